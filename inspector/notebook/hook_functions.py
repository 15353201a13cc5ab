"""TransformerLens-style hook functions, ``fn(activation, hook)``, run by the eager engine on every
forward (``plugin.python_hooks``): each prompt's rows of the forward as a [pos, d_model] view (queries,
keys, values and head outputs [pos, head, d_head]), edited in place or replaced by what the function
returns. A prompt that chunked prefill splits over forwards comes in pieces: ``hook.positions`` says
which."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch

from inspector.core.hooks import HookPoint

HookFunction = Callable[[torch.Tensor, "HookContext"], torch.Tensor | None]


@dataclass(frozen=True)
class HookContext:
    """A hook function's second argument, where TransformerLens passes its ``HookPoint``: the point's
    ``name`` and ``layer()``, and which rows the activation holds: ``request`` (the prompt's index in
    the batch) and ``positions`` (in the prompt)."""

    name: str
    point: HookPoint
    request: int
    positions: torch.Tensor

    def layer(self) -> int:
        if self.point.layer < 0:
            raise ValueError(f"{self.name} is not in a block")
        return self.point.layer


def row_function(point: HookPoint, functions: Sequence[HookFunction], request_index: dict[str, int],
                 head_size: int | None) -> Callable:
    """The engine-side function of one hook point (``plugin.python_hooks.RowFunction``): calls
    ``functions`` in order on each prompt's rows, shaped as TransformerLens shapes them."""
    def run(rows: torch.Tensor, request_id: str, positions: np.ndarray) -> None:
        view = rows.view(rows.shape[0], -1, head_size) if head_size else rows
        context = HookContext(point.alias, point, request_index.get(request_id, -1), torch.from_numpy(positions))
        for function in functions:
            out = function(view, context)
            if out is None or out is view:
                continue
            if not isinstance(out, torch.Tensor) or tuple(out.shape) != tuple(view.shape):
                got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
                raise ValueError(f"the hook function {getattr(function, '__name__', function)!r} on {point.alias} "
                                 f"returned {got}; it was given {tuple(view.shape)} (one prompt's rows of a forward: "
                                 "return the same shape, or None after editing the activation in place)")
            view.copy_(out)
    return run
