"""Where to encode SAE features: right after the forward, or inside the compiled graph.

After the forward is what the engine does (``plugin.features.DeviceSae.strongest``: eager kernels on
the captured rows, on the device, before the copy to the host). Inside the graph would be the same
function traced with the model: compiled by Inductor and, on CUDA, replayed from a CUDA graph as
vLLM's graphs are; here it is compiled on its own (``torch.compile``, "reduce-overhead" on CUDA) at
each step size. Prints, per step size, the encoder's time both ways; compare with a forward's step
time (``plugin_bench``'s ms/step).

    packaging/dev bench sae_encoder_bench                      # CPU: 512 -> 8,192 features, float32
    python3 bench/sae_encoder_bench.py --preset llama3-8b      # GPU: 4,096 -> 65,536 features, bf16
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

PRESETS = {"cpu": (512, "float32", (8, 64, 1024)), "llama3-8b": (4096, "bfloat16", (1, 32, 256, 8192))}
K = 32


def timed(fn, x, reps: int, sync) -> float:
    """Median ms of ``fn(x)`` over ``reps`` calls, after two warm-up calls."""
    for _ in range(2):
        fn(x)
    sync()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn(x)
        sync()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    parser.add_argument("--expansion", type=int, default=16, help="d_sae = expansion x d_in")
    parser.add_argument("--reps", type=int, default=20)
    args = parser.parse_args()
    import torch

    from inspector.core.sae import AttachedSae, read_sae
    from inspector.plugin.features import CHUNK_ROWS, DeviceSae
    from sae_files import write_sae

    d_in, dtype, sizes = PRESETS[args.preset]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sae_dir = write_sae(Path(tempfile.mkdtemp(prefix="bench-sae-")) / "sae", "standard", d_in, d_in * args.expansion,
                        "blocks.4.hook_resid_post")
    sae = DeviceSae(AttachedSae(read_sae(sae_dir), "blocks.4.hook_resid_post", K), device, getattr(torch, dtype))
    mode = "reduce-overhead" if device.type == "cuda" else "default"

    def in_graph(rows):  # what strongest() does, without its inference mode (which the compiler does not trace)
        pieces = [sae._strongest(rows[start:start + CHUNK_ROWS]) for start in range(0, rows.shape[0], CHUNK_ROWS)]
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=1)

    torch.set_grad_enabled(False)
    print(f"SAE {d_in} -> {d_in * args.expansion} features, {dtype}, {K} kept per row, on {device}; median ms of "
          f"{args.reps} calls", flush=True)
    print(f"{'rows':>6s} {'after the forward':>18s} {'compiled (' + mode + ')':>28s} {'ratio':>6s}")
    for rows in sizes:
        x = torch.randn(rows, d_in, device=device, dtype=getattr(torch, dtype))
        eager = timed(sae.strongest, x, args.reps, sync)
        compiled_fn = torch.compile(in_graph, mode=mode, dynamic=False)
        same = torch.equal(compiled_fn(x)[1], sae.strongest(x)[1])
        compiled = timed(compiled_fn, x, args.reps, sync)
        print(f"{rows:6d} {eager:18.3f} {compiled:28.3f} {eager / compiled:6.2f}"
              + ("" if same else "   (the compiled ids differ: ties in a low-precision top-k)"), flush=True)


if __name__ == "__main__":
    main()
