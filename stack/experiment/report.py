"""The experiment's tables and plot from its part results: a per-prompt before/after table per
training seed (CSV) and one PNG (training reward per step of the positive control and of each
seed; held-out pass@1 before, midway and after with paired 95 % intervals)."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any


def _pass_rates(arm: dict[str, Any]) -> dict[str, float]:
    return {t: sum(s["verdict"] == "pass" for s in ss) / len(ss)
            for t, ss in arm["samples"].items() if ss}


def prompt_table(done: dict[str, dict[str, Any]], results: Path) -> list[Path]:
    """results/table-train-N.csv: per held-out prompt, its template and pass rate per arm."""
    written = []
    if "aa" not in done:
        return written
    before = done["aa"]["result"]["arms"][0]
    for name, record in sorted(done.items()):
        if not name.startswith(("train-", "shuffled-", "agent-")):
            continue
        arms = [before, *record["result"]["evaluations"]]
        rates = [_pass_rates(a) for a in arms]
        path = results / f"table-{name}.csv"
        with path.open("w", newline="") as fh:
            out = csv.writer(fh)
            out.writerow(["prompt", "template", "ood", *(f"pass_{a['label']}" for a in arms)])
            for task in before["samples"]:
                out.writerow([task, before["templates"].get(task, ""), task in before["ood"],
                              *(f"{r.get(task, float('nan')):.3f}" for r in rates)])
        written.append(path)
    return written


def plot(done: dict[str, dict[str, Any]], path: Path) -> Path | None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curves = {n: r["result"]["steps"] for n, r in done.items() if "steps" in r.get("result", {})}
    if not curves:
        return None
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for name, steps in sorted(curves.items()):
        xs = [s["step"] for s in steps if s["reward"] is not None]
        left.plot(xs, [s["reward"] for s in steps if s["reward"] is not None], "o-", ms=3,
                  label=name + (" (reply-length reward)" if name == "positive" else ""))
    left.set(xlabel="optimizer step", ylabel="mean training reward", ylim=(0, 1),
             title="training reward (in-sample)")
    left.legend(fontsize=8)
    for name, record in sorted(done.items()):
        if not name.startswith(("train-", "shuffled-", "agent-")):
            continue
        res = record["result"]
        points = [(0, res["vs_before_" + res["evaluations"][0]["label"]]["a"], 0.0, 0.0)]
        for ev in res["evaluations"]:
            s = res[f"vs_before_{ev['label']}"]
            step = res["steps"][-1]["step"] if ev["label"] == "after" else int(
                ev["label"].removeprefix("step"))
            points.append((step, s["b"], s["b"] - (s["a"] + s["ci_low"]),
                           (s["a"] + s["ci_high"]) - s["b"]))
        right.errorbar([p[0] for p in points], [p[1] for p in points],
                       yerr=[[max(p[2], 0) for p in points], [max(p[3], 0) for p in points]],
                       fmt="s--", capsize=3, label=name)
    right.set(xlabel="optimizer step", ylabel="held-out pass@1", ylim=(0, 1),
              title="held-out pass@1 (paired 95% prompt-bootstrap)")
    if right.lines:
        right.legend(fontsize=8)
    fig.suptitle("SmolLM2-135M-Instruct, GRPO through rolltap on 2 CPU cores")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write(done: dict[str, dict[str, Any]], results: Path) -> None:
    prompt_table(done, results)
    plot(done, results / "learning.png")
