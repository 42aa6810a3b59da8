"""DCP checkpoint round trip: model, optimizer, version, RNG; atomic `latest` marker."""

from __future__ import annotations

import random

import numpy as np
import torch

from rollart.trainer.checkpoint import (
    latest_checkpoint,
    load_trainer,
    mark_complete,
    save_trainer,
    step_dir,
)


def _model_and_opt(seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    return model, torch.optim.AdamW(model.parameters(), lr=0.01)


def _train(model, opt):
    loss = model(torch.ones(3, 4)).pow(2).sum()
    loss.backward()
    opt.step()
    opt.zero_grad()


def test_save_then_load_restores_everything(tmp_path):
    model, opt = _model_and_opt(0)
    _train(model, opt)
    torch.manual_seed(123)
    random.seed(5)
    np.random.seed(7)
    assert latest_checkpoint(tmp_path) is None
    save_trainer(step_dir(tmp_path, 3), model, opt, version=3, step=3)
    mark_complete(tmp_path, 3)
    expected = (torch.rand(2), random.random(), np.random.rand())
    _train(model, opt)  # the saved state must not see this

    model2, opt2 = _model_and_opt(1)
    path = latest_checkpoint(tmp_path)
    assert path == step_dir(tmp_path, 3)
    state = load_trainer(path, model2, opt2)
    assert (state.version, state.step) == (3, 3)
    assert torch.equal(torch.rand(2), expected[0])
    assert random.random() == expected[1] and np.random.rand() == expected[2]
    # Same weights and optimizer moments as at save time: one more identical step agrees.
    model3, opt3 = _model_and_opt(0)
    _train(model3, opt3)
    _train(model3, opt3)
    _train(model2, opt2)
    for a, b in zip(model2.parameters(), model3.parameters(), strict=True):
        torch.testing.assert_close(a, b)


def test_incomplete_checkpoint_is_not_selected(tmp_path):
    model, opt = _model_and_opt(0)
    save_trainer(step_dir(tmp_path, 1), model, opt, version=1, step=1)
    mark_complete(tmp_path, 1)
    save_trainer(step_dir(tmp_path, 2), model, opt, version=2, step=2)  # killed before sealing
    assert latest_checkpoint(tmp_path) == step_dir(tmp_path, 1)
