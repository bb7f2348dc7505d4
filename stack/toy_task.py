"""A toy task with a verifiable reward, for the end-to-end test and the demo's training run.

The agent (the official `openai` SDK, through the gateway with a rollout's key, like any
harness) asks for a short list of everyday nouns. The verifier scores the tokens the engine
sampled: the reward is the fraction of the `max_tokens` answer slots filled with a token that
spells one of `ALLOWED_WORDS`. The tiny model's vocabulary holds each of them as a single token
(with and without a leading space), 48 tokens of 2048, so a random policy scores about 0.02 and
almost never 1, while a policy can learn the task by moving probability onto a fixed token set,
which a few dozen optimizer steps of the tiny model do.

The request offers a tool, as an agent turn does: a toolless call is a side call (a title, a
summary) that the gateway stores but does not train by default.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable, Collection, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
from tokenizers import Tokenizer

TASK_ID = "toy-allowed-words"
ALLOWED_WORDS = (
    "apple river mountain window garden kitchen letter travel winter summer morning evening "
    "question answer problem solution example reason history science language country city "
    "people"
).split()
MAX_TOKENS = 8
SYSTEM = "You are an agent. Answer with nouns from this list only: " + ", ".join(ALLOWED_WORDS)
PROMPT = "Write eight nouns from the list, separated by spaces."
SUBMIT_TOOL = {
    "type": "function",
    "function": {
        "name": "submit",
        "description": "Submit the answer.",
        "parameters": {"type": "object", "properties": {}},
    },
}


def allowed_token_ids(model_dir: str | Path) -> frozenset[int]:
    """Ids of the tokens that spell one allowed word, bare or after a space."""
    tokenizer = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
    ids = set()
    for word in ALLOWED_WORDS:
        for text in (word, " " + word):
            encoded = tokenizer.encode(text, add_special_tokens=False).ids
            if len(encoded) == 1:
                ids.update(encoded)
    return frozenset(ids)


def reward(completion_ids: Iterable[int], allowed: Collection[int], max_tokens: int) -> float:
    """Fraction of the `max_tokens` slots holding an allowed token: stopping early never pays."""
    return sum(token in allowed for token in completion_ids) / max_tokens


@dataclass(frozen=True)
class ToyResult:
    rollout_id: str
    group_id: str
    reward: float
    completion_ids: list[int]


class ToyTask:
    """Plays rollouts of the toy task against a gateway (admin key to create and score them)."""

    def __init__(
        self,
        gateway_url: str,
        admin_key: str,
        model: str,
        model_dir: str | Path,
        *,
        max_tokens: int = MAX_TOKENS,
        metadata: dict | None = None,
        timeout: float = 300,
    ) -> None:
        self.model = model
        self.max_tokens = max_tokens
        self.metadata = {"task": TASK_ID, **(metadata or {})}
        self.allowed = allowed_token_ids(model_dir)
        self.timeout = timeout
        self._admin = httpx.Client(
            base_url=gateway_url.rstrip("/"),
            timeout=timeout,
            headers={"Authorization": f"Bearer {admin_key}"},
        )

    def play(self, group_id: str) -> ToyResult:
        """One rollout: create it, let the agent answer, score the sampled tokens, finish it."""
        import openai  # the agent's SDK (the dev extra); nothing else here needs it

        created = self._admin.post(
            "/admin/rollouts",
            json={"task_id": TASK_ID, "group_id": group_id, "metadata": self.metadata},
        )
        created.raise_for_status()
        rollout = created.json()
        agent = openai.OpenAI(
            base_url=rollout["openai_base_url"],
            api_key=rollout["api_key"],
            max_retries=0,
            timeout=self.timeout,
        )
        try:
            response = agent.chat.completions.create(
                model=self.model,
                messages=[
                    {"role": "system", "content": SYSTEM},
                    {"role": "user", "content": PROMPT},
                ],
                tools=[SUBMIT_TOOL],
                max_tokens=self.max_tokens,
                # The verifier scores the engine's own tokens, which the gateway hands back
                # when asked (vLLM's return_token_ids); decoding and re-encoding text would not
                # give the same ids.
                extra_body={"return_token_ids": True},
            )
        except BaseException:
            self._finish(rollout["rollout_id"], None, status="failed")
            raise
        finally:
            agent.close()
        ids = list(response.choices[0].model_extra["token_ids"])
        score = reward(ids, self.allowed, self.max_tokens)
        self._finish(rollout["rollout_id"], score)
        return ToyResult(rollout["rollout_id"], group_id, score, ids)

    def _finish(self, rollout_id: str, score: float | None, status: str = "finished") -> None:
        body = {"reward": score, "status": status}
        response = self._admin.post(f"/admin/rollouts/{rollout_id}/finish", json=body)
        if response.status_code >= 500:
            # Finishing is idempotent (the same status and reward again answers 200), so a
            # server error is retried once, as a runner would.
            response = self._admin.post(f"/admin/rollouts/{rollout_id}/finish", json=body)
        response.raise_for_status()

    def play_group(self, group_id: str, size: int) -> list[ToyResult]:
        """`size` rollouts of one group, played at once, as a runner plays a group."""
        with ThreadPoolExecutor(size) as pool:
            return list(pool.map(lambda _: self.play(group_id), range(size)))

    def close(self) -> None:
        self._admin.close()


def run_toy_rollouts(
    task: ToyTask,
    *,
    group_size: int,
    groups: int | None = None,
    stop: threading.Event | None = None,
    on_group: Callable[[list[ToyResult]], None] | None = None,
) -> list[ToyResult]:
    """Play groups one after another until `groups` are done or `stop` is set.

    One group at a time keeps generation from running far ahead of the trainer (whose samples
    would then be stale). Group ids are fresh for every call.
    """
    run = uuid.uuid4().hex[:8]
    results: list[ToyResult] = []
    n = 0
    while (groups is None or n < groups) and not (stop is not None and stop.is_set()):
        group = task.play_group(f"{TASK_ID}-{run}-{n}", group_size)
        results.extend(group)
        if on_group is not None:
            on_group(group)
        n += 1
    return results
