"""bfloat16: how far captures of a bf16 engine are from Hugging Face transformers in float32.

There is no parity to prove at bf16 (8 bits of mantissa), so the figure is recorded (a junit
property, printed by tests/gpu/run_gpu_checks.py) and only a loose bound that catches a wrong row,
position or layer is asserted. The reference runs on the engine's own tokens. The rows stay bfloat16
from the device to the capture file and back, bit for bit.
"""

import h5py
import numpy as np
import pytest

import hf_reference
from inspector.core.dtypes import BFLOAT16
from inspector.core.hooks import HookPoint
from inspector.core.run import HookRows, RequestCapture, Run
from inspector.io import open_run, write_run
from engines import booted, generate, rel_l2, rpc

PROMPTS = ["def fibonacci(n):", "import os\nimport sys"]
# A misplaced row or layer gives relative errors near 1 or more; bf16 rounding of weights and
# activations through a few random layers stays far below.
LOOSE_BOUND = 0.1


@pytest.fixture(scope="module")
def llm(tiny_models):
    with booted(tiny_models["llama"], dtype="bfloat16", hook_patterns=("blocks.*.hook_resid_post",)) as llm:
        yield llm


def test_bf16_captures_are_close_to_float32_transformers(llm, tiny_models, record_property):
    aliases = {p["name"]: p["alias"] for p in rpc(llm, "inspector_describe")["hook_points"]}
    tokens, caps = generate(llm, PROMPTS, max_tokens=8)
    errors = []
    for rid, (prompt_ids, gen_ids) in tokens.items():
        seq = prompt_ids + gen_ids
        ref = hf_reference.run(tiny_models["llama"], seq[:-1])
        by_alias = {aliases[name]: rows for name, rows in caps[rid].items()}
        for layer in range(ref["resid_post"].shape[0]):
            rows = by_alias[f"blocks.{layer}.hook_resid_post"]
            assert rows["positions"].tolist() == list(range(len(seq) - 1))
            assert rows["values"].dtype == BFLOAT16  # not converted on the host
            errors.append(rel_l2(rows["values"], ref["resid_post"][layer]))
    errors = np.concatenate(errors)
    record_property("bf16_rel_l2_max", f"{errors.max():.2e}")
    record_property("bf16_rel_l2_median", f"{np.median(errors):.2e}")
    assert errors.max() < LOOSE_BOUND


def test_bf16_rows_round_trip_through_a_capture_file_bit_for_bit(llm, tmp_path):
    points = {p["name"]: p for p in rpc(llm, "inspector_describe")["hook_points"]}
    _, caps = generate(llm, PROMPTS[:1], max_tokens=4)
    (rid, hooks), = caps.items()
    run = Run(metadata={"dtype": "bfloat16"}, hooks={name: HookPoint.from_dict(points[name]) for name in hooks})
    req = run.requests[rid] = RequestCapture(rid, PROMPTS[0], [], {}, finish_reason="length")
    for name, rows in hooks.items():
        req.hooks[name] = HookRows(rows["values"].shape[1], dtype=rows["values"].dtype)
        req.hooks[name].append(rows["positions"], rows["token_ids"], rows["values"])
    write_run(run, tmp_path / "bf16.h5")
    with h5py.File(tmp_path / "bf16.h5") as f:  # as any HDF5 reader sees it: the bits, and their dtype named
        stored = f[f"requests/0/hooks/{next(iter(hooks))}/values"]
        assert stored.dtype == np.uint16 and stored.attrs["dtype"] == "bfloat16"
    with open_run(tmp_path / "bf16.h5") as opened:
        for name, rows in hooks.items():
            back = opened.run.requests[rid].hooks[name]
            assert back.dtype == BFLOAT16
            np.testing.assert_array_equal(back.values[...].view(np.uint16), rows["values"].view(np.uint16))
            np.testing.assert_array_equal(np.asarray(back.values, np.float32), rows["values"].astype(np.float32))
