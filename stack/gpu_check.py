"""`make gpu-check`: the GPU recipe run for real, on a user's GPU node, in a few minutes.

It starts vLLM on one GPU exactly as the README does (`rolltap serve-model --device gpu`), the
gateway with its embedded Postgres, and `rolltap bridge --weight-sync nccl` on another GPU for 2
optimizer steps of the tiny model (built offline) on the toy task, whose rollouts an agent plays
through the gateway meanwhile. Then it prints PASS or FAIL for each stage:

  CUDA devices           at least two GPUs, one to serve and one to train
  vLLM on GPU            the server answers /health
  transfer engine        the bridge joined vLLM's NCCL weight-transfer group
  bridge                 the bridge trained its steps and exited cleanly
  weights pushed         vLLM's own weight checksums changed
  version bumped         the gateway stamps the version of the last push
  output changed         the greedy answer's tokens or logprobs differ from before training

Where no GPU is visible it fails at the first stage ("no CUDA device") before anything is
installed or started. The logs of every process stay in the working directory.

This module imports nothing outside the standard library at import time, so the Makefile can
run the first stage (`--preflight`) with any Python before it installs the GPU environment.
"""

from __future__ import annotations

import argparse
import secrets
import shutil
import subprocess
import sys
import threading
from pathlib import Path

STEPS = 2
# The cold push at train begin, then one per optimizer step.
PUSHES = STEPS + 1
PROBE = [{"role": "user", "content": "Write eight nouns from the list, separated by spaces."}]


class Stages:
    """Prints each stage's verdict as it is reached and remembers whether all passed."""

    def __init__(self) -> None:
        self.failed: list[str] = []

    def check(self, name: str, ok: bool, detail: str) -> bool:
        print(f"{'PASS' if ok else 'FAIL'}  {name}: {detail}", flush=True)
        if not ok:
            self.failed.append(name)
        return ok

    def exit_code(self) -> int:
        if self.failed:
            print(f"gpu-check: FAILED at {', '.join(self.failed)}", flush=True)
            return 1
        print("gpu-check: all stages passed", flush=True)
        return 0


def listed_gpus() -> list[str]:
    """The GPUs `nvidia-smi -L` lists: none where the driver or its tool is absent."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return []
    try:
        listing = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return []
    if listing.returncode != 0:
        return []
    return [line for line in listing.stdout.splitlines() if line.startswith("GPU ")]


def check_devices(stages: Stages, count: int, needed: int, how: str) -> bool:
    if count == 0:
        return stages.check(
            "CUDA devices", False,
            f"no CUDA device ({how}). make gpu-check runs on a node with NVIDIA GPUs and "
            "their driver; nothing was started.",
        )
    return stages.check(
        "CUDA devices", count >= needed,
        f"{count} visible ({how}); the check needs {needed}: one serves, one trains",
    )


def _greedy(url: str) -> dict:
    import httpx

    response = httpx.post(f"{url}/v1/chat/completions", timeout=120, json={
        "model": "tiny", "messages": PROBE, "max_tokens": 16, "temperature": 0,
        "logprobs": True, "top_logprobs": 0, "return_token_ids": True,
    })
    response.raise_for_status()
    choice = response.json()["choices"][0]
    return {"ids": choice["token_ids"],
            "logprobs": [entry["logprob"] for entry in choice["logprobs"]["content"]]}


def _checksums(url: str) -> dict[str, str]:
    import httpx

    response = httpx.post(f"{url}/weight_checker", json={"action": "checksum"}, timeout=300)
    response.raise_for_status()
    return response.json()["checksums"]


def _output_changed(before: dict, after: dict) -> tuple[bool, str]:
    if before["ids"] != after["ids"]:
        return True, f"greedy tokens {before['ids'][:6]}… became {after['ids'][:6]}…"
    gap = max((abs(a - b) for a, b in zip(before["logprobs"], after["logprobs"])), default=0.0)
    return gap > 1e-3, f"same greedy tokens; largest logprob change {gap:.4f}"


def run(args: argparse.Namespace) -> int:
    stages = Stages()
    gpus = listed_gpus()
    if not check_devices(stages, len(gpus), 2, "nvidia-smi -L"):
        return stages.exit_code()
    if args.preflight:
        return 0

    import torch

    if not check_devices(stages, torch.cuda.device_count(), 2, "torch.cuda.device_count()"):
        return stages.exit_code()

    from stack.launcher import (
        ROLLTAP,
        Processes,
        admin_client,
        free_port,
        start_gateway,
        stop_embedded_postgres,
    )
    from stack.serve_model import VllmStartError, start_vllm
    from stack.tiny_model import write_tiny_model
    from stack.toy_task import ToyTask, run_toy_rollouts
    from trainer_bridge.config import match_arg

    workdir: Path = args.dir.resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    model_dir = workdir / "tiny"
    if not (model_dir / "model.safetensors").exists():
        write_tiny_model(model_dir)
    admin_key = secrets.token_urlsafe(16)
    procs = Processes()
    vllm = start_vllm(model_dir, free_port(), device="gpu", gpus=(args.serve_gpu,),
                      served_model_name="tiny", max_model_len=2048,
                      extra_args=["--gpu-memory-utilization", "0.5"],
                      log_path=workdir / "vllm.log")
    print(f"$ {vllm.command_line()}", flush=True)
    try:
        try:
            vllm.wait_ready(args.timeout)
        except VllmStartError as exc:
            stages.check("vLLM on GPU", False, str(exc))
            return stages.exit_code()
        stages.check("vLLM on GPU", True, f"GPU {args.serve_gpu}, {vllm.url}")

        gw_port = free_port()
        gateway = f"http://127.0.0.1:{gw_port}"
        start_gateway(procs, workdir, vllm.url, gw_port, admin_key)
        admin = admin_client(gateway, admin_key)
        start_version = admin.get("/admin/policy").json()["version"]
        before, sums_before = _greedy(vllm.url), _checksums(vllm.url)

        run_id = secrets.token_hex(4)
        bridge_log = workdir / "bridge.log"
        bridge = procs.start(
            [*ROLLTAP, "bridge", "--model", str(model_dir), "--vllm", vllm.url,
             "--gateway", gateway, "--data-dir", str(workdir / "data"),
             "--weight-sync", "nccl", "--max-steps", str(STEPS), "--num-generations", "8",
             "--learning-rate", "2e-2", "--token-budget", "420", "--queue-size", "24",
             "--match", match_arg("run", run_id), "--output-dir", str(workdir / f"train-{run_id}")],
            bridge_log,
            env={"ROLLTAP_ADMIN_KEY": admin_key, "CUDA_VISIBLE_DEVICES": str(args.train_gpu)},
        )
        print(f"   bridge on GPU {args.train_gpu}, log {bridge_log}", flush=True)
        stop = threading.Event()
        task = ToyTask(gateway, admin_key, "tiny", model_dir, metadata={"run": run_id})
        player = threading.Thread(
            target=run_toy_rollouts, args=(task,), kwargs={"group_size": 8, "stop": stop},
            daemon=True)
        player.start()
        try:
            code = bridge.wait(args.timeout)
        except subprocess.TimeoutExpired:
            code = None
        stop.set()
        player.join(120)
        log_text = bridge_log.read_text(errors="replace")
        stages.check("transfer engine", "NCCL weight transfer to" in log_text,
                     "the bridge joined vLLM's NCCL group" if "NCCL weight transfer to" in log_text
                     else f"the bridge never initialised it; see {bridge_log}")
        stages.check("bridge", code == 0,
                     f"{STEPS} optimizer steps, exit code 0" if code == 0 else
                     f"exit code {code} (None: still running after {args.timeout:.0f} s); "
                     f"last lines of {bridge_log}:\n{log_text[-3000:]}")
        sums_after = _checksums(vllm.url)
        changed = sum(sums_after.get(k) != v for k, v in sums_before.items())
        stages.check("weights pushed", changed > 0,
                     f"{changed} of {len(sums_before)} weight checksums changed in vLLM")
        version = admin.get("/admin/policy").json()["version"]
        stages.check("version bumped", version == start_version + PUSHES,
                     f"gateway policy version {start_version} -> {version} (expected "
                     f"{start_version + PUSHES}: the first push, then one per step)")
        ok, detail = _output_changed(before, _greedy(vllm.url))
        stages.check("output changed", ok, detail)
    finally:
        procs.stop_all()
        vllm.stop()
        stop_embedded_postgres(workdir / "data" / "pgdata")
    return stages.exit_code()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m stack.gpu_check",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--dir", type=Path, default=Path("runs/gpu-check"),
                        help="working directory: model, logs, database (default %(default)s)")
    parser.add_argument("--serve-gpu", type=int, default=0, metavar="N",
                        help="GPU index vLLM serves on (default %(default)s)")
    parser.add_argument("--train-gpu", type=int, default=1, metavar="N",
                        help="GPU index the bridge trains on (default %(default)s)")
    parser.add_argument("--timeout", type=float, default=1200.0, metavar="S",
                        help="seconds allowed for vLLM to start and for the bridge's run "
                        "(default %(default)s)")
    parser.add_argument("--preflight", action="store_true",
                        help="only the first stage (are there GPUs?), with no dependency "
                        "beyond the standard library")
    args = parser.parse_args(argv)
    if args.serve_gpu == args.train_gpu:
        parser.error("--serve-gpu and --train-gpu must differ: NCCL refuses one GPU on both "
                     "ends of the transfer")
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
