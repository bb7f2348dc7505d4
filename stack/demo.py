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
import json
import secrets
import signal
import sys
import time
from pathlib import Path

from stack.launcher import (
    ROLLTAP,
    Processes,
    admin_client,
    free_port,
    run_once,
    serve_model,
    start_gateway,
    step,
    stop_embedded_postgres,
)
from stack.real_demo import add_arguments, run_real

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
                        "through sandboxes and hidden tests (see "
                        "stack/real_demo.py)")
    parser.add_argument("--gateway-port", type=int, default=None, metavar="PORT",
                        help="port of the demo's gateway (default: a free one); the container "
                        "image sets 9000 for its health check")
    add_arguments(parser)
    parser.set_defaults(func=run)


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
            return run_real(args)
        return _run_tiny(args)
    except Interrupted as stop:
        print(f"\nrolltap demo: interrupted by {stop}; its servers are stopped", file=sys.stderr,
              flush=True)
        return 128 + stop.signum


def _run_tiny(args: argparse.Namespace) -> int:
    if args.train_steps is None:
        args.train_steps = 24

    workdir: Path = args.dir.resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    procs = Processes()
    admin_key = secrets.token_urlsafe(16)
    try:
        model_dir = workdir / "tiny-untied"
        step(f"1/7 tiny model (offline) in {model_dir}")
        if not (model_dir / "model.safetensors").exists():
            # Untied by default: vLLM's CPU build can reload only an untied LM head in place.
            run_once([*ROLLTAP, "tiny-model", str(model_dir)])
        else:
            print("   already built")

        vllm_port, gw_port = free_port(), args.gateway_port or free_port()
        upstream = f"http://127.0.0.1:{vllm_port}"
        step(f"2/7 vLLM (CPU build) on {upstream}; log {workdir / 'vllm.log'}")
        serve_model(procs, workdir / "vllm.log", model_dir, vllm_port, "tiny")

        gateway = f"http://127.0.0.1:{gw_port}"
        step(f"3/7 gateway on {gateway}, embedded Postgres in {workdir / 'data'}")
        # the tiny model calls its tools only under a grammar: train those
        start_gateway(procs, workdir, upstream, gw_port, admin_key,
                      ("--tokenizer", str(model_dir), "--train-constrained"))
        admin = admin_client(gateway, admin_key)

        step("4/7 a tool-using conversation through the gateway, as one rollout")
        rollout = admin.post("/admin/rollouts", json={"task_id": "demo-fix-calc"}).json()
        print(f"   rollout {rollout['rollout_id']}, key {rollout['api_key'][:10]}…")
        _conversation(rollout["openai_base_url"], rollout["api_key"], "tiny", args.turns)
        finished = admin.post(f"/admin/rollouts/{rollout['rollout_id']}/finish",
                              json={"reward": 1.0}).json()

        step("5/7 what Postgres holds")
        _show_calls(admin, upstream, rollout["rollout_id"])
        stats = finished["merge"]["stats"]
        print(f"   merged into {stats['sequences']} training sequence(s): "
              f"{stats['trained_tokens']} trained tokens of {stats['sampled_tokens']} sampled, "
              f"{stats['lost_tokens']} lost; forks by cause {stats['causes']}")
        print(f"   inspect: curl -H 'Authorization: Bearer $ROLLTAP_ADMIN_KEY' "
              f"{gateway}/admin/rollouts/{rollout['rollout_id']}/traces")
        print(f"   or see it at {gateway}/ui#/rollout/{rollout['rollout_id']} (admin key "
              f"{admin_key}) while the demo runs")

        step("6/7 sandboxes: the scripted python harness on an example task, hidden tests score")
        run_once([*ROLLTAP, "rollouts", str(EXAMPLE_TASKS), "--harness", "python",
                  "--agent", "sandbox.agents.scripted:run", "--task", "fizzbuzz",
                  "--group-size", "2", "--concurrency", "2", "--gateway", gateway,
                  "--model", "tiny"],
                 env={"ROLLTAP_ADMIN_KEY": admin_key}, check=False)
        print("   (the random tiny model writes no working code: rewards are 0, as expected)")

        if args.train_steps > 0:
            step(f"7/7 training: {args.train_steps} GRPO steps on the toy task, weights back "
                  "to vLLM after each")
            _train(args.train_steps, workdir, procs, model_dir, upstream, gateway, admin,
                   admin_key)
    finally:
        procs.stop_all()
        stop_embedded_postgres(workdir / "data" / "pgdata")
    print("\ndemo finished")
    return 0


def _train(steps: int, workdir: Path, procs: Processes, model_dir: Path, upstream: str,
           gateway: str, admin, admin_key: str) -> None:
    """The bridge trains on toy-task rollouts that an agent plays through the gateway meanwhile;
    the demo prints the reward of each step as the bridge logs it."""
    import threading

    from stack.toy_task import ToyTask, run_toy_rollouts
    from trainer_bridge.config import match_arg

    run_id = secrets.token_hex(4)
    out_dir = workdir / f"train-{run_id}"
    start_version = admin.get("/admin/policy").json()["version"]
    bridge = procs.start(
        [*ROLLTAP, "bridge", "--model", str(model_dir), "--vllm", upstream, "--gateway", gateway,
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
