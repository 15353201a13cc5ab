"""SAE features at serving speed: a corpus scan with a 16x SAE against vanilla vLLM prefill of the same
corpus and against a batched transformers + PyTorch encoding loop (what SAELens users run today), and
live decode with the SAE attached against capture without it.

Each configuration boots once in its own process; the runs then alternate (A B C …) so that machine
noise hits all alike. Prints medians and ratios.

    packaging/dev bench sae_bench                          # CPU: the plugin bench's small Llama, float32
    python3 bench/sae_bench.py --preset llama3-8b          # GPU: Llama-3-8B shape, dummy bf16, a 65,536-feature SAE

Scan = ``inspector.experiments.scan`` (prefill in batches, each token's 32 strongest features sent to the
host, per feature its top contexts and a histogram); vanilla = ``LLM.generate`` of the same documents,
one token each; transformers = the model's forward with hidden states, the SAE encoding the hook's rows
on the same device, each token's 32 strongest features to the host. ``--only scan`` also runs
"features": the scan's engine calls alone (the same documents, features sent to the host and dropped
there), which splits a scan's cost between the engine and the host's bookkeeping.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from plugin_bench import PRESETS, model_dir, receive  # noqa: E402

LAYER = 4  # the hook: blocks.4.hook_resid_post
K = 32
CONFIGS = ("vanilla", "scan", "features", "transformers")
DECODE_CONFIGS = ("capture", "sae")


def corpus(n: int) -> list[str]:
    from inspector.testing.tinymodels import stdlib_corpus

    pieces = []
    for text in stdlib_corpus():
        pieces += [text[i:i + 700] for i in range(0, len(text), 700)]
    return pieces[:n]


def serve(name: str, conn, preset: str, path: str, extra: dict, sae_dir: str, documents: list[str], decode: tuple):
    """One configuration, booted once; answers "run" with its throughput."""
    import os

    os.environ.setdefault("GOMP_SPINCOUNT", "10000")
    from inspector.engine.environment import prepare_environment

    prepare_environment()
    import torch

    _, dtype, max_batched, _, _ = PRESETS[preset]
    cuda = torch.cuda.is_available()
    engine = {**({"gpu_memory_utilization": 0.25} if cuda else {}), **extra}
    if name == "transformers":
        run = _transformers_loop(path, dtype, sae_dir, documents)
    elif name == "vanilla":
        from vllm import LLM, SamplingParams

        llm = LLM(model=path, dtype=dtype, max_model_len=1024, enable_prefix_caching=False,
                  max_num_batched_tokens=max_batched, **engine)
        params = SamplingParams(max_tokens=1, temperature=0.0)

        def run():
            t = time.perf_counter()
            outs = llm.generate(documents, params, use_tqdm=False)
            return sum(len(o.prompt_token_ids) for o in outs) / (time.perf_counter() - t)
    else:
        from inspector.core.protocol import Sampling, SessionOptions
        from inspector.engine.session import Session
        from inspector.experiments.scan import ScanSpec, ScanState, scan

        session = Session.open(SessionOptions(model=path, dtype=dtype, hooks=(f"blocks.{LAYER}.hook_resid_post",),
                                              max_model_len=1024, retain_rows=False, engine_args=engine,
                                              max_num_batched_tokens=max_batched))
        hook = next(iter(session.installed))
        if name != "capture":
            sae = session.attach_sae(sae_dir, hook, K)
        if name == "scan":
            def run():
                state = ScanState(sae.config.d_sae, 20)
                t = time.perf_counter()
                scan(session, documents, ScanSpec(hook, sae.name, top=20), state)
                return state.tokens_done / (time.perf_counter() - t)
        elif name == "features":
            def run():
                sampling = Sampling(max_tokens=1, temperature=0.0, logprobs=0, ignore_eos=True, capture=False)
                session.new_run()
                t, tokens = time.perf_counter(), 0
                for event in session.generate(documents, sampling):
                    tokens += sum(len(s.features[sae.name][0]) for s in event.requests if sae.name in s.features)
                return tokens / (time.perf_counter() - t)
        else:
            batch, new = decode

            def run():
                sampling = Sampling(max_tokens=new, temperature=0.0, ignore_eos=True, logprobs=0)
                session.new_run()
                first, t, tokens = None, None, 0
                for event in session.generate(documents[:batch], sampling):
                    tokens += sum(len(s.new_token_ids) for s in event.requests)
                    if first is None and tokens >= batch:  # prefill done: every request has its first token
                        first, t = tokens, time.perf_counter()
                return (tokens - first) / (time.perf_counter() - t)
    conn.send("ready")
    while conn.recv() == "run":
        conn.send(run())


def _transformers_loop(path: str, dtype: str, sae_dir: str, documents: list[str]):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from inspector.core.sae import load_weights, read_sae

    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch_dtype = getattr(torch, dtype)
    config = AutoConfig.from_pretrained(path)
    if (Path(path) / "model.safetensors").exists():
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype)
    else:  # a dummy-weight shape: random weights, as vLLM's dummy load, made on the device
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, dtype=torch_dtype)
    model = model.to(device).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    weights = {n: torch.from_numpy(a).to(device=device, dtype=torch_dtype)
               for n, a in load_weights(read_sae(sae_dir)).items()}
    encoded = [tokenizer(d, return_tensors="pt").input_ids[0] for d in documents]

    @torch.inference_mode()
    def run():
        t, tokens = time.perf_counter(), 0
        for start in range(0, len(encoded), 16):
            batch = encoded[start:start + 16]
            ids = torch.nn.utils.rnn.pad_sequence(batch, batch_first=True).to(device)
            mask = torch.nn.utils.rnn.pad_sequence([torch.ones_like(b) for b in batch], batch_first=True).to(device)
            hidden = model(ids, attention_mask=mask, output_hidden_states=True).hidden_states[LAYER + 1]
            rows = hidden[mask.bool()]
            acts = ((rows - weights["b_dec"]) @ weights["W_enc"] + weights["b_enc"]).relu()
            values, features = acts.float().topk(K, dim=1)
            values.cpu(), features.cpu()
            tokens += len(rows)
        return tokens / (time.perf_counter() - t)
    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--documents", type=int, default=256)
    parser.add_argument("--expansion", type=int, default=16, help="d_sae = expansion x d_in")
    parser.add_argument("--only", choices=("scan", "decode"), help="run one of the two comparisons")
    args = parser.parse_args()
    from sae_files import write_sae

    from plugin_bench import dims

    path, extra = model_dir(args.preset)
    extra.pop("skip_tokenizer_init", None)  # text documents: the engine tokenizes them
    spec = PRESETS[args.preset][0]
    _, hidden, _, _ = dims(spec)
    d_sae = hidden * args.expansion
    sae_dir = str(write_sae(Path(tempfile.mkdtemp(prefix="bench-sae-")) / "sae", "standard", hidden, d_sae,
                            f"blocks.{LAYER}.hook_resid_post"))
    documents = corpus(args.documents)
    decode = PRESETS[args.preset][4][-1]
    ctx = mp.get_context("spawn")
    results = {}
    groups = {"scan": CONFIGS, "decode": DECODE_CONFIGS}
    for group in [groups[args.only]] if args.only else groups.values():
        workers = {}
        for name in group:  # one at a time: boots compete for the same cores
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=serve, args=(name, child, args.preset, path, extra, sae_dir, documents, decode),
                               daemon=True)
            proc.start()
            assert receive(parent, proc) == "ready"
            workers[name] = (proc, parent)
            print(f"booted {name}", flush=True)
        for rep in range(args.reps):
            for name, (proc, conn) in workers.items():
                conn.send("run")
                results.setdefault(name, []).append(receive(conn, proc))
            print(f"rep {rep + 1}/{args.reps}: " + ", ".join(f"{n} {results[n][-1]:.0f}" for n in workers), flush=True)
        for proc, conn in workers.values():
            conn.send("stop")
            proc.join(timeout=120)
    med = {name: statistics.median(r) for name, r in results.items()}
    print(f"\npreset {args.preset}: SAE {hidden} -> {d_sae} features at blocks.{LAYER}.hook_resid_post, {K} kept per "
          f"token; {len(documents)} documents; decode {decode[0]} x {decode[1]}; {args.reps} alternated reps (medians)")
    if "scan" in med:
        print(f"scan {med['scan']:.0f} tok/s, vanilla prefill {med['vanilla']:.0f} tok/s, transformers loop "
              f"{med['transformers']:.0f} tok/s")
        print(f"scan / vanilla prefill {med['scan'] / med['vanilla']:.3f}; scan / transformers loop "
              f"{med['scan'] / med['transformers']:.2f}; the scan's engine calls alone {med['features']:.0f} tok/s "
              f"({med['features'] / med['vanilla']:.3f} of vanilla)")
    if "sae" in med:
        print(f"decode with the SAE {med['sae']:.1f} tok/s, capture without it {med['capture']:.1f} tok/s: "
              f"ratio {med['sae'] / med['capture']:.3f}")


if __name__ == "__main__":
    main()
