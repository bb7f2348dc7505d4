"""Local rendering where it has reproduced the engine's ids, the engine everywhere else, with a
sample of later renders checked against the engine in the background."""

from __future__ import annotations

import asyncio
import functools
import logging
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Hashable
from concurrent.futures import ThreadPoolExecutor

from gateway.continuation.engine_render import Around, Encoded, EngineRenderer, RenderError
from gateway.continuation.keys import context_key
from gateway.continuation.local_template import CONTENT_FORMATS, LocalTemplate

log = logging.getLogger(__name__)

# A few conversation shapes, each rendered with and without a generation prompt and with and
# without a tool: what a replica and model must reproduce before local rendering is used for them.
_PROBE_TOOL = {
    "type": "function",
    "function": {
        "name": "probe",
        "description": "A probe.",
        "parameters": {"type": "object", "properties": {"x": {"type": "string"}}},
    },
}
_PROBES = (
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hi."}],
    [{"role": "user", "content": "Hi   there\n\n  friend\t!"}],
    [
        {
            "role": "user",
            "content": [{"type": "text", "text": "one"}, {"type": "text", "text": "2"}],
        },
        {"role": "assistant", "content": "a b", "refusal": None},
        {"role": "user", "content": "cafe\u0301 \u00e9t\u00e9 \u4e2d\u6587 \U0001f600"},
    ],
    [
        {"role": "user", "content": "q"},
        {
            "role": "assistant",
            "content": "",
            "reasoning": "hmm",
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "probe", "arguments": '{ "x" :  "y"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "ok"},
    ],
)


class Crosscheck:
    """Where a cheaper render (`what`) may stand in for the reference one (`reference`).

    Per key (an upstream and request context, and whatever else the cheaper render depends on):
    unknown until a request there is rendered both ways, then trusted while the two agree. One
    in `sample_every` later uses is checked again in the background, one in twice as many after
    each check that agrees, down to one in `8 * sample_every` (a reference render costs what the
    cheaper one saves: at 32k tokens, milliseconds); one disagreement ends the cheaper render's
    use for that key and brings the checks back to one in `sample_every`."""

    def __init__(
        self, what: str, reference: str, sample_every: int = 32, keys: int = 4096
    ) -> None:
        self._what = what
        self._reference = reference
        self._sample_every = sample_every
        self._interval = self._due = sample_every
        # Bounded, the least recently used forgotten first: a forgotten key is learnt again at
        # the cost of one more reference render, while requests of endless new shapes (a
        # hostile harness) would otherwise grow it without end.
        self._keys: OrderedDict[Hashable, bool] = OrderedDict()
        self._max_keys = keys
        self._checks: set[asyncio.Task] = set()
        self.stats = {"used": 0, "checked": 0, "mismatches": 0}

    def trusted(self, key: Hashable) -> bool | None:
        found = self._keys.get(key)
        if found is not None:
            self._keys.move_to_end(key)
        return found

    def _set(self, key: Hashable, trusted: bool) -> None:
        self._keys[key] = trusted
        self._keys.move_to_end(key)
        while len(self._keys) > self._max_keys:
            self._keys.popitem(last=False)

    def judge(self, key: Hashable, cheap: Around | None, reference: Around | None) -> None:
        same = (reference is None and cheap is None) or (
            reference is not None and cheap is not None and reference.same_ids(cheap)
        )
        self.stats["checked"] += 1
        if same:
            if key not in self._keys:
                log.info("%s agrees with %s at %s; used there", self._what, self._reference,
                         _describe(key))
            self._set(key, True)
        else:
            self.distrust(key, f"it differs from {self._reference}")

    def distrust(self, key: Hashable, why: str) -> None:
        self.stats["mismatches"] += 1
        self._set(key, False)
        log.warning("%s not used at %s again: %s", self._what, _describe(key), why)

    def used(
        self,
        key: Hashable,
        cheap: Around | None,
        reference: Callable[[], Awaitable[Around | None]],
    ) -> None:
        """Counts a use of the cheaper render; the sampled ones are checked against
        `reference()` in the background (the call does not wait for it)."""
        self.stats["used"] += 1
        self._due -= 1
        if self._due > 0:
            return
        self._due = self._interval
        task = asyncio.create_task(self._sample(key, cheap, reference))
        self._checks.add(task)
        task.add_done_callback(self._checks.discard)

    async def _sample(self, key, cheap, reference) -> None:
        try:
            expected = await reference()
        except RenderError:
            return  # nothing learnt; a later sample checks again
        self.judge(key, cheap, expected)
        agreed = self._keys.get(key) is True
        self._interval = (
            min(self._interval * 2, 8 * self._sample_every) if agreed else self._sample_every
        )


def _describe(key: Hashable) -> str:
    parts = key if isinstance(key, tuple) else (key,)
    return " ".join(p.hex()[:12] if isinstance(p, bytes) else str(p) for p in parts)


class CheckedRenderer:
    """Local rendering where it has reproduced the engine, the engine everywhere else."""

    def __init__(self, engine: EngineRenderer, local: LocalTemplate, sample_every: int = 32):
        self._engine = engine
        self._local = local
        self._check = Crosscheck("local rendering", "the engine's", sample_every)
        self.stats = self._check.stats
        # (upstream, model) -> content format that reproduced the engine, or None
        self._models: dict[tuple[str, str], str | None] = {}
        self._model_locks: dict[tuple[str, str], asyncio.Lock] = {}
        # Rendering a long conversation with Jinja and tokenizing it takes milliseconds of CPU:
        # done on a thread of its own, the event loop goes on serving streams meanwhile. One
        # thread: the renders hold the GIL, more would only contend for it.
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="rolltap-render")

    async def render(self, upstream: str, body: dict) -> list[int]:
        return await self._engine.render(upstream, body)

    async def self_check(self, upstream: str, model: str) -> str | None:
        """The content format in which local rendering reproduces `upstream`'s ids for `model`
        on every probe, or None; decided once per replica and model."""
        key = (upstream, model)
        if key in self._models:
            return self._models[key]
        async with self._model_locks.setdefault(key, asyncio.Lock()):
            if key in self._models:
                return self._models[key]
            bodies = [
                {"model": model, "messages": p, "add_generation_prompt": g}
                | ({"tools": [_PROBE_TOOL]} if tools else {})
                for p in _PROBES
                for g in (True, False)
                for tools in (False, True)
            ]
            expected = await asyncio.gather(*(self._engine.render(upstream, b) for b in bodies))
            found = None
            for fmt in CONTENT_FORMATS:
                try:
                    if all(self._local.render(b, fmt) == e for b, e in zip(bodies, expected)):
                        found = fmt
                        break
                except Exception:  # noqa: BLE001 - a template that fails here is not used
                    log.exception("local rendering failed on a probe")
                    break
            if found is None:
                log.warning(
                    "local rendering differs from %s for %s; rendering there", upstream, model
                )
            self._models[key] = found
            return found

    async def around(
        self, upstream: str, body: dict, upto: int, encoded: Encoded | None = None
    ) -> Around | None:
        context = context_key(body)
        try:
            fmt = await self.self_check(upstream, body.get("model"))
        except RenderError:
            fmt = None
        key = (upstream, context)
        trusted = self._check.trusted(key)
        engine = functools.partial(self._engine.around, upstream, body, upto, encoded)
        if fmt is None or trusted is False:
            return await engine()
        try:
            local = await asyncio.get_running_loop().run_in_executor(
                self._executor, self._local.around, body, upto, fmt
            )
        except Exception:  # noqa: BLE001 - e.g. a template error: the engine says what is wrong
            log.exception("local rendering failed; asking the engine")
            local = False
        if local is False:
            return await engine()
        if trusted is None:  # a new context: the engine answers, and says whether to trust us
            reference = await engine()
            self._check.judge(key, local, reference)
            return reference
        self._check.used(key, local, engine)
        return local
