"""The gateway's one configuration object, from flags with `ROLLTAP_*` environment fallbacks."""

from __future__ import annotations

import argparse
import os
import secrets
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

from gateway.merge import MergeOptions


def default_data_dir() -> Path:
    base = os.environ.get("XDG_DATA_HOME") or os.path.join(
        os.path.expanduser("~"), ".local", "share"
    )
    return Path(base) / "rolltap"


@dataclass
class GatewayConfig:
    upstreams: list[str]
    host: str = "127.0.0.1"
    port: int = 9000
    database_url: str | None = None  # None: start an embedded Postgres in data_dir
    data_dir: Path = field(default_factory=default_data_dir)
    admin_key: str = ""
    public_url: str = ""  # base URL handed to sandboxes; defaults to http://host:port
    # Also served on this Unix socket (mode 0666): confined sandboxes on this machine reach the
    # gateway only through it (bound into their network namespace).
    unix_socket: Path | None = None
    # The training policy: every sampled token is drawn at this temperature with no truncation,
    # so the recorded logprobs are the ones the trainer's ratio is computed against.
    temperature: float = 1.0
    max_body_bytes: int = 32 * 1024 * 1024
    upstream_timeout_s: float = 600.0
    record_bodies: bool = True
    rollout_timeout_s: float | None = None  # default deadline for rollouts that name none
    default_max_tokens: int | None = None  # output cap for requests that set none
    # exact: a request that continues an earlier call of its rollout gets that call's prompt and
    # sampled ids back as its prompt prefix; render: the engine re-renders every conversation.
    continuation: str = "exact"
    # The served model's directory: continuations are then rendered in the gateway with its chat
    # template and tokenizer wherever they reproduce the engine's ids (else by the engine).
    local_template: Path | None = None
    merge_options: MergeOptions = field(default_factory=MergeOptions)
    # Operating many replicas and gateways (see README, "Running at scale").
    eject_after: int = 3  # consecutive failures that take a replica out of service
    probe_interval_s: float = 2.0  # active /health checks of every replica
    replica_max_inflight: int | None = None  # new rollouts avoid replicas this busy
    ttft_timeout_s: float = 120.0  # a stream's first chunk, else the replica is frozen
    stream_idle_timeout_s: float = 30.0  # between chunks of a stream
    max_inflight: int = 1024  # model calls this gateway serves at once; past it 429/529
    drain_timeout_s: float = 30.0  # on SIGTERM, how long in-flight calls may still run
    idle_timeout_s: float = 15.0  # a connection's time to send a request head (keep-alive)
    body_timeout_s: float = 30.0  # a request's time to send its whole body
    db_pool_size: int = 10
    access_log: bool = True  # one log line per HTTP call
    tokenizer: Path | None = None  # model dir whose tokenizer.json the viewer decodes with
    # A database that is down or frozen fails calls within about these bounds (503), instead of
    # holding them; the gateway recovers on its own when it answers again. Not shorter: a
    # commit fails calls whose tokens are already generated, and a busy server's commits took
    # over 2 s in the gateway bench at c=64 (load average 16 on 2 cores).
    db_acquire_timeout_s: float = 5.0
    db_command_timeout_s: float = 10.0
    # Call records waiting for their commit; past it new calls get 503 (529 on the Anthropic
    # API) with Retry-After rather than queueing without bound.
    max_pending_records: int = 4096
    # Memory for running rollouts' latest calls (their ids, request bodies and continuation
    # keys, see store/tokens.RecentCalls); past it the least recently used rollouts are read
    # back from the database when they call again.
    recent_calls_mib: int = 512

    def __post_init__(self) -> None:
        for name in ("eject_after", "max_inflight"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1")
        for name in ("probe_interval_s", "ttft_timeout_s", "stream_idle_timeout_s",
                     "idle_timeout_s", "body_timeout_s"):
            if not getattr(self, name) > 0:
                flag = name.removesuffix("_s").replace("_", "-")
                raise ValueError(f"--{flag} must be a positive number of seconds")
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


def _env(name: str, default: str | None = None) -> str | None:
    return os.environ.get(f"ROLLTAP_{name}", default)


def _option(
    parser: argparse.ArgumentParser,
    flag: str,
    kind,
    default,
    help_text: str,
    metavar: str | None = None,
    show_default: bool = True,
) -> None:
    """A flag whose environment fallback is ROLLTAP_ and its name (`--max-inflight`:
    ROLLTAP_MAX_INFLIGHT); `default` is used when neither is given."""
    env = flag.removeprefix("--").replace("-", "_").upper()
    value = _env(env)
    parser.add_argument(
        flag,
        type=kind,
        default=kind(value) if value is not None else default,
        metavar=metavar,
        help=f"{help_text} (env ROLLTAP_{env}"
        + ("; default %(default)s)" if show_default else ")"),
    )


def _switch(
    parser: argparse.ArgumentParser, flag: str, env: str, help_text: str, off: bool = False
) -> None:
    """An on/off flag: given, or its environment variable set to 1/true/yes; with `off`, the
    variable names what the flag turns off, and 0/false/no sets the flag."""
    words = ("0", "false", "no") if off else ("1", "true", "yes")
    parser.add_argument(
        flag,
        action="store_true",
        default=(_env(env) or "").lower() in words,
        help=f"{help_text} (env ROLLTAP_{env}={words[0]})",
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    env_upstreams = [u for u in (_env("UPSTREAMS") or "").split(",") if u]
    parser.add_argument(
        "--upstream",
        action="append",
        dest="upstreams",
        metavar="URL",
        help="vLLM server root, e.g. http://127.0.0.1:8000; repeat for several replicas "
        "(env ROLLTAP_UPSTREAMS, comma separated). A rollout stays on one replica while it is "
        "healthy; more can be added at run time (POST /admin/upstreams).",
    )
    parser.set_defaults(env_upstreams=env_upstreams)
    option = partial(_option, parser)
    option("--host", str, "127.0.0.1", "bind address")
    option("--port", int, 9000, "bind port")
    option("--database-url", str, None, "Postgres DSN. Without it an embedded Postgres is "
           "started in --data-dir", "DSN", show_default=False)
    option("--data-dir", Path, default_data_dir(), "where the embedded Postgres keeps its data")
    option("--admin-key", str, None, "key for /admin routes. If unset, one is generated and "
           "printed", "KEY", show_default=False)
    option("--public-url", str, "", "base URL sandboxes reach the gateway at, handed out by "
           "POST /admin/rollouts; default http://HOST:PORT", "URL", show_default=False)
    option("--unix-socket", Path, None, "also listen on this Unix socket; `rolltap rollouts "
           "--gateway-socket PATH` binds it into confined sandboxes as their only way out",
           "PATH", show_default=False)
    option("--temperature", float, 1.0, "sampling temperature of the training policy; top_p 1, "
           "no top_k/min_p/penalties")
    option("--max-body-mb", float, 32.0, "largest request body accepted, in MiB", "MIB")
    option("--upstream-timeout", float, 600.0, "seconds a single upstream call may take",
           "SECONDS")
    option("--default-max-tokens", int, 0, "output cap for requests that set none (Codex sends "
           "none); 0: the engine's context limit. Codex exits 1 when this cap binds (an "
           "incomplete response): leave it unset for Codex rollouts", "N")
    option("--rollout-timeout", float, 0.0, "default deadline of a rollout that names none, in "
           "seconds; past it the rollout ends as timeout; 0: none", "SECONDS")
    parser.add_argument(
        "--continuation",
        choices=("exact", "render"),
        default=_env("CONTINUATION", "exact"),
        help="how a request that continues an earlier call is prompted: `exact` hands the engine "
        "the tokens it sampled then (the rollout stays one training sequence), `render` lets it "
        "re-render the conversation (drift forks the sequence) (env ROLLTAP_CONTINUATION; "
        "default %(default)s)",
    )
    option("--local-template", Path, None, "the served model's directory (tokenizer.json, "
           "tokenizer_config.json): render exact continuations in the gateway with its chat "
           "template and tokenizer, which saves the engine round trip; used only where a "
           "self-check against the engine shows the same ids, and cross-checked on a sample of "
           "calls", "MODEL_DIR", show_default=False)
    option("--tokenizer", Path, None, "the served model's directory; the trace viewer (/ui) "
           "shows token text decoded with its tokenizer.json; default: --local-template",
           "MODEL_DIR", show_default=False)
    _switch(parser, "--no-record-bodies", "RECORD_BODIES",
            "do not keep compressed request/response bodies (token records are always kept)",
            off=True)
    _switch(parser, "--no-access-log", "ACCESS_LOG", "do not log one line per HTTP call "
            "(method, route, status, latency, rollout, request id)", off=True)
    option("--db-acquire-timeout", float, 5.0, "longest wait for a database connection (also "
           "connecting) before a call fails with 503", "SECONDS")
    option("--db-command-timeout", float, 10.0, "longest a database statement (a commit of call "
           "records included) may take before the calls waiting on it fail with 503", "SECONDS")
    option("--max-pending-records", int, 4096, "call records that may wait for their commit; "
           "beyond that new calls are turned away with 503/529 and Retry-After", "N")
    option("--recent-calls-mib", int, 512, "memory for running rollouts' latest calls (ids, "
           "bodies, continuation keys); past it the least recently used are read back from the "
           "database", "MIB")
    for what, why in (
        ("constrained", "calls sampled under a grammar, forced tool or banned/forced tokens"),
        ("auxiliary", "side calls: toolless sequences beside tool-offering calls (titles, "
                      "summaries), or in rollouts created with side_calls toolless"),
        ("abandoned", "retries the harness did not continue"),
        ("aborted", "calls the client abandoned mid-stream or that failed"),
    ):
        _switch(parser, f"--train-{what}", f"TRAIN_{what.upper()}",
                f"merge: also train {why} (excluded by default)")
    # Operating many replicas and gateways (README, "Running at scale").
    option("--eject-after", int, 3,
           "consecutive failures (probes, connect errors, 5xx, broken or frozen streams) that "
           "take a replica out of service until a /health probe passes", "N")
    option("--probe-interval", float, 2.0,
           "seconds between /health probes of every replica", "SECONDS")
    option("--replica-max-inflight", int, None,
           "new rollouts avoid a replica with this many calls in flight while another has room",
           "N")
    option("--ttft-timeout", float, 120.0,
           "seconds a stream may wait for its first chunk; then the call fails and the replica "
           "counts a failure", "SECONDS")
    option("--stream-idle-timeout", float, 30.0,
           "seconds a stream may go without a chunk; then the call fails and the replica "
           "counts a failure", "SECONDS")
    option("--max-inflight", int, 1024,
           "model calls served at once; past it callers get 429 (OpenAI) or 529 (Anthropic) "
           "with Retry-After", "N")
    option("--drain-timeout", float, 30.0,
           "on SIGTERM/SIGINT, seconds in-flight calls may still finish; then they are "
           "recorded aborted and ended with an error event", "SECONDS")
    option("--idle-timeout", float, 15.0,
           "seconds a connection may take to send a request head, also between keep-alive "
           "requests; then it is closed", "SECONDS")
    option("--body-timeout", float, 30.0,
           "seconds a request may take to send its body; then it gets 408", "SECONDS")
    option("--db-pool-size", int, 10, "Postgres connections in the pool (at least 4)", "N")


def from_args(args: argparse.Namespace) -> GatewayConfig:
    upstreams = args.upstreams or args.env_upstreams
    if not upstreams:
        raise SystemExit(
            "rolltap gateway: no upstream. Pass --upstream http://HOST:PORT (a vLLM server, e.g. "
            "from `rolltap serve-model`) or set ROLLTAP_UPSTREAMS."
        )
    try:
        return _config(args, upstreams)
    except ValueError as exc:
        raise SystemExit(f"rolltap gateway: {exc}") from None


def _config(args: argparse.Namespace, upstreams: list[str]) -> GatewayConfig:
    return GatewayConfig(
        upstreams=upstreams,
        host=args.host,
        port=args.port,
        database_url=args.database_url,
        data_dir=args.data_dir,
        admin_key=args.admin_key or secrets.token_urlsafe(24),
        public_url=args.public_url,
        unix_socket=args.unix_socket,
        temperature=args.temperature,
        max_body_bytes=int(args.max_body_mb * 1024 * 1024),
        upstream_timeout_s=args.upstream_timeout,
        record_bodies=not args.no_record_bodies,
        rollout_timeout_s=args.rollout_timeout or None,
        default_max_tokens=args.default_max_tokens or None,
        continuation=args.continuation,
        local_template=args.local_template,
        db_acquire_timeout_s=args.db_acquire_timeout,
        db_command_timeout_s=args.db_command_timeout,
        max_pending_records=args.max_pending_records,
        recent_calls_mib=args.recent_calls_mib,
        merge_options=MergeOptions(
            train_constrained=args.train_constrained,
            train_auxiliary=args.train_auxiliary,
            train_abandoned=args.train_abandoned,
            train_aborted=args.train_aborted,
        ),
        eject_after=args.eject_after,
        probe_interval_s=args.probe_interval,
        replica_max_inflight=args.replica_max_inflight,
        ttft_timeout_s=args.ttft_timeout,
        stream_idle_timeout_s=args.stream_idle_timeout,
        max_inflight=args.max_inflight,
        drain_timeout_s=args.drain_timeout,
        idle_timeout_s=args.idle_timeout,
        body_timeout_s=args.body_timeout,
        db_pool_size=args.db_pool_size,
        access_log=not args.no_access_log,
        tokenizer=args.tokenizer,
    )
