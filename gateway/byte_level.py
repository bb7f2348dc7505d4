"""Byte-level BPE's table of printable characters for bytes (GPT-2's), which the local
template's encoding and the viewer's vocabulary both read tokens through."""

from __future__ import annotations


def bytes_to_unicode() -> dict[int, str]:
    """The byte <-> printable character table of byte-level BPE (GPT-2's)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table
