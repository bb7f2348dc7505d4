"""The continuation step of a call (see the package docstring for what and why): find the
call a request continues, render, splice; and remember each call's reply for the calls after it.

Parents are found in an in-memory index of reply keys per rollout; the database answers what the
index cannot (a restart, or the previous turn served by another gateway), and is asked only when
the request's last assistant turn is not in the index. The parent's tokens come from the recent
calls cache or, failing that, from its stored base chain.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from typing import TYPE_CHECKING, Any
from uuid import UUID

import asyncpg
import msgspec
import numpy as np

from core.store import calls as calls_store
from gateway import engine_ids
from gateway.continuation import splice as cont
from gateway.continuation.keys import RequestKeys
from gateway.continuation.rendering import RenderError, render_body
from gateway.continuation.splice import ContinuationRecord

if TYPE_CHECKING:
    from gateway.continuation.window import WindowedRenderer
    from gateway.rollout_memory import RolloutMemory
    from gateway.stage_cpu import Clock

log = logging.getLogger(__name__)

_encode = msgspec.json.encode

# Sampled ids a spliced prompt's array has room for after it (see `Turn.full`): most replies
# of an agent are shorter; a longer one is copied. 8 kB a call at most, not counted as kept.
_SPARE = 2048

_PROBE_USER = {"role": "user", "content": "x"}
_PROBE_EMPTY_REPLY = {"role": "assistant", "content": ""}


class Turn:
    """One call's continuation: its request keys, what was decided, and the ids to send."""

    __slots__ = (
        "keys", "record", "parent_id", "parent_full", "prompt_ids", "prompt_pieces", "_extended"
    )  # fmt: skip

    def __init__(
        self,
        keys: RequestKeys,
        record: ContinuationRecord,
        parent_id: UUID | None = None,
        parent_full: np.ndarray | None = None,
        prompt_ids: np.ndarray | None = None,
        prompt_pieces: engine_ids.Pieces | None = None,
    ) -> None:
        self.keys = keys
        self.record = record
        self.parent_id = parent_id
        self.parent_full = parent_full
        self.prompt_ids = prompt_ids
        # `prompt_ids` as JSON pieces (the parent's, then the new ids), if the parent's are at hand
        self.prompt_pieces = prompt_pieces
        self._extended = False

    def full(self, prompt: np.ndarray, completion: np.ndarray) -> np.ndarray:
        """`prompt` + `completion`. The splice's prompt is followed by them in the room its array
        left (once: the array then holds them): a 32k-token prompt is not copied again."""
        room = prompt.base
        n, m = prompt.size, completion.size
        if (
            prompt is self.prompt_ids
            and not self._extended
            and isinstance(room, np.ndarray)
            and room.size >= n + m
        ):
            self._extended = True
            room[n : n + m] = completion
            return room[: n + m]
        return np.concatenate((prompt, completion))

    def confirm(self, prompt: np.ndarray) -> None:
        """Checks the engine's prompt against the splice: an engine that rendered the messages
        instead (it does so for media content) must not leave an `exact` record behind."""
        if (
            self.prompt_ids is not None
            and prompt is not self.prompt_ids  # not echoed: the engine's count checked it
            and prompt.size
            and not np.array_equal(prompt, self.prompt_ids)
        ):
            self.record = msgspec.structs.replace(self.record, path="fallback", reason=cont.IGNORED)
            self.prompt_ids = self.parent_full = None

    def engine_messages(self, messages: list) -> list | msgspec.Raw:
        """The `messages` the engine is sent. Given the prompt ids (an exact continuation) it
        neither templates nor tokenizes them, so only the continued reply and what follows it
        go: the rest would be sent, parsed and validated for nothing (at 32k tokens, 130 kB a
        call). Otherwise all of them, as encoded for the keys."""
        if self.prompt_ids is not None:
            return messages[self.record.messages - 1 :]
        return msgspec.Raw(self.keys.messages_json())

    def opens(self, prompt: np.ndarray, candidates: list[tuple[UUID, np.ndarray]]) -> int | None:
        """The index among `candidates` of the parent, if `prompt` is the splice built from its
        ids (which then open it without being compared)."""
        if self.prompt_ids is None or prompt is not self.prompt_ids:
            return None
        return next((i for i, (cid, _) in enumerate(candidates) if cid == self.parent_id), None)

    def candidates(self, recent: list[tuple[UUID, np.ndarray]]) -> list[tuple[UUID, np.ndarray]]:
        """Delta-encoding candidates with the parent added: it is the best base of an exact
        continuation even when it dropped out of the recent calls."""
        if self.parent_full is None or any(cid == self.parent_id for cid, _ in recent):
            return recent
        assert self.parent_id is not None  # a turn gets parent_full with its parent_id
        return [*recent, (self.parent_id, self.parent_full)]


class Continuer:
    def __init__(
        self,
        mode: str,
        pool: asyncpg.Pool,
        memory: RolloutMemory,
        renderer: WindowedRenderer,
    ) -> None:
        self.mode = mode
        self._pool = pool
        self._recent = memory.recent
        self._index = memory.replies
        self._renderer = renderer
        # (upstream, context key) -> the template's assistant turn end; bounded by the number of
        # distinct tool sets and models, small in practice.
        self._suffixes: OrderedDict[tuple[str, bytes], tuple[int, ...]] = OrderedDict()

    def _unspliced(self, keys: RequestKeys, body: dict[str, Any]) -> tuple[str, str] | None:
        """(path, reason) of a continuation the gateway does not splice whatever the parent's
        tokens: configured so, or a request with media or `echo`; None if it may splice."""
        if self.mode == "render":
            return "render", cont.CONFIGURED
        if keys.media:
            return "fallback", cont.MEDIA
        if body.get("echo"):
            return "fallback", cont.ECHO
        return None

    async def prepare(
        self, rollout_id: UUID, upstream: str, body: dict[str, Any], clock: Clock
    ) -> Turn:
        """Decides how the engine gets this request's prompt; a render that fails means a plain
        render, not a failed request. `clock` is paused over what waits (database, renders)."""
        earlier = self._recent.entries(rollout_id) or ()
        keys = RequestKeys(body, (c.keys for c in earlier if c.keys is not None))
        if not keys.keys:
            return Turn(keys, ContinuationRecord(path="render", reason=cont.FIRST_TURN))
        found = await self._find(rollout_id, keys, clock)
        if found is None:
            return Turn(keys, ContinuationRecord(path="render", reason=cont.NO_PARENT))
        i, parent_id = found
        record = ContinuationRecord(
            path="render", parent=str(parent_id), messages=keys.positions[i] + 1
        )

        def plain(path: str, reason: str, **extra) -> Turn:
            return Turn(keys, msgspec.structs.replace(record, path=path, reason=reason, **extra))

        unspliced = self._unspliced(keys, body)
        if unspliced is not None:
            return plain(*unspliced)
        parent_full, parent_pieces = await self._parent_ids(rollout_id, parent_id, clock)
        if parent_full is None or not parent_full.size:
            return plain("fallback", cont.PARENT_TOKENS)
        started = time.perf_counter()
        around = self._renderer.around(
            upstream, body, keys.positions[i] + 1, keys.messages_json, keys.context
        )
        suffix = self._suffixes.get((upstream, keys.context))
        try:
            if suffix is None:  # probed once per context, beside this call's renders
                suffix, around = await clock.wait(
                    "plan", asyncio.gather(self._suffix(upstream, body, keys.context), around)
                )
            else:  # at hand: a gather would cost two tasks, tens of µs a call
                around = await clock.wait("plan", around)
        except RenderError as exc:
            log.warning("continuation render failed, rendering plainly: %s", exc)
            return plain("fallback", cont.RENDER_FAILED)
        render_ms = round((time.perf_counter() - started) * 1000, 3)
        if around is None:
            return plain("fallback", cont.REWRITES_HISTORY, render_ms=render_ms)
        cap = body.get("max_tokens") or body.get("max_completion_tokens")
        spare = min(cap, _SPARE) if isinstance(cap, int) and cap > 0 else _SPARE
        ids, reason = cont.splice(parent_full, around.turn_end, around.tail, suffix, spare)
        if ids is None:
            assert reason is not None  # splice says why it gave no ids
            return plain(
                "fallback", reason, render_ms=render_ms, rendered_by=around.by, window=around.window
            )
        pieces = None
        if parent_pieces is not None:  # the parent's ids as text, then the new ones encoded
            pieces = engine_ids.extend(parent_pieces, _encode(ids[parent_full.size :].tolist()))
        return Turn(
            keys,
            msgspec.structs.replace(
                record,
                path="exact",
                render_ms=render_ms,
                rendered_by=around.by,
                window=around.window,
            ),
            parent_id,
            parent_full,
            ids,
            pieces,
        )

    async def _find(
        self, rollout_id: UUID, keys: RequestKeys, clock: Clock
    ) -> tuple[int, UUID] | None:
        replies = self._index.get(rollout_id)
        i = keys.longest(replies.calls)
        unknown = [k for k in keys.keys[i + 1 :] if k not in replies.missing]
        if unknown:
            async with self._pool.acquire() as conn:
                rows = await clock.wait(
                    "plan", calls_store.find_replies(conn, rollout_id, unknown)
                )
            for call_id, reply_keys in rows:  # oldest first: the newest call wins a shared key
                self._index.add(rollout_id, call_id, reply_keys)
            self._index.add_missing(rollout_id, unknown)
            i = keys.longest(replies.calls)
        return None if i < 0 else (i, replies.calls[keys.keys[i]])

    async def _parent_ids(
        self, rollout_id: UUID, call_id: UUID, clock: Clock
    ) -> tuple[np.ndarray | None, engine_ids.Pieces | None]:
        """The parent's prompt + sampled ids, and their JSON if it is at hand."""
        recent = self._recent.find(rollout_id, call_id)
        if recent is not None:
            return recent.full, recent.full_json
        async with self._pool.acquire() as conn:
            return await clock.wait("plan", calls_store.full_ids(conn, rollout_id, call_id)), None

    async def _suffix(self, upstream: str, body: dict, context: bytes) -> tuple[int, ...]:
        """The template's assistant turn end under this request's context, probed once."""
        key = (upstream, context)
        suffix = self._suffixes.get(key)
        if suffix is None:
            generation, empty_turn = await asyncio.gather(
                self._renderer.render(
                    upstream, render_body(body, [_PROBE_USER], ending="generation")
                ),
                self._renderer.render(
                    upstream,
                    render_body(body, [_PROBE_USER, _PROBE_EMPTY_REPLY], ending="none"),
                ),
            )
            suffix = cont.assistant_suffix(generation, empty_turn)
            if not suffix:
                log.warning("chat template shows no assistant turn end; continuing plainly")
            self._suffixes[key] = suffix
            while len(self._suffixes) > 1024:
                self._suffixes.popitem(last=False)
        return suffix
