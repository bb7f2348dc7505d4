"""`rolltap rollouts --probe`: what a sandboxed agent can reach here (apart from sandbox/cli.py,
the plain run)."""

from __future__ import annotations

import argparse
import os
import sys


async def run_probe(args: argparse.Namespace, admin_key: str, backend) -> int:
    """`rolltap rollouts --probe`: one sandbox whose agent reports what it can reach."""
    import json

    from sandbox.backends.base import SandboxRequest
    from sandbox.gateway_client import AdminClient, GatewayError
    from sandbox.presets import Harness
    from sandbox.tasks import Task, Verifier

    paths = [os.path.abspath(args.tasks)] if args.tasks else []
    spec = {"ports": sorted({5432, *args.probe_port}), "paths": paths}
    task = Task(id="probe", prompt=json.dumps(spec), files={},
                verifier=Verifier("true", "binary", {}), source_paths=tuple(paths))
    harness = Harness(preset="python", model=args.model, agent="sandbox.agents.probe:run")
    try:
        async with AdminClient(args.gateway, admin_key) as admin:
            access = await admin.create_rollout(task_id="probe", group_id="probe",
                                                metadata={"probe": True}, timeout_s=600)
            try:
                result = await backend.run(SandboxRequest(task, harness, access))
            finally:
                await admin.finish_rollout(access.rollout_id, reward=None, status="failed",
                                           metrics={"probe": True})
    except GatewayError as exc:
        print(f"rolltap rollouts --probe: {exc}", file=sys.stderr)
        return 1
    lines = (result.agent.stdout.strip().splitlines() if result.agent else []) or [""]
    try:
        checks = json.loads(lines[-1])
    except ValueError:
        print(f"the probe failed: {result.reward_detail}\n{result.agent and result.agent.stderr}",
              file=sys.stderr)
        return 1
    print(f"sandbox isolation: {result.isolation}")
    for name, (allowed, detail) in checks.items():
        verdict = "" if name in ("uid", "processes visible") else (
            "ALLOWED" if allowed else "refused")
        print(f"  {verdict:<8} {name}: {str(detail)[:100]}")
    for warning in result.warnings:
        print(f"  warning: {warning}")
    return 0
