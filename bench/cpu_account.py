"""The gateway's CPU account per call, from its `/metrics` (`--cpu-account`,
gateway/stage_cpu.py): each stage of a call with what it awaits, then the server's request
tasks outside the stages, the engine client's tasks, the commit writer, other tasks, the event
loop with its protocol callbacks, and other threads, beside the process's CPU per call from
/proc. Part of the floors section (`bench/bench_floors.py`).

What the counters cannot split (inside `loop`: aiohttp's HTTP parsers, asyncpg's protocol,
uvloop) a sampling profile shows: `python -m bench.profile` (py-spy)."""

from __future__ import annotations

from gateway.stage_cpu import ACCOUNT, STAGES

GOAL_SHARE = 0.90  # issue #41: the parts together account for at least this much
# Differences of two clocks, not counted step by step.
MEASURED = {"loop": "the main thread's clock less its tasks'",
            "threads": "the process's clock less the main thread's"}


def table(parts_us: dict[str, float], process_us: float, title: str) -> str:
    """One load's account: µs per call and share of the process's CPU, by stage and part."""
    if not parts_us:
        return f"CPU account ({title}): none (the gateway ran without --cpu-account)"
    lines = [f"CPU account per call, {title}:", f"  {'part':<12}{'µs/call':>9}{'share':>8}"]
    for name in (*STAGES, *ACCOUNT):
        us = parts_us.get(name, 0.0)
        note = f"  ({MEASURED[name]})" if name in MEASURED else ""
        kind = "stage " if name in STAGES else ""
        lines.append(f"  {kind + name:<12}{us:>9,.0f}{us / process_us:>8.0%}{note}")
    total = sum(parts_us.get(n, 0.0) for n in (*STAGES, *ACCOUNT))
    share = total / process_us if process_us else float("nan")
    verdict = "met" if share >= GOAL_SHARE else "MISSED"
    lines.append(
        f"  {'sum':<12}{total:>9,.0f}{share:>8.0%}   of the process's {process_us:,.0f} µs/call "
        f"(/proc); goal ≥ {GOAL_SHARE:.0%}: {verdict}"
    )
    return "\n".join(lines)
