"""Local rendering where it has reproduced the engine's ids, the engine everywhere else, with a
sample of later renders checked against the engine in the background."""

from __future__ import annotations

import asyncio
import functools
import logging
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from gateway.continuation.keys import context_key
from gateway.continuation.local_template import CONTENT_FORMATS, LocalTemplate
from gateway.continuation.rendering import Around, Crosscheck, Encoded, RenderError

if TYPE_CHECKING:
    from gateway.continuation.engine_render import EngineRenderer

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
        model = body.get("model")
        assert isinstance(model, str)  # call_request puts the served model in every body
        try:
            fmt = await self.self_check(upstream, model)
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
