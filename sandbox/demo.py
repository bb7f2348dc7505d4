"""`rolltap demo`: the whole loop on this machine, from nothing, on the CPU.

Builds the tiny model offline, starts vLLM (CPU build) and the gateway with its embedded
Postgres, then:
- plays a multi-turn, tool-using conversation through the gateway with the official `openai`
  SDK as one rollout and shows what was recorded (the engine's token ids, logprobs and policy
  versions of every call) and how the calls merged into one training sequence;
- runs the sandbox runner with the scripted `python` harness over an example coding task, the
  hidden tests giving the rewards;
- trains: `rolltap bridge` (TRL's AsyncGRPO on the CPU) learns a toy task from rollouts played
  through the gateway, pushing every new policy back to vLLM and its version to the gateway,
  and the reward per step climbs.
Every part is a separate process driven over HTTP, exactly as in a deployment.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from trainer_bridge.serve_model import die_with_parent

EXAMPLE_TASKS = Path(__file__).resolve().parents[1] / "examples" / "tasks" / "tasks.jsonl"

DEMO_TOOL = {
    "type": "function",
    "function": {
        "name": "run_tests",
        "description": "Run the project's tests and report the result",
        "parameters": {
            "type": "object",
            "properties": {"suite": {"type": "string", "enum": ["unit", "integration"]}},
            "required": ["suite"],
            "additionalProperties": False,
        },
        # Strict: vLLM holds the arguments to the schema, so even a random model calls validly.
        "strict": True,
    },
}


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "demo",
        help="run the whole stack on this machine (tiny model, vLLM, gateway, Postgres)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--dir", type=Path, default=Path("runs/demo"),
                        help="working directory for the model, logs and database "
                        "(default: %(default)s)")
    parser.add_argument("--turns", type=int, default=3, help="tool-using turns (default 3)")
    parser.add_argument("--train-steps", type=int, default=None,
                        help="optimizer steps of the training stage (default 24 with the tiny "
                        "model, 16 with smol; 0 skips it)")
    parser.add_argument("--model", choices=("tiny", "smol"), default="tiny",
                        help="tiny: the random tiny model, toy training task (default); smol: "
                        "SmolLM2-135M-Instruct learning the coding tasks of examples/smol-tasks "
                        "through sandboxes and hidden tests (see sandbox/real_demo.py)")
    parser.add_argument("--gateway-port", type=int, default=None, metavar="PORT",
                        help="port of the demo's gateway (default: a free one); the container "
                        "image sets 9000 for its health check")
    from sandbox.real_demo import add_arguments

    add_arguments(parser)
    parser.set_defaults(func=run)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _step(text: str) -> None:
    print(f"\n== {text}", flush=True)


def _wait_http(url: str, proc: subprocess.Popen, log: Path, what: str, timeout: float) -> None:
    import httpx

    started = time.monotonic()
    last = 0.0
    while time.monotonic() - started < timeout:
        if proc.poll() is not None:
            tail = log.read_text(errors="replace")[-3000:]
            raise SystemExit(f"{what} exited with code {proc.returncode}; log {log}:\n{tail}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=2).status_code == 200:
                print(f"   {what} ready after {time.monotonic() - started:.0f} s", flush=True)
                return
        if time.monotonic() - last > 10:
            last = time.monotonic()
            print(f"   waiting for {what} ({time.monotonic() - started:.0f} s) …", flush=True)
        time.sleep(0.5)
    raise SystemExit(f"{what} not ready after {timeout:.0f} s; see {log}")


class _Processes:
    """Child processes of the demo, each in its own process group (a Ctrl-C in the terminal
    reaches the demo, which stops them in its own time), each sent SIGTERM by the kernel when
    the demo dies, even by SIGKILL (`die_with_parent`): nothing of the demo outlives it."""

    def __init__(self) -> None:
        self._procs: list[subprocess.Popen] = []

    def start(self, args: list[str], log: Path, env: dict | None = None) -> subprocess.Popen:
        # Secrets go by environment, never argv, where any local process could read them.
        proc = subprocess.Popen(args, stdout=open(log, "ab"), stderr=subprocess.STDOUT,
                                start_new_session=True, preexec_fn=die_with_parent(),
                                env={**os.environ, **(env or {})})
        self._procs.append(proc)
        return proc

    def stop_all(self, grace_s: float = 20.0) -> None:
        """SIGTERM to every group at once, SIGKILL to what is left after `grace_s`: all
        together, so the whole stop fits into the few seconds a parent's timeout allows."""
        running = [proc for proc in self._procs if proc.poll() is None]
        for proc in running:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for proc in running:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(max(deadline - time.monotonic(), 0))
        for proc in self._procs:
            # The group too: what a server started (vLLM's engine core) may outlive it.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _conversation(base_url: str, api_key: str, model: str, turns: int) -> None:
    import openai

    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=300)
    messages = [
        {"role": "system", "content": "You are a coding agent. Use the tools to check your work."},
        {"role": "user", "content": "Fix the failing test in calc.py, then tell me what you did."},
    ]
    for turn in range(turns):
        msg = client.chat.completions.create(
            model=model, messages=messages, tools=[DEMO_TOOL], max_tokens=300,
            tool_choice={"type": "function", "function": {"name": "run_tests"}},
            parallel_tool_calls=False,
        ).choices[0].message
        call = msg.tool_calls[0]
        print(f"   turn {turn + 1}: model called {call.function.name}"
              f"({call.function.arguments.strip()})", flush=True)
        messages.append({"role": "assistant", "content": msg.content,
                         "tool_calls": [call.model_dump()]})
        result = "2 passed" if turn == turns - 1 else f"1 failed, {turn + 1} passed"
        messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    print("   final turn (streamed): ", end="", flush=True)
    stream = client.chat.completions.create(model=model, messages=messages, tools=[DEMO_TOOL],
                                            tool_choice="none", max_tokens=40, stream=True)
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            print(chunk.choices[0].delta.content, end="", flush=True)
    print(flush=True)


def _show_calls(admin, upstream: str, rollout_id: str) -> None:
    import httpx
    import numpy as np

    calls = admin.get(f"/admin/rollouts/{rollout_id}/calls").json()["calls"]
    print(f"   {'seq':>3} {'status':6} {'prompt':>6} {'stored':>6} {'sampled':>7} "
          f"{'finish':10} {'mean lp':>8} {'versions':8}  decoded excerpt")
    for c in calls:
        lp = np.asarray(c["logprobs"])
        text = httpx.post(upstream + "/detokenize", timeout=30,
                          json={"model": c["model"], "tokens": c["completion_ids"][:24]}
                          ).json().get("prompt", "")
        versions = sorted(set(c["versions"]))
        print(f"   {c['seq']:>3} {c['status']:6} {c['prompt_tokens']:>6} "
              f"{c['stored_prompt_tokens']:>6} {len(c['completion_ids']):>7} "
              f"{c['finish_reason'] or '-':10} {lp.mean() if lp.size else 0:8.3f} "
              f"{str(versions):8}  {json.dumps(text)[:48]}")
    print("   (prompt = engine prompt tokens; stored = prompt tokens kept after the shared "
          "prefix with an earlier call)")


class Interrupted(Exception):
    """A signal ended the demo: Ctrl-C, or SIGTERM or SIGHUP (a parent's timeout, a closed
    terminal)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _interrupt(signum: int, _frame) -> None:
    # Only the first signal interrupts: the clean-up it starts (stopping the servers) is
    # bounded and must not be cut short by the next one.
    for sig in _STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    raise Interrupted(signum)


_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def run(args: argparse.Namespace) -> int:
    """Either demo; an interrupted one stops its servers (`finally` blocks) and says so in one
    line, where the default actions would leave them running or print a traceback."""
    for sig in _STOP_SIGNALS:
        signal.signal(sig, _interrupt)
    try:
        if args.model == "smol":
            from sandbox.real_demo import run_real

            return run_real(args)
        return _run_tiny(args)
    except Interrupted as stop:
        print(f"\nrolltap demo: interrupted by {stop}; its servers are stopped", file=sys.stderr,
              flush=True)
        return 128 + stop.signum


def _run_tiny(args: argparse.Namespace) -> int:
    import httpx

    if args.train_steps is None:
        args.train_steps = 24

    workdir: Path = args.dir.resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    rolltap = [sys.executable, "-m", "gateway.cli"]
    procs = _Processes()
    admin_key = secrets.token_urlsafe(16)
    try:
        model_dir = workdir / "tiny-untied"
        _step(f"1/7 tiny model (offline) in {model_dir}")
        if not (model_dir / "model.safetensors").exists():
            # Untied by default: vLLM's CPU build can reload only an untied LM head in place.
            subprocess.run([*rolltap, "tiny-model", str(model_dir)], check=True,
                           preexec_fn=die_with_parent())
        else:
            print("   already built")

        vllm_port, gw_port = _free_port(), args.gateway_port or _free_port()
        upstream = f"http://127.0.0.1:{vllm_port}"
        _step(f"2/7 vLLM (CPU build) on {upstream}; log {workdir / 'vllm.log'}")
        vllm = procs.start([*rolltap, "serve-model", str(model_dir), "--port", str(vllm_port),
                            "--served-model-name", "tiny"], workdir / "vllm.log")
        _wait_http(upstream + "/health", vllm, workdir / "vllm.log", "vLLM", 600)

        gateway = f"http://127.0.0.1:{gw_port}"
        _step(f"3/7 gateway on {gateway}, embedded Postgres in {workdir / 'data'}")
        gw = procs.start([*rolltap, "gateway", "--upstream", upstream, "--port", str(gw_port),
                          "--data-dir", str(workdir / "data"), "--tokenizer", str(model_dir),
                          # the tiny model calls its tools only under a grammar: train those
                          "--train-constrained"],
                         workdir / "gateway.log", env={"ROLLTAP_ADMIN_KEY": admin_key})
        _wait_http(gateway + "/healthz", gw, workdir / "gateway.log", "gateway", 180)
        admin = httpx.Client(base_url=gateway, timeout=60,
                             headers={"Authorization": f"Bearer {admin_key}"})

        _step("4/7 a tool-using conversation through the gateway, as one rollout")
        rollout = admin.post("/admin/rollouts", json={"task_id": "demo-fix-calc"}).json()
        print(f"   rollout {rollout['rollout_id']}, key {rollout['api_key'][:10]}…")
        _conversation(rollout["openai_base_url"], rollout["api_key"], "tiny", args.turns)
        finished = admin.post(f"/admin/rollouts/{rollout['rollout_id']}/finish",
                              json={"reward": 1.0}).json()

        _step("5/7 what Postgres holds")
        _show_calls(admin, upstream, rollout["rollout_id"])
        stats = finished["merge"]["stats"]
        print(f"   merged into {stats['sequences']} training sequence(s): "
              f"{stats['trained_tokens']} trained tokens of {stats['sampled_tokens']} sampled, "
              f"{stats['lost_tokens']} lost; forks by cause {stats['causes']}")
        print(f"   inspect: curl -H 'Authorization: Bearer $ROLLTAP_ADMIN_KEY' "
              f"{gateway}/admin/rollouts/{rollout['rollout_id']}/traces")
        print(f"   or see it at {gateway}/ui#/rollout/{rollout['rollout_id']} (admin key "
              f"{admin_key}) while the demo runs")

        _step("6/7 sandboxes: the scripted python harness on an example task, hidden tests score")
        subprocess.run(
            [*rolltap, "rollouts", str(EXAMPLE_TASKS), "--harness", "python",
             "--agent", "sandbox.agents.scripted:run", "--task", "fizzbuzz", "--group-size", "2",
             "--concurrency", "2", "--gateway", gateway, "--model", "tiny"],
            check=False, env={**os.environ, "ROLLTAP_ADMIN_KEY": admin_key},
            preexec_fn=die_with_parent(),
        )
        print("   (the random tiny model writes no working code: rewards are 0, as expected)")

        if args.train_steps > 0:
            _step(f"7/7 training: {args.train_steps} GRPO steps on the toy task, weights back "
                  "to vLLM after each")
            _train(args.train_steps, workdir, rolltap, procs, model_dir, upstream, gateway,
                   admin, admin_key)
    finally:
        procs.stop_all()
        stop_embedded_postgres(workdir / "data" / "pgdata")
    print("\ndemo finished")
    return 0


def _train(steps: int, workdir: Path, rolltap: list[str], procs: _Processes, model_dir: Path,
           upstream: str, gateway: str, admin, admin_key: str) -> None:
    """The bridge trains on toy-task rollouts that an agent plays through the gateway meanwhile;
    the demo prints the reward of each step as the bridge logs it."""
    import threading

    from trainer_bridge.config import match_arg
    from trainer_bridge.toy_task import ToyTask, run_toy_rollouts

    run_id = secrets.token_hex(4)
    out_dir = workdir / f"train-{run_id}"
    start_version = admin.get("/admin/policy").json()["version"]
    bridge = procs.start(
        [*rolltap, "bridge", "--model", str(model_dir), "--vllm", upstream, "--gateway", gateway,
         "--data-dir", str(workdir / "data"), "--num-generations", "8",
         "--max-steps", str(steps), "--weight-sync", "disk",
         "--checkpoint-dir", str(out_dir / "checkpoints"), "--output-dir", str(out_dir),
         "--match", match_arg("run", run_id), "--learning-rate", "2e-2",
         "--set", "epsilon_high=1.0",
         "--token-budget", "420", "--queue-size", "24", "--threads", "1"],
        workdir / "bridge.log", env={"ROLLTAP_ADMIN_KEY": admin_key},
    )
    print(f"   bridge log {workdir / 'bridge.log'}; waiting for its first weight push …",
          flush=True)
    while admin.get("/admin/policy").json()["version"] == start_version:
        if bridge.poll() is not None:
            raise SystemExit(f"the bridge exited early; see {workdir / 'bridge.log'}")
        time.sleep(1)
    stop = threading.Event()
    task = ToyTask(gateway, admin_key, "tiny", model_dir, metadata={"run": run_id})
    results: list = []
    failures: list[Exception] = []

    def play() -> None:
        try:
            run_toy_rollouts(task, group_size=8, stop=stop, on_group=results.extend)
        except Exception as exc:  # once stopped, the servers are going: not a failure then
            if not stop.is_set():
                failures.append(exc)

    player = threading.Thread(target=play, daemon=True)
    player.start()
    progress, shown = out_dir / "progress.jsonl", 0
    print(f"   {'step':>4} {'reward':>7} {'policy version':>15}")
    try:
        while bridge.poll() is None or shown < steps:
            lines = progress.read_text().splitlines() if progress.exists() else []
            for line in lines[shown:]:
                entry = json.loads(line)
                print(f"   {entry['step']:>4} {entry['reward'] or 0:7.3f} "
                      f"{entry['version']!s:>15}", flush=True)
            shown = len(lines)
            if bridge.poll() is not None:
                break
            if failures:  # no more rollouts: the bridge would wait for them forever
                raise SystemExit(f"the toy agent failed: {failures[0]!r}; see "
                                 f"{workdir / 'gateway.log'}")
            time.sleep(1)
    finally:
        stop.set()
    player.join(600)
    if bridge.returncode:
        raise SystemExit(f"the bridge failed; see {workdir / 'bridge.log'}")
    first, last = results[0], results[-1]
    for label, res in (("first", first), ("last", last)):
        calls = admin.get(f"/admin/rollouts/{res.rollout_id}/calls?bodies=0").json()["calls"]
        versions = sorted({v for c in calls for v in c["versions"]})
        print(f"   {label} toy rollout: reward {res.reward:.2f}, its tokens were sampled under "
              f"policy version(s) {versions}")
    summary = json.loads((out_dir / "summary.json").read_text())
    print(f"   reward over the first steps {summary['reward_first_steps'] or 0:.3f} -> last "
          f"steps {summary['reward_last_steps'] or 0:.3f}; versions {summary['versions']}")


def stop_embedded_postgres(pgdata: Path, timeout: float = 30.0) -> None:
    """Stop the embedded Postgres in `pgdata`, which the gateway leaves running on purpose (a
    restart reuses it). Signalled directly: pgserver's own cleanup stops a server only when its
    last registered handle goes, and the gateway's handle stays registered."""
    pid_file = pgdata / "postmaster.pid"
    if not pid_file.exists():
        return
    pid = int(pid_file.read_text().split("\n", 1)[0])
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGINT)  # Postgres's fast shutdown
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            os.kill(pid, 0)
            time.sleep(0.1)
