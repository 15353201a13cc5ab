"""Documents' token ids packed into contexts of one size, the way SAELens's ``ActivationsStore`` packs
them (``concat_and_batch_sequences``): documents are tokenized without special tokens and laid end to
end; each context starts with the beginning-of-sequence token (unless its first token already is it);
a document that starts inside a context is preceded by the separator (unless it starts with it); a
document longer than what is left runs on into the next context; the last, part-filled context is
dropped. So a harvest's activations are those SAELens would train on for the same corpus."""

from __future__ import annotations

from typing import Iterable, Iterator

import numpy as np


def pack(documents: Iterable[list[int]], context_size: int, bos: int | None, separator: int | None) -> Iterator[np.ndarray]:
    """Contexts (int64 [context_size]) from the documents' token ids, in order."""
    if context_size < 2:
        raise ValueError(f"context size must be at least 2 tokens, got {context_size}")
    context: list[int] | None = None
    for tokens in documents:
        offset = 0
        while offset < len(tokens):
            first = tokens[offset]
            if context is None:
                prefix = [bos] if bos is not None and first != bos else []
                room = max(context_size - len(prefix), 0)
                context = prefix[:context_size] + list(tokens[offset:offset + room])
            else:
                prefix = [separator] if separator is not None and first != separator else []
                room = max(context_size - len(context) - len(prefix), 0)
                context += prefix[:context_size - len(context)] + list(tokens[offset:offset + room])
            offset += room
            if len(context) == context_size:
                yield np.asarray(context, dtype=np.int64)
                context = None
