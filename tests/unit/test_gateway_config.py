"""The gateway's flags, their `ROLLTAP_*` variables, defaults and help, and the `GatewayConfig`
they make: pinned, so that generating the command line from one declaration changes nothing a
user sees (precedence: flag, then environment variable, then default)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import pytest

from core.merge.values import MergeOptions
from gateway import config

# flag, its default once parsed, metavar, choices, help as `--help` prints it.
FLAGS = [
    ('--upstream', None, 'URL', None,
     'vLLM server root, e.g. http://127.0.0.1:8000; repeat for several replicas (env '
     'ROLLTAP_UPSTREAMS, comma separated). A rollout stays on one replica while it is '
     'healthy; more can be added at run time (POST /admin/upstreams).'),
    ('--host', '127.0.0.1', None, None,
     'bind address (env ROLLTAP_HOST; default 127.0.0.1)'),
    ('--port', 9000, None, None,
     'bind port (env ROLLTAP_PORT; default 9000)'),
    ('--database-url', None, 'DSN', None,
     'Postgres DSN. Without it an embedded Postgres is started in --data-dir (env '
     'ROLLTAP_DATABASE_URL)'),
    ('--data-dir', Path('/xdg/rolltap'), None, None,
     'where the embedded Postgres keeps its data (env ROLLTAP_DATA_DIR; default /xdg/rolltap)'),
    ('--admin-key', None, 'KEY', None,
     'key for /admin routes. If unset, one is generated and printed (env ROLLTAP_ADMIN_KEY)'),
    ('--public-url', '', 'URL', None,
     'base URL sandboxes reach the gateway at, handed out by POST /admin/rollouts; default '
     'http://HOST:PORT (env ROLLTAP_PUBLIC_URL)'),
    ('--unix-socket', None, 'PATH', None,
     'also listen on this Unix socket; `rolltap rollouts --gateway-socket PATH` binds it '
     'into confined sandboxes as their only way out (env ROLLTAP_UNIX_SOCKET)'),
    ('--temperature', 1.0, None, None,
     'sampling temperature of the training policy; top_p 1, no top_k/min_p/penalties (env '
     'ROLLTAP_TEMPERATURE; default 1.0)'),
    ('--max-body-mb', 32.0, 'MIB', None,
     'largest request body accepted, in MiB (env ROLLTAP_MAX_BODY_MB; default 32.0)'),
    ('--upstream-timeout', 600.0, 'SECONDS', None,
     'seconds a single upstream call may take (env ROLLTAP_UPSTREAM_TIMEOUT; default 600.0)'),
    ('--default-max-tokens', 0, 'N', None,
     "output cap for requests that set none (Codex sends none); 0: the engine's context "
     'limit. Codex exits 1 when this cap binds (an incomplete response): leave it unset for '
     'Codex rollouts (env ROLLTAP_DEFAULT_MAX_TOKENS; default 0)'),
    ('--rollout-timeout', 0.0, 'SECONDS', None,
     'default deadline of a rollout that names none, in seconds; past it the rollout ends as'
     ' timeout; 0: none (env ROLLTAP_ROLLOUT_TIMEOUT; default 0.0)'),
    ('--continuation', 'exact', None, ('exact', 'render'),
     'how a request that continues an earlier call is prompted: `exact` hands the engine the'
     ' tokens it sampled then (the rollout stays one training sequence), `render` lets it '
     're-render the conversation (drift forks the sequence) (env ROLLTAP_CONTINUATION; '
     'default exact)'),
    ('--local-template', None, 'MODEL_DIR', None,
     "the served model's directory (tokenizer.json, tokenizer_config.json): render exact "
     'continuations in the gateway with its chat template and tokenizer, which saves the '
     'engine round trip; used only where a self-check against the engine shows the same ids,'
     ' and cross-checked on a sample of calls (env ROLLTAP_LOCAL_TEMPLATE)'),
    ('--tokenizer', None, 'MODEL_DIR', None,
     "the served model's directory; the trace viewer (/ui) shows token text decoded with its"
     ' tokenizer.json; default: --local-template (env ROLLTAP_TOKENIZER)'),
    ('--no-record-bodies', False, None, None,
     'do not keep compressed request/response bodies (token records are always kept) (env '
     'ROLLTAP_RECORD_BODIES=0)'),
    ('--no-access-log', False, None, None,
     'do not log one line per HTTP call (method, route, status, latency, rollout, request '
     'id) (env ROLLTAP_ACCESS_LOG=0)'),
    ('--db-acquire-timeout', 5.0, 'SECONDS', None,
     'longest wait for a database connection (also connecting) before a call fails with 503 '
     '(env ROLLTAP_DB_ACQUIRE_TIMEOUT; default 5.0)'),
    ('--db-command-timeout', 10.0, 'SECONDS', None,
     'longest a database statement (a commit of call records included) may take before the '
     'calls waiting on it fail with 503 (env ROLLTAP_DB_COMMAND_TIMEOUT; default 10.0)'),
    ('--max-pending-records', 4096, 'N', None,
     'call records that may wait for their commit; beyond that new calls are turned away '
     'with 503/529 and Retry-After (env ROLLTAP_MAX_PENDING_RECORDS; default 4096)'),
    ('--recent-calls-mib', 512, 'MIB', None,
     "memory for running rollouts' latest calls (ids, bodies, continuation keys); past it "
     'the least recently used are read back from the database (env ROLLTAP_RECENT_CALLS_MIB;'
     ' default 512)'),
    ('--train-constrained', False, None, None,
     'merge: also train calls sampled under a grammar, forced tool or banned/forced tokens '
     '(excluded by default) (env ROLLTAP_TRAIN_CONSTRAINED=1)'),
    ('--train-auxiliary', False, None, None,
     'merge: also train side calls: toolless sequences beside tool-offering calls (titles, '
     'summaries), or in rollouts created with side_calls toolless (excluded by default) (env'
     ' ROLLTAP_TRAIN_AUXILIARY=1)'),
    ('--train-abandoned', False, None, None,
     'merge: also train retries the harness did not continue (excluded by default) (env '
     'ROLLTAP_TRAIN_ABANDONED=1)'),
    ('--train-aborted', False, None, None,
     'merge: also train calls the client abandoned mid-stream or that failed (excluded by '
     'default) (env ROLLTAP_TRAIN_ABORTED=1)'),
    ('--eject-after', 3, 'N', None,
     'consecutive failures (probes, connect errors, 5xx, broken or frozen streams) that take'
     ' a replica out of service until a /health probe passes (env ROLLTAP_EJECT_AFTER; '
     'default 3)'),
    ('--probe-interval', 2.0, 'SECONDS', None,
     'seconds between /health probes of every replica (env ROLLTAP_PROBE_INTERVAL; default 2.0)'),
    ('--replica-max-inflight', None, 'N', None,
     'new rollouts avoid a replica with this many calls in flight while another has room '
     '(env ROLLTAP_REPLICA_MAX_INFLIGHT; default None)'),
    ('--ttft-timeout', 120.0, 'SECONDS', None,
     'seconds a stream may wait for its first chunk; then the call fails and the replica '
     'counts a failure (env ROLLTAP_TTFT_TIMEOUT; default 120.0)'),
    ('--stream-idle-timeout', 30.0, 'SECONDS', None,
     'seconds a stream may go without a chunk; then the call fails and the replica counts a '
     'failure (env ROLLTAP_STREAM_IDLE_TIMEOUT; default 30.0)'),
    ('--max-inflight', 1024, 'N', None,
     'model calls served at once; past it callers get 429 (OpenAI) or 529 (Anthropic) with '
     'Retry-After (env ROLLTAP_MAX_INFLIGHT; default 1024)'),
    ('--rollout-max-inflight', 32, 'N', None,
     'model calls one rollout may have at once, counted from its request head (a body still '
     'being sent counts); past it that rollout\'s callers get 429 (OpenAI) or 529 '
     '(Anthropic) with Retry-After, and other rollouts are not affected (env '
     'ROLLTAP_ROLLOUT_MAX_INFLIGHT; default 32)'),
    ('--rollout-max-rps', 50.0, 'RATE', None,
     'model calls one rollout may start per second, with bursts of twice as many; past it '
     'that rollout\'s callers get 429 with Retry-After (env ROLLTAP_ROLLOUT_MAX_RPS; default '
     '50.0)'),
    ('--rollout-max-stored-mb', 1024.0, 'MB', None,
     'body bytes one rollout may store (compressed, as stored); past it its calls are '
     'refused with 413 and not recorded (env ROLLTAP_ROLLOUT_MAX_STORED_MB; default 1024.0)'),
    ('--drain-timeout', 30.0, 'SECONDS', None,
     'on SIGTERM/SIGINT, seconds in-flight calls may still finish; then they are recorded '
     'aborted and ended with an error event (env ROLLTAP_DRAIN_TIMEOUT; default 30.0)'),
    ('--idle-timeout', 15.0, 'SECONDS', None,
     'seconds a connection may take to send a request head, also between keep-alive '
     'requests; then it is closed (env ROLLTAP_IDLE_TIMEOUT; default 15.0)'),
    ('--body-timeout', 30.0, 'SECONDS', None,
     'seconds a request may take to send its body; then it gets 408 (env '
     'ROLLTAP_BODY_TIMEOUT; default 30.0)'),
    ('--db-pool-size', 10, 'N', None,
     'Postgres connections in the pool (at least 4) (env ROLLTAP_DB_POOL_SIZE; default 10)'),
]

# Every field the gateway reads, as a `rolltap gateway --upstream http://a/` gives it.
DEFAULTS = {
    "upstreams": ["http://a"], "host": "127.0.0.1", "port": 9000, "database_url": None,
    "data_dir": Path("/xdg/rolltap"), "public_url": "http://127.0.0.1:9000",
    "unix_socket": None, "temperature": 1.0, "max_body_bytes": 32 * 1024 * 1024,
    "upstream_timeout_s": 600.0, "record_bodies": True, "rollout_timeout_s": None,
    "default_max_tokens": None, "continuation": "exact", "local_template": None,
    "merge_options": MergeOptions(), "eject_after": 3, "probe_interval_s": 2.0,
    "replica_max_inflight": None, "ttft_timeout_s": 120.0, "stream_idle_timeout_s": 30.0,
    "max_inflight": 1024, "rollout_max_inflight": 32, "rollout_max_rps": 50.0,
    "rollout_max_stored_mb": 1024.0,
    "drain_timeout_s": 30.0, "idle_timeout_s": 15.0,
    "body_timeout_s": 30.0, "db_pool_size": 10, "access_log": True, "tokenizer": None,
    "db_acquire_timeout_s": 5.0, "db_command_timeout_s": 10.0, "max_pending_records": 4096,
    "recent_calls_mib": 512,
}

# Every variable set to something else than its default, and what each field becomes.
ENVIRONMENT = {
    "UPSTREAMS": "http://e1/,http://e2", "HOST": "0.0.0.0", "PORT": "9100",
    "DATABASE_URL": "postgresql://db", "DATA_DIR": "/data", "ADMIN_KEY": "k",
    "PUBLIC_URL": "http://pub/", "UNIX_SOCKET": "/run/g.sock", "TEMPERATURE": "0.5",
    "MAX_BODY_MB": "1.5", "UPSTREAM_TIMEOUT": "60", "DEFAULT_MAX_TOKENS": "256",
    "ROLLOUT_TIMEOUT": "90", "CONTINUATION": "render", "LOCAL_TEMPLATE": "/m",
    "TOKENIZER": "/t", "RECORD_BODIES": "0", "ACCESS_LOG": "false",
    "DB_ACQUIRE_TIMEOUT": "1", "DB_COMMAND_TIMEOUT": "2", "MAX_PENDING_RECORDS": "8",
    "RECENT_CALLS_MIB": "0", "TRAIN_CONSTRAINED": "1", "TRAIN_AUXILIARY": "true",
    "TRAIN_ABANDONED": "yes", "TRAIN_ABORTED": "1", "EJECT_AFTER": "5",
    "PROBE_INTERVAL": "0.5", "REPLICA_MAX_INFLIGHT": "7", "TTFT_TIMEOUT": "9",
    "STREAM_IDLE_TIMEOUT": "4", "MAX_INFLIGHT": "16", "ROLLOUT_MAX_INFLIGHT": "2",
    "ROLLOUT_MAX_RPS": "0.5", "ROLLOUT_MAX_STORED_MB": "2.5", "DRAIN_TIMEOUT": "0",
    "IDLE_TIMEOUT": "3", "BODY_TIMEOUT": "6", "DB_POOL_SIZE": "4",
}
FROM_ENVIRONMENT = {
    "upstreams": ["http://e1", "http://e2"], "host": "0.0.0.0", "port": 9100,
    "database_url": "postgresql://db", "data_dir": Path("/data"), "admin_key": "k",
    "public_url": "http://pub", "unix_socket": Path("/run/g.sock"), "temperature": 0.5,
    "max_body_bytes": 1572864, "upstream_timeout_s": 60.0, "record_bodies": False,
    "rollout_timeout_s": 90.0, "default_max_tokens": 256, "continuation": "render",
    "local_template": Path("/m"), "tokenizer": Path("/t"), "access_log": False,
    "merge_options": MergeOptions(train_constrained=True, train_auxiliary=True,
                                  train_abandoned=True, train_aborted=True),
    "eject_after": 5, "probe_interval_s": 0.5, "replica_max_inflight": 7,
    "ttft_timeout_s": 9.0, "stream_idle_timeout_s": 4.0, "max_inflight": 16,
    "rollout_max_inflight": 2, "rollout_max_rps": 0.5, "rollout_max_stored_mb": 2.5,
    "drain_timeout_s": 0.0,
    "idle_timeout_s": 3.0, "body_timeout_s": 6.0, "db_pool_size": 4,
    "db_acquire_timeout_s": 1.0, "db_command_timeout_s": 2.0, "max_pending_records": 8,
    "recent_calls_mib": 0,
}


@pytest.fixture
def clean_env(monkeypatch):
    for name in list(os.environ):
        if name.startswith("ROLLTAP_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("XDG_DATA_HOME", "/xdg")
    return monkeypatch


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    config.add_arguments(parser)
    return parser


def _config(argv: list[str]) -> config.GatewayConfig:
    return config.from_args(_parser().parse_args(argv))


def _fields(cfg: config.GatewayConfig, names) -> dict:
    return {name: getattr(cfg, name) for name in names}


def test_flags_defaults_environment_names_and_help_are_todays(clean_env):
    parser = _parser()
    defaults = vars(parser.parse_args([]))
    shown = [
        (action.option_strings[0], defaults[action.dest], action.metavar,
         action.choices and tuple(action.choices), action.help % {"default": action.default})
        for action in parser._actions
        if action.option_strings and action.dest != "help"
    ]
    assert shown == FLAGS


def test_defaults_make_todays_config(clean_env):
    cfg = _config(["--upstream", "http://a/"])
    assert _fields(cfg, DEFAULTS) == DEFAULTS
    assert len(cfg.admin_key) >= 32  # generated when none is given


def test_every_variable_sets_its_field(clean_env):
    for name, value in ENVIRONMENT.items():
        clean_env.setenv(f"ROLLTAP_{name}", value)
    assert _fields(_config([]), FROM_ENVIRONMENT) == FROM_ENVIRONMENT


def test_flags_win_over_variables(clean_env):
    for name, value in ENVIRONMENT.items():
        clean_env.setenv(f"ROLLTAP_{name}", value)
    cfg = _config(["--upstream", "http://f", "--port", "1", "--max-body-mb", "2",
                   "--rollout-timeout", "0", "--continuation", "exact", "--db-pool-size", "5"])
    assert (cfg.upstreams, cfg.port, cfg.max_body_bytes) == (["http://f"], 1, 2 * 1024 * 1024)
    assert (cfg.rollout_timeout_s, cfg.continuation, cfg.db_pool_size) == (None, "exact", 5)
    assert cfg.host == "0.0.0.0"  # the variables the flags left alone still count


def test_switches_from_flags(clean_env):
    cfg = _config(["--upstream", "http://a", "--no-record-bodies", "--no-access-log",
                   "--train-aborted", "--train-auxiliary"])
    assert not cfg.record_bodies and not cfg.access_log
    assert cfg.merge_options == MergeOptions(train_auxiliary=True, train_aborted=True)


@pytest.mark.parametrize("argv, message", [
    ([], "no upstream. Pass --upstream"),
    (["--upstream", "http://a", "--db-pool-size", "3"], "--db-pool-size must be at least 4"),
    (["--upstream", "http://a", "--ttft-timeout", "0"], "--ttft-timeout must be a positive"),
])
def test_bad_values_say_what_to_do(clean_env, argv, message):
    with pytest.raises(SystemExit, match=message):
        _config(argv)
