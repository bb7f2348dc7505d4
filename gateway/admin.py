"""The admin API: create and finish rollouts, read their records, set the policy version.

Every route needs the admin key; a rollout key is refused (invariant 6)."""

from __future__ import annotations

import math
import uuid
from typing import Annotated

import asyncpg
import msgspec
from aiohttp import web

from core.merge.values import SideCalls
from core.store import calls as calls_store
from core.store import rollouts as rollouts_store
from core.store import traces as traces_store
from core.store import values
from core.store.ledger import rollout_reason
from gateway.admin_http import admin_app, decode_body, json_response
from gateway.app_keys import CONFIG, MEMORY, POLICY, POOL, ROLLOUT_KEYS
from gateway.auth import hash_key, new_rollout_key
from gateway.call_request import sampling_policy
from gateway.continuation.splice import counts as continuation_counts
from gateway.finalize import merge_rollout
from gateway.protocols.errors import GatewayError

routes = web.RouteTableDef()


# Ranges Postgres holds (a deadline within a century; `policy.version` is an integer column).
_Timeout = Annotated[float, msgspec.Meta(gt=0, le=3.2e9)]
_Version = Annotated[int, msgspec.Meta(ge=0, le=2**31 - 1)]


class NewRollout(msgspec.Struct, forbid_unknown_fields=True):
    task_id: str | None = None
    group_id: str | None = None
    metadata: dict = {}
    timeout_s: _Timeout | None = None
    # Which toolless calls are a harness's side calls, not trained (core/merge/).
    side_calls: SideCalls = "auto"


class Finish(msgspec.Struct, forbid_unknown_fields=True):
    reward: float | None
    status: str = "finished"
    metrics: dict | None = None


class Policy(msgspec.Struct, forbid_unknown_fields=True):
    version: _Version


def _storable(**fields) -> None:
    """400 naming the field whose value Postgres could not store (NUL, depth, range)."""
    for name, value in fields.items():
        bad = values.problem(value, name)
        if bad:
            raise GatewayError(400, f"invalid request: {bad}", param=name)


def _rollout_id(request: web.Request) -> uuid.UUID:
    try:
        return uuid.UUID(request.match_info["rollout_id"])
    except ValueError:
        raise GatewayError(404, "no such rollout", "not_found_error") from None


@routes.post("/admin/rollouts")
async def create_rollout(request: web.Request) -> web.Response:
    app = admin_app(request)
    spec = decode_body(await request.read(), NewRollout)
    _storable(task_id=spec.task_id, group_id=spec.group_id, metadata=spec.metadata)
    rollout_id = uuid.uuid4()
    key = new_rollout_key()
    async with app[POOL].acquire() as conn:
        await rollouts_store.create(
            conn,
            rollout_id,
            hash_key(key),
            spec.task_id,
            spec.group_id,
            spec.metadata,
            spec.timeout_s if spec.timeout_s is not None else app[CONFIG].rollout_timeout_s,
            spec.side_calls,
        )
    base = app[CONFIG].public_url
    return json_response(
        {
            "rollout_id": str(rollout_id),
            "api_key": key,
            "openai_base_url": base + "/v1",
            "anthropic_base_url": base,
        },
        status=201,
    )


async def _summary(pool: asyncpg.Pool, rollout_id: uuid.UUID) -> dict:
    async with pool.acquire() as conn:
        row = await rollouts_store.get(conn, rollout_id)
        if row is None:
            raise GatewayError(404, f"no rollout {rollout_id}", "not_found_error")
        calls = await calls_store.rollout_calls(
            conn, rollout_id, with_tokens=False, with_bodies=False
        )
    return {
        **rollouts_store.identity(row),
        "metadata": row["metadata"],
        "metrics": row["metrics"],
        "created_at": row["created_at"].isoformat(),
        "finished_at": row["finished_at"] and row["finished_at"].isoformat(),
        "merge": row["merge_stats"]
        and {"stats": row["merge_stats"], "options": row["merge_options"]},
        "merge_status": "merged"
        if row["merged_at"]
        else "merge_failed"
        if row["merge_error"]
        else "pending",
        "merge_error": row["merge_error"],
        "side_calls": row["side_calls"],
        # What the bridge gave the trainer once it consumed the rollout, else what the merge left.
        "ledger": row["ledger"],
        "trained_nothing": rollout_reason(row),
        "continuation": continuation_counts(c["continuation"] for c in calls),
        "calls": calls,
    }


@routes.post("/admin/rollouts/{rollout_id}/finish")
async def finish_rollout(request: web.Request) -> web.Response:
    app = admin_app(request)
    rollout_id = _rollout_id(request)
    spec = decode_body(await request.read(), Finish)
    if spec.status not in ("finished", "failed", "timeout"):
        raise GatewayError(400, "status must be finished, failed or timeout", param="status")
    if spec.reward is not None and not math.isfinite(spec.reward):
        raise GatewayError(400, "reward must be a finite number or null", param="reward")
    metrics = spec.metrics
    if metrics is not None:
        # The metrics carry the harness's own output (stderr tails), which may hold any byte:
        # NULs are removed, not refused, and the removal is recorded with them.
        metrics, removed = values.without_nul(metrics)
        if removed:
            metrics["rolltap_removed_nul_characters"] = removed
        _storable(metrics=metrics)
    async with app[POOL].acquire() as conn:
        ended = await rollouts_store.finish(conn, rollout_id, spec.status, spec.reward, metrics)
        # A retried finish (the first one's merge failed or its gateway died) merges too.
        row = await rollouts_store.get(conn, rollout_id)
    app[ROLLOUT_KEYS].forget(rollout_id)
    app[MEMORY].forget(rollout_id)
    if row is not None and row["status"] != "running" and (ended or row["merged_at"] is None):
        await merge_rollout(app[POOL], rollout_id, app[CONFIG].merge_options)
    summary = await _summary(app[POOL], rollout_id)
    if not ended and (summary["status"], summary["reward"]) != (spec.status, spec.reward):
        raise GatewayError(
            409,
            f"rollout already ended as {summary['status']} with reward "
            f"{summary['reward']}; it cannot be finished again differently",
            code="rollout_ended",
        )
    return json_response(summary)


@routes.get("/admin/rollouts/{rollout_id}")
async def get_rollout(request: web.Request) -> web.Response:
    app = admin_app(request)
    return json_response(await _summary(app[POOL], _rollout_id(request)))


@routes.get("/admin/rollouts/{rollout_id}/calls")
async def get_calls(request: web.Request) -> web.Response:
    app = admin_app(request)
    rollout_id = _rollout_id(request)
    with_bodies = request.query.get("bodies", "1") not in ("0", "false")
    async with app[POOL].acquire() as conn:
        if await rollouts_store.get(conn, rollout_id) is None:
            raise GatewayError(404, f"no rollout {rollout_id}", "not_found_error")
        calls = await calls_store.rollout_calls(
            conn, rollout_id, with_tokens=True, with_bodies=with_bodies
        )
    return json_response({"rollout_id": str(rollout_id), "calls": calls})


@routes.post("/admin/policy")
async def set_policy(request: web.Request) -> web.Response:
    app = admin_app(request)
    spec = decode_body(await request.read(), Policy)
    async with app[POOL].acquire() as conn:
        await rollouts_store.set_policy_version(conn, spec.version)
    app[POLICY].value = spec.version
    return json_response({"version": spec.version})


@routes.get("/admin/policy")
async def get_policy(request: web.Request) -> web.Response:
    app = admin_app(request)
    return json_response(
        {"version": app[POLICY].value, "sampling": sampling_policy(app[CONFIG].temperature)}
    )


@routes.get("/admin/backlog")
async def get_backlog(request: web.Request) -> web.Response:
    """How far a runner's run is ahead of training, so it can wait for the trainer instead of
    producing samples that will be stale when they are trained (`rolltap rollouts
    --max-backlog`)."""
    app = admin_app(request)
    run_id = request.query.get("run_id", "")
    if not run_id or "\x00" in run_id:
        raise GatewayError(400, "give the run: GET /admin/backlog?run_id=RUN", param="run_id")
    async with app[POOL].acquire() as conn:
        running, waiting = await rollouts_store.backlog(conn, run_id)
    return json_response({"run_id": run_id, "running": running, "waiting": waiting})


@routes.get("/admin/rollouts/{rollout_id}/traces")
async def get_traces(request: web.Request) -> web.Response:
    app = admin_app(request)
    rollout_id = _rollout_id(request)
    async with app[POOL].acquire() as conn:
        row = await rollouts_store.get(conn, rollout_id)
        if row is None:
            raise GatewayError(404, f"no rollout {rollout_id}", "not_found_error")
        if row["merged_at"] is None:
            raise GatewayError(
                409,
                f"rollout {rollout_id} is {row['status']} and not merged yet; traces "
                "exist once it is finished (POST /admin/rollouts/{id}/finish)",
                code="not_merged",
            )
        traces = await traces_store.fetch(conn, rollout_id)
    return json_response(
        {
            "rollout_id": str(rollout_id),
            "sequences": [t.to_dict() for t in traces],
            "stats": row["merge_stats"],
            "options": row["merge_options"],
        }
    )


@routes.get("/admin/metrics")
async def get_metrics(request: web.Request) -> web.Response:
    """Merge statistics per harness, for dashboards: how often each harness drifts."""
    app = admin_app(request)
    async with app[POOL].acquire() as conn:
        rows = await traces_store.harness_metrics(conn)
    return json_response(
        {"harnesses": [dict(r) for r in rows], "policy_version": app[POLICY].value}
    )
