"""A client's shared memory for its rows, offered to a server on the same machine (docs/protocol.md:
Rows through shared memory). The server copies an event's large arrays into it piece by piece,
each ``rows`` message saying where; each is copied out at once into its array (by several threads),
the room given back, and the array handed to the event that names it.
"""

from __future__ import annotations

import math

import numpy as np

from inspector.core.reused_memory import ReusedMemory
from inspector.core.shared_ring import Copiers, SharedRing, aligned, ring_bytes
from inspector.net.wire import WireError, array_dtype

# A sixteenth of the memory, from 512 MiB to 8 GiB: pages made as first used. A batch-256 prompt's rows of
# an 8B model's 32 residual points are 8 GiB: through a 2 GiB ring the server's engine waited while the
# client copied each of its four steps out, and on an H100's host its client got 0.625 of vanilla's
# tokens/s against 0.782 through 8 GiB (docs/gpu-run-2026-12-07f-ring-and-pages.md).
RING_BYTES = ring_bytes(16, most=8 << 30)


class RowsAhead:
    def __init__(self, size: int | None = None):
        """OSError where shared memory cannot be made (no memfd on this system)."""
        self.ring = SharedRing(size or RING_BYTES, name="inspector-client-rows")
        self._copiers = Copiers("client-rows-copy")
        self.memory = ReusedMemory()  # a dropped run's memory, for the next run's rows
        self.arrays: dict[int, np.ndarray] = {}  # by number, until their event takes them
        self.bytes_shared = 0  # rows that came through the ring
        self.bytes_by_socket = 0  # and as frames, where the server found no room in time

    def offer(self) -> dict:
        return self.ring.offer()

    def take(self, body: dict) -> int | None:
        """A ``rows`` message's pieces copied into their arrays; the message's number, to give its room
        back (None where its pieces came as frames). WireError if it is malformed."""
        try:
            self.arrays.update(_in_one_block(body["arrays"], self.memory))
            copies, shared, framed = [], 0, 0
            for number, a, b, data in body["slices"]:
                dest = self.arrays[number][a:b]
                if not (isinstance(a, int) and isinstance(b, int) and 0 <= a < b and len(dest) == b - a):
                    raise ValueError(f"rows {a!r:.20}:{b!r:.20} of an array of {len(self.arrays[number])}")
                source = data if isinstance(data, np.ndarray) else self.ring.view(data, dest.dtype, dest.shape)
                if source.shape != dest.shape or source.dtype != dest.dtype:
                    raise ValueError("a piece that does not fit its array")
                copies.append((dest, source))
                if isinstance(data, np.ndarray):
                    framed += dest.nbytes
                else:
                    shared += dest.nbytes
        except WireError:
            raise
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise WireError("bad-message", f"a malformed rows message: {e}") from None
        self._copiers.copy(copies)
        self.bytes_shared += shared
        self.bytes_by_socket += framed
        return body.get("message") if shared else None

    def close(self) -> None:
        self.arrays.clear()
        self.memory.close()
        self._copiers.shutdown()
        self.ring.close()


def _in_one_block(declared: dict, memory: ReusedMemory) -> dict[int, np.ndarray]:
    """Empty arrays of the (dtype, shape) declared, by number: views of one block (a fresh allocation for
    each array of a MiB took four times as long as the copy into it)."""
    layout, at = {}, 0
    for number, (dtype, shape) in declared.items():
        if not (isinstance(shape, list) and shape and all(isinstance(n, int) and n >= 0 for n in shape)):
            raise ValueError(f"shape {shape!r:.50}")
        nbytes = math.prod(shape) * array_dtype(dtype).itemsize
        layout[number] = (at, array_dtype(dtype), shape, nbytes)
        at += aligned(nbytes)
    if at > 1 << 40:
        raise ValueError("arrays of more than a TiB")
    block = memory.empty(at)
    return {number: block[a:a + n].view(dtype).reshape(shape) for number, (a, dtype, shape, n) in layout.items()}
