"""The built-in demo SAE: a top-k sparse autoencoder on the demo model's residual stream after block 2,
trained offline on the activations of the demo model's own training files (Python's stdlib), saved in
SAELens's format with a scan of the held-out files, so the Features view means something out of the box.

    packaging/dev run python tools/demo_sae.py [--out resources/demo-sae] [--tokens 300000] [--steps 3000]

The activations come from the engine (prefill of the files in chunks of about 200 tokens); the inputs
are scaled to a mean norm of sqrt(d_in) for training and the scale is folded into the saved weights
(``normalize_activations`` none). Reconstruction quality on held-out activations goes into
``training.json``: the fraction of variance explained and L0. A development tool: the package ships
the result.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))

HOOK = "blocks.2.hook_resid_post"
CHUNK_CHARS = 700  # about 200 tokens of Python source


def chunks(texts: list[str]) -> list[str]:
    """Line-aligned pieces of about CHUNK_CHARS characters."""
    out = []
    for text in texts:
        piece = ""
        for line in text.splitlines(keepends=True):
            piece += line
            if len(piece) >= CHUNK_CHARS:
                out.append(piece)
                piece = ""
        if piece.strip():
            out.append(piece)
    return out


def activations(session, documents: list[str], limit: int, hook: str) -> np.ndarray:
    """Rows of ``hook`` over ``documents`` (prefill), until ``limit`` rows."""
    from inspector.core.protocol import Sampling

    rows = []
    for start in range(0, len(documents), 32):
        session.new_run()
        list(session.generate(documents[start:start + 32], Sampling(max_tokens=1, logprobs=0)))
        rows += [np.asarray(req.hooks[hook].values) for req in session.run.requests.values()]
        if sum(len(r) for r in rows) >= limit:
            break
    return np.concatenate(rows)[:limit]


def train(x: np.ndarray, d_sae: int, k: int, steps: int, seed: int = 0) -> dict[str, np.ndarray]:
    """A top-k SAE on rows ``x`` (already scaled), Adam; decoder rows kept at unit norm."""
    import torch

    torch.manual_seed(seed)
    data = torch.from_numpy(x)
    d_in = x.shape[1]
    w_dec = torch.randn(d_sae, d_in)
    w_dec /= w_dec.norm(dim=1, keepdim=True)
    params = {"W_dec": w_dec.clone().requires_grad_(), "W_enc": w_dec.T.clone().contiguous().requires_grad_(),
              "b_enc": torch.zeros(d_sae, requires_grad=True),
              "b_dec": data.mean(0).clone().requires_grad_()}
    optimizer = torch.optim.Adam(params.values(), lr=4e-4)
    generator = torch.Generator().manual_seed(seed)
    for step in range(steps):
        batch = data[torch.randint(0, len(data), (2048,), generator=generator)]
        pre = (batch - params["b_dec"]) @ params["W_enc"] + params["b_enc"]
        top = pre.topk(k, dim=1)
        acts = torch.zeros_like(pre).scatter_(1, top.indices, top.values.relu())
        loss = ((acts @ params["W_dec"] + params["b_dec"] - batch) ** 2).sum(1).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        with torch.no_grad():
            params["W_dec"] /= params["W_dec"].norm(dim=1, keepdim=True)
        if step % 500 == 0 or step == steps - 1:
            print(f"step {step}: loss {loss.item():.2f}", flush=True)
    return {name: p.detach().numpy().astype(np.float32) for name, p in params.items()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="tools/demo_sae.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(ROOT / "resources" / "demo-sae"))
    parser.add_argument("--tokens", type=int, default=300_000, help="training activations")
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--d-sae", type=int, default=2048)
    parser.add_argument("--k", type=int, default=16)
    args = parser.parse_args(argv)
    from demo_model import split_corpus
    from safetensors.numpy import save_file

    from inspector.core.protocol import SessionOptions
    from inspector.core.sae import encode, read_sae
    from inspector.engine.session import Session
    from inspector.experiments.scan import ScanSpec, ScanState, scan
    from inspector.io.scan import write_scan

    started = time.perf_counter()
    train_texts, heldout_texts = split_corpus()
    session = Session.open(SessionOptions(model="demo", mode="eager", hooks=(HOOK,), max_model_len=1024,
                                          max_num_batched_tokens=2048, retain_rows=True))
    try:
        hook = next(iter(session.installed))
        x = activations(session, chunks(train_texts), args.tokens, hook)
        heldout = activations(session, chunks(heldout_texts), 50_000, hook)
        scale = float(np.sqrt(x.shape[1]) / np.linalg.norm(x, axis=1).mean())
        print(f"{len(x)} training rows, {len(heldout)} held-out rows; input scale {scale:.3f}", flush=True)
        weights = train(x * scale, args.d_sae, args.k, args.steps)
        # fold the scale in: the saved SAE reads the model's own activations
        weights["W_enc"] = weights["W_enc"] * scale
        weights["W_dec"] = weights["W_dec"] / scale
        weights["b_dec"] = weights["b_dec"] / scale
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        save_file(weights, str(out / "sae_weights.safetensors"))
        (out / "cfg.json").write_text(json.dumps({
            "architecture": "topk", "d_in": int(x.shape[1]), "d_sae": args.d_sae, "k": args.k, "dtype": "float32",
            "device": "cpu", "apply_b_dec_to_input": True, "normalize_activations": "none",
            "reshape_activations": "none",
            "metadata": {"model_name": "activation-inspector demo model", "hook_name": HOOK}}, indent=1))
        config = read_sae(out)
        acts = encode(config, weights, heldout)
        recon = acts @ weights["W_dec"] + weights["b_dec"]
        fve = 1 - ((heldout - recon) ** 2).sum() / ((heldout - heldout.mean(0)) ** 2).sum()
        l0 = float((acts > 0).sum(1).mean())
        dead = float(((acts > 0).sum(0) == 0).mean())
        print(f"held-out: fraction of variance explained {fve:.3f}, L0 {l0:.1f}, dead {dead:.1%}", flush=True)
        sae = session.attach_sae(out, k=args.k)
        documents = chunks(heldout_texts)
        state = scan(session, documents, ScanSpec(hook, sae.name, top=10), ScanState(args.d_sae, 10))
        ids = np.unique(state.top_windows[state.top_windows >= 0])
        write_scan(state, {"model": "demo", "corpus": "the demo model's held-out stdlib files", "documents":
                           len(documents), "hook": HOOK, "sae": config.as_dict(), "sae_k": args.k, "top": 10},
                   dict(zip(ids.tolist(), session.token_texts(ids))), out / "scan.h5")
        (out / "training.json").write_text(json.dumps({
            "hook": HOOK, "d_sae": args.d_sae, "k": args.k, "steps": args.steps, "training_rows": len(x),
            "heldout_rows": len(heldout), "input_scale": scale, "heldout_fraction_of_variance_explained": float(fve),
            "heldout_l0": l0, "heldout_dead_fraction": dead, "scan_documents": len(documents),
            "scan_tokens": state.tokens_done, "seconds": round(time.perf_counter() - started, 1)}, indent=1))
    finally:
        session.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
