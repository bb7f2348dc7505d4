"""`rolltap rollouts`: run a task set through a harness in sandboxes, against the gateway.

Only flags are declared here; the runner, the backends and aiohttp are imported when the
command runs, so `rolltap --help` stays fast.
"""

from __future__ import annotations

import argparse
import os
import sys

from sandbox.throughput_cli import (
    Throughput,
    add_throughput_arguments,
    phase_pools,
    throughput_problem,
)

DESCRIPTION = """Run rollouts: for every task in TASKS.jsonl, GROUP-SIZE rollouts per repeat, each
in a fresh sandbox running the chosen harness against the gateway.

For each rollout the runner creates it at the gateway's admin API (POST /admin/rollouts, all
members of one task and repeat share a group id), starts the harness in a sandbox with only
that rollout's API key and the gateway's base URL, runs the task's hidden tests once the
harness has exited, and posts the reward (POST /admin/rollouts/ID/finish). The admin key never
enters a sandbox.

Every phase of a sandbox (setup, harness, verifier) is confined with bubblewrap (Debian package
`bubblewrap`; `socat` too): its own uid (as root), user/PID/mount/IPC/UTS/network/cgroup
namespaces, no capabilities, an empty filesystem with only the system directories, the
interpreter and harness installs (read-only) and its own directories; the task set, other
sandboxes and the --state file are not there. Its network reaches only the gateway (through a
Unix socket, served inside on 127.0.0.1). Limits: cgroup memory, CPU and processes, rlimits,
a tmpfs of bounded size, a wall-clock timeout. The verifier runs as another uid over a copy of
the harness's workdir, with the hidden tests read-only, and reports through a pipe. A task's
`protected` paths changed by the harness score 0 (`tampered`). --isolation none turns all of
this off; the summary then says so.
A harness that crashes or times out is recorded with that status; the run goes on.

Ctrl-C (or SIGTERM) stops the run: sandboxes in flight are killed and their rollouts finished
as failed with metrics.interrupted. With --state, rerunning the same command resumes: finished
rollouts are skipped, the remaining ones join the same groups. A second Ctrl-C exits at once."""

EPILOG = """harness presets:
  python       an agent function run in the sandbox: --agent package.module:function
               (called with prompt, base_url, api_key, model, workdir; e.g.
               sandbox.agents.scripted:run, a scripted OpenAI-SDK agent)
  command      any command: --command 'my-agent --url {base_url} --key {api_key} {prompt}'
               fields: {prompt} {base_url} {api_key} {model} {workdir}; no shell involved
  opencode     opencode run --pure            (chat completions, openai base URL)
  codex        codex exec                     (Responses API, openai base URL)
  claude-code  claude --print                 (Messages API, anthropic base URL)
  qwen-code    qwen --auth-type openai        (chat completions, openai base URL)
  pi           pi --print --offline           (chat completions, openai base URL)
  The npm harnesses must be on PATH (or given with --harness-bin). Each gets its config in the
  sandbox's HOME, telemetry and update checks off, and an npm registry that does not exist.

reward of a crashed or timed-out harness (--crash-reward):
  zero    0.0 (default)     null    unscorable (None)
  verify  run the hidden tests on whatever the harness left behind

examples:
  rolltap rollouts --probe --gateway http://127.0.0.1:9000 --probe-port 8000
      (what a sandboxed agent can reach here; compare with --isolation none)
  rolltap rollouts examples/tasks/tasks.jsonl --harness python \\
      --agent sandbox.agents.scripted:run --group-size 4 \\
      --gateway http://127.0.0.1:9000 --admin-key SECRET --state run1.jsonl
  ROLLTAP_ADMIN_KEY=SECRET rolltap rollouts tasks.jsonl --harness opencode --model tiny \\
      --group-size 8 --concurrency 16 --backend ray --ray-address auto \\
      --gateway http://gateway.internal:9000"""


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "rollouts",
        help="run a task set through a harness in sandboxes against the gateway",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("tasks", metavar="TASKS.jsonl", nargs="?",
                   help="task file, one JSON task per line (with --harness harbor:AGENT: a "
                        "Harbor task directory or a directory of them)")

    run = p.add_argument_group("run")
    run.add_argument("--probe", action="store_true",
                     help="instead of rollouts: run one sandbox whose agent reports what it can "
                          "reach (other processes, limits, cgroups, the network, the gateway's "
                          "admin API, TASKS.jsonl if given) and print it")
    run.add_argument("--probe-port", type=int, action="append", default=[], metavar="PORT",
                     help="--probe: also try this TCP port on 127.0.0.1 (repeatable; 5432 "
                          "always)")
    run.add_argument("--harness", metavar="NAME",
                     help="harness preset: python, command, opencode, codex, claude-code, "
                          "qwen-code, pi; or harbor:AGENT, a Harbor agent (oracle, nop, "
                          "claude-code, terminus-2, ... or module:Class), one Harbor trial "
                          "per rollout")
    run.add_argument("--group-size", type=int, metavar="G",
                     help="rollouts per task and repeat, sharing one group id")
    run.add_argument("--repeat", type=int, default=1, metavar="K",
                     help="groups per task (default 1)")
    run.add_argument("--concurrency", type=int, default=4, metavar="C",
                     help="sandboxes running at once (default 4)")
    run.add_argument("--max-unscorable-share", type=float, default=0.1, metavar="SHARE",
                     help="warn in the summary when more than this share of the run's "
                     "rollouts are unscorable (reward null; default 0.1): above it the "
                     "environment, not the policy, is failing")
    run.add_argument("--max-backlog", type=int, metavar="N",
                     help="with a trainer bridge running: start a rollout only while this "
                          "run's rollouts in flight plus those waiting to be trained are fewer "
                          "than N (at least the group size), so samples do not go stale while "
                          "the runner races ahead of training (default: no limit)")
    run.add_argument("--state", metavar="FILE",
                     help="JSONL of finished rollouts; rerun with the same file to resume")
    run.add_argument("--run-id", metavar="ID",
                     help="the run id of a new run, stamped on its rollouts' metadata "
                          "(`rolltap bridge --match run_id=ID` trains on them; default: a "
                          "random one); a resumed --state file keeps its own")
    run.add_argument("--crash-reward", choices=["zero", "null", "verify"], default="zero",
                     help="reward of a crashed or timed-out harness (default zero)")
    run.add_argument("--task", action="append", metavar="ID", dest="task_ids",
                     help="run only this task (repeatable)")

    gw = p.add_argument_group("gateway")
    gw.add_argument("--gateway", required=True, metavar="URL",
                    help="gateway root URL, e.g. http://127.0.0.1:9000")
    gw.add_argument("--admin-key", metavar="KEY",
                    help="admin API key (default: $ROLLTAP_ADMIN_KEY); stays in this process")
    gw.add_argument("--model", default="default", metavar="NAME",
                    help="model name the harness asks for (default 'default')")

    h = p.add_argument_group("harness options")
    h.add_argument("--agent", metavar="MODULE:FUNCTION", help="python preset: the agent")
    h.add_argument("--pythonpath", action="append", default=[], metavar="DIR",
                   help="python preset: directory to import the agent from (repeatable)")
    h.add_argument("--command", metavar="TEMPLATE", help="command preset: the command line")
    h.add_argument("--protocol", choices=["openai", "anthropic"],
                   help="python/command presets: which gateway base URL (default openai)")
    h.add_argument("--harness-bin", metavar="PATH",
                   help="npm presets: the harness executable (default: its name on PATH)")
    h.add_argument("--harness-arg", action="append", default=[], metavar="ARG",
                   help="extra argument for the harness, before the prompt (repeatable)")
    h.add_argument("--context-window", type=int, default=32768, metavar="TOKENS",
                   help="context window written into harness configs (default 32768)")
    h.add_argument("--max-output-tokens", type=int, default=4096, metavar="TOKENS",
                   help="output cap written into harness configs (default 4096)")

    lim = p.add_argument_group("sandbox limits (defaults depend on the preset)")
    lim.add_argument("--cpu-seconds", type=int, metavar="S", help="CPU time per process")
    lim.add_argument("--memory-mb", type=int, metavar="MB",
                     help="address space per process; 0 = unlimited (npm presets' default)")
    lim.add_argument("--sandbox-memory-mb", type=int, metavar="MB",
                     help="memory of a whole sandbox (cgroup, no swap; default 4096); 0 = none")
    lim.add_argument("--cpus", type=float, metavar="N",
                     help="CPUs a sandbox may use (cgroup; default 1); 0 = no limit")
    lim.add_argument("--disk-mb", type=int, metavar="MB",
                     help="size of a sandbox's writable directories (tmpfs; default 1024)")
    lim.add_argument("--max-procs", type=int, metavar="N", help="processes per sandbox")
    lim.add_argument("--file-size-mb", type=int, metavar="MB", help="largest file written")
    lim.add_argument("--output-kb", type=int, metavar="KB",
                     help="stdout/stderr kept per process (head and tail); the rest is counted")

    sb = p.add_argument_group("sandbox backend")
    sb.add_argument("--backend", choices=["local", "ray"], default="local",
                    help="local processes (default) or Ray tasks")
    sb.add_argument("--sandbox-root", metavar="DIR",
                    help="where sandbox directories are made, hidden from every agent but "
                         "its own (default: a directory in the temp dir)")
    sb.add_argument("--keep-sandboxes", action="store_true",
                    help="do not delete sandbox directories (debugging)")
    sb.add_argument("--no-cgroup", action="store_true",
                    help="do not give sandboxes cgroups of their own (no memory/CPU caps; "
                         "processes capped by RLIMIT_NPROC only)")
    sb.add_argument("--isolation", choices=["bwrap", "none"], default="bwrap",
                    help="bwrap (default): confine every phase with bubblewrap; none: run "
                         "unconfined (agents can read the task set and reach the network)")
    sb.add_argument("--gateway-socket", metavar="PATH",
                    help="the gateway's Unix socket (rolltap gateway --unix-socket), bound "
                         "into sandboxes; default: a relay to --gateway per sandbox")
    sb.add_argument("--ro-path", action="append", default=[], metavar="PATH",
                    help="host path confined harnesses may read, e.g. a Node.js outside /usr "
                         "(repeatable)")
    sb.add_argument("--ray-address", metavar="ADDR",
                    help="Ray cluster to join (e.g. auto); default: start a local Ray")
    sb.add_argument("--ray-cpus-per-sandbox", type=float, default=1.0, metavar="N",
                    help="CPUs Ray reserves per sandbox (default 1)")
    from sandbox.backends.ray import ray_resource

    sb.add_argument("--ray-resource", action="append", default=[], metavar="NAME=N",
                    type=ray_resource,
                    help="a custom Ray resource each sandbox reserves, e.g. sandbox=1 with "
                         "nodes started as `ray start --resources '{\"sandbox\": 8}'` "
                         "(repeatable)")
    from sandbox.harbor.cli import add_arguments
    add_throughput_arguments(p)
    add_arguments(p)
    p.set_defaults(func=main)


def _harness(args: argparse.Namespace):
    import msgspec

    from sandbox.presets import Harness, check_harness, harness_limits

    harness = Harness(
        preset=args.harness,
        model=args.model,
        agent=args.agent,
        command=args.command,
        protocol=args.protocol,
        executable=args.harness_bin,
        extra_args=tuple(args.harness_arg),
        pythonpath=tuple(os.path.abspath(p) for p in args.pythonpath),
        context_window=args.context_window,
        max_output_tokens=args.max_output_tokens,
    )
    check_harness(harness)
    return msgspec.structs.replace(harness, limits=_limits(harness_limits(harness), args))


def _limits(base, args: argparse.Namespace):
    import msgspec

    changes = {}
    if args.cpu_seconds is not None:
        changes["cpu_s"] = args.cpu_seconds
    if args.memory_mb is not None:
        changes["address_space_mb"] = args.memory_mb or None
    if args.max_procs is not None:
        changes["max_procs"] = args.max_procs
    if args.file_size_mb is not None:
        changes["file_size_mb"] = args.file_size_mb
    if args.output_kb is not None:
        changes["output_bytes"] = args.output_kb * 1024
    if args.sandbox_memory_mb is not None:
        changes["memory_mb"] = args.sandbox_memory_mb or None
    if args.cpus is not None:
        changes["cpus"] = args.cpus or None
    if args.disk_mb is not None:
        changes["disk_mb"] = args.disk_mb
    return msgspec.structs.replace(base, **changes)


def build_backend(args: argparse.Namespace, pools=None):
    local_options = {
        "root": args.sandbox_root,
        "use_cgroup": not args.no_cgroup,
        "keep_dirs": args.keep_sandboxes,
        "isolation": args.isolation,
        "gateway_socket": args.gateway_socket,
        "read_only_paths": tuple(os.path.abspath(p) for p in args.ro_path),
    }
    if args.backend == "ray":
        from sandbox.backends.ray import RayBackend

        return RayBackend(address=args.ray_address, num_cpus=args.ray_cpus_per_sandbox,
                          resources=dict(args.ray_resource), **local_options)
    from sandbox.backends.local import LocalBackend

    return LocalBackend(pools=pools, **local_options)


def _findable(harness) -> bool:
    import shutil

    from sandbox.layout import sandbox_path
    from sandbox.presets import executable

    program = executable(harness)
    if shutil.which(program, path=sandbox_path()) is None:
        print(f"rolltap rollouts: {program!r} is not on PATH (give --harness-bin for npm "
              "harnesses)", file=sys.stderr)
        return False
    return True


def _summary(args: argparse.Namespace, report, backend) -> list:
    """Print the run's summary table and notes; returns the finished rollouts (with --state,
    those of earlier runs of the state file too)."""
    from sandbox.summary import (
        format_table,
        isolation_line,
        summarize,
        unscorable_lines,
        unsealed_lines,
    )

    records = list(report.finished)
    if args.state:
        from sandbox.state import StateFile

        records = list(StateFile(args.state).load()[1].values())
    errors: dict[str, int] = {}
    for e in report.errors:
        errors[e.task_id] = errors.get(e.task_id, 0) + 1
    print()
    print(format_table(summarize(records, errors)))
    print(isolation_line(records, args.isolation))
    for line in [*unsealed_lines(records),
                 *unscorable_lines(records, args.max_unscorable_share)]:
        print(line)
    if getattr(backend, "trials_dir", None):
        print(f"Harbor trials: {backend.trials_dir}")
    if report.skipped:
        print(f"({report.skipped} rollouts were finished by an earlier run of this state file)")
    if args.max_backlog is not None:
        print(f"waited {report.waited_for_trainer_s:.0f} s for the trainer (--max-backlog "
              f"{args.max_backlog})")
    return records


async def _run(args: argparse.Namespace, tasks, harness, admin_key: str, backend,
               pools) -> int:
    import asyncio
    import signal

    from sandbox.runner import run_rollouts
    from sandbox.summary import error_line, progress_line
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    main_task = asyncio.current_task()
    assert main_task is not None  # a coroutine runs in a task

    def on_signal() -> None:
        if stop.is_set():
            main_task.cancel()  # second signal: do not wait for the clean-up
            return
        print("\nstopping: killing running sandboxes (again to exit at once)", flush=True)
        stop.set()

    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, on_signal)

    extras = Throughput(args, tasks, pools)

    def finished(record, progress) -> None:
        extras.ended[record.status] += 1
        print(progress_line(record, progress.done, progress.total, progress.running), flush=True)

    def failed(error, progress) -> None:
        print(error_line(error.task_id, error.repeat, error.member, error.message,
                         progress.done, progress.total), flush=True)

    await extras.start()
    try:
        report = await run_rollouts(
            tasks, harness, gateway=args.gateway, admin_key=admin_key,
            group_size=args.group_size, backend=backend, concurrency=args.concurrency,
            repeat=args.repeat, state_path=args.state, crash_reward=args.crash_reward,
            stop=stop, on_finished=finished, on_error=failed, max_backlog=args.max_backlog,
            run_id=args.run_id, **extras.run_options(),
        )
    finally:
        await extras.stop()
        await backend.aclose()
    records = _summary(args, report, backend)
    extras.print_summary(report)
    if report.interrupted:
        left = report.total - len(records)
        resume = f"; rerun with --state {args.state} to do them" if args.state else ""
        print(f"interrupted: {left} rollouts not done{resume}")
        return 130
    return 1 if report.errors else 0


def _flag_problem(args: argparse.Namespace) -> str | None:
    """What is wrong with the flags of a run (not a probe), before anything loads."""
    missing = [flag for flag, value in (("TASKS.jsonl", args.tasks), ("--harness", args.harness),
                                        ("--group-size", args.group_size)) if value is None]
    if missing:
        return f"give {', '.join(missing)} (or --probe)"
    if problem := throughput_problem(args):
        return problem
    if args.max_backlog is not None and args.max_backlog < args.group_size:
        return (f"--max-backlog ({args.max_backlog}) must be at least --group-size "
                f"({args.group_size}): a bridge trains whole groups")
    if args.run_id and args.state:
        from sandbox.state import StateFile

        header = StateFile(args.state).load()[0]
        if header is not None and header.run_id != args.run_id:
            return (f"--state {args.state} belongs to run {header.run_id}, not --run-id "
                    f"{args.run_id}")
    return None


def _load(args: argparse.Namespace, harbor_agent: str | None):
    """The tasks to run (those of --task, if given) and the harness; raises TaskFileError or
    ValueError, each saying what to fix."""
    from sandbox.tasks import TaskFileError, load_tasks

    if harbor_agent is not None:
        from sandbox.harbor.tasks import load_harbor_tasks
        from sandbox.presets import Harness

        tasks = load_harbor_tasks(args.tasks)
        harness = Harness(preset=args.harness, model=args.model)
    elif os.path.isdir(args.tasks):
        raise TaskFileError(f"{args.tasks} is a directory: Harbor tasks run with --harness "
                            "harbor:AGENT (e.g. harbor:oracle); other harnesses take a "
                            "JSONL task file")
    else:
        tasks = load_tasks(args.tasks)
        harness = _harness(args)
    if args.task_ids:
        unknown = set(args.task_ids) - {t.id for t in tasks}
        if unknown:
            raise ValueError(f"unknown task ids: {', '.join(sorted(unknown))}")
        tasks = [t for t in tasks if t.id in set(args.task_ids)]
    return tasks, harness


def _backend_for(args: argparse.Namespace, harbor_agent: str | None):
    """The backend and its phase pools (on Ray, each node's sandboxes have their own there)."""
    pools = None if args.backend == "ray" and harbor_agent is None else phase_pools(args)
    if harbor_agent is not None:
        from sandbox.harbor.cli import make_backend

        return make_backend(args, harbor_agent, pools), pools
    return build_backend(args, pools), pools


def main(args: argparse.Namespace) -> int:
    import asyncio

    from sandbox.confine import ConfinementError
    from sandbox.tasks import TaskFileError

    admin_key = args.admin_key or os.environ.get("ROLLTAP_ADMIN_KEY")
    if not admin_key:
        print("rolltap rollouts: give --admin-key or set ROLLTAP_ADMIN_KEY", file=sys.stderr)
        return 2
    if args.probe:
        try:
            backend = build_backend(args)
        except ConfinementError as exc:
            print(f"rolltap rollouts: {exc}", file=sys.stderr)
            return 2
        from sandbox.probe_cli import run_probe

        return asyncio.run(run_probe(args, admin_key, backend))
    if problem := _flag_problem(args):
        print(f"rolltap rollouts: {problem}", file=sys.stderr)
        return 2
    from sandbox.harbor.cli import agent_name

    try:
        harbor_agent = agent_name(args.harness)
        tasks, harness = _load(args, harbor_agent)
    except (TaskFileError, ValueError) as exc:
        print(f"rolltap rollouts: {exc}", file=sys.stderr)
        return 2
    if harbor_agent is None and args.backend == "local" and not _findable(harness):
        return 2
    try:
        backend, pools = _backend_for(args, harbor_agent)
    except (ConfinementError, ValueError) as exc:
        print(f"rolltap rollouts: {exc}", file=sys.stderr)
        return 2
    from sandbox.preflight import PreflightError, check_gateway

    try:
        # Once, before the first rollout: a wrong address or key would fail every one of them.
        asyncio.run(check_gateway(args.gateway, admin_key, args.model,
                                  provider_prefix=harbor_agent is not None))
        return asyncio.run(_run(args, tasks, harness, admin_key, backend, pools))
    except PreflightError as exc:
        print(f"rolltap rollouts: {exc}", file=sys.stderr)
        return 2
    except (KeyboardInterrupt, asyncio.CancelledError):
        print("interrupted", file=sys.stderr)
        return 130
    finally:
        close = getattr(backend, "close", None)
        if close is not None:
            close()


def run_cli(argv: list[str] | None = None) -> int:
    """Run `rollouts` without the `rolltap` dispatcher (tests, `python -m sandbox.cli`)."""
    parser = argparse.ArgumentParser(prog="rolltap")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["rollouts", *(sys.argv[1:] if argv is None else argv)])
    return args.func(args)


if __name__ == "__main__":
    sys.exit(run_cli())
