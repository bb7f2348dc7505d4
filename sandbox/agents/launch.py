"""Entry point of the `python` preset inside a sandbox:

    python -I -m sandbox.agents.launch --agent pkg.mod:func --workdir W --model M \
        --protocol openai --base-url URL [--path DIR ...] --prompt=TEXT

Imports the agent function and calls it with keyword arguments `prompt`, `base_url`,
`api_key`, `model`, `workdir` (and `protocol`). The key comes from the environment
(ROLLTAP_API_KEY), not argv, where other users of the machine could read it. A coroutine
function is run to completion. An exception exits 1 with its traceback on stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import inspect
import os
import sys


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m sandbox.agents.launch")
    parser.add_argument("--agent", required=True, help="module:function")
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--protocol", choices=["openai", "anthropic"], default="openai")
    parser.add_argument("--base-url", required=True)
    parser.add_argument("--path", action="append", default=[], help="add to sys.path")
    parser.add_argument("--prompt", required=True)
    return parser.parse_args(argv)


def load(target: str):
    module_name, _, func_name = target.partition(":")
    return getattr(importlib.import_module(module_name), func_name)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    sys.path[:0] = args.path
    func = load(args.agent)
    kwargs = {
        "prompt": args.prompt,
        "base_url": args.base_url,
        "api_key": os.environ.get("ROLLTAP_API_KEY", ""),
        "model": args.model,
        "workdir": args.workdir,
    }
    # `protocol` only for agents that ask for it: most speak just one.
    if "protocol" in inspect.signature(func).parameters:
        kwargs["protocol"] = args.protocol
    result = func(**kwargs)
    if inspect.iscoroutine(result):
        asyncio.run(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
