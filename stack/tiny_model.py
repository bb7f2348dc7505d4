"""`rolltap tiny-model`: build a tiny random Qwen2 model with a ChatML/Hermes tokenizer, offline.

The tests and the demo need a real model that vLLM's CPU build serves in under a minute and that
speaks the chat and tool-call format real harnesses expect. Nothing here downloads anything: the
tokenizer is a byte-level BPE trained on text generated in this module, the weights are drawn from
a seeded numpy generator, so one seed always gives byte-identical files.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

HIDDEN_SIZE = 128
NUM_LAYERS = 2
NUM_HEADS = 2
HEAD_DIM = 64  # vLLM's CPU attention rejects smaller heads ("Unsupported CPU attention").
NUM_KV_HEADS = 1
INTERMEDIATE_SIZE = 256
VOCAB_SIZE = 2048
MAX_POSITIONS = 65536  # Harness prompts run to tens of thousands of tokens with this vocabulary.
ROPE_THETA = 1_000_000.0
# Small enough that the logits stay close to uniform: the model rambles instead of stopping at once.
INIT_STD = 0.02

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
# (token, special). Tool and think tags are not special, as in Qwen: vLLM decodes with
# skip_special_tokens, and the hermes tool parser must still see `<tool_call>` in the text.
ADDED_TOKENS: tuple[tuple[str, bool], ...] = (
    (ENDOFTEXT, True),
    (IM_START, True),
    (IM_END, True),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<tool_response>", False),
    ("</tool_response>", False),
    ("<think>", False),
    ("</think>", False),
)

CHAT_TEMPLATE = """\
{%- macro render_text(content) -%}
    {%- if content is string -%}
        {{- content -}}
    {%- elif content is iterable -%}
        {%- for part in content -%}
            {%- if part.type == 'text' -%}{{- part.text -}}{%- endif -%}
        {%- endfor -%}
    {%- endif -%}
{%- endmacro -%}
{%- set has_system = messages and messages[0].role == 'system' -%}
{%- if tools -%}
    {{- '<|im_start|>system\\n' -}}
    {%- if has_system -%}{{- render_text(messages[0].content) + '\\n\\n' -}}{%- endif -%}
    {{- '# Tools\\n\\nThese functions are available, one JSON signature per line:\\n<tools>\\n' -}}
    {#- Name, description and parameters only, in this order: clients (and vLLM's request
        models) order and decorate tool objects differently, the prompt should not care. -#}
    {%- for tool in tools -%}
        {%- set fn = tool.function if tool.function is defined else tool -%}
        {%- set parameters = fn.parameters if fn.parameters is mapping else {} -%}
        {%- if fn.description is string -%}
            {%- set signature = {'name': fn.name, 'description': fn.description,
                                 'parameters': parameters} -%}
        {%- else -%}
            {%- set signature = {'name': fn.name, 'parameters': parameters} -%}
        {%- endif -%}
        {{- signature | tojson -}}{{- '\\n' -}}
    {%- endfor -%}
    {{- '</tools>\\n\\nTo call a function, answer with its name and a JSON object of arguments ' -}}
    {{- 'between tool-call tags:\\n<tool_call>\\n' -}}
    {{- '{"name": <function-name>, "arguments": <arguments-object>}\\n</tool_call><|im_end|>\\n' -}}
{%- elif has_system -%}
    {{- '<|im_start|>system\\n' + render_text(messages[0].content) + '<|im_end|>\\n' -}}
{%- endif -%}
{%- for message in messages -%}
    {%- if loop.first and has_system -%}
    {%- elif message.role == 'assistant' -%}
        {{- '<|im_start|>assistant\\n' -}}
        {%- set reasoning = message.reasoning_content or message.reasoning -%}
        {%- if reasoning is string and reasoning -%}
            {{- '<think>\\n' + reasoning + '\\n</think>\\n\\n' -}}
        {%- endif -%}
        {%- set content = render_text(message.content) -%}
        {{- content -}}
        {%- for call in message.tool_calls or [] -%}
            {%- set fn = call.function if call.function is defined else call -%}
            {%- if content or not loop.first -%}{{- '\\n' -}}{%- endif -%}
            {{- '<tool_call>\\n{"name": ' + (fn.name | tojson) + ', "arguments": ' -}}
            {%- if fn.arguments is string -%}
                {{- fn.arguments -}}
            {%- else -%}
                {{- fn.arguments | tojson -}}
            {%- endif -%}
            {{- '}\\n</tool_call>' -}}
        {%- endfor -%}
        {{- '<|im_end|>\\n' -}}
    {%- elif message.role == 'tool' -%}
        {#- Consecutive tool results share one user turn. The turn is closed by whatever comes
            next, not here, so a conversation ending in a tool result stays a prefix of its
            continuation. -#}
        {%- if loop.first or loop.previtem.role != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}
        {{- '\\n<tool_response>\\n' + render_text(message.content) + '\\n</tool_response>' -}}
        {%- if not loop.last and loop.nextitem.role != 'tool' -%}
            {{- '<|im_end|>\\n' -}}
        {%- endif -%}
    {%- else -%}
        {{- '<|im_start|>' + message.role + '\\n' -}}
        {{- render_text(message.content) + '<|im_end|>\\n' -}}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {%- if messages and messages[-1].role == 'tool' -%}{{- '<|im_end|>\\n' -}}{%- endif -%}
    {{- '<|im_start|>assistant\\n' -}}
{%- endif -%}
"""

_PROSE = """\
The agent reads the task, opens the repository and runs the tests before it changes anything.
A failing test tells it where to look; a passing one tells it what not to break. When a tool call
returns an error, the agent reads the message, fixes the arguments and tries again. The gateway
records every token the engine saw and every token it sampled, so the trainer learns from exactly
what happened. Rewards come from hidden tests that the agent never sees. Each rollout belongs to a
group, and the advantage of a rollout is its reward compared with the others in the same group.
Please summarize the changes in one short paragraph. What is the capital of France? Paris is the
capital of France. How many files are in this directory? There are three files and two folders.
Write a function that returns the sum of a list of numbers, then add a test for the empty list.
The quick brown fox jumps over the lazy dog. She sells sea shells by the sea shore. It was a bright
cold day in April, and the clocks were striking thirteen. I think the bug is in the parser: it
drops the last line when the file does not end with a newline. Let me check the logs first.
Thanks! That fixed it. Could you also update the documentation and the changelog? Sure, here is
the plan: read the file, find the function, change the default value, run the tests, commit.
"""

_PYTHON = '''\
import json
import os
import sys
from pathlib import Path


def read_lines(path: str) -> list[str]:
    """Return the lines of a text file without trailing newlines."""
    with open(path, encoding="utf-8") as handle:
        return [line.rstrip("\\n") for line in handle]


class Counter:
    def __init__(self, start: int = 0) -> None:
        self.value = start

    def increment(self, step: int = 1) -> int:
        self.value += step
        return self.value


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args:
        print("usage: count FILE", file=sys.stderr)
        return 2
    total = 0
    for name in args:
        try:
            total += len(read_lines(name))
        except FileNotFoundError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
    print(json.dumps({"files": len(args), "lines": total}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())


def test_counter_increments():
    counter = Counter()
    assert counter.increment() == 1
    assert counter.increment(5) == 6
'''

_JSON = """\
{"name": "read_file", "arguments": {"path": "src/app.py"}}
{"name": "run_command", "arguments": {"command": "pytest -x -q", "timeout": 120}}
{"name": "write_file", "arguments": {"path": "README.md", "content": "# Project\\n"}}
{"type": "function", "function": {"name": "search", "description": "Search the code.",
 "parameters": {"type": "object", "properties": {"query": {"type": "string"}},
 "required": ["query"]}}}
{"role": "user", "content": "List the files."}
{"role": "assistant", "content": null, "tool_calls": [{"id": "call_1", "type": "function"}]}
{"ok": true, "count": 3, "items": [1, 2, 3], "error": null, "ratio": 0.75}
$ ls -la && git status && git diff --stat
$ python -m pytest tests/test_app.py::test_main -q
"""

_WORD_TEXT = (
    "file path line test code function class method value result error output input list "
    "dict string number return import module package server client request response token "
    "model agent task reward group rollout trace record engine prompt message content user "
    "assistant system tool call argument name type default option config build install run "
    "check update delete create read write open close start stop wait retry timeout status "
    "commit branch merge patch diff log debug info warning fatal parse render format encode "
    "decode stream chunk buffer queue worker thread process signal event handler callback "
    "database query table column index schema migration session cache memory disk network "
    "port host address key secret version policy weight sample batch step epoch loss score "
    "apple river mountain window garden kitchen letter travel winter summer morning evening "
    "question answer problem solution example reason history science language country city "
    "people family friend teacher student doctor market company money office project meeting "
    "simple careful quickly slowly always never often maybe because although however therefore "
    "array vector matrix tensor gradient optimizer scheduler checkpoint tokenizer vocabulary "
    "directory archive compress extract validate verify transform filter reduce collect "
    "async await yield lambda iterator generator decorator context manager exception assert "
    "integer float boolean bytes tuple object instance attribute property interface protocol "
    "kubernetes container docker image volume cluster replica deploy service endpoint router "
    "browser window cursor terminal editor keyboard screen pixel color width height border"
)
_IDENT_PREFIXES = (
    "get", "set", "is", "has", "make", "load", "save", "to", "from", "new", "max", "min", "num",
    "total", "count", "first", "last", "next", "prev", "raw", "full", "parse", "build", "check",
)


def _generated_text(rng: random.Random, lines: int) -> str:
    """Code-, prose- and JSON-shaped lines over a fixed word list, for BPE merges to learn from."""
    words = _WORD_TEXT.split()
    out = []
    for _ in range(lines):
        w = [rng.choice(words) for _ in range(6)]
        ident = f"{rng.choice(_IDENT_PREFIXES)}_{w[0]}_{w[1]}"
        kind = rng.randrange(5)
        if kind == 0:
            out.append(f"The {w[0]} {w[1]}s the {w[2]} before the {w[3]} {w[4]} can {w[5]}.")
        elif kind == 1:
            out.append(f"def {ident}({w[2]}: str, {w[3]}: int = {rng.randrange(1000)}) -> bool:")
            out.append(f"    return {w[2]}.{w[4]}({w[3]}) is not None")
        elif kind == 2:
            out.append(json.dumps({"name": ident, "arguments": {w[2]: w[3], w[4]: rng.random()}}))
        elif kind == 3:
            out.append(f"    {ident} = self.{w[2]}_{w[3]}[{rng.randrange(64)}]  # {w[4]} {w[5]}")
        else:
            out.append(f"$ rolltap {w[0]} --{w[1]}-{w[2]} {rng.randrange(65536)} ./{w[3]}/{w[4]}")
    return "\n".join(out)


# Qwen2's split: contractions, letter runs with one leading non-letter, single digits,
# punctuation runs, newline runs, other whitespace.
_PRETOKENIZE_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def training_text() -> list[str]:
    """The tokenizer's training text: fixed, so every build gets the same vocabulary."""
    return [_PROSE, _PYTHON, _JSON, _generated_text(random.Random(0), 4000)]


def build_tokenizer():
    """Train the byte-level BPE (fills the whole vocabulary) and add the chat/tool tokens."""
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        trainers,
    )

    # transformers (and so vLLM) loads any `qwen2` model's tokenizer as Qwen2Tokenizer, which
    # rebuilds this normalizer and pre-tokenizer around the trained vocabulary. Training with the
    # same pipeline keeps tokenizer.json, transformers and vLLM in exact agreement.
    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE - len(ADDED_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(training_text(), trainer=trainer)
    if tokenizer.get_vocab_size() != VOCAB_SIZE - len(ADDED_TOKENS):
        # Out-of-tokenizer ids would be sampled by the model and then fail to decode.
        raise RuntimeError(f"BPE learned only {tokenizer.get_vocab_size()} tokens")
    tokenizer.add_tokens(
        [AddedToken(text, special=special, normalized=False) for text, special in ADDED_TOKENS]
    )
    return tokenizer


def model_config(eos_id: int, pad_id: int, tied: bool = False,
                 layers: int = NUM_LAYERS) -> dict:
    return {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "hidden_size": HIDDEN_SIZE,
        "intermediate_size": INTERMEDIATE_SIZE,
        "num_hidden_layers": layers,
        "num_attention_heads": NUM_HEADS,
        "num_key_value_heads": NUM_KV_HEADS,
        "head_dim": HEAD_DIM,
        "hidden_act": "silu",
        "max_position_embeddings": MAX_POSITIONS,
        "max_window_layers": layers,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "default", "rope_theta": ROPE_THETA},
        "sliding_window": None,
        "use_sliding_window": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": tied,
        "vocab_size": VOCAB_SIZE,
        "bos_token_id": None,
        "eos_token_id": eos_id,
        "pad_token_id": pad_id,
        "initializer_range": INIT_STD,
        "use_cache": True,
        "dtype": "float32",
    }


def init_weights(seed: int, layers: int = NUM_LAYERS) -> dict:
    """Qwen2 parameters (lm_head tied to the embedding), drawn in a fixed order from `seed`."""
    import numpy as np

    rng = np.random.default_rng(seed)

    def normal(*shape: int):
        return rng.normal(0.0, INIT_STD, shape).astype(np.float32)

    def ones(n: int):
        return np.ones(n, dtype=np.float32)

    q_dim, kv_dim = NUM_HEADS * HEAD_DIM, NUM_KV_HEADS * HEAD_DIM
    weights = {"model.embed_tokens.weight": normal(VOCAB_SIZE, HIDDEN_SIZE)}
    for i in range(layers):
        p = f"model.layers.{i}."
        weights |= {
            p + "input_layernorm.weight": ones(HIDDEN_SIZE),
            p + "self_attn.q_proj.weight": normal(q_dim, HIDDEN_SIZE),
            p + "self_attn.q_proj.bias": normal(q_dim),
            p + "self_attn.k_proj.weight": normal(kv_dim, HIDDEN_SIZE),
            p + "self_attn.k_proj.bias": normal(kv_dim),
            p + "self_attn.v_proj.weight": normal(kv_dim, HIDDEN_SIZE),
            p + "self_attn.v_proj.bias": normal(kv_dim),
            p + "self_attn.o_proj.weight": normal(HIDDEN_SIZE, q_dim),
            p + "post_attention_layernorm.weight": ones(HIDDEN_SIZE),
            p + "mlp.gate_proj.weight": normal(INTERMEDIATE_SIZE, HIDDEN_SIZE),
            p + "mlp.up_proj.weight": normal(INTERMEDIATE_SIZE, HIDDEN_SIZE),
            p + "mlp.down_proj.weight": normal(HIDDEN_SIZE, INTERMEDIATE_SIZE),
        }
    weights["model.norm.weight"] = ones(HIDDEN_SIZE)
    return weights


def _tokenizer_config(tokenizer) -> dict:
    added = {
        str(tokenizer.token_to_id(text)): {
            "content": text,
            "special": special,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "single_word": False,
        }
        for text, special in ADDED_TOKENS
    }
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "additional_special_tokens": [t for t, special in ADDED_TOKENS if special],
        "bos_token": None,
        "eos_token": IM_END,
        "pad_token": ENDOFTEXT,
        "unk_token": None,
        "model_max_length": MAX_POSITIONS,
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": False,
        "chat_template": CHAT_TEMPLATE,
    }


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def write_tiny_model(out_dir: Path, seed: int = 0, tied: bool = False,
                     layers: int = NUM_LAYERS) -> Path:
    """Write config, generation config, weights and tokenizer files to `out_dir`; return it.

    `layers`: more of them make a trainer step dearer and change nothing else (a benchmark
    sizes its trainer with it).

    Untied by default: the LM head is a weight of its own starting equal to the embeddings
    (the same function), because vLLM's CPU build does not refresh a tied head on an in-place
    reload, so only an untied model can be trained there with `--weight-sync disk`."""
    from safetensors.numpy import save_file

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    eos_id, pad_id = tokenizer.token_to_id(IM_END), tokenizer.token_to_id(ENDOFTEXT)
    _write_json(out_dir / "config.json", model_config(eos_id, pad_id, tied, layers))
    _write_json(
        out_dir / "generation_config.json",
        {"eos_token_id": [eos_id, pad_id], "pad_token_id": pad_id, "bos_token_id": None},
    )
    weights = init_weights(seed, layers)
    if not tied:
        weights["lm_head.weight"] = weights["model.embed_tokens.weight"].copy()
    save_file(weights, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "tokenizer.json").write_text(tokenizer.to_str(pretty=True), encoding="utf-8")
    _write_json(out_dir / "tokenizer_config.json", _tokenizer_config(tokenizer))
    return out_dir


def _run(args: argparse.Namespace) -> int:
    out = write_tiny_model(Path(args.out_dir), seed=args.seed, tied=args.tied)
    head = "LM head tied to the embeddings" if args.tied else "untied LM head"
    print(f"tiny model (seed {args.seed}, {head}) written to {out}")
    return 0


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "tiny-model",
        help="build a tiny random Qwen2 chat model offline (for tests and the demo)",
        description=(
            "Write a tiny, randomly initialised Qwen2 causal LM (hidden 128, 2 layers, vocab "
            "2048, float32) with a byte-level BPE tokenizer and a ChatML/Hermes chat template "
            "that renders tools and tool calls. Needs no network; the same seed gives "
            "byte-identical files. The LM head is untied by default (a weight of its own "
            "starting equal to the embeddings), so the bridge can train it on a CPU. Serve it "
            "with `rolltap serve-model OUT_DIR`."
        ),
    )
    parser.add_argument("out_dir", metavar="OUT_DIR", help="directory to write the model into")
    parser.add_argument(
        "--seed", type=int, default=0, help="seed of the random weights (default: 0)"
    )
    parser.add_argument(
        "--tied",
        action="store_true",
        help="tie the LM head to the input embeddings (smaller; vLLM's CPU build cannot "
        "reload such a head in place, so `rolltap bridge --weight-sync disk` refuses it there)",
    )
    parser.set_defaults(func=_run)
