"""`GatewayConfig`: every knob of `rolltap gateway` declared once, as a dataclass whose fields
carry their flag's help; its flags and `ROLLTAP_*` variables are generated from the fields
(core/knobs.py says how they are named). Precedence: flag, then variable, then default."""

from __future__ import annotations

import argparse
import dataclasses
import secrets
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from core import knobs
from core.knobs import knob
from core.merge.values import MergeOptions
from core.paths import default_data_dir


def _opt(help: str, metavar: str | None = None, **kwargs: Any) -> dict:
    """A gateway flag: its help shows its default, None included, unless told otherwise."""
    return knob(help, metavar, **{"show_default": True, **kwargs})


def _none_if_zero(value: float) -> float | None:
    return value or None


def _mib_to_bytes(mib: float) -> int:
    return int(mib * 1024 * 1024)


def _admin_key(key: str | None) -> str:
    return key or secrets.token_urlsafe(24)


_TRAIN_WHAT = {
    "constrained": "calls sampled under a grammar, forced tool or banned/forced tokens",
    "auxiliary": "side calls: toolless sequences beside tool-offering calls (titles, "
                 "summaries), or in rollouts created with side_calls toolless",
    "abandoned": "retries the harness did not continue",
    "aborted": "calls the client abandoned mid-stream or that failed",
}


def _train(what: str) -> Any:
    return field(default=False, metadata=_opt(
        f"merge: also train {_TRAIN_WHAT[what]} (excluded by default)"))


@dataclass
class GatewayConfig:
    """Configuration of the gateway (see `rolltap gateway --help`)."""

    upstreams: list[str] = field(default_factory=list, metadata=_opt(
        "vLLM server root, e.g. http://127.0.0.1:8000; repeat for several replicas (env "
        "ROLLTAP_UPSTREAMS, comma separated). A rollout stays on one replica while it is "
        "healthy; more can be added at run time (POST /admin/upstreams).", "URL",
        flag="--upstream", env="UPSTREAMS", env_in_help=True, action="append"))
    host: str = field(default="127.0.0.1", metadata=_opt("bind address"))
    port: int = field(default=9000, metadata=_opt("bind port", type=int))
    database_url: str | None = field(default=None, metadata=_opt(
        "Postgres DSN. Without it an embedded Postgres is started in --data-dir", "DSN",
        show_default=False))
    data_dir: Path = field(default_factory=default_data_dir, metadata=_opt(
        "where the embedded Postgres keeps its data", type=Path))
    admin_key: str = field(default="", metadata=_opt(
        "key for /admin routes. If unset, one is generated and printed", "KEY",
        flag_default=None, to_field=_admin_key, show_default=False))
    public_url: str = field(default="", metadata=_opt(
        "base URL sandboxes reach the gateway at, handed out by POST /admin/rollouts; default "
        "http://HOST:PORT", "URL", show_default=False))
    # Confined sandboxes on this machine reach the gateway only through this socket (mode
    # 0666), bound into their network namespace.
    unix_socket: Path | None = field(default=None, metadata=_opt(
        "also listen on this Unix socket; `rolltap rollouts --gateway-socket PATH` binds it "
        "into confined sandboxes as their only way out", "PATH", type=Path, show_default=False))
    # The training policy: every sampled token is drawn at this temperature with no truncation,
    # so the recorded logprobs are the ones the trainer's ratio is computed against.
    temperature: float = field(default=1.0, metadata=_opt(
        "sampling temperature of the training policy; top_p 1, no top_k/min_p/penalties",
        type=float))
    max_body_bytes: int = field(default=32 * 1024 * 1024, metadata=_opt(
        "largest request body accepted, in MiB", "MIB", type=float, flag="--max-body-mb",
        flag_default=32.0, to_field=_mib_to_bytes))
    upstream_timeout_s: float = field(default=600.0, metadata=_opt(
        "seconds a single upstream call may take", "SECONDS", type=float))
    default_max_tokens: int | None = field(default=None, metadata=_opt(
        "output cap for requests that set none (Codex sends none); 0: the engine's context "
        "limit. Codex exits 1 when this cap binds (an incomplete response): leave it unset for "
        "Codex rollouts", "N", type=int, flag_default=0, to_field=_none_if_zero))
    rollout_timeout_s: float | None = field(default=None, metadata=_opt(
        "default deadline of a rollout that names none, in seconds; past it the rollout ends "
        "as timeout; 0: none", "SECONDS", type=float, flag_default=0.0,
        to_field=_none_if_zero))
    # exact: a request that continues an earlier call of its rollout gets that call's prompt and
    # sampled ids back as its prompt prefix; render: the engine re-renders every conversation.
    continuation: str = field(default="exact", metadata=_opt(
        "how a request that continues an earlier call is prompted: `exact` hands the engine "
        "the tokens it sampled then (the rollout stays one training sequence), `render` lets "
        "it re-render the conversation (drift forks the sequence)",
        choices=("exact", "render")))
    local_template: Path | None = field(default=None, metadata=_opt(
        "the served model's directory (tokenizer.json, tokenizer_config.json): render exact "
        "continuations in the gateway with its chat template and tokenizer, which saves the "
        "engine round trip; used only where a self-check against the engine shows the same "
        "ids, and cross-checked on a sample of calls", "MODEL_DIR", type=Path,
        show_default=False))
    tokenizer: Path | None = field(default=None, metadata=_opt(
        "the served model's directory; the trace viewer (/ui) shows token text decoded with "
        "its tokenizer.json; default: --local-template", "MODEL_DIR", type=Path,
        show_default=False))
    record_bodies: bool = field(default=True, metadata=_opt(
        "do not keep compressed request/response bodies (token records are always kept)"))
    access_log: bool = field(default=True, metadata=_opt(
        "do not log one line per HTTP call (method, route, status, latency, rollout, request "
        "id)"))
    # A database that is down or frozen fails calls within about these bounds (503), instead of
    # holding them; the gateway recovers on its own when it answers again. Not shorter: a
    # commit fails calls whose tokens are already generated, and a busy server's commits took
    # over 2 s in the gateway bench at c=64 (load average 16 on 2 cores).
    db_acquire_timeout_s: float = field(default=5.0, metadata=_opt(
        "longest wait for a database connection (also connecting) before a call fails with "
        "503", "SECONDS", type=float))
    db_command_timeout_s: float = field(default=10.0, metadata=_opt(
        "longest a database statement (a commit of call records included) may take before the "
        "calls waiting on it fail with 503", "SECONDS", type=float))
    # Past it new calls get 503 (529 on the Anthropic API) with Retry-After rather than
    # queueing without bound.
    max_pending_records: int = field(default=4096, metadata=_opt(
        "call records that may wait for their commit; beyond that new calls are turned away "
        "with 503/529 and Retry-After", "N", type=int))
    # See rollout_memory.RecentCalls; past it the least recently used rollouts are read back from
    # the database when they call again.
    recent_calls_mib: int = field(default=512, metadata=_opt(
        "memory for running rollouts' latest calls (ids, bodies, continuation keys); past it "
        "the least recently used are read back from the database", "MIB", type=int))
    train_constrained: bool = _train("constrained")
    train_auxiliary: bool = _train("auxiliary")
    train_abandoned: bool = _train("abandoned")
    train_aborted: bool = _train("aborted")
    # Operating many replicas and gateways (see README, "Running at scale").
    eject_after: int = field(default=3, metadata=_opt(
        "consecutive failures (probes, connect errors, 5xx, broken or frozen streams) that "
        "take a replica out of service until a /health probe passes", "N", type=int))
    probe_interval_s: float = field(default=2.0, metadata=_opt(
        "seconds between /health probes of every replica", "SECONDS", type=float))
    replica_max_inflight: int | None = field(default=None, metadata=_opt(
        "new rollouts avoid a replica with this many calls in flight while another has room",
        "N", type=int))
    ttft_timeout_s: float = field(default=120.0, metadata=_opt(
        "seconds a stream may wait for its first chunk; then the call fails and the replica "
        "counts a failure", "SECONDS", type=float))
    stream_idle_timeout_s: float = field(default=30.0, metadata=_opt(
        "seconds a stream may go without a chunk; then the call fails and the replica counts "
        "a failure", "SECONDS", type=float))
    max_inflight: int = field(default=1024, metadata=_opt(
        "model calls served at once; past it callers get 429 (OpenAI) or 529 (Anthropic) with "
        "Retry-After", "N", type=int))
    rollout_max_inflight: int = field(default=32, metadata=_opt(
        "model calls one rollout may have at once, counted from its request head (a body "
        "still being sent counts); past it that rollout's callers get 429 (OpenAI) or 529 "
        "(Anthropic) with Retry-After, and other rollouts are not affected", "N", type=int))
    rollout_max_rps: float = field(default=50.0, metadata=_opt(
        "model calls one rollout may start per second, with bursts of twice as many; past it "
        "that rollout's callers get 429 with Retry-After", "RATE", type=float))
    rollout_max_stored_mb: float = field(default=1024.0, metadata=_opt(
        "body bytes one rollout may store (compressed, as stored); past it its calls are "
        "refused with 413 and not recorded", "MB", type=float))
    drain_timeout_s: float = field(default=30.0, metadata=_opt(
        "on SIGTERM/SIGINT, seconds in-flight calls may still finish; then they are recorded "
        "aborted and ended with an error event", "SECONDS", type=float))
    idle_timeout_s: float = field(default=15.0, metadata=_opt(
        "seconds a connection may take to send a request head, also between keep-alive "
        "requests; then it is closed", "SECONDS", type=float))
    body_timeout_s: float = field(default=30.0, metadata=_opt(
        "seconds a request may take to send its body; then it gets 408", "SECONDS", type=float))
    db_pool_size: int = field(default=10, metadata=_opt(
        "Postgres connections in the pool (at least 4)", "N", type=int))

    @property
    def merge_options(self) -> MergeOptions:
        return MergeOptions(
            train_constrained=self.train_constrained,
            train_auxiliary=self.train_auxiliary,
            train_abandoned=self.train_abandoned,
            train_aborted=self.train_aborted,
        )

    def __post_init__(self) -> None:
        for name in ("eject_after", "max_inflight", "rollout_max_inflight"):
            if getattr(self, name) < 1:
                raise ValueError(f"{_flag_of(name)} must be at least 1")
        if not self.rollout_max_stored_mb > 0:
            raise ValueError("--rollout-max-stored-mb must be a positive number of megabytes")
        if not self.rollout_max_rps > 0:
            raise ValueError("--rollout-max-rps must be a positive number of calls a second")
        for name in ("probe_interval_s", "ttft_timeout_s", "stream_idle_timeout_s",
                     "idle_timeout_s", "body_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{_flag_of(name)} must be a positive number of seconds")
        if not self.drain_timeout_s >= 0:
            raise ValueError("--drain-timeout must be zero or more seconds")
        if self.db_pool_size < 4:
            # The recorder and the policy listener each hold one connection for good.
            raise ValueError("--db-pool-size must be at least 4")
        if self.recent_calls_mib < 0:
            raise ValueError("--recent-calls-mib must be zero or more")
        if self.continuation not in ("exact", "render"):
            raise ValueError(f"continuation must be exact or render, not {self.continuation!r}")
        self.upstreams = [u.rstrip("/") for u in self.upstreams]
        if not self.public_url:
            self.public_url = f"http://{self.host}:{self.port}"
        self.public_url = self.public_url.rstrip("/")


def _flag_of(name: str) -> str:
    return next(knobs.flag_name(f) for f in dataclasses.fields(GatewayConfig) if f.name == name)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per field of `GatewayConfig`, its default taken from the variable when set."""
    knobs.add_arguments(GatewayConfig, parser, secret=("admin_key",))


def from_args(args: argparse.Namespace) -> GatewayConfig:
    """The config of flags parsed by a parser `add_arguments` filled."""
    values = knobs.values_from_args(GatewayConfig, args)
    if not values["upstreams"]:
        raise SystemExit(
            "rolltap gateway: no upstream. Pass --upstream http://HOST:PORT (a vLLM server, e.g. "
            "from `rolltap serve-model`) or set ROLLTAP_UPSTREAMS."
        )
    try:
        return GatewayConfig(**values)
    except ValueError as exc:
        raise SystemExit(f"rolltap gateway: {exc}") from None
