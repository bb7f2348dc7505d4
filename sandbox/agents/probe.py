"""A `python`-preset agent that reports what a sandboxed agent can reach: run by
`rolltap rollouts --probe` (or as any agent, `--agent sandbox.agents.probe:run`). It prints one
JSON object of checks, each `[allowed, detail]`; `allowed` true means the agent could do it.

The prompt is JSON: `ports` (TCP ports on 127.0.0.1 to try, e.g. Postgres and vLLM) and
`paths` (host paths to try to read, e.g. the task file).
"""

from __future__ import annotations

import json
import os
import resource
import socket
import urllib.error
import urllib.request


def _try(call) -> list:
    try:
        return [True, call()]
    except OSError as exc:
        return [False, exc.strerror or str(exc)]
    except ValueError as exc:
        return [False, str(exc)]


def _connect(host: str, port: int) -> str:
    with socket.create_connection((host, port), timeout=3):
        return "connected"


def _gateway(url: str, key: str) -> str:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return f"HTTP {response.status}"
    except urllib.error.HTTPError as exc:
        raise PermissionError(13, f"HTTP {exc.code}") from None
    except urllib.error.URLError as exc:
        raise OSError(str(exc.reason)) from None


def _foreign_environ() -> str:
    """Processes whose environment can be read and holds a variable this agent's does not
    (the sandbox's own helpers share its environment)."""
    mine = set(os.environ)
    foreign = []
    for pid in (int(p) for p in os.listdir("/proc") if p.isdigit()):
        try:
            with open(f"/proc/{pid}/environ", "rb") as fh:
                names = {item.split(b"=", 1)[0].decode(errors="replace")
                         for item in fh.read().split(b"\0") if item}
        except OSError:
            continue
        if names - mine:
            foreign.append(pid)
    if not foreign:
        raise PermissionError(13, "none readable besides the sandbox's own")
    return f"{len(foreign)} processes, e.g. pids {foreign[:5]}"


def _raise_nproc() -> str:
    soft, hard = resource.getrlimit(resource.RLIMIT_NPROC)
    if hard == resource.RLIM_INFINITY:
        return "no limit to raise"
    resource.setrlimit(resource.RLIMIT_NPROC, (hard + 1, hard + 1))
    return f"raised to {hard + 1}"


def run(*, prompt: str, base_url: str, api_key: str, model: str, workdir: str) -> None:
    spec = json.loads(prompt) if prompt.strip().startswith("{") else {}
    root = base_url.removesuffix("/v1")
    checks = {
        "uid": [True, os.getuid()],
        "processes visible": [True, len([p for p in os.listdir("/proc") if p.isdigit()])],
        "read other processes' environment": _try(_foreign_environ),
        "write /sys/fs/cgroup": _try(lambda: open("/sys/fs/cgroup/cgroup.procs", "w").close()),
        "raise RLIMIT_NPROC": _try(_raise_nproc),
        "internet (1.1.1.1:80)": _try(lambda: _connect("1.1.1.1", 80)),
        "gateway model list (rollout key)": _try(lambda: _gateway(f"{base_url}/models",
                                                                  api_key)),
        "gateway admin API (rollout key)": _try(lambda: _gateway(f"{root}/admin/policy",
                                                                 api_key)),
    }
    for port in spec.get("ports", []):
        checks[f"127.0.0.1:{port}"] = _try(lambda port=port: _connect("127.0.0.1", port))
    for path in spec.get("paths", []):
        checks[f"read {path}"] = _try(lambda path=path: f"{len(open(path, 'rb').read())} bytes")
    print(json.dumps(checks))
