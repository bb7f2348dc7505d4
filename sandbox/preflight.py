"""What `rolltap rollouts` checks once before its first rollout: the gateway answers, takes the
admin key, and has a replica that serves the model the harness will ask for. Each failure is one
sentence that says what to do, instead of the same connection error once per rollout.
"""

from __future__ import annotations

import aiohttp
import msgspec

# Long enough for a busy gateway, short enough that a wrong address fails within seconds.
TIMEOUT_S = 5.0


class PreflightError(RuntimeError):
    """The runner cannot start against this gateway; the message says why and what to do."""


class _Models(msgspec.Struct):
    models: list[str]
    upstreams: list[str] = []


def model_problem(gateway: str, model: str, served: list[str], upstreams: list[str],
                  provider_prefix: bool = False) -> str | None:
    """Why `model` cannot be asked for through `gateway`, or None when it can (pure). With
    `provider_prefix` (Harbor agents: `openai/NAME`, which the agent strips), the name after
    the first `/` will do too."""
    if model in served or (provider_prefix and model.partition("/")[2] in served):
        return None
    if not served:
        where = ", ".join(upstreams) or "none configured"
        return (f"no vLLM replica behind the gateway at {gateway} answers (replicas: {where}): "
                "start vLLM (rolltap serve-model) or point the gateway at it (--upstream)")
    return (f"the engine behind the gateway at {gateway} does not serve model {model!r} (it "
            f"serves {', '.join(map(repr, served))}): give --model one of those")


async def check_gateway(url: str, admin_key: str, model: str,
                        timeout_s: float = TIMEOUT_S, provider_prefix: bool = False) -> None:
    """Raise PreflightError unless the gateway at `url` is ready for rollouts of `model`."""
    root = url.rstrip("/")
    headers = {"Authorization": f"Bearer {admin_key}"}
    try:
        async with aiohttp.ClientSession(
            headers=headers, timeout=aiohttp.ClientTimeout(total=timeout_s)
        ) as http, http.get(f"{root}/admin/models") as response:
            body = await response.read()
            status = response.status
    except (TimeoutError, aiohttp.ClientError, OSError) as exc:
        reason = str(exc) or type(exc).__name__
        raise PreflightError(f"cannot reach the gateway at {root} ({reason}): start it "
                             "(rolltap gateway) or fix --gateway") from None
    if status in (401, 403):
        raise PreflightError(f"the gateway at {root} refused the admin key: give the key it "
                             "was started with (--admin-key or ROLLTAP_ADMIN_KEY)")
    try:
        listing = msgspec.json.decode(body, type=_Models) if status == 200 else None
    except (msgspec.DecodeError, msgspec.ValidationError):
        listing = None
    if listing is None:
        raise PreflightError(f"{root} answered GET /admin/models with HTTP {status}, not as a "
                             "rolltap gateway does: check --gateway (the gateway's root URL)")
    problem = model_problem(root, model, listing.models, listing.upstreams, provider_prefix)
    if problem:
        raise PreflightError(problem)
