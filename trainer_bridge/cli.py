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

A micro-batch the trainer holds open trains as it is once no new sample came for --flush-after
seconds, so a finite run trains everything it took; --until-empty ends the run once nothing is
left to deliver. SIGTERM or Ctrl-C during a step's push lets the push finish first.

After a crash, restart with the same flags and --resume (either weight sync): the bridge starts
from the newest complete checkpoint in --checkpoint-dir (weights, optimizer, scheduler, step),
and the rollouts that steps after it logged go back to the queue, so the log says exactly what
the weights hold.

Weight sync:
  disk  write a safetensors checkpoint into --checkpoint-dir (a path every replica can read),
        pause each replica, reload it in place, resume it. Any number of replicas; CPU or GPU.
        vLLM needs VLLM_SERVER_DEV_MODE=1 (rolltap serve-model sets it).
  nccl  TRL's NCCL transfer into exactly one vLLM server (tensor parallel inside it is fine)
        on GPUs; `rolltap serve-model --device gpu` starts it with the transfer engine
        (--weight-transfer-config '{"backend":"nccl"}') and VLLM_SERVER_DEV_MODE=1. Several
        replicas: use disk for all of them (one bridge has one sync mode).

On GPUs the policy trains in bfloat16 (serve vLLM in bfloat16 too: serve-model's GPU default),
and TRL's packed attention loads the flash-attention kernel from the Hugging Face Hub at start
(the `kernels` package of the gpu extra; with HF_HUB_OFFLINE=1 it must be in the cache already).
--print-config shows the resolved configuration, device and precision included, and exits.

On vLLM's CPU build the model must not tie its LM head to its embeddings (an in-place reload
does not refresh a tied head there). `rolltap tiny-model` writes an untied model; for another
model, serve and train an untied copy made by
trainer_bridge.checkpoints.untie_embeddings(MODEL_DIR, DEST).

Example (CPU, the tiny model from `rolltap tiny-model models/tiny`):
  rolltap bridge --model models/tiny --vllm http://127.0.0.1:8000 \\
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
    parser.add_argument("--print-config", action="store_true",
                        help="print the resolved configuration (device, precision, trainer "
                        "fields, weight sync) as JSON and exit without connecting to anything")
    parser.set_defaults(func=_run)


def training_device(weight_sync: str, cuda: bool) -> str:
    """Where the policy trains: NCCL sync exists only between GPUs, so it means "gpu" even
    where this machine has none (the run then refuses to start, the printed configuration
    shows the GPU one)."""
    return "gpu" if cuda or weight_sync == "nccl" else "cpu"


def resolved_config(config, device: str) -> dict:
    """What the run would use, secrets and the database address left out: the trainer's
    fields, and where rollouts come from and weights go."""
    from trainer_bridge.trainer import trainer_fields

    return {
        "model": str(config.model),
        "device": device,
        "weight_sync": config.weight_sync,
        "vllm": config.vllm,
        "gateways": config.gateway,
        "trainer": trainer_fields(config, device),
        "checkpoint_dir": str(_checkpoint_dir(config)),
    }


def _offline(device: str) -> None:
    # The model is a local directory, and telemetry would only time out on machines without
    # internet. On a CPU nothing needs the Hub; on GPUs TRL's packed attention fetches its
    # flash-attention kernel from it (cached afterwards), so offline is the user's choice there.
    names = ["HF_HUB_DISABLE_TELEMETRY", "DO_NOT_TRACK"]
    if device == "cpu":
        names += ["HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"]
    for name in names:
        os.environ.setdefault(name, "1")


def _interrupt_on_sigterm() -> None:
    # TRL stops the rollout source and the weight transfer in a `finally`; SIGTERM should get
    # there too, so leases are not left to expire and engines are not left paused.
    def interrupt(_signum, _frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)


def _resume_point(config, database_url: str):
    """The checkpoint to resume from (or None) and its delivery history; the rollouts that later
    steps logged are back in the queue."""
    from trainer_bridge import resume

    if not config.resume:
        return None, {}
    checkpoint_dir = _checkpoint_dir(config)
    checkpoint = resume.newest_resumable(checkpoint_dir)
    if checkpoint is None:
        print(f"rolltap bridge: --resume: {checkpoint_dir} holds no complete checkpoint; "
              f"starting from {config.model}", flush=True)
        return None, {}
    history = resume.read_history(checkpoint)
    reverted = resume.revert_to(database_url, history)
    print(f"rolltap bridge: resuming from {checkpoint} (step {max(history.values(), default=0)}"
          f", weights, optimizer and scheduler); {len(reverted)} rollouts that later steps "
          "had logged are back in the queue", flush=True)
    return checkpoint, history


def _checkpoint_dir(config) -> Path:
    return config.checkpoint_dir or config.output_dir / "weights"


def _take_back_unsaved(checkpoint_dir, database_url: str) -> None:
    """A stopped bridge puts back in the queue what it logged after its last complete
    checkpoint, so the log says what the weights it leaves hold (as a resume would)."""
    from trainer_bridge import resume

    if (checkpoint := resume.newest_resumable(checkpoint_dir)) is not None:
        if reverted := resume.revert_to(database_url, resume.read_history(checkpoint)):
            print(f"rolltap bridge: {len(reverted)} rollouts logged after {checkpoint.name} "
                  "are back in the queue", file=sys.stderr, flush=True)


def _database_url(config) -> str:
    if config.database_url:
        return config.database_url
    from core.paths import default_data_dir
    from core.store.db import start_embedded

    data_dir = config.data_dir or default_data_dir()
    print(f"rolltap bridge: no --database-url; using the embedded Postgres in {data_dir}",
          flush=True)
    return start_embedded(data_dir)


def _trainer_sampling(config) -> dict[str, float]:
    """The sampling the trainer will train under: AsyncGRPOConfig's defaults, the bridge's
    temperature, and any `--set` of them."""
    import dataclasses

    from trl.experimental.async_grpo.async_grpo_config import AsyncGRPOConfig

    from trainer_bridge.policy import trainer_sampling

    defaults = {f.name: f.default for f in dataclasses.fields(AsyncGRPOConfig)}
    return trainer_sampling({**defaults, "temperature": config.temperature, **config.overrides})


def _refusal(config, cuda: bool) -> str | None:
    """Why the settings cannot run here, before anything loads."""
    if not config.admin_key:
        return "--admin-key (or ROLLTAP_ADMIN_KEY) is required"
    if config.weight_sync == "nccl" and not cuda:
        return ("--weight-sync nccl needs CUDA (TRL's NCCL transfer runs between GPUs); use "
                "--weight-sync disk on this machine")
    if config.weight_sync == "nccl" and len(config.vllm) != 1:
        return ("--weight-sync nccl talks to exactly one vLLM; use --weight-sync disk for "
                "several replicas")
    return None


def _warn_unsynced(unsynced: list[tuple[str, str]]) -> None:
    for gateway, upstream in unsynced:
        print(f"warning: gateway {gateway} routes to {upstream}, which is not a --vllm of this "
              "bridge: unless it is one of them under another name, it keeps its weights while "
              "its tokens get the new versions", file=sys.stderr, flush=True)


def _disk_sync(config, resume_from: Path | None):
    """The disk weight sync of `--weight-sync disk`; None with NCCL (TRL builds that one)."""
    if config.weight_sync != "disk":
        return None
    from trainer_bridge.resume import resumable
    from trainer_bridge.weights import DiskWeightSync

    return DiskWeightSync(
        config.model,
        _checkpoint_dir(config),
        config.vllm,
        keep=config.keep_checkpoints,
        resumable=resumable,
        protected=[resume_from] if resume_from else [],
    )


def _run(args: argparse.Namespace) -> int:
    from trainer_bridge import preflight
    from trainer_bridge.config import BridgeConfig

    preflight.silence_checked_vllm_warning()
    try:
        config = BridgeConfig.from_args(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    import torch

    device = training_device(config.weight_sync, torch.cuda.is_available())
    if args.print_config:
        print(json.dumps(resolved_config(config, device), indent=2), flush=True)
        return 0
    _offline(device)
    if refusal := _refusal(config, torch.cuda.is_available()):
        print(f"error: {refusal}", file=sys.stderr)
        return 2
    # Before the model loads: what is not there is said within seconds.
    if problems := preflight.problems(config):
        print("\n".join(f"error: {p}" for p in problems), file=sys.stderr)
        return 2
    if config.threads:
        torch.set_num_threads(config.threads)
    _interrupt_on_sigterm()

    from transformers import AutoTokenizer
    from transformers.trainer_callback import PrinterCallback

    from trainer_bridge.policy import SamplingMismatch, check_sampling
    from trainer_bridge.progress import Progress
    from trainer_bridge.resume import StateWriter
    from trainer_bridge.source import RolloutSource
    from trainer_bridge.trainer import KernelUnavailable, make_trainer
    from trainer_bridge.versions import (
        PauseLease,
        PolicyAnnouncer,
        VersionedTransfer,
        gateway_upstreams,
        unsynced_upstreams,
    )
    from trainer_bridge.weights import (
        DiskWeightSync,
        NcclWeightSync,
        StateCheckpoints,
    )

    admin_key = config.admin_key or ""  # `_refusal` made sure it is set
    announcer = PolicyAnnouncer.from_gateways(config.gateway, admin_key)
    try:
        check_sampling(announcer.policies, _trainer_sampling(config))
    except SamplingMismatch as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    database_url = _database_url(config)
    announcer.use_database(database_url)
    _warn_unsynced(unsynced_upstreams(gateway_upstreams(config.gateway, admin_key),
                                      config.vllm))
    output_dir = config.output_dir
    output_dir.mkdir(parents=True, exist_ok=True)
    resume_from, history = _resume_point(config, database_url)
    tokenizer = AutoTokenizer.from_pretrained(config.model)
    source = RolloutSource(
        config.source_config(database_url, version_offset=announcer.offset),
        decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=False),
    )
    disk = _disk_sync(config, resume_from)
    lease = PauseLease(config.gateway, admin_key, config.vllm, config.pause_lease_seconds)
    try:
        trainer = make_trainer(
            config,
            rollout_worker=source,
            # None: TRL builds its own NCCL transfer to the vLLM named in the config.
            weight_transfer=VersionedTransfer(disk, announcer, lease) if disk else None,
            processing_class=tokenizer,
        )
    except KernelUnavailable as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    state_writer = StateWriter(trainer, source.owner, history, config.state_every)
    checkpoints: DiskWeightSync | StateCheckpoints
    if disk is not None:
        checkpoints = disk
    else:
        # NCCL writes no checkpoint of its own: every --state-every pushes write one to resume
        # from, from the same pass over the weights.
        checkpoints = StateCheckpoints(
            config.model, _checkpoint_dir(config),
            due=lambda: trainer.state.global_step % config.state_every == 0,
            keep=config.keep_checkpoints, protected=[resume_from] if resume_from else [])
        trainer.weight_transfer = VersionedTransfer(
            NcclWeightSync(trainer.weight_transfer, config.vllm[0], state=checkpoints),
            announcer, lease)
    checkpoints.add_state = state_writer
    trainer.stop.install()
    progress = Progress(source, trainer.weight_transfer, output_dir / "progress.jsonl")
    trainer.remove_callback(PrinterCallback)
    trainer.add_callback(progress)

    print(f"rolltap bridge: training {config.model} for {config.max_steps} steps; rollouts from "
          f"the database, groups of {config.num_generations}; versions from "
          f"{announcer.offset + 1} on {len(announcer.gateways)} gateway(s); "
          f"weights by {config.weight_sync} to {len(config.vllm)} vLLM replica(s)", flush=True)
    started = time.monotonic()
    code = _train(trainer, config, source, resume_from, checkpoints.checkpoint_dir, database_url)
    if code == 1:
        return code
    summary = progress.summary(
        elapsed_s=time.monotonic() - started,
        steps=trainer.state.global_step,
        checkpoint=checkpoints.latest,
    )
    (output_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(progress.format_summary(summary), flush=True)
    return code


def _train(trainer, config, source, resume_from: Path | None, checkpoint_dir: Path,
           database_url: str) -> int:
    """Trains (its /metrics served meanwhile with --metrics-port); 0 when the run ended, 130
    when interrupted (steps past the newest checkpoint taken back) or stopped at a step's end,
    1 when the weights could not be pushed."""
    from trainer_bridge.metrics import TrainerCollector
    from trainer_bridge.metrics import serve as serve_metrics
    from trainer_bridge.weights import WeightSyncError

    metrics = None if config.metrics_port is None else serve_metrics(
        TrainerCollector(source.delivery_queue, source.stats, lambda: trainer.state.global_step),
        config.metrics_port)
    try:
        trainer.train(resume_from_checkpoint=str(resume_from) if resume_from else None)
    except KeyboardInterrupt:
        print("\nrolltap bridge: interrupted", file=sys.stderr)
        _take_back_unsaved(checkpoint_dir, database_url)
        return 130
    except WeightSyncError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    finally:
        if metrics is not None:
            metrics.shutdown()
    if trainer.stop.requested:
        # Stopped at the end of a step, its push and checkpoint written: nothing to take back.
        print(f"rolltap bridge: stopped after step {trainer.state.global_step}, checkpointed",
              file=sys.stderr)
        return 130
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rolltap")
    register(parser.add_subparsers(dest="command", metavar="COMMAND", required=True))
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
