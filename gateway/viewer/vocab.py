"""Token id -> the text it stands for, from the served model's `tokenizer.json`.

The viewer decodes on the server with the model's own vocabulary, read once from disk: no
engine round trip per page and nothing fetched from the network. Each token is decoded on its
own, so a character split over several byte-level tokens shows its partial bytes escaped
(`\\xe2`) instead of being silently merged into a neighbour."""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path

from gateway.byte_level import bytes_to_unicode

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


class Vocab:
    def __init__(self, texts: dict[int, str]) -> None:
        self._texts = texts

    def texts(self, ids) -> dict[int, str]:
        """Text of each distinct id; an id outside the vocabulary shows as `<id N>`."""
        return {int(i): self._texts.get(int(i), f"<id {int(i)}>") for i in set(ids)}


def _byte_level(spec: dict) -> bool:
    parts = [spec.get("decoder") or {}, spec.get("pre_tokenizer") or {}]
    for part in list(parts):
        parts += part.get("decoders") or part.get("pretokenizers") or []
    return any(p.get("type") == "ByteLevel" for p in parts)


def vocab_from_tokenizer_json(spec: dict) -> Vocab:
    vocab: dict[str, int] = (spec.get("model") or {}).get("vocab") or {}
    if isinstance(vocab, list):  # Unigram models list [piece, score] pairs
        vocab = {piece: i for i, (piece, _) in enumerate(vocab)}
    texts: dict[int, str] = {}
    if _byte_level(spec):
        to_byte = {c: b for b, c in bytes_to_unicode().items()}
        for token, i in vocab.items():
            raw = bytes(to_byte.get(c, 0x3F) for c in token)
            texts[i] = raw.decode("utf-8", errors="backslashreplace")
    else:  # SentencePiece style: `▁` is a space, `<0xNN>` a raw byte
        for token, i in vocab.items():
            byte = _BYTE_TOKEN.fullmatch(token)
            texts[i] = (
                bytes([int(byte.group(1), 16)]).decode("utf-8", errors="backslashreplace")
                if byte
                else token.replace("\u2581", " ")
            )
    for added in spec.get("added_tokens") or ():
        texts[added["id"]] = added["content"]
    return Vocab(texts)


@functools.lru_cache(maxsize=4)
def load(model_dir: Path) -> Vocab:
    path = Path(model_dir) / "tokenizer.json"
    try:
        spec = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read {path}: {exc}") from exc
    return vocab_from_tokenizer_json(spec)
