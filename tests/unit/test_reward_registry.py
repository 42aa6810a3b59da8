"""Reward function registry: decorator, registration by object / module / import path."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest

from rollart.reward.registry import RewardRegistry, marked_spec, reward_function
from rollart.reward.server import build_registry


def plain(prompt, response, reference, metadata):
    """Plain sync function.

    Second line is not part of the description.
    """
    return 1.0


async def coro(prompt, response, reference, metadata):
    return 0.5


USER_MODULE = textwrap.dedent(
    """
    from rollart.reward.registry import reward_function

    @reward_function("fake_len", timeout_s=2.0)
    def length(prompt, response, reference, metadata):
        return float(len(response))

    @reward_function("fake_async")
    async def is_yes(prompt, response, reference, metadata):
        return 1.0 if response == "yes" else 0.0

    def unmarked(prompt, response, reference, metadata):
        return 0.0
    """
)


@pytest.fixture
def user_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    name = f"fake_user_rewards_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text(USER_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    sys.modules.pop(name, None)


def test_decorator_marks_without_registering_anywhere() -> None:
    @reward_function("marked", executor="process", timeout_s=3.0)
    def fn(prompt, response, reference, metadata):
        return 1.0

    assert fn(None, None, None, None) == 1.0  # returned unchanged
    spec = marked_spec(fn)
    assert (spec.name, spec.executor, spec.timeout_s, spec.is_async) == (
        "marked",
        "process",
        3.0,
        False,
    )
    assert len(RewardRegistry()) == 0


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"name": "has space"}, ValueError, "invalid reward function name"),
        ({"name": "a/b"}, ValueError, "invalid reward function name"),
        ({"name": ""}, ValueError, "invalid reward function name"),
        ({"name": "ok", "executor": "gpu"}, ValueError, "executor"),
        ({"name": "ok", "timeout_s": 0}, ValueError, "timeout_s"),
    ],
)
def test_decorator_rejects_bad_options(kwargs: dict, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        reward_function(**kwargs)(plain)


def test_signature_is_checked() -> None:
    def two_args(prompt, response):
        return 1.0

    with pytest.raises(TypeError, match="must accept"):
        reward_function("two")(two_args)
    with pytest.raises(TypeError, match="must accept"):
        RewardRegistry().register(two_args)


def test_register_defaults_and_async_detection() -> None:
    registry = RewardRegistry()
    spec = registry.register(plain)
    assert (spec.name, spec.executor, spec.is_async, spec.timeout_s) == (
        "plain",
        "thread",
        False,
        None,
    )
    assert spec.description == "Plain sync function."
    assert registry.register(coro, "other").is_async
    assert registry.names() == ["other", "plain"]
    assert "plain" in registry and "nope" not in registry


def test_duplicate_names_are_rejected() -> None:
    registry = RewardRegistry()
    registry.register(plain)
    with pytest.raises(ValueError, match="already registered"):
        registry.register(coro, "plain")


def test_get_unknown_names_the_known_functions() -> None:
    registry = RewardRegistry()
    registry.register(plain)
    with pytest.raises(KeyError, match=r"unknown reward function 'x'; known: \['plain'\]"):
        registry.get("x")


def test_register_import_path_function(user_module: str) -> None:
    registry = RewardRegistry()
    [spec] = registry.register_import_path(f"{user_module}:length")
    assert (spec.name, spec.timeout_s) == ("fake_len", 2.0)  # from the mark
    [renamed] = registry.register_import_path(f"{user_module}:length", name="len2")
    assert renamed.name == "len2"
    [unmarked] = registry.register_import_path(f"{user_module}:unmarked")
    assert unmarked.name == "unmarked"


def test_register_import_path_module_takes_every_marked_function(user_module: str) -> None:
    registry = RewardRegistry()
    specs = registry.register_import_path(user_module)
    assert sorted(s.name for s in specs) == ["fake_async", "fake_len"]
    assert registry.get("fake_async").is_async


@pytest.mark.parametrize(
    ("path", "error", "match"),
    [
        ("", ValueError, "invalid import path"),
        ("pkg.mod:", ValueError, "invalid import path"),
        ("no_such_module_xyz:fn", ImportError, "cannot import module 'no_such_module_xyz'"),
        ("json:no_such_fn", ValueError, "has no attribute 'no_such_fn'"),
        ("json", ValueError, "no function marked"),
    ],
)
def test_register_import_path_errors(path: str, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        RewardRegistry().register_import_path(path)


def test_module_path_with_name_is_rejected(user_module: str) -> None:
    with pytest.raises(ValueError, match="names a module"):
        RewardRegistry().register_import_path(user_module, name="x")


def test_build_registry_has_builtins_and_named_user_functions(user_module: str) -> None:
    registry = build_registry([f"mine={user_module}:length", user_module])
    assert registry.names() == sorted(
        ["boxed_format", "env_return", "env_success", "exact_match", "math", "reasoning_gym",
         "mine", "fake_len", "fake_async"]
    )
    assert registry.get("mine").fn is registry.get("fake_len").fn
