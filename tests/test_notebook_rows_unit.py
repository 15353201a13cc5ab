"""The notebook's row sink on its own: a forward whose batch holds other requests' rows too (a server's,
the engine's own) scatters only the notebook's, each to its prompt and position; a stack's unwanted
hooks stay out."""

import numpy as np
import torch

from inspector.notebook.rows import DeviceRows


def test_only_the_notebooks_rows_land_each_at_its_prompt_and_position():
    sink = DeviceRows({"a", "c"}, {"req7": 0, "req9": 1}, batch=2, capacity=6)
    stack = torch.arange(3 * 5 * 2, dtype=torch.float32).reshape(3, 5, 2)  # hooks a, b, c; 5 rows of width 2
    # rows 0-1: req9 at positions 3, 4; rows 2-3: someone else's; row 4: req7 at position 0
    for _ in range(2):  # a second forward alike: the same places, nothing worked out again goes wrong
        sink(["req9", "other", "req7"], np.array([0, 2, 4, 5]), np.array([3, 4, 0, 1, 0]), [(("a", "b", "c"), stack)])
    assert set(sink.tensors) == {"a", "c"}
    for name, h in (("a", 0), ("c", 2)):
        got = sink.tensors[name]
        assert torch.equal(got[1, 3:5], stack[h, 0:2]) and torch.equal(got[0, 0], stack[h, 4])
    expected = torch.zeros(2, 6, dtype=torch.bool)
    expected[1, 3:5] = expected[0, 0] = True
    assert torch.equal(sink.written, expected)
    assert int(sink.tensors["a"].count_nonzero()) == 2 * 3 - 1  # one of the five values landed is zero
