"""The gateway's one configuration object, from flags with `ROLLTAP_*` environment fallbacks."""

from __future__ import annotations

import argparse
import os
import secrets
from dataclasses import dataclass, field
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
    # A database that is down or frozen fails calls within about these bounds (503), instead of
    # holding them; the gateway recovers on its own when it answers again.
    db_acquire_timeout_s: float = 2.0
    db_command_timeout_s: float = 2.0
    # Call records waiting for their commit; past it new calls get 503 (529 on the Anthropic
    # API) with Retry-After rather than queueing without bound.
    max_pending_records: int = 4096

    def __post_init__(self) -> None:
        if self.continuation not in ("exact", "render"):
            raise ValueError(f"continuation must be exact or render, not {self.continuation!r}")
        self.upstreams = [u.rstrip("/") for u in self.upstreams]
        if not self.public_url:
            self.public_url = f"http://{self.host}:{self.port}"
        self.public_url = self.public_url.rstrip("/")


def _env(name: str, default: str | None = None) -> str | None:
    return os.environ.get(f"ROLLTAP_{name}", default)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    env_upstreams = [u for u in (_env("UPSTREAMS") or "").split(",") if u]
    parser.add_argument(
        "--upstream",
        action="append",
        dest="upstreams",
        metavar="URL",
        help="vLLM server root, e.g. http://127.0.0.1:8000; repeat for several replicas "
        "(env ROLLTAP_UPSTREAMS, comma separated). A rollout always goes to the same replica.",
    )
    parser.set_defaults(env_upstreams=env_upstreams)
    parser.add_argument(
        "--host", default=_env("HOST", "127.0.0.1"), help="bind address (env ROLLTAP_HOST)"
    )
    parser.add_argument(
        "--port", type=int, default=int(_env("PORT", "9000")), help="bind port (env ROLLTAP_PORT)"
    )
    parser.add_argument(
        "--database-url",
        default=_env("DATABASE_URL"),
        metavar="DSN",
        help="Postgres DSN (env ROLLTAP_DATABASE_URL). Without it an embedded Postgres is started "
        "in --data-dir.",
    )
    parser.add_argument(
        "--data-dir",
        type=Path,
        default=Path(_env("DATA_DIR") or default_data_dir()),
        help="where the embedded Postgres keeps its data "
        "(env ROLLTAP_DATA_DIR; default %(default)s)",
    )
    parser.add_argument(
        "--admin-key",
        default=_env("ADMIN_KEY"),
        help="key for /admin routes (env ROLLTAP_ADMIN_KEY). "
        "If unset, one is generated and printed.",
    )
    parser.add_argument(
        "--public-url",
        default=_env("PUBLIC_URL", ""),
        help="base URL sandboxes reach the gateway at, handed out by POST /admin/rollouts "
        "(env ROLLTAP_PUBLIC_URL; default http://HOST:PORT)",
    )
    parser.add_argument(
        "--temperature",
        type=float,
        default=float(_env("TEMPERATURE", "1.0")),
        help="sampling temperature of the training policy; top_p 1, no top_k/min_p/penalties "
        "(env ROLLTAP_TEMPERATURE; default %(default)s)",
    )
    parser.add_argument(
        "--max-body-mb",
        type=float,
        default=float(_env("MAX_BODY_MB", "32")),
        help="largest request body accepted, in MiB (env ROLLTAP_MAX_BODY_MB; default %(default)s)",
    )
    parser.add_argument(
        "--upstream-timeout",
        type=float,
        default=float(_env("UPSTREAM_TIMEOUT", "600")),
        help="seconds a single upstream call may take (env ROLLTAP_UPSTREAM_TIMEOUT)",
    )
    parser.add_argument(
        "--no-record-bodies",
        action="store_true",
        default=_env("RECORD_BODIES", "1") in ("0", "false", "no"),
        help="do not keep compressed request/response bodies (token records are always kept)",
    )
    parser.add_argument(
        "--default-max-tokens",
        type=int,
        default=int(_env("DEFAULT_MAX_TOKENS", "0")) or None,
        metavar="N",
        help="output cap for requests that set none (Codex sends none); default: the engine's "
        "context limit (env ROLLTAP_DEFAULT_MAX_TOKENS)",
    )
    parser.add_argument(
        "--rollout-timeout",
        type=float,
        default=float(_env("ROLLOUT_TIMEOUT", "0")) or None,
        metavar="SECONDS",
        help="default deadline of a rollout that names none; past it the rollout ends as timeout",
    )
    parser.add_argument(
        "--continuation",
        choices=("exact", "render"),
        default=_env("CONTINUATION", "exact"),
        help="how a request that continues an earlier call is prompted: `exact` hands the engine "
        "the tokens it sampled then (the rollout stays one training sequence), `render` lets it "
        "re-render the conversation (drift forks the sequence) (env ROLLTAP_CONTINUATION; "
        "default %(default)s)",
    )
    parser.add_argument(
        "--local-template",
        type=Path,
        default=_env("LOCAL_TEMPLATE"),
        metavar="MODEL_DIR",
        help="the served model's directory (tokenizer.json, tokenizer_config.json): render "
        "exact continuations in the gateway with its chat template and tokenizer, which saves "
        "the engine round trip; used only where a self-check against the engine shows the same "
        "ids, and cross-checked on a sample of calls (env ROLLTAP_LOCAL_TEMPLATE)",
    )
    parser.add_argument(
        "--db-acquire-timeout",
        type=float,
        default=float(_env("DB_ACQUIRE_TIMEOUT", "2")),
        metavar="SECONDS",
        help="longest wait for a database connection (also connecting) before a call fails "
        "with 503 (env ROLLTAP_DB_ACQUIRE_TIMEOUT; default %(default)s)",
    )
    parser.add_argument(
        "--db-command-timeout",
        type=float,
        default=float(_env("DB_COMMAND_TIMEOUT", "2")),
        metavar="SECONDS",
        help="longest a database statement (a commit of call records included) may take "
        "before the calls waiting on it fail with 503 (env ROLLTAP_DB_COMMAND_TIMEOUT; "
        "default %(default)s)",
    )
    parser.add_argument(
        "--max-pending-records",
        type=int,
        default=int(_env("MAX_PENDING_RECORDS", "4096")),
        metavar="N",
        help="call records that may wait for their commit; beyond that new calls are turned "
        "away with 503/529 and Retry-After (env ROLLTAP_MAX_PENDING_RECORDS; default "
        "%(default)s)",
    )
    for what, why in (
        ("constrained", "calls sampled under a grammar, forced tool or banned/forced tokens"),
        ("auxiliary", "sequences none of whose calls offered tools (titles, summaries)"),
        ("abandoned", "retries the harness did not continue"),
        ("aborted", "calls the client abandoned mid-stream or that failed"),
    ):
        parser.add_argument(
            f"--train-{what}",
            action="store_true",
            default=_env(f"TRAIN_{what.upper()}", "0") in ("1", "true", "yes"),
            help=f"merge: also train {why} (excluded by default; env ROLLTAP_TRAIN_{what.upper()})",
        )


def from_args(args: argparse.Namespace) -> GatewayConfig:
    upstreams = args.upstreams or args.env_upstreams
    if not upstreams:
        raise SystemExit(
            "rolltap gateway: no upstream. Pass --upstream http://HOST:PORT (a vLLM server, e.g. "
            "from `rolltap serve-model`) or set ROLLTAP_UPSTREAMS."
        )
    return GatewayConfig(
        upstreams=upstreams,
        host=args.host,
        port=args.port,
        database_url=args.database_url,
        data_dir=args.data_dir,
        admin_key=args.admin_key or secrets.token_urlsafe(24),
        public_url=args.public_url,
        temperature=args.temperature,
        max_body_bytes=int(args.max_body_mb * 1024 * 1024),
        upstream_timeout_s=args.upstream_timeout,
        record_bodies=not args.no_record_bodies,
        rollout_timeout_s=args.rollout_timeout,
        default_max_tokens=args.default_max_tokens,
        continuation=args.continuation,
        local_template=args.local_template,
        db_acquire_timeout_s=args.db_acquire_timeout,
        db_command_timeout_s=args.db_command_timeout,
        max_pending_records=args.max_pending_records,
        merge_options=MergeOptions(
            train_constrained=args.train_constrained,
            train_auxiliary=args.train_auxiliary,
            train_abandoned=args.train_abandoned,
            train_aborted=args.train_aborted,
        ),
    )
