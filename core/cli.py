"""The `rolltap` command: one subcommand per entry point in the `rolltap.commands` group.

Subcommands live with the package they belong to (`rolltap gateway` in gateway/,
`rolltap bridge` in trainer_bridge/, `rolltap rollouts` in sandbox/). Discovering them through
entry points keeps the gateway free of imports from the other packages, and keeps `--help` fast:
a subcommand module's `register(subparsers)` only declares flags; heavy imports happen when the
command runs.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from importlib.metadata import entry_points

DESCRIPTION = """rolltap: a recording OpenAI/Anthropic gateway in front of vLLM that turns any
coding-agent harness into an RL training environment.

Typical loop on one machine:
  rolltap tiny-model models/tiny                    # build a tiny model offline (tests, demo)
  rolltap serve-model models/tiny --port 8000       # vLLM with the flags rolltap needs
  rolltap gateway --upstream http://127.0.0.1:8000 --port 9000 --admin-key SECRET
Run `rolltap COMMAND --help` for the options of each command."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rolltap",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for ep in sorted(entry_points(group="rolltap.commands"), key=lambda e: e.name):
        try:
            module = importlib.import_module(ep.value)
        except ImportError as exc:
            # An optional extra is missing (e.g. `train` for the bridge): keep the other commands.
            subparsers.add_parser(ep.name, help=f"unavailable: {exc}; install the extra it needs")
            continue
        module.register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    func = getattr(args, "func", None)
    if func is None:
        parser.error(f"`{args.command}` cannot run here; see the help line for what to install")
    return int(func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
