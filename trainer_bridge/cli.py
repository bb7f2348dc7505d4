"""`rolltap bridge`: train a model with TRL's AsyncGRPO on the rollouts the gateway recorded, and
push every new policy to the vLLM replicas and its version to the gateways.

Also runs as `python -m trainer_bridge.cli bridge ...` (without the installed entry point).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

DESCRIPTION = """Train MODEL with TRL's AsyncGRPO trainer on the rollouts the gateway recorded.

Finished rollouts stream in from Postgres (LISTEN/NOTIFY, with polling as a fallback), grouped by
group_id: a group is trained once NUM_GENERATIONS of its rollouts finished, or when its deadline
passes (then trained partial or dropped). Advantages are group-relative per rollout and shared by
every merged sequence of that rollout. After every optimizer step the new weights go to every vLLM
replica and the new policy version to every gateway, so the tokens sampled next carry it.
Several bridges may share one database: leases give every rollout to exactly one of them.

Weight sync:
  disk  write a safetensors checkpoint into --checkpoint-dir (a path every replica can read),
        pause each replica, reload it in place, resume it. Any number of replicas; CPU or GPU.
        vLLM needs VLLM_SERVER_DEV_MODE=1 (rolltap serve-model sets it).
  nccl  TRL's NCCL transfer into one vLLM on GPUs; start vLLM with
        --weight-transfer-config '{"backend":"nccl"}' and VLLM_SERVER_DEV_MODE=1.

On vLLM's CPU build the model must not tie its LM head to its embeddings (an in-place reload
does not refresh a tied head there). `rolltap tiny-model` writes an untied model; for another
model, serve and train an untied copy made by
trainer_bridge.weights.untie_embeddings(MODEL_DIR, DEST).

Example (CPU, the tiny model from `rolltap tiny-model models/tiny`):
  rolltap bridge --model models/tiny --vllm http://127.0.0.1:8000 \\
      --gateway http://127.0.0.1:9000 --admin-key SECRET --num-generations 8 --max-steps 50 \\
      --threads 1"""


def _key_value(text: str) -> tuple[str, object]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def register(subparsers) -> None:
    env = os.environ.get
    parser = subparsers.add_parser(
        "bridge",
        help="train on recorded rollouts with TRL's AsyncGRPO; push weights and versions back",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    where = parser.add_argument_group("where things are")
    where.add_argument("--model", required=True, metavar="PATH",
                       help="model directory to train (the one vLLM serves)")
    where.add_argument("--vllm", action="append", required=True, metavar="URL",
                       help="a vLLM replica to push weights to, e.g. http://127.0.0.1:8000; "
                       "repeat for several (nccl: exactly one)")
    where.add_argument("--gateway", action="append", required=True, metavar="URL",
                       help="a gateway to tell the new policy version; repeat for several")
    where.add_argument("--admin-key", default=env("ROLLTAP_ADMIN_KEY"), metavar="KEY",
                       help="the gateways' admin key (env ROLLTAP_ADMIN_KEY)")
    where.add_argument("--database-url", default=env("ROLLTAP_DATABASE_URL"), metavar="DSN",
                       help="the gateways' Postgres (env ROLLTAP_DATABASE_URL); without it, the "
                       "embedded Postgres in --data-dir")
    where.add_argument("--data-dir", type=Path, default=None, metavar="DIR",
                       help="the gateway's data directory holding its embedded Postgres (env "
                       "ROLLTAP_DATA_DIR; default: the gateway's default)")
    where.add_argument("--output-dir", type=Path, default=Path("runs/bridge"), metavar="DIR",
                       help="trainer output, progress.jsonl and summary.json (default "
                       "%(default)s)")
    where.add_argument("--checkpoint-dir", type=Path, metavar="DIR",
                       help="disk sync: where checkpoints are written for the replicas to load; "
                       "must be the same path on their machines (default OUTPUT_DIR/weights)")

    train = parser.add_argument_group("training")
    train.add_argument("--num-generations", type=int, default=8, metavar="G",
                       help="rollouts per group (per task); a group is trained when G of them "
                       "finished (default %(default)s)")
    train.add_argument("--max-steps", type=int, required=True, metavar="N",
                       help="optimizer steps to train; each is followed by a weight push")
    train.add_argument("--learning-rate", type=float, default=1e-6, metavar="LR",
                       help="AdamW learning rate, constant (default %(default)s)")
    train.add_argument("--loss-normalization", choices=("token", "rollout"), default="token",
                       help="token: TRL's loss, every trained token weighs the same; rollout: "
                       "every rollout weighs the same whatever its length and sequence count "
                       "(default %(default)s)")
    train.add_argument("--no-std-scaling", action="store_true",
                       help="advantage = reward - group mean, not divided by the group's std")
    train.add_argument("--token-budget", type=int, default=16384, metavar="N",
                       help="tokens per micro-batch row; longer sequences are skipped and "
                       "counted, never truncated (default %(default)s)")
    train.add_argument("--max-staleness", type=int, default=4, metavar="N",
                       help="drop samples more than N policy versions old (default %(default)s)")
    train.add_argument("--set", dest="overrides", action="append", default=[],
                       type=_key_value, metavar="KEY=VALUE",
                       help="any other AsyncGRPOConfig field, VALUE as JSON or text, e.g. "
                       "--set gradient_accumulation_steps=4 --set seed=1; repeatable")

    groups = parser.add_argument_group("rollouts and groups")
    groups.add_argument("--group-deadline", type=float, default=600.0, metavar="S",
                        help="seconds after a group's first rollout finished until it is "
                        "released incomplete (default %(default)s)")
    groups.add_argument("--partial-groups", choices=("train", "drop"), default="train",
                        help="what an incomplete group at its deadline becomes (default "
                        "%(default)s)")
    groups.add_argument("--match", dest="match", action="append", default=[], type=_key_value,
                        metavar="KEY=VALUE",
                        help="only rollouts whose metadata has KEY=VALUE (VALUE as JSON or "
                        "text); repeatable")
    groups.add_argument("--queue-size", type=int, default=64, metavar="N",
                        help="claim new groups only while fewer than N samples wait for the "
                        "trainer (default %(default)s)")
    groups.add_argument("--lease-seconds", type=float, default=60.0, metavar="S",
                        help="how long a claimed group stays this bridge's if it dies before "
                        "delivering it (default %(default)s)")
    groups.add_argument("--poll-interval", type=float, default=2.0, metavar="S",
                        help="seconds between looks at the database when no notification "
                        "arrives (default %(default)s)")

    train.add_argument("--threads", type=int, metavar="N",
                       help="CPU threads for the trainer (default: torch's choice); on a CPU "
                       "shared with vLLM, 1 keeps the two from stalling each other")

    weights = parser.add_argument_group("weights")
    weights.add_argument("--weight-sync", choices=("disk", "nccl"), default="disk",
                         help="how new weights reach vLLM (see above; default %(default)s)")
    weights.add_argument("--keep-checkpoints", type=int, default=2, metavar="N",
                         help="disk sync: newest checkpoints kept; the last is the trained "
                         "model (default %(default)s)")
    parser.set_defaults(func=_run)


def _offline() -> None:
    # Nothing here needs the Hub: the model is a local directory, and telemetry would only time
    # out on machines without internet.
    for name in ("HF_HUB_OFFLINE", "HF_HUB_DISABLE_TELEMETRY", "TRANSFORMERS_OFFLINE",
                 "DO_NOT_TRACK"):
        os.environ.setdefault(name, "1")


def _interrupt_on_sigterm() -> None:
    # TRL stops the rollout source and the weight transfer in a `finally`; SIGTERM should get
    # there too, so leases are not left to expire and engines are not left paused.
    def interrupt(_signum, _frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)


def _database_url(args: argparse.Namespace) -> str:
    if args.database_url:
        return args.database_url
    from gateway.config import default_data_dir
    from gateway.store.db import start_embedded

    data_dir = args.data_dir or Path(os.environ.get("ROLLTAP_DATA_DIR") or default_data_dir())
    print(f"rolltap bridge: no --database-url; using the embedded Postgres in {data_dir}",
          flush=True)
    return start_embedded(data_dir)


def _run(args: argparse.Namespace) -> int:
    _offline()
    if not args.admin_key:
        print("error: --admin-key (or ROLLTAP_ADMIN_KEY) is required", file=sys.stderr)
        return 2
    import torch

    if args.weight_sync == "nccl":
        if not torch.cuda.is_available():
            print("error: --weight-sync nccl needs CUDA (TRL's NCCL transfer runs between GPUs); "
                  "use --weight-sync disk on this machine", file=sys.stderr)
            return 2
        if len(args.vllm) != 1:
            print("error: --weight-sync nccl talks to exactly one vLLM; use --weight-sync disk "
                  "for several replicas", file=sys.stderr)
            return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    _interrupt_on_sigterm()

    from transformers import AutoTokenizer
    from transformers.trainer_callback import PrinterCallback

    from trainer_bridge.progress import Progress
    from trainer_bridge.source import RolloutSource, SourceConfig
    from trainer_bridge.trainer import make_trainer
    from trainer_bridge.weights import (
        DiskWeightSync,
        PolicyAnnouncer,
        VersionedTransfer,
        WeightSyncError,
    )

    output_dir = args.output_dir
    output_dir.mkdir(parents=True, exist_ok=True)
    announcer = PolicyAnnouncer.from_gateways(args.gateway, args.admin_key)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    source = RolloutSource(
        SourceConfig(
            database_url=_database_url(args),
            num_generations=args.num_generations,
            token_budget=args.token_budget,
            group_deadline_s=args.group_deadline,
            partial_groups=args.partial_groups,
            scale_std=not args.no_std_scaling,
            max_staleness=args.max_staleness,
            queue_size=args.queue_size,
            lease_s=args.lease_seconds,
            poll_interval_s=args.poll_interval,
            match=dict(args.match),
            version_offset=announcer.offset,
        ),
        decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=False),
    )
    disk = None
    if args.weight_sync == "disk":
        disk = DiskWeightSync(
            args.model,
            args.checkpoint_dir or output_dir / "weights",
            args.vllm,
            keep=args.keep_checkpoints,
        )
    trainer = make_trainer(
        args.model,
        rollout_worker=source,
        # None: TRL builds its own NCCL transfer to the vLLM named below.
        weight_transfer=VersionedTransfer(disk, announcer) if disk else None,
        output_dir=output_dir,
        loss_normalization=args.loss_normalization,
        processing_class=tokenizer,
        # `--set` wins, also over the fields that have flags of their own (`--set
        # token_budget=0` makes TRL count samples per micro-batch instead of tokens, while the
        # bridge still skips sequences longer than --token-budget).
        **{
            "max_steps": args.max_steps,
            "token_budget": args.token_budget,
            "learning_rate": args.learning_rate,
            "max_staleness": args.max_staleness,
            "num_generations": args.num_generations,
            "vllm_server_base_url": args.vllm[0],
            "save_strategy": "no",
            "report_to": "none",
            "disable_tqdm": True,
            **dict(args.overrides),
        },
    )
    if disk is None:
        trainer.weight_transfer = VersionedTransfer(trainer.weight_transfer, announcer)
    progress = Progress(source, trainer.weight_transfer, output_dir / "progress.jsonl")
    trainer.remove_callback(PrinterCallback)
    trainer.add_callback(progress)

    print(f"rolltap bridge: training {args.model} for {args.max_steps} steps; rollouts from "
          f"the database, groups of {args.num_generations}; versions from "
          f"{announcer.offset + 1} on {len(announcer.gateways)} gateway(s); "
          f"weights by {args.weight_sync} to {len(args.vllm)} vLLM replica(s)", flush=True)
    started = time.monotonic()
    code = 0
    try:
        trainer.train()
    except KeyboardInterrupt:
        print("\nrolltap bridge: interrupted", file=sys.stderr)
        code = 130
    except WeightSyncError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    summary = progress.summary(
        elapsed_s=time.monotonic() - started,
        steps=trainer.state.global_step,
        checkpoint=disk.latest if disk else None,
    )
    (output_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(progress.format_summary(summary), flush=True)
    return code


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rolltap")
    register(parser.add_subparsers(dest="command", metavar="COMMAND", required=True))
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
