"""`rolltap gateway`: run the recording gateway."""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import signal

log = logging.getLogger(__name__)


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "gateway",
        help="run the recording OpenAI/Anthropic gateway in front of vLLM",
        description="Serve OpenAI (/v1/chat/completions, /v1/completions, /v1/responses) and "
        "Anthropic (/v1/messages) APIs to agent harnesses, forward every call to vLLM, and "
        "record the engine's exact token ids, logprobs and policy versions in Postgres. "
        "Rollouts are created with the admin API (POST /admin/rollouts), which hands out the "
        "per-rollout API key a harness uses.",
    )
    from gateway import config

    config.add_arguments(parser)
    parser.add_argument("--log-level", default="INFO", help="logging level (default INFO)")
    parser.add_argument(
        "--log-format",
        choices=("text", "json"),
        default="text",
        help="text lines, or one JSON object a line; both carry each call's X-Request-Id",
    )
    parser.set_defaults(func=run)


async def _serve(cfg) -> None:
    from aiohttp import web

    from core.store.db import open_pool, start_embedded
    from core.store.migrations import SchemaTooNew
    from gateway import access_log
    from gateway.app import build_app
    from gateway.app_keys import ADMISSION
    from gateway.runtime import Runtime

    dsn = cfg.database_url
    if dsn is None:
        print(
            f"rolltap: no --database-url; starting embedded Postgres in {cfg.data_dir}", flush=True
        )
        dsn = await asyncio.to_thread(start_embedded, cfg.data_dir)
    try:
        pool = await open_pool(
            dsn,
            min_size=2,
            max_size=cfg.db_pool_size,
            acquire_timeout=cfg.db_acquire_timeout_s,
            command_timeout=cfg.db_command_timeout_s,
        )
    except SchemaTooNew as exc:
        raise SystemExit(f"rolltap gateway: {exc}") from None
    except Exception as exc:  # noqa: BLE001 - asyncpg raises many unrelated types here
        raise SystemExit(
            f"rolltap gateway: cannot open database {dsn!r}: {exc}. Check "
            "--database-url (or drop it to use the embedded Postgres)."
        ) from exc
    app = build_app(Runtime(cfg, pool))
    # keepalive_timeout bounds a connection's wait for a complete request head, from its first
    # byte and between keep-alive requests: slow-header and idle connections are closed. After
    # an answer that left the body unread (a 408 for a trickling body), the rest is drained for
    # at most lingering_time, so the client can still read the answer before the close.
    runner = web.AppRunner(
        app,
        access_log=access_log.LOGGER if cfg.access_log else None,
        access_log_class=access_log.AccessLogger,
        keepalive_timeout=cfg.idle_timeout_s,
        lingering_time=2.0,
        shutdown_timeout=5.0,
    )
    await runner.setup()
    site = web.TCPSite(runner, cfg.host, cfg.port, backlog=1024)
    await site.start()
    if cfg.unix_socket is not None:
        await web.UnixSite(runner, str(cfg.unix_socket), backlog=1024).start()
        # Sandboxes run as uids of their own; connecting to a socket needs write permission.
        cfg.unix_socket.chmod(0o666)
        print(f"rolltap gateway also listening on unix:{cfg.unix_socket}", flush=True)
    settle_heap()
    print(
        f"rolltap gateway listening on http://{cfg.host}:{cfg.port} "
        f"(public {cfg.public_url}); upstreams: {', '.join(cfg.upstreams)}",
        flush=True,
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
        print("rolltap gateway: shutting down; in-flight calls may finish", flush=True)
        await _drain(runner, app[ADMISSION], cfg.drain_timeout_s)
    finally:
        await runner.cleanup()  # commits queued records (the recorder drains on close)
        await pool.close()
    print("rolltap gateway: stopped", flush=True)


# Collections measured under the gateway bench's load (gc.callbacks, 512-token calls, 64
# harnesses): with Python's default thresholds (700, 10, 10) collecting took about 120 µs a
# call, and the full collections (~50 ms each) traverse every module, class and function
# loaded at start-up, while all of them found almost nothing to free (cycles are rare on the
# request path). Ten thousand young objects between collections cut that to about 20 µs;
# freezing the start-up heap makes the full collections that still come short (~15 ms).
# Together: 1,200 -> 890 µs of CPU per call at c=64; at c=1 collections are too rare to
# matter either way.
GC_THRESHOLDS = (10_000, 20, 20)


def settle_heap() -> None:
    """Once start-up is done: what exists now lives as long as the process, so the collector
    stops traversing it, and collects the young generation less often."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)


async def _drain(runner, admission, timeout_s: float) -> None:
    """Stop accepting, let in-flight calls finish for `timeout_s`, then end the rest: each is
    recorded `aborted` and its client gets an error in its protocol."""
    admission.closing = True
    for site in list(runner.sites):
        await site.stop()
    runner.server.pre_shutdown()  # idle keep-alive connections close now, busy ones after
    await admission.drain(timeout_s)


def write_headers_and_body_together() -> None:
    """aiohttp joins a message's headers and body into one new buffer before writing them, on
    CPython before 3.12.9 (whose asyncio `writelines` is unsafe there). The gateway runs on
    uvloop, whose `writelines` hands both to one `writev`: that join copied every engine
    request again, 200 kB a call at 32k-token prompts."""
    from aiohttp import http_writer

    http_writer.SKIP_WRITELINES = False


def run(args: argparse.Namespace) -> int:
    import uvloop

    from gateway import config, logs

    write_headers_and_body_together()
    logs.configure(args.log_level, args.log_format)
    cfg = config.from_args(args)
    if not args.admin_key:
        print(
            f"rolltap: generated admin key (pass --admin-key to choose one): {cfg.admin_key}",
            flush=True,
        )
    try:
        uvloop.run(_serve(cfg))
    except KeyboardInterrupt:
        pass
    return 0
