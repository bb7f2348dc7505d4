"""Which fields of a request reach the engine, and which of them keep it from sampling from the
free policy.

Only fields known to leave sampling alone pass (`NEUTRAL`), with those that constrain it
(below), which pass and mark the call; the harness's sampling parameters are replaced by the
policy's before this (`call_request.SAMPLING_KEYS`). Everything else is stripped and named in
the call's record (`applied.stripped`): an allow-list, because vLLM takes fields that change
what is sampled without a name that says so (`use_beam_search` is greedy decoding at n=1 on
vLLM 0.32; `vllm_xargs` reaches custom logits processors; `kv_transfer_params` would replace
the prompt ids the gateway splices), and a new release can add more.

A grammar (strict tools, a forced or required tool, a response format, structured outputs),
banned or allowed token sets, a minimum length or an ignored end of sequence all change the
distribution the engine samples from and reports logprobs of, while the trainer computes the
unconstrained policy's. Such calls are kept (the harness needs its grammar) but marked
`constrained`, and their tokens are not trained by default (invariant 10). Fields that would
switch capture off are not here: the call request stage removes them (see `CAPTURE_OFF`).
"""

from __future__ import annotations

from collections.abc import Container
from typing import Any

# Fields vLLM reads that turn the token capture off: removed before the request goes upstream
# and kept in the call's record of what was requested.
CAPTURE_OFF = ("include_reasoning",)

_GRAMMARS = (
    "structured_outputs",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "guided_whitespace_pattern",
    "guided_decoding_backend",
)


# Fields that do not change the distribution tokens are sampled from: the prompt and its
# rendering (recorded as the engine's prompt ids), where generation stops, output formatting,
# tools offered, scheduling, and the capture's own switches.
NEUTRAL = frozenset({
    "model", "messages", "prompt", "stream", "stream_options", "n", "user", "request_id",
    "max_tokens", "max_completion_tokens", "stop", "stop_token_ids",
    "include_stop_str_in_output", "skip_special_tokens", "spaces_between_special_tokens",
    "tools", "tool_choice", "parallel_tool_calls", "reasoning_effort",
    "add_generation_prompt", "continue_final_message", "add_special_tokens", "echo",
    "chat_template", "chat_template_kwargs", "documents",
    "priority", "cache_salt", "stream_interval",
    "return_token_ids",
})  # fmt: skip

# Fields that constrain sampling: passed on (the harness needs its grammar), the call marked.
CONSTRAINING = frozenset({
    *_GRAMMARS, "response_format", "min_tokens", "ignore_eos", "bad_words", "allowed_token_ids",
    "logits_processors", "thinking_token_budget",
})


_KNOWN = NEUTRAL | CONSTRAINING


def strip_unknown(body: dict[str, Any], handled: Container[str]) -> list[str]:
    """Removes from an engine body every field neither neutral nor constraining nor `handled`
    by the caller; returns their names, sorted."""
    stripped = sorted(k for k in body if k not in _KNOWN and k not in handled)
    for key in stripped:
        del body[key]
    return stripped


def constraints(body: dict[str, Any]) -> list[str]:
    """Names of the fields of an upstream (chat or completions) body that constrain sampling."""
    found = [k for k in _GRAMMARS if body.get(k) not in (None, {}, [], "")]
    fmt = body.get("response_format")
    if isinstance(fmt, dict) and fmt.get("type") not in (None, "text"):
        found.append("response_format")
    choice = body.get("tool_choice")
    if body.get("tools") and (choice == "required" or isinstance(choice, dict)):
        found.append("tool_choice")
    for tool in body.get("tools") or ():
        fn = tool.get("function") if isinstance(tool, dict) else None
        if (isinstance(fn, dict) and fn.get("strict")) or (
            isinstance(tool, dict) and tool.get("strict")
        ):
            found.append("tools.strict")
            break
    if body.get("min_tokens"):
        found.append("min_tokens")
    if body.get("ignore_eos"):
        found.append("ignore_eos")
    for key in ("bad_words", "allowed_token_ids", "logits_processors", "thinking_token_budget"):
        if body.get(key) not in (None, [], {}):
            found.append(key)
    return found
