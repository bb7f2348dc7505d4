"""The body a replica is sent for one call, as a typed value built in one place (`build`): the
harness's fields that passed the allow-list (`gateway.constraints`), as they came; the training
policy's sampling over them; the switches that make the engine report what it sampled; and, for
an exact continuation, the prompt ids the gateway spliced (`gateway.continuation`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

import msgspec
import numpy as np
from msgspec import UNSET, UnsetType

from gateway import engine_ids
from gateway.protocols.adapter import CHAT_PATH

if TYPE_CHECKING:
    from gateway.continuation.planner import Turn

_encode = msgspec.json.encode


class KvTransfer(msgspec.Struct):
    """How vLLM takes a prompt as ids instead of rendering `messages` itself."""

    prompt_token_ids: list[msgspec.Raw]  # JSON pieces (`gateway.engine_ids`), sent as they are


class StreamOptions(msgspec.Struct):
    include_usage: bool  # the usage the capture is checked against comes in the last chunk


class EngineBody(msgspec.Struct, kw_only=True):
    """A `/v1/chat/completions` or `/v1/completions` body. Fields left UNSET are not sent. The
    harness's fields are typed as they may come (vLLM validates their contents); the policy's
    sampling is always sent, since an engine fills a field left out from the model's
    generation config, not from the policy."""

    model: str
    # The training policy's sampling (`call_request.sampling_policy`).
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    # What the engine reports of what it sampled.
    logprobs: bool | int  # chat: True; legacy completions: 0 alternatives
    top_logprobs: int | UnsetType = UNSET
    return_token_ids: bool | UnsetType = UNSET
    return_tokens_as_token_ids: bool | UnsetType = UNSET
    stream_options: StreamOptions | dict[str, Any] | UnsetType = UNSET
    kv_transfer_params: KvTransfer | UnsetType = UNSET
    # The harness's fields that leave sampling alone (`constraints.NEUTRAL`) ...
    messages: list[Any] | msgspec.Raw | UnsetType = UNSET
    prompt: Any = UNSET
    stream: Any = UNSET
    n: Any = UNSET
    user: Any = UNSET
    request_id: Any = UNSET
    max_tokens: Any = UNSET
    max_completion_tokens: Any = UNSET
    stop: Any = UNSET
    stop_token_ids: Any = UNSET
    include_stop_str_in_output: Any = UNSET
    skip_special_tokens: Any = UNSET
    spaces_between_special_tokens: Any = UNSET
    tools: Any = UNSET
    tool_choice: Any = UNSET
    parallel_tool_calls: Any = UNSET
    reasoning_effort: Any = UNSET
    add_generation_prompt: Any = UNSET
    continue_final_message: Any = UNSET
    add_special_tokens: Any = UNSET
    echo: Any = UNSET
    chat_template: Any = UNSET
    chat_template_kwargs: Any = UNSET
    documents: Any = UNSET
    priority: Any = UNSET
    cache_salt: Any = UNSET
    stream_interval: Any = UNSET
    # ... and those that constrain it (`constraints.CONSTRAINING`): the call is marked.
    structured_outputs: Any = UNSET
    guided_json: Any = UNSET
    guided_regex: Any = UNSET
    guided_choice: Any = UNSET
    guided_grammar: Any = UNSET
    guided_whitespace_pattern: Any = UNSET
    guided_decoding_backend: Any = UNSET
    response_format: Any = UNSET
    min_tokens: Any = UNSET
    ignore_eos: Any = UNSET
    bad_words: Any = UNSET
    allowed_token_ids: Any = UNSET
    logits_processors: Any = UNSET
    thinking_token_budget: Any = UNSET


class EngineRequest(NamedTuple):
    """What is sent to the engine, and what reading its answer needs to know of it."""

    body: EngineBody
    encoded: bytes
    path: str  # the engine endpoint
    streamed: bool
    passes_ids: bool  # the protocol passes the engine's prompt ids on unread
    prompt_ids: np.ndarray | None  # the spliced prompt, int32 (None: the engine renders it)
    # The spliced prompt ids as JSON pieces (None: the engine renders the prompt itself).
    prompt_json: engine_ids.Pieces | None
    # The same ids as one JSON array, if the engine is to echo them: its echo is known by them.
    echo_expected: bytes | None
    # The engine was asked for no id arrays: sampled ids are read from the logprob tokens.
    ids_in_logprobs: bool


def build(
    fields: dict[str, Any],
    sampling: dict[str, Any],
    path: str,
    passes_ids: bool,
    plan: Turn | None,
    wants_ids: bool,
) -> EngineRequest:
    """The body for a call whose harness fields are `fields` (read, not changed), sampled under
    `sampling`, to `path` (chat completions, or legacy completions), with the continuation
    `plan`. `wants_ids`: the harness asked for the engine's ids or logprobs itself."""
    chat = path == CHAT_PATH
    streamed = bool(fields.get("stream"))
    body = EngineBody(
        **fields,
        **sampling,
        logprobs=True if chat else 0,
        top_logprobs=0 if chat else UNSET,
        return_token_ids=True,
    )
    if streamed:
        body.stream_options = StreamOptions(include_usage=True)
    prompt_ids = None if plan is None else plan.prompt_ids
    prompt_json, echo_expected, ids_in_logprobs = None, None, False
    if plan is not None and plan.prompt_ids is not None:
        prompt_json = plan.prompt_pieces or (_encode(plan.prompt_ids.tolist()),)
        body.kv_transfer_params = KvTransfer(engine_ids.items(prompt_json))
        if wants_ids:
            echo_expected = engine_ids.concat(prompt_json)
        else:
            # The engine would echo the prompt the gateway just sent (at 32k tokens, 200 kB
            # to write, read and compare per call): only the sampled ids are asked for, as
            # logprob tokens. Its prompt token count still checks that it used these ids.
            body.return_token_ids = UNSET
            body.return_tokens_as_token_ids = ids_in_logprobs = True
    if plan is not None and isinstance(body.messages, list):
        body.messages = plan.engine_messages(body.messages)
    return EngineRequest(body, _encode(body), path, streamed, passes_ids, prompt_ids,
                         prompt_json, echo_expected, ids_in_logprobs)  # fmt: skip
