"""What the engine really did on one call, collected from its response as it streams by.

Token ids and logprobs are taken from vLLM's own fields (`prompt_token_ids`, `token_ids`,
`logprobs`), never re-encoded (invariant 1). A call whose prompt ids the gateway chose (an exact
continuation) does not have them echoed: its sampled ids come as the `token_id:N` strings vLLM
writes for logprob tokens with `return_tokens_as_token_ids`. Every sampled token is stamped with
the policy version live when its chunk arrived (invariant 4). The assistant message the client
saw is assembled too: it is stored with the call, and later requests are matched against it.
"""

from __future__ import annotations

from array import array

import numpy as np


class Capture:
    __slots__ = (
        "prompt_ids",
        "completion_ids",
        "logprobs",
        "_version_runs",
        "finish_reason",
        "_text",
        "_reasoning",
        "_tool_calls",
        "usage",
        "ids_in_logprobs",
    )

    def __init__(self) -> None:
        self.prompt_ids: np.ndarray | None = None  # int32
        self.completion_ids = array("i")
        self.logprobs = array("f")
        self._version_runs: list[tuple[int, int]] = []  # (token count, version), in order
        self.finish_reason: str | None = None
        self._text: list[str] = []
        self._reasoning: list[str] = []
        self._tool_calls: dict[int, dict] = {}
        self.usage: dict | None = None
        # The engine was asked for no id arrays: sampled ids are read from the logprob tokens.
        self.ids_in_logprobs = False

    # -- feeding -----------------------------------------------------------------------------

    def add_chunk(self, chunk: dict, version: int) -> None:
        """One streamed chunk of /v1/chat/completions or /v1/completions."""
        prompt = chunk.get("prompt_token_ids")
        if prompt is not None:
            self.set_prompt(prompt)
        usage = chunk.get("usage")
        if usage:
            self.usage = usage
        for choice in chunk.get("choices") or ():
            if choice.get("index", 0) != 0:
                continue
            prompt = choice.get("prompt_token_ids")  # the completions API puts it here
            if prompt is not None:
                self.set_prompt(prompt)
            self._add_tokens(choice, version)
            delta = choice.get("delta")
            if delta is not None:
                self._add_message_delta(delta)
            elif "text" in choice:
                self._text.append(choice["text"])
            if choice.get("finish_reason") is not None:
                self.finish_reason = choice["finish_reason"]

    def set_prompt(self, ids) -> None:
        """The engine's prompt ids (an int32 array, or the list decoded from its JSON); the
        first ones given stay: the engine reading hands them over before the response is fed, as an
        array (`gateway.engine_ids`)."""
        if self.prompt_ids is None and isinstance(ids, (list, np.ndarray)):
            self.prompt_ids = np.asarray(ids, dtype=np.int32)

    def add_response(self, resp: dict, version: int) -> None:
        """A whole non-streamed response. `version` is the older of the versions live at the
        start and the end of the call: the tokens may have been sampled under either."""
        self.add_chunk(
            {
                "prompt_token_ids": resp.get("prompt_token_ids"),
                "usage": resp.get("usage"),
                "choices": [
                    {**c, "delta": c["message"]} if "message" in c else c
                    for c in resp.get("choices") or ()
                ],
            },
            version,
        )

    def _add_tokens(self, choice: dict, version: int) -> None:
        ids = choice.get("token_ids")
        if ids is None and self.ids_in_logprobs:
            ids = choice["token_ids"] = _logprob_ids(choice.get("logprobs"))
        if not ids:
            return
        self.completion_ids.extend(ids)
        self._version_runs.append((len(ids), version))
        lp = choice.get("logprobs")
        if lp is None:
            return
        content = lp.get("content")
        if content is not None:  # chat shape
            self.logprobs.extend([entry["logprob"] for entry in content])
        else:  # completions shape
            self.logprobs.extend(lp.get("token_logprobs") or ())

    def _add_message_delta(self, delta: dict) -> None:
        content = delta.get("content")
        if content:
            self._text.append(content)
        reasoning = delta.get("reasoning_content") or delta.get("reasoning")
        if reasoning:
            self._reasoning.append(reasoning)
        for call in delta.get("tool_calls") or ():
            slot = self._tool_calls.setdefault(
                call.get("index", len(self._tool_calls)),
                {"id": None, "type": "function", "function": {"name": "", "arguments": ""}},
            )
            if call.get("id"):
                slot["id"] = call["id"]
            fn = call.get("function") or {}
            if fn.get("name"):
                slot["function"]["name"] += fn["name"]
            if fn.get("arguments"):
                slot["function"]["arguments"] += fn["arguments"]

    # -- results -----------------------------------------------------------------------------

    def versions(self) -> np.ndarray:
        if not self._version_runs:
            return np.zeros(0, dtype=np.int32)
        counts, versions = zip(*self._version_runs)
        return np.repeat(np.asarray(versions, dtype=np.int32), counts)

    def message(self) -> dict:
        """The assistant message as the client received it, in chat-completions form."""
        msg: dict = {"role": "assistant", "content": "".join(self._text) or None}
        if self._reasoning:
            msg["reasoning_content"] = "".join(self._reasoning)
        if self._tool_calls:
            msg["tool_calls"] = [self._tool_calls[i] for i in sorted(self._tool_calls)]
        return msg

    def check(self) -> str | None:
        """Why this capture cannot be trusted, or None. Logprobs must align 1:1 with ids."""
        if self.prompt_ids is None:
            return "engine returned no prompt_token_ids"
        if len(self.logprobs) != len(self.completion_ids):
            return f"{len(self.logprobs)} logprobs for {len(self.completion_ids)} sampled tokens"
        # The engine's own count is the check that nothing was withheld (a reasoning parser
        # told not to return reasoning drops its token ids, for one).
        usage = self.usage or {}
        for kind, ids in (("prompt", self.prompt_ids), ("completion", self.completion_ids)):
            counted = usage.get(f"{kind}_tokens")
            if counted is None:
                return f"engine reported no {kind}_tokens usage to check the capture against"
            if counted != len(ids):
                return f"engine counted {counted} {kind} tokens but returned {len(ids)} ids"
        return None


_ID_PREFIX = "token_id:"


def _logprob_ids(logprobs) -> list[int] | None:
    """The sampled ids of a chat choice's `logprobs.content` written as `token_id:N`; None if it
    has none, or any token is not written so (then no ids are taken and the check fails)."""
    content = logprobs.get("content") if isinstance(logprobs, dict) else None
    if not content:
        return None
    try:
        tokens = [entry["token"] for entry in content]
    except (KeyError, TypeError):
        return None
    n = len(_ID_PREFIX)
    # Plain ASCII digits only: int() would also take signs, spaces, underscores and other scripts.
    if not all(
        type(t) is str and t.startswith(_ID_PREFIX) and t[n:].isascii() and t[n:].isdigit()
        and len(t) - n <= 10
        for t in tokens
    ):
        return None
    ids = [int(t[n:]) for t in tokens]
    return ids if max(ids) < 2**31 else None
