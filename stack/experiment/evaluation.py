"""Held-out evaluation: every task sampled K times straight from vLLM with a fixed seed per
(task, sample), each reply graded by `check.grade`.

Why straight from vLLM and not through the gateway: the gateway pins every call to the training
policy's sampling and drops a harness's `seed` (gateway/call_request.py, SAMPLING_KEYS), so no
seed can ever reach a training rollout, whatever a harness sends. The evaluation needs seeds
(common random numbers: the same seed for (task, j) before and after training makes the paired
difference less noisy), so it talks to the engine itself, with exactly the pinned sampling
(`sampling_policy`) and the agent's own messages and token limit, and records nothing. The
policy it measures is whatever weights vLLM holds at that moment.
"""

from __future__ import annotations

import asyncio
import time
import zlib
from collections.abc import Callable
from typing import Any

import msgspec

from gateway.call_request import sampling_policy
from sandbox.agents.code_writer import MAX_TOKENS, SYSTEM, user_text
from stack.experiment.check import STRUCTURAL, grade


class Sample(msgspec.Struct, frozen=True):
    seed: int
    verdict: str
    passed: int
    total: int
    chars: int  # reply length (the positive control's reward reads it)
    tokens: int


class Evaluation(msgspec.Struct):
    label: str
    seed_base: int
    samples: dict[str, list[Sample]]  # task id -> its samples, j = 0..K-1
    seconds: float
    templates: dict[str, str] = {}  # task id -> template
    ood: list[str] = []  # task ids of out-of-distribution templates

    def outcomes(self, *, ood: bool = False) -> dict[str, list[bool]]:
        """pass per sample, per task of the in-distribution (or, `ood`, the OOD) tasks."""
        keep = set(self.ood)
        return {t: [s.verdict == "pass" for s in ss] for t, ss in self.samples.items()
                if (t in keep) == ood}

    def structural(self, *, ood: bool = False) -> dict[str, list[bool]]:
        """structurally sound (imports quietly, defines the function) per sample."""
        keep = set(self.ood)
        return {t: [s.verdict not in STRUCTURAL for s in ss] for t, ss in self.samples.items()
                if (t in keep) == ood}

    def verdicts(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for ss in self.samples.values():
            for s in ss:
                counts[s.verdict] = counts.get(s.verdict, 0) + 1
        return dict(sorted(counts.items()))


def sample_seed(seed_base: int, task_id: str, j: int) -> int:
    """The seed of sample j of a task: the same in every arm that uses `seed_base`."""
    return zlib.crc32(f"{seed_base}/{task_id}/{j}".encode()) & 0x7FFFFFFF


def messages(task: dict[str, Any]) -> list[dict[str, str]]:
    """The code-writer agent's messages for `task` (its one starting file)."""
    (name, content), = task["files"].items()
    return [{"role": "system", "content": SYSTEM},
            {"role": "user", "content": user_text(task["prompt"], name, content)}]


async def _one(client, model: str, task: dict[str, Any], seed: int, temperature: float,
               gate: asyncio.Semaphore) -> tuple[str, int]:
    policy = sampling_policy(temperature)
    async with gate:
        response = await client.chat.completions.create(
            model=model, messages=messages(task), max_tokens=MAX_TOKENS, seed=seed,
            temperature=policy["temperature"], top_p=policy["top_p"],
            presence_penalty=policy["presence_penalty"],
            frequency_penalty=policy["frequency_penalty"],
            extra_body={k: policy[k] for k in ("top_k", "min_p", "repetition_penalty")})
    usage = response.usage.completion_tokens if response.usage else 0
    return response.choices[0].message.content or "", usage


async def _generate(upstream: str, model: str, jobs: list[tuple[dict[str, Any], int]],
                    temperature: float, concurrency: int,
                    progress: Callable[[int, int], None]) -> list[tuple[str, int]]:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=f"{upstream}/v1", api_key="evaluation", max_retries=3,
                         timeout=1800)
    gate = asyncio.Semaphore(concurrency)
    done = 0

    async def counted(task, seed):
        nonlocal done
        out = await _one(client, model, task, seed, temperature, gate)
        done += 1
        progress(done, len(jobs))
        return out

    try:
        return await asyncio.gather(*(counted(t, s) for t, s in jobs))
    finally:
        await client.close()


def evaluate(label: str, tasks: list[dict[str, Any]], *, upstream: str, model: str,
             samples: int, seed_base: int, temperature: float, concurrency: int = 8,
             log: Callable[[str], None] = print) -> Evaluation:
    """Sample and grade `samples` replies per task; progress lines through `log`."""
    started = time.monotonic()
    jobs = [(t, sample_seed(seed_base, t["id"], j)) for t in tasks for j in range(samples)]
    last = [0.0]

    def progress(done: int, total: int) -> None:
        if done == total or time.monotonic() - last[0] > 30:
            last[0] = time.monotonic()
            log(f"   {label}: {done}/{total} replies sampled "
                f"({time.monotonic() - started:.0f} s)")

    replies = asyncio.run(_generate(upstream, model, jobs, temperature, concurrency, progress))
    out: dict[str, list[Sample]] = {t["id"]: [] for t in tasks}
    for (task, seed), (reply, tokens) in zip(jobs, replies, strict=True):
        meta = task["metadata"]
        graded = grade(reply, meta["func"], meta["cases"])
        out[task["id"]].append(Sample(seed, graded.verdict, graded.passed, graded.total,
                                      len(reply), tokens))
    return Evaluation(label, seed_base, out, round(time.monotonic() - started, 1),
                      {t["id"]: t["metadata"].get("template", "") for t in tasks},
                      [t["id"] for t in tasks if t["metadata"].get("ood")])
