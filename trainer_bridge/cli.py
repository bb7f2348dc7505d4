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

DESCRIPTION = """Train MODEL with TRL's AsyncGRPO trainer on the rollouts the gateway recorded.

Finished rollouts stream in from Postgres (LISTEN/NOTIFY, with polling as a fallback), grouped by
group_id: a group is trained once NUM_GENERATIONS of its rollouts finished, or when its deadline
passes (then trained partial or dropped). Advantages are group-relative per rollout and shared by
every merged sequence of that rollout. After every optimizer step the new weights go to every vLLM
replica and the new policy version to every gateway, so the tokens sampled next carry it.
Several bridges may share one database: leases give every rollout to exactly one of them.
A trace counts as delivered only once an optimizer step has taken it (logged in the table
`deliveries` right after the step): a bridge that crashes before that delivers it again after a
restart, with the advantages fixed when its group was first released; after it, never.
Every flag can also be set by its ROLLTAP_* environment variable (named in its help).

Weight sync:
  disk  write a safetensors checkpoint into --checkpoint-dir (a path every replica can read),
        pause each replica, reload it in place, resume it. Any number of replicas; CPU or GPU.
        vLLM needs VLLM_SERVER_DEV_MODE=1 (rolltap serve-model sets it).
  nccl  TRL's NCCL transfer into one vLLM on GPUs; start vLLM with
        --weight-transfer-config '{"backend":"nccl"}' and VLLM_SERVER_DEV_MODE=1.

On vLLM's CPU build the model must not tie its LM head to its embeddings (an in-place reload
does not refresh a tied head there); serve and train an untied copy, made by
trainer_bridge.weights.untie_embeddings(MODEL_DIR, DEST).

Example (CPU, an untied copy of the tiny model):
  rolltap bridge --model models/tiny-untied --vllm http://127.0.0.1:8000 \\
      --gateway http://127.0.0.1:9000 --admin-key SECRET --num-generations 8 --max-steps 50 \\
      --threads 1"""


def register(subparsers) -> None:
    from trainer_bridge.config import BridgeConfig

    parser = subparsers.add_parser(
        "bridge",
        help="train on recorded rollouts with TRL's AsyncGRPO; push weights and versions back",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    BridgeConfig.add_arguments(parser, required=("model", "vllm", "gateway", "max_steps"))
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


def _database_url(config) -> str:
    if config.database_url:
        return config.database_url
    from gateway.config import default_data_dir
    from gateway.store.db import start_embedded

    data_dir = config.data_dir or default_data_dir()
    print(f"rolltap bridge: no --database-url; using the embedded Postgres in {data_dir}",
          flush=True)
    return start_embedded(data_dir)


def _trainer_sampling(config) -> dict[str, float]:
    """The sampling the trainer will train under: AsyncGRPOConfig's defaults, the bridge's
    temperature, and any `--set` of them."""
    import dataclasses

    from trl.experimental.async_grpo import AsyncGRPOConfig

    from trainer_bridge.policy import trainer_sampling

    defaults = {f.name: f.default for f in dataclasses.fields(AsyncGRPOConfig)}
    return trainer_sampling({**defaults, "temperature": config.temperature, **config.overrides})


def _run(args: argparse.Namespace) -> int:
    from trainer_bridge.config import BridgeConfig

    _offline()
    try:
        config = BridgeConfig.from_args(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if not config.admin_key:
        print("error: --admin-key (or ROLLTAP_ADMIN_KEY) is required", file=sys.stderr)
        return 2
    import torch

    if config.weight_sync == "nccl":
        if not torch.cuda.is_available():
            print("error: --weight-sync nccl needs CUDA (TRL's NCCL transfer runs between GPUs); "
                  "use --weight-sync disk on this machine", file=sys.stderr)
            return 2
        if len(config.vllm) != 1:
            print("error: --weight-sync nccl talks to exactly one vLLM; use --weight-sync disk "
                  "for several replicas", file=sys.stderr)
            return 2
    if config.threads:
        torch.set_num_threads(config.threads)
    _interrupt_on_sigterm()

    from transformers import AutoTokenizer
    from transformers.trainer_callback import PrinterCallback

    from trainer_bridge.policy import SamplingMismatch, check_sampling
    from trainer_bridge.progress import Progress
    from trainer_bridge.source import RolloutSource
    from trainer_bridge.trainer import make_trainer
    from trainer_bridge.weights import (
        DiskWeightSync,
        PolicyAnnouncer,
        VersionedTransfer,
        WeightSyncError,
    )

    announcer = PolicyAnnouncer.from_gateways(config.gateway, config.admin_key)
    try:
        check_sampling(announcer.policies, _trainer_sampling(config))
    except SamplingMismatch as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    output_dir = config.output_dir
    output_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(config.model)
    source = RolloutSource(
        config.source_config(_database_url(config), version_offset=announcer.offset),
        decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=False),
    )
    disk = None
    if config.weight_sync == "disk":
        disk = DiskWeightSync(
            config.model,
            config.checkpoint_dir or output_dir / "weights",
            config.vllm,
            keep=config.keep_checkpoints,
        )
    trainer = make_trainer(
        config,
        rollout_worker=source,
        # None: TRL builds its own NCCL transfer to the vLLM named in the config.
        weight_transfer=VersionedTransfer(disk, announcer) if disk else None,
        processing_class=tokenizer,
    )
    if disk is None:
        trainer.weight_transfer = VersionedTransfer(trainer.weight_transfer, announcer)
    progress = Progress(source, trainer.weight_transfer, output_dir / "progress.jsonl")
    trainer.remove_callback(PrinterCallback)
    trainer.add_callback(progress)

    print(f"rolltap bridge: training {config.model} for {config.max_steps} steps; rollouts from "
          f"the database, groups of {config.num_generations}; versions from "
          f"{announcer.offset + 1} on {len(announcer.gateways)} gateway(s); "
          f"weights by {config.weight_sync} to {len(config.vllm)} vLLM replica(s)", flush=True)
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
