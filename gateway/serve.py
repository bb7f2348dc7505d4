"""`rolltap gateway`: run the recording gateway."""

from __future__ import annotations

import argparse
import asyncio
import logging


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
    parser.set_defaults(func=run)


async def _serve(cfg) -> None:
    from aiohttp import web

    from gateway.app import build_app
    from gateway.store.db import open_pool, start_embedded

    dsn = cfg.database_url
    if dsn is None:
        print(
            f"rolltap: no --database-url; starting embedded Postgres in {cfg.data_dir}", flush=True
        )
        dsn = await asyncio.to_thread(start_embedded, cfg.data_dir)
    try:
        pool = await open_pool(
            dsn,
            acquire_timeout=cfg.db_acquire_timeout_s,
            command_timeout=cfg.db_command_timeout_s,
        )
    except Exception as exc:  # noqa: BLE001 - asyncpg raises many unrelated types here
        raise SystemExit(
            f"rolltap gateway: cannot open database {dsn!r}: {exc}. Check "
            "--database-url (or drop it to use the embedded Postgres)."
        ) from exc
    app = build_app(cfg, pool)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, cfg.host, cfg.port, backlog=1024)
    await site.start()
    print(
        f"rolltap gateway listening on http://{cfg.host}:{cfg.port} "
        f"(public {cfg.public_url}); upstreams: {', '.join(cfg.upstreams)}",
        flush=True,
    )
    try:
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()
        await pool.close()


def run(args: argparse.Namespace) -> int:
    import uvloop

    from gateway import config

    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
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
