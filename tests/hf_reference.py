"""Hugging Face transformers as the independent reference for captured activations."""

from __future__ import annotations

import functools

import numpy as np
import torch


@functools.lru_cache(maxsize=4)
def load(model_dir: str):
    from transformers import AutoModelForCausalLM

    # eager attention: the reference computes what the config says (sdpa would drop Gemma 2's soft cap)
    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    for module in model.modules():  # vLLM's Bloom computes GELU exactly, transformers' with tanh: the same here
        if type(module).__name__ == "BloomGelu":
            module.forward = torch.nn.functional.gelu
    return model


def _blocks(model):
    inner = getattr(model, "model", None) or getattr(model, "gpt_neox", None) or model.transformer
    inner = getattr(inner, "decoder", inner)  # OPT
    return list(getattr(inner, "layers", None) or inner.h)


_LLAMA_STYLE = {"attn_out": ("self_attn", "out"), "z": ("self_attn.o_proj", "in"),
                "resid_mid": ("post_attention_layernorm", "in"),
                "mlp_post": ("mlp.down_proj", "in"), "mlp_out": ("mlp", "out")}
_GEMMA_STYLE = {"attn_raw": ("self_attn", "out"), "z": ("self_attn.o_proj", "in"),
                "attn_out": ("post_attention_layernorm", "out"),
                "resid_mid": ("pre_feedforward_layernorm", "in"), "mlp_post": ("mlp.down_proj", "in"),
                "mlp_raw": ("mlp", "out"), "mlp_out": ("post_feedforward_layernorm", "out")}
# Each kind of hook point as transformers' modules give it (TransformerLens's definitions): module, in/out.
KINDS = {
    **{arch: _LLAMA_STYLE for arch in ("llama", "qwen2", "qwen3", "mistral", "phi3", "gemma", "stablelm", "granite",
                                       "olmo")},
    # the router's logits (a dense layer has none)
    **{arch: {**_LLAMA_STYLE, "router": ("mlp.gate", "out")} for arch in ("qwen3_moe", "mixtral", "olmoe", "qwen2_moe",
                                                                         "glm4_moe")},
    "gemma2": _GEMMA_STYLE, "gemma3": _GEMMA_STYLE,
    "olmo2": {"attn_raw": ("self_attn", "out"), "z": ("self_attn.o_proj", "in"),
              "attn_out": ("post_attention_layernorm", "out"),
              "resid_mid": ("mlp", "in"), "mlp_post": ("mlp.down_proj", "in"), "mlp_raw": ("mlp", "out"),
              "mlp_out": ("post_feedforward_layernorm", "out")},
    "gpt_oss": {**_LLAMA_STYLE, "router": ("mlp.router", "out")},
    "cohere": {"attn_out": ("self_attn", "out"), "z": ("self_attn.o_proj", "in"), "mlp_post": ("mlp.down_proj", "in"),
               "mlp_out": ("mlp", "out")},
    # Bloom's attention and MLP modules add the residual themselves: their projections' outputs are the branches
    "bloom": {"z": ("self_attention.dense", "in"), "attn_out": ("self_attention.dense", "out"),
              "resid_mid": ("post_attention_layernorm", "in"), "mlp_post": ("mlp.dense_4h_to_h", "in"),
              "mlp_out": ("mlp.dense_4h_to_h", "out")},
    "gpt_bigcode": {"attn_out": ("attn", "out"), "z": ("attn.c_proj", "in"), "resid_mid": ("ln_2", "in"),
                    "mlp_post": ("mlp.c_proj", "in"), "mlp_out": ("mlp", "out")},
    "gpt2": {"attn_out": ("attn", "out"), "z": ("attn.c_proj", "in"), "resid_mid": ("ln_2", "in"), "mlp_post": ("mlp.c_proj", "in"),
             "mlp_out": ("mlp", "out")},
    "phi": {"attn_out": ("self_attn", "out"), "z": ("self_attn.dense", "in"), "mlp_post": ("mlp.fc2", "in"), "mlp_out": ("mlp", "out")},
    "gptj": {"attn_out": ("attn", "out"), "z": ("attn.out_proj", "in"), "mlp_post": ("mlp.fc_out", "in"), "mlp_out": ("mlp", "out")},
    "gpt_neox": {"attn_out": ("attention", "out"), "z": ("attention.dense", "in"), "mlp_post": ("mlp.dense_4h_to_h", "in"), "mlp_out": ("mlp", "out")},
    "opt": {"attn_out": ("self_attn", "out"), "z": ("self_attn.out_proj", "in"), "resid_mid": ("final_layer_norm", "in"), "mlp_post": ("fc2", "in"),
            "mlp_out": ("fc2", "out")},
}


def branch_scale(model) -> dict[str, float]:
    """What a branch's module output is multiplied by as the block adds it to the stream (Granite's
    residual multiplier): the kinds' values are what the stream gets."""
    return {kind: getattr(model.config, "residual_multiplier", 1.0) for kind in ("attn_out", "mlp_out")}


def _site(block, arch: str, kind: str):
    """(module, "in" or "out"): where transformers' modules give ``kind`` of this block; None if the
    block lacks that module (an MoE layer's down projection)."""
    if kind in ("resid_pre", "resid_post"):
        return block, "in" if kind == "resid_pre" else "out"
    path, side = KINDS[arch][kind]
    try:
        return block.get_submodule(path), side
    except AttributeError:
        return None


def _hook(module, side: str, edit):
    """A forward (pre-)hook that calls ``edit(x)`` on the module's input or output activation, ``x``
    [batch, tokens, width] or flattened; ``edit`` returns None to leave it, or the replacement."""
    if side == "in":
        def pre(m, args, kwargs):
            x = args[0] if args else kwargs["hidden_states"]
            y = edit(x)
            if y is None:
                return None
            return ((y, *args[1:]), kwargs) if args else (args, {**kwargs, "hidden_states": y})
        return module.register_forward_pre_hook(pre, with_kwargs=True)

    def post(m, args, out):
        y = edit(out[0] if isinstance(out, tuple) else out)
        if y is None:
            return None
        return (y, *out[1:]) if isinstance(out, tuple) else y
    return module.register_forward_hook(post)


@torch.no_grad()
def block_points(model_dir, arch: str, token_ids: list[int]) -> dict[tuple[int, str], np.ndarray]:
    """{(layer, kind): [tokens, width]} for resid_pre, resid_post and ``KINDS[arch]``, read with forward
    hooks on transformers' modules; a module a layer lacks (an MoE layer's down projection) is skipped."""
    model = load(str(model_dir))
    found, handles = {}, []
    scale = branch_scale(model)

    def keep(key):
        def edit(x):  # [tokens, width] of a batch of one (some modules see it flattened already)
            found[key] = x.reshape(-1, x.shape[-1]).clone() * scale.get(key[1], 1.0)
        return edit

    for layer, block in enumerate(_blocks(model)):
        for kind in ("resid_pre", "resid_post", *KINDS[arch]):
            site = _site(block, arch, kind)
            if site is not None:
                handles.append(_hook(*site, keep((layer, kind))))
    try:
        model(torch.tensor([token_ids]))
    finally:
        for h in handles:
            h.remove()
    return {key: value.numpy() for key, value in found.items()}


@torch.no_grad()
def patched_logprobs(model_dir, arch: str, token_ids: list[int], patches: list[tuple[int, str, int, np.ndarray]],
                     score_ids: list[int]) -> np.ndarray:
    """Activation patching one cell at a time: for each (layer, kind, position, vector), a forward of
    ``token_ids`` with that activation at that position replaced by ``vector`` (a forward hook), and
    the logprobs of ``score_ids`` after the last token (a patch of None: the plain forward).
    [patches, len(score_ids)]."""
    model = load(str(model_dir))
    blocks, out = _blocks(model), []
    for patch in patches:
        if patch is None:
            out.append(torch.log_softmax(model(torch.tensor([token_ids])).logits[0, -1].double(), -1)[score_ids].numpy())
            continue
        layer, kind, position, vector = patch
        value = torch.from_numpy(np.asarray(vector, np.float32)) / branch_scale(model).get(kind, 1.0)

        def edit(x, position=position, value=value):
            y = x.clone()
            y.view(-1, y.shape[-1])[position] = value
            return y

        handle = _hook(*_site(blocks[layer], arch, kind), edit)
        try:
            logits = model(torch.tensor([token_ids])).logits[0, -1].double()
        finally:
            handle.remove()
        out.append(torch.log_softmax(logits, -1)[score_ids].numpy())
    return np.array(out)


@torch.no_grad()
def run(model_dir, token_ids: list[int]) -> dict[str, np.ndarray]:
    """Residual stream after every block, MLP neuron activations and logits for one sequence."""
    model = load(str(model_dir))
    resid, mlp_post = [], []
    handles = []
    for block in _blocks(model):
        handles.append(block.register_forward_hook(
            lambda m, a, out: resid.append((out[0] if isinstance(out, tuple) else out)[0].clone())))
        down = getattr(block.mlp, "down_proj", None) or block.mlp.c_proj
        handles.append(down.register_forward_pre_hook(lambda m, a: mlp_post.append(a[0][0].clone())))
    try:
        out = model(torch.tensor([token_ids]), output_hidden_states=True)
    finally:
        for h in handles:
            h.remove()
    return {"resid_post": torch.stack(resid).numpy(), "mlp_post": torch.stack(mlp_post).numpy(),
            "embed_resid": out.hidden_states[0][0].numpy(), "final": out.hidden_states[-1][0].numpy(),
            "logits": out.logits[0].numpy()}


@torch.no_grad()
def attention_patterns(model_dir, token_ids: list[int]) -> list[np.ndarray]:
    """Every layer's attention weights [heads, tokens, tokens] from transformers' eager attention."""
    out = load(str(model_dir))(torch.tensor([token_ids]), output_attentions=True)
    return [a[0].numpy() for a in out.attentions]


@torch.no_grad()
def direct_logit_attribution(model_dir, components: np.ndarray, final_residual: np.ndarray) -> np.ndarray:
    """TransformerLens's convention, written out: a component's rows, centred if the final norm is a
    LayerNorm, times the norm's weight, divided by the final residual's norm scale, through lm_head's
    weight (no bias). [rows, vocab]. For Llama/Qwen2 (RMSNorm) and GPT-2 (LayerNorm) final norms."""
    model = load(str(model_dir))
    norm = model.model.norm if hasattr(model, "model") else model.transformer.ln_f
    c, r = torch.from_numpy(components).double(), torch.from_numpy(final_residual).double()
    centred = isinstance(norm, torch.nn.LayerNorm)
    eps = norm.eps if centred else norm.variance_epsilon
    if centred:
        c, r = c - c.mean(-1, keepdim=True), r - r.mean(-1, keepdim=True)
    scale = torch.sqrt(r.pow(2).mean(-1, keepdim=True) + eps)
    return ((c * norm.weight.double() / scale) @ model.lm_head.weight.double().T).numpy()


def _routers(model) -> dict[int, torch.nn.Module]:
    """Each mixture-of-experts layer's router: transformers' top-k routers return (logits, weights, ids)."""
    routers = {i: getattr(block.mlp, "gate", None) or getattr(block.mlp, "router", None)
               for i, block in enumerate(_blocks(model)) if hasattr(block, "mlp")}
    return {i: router for i, router in routers.items() if router is not None}


@torch.no_grad()
def expert_choice(model_dir, token_ids: list[int]) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """{layer: (expert ids, their weights)} per token, [tokens, top_k] each, as transformers' routers
    chose them."""
    model = load(str(model_dir))
    found = {}

    def keep(layer):
        def hook(module, args, out):
            found[layer] = (out[2].numpy(), out[1].numpy())
        return hook

    handles = [gate.register_forward_hook(keep(i)) for i, gate in _routers(model).items()]
    try:
        model(torch.tensor([token_ids]))
    finally:
        for h in handles:
            h.remove()
    return found


@torch.no_grad()
def router_steered(model_dir, token_ids: list[int], layer: int, bias: np.ndarray) -> dict[str, np.ndarray]:
    """The logits and the last block's output with ``bias`` added to layer ``layer``'s router logits
    before transformers' own router chooses from them (its linear's output, while that router runs):
    the steering an intervention at ``blocks.{layer}.mlp.hook_router`` with that bias does."""
    import torch.nn.functional as F

    model = load(str(model_dir))
    gate, add, plain = _routers(model)[layer], torch.from_numpy(np.asarray(bias, np.float32)), F.linear
    outputs = []

    def biased(x, weight, b=None):
        return plain(x, weight, b) + add if weight is gate.weight else plain(x, weight, b)

    def swap(linear):
        def hook(*_):
            F.linear = linear
        return hook

    handles = [gate.register_forward_pre_hook(swap(biased)), gate.register_forward_hook(swap(plain)),
               _blocks(model)[-1].register_forward_hook(lambda m, a, out: outputs.append(
                   (out[0] if isinstance(out, tuple) else out)[0].clone()))]
    try:
        logits = model(torch.tensor([token_ids])).logits[0]
    finally:
        F.linear = plain
        for h in handles:
            h.remove()
    return {"logits": logits.numpy(), "resid_post": outputs[0].numpy()}


@torch.no_grad()
def logits(model_dir, token_ids: list[int]) -> np.ndarray:
    return load(str(model_dir))(torch.tensor([token_ids])).logits[0].numpy()


_CHILD_LOOP = """
import os, pickle, sys, traceback
sys.path.insert(0, sys.argv[1])
answers = os.fdopen(os.dup(1), "wb")
os.dup2(2, 1)  # whatever else prints goes to stderr, not into the answers
import hf_reference
while True:
    try:
        function, *args = pickle.load(sys.stdin.buffer)
    except EOFError:
        break
    try:
        answer = (True, getattr(hf_reference, function)(*args))
    except Exception:
        answer = (False, traceback.format_exc())
    pickle.dump(answer, answers)
    answers.flush()
"""
_child = _child_stderr = None


def in_child_process(function: str, *args) -> object:
    """``function(*args)`` of this module in another Python: vLLM's Transformers backend decorates
    transformers' model classes in the process that booted it, so they cannot be loaded plainly there.
    One child serves the whole run (its ``load`` keeps the models it read), not a Python each call."""
    import pickle
    import subprocess
    import sys
    import tempfile
    from pathlib import Path

    global _child, _child_stderr
    if _child is None or _child.poll() is not None:
        _child_stderr = tempfile.TemporaryFile()
        _child = subprocess.Popen([sys.executable, "-c", _CHILD_LOOP, str(Path(__file__).parent)],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=_child_stderr)
    try:
        pickle.dump((function, *(str(a) if isinstance(a, Path) else a for a in args)), _child.stdin)
        _child.stdin.flush()
        ok, answer = pickle.load(_child.stdout)
    except (EOFError, BrokenPipeError):
        _child_stderr.seek(0)
        raise AssertionError(_child_stderr.read().decode()[-3000:]) from None
    except BaseException:  # cut short (a test's timeout): its answer must not become the next call's
        _child.kill()
        _child.wait()
        raise
    assert ok, answer
    return answer


@torch.no_grad()
def steered(model_dir, token_ids: list[int], layer: int, vector: np.ndarray, clamp: dict | None = None
            ) -> dict[str, np.ndarray]:
    """Every block's output and the logits with ``vector`` added to block ``layer``'s output by a
    forward hook: the steering an intervention at ``blocks.{layer}.hook_resid_post`` with that bias does.
    ``clamp`` (a ``FeatureClamp.as_dict()``): then also that SAE feature clamped, written out here as
    the SAE's reconstruction with the feature set to the value plus the SAE's error."""
    model = load(str(model_dir))
    blocks, outputs = _blocks(model), []
    add = torch.from_numpy(np.asarray(vector, np.float32))

    def edit(x):
        x = x + add
        if clamp is None:
            return x
        encoder, decoder = (torch.tensor(clamp[k], dtype=torch.float32) for k in ("encoder", "decoder"))
        pre = x @ encoder + clamp["offset"]
        activation = torch.where(pre > clamp["floor"], pre, torch.zeros_like(pre))
        return x + (clamp["value"] - activation)[..., None] * decoder

    def steer(module, args, out):
        return (edit(out[0]), *out[1:]) if isinstance(out, tuple) else edit(out)

    handles = [blocks[layer].register_forward_hook(steer)]
    handles += [b.register_forward_hook(lambda m, a, out: outputs.append(
        (out[0] if isinstance(out, tuple) else out).reshape(-1, add.shape[0]).clone())) for b in blocks]
    try:
        logits = model(torch.tensor([token_ids])).logits[0]
    finally:
        for h in handles:
            h.remove()
    return {"resid_post": torch.stack(outputs).numpy(), "logits": logits.numpy()}
