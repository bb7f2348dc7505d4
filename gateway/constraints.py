"""Request fields under which the engine does not sample from the free policy.

A grammar (strict tools, a forced or required tool, a response format, structured outputs),
banned or allowed token sets, a minimum length or an ignored end of sequence all change the
distribution the engine samples from and reports logprobs of, while the trainer computes the
unconstrained policy's. Such calls are kept (the harness needs its grammar) but marked
`constrained`, and their tokens are not trained by default (invariant 10). Fields that would
switch capture off are not here: the call request stage removes them (see `CAPTURE_OFF`).
"""

from __future__ import annotations

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
