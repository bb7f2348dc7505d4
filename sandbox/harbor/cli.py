"""`rolltap rollouts PATH --harness harbor:AGENT`: the flags and the backend they make."""

from __future__ import annotations

import argparse
import json
from typing import Any

PREFIX = "harbor:"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group(
        "Harbor (--harness harbor:AGENT; TASKS is a Harbor task directory or a directory of "
        "them)")
    g.add_argument("--environment", default="bwrap", metavar="TYPE",
                   help="where each trial runs: bwrap (default; rolltap's bubblewrap sandbox, "
                        "one persistent sandbox per trial on the host's system directories), "
                        "any Harbor environment type (podman, docker, daytona, modal, e2b, "
                        "gke, ...) or module:Class")
    g.add_argument("--environment-kwarg", action="append", default=[], metavar="K=V",
                   help="keyword argument for the environment (repeatable; V is JSON if it "
                        "parses, else a string)")
    g.add_argument("--agent-kwarg", action="append", default=[], metavar="K=V",
                   help="keyword argument for the Harbor agent (repeatable; as above)")
    g.add_argument("--agent-env", action="append", default=[], metavar="K=V",
                   help="environment variable for the agent's commands only (repeatable), "
                        "e.g. CLAUDE_CODE_MAX_OUTPUT_TOKENS=1024; the rollout's key and base "
                        "URLs cannot be overridden")
    g.add_argument("--reward-key", default="reward", metavar="KEY",
                   help="which key of the verifier's reward.json is the reward (default "
                        "reward); the other keys go to the rollout's metrics")
    g.add_argument("--public-url", metavar="URL",
                   help="the gateway's URL as a non-bwrap environment reaches it (a remote "
                        "sandbox needs a routable one; default --gateway)")
    g.add_argument("--trials-dir", metavar="DIR",
                   help="where Harbor writes each trial's logs (default: a new directory in "
                        "the temp dir, printed at the end)")


def agent_name(harness: str | None) -> str | None:
    """The Harbor agent of `--harness harbor:AGENT`, else None."""
    if harness is None or not harness.startswith(PREFIX):
        return None
    name = harness[len(PREFIX):]
    if not name:
        raise ValueError("give the agent after harbor:, e.g. harbor:oracle, harbor:claude-code "
                         "or harbor:my.module:MyAgent")
    return name


def parse_kwargs(pairs: list[str], flag: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"{flag} {pair!r}: write it as KEY=VALUE")
        try:
            out[key] = json.loads(value)
        except ValueError:
            out[key] = value
    return out


def make_backend(args: argparse.Namespace, agent: str, pools=None):
    from sandbox.harbor.backend import HarborBackend

    backend = HarborBackend(
        agent, model=None if args.model == "default" else args.model, gateway=args.gateway,
        public_url=args.public_url, environment=args.environment,
        environment_kwargs=parse_kwargs(args.environment_kwarg, "--environment-kwarg"),
        agent_kwargs=parse_kwargs(args.agent_kwarg, "--agent-kwarg"),
        extra_env={k: str(v) for k, v in parse_kwargs(args.agent_env, "--agent-env").items()},
        reward_key=args.reward_key, trials_dir=args.trials_dir, pools=pools)
    backend.check()
    return backend
