"""The text an engine makes of a recorded call's sampled ids, to check records against what a
client received."""

from __future__ import annotations

from tokenizers.decoders import DecodeStream

__all__ = ["engine_text"]

# vLLM restarts its decode stream on this error of tokenizers' DecodeStream (vllm#17448).
_INVALID_PREFIX = "Invalid prefix encountered"


def engine_text(tokenizer, call: dict, *, skip_special_tokens: bool = True) -> str:
    """A call's sampled ids as vLLM's fast incremental detokenizer turns them into text:
    tokenizers' DecodeStream primed with the prompt. Unlike a one-shot `decode`, it never emits
    an incomplete UTF-8 sequence at the end, which the random tiny model often leaves when it
    stops at `max_tokens` in the middle of a character; and the stop token that ended the reply
    is not text.

    `skip_special_tokens=False` where the engine keeps them: vLLM's hermes tool parser does so
    for every request that offers tools with a `tool_choice` other than "none"."""
    ids = list(call["completion_ids"])
    if call["finish_reason"] == "stop" and ids and ids[-1] in tokenizer.all_special_ids:
        ids.pop()
    backend = tokenizer.backend_tokenizer
    stream = DecodeStream(ids=call["prompt_ids"], skip_special_tokens=skip_special_tokens)
    pieces = []
    for token in ids:
        try:
            piece = stream.step(backend, token)
        except Exception as exc:
            if _INVALID_PREFIX not in str(exc):
                raise
            stream = DecodeStream(skip_special_tokens=skip_special_tokens)
            piece = stream.step(backend, token)
        pieces.append(piece or "")
    return "".join(pieces)
