"""Model directories on disk: the checkpoints the disk sync writes (complete or not there at
all), the names of a model's tensors, and an untied copy of a model for vLLM's CPU build."""

from __future__ import annotations

import json
import logging
import os
import queue
import re
import shutil
import threading
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import AutoConfig

log = logging.getLogger(__name__)

# template, generation config) is copied into each checkpoint so it is a complete model.
_WEIGHT_FILE = re.compile(r".*\.(safetensors|bin|pt|pth|gguf)$|.*\.index\.json$")
_CHECKPOINT = re.compile(r"policy-(\d+)$")
_SINGLE_FILE = "model.safetensors"
_INDEX_FILE = "model.safetensors.index.json"



def checkpoint_index(path: Path) -> int | None:
    match = _CHECKPOINT.match(path.name)
    return int(match.group(1)) if match else None


def write_checkpoint(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    model_dir: Path,
    dest: Path,
    shard_bytes: int = 2 << 30,
    extra: Callable[[Path], None] | None = None,
) -> Path:
    """Write a complete model directory at `dest`: the weights as safetensors, the model's other
    files copied, then whatever `extra(directory)` adds (the trainer's state). It appears at once
    (written beside it, then renamed), so a reader never sees a partial one. Tensors stream in
    and are written in shards of about `shard_bytes`, so at most one shard is held in memory; a
    checkpoint of several shards gets an index file."""
    partial = dest.with_name(f".{dest.name}.partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    for item in Path(model_dir).iterdir():
        if item.is_file() and not _WEIGHT_FILE.fullmatch(item.name):
            shutil.copy2(item, partial / item.name)
    shard: dict[str, torch.Tensor] = {}
    files: list[str] = []
    weight_map: dict[str, str] = {}
    size = 0

    def flush() -> None:
        files.append(f"model-{len(files) + 1:05d}.safetensors")
        save_file(shard, str(partial / files[-1]), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, files[-1]))
        shard.clear()

    for name, tensor in named_tensors:
        if name in weight_map or name in shard:
            raise ValueError(f"parameter {name!r} sent twice")
        shard[name] = tensor.detach().to("cpu").contiguous()
        size += tensor.numel() * tensor.element_size()
        if size >= shard_bytes:
            flush()
            size = 0
    if shard or not files:
        flush()
    if len(files) == 1:
        (partial / files[0]).rename(partial / _SINGLE_FILE)
    else:
        index = {"metadata": {}, "weight_map": dict(sorted(weight_map.items()))}
        (partial / _INDEX_FILE).write_text(json.dumps(index, indent=2))
    if extra is not None:
        extra(partial)
    partial.rename(dest)
    return dest


def next_checkpoint(checkpoint_dir: Path) -> Path:
    """Where the next checkpoint goes: numbered on from whatever the directory holds."""
    existing = [i for p in Path(checkpoint_dir).iterdir() if (i := checkpoint_index(p))]
    return Path(checkpoint_dir) / f"policy-{max(existing, default=0) + 1:06d}"


def prune_checkpoints(checkpoint_dir: Path, keep: int, resumable: Callable[[Path], bool],
                      protected: set[Path]) -> None:
    """Remove all but the newest `keep` checkpoints, the newest `resumable` one and the
    `protected` ones."""
    checkpoints = sorted((p for p in Path(checkpoint_dir).iterdir() if checkpoint_index(p)),
                         key=lambda p: checkpoint_index(p) or 0)
    kept = {*checkpoints[-keep:], *[p for p in checkpoints if resumable(p)][-1:]}
    for path in checkpoints:
        if path not in kept and path.resolve() not in protected:
            shutil.rmtree(path, ignore_errors=True)


Named = Iterator[tuple[str, torch.Tensor]]


def send_and_write(named_tensors: Iterable[tuple[str, torch.Tensor]], send: Callable[[Named], None],
                   model_dir: Path, dest: Path,
                   extra: Callable[[Path], None] | None = None) -> Path:
    """`send` the tensors and write them as checkpoint `dest` from the same pass: each one is
    copied to the CPU as it goes by and written by a thread (`write_checkpoint`), so a stream
    that can be read once (TRL's, gathered parameter by parameter) is read once. The checkpoint
    appears only if both the send and the write succeed."""
    passing: queue.Queue[tuple[str, torch.Tensor] | None] = queue.Queue(maxsize=4)
    failed: list[BaseException] = []

    def received() -> Iterator[tuple[str, torch.Tensor]]:
        while (item := passing.get()) is not None:
            yield item

    def write() -> None:
        try:
            write_checkpoint(received(), model_dir, dest.with_name(f".{dest.name}.sent"),
                             extra=extra)
        except BaseException as exc:  # raised in the caller's thread below
            failed.append(exc)
            for _ in iter(passing.get, None):  # keep the sender from blocking
                pass

    writer = threading.Thread(target=write, name="rolltap-state-writer", daemon=True)
    writer.start()

    def tee() -> Named:
        for name, tensor in named_tensors:
            passing.put((name, tensor.detach().to("cpu", copy=True)))
            yield name, tensor

    try:
        send(tee())
    finally:
        passing.put(None)
        writer.join()
    if failed:
        raise failed[0]
    dest.with_name(f".{dest.name}.sent").rename(dest)
    return dest


def remove_partial_checkpoints(checkpoint_dir: Path) -> list[Path]:
    """Remove the checkpoints a crash left half written (`write_checkpoint`'s partial ones)."""
    partials = [*Path(checkpoint_dir).glob(".policy-*.partial"),
                *Path(checkpoint_dir).glob(".policy-*.sent")]
    for partial in partials:
        log.warning("weight sync: removing %s, a checkpoint a crash left unfinished", partial)
        shutil.rmtree(partial)
    return partials


def ties_embeddings(model_dir: Path) -> bool:
    config = AutoConfig.from_pretrained(str(model_dir)).get_text_config()
    return bool(getattr(config, "tie_word_embeddings", False))


def untie_embeddings(model_dir: str | os.PathLike, dest: str | os.PathLike) -> Path:
    """Copy a model whose LM head is tied to its input embeddings into `dest`, with the head
    as a weight of its own (starting equal to the embeddings): the same model, but one whose
    head an in-place reload can update on vLLM's CPU build."""
    src, dest = Path(model_dir), Path(dest)
    shutil.copytree(src, dest)
    config_path = dest / "config.json"
    config = json.loads(config_path.read_text())
    config["tie_word_embeddings"] = False
    if isinstance(config.get("text_config"), dict):
        config["text_config"]["tie_word_embeddings"] = False
    config_path.write_text(json.dumps(config, indent=2) + "\n")
    index_path = dest / _INDEX_FILE
    if index_path.exists():
        index = json.loads(index_path.read_text())
        weight_map = index["weight_map"]
        embed = next(name for name in weight_map if name.endswith("embed_tokens.weight"))
        head = load_file(str(dest / weight_map[embed]))[embed].clone()
        save_file({"lm_head.weight": head}, str(dest / "lm_head.safetensors"),
                  metadata={"format": "pt"})
        weight_map["lm_head.weight"] = "lm_head.safetensors"
        index_path.write_text(json.dumps(index, indent=2))
    else:
        # A single-file model stays a single file: loaders read only model.safetensors then.
        tensors = load_file(str(dest / _SINGLE_FILE))
        embed = next(name for name in tensors if name.endswith("embed_tokens.weight"))
        tensors["lm_head.weight"] = tensors[embed].clone()
        save_file(tensors, str(dest / _SINGLE_FILE), metadata={"format": "pt"})
    return dest


def checkpoint_names(model_dir: Path) -> set[str]:
    """Tensor names of a model directory's safetensors weights."""
    names: set[str] = set()
    for path in Path(model_dir).glob("*.safetensors"):
        with safe_open(str(path), framework="pt") as f:
            names.update(f.keys())
    return names


def check_names(sent: set[str], original: set[str]) -> None:
    """The pushed names must be the model's own checkpoint names, or vLLM would silently keep
    the tensors it finds no match for. Only a tied head may be absent from what the trainer
    sends (the engine ties it to the embeddings itself)."""
    unknown = sent - original
    missing = original - sent - {"lm_head.weight"}
    if unknown or missing:
        raise ValueError(
            "the trainer's parameter names do not match the model's checkpoint: "
            f"unknown to the checkpoint {sorted(unknown)[:8]}, not sent {sorted(missing)[:8]}"
        )
