"""Readable text for single tokens.

Decoding one token at a time turns byte-level pieces of a multi-byte character into "�". For a
token strip that is useless, so such tokens show their bytes instead (``\\xf0\\x9f``), while whole
characters stay as they are.
"""

from __future__ import annotations

import functools
import re

_BYTE_FALLBACK = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")  # SentencePiece byte-fallback pieces


@functools.lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet (printable stand-ins for the 256 byte values), inverted."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    codes, extra = list(keep), 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            codes.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(keep, codes)}


def token_text(tokenizer, token_id: int) -> str:
    text = tokenizer.decode([token_id])
    if "\ufffd" not in text:
        return text
    piece = tokenizer.convert_ids_to_tokens(token_id)
    if not isinstance(piece, str):
        return text
    fallback = _BYTE_FALLBACK.match(piece)
    if fallback:
        return f"\\x{fallback.group(1).lower()}"
    decoder = _byte_decoder()
    if all(ch in decoder for ch in piece):
        return bytes(decoder[ch] for ch in piece).decode("utf-8", errors="backslashreplace")
    return text
