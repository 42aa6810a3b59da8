"""The ``rollart`` command: one subcommand per process role, each calling that role's ``main``.

Modules are imported only for the chosen subcommand, so ``rollart serve-reward`` never imports
torch or vLLM.
"""

from __future__ import annotations

import importlib
import sys

#: subcommand -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "run": ("rollart.launcher", "run a scenario end to end (all processes, locally)"),
    "report": ("rollart.launcher.report", "plot a run folder's metrics (PNGs + one HTML page)"),
    "validate": ("rollart.launcher.validate", "check a scenario and print it resolved"),
    "plan": ("rollart.planner.command", "choose a scenario's layout with the simulator"),
    "export": ("rollart.trainer.export",
               "write a run's checkpoint as a Hugging Face folder (transformers, vLLM)"),
    "serve-inference": ("rollart.inference.worker", "serve a vLLM inference worker over ZMQ"),
    "serve-env": ("rollart.envhost.host", "serve environment sessions over ZMQ"),
    "serve-reward": ("rollart.reward.server", "serve reward functions over HTTP"),
    "serve-trainer": ("rollart.trainer.service", "serve the trainer over ZMQ"),
    "keygen": ("rollart.transport.security", "make a run key file for services started by hand"),
}


def _usage() -> str:
    lines = ["usage: rollart COMMAND [ARGS...]", "", "commands:"]
    lines += [f"  {name:<16} {help_}" for name, (_, help_) in COMMANDS.items()]
    lines.append("\n`rollart COMMAND --help` shows a command's options.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:  # a usage error, as argparse treats a missing required argument
        print(_usage(), file=sys.stderr)
        return 2
    if argv[0] in ("-h", "--help"):
        print(_usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        from rollart.config.validate import suggest

        print(f"rollart: unknown command {name!r}{suggest(name, list(COMMANDS))}\n\n{_usage()}",
              file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[name][0])
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
