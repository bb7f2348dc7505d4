"""`rolltap rollouts` flags for throughput (issue #42): oversampling with straggler abort,
phase pools, a continuous run from a task pool, and where the time went (engine busy fraction,
pool queue waits, on /metrics and in the summary). Declared here so sandbox/cli.py stays the
plain run; everything heavy is imported when a run starts."""

from __future__ import annotations

import argparse
from collections import Counter


def add_throughput_arguments(p: argparse.ArgumentParser) -> None:
    run = p.add_argument_group("throughput (README: Throughput)")
    run.add_argument("--oversample", type=int, default=0, metavar="K",
                     help="start G+K members per group; once G have ended the rest are "
                          "stopped (sandbox killed, calls in flight ended at the gateway, "
                          "rollout finished aborted: never trained) and the group trains its "
                          "fastest G. Trades a length bias (slow rollouts under-represented, "
                          "said in each rollout's metadata and ledger) for not waiting on the "
                          "slowest member (default 0: off)")
    run.add_argument("--setup-slots", type=int, metavar="N",
                     help="sandboxes in their setup phase at once (image unpack, the task's "
                          "setup command; Harbor: environment start and health check, agent "
                          "install) (default: no limit of its own)")
    run.add_argument("--agent-slots", type=int, metavar="N",
                     help="harnesses running at once; with --setup-slots/--verify-slots and a "
                          "larger --concurrency, a slow verifier or image unpack never holds "
                          "an agent's slot (default: no limit of its own)")
    run.add_argument("--verify-slots", type=int, metavar="N",
                     help="verifiers running at once (default: no limit of its own)")
    cont = p.add_argument_group("continuous run (groups drawn from the task pool)")
    cont.add_argument("--continuous", action="store_true",
                      help="instead of every task --repeat times: draw tasks at random (with "
                           "--seed) and run a group of each, until --until-steps or "
                           "--deadline; pair with --max-backlog to keep samples fresh")
    cont.add_argument("--seed", type=int, default=0, help="the draws' seed (default 0)")
    cont.add_argument("--until-steps", type=int, metavar="N",
                      help="stop drawing once the gateway's policy version is N past the one "
                           "at start (the bridge pushes one a step: its --max-steps)")
    cont.add_argument("--deadline", type=float, metavar="SECONDS",
                      help="stop drawing after this long")
    cont.add_argument("--filter-flat", action="store_true",
                      help="draw less often a task whose last --flat-window groups all "
                           "passed or all failed (no gradient); the summary counts the skips")
    cont.add_argument("--flat-window", type=int, default=2, metavar="N",
                      help="groups a task must be flat in a row to be drawn less (default 2)")

    where = p.add_argument_group("where the time goes")
    where.add_argument("--engine-metrics", action="append", default=[], metavar="URL",
                       help="a vLLM base URL whose /metrics to sample for the engines' busy "
                            "fraction (repeatable)")
    where.add_argument("--metrics-port", type=int, metavar="PORT",
                       help="serve the run's pools, engine busy fraction and ended rollouts on "
                            "http://127.0.0.1:PORT/metrics")



def throughput_problem(args: argparse.Namespace) -> str | None:
    """What is wrong with these flags, before anything loads."""
    if args.oversample < 0:
        return "--oversample must be 0 or more"
    if args.continuous and args.until_steps is None and args.deadline is None:
        return "--continuous needs --until-steps or --deadline (or both), or it never ends"
    if not args.continuous and (args.until_steps or args.deadline or args.filter_flat):
        return "--until-steps, --deadline and --filter-flat go with --continuous"
    for flag in ("setup_slots", "agent_slots", "verify_slots"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            return f"--{flag.replace('_', '-')} must be at least 1"
    return None


def phase_pools(args: argparse.Namespace):
    from sandbox.pools import PhasePools

    return PhasePools(setup=args.setup_slots, agent=args.agent_slots, verify=args.verify_slots)


class Throughput:
    """A run's throughput parts: the task sampler of a continuous run, the engines' busy
    sampling, the /metrics server, and their summary lines."""

    def __init__(self, args: argparse.Namespace, tasks, pools) -> None:
        from sandbox.engine_busy import EngineBusy

        self.args, self.pools = args, pools
        self.ended: Counter = Counter()  # rollouts by how they ended
        self.sampler = None
        if args.continuous:
            from sandbox.continuous import TaskSampler

            self.sampler = TaskSampler(tasks, args.group_size, seed=args.seed,
                                       filter_flat=args.filter_flat, window=args.flat_window)
        self.engines = EngineBusy(args.engine_metrics)
        self.server = None

    async def start(self) -> None:
        from sandbox import run_metrics

        self.engines.start()
        if self.args.metrics_port is not None:
            collector = run_metrics.RunCollector(self.pools, self.engines, self.ended)
            self.server = await run_metrics.serve(collector, self.args.metrics_port)

    async def stop(self) -> None:
        await self.engines.stop()
        if self.server is not None:
            await self.server.cleanup()

    def run_options(self) -> dict:
        """run_rollouts' throughput arguments."""
        args = self.args
        return {"oversample": args.oversample, "sampler": self.sampler,
                "until_steps": args.until_steps, "deadline_s": args.deadline}

    def print_summary(self, report) -> None:
        args = self.args
        if self.pools is not None:
            from sandbox.pools import stats_line

            print(stats_line(self.pools.stats()))
        if args.oversample:
            print(f"oversampling: {report.aborted} stragglers aborted, {report.unneeded} extra "
                  f"members not started; each group trained its fastest {args.group_size} of "
                  f"{args.group_size + args.oversample} (length bias; --oversample 0 turns it off)")
        if self.sampler is not None:
            print(self.sampler.summary())
        if (busy := self.engines.fraction()) is not None:
            print(f"engines busy {busy:.0%} of the run (a request running; "
                  f"{len(args.engine_metrics)} engine(s) sampled)")
