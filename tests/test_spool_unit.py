"""Write-through runs: rows read back from the scratch file equal the rows kept in memory."""

import numpy as np
import pytest

from inspector.core.dtypes import BFLOAT16, ROW_DTYPES
from inspector.core.hooks import HookPoint
from inspector.core.protocol import RequestStart, RequestStep, StepEvent
from inspector.core.run import HookRows, RequestCapture
from inspector.io import CaptureFileError, open_run, write_run
from inspector.io.spool import RowSpool
from inspector.viewer.run_view import RunSource, RunView

WIDTH = 32_769  # wider than whole-row chunks allow: 3 column chunks in float32, 2 in 16 bits


def _rows(rng, n, dtype):
    return rng.standard_normal((n, WIDTH)).astype(dtype)


@pytest.mark.parametrize("dtype", ROW_DTYPES.values(), ids=ROW_DTYPES)
def test_spooled_rows_read_back_as_kept_in_memory_whatever_the_slice(tmp_path, dtype):
    rng = np.random.default_rng(0)
    spool = RowSpool(tmp_path, {"dtype": str(dtype)})
    req = RequestCapture("r0", "p", [1, 2], {})
    spooled = spool.rows(req, HookPoint("h", "h", "m", "resid_post", WIDTH, 0, "bfloat16"), dtype)
    kept = HookRows(WIDTH, dtype=dtype)
    position = 0
    for n in (1, 130, 1, 1, 300, 7, 1):  # across chunk boundaries, some rows only in the writer's buffer
        values = _rows(rng, n, dtype)
        for rows in (spooled, kept):
            rows.append(np.arange(position, position + n), np.full(n, 5), values)
        position += n
        frozen = spooled.snapshot()
        assert len(frozen) == len(kept) and frozen.values.shape == kept.values.shape
        assert frozen.values.dtype == kept.values.dtype == dtype
        for key in (slice(None), slice(3, 200), slice(len(kept) - 1, None), -1, 0, (slice(None), 7),
                    (slice(10, 140), slice(10_900, 16_400)), (slice(None, None, 3), slice(None)), [0, 2]):
            if isinstance(key, list) and len(kept) < 3:
                continue
            got, expected = frozen.values[key], kept.values[key]
            assert got.shape == expected.shape and got.dtype == expected.dtype, key
            np.testing.assert_array_equal(np.ascontiguousarray(got).view(np.uint8),
                                          np.ascontiguousarray(expected).view(np.uint8), err_msg=str(key))
        np.testing.assert_array_equal(frozen.positions, kept.positions)
    np.testing.assert_array_equal(np.asarray(spooled.values, np.float32), kept.values.astype(np.float32))
    spool.close()
    assert not list(tmp_path.iterdir())  # scratch: nothing left
    with pytest.raises(CaptureFileError):
        spooled.values[:2]


def _event(step, started, rows):
    return StepEvent(step, tuple(RequestStep(rid, rows={"h": r}) for rid, r in rows.items()), started)


def test_a_written_through_live_run_shows_and_exports_the_rows_an_in_memory_one_does(tmp_path):
    rng = np.random.default_rng(1)
    hooks = {"h": HookPoint("h", "blocks.0.hook_resid_post", "m", "resid_post", WIDTH, 0, "bfloat16")}
    views = {"memory": RunView.live({"dtype": "bfloat16"}, hooks), "through": RunView.live({"dtype": "bfloat16"}, hooks)}
    views["through"].write_through(tmp_path / "spool")
    started = tuple(RequestStart(f"r{i}", "p", (1, 2, 3), ("a", "b", "c"), {"max_tokens": 50}) for i in range(2))
    for step in range(60):
        rows = {f"r{i}": (np.arange(step, step + 1), np.array([7]), _rows(rng, 1, BFLOAT16)) for i in range(2)}
        for view in views.values():
            view.apply(_event(step, started if step == 0 else (), rows))
    memory, through = views["memory"], views["through"]
    assert memory.bytes_kept() == 2 * 60 * WIDTH * 2 and through.bytes_kept() == 0
    for rid in ("r0", "r1"):
        (p_a, v_a), (p_b, v_b) = memory.rows(rid, "h"), through.rows(rid, "h")
        np.testing.assert_array_equal(p_a, p_b)
        np.testing.assert_array_equal(np.asarray(v_a[5:40, 100:900]).view(np.uint16),
                                      np.asarray(v_b[5:40, 100:900]).view(np.uint16))
        np.testing.assert_array_equal(memory.norms(rid, "h"), through.norms(rid, "h"))
    for name, view in views.items():
        write_run(view.snapshot(), tmp_path / f"{name}.h5")
    with open_run(tmp_path / "memory.h5") as a, open_run(tmp_path / "through.h5") as b:
        for rid in ("r0", "r1"):
            assert a.run.requests[rid].hooks["h"].dtype == b.run.requests[rid].hooks["h"].dtype == BFLOAT16
            np.testing.assert_array_equal(a.run.requests[rid].hooks["h"].values[...].view(np.uint16),
                                          b.run.requests[rid].hooks["h"].values[...].view(np.uint16))
    through.close()
    assert not list((tmp_path / "spool").iterdir())
    assert RunSource.LIVE is through.source
