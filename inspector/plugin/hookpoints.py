"""The hook-point catalogue: where in a vLLM model an activation can be read and replaced.

A hook point is a module plus a *site*, the rule that turns that module's call into one
``[tokens, width]`` tensor and back:

- ``output``: the module's output tensor (or the first element of a tuple: linears return
  ``(out, bias)``, norms called with a residual return ``(normed, residual)``).
- ``output_pair_sum``: fused decoder layers return ``(hidden, residual)``; the residual stream is
  their sum, and replacing it with R means returning ``(R - residual, residual)``.
- ``input_pair_sum``: a forward pre-hook on ``(hidden, residual)`` arguments starting at
  ``arg_index`` (a fused layer's input is resid_pre; the post-attention norm's is resid_mid).
- ``input``: a pre-hook on the argument at ``arg_index`` (GPT-2 blocks take the plain residual stream;
  MLP neuron activations are the down projection's input, since activation modules can be shared
  between layers: vLLM caches one ``gelu_new`` instance for all of them; queries and keys are the
  first two arguments of vLLM's attention layer, after rotary embedding and any q/k norm, flattened
  to ``[tokens, heads × head_size]`` where a model passes them per head).

Replacement is written as a delta, ``h' = h * S + (r * (S - 1) + B)``, so that the residual stream
becomes ``(h + r) * S + B`` while an identity (S = 1, B = 0) leaves every value bit-identical.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from inspector.capture.hooks import HookPoint


@dataclass(frozen=True)
class Site:
    """How a hook point reads and replaces the value at its module (see the module docstring)."""

    how: str  # output | output_pair_sum | input_pair_sum | input
    arg_index: int = 0

    @property
    def is_pre_hook(self) -> bool:
        return self.how.startswith("input")


def _has(module: nn.Module, *names: str) -> bool:
    return all(hasattr(module, n) for n in names)


def _find_block_list(model: nn.Module) -> tuple[str, nn.ModuleList] | None:
    for path, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) and (
            _has(module[0], "input_layernorm", "post_attention_layernorm", "self_attn", "mlp")
            or _has(module[0], "ln_1", "attn", "ln_2", "mlp")
        ):
            return path, module
    return None


def catalogue(model: nn.Module, hidden: int, intermediate: int, dtype: str) -> list[tuple[HookPoint, Site]]:
    """Hook points of a Llama/Qwen-style (fused residual) or GPT-2-style model, in model order."""
    found = _find_block_list(model)
    if found is None:
        raise ValueError(f"{type(model).__name__}: no decoder block list found; "
                         "supported are Llama/Qwen/Mistral-style and GPT-2-style models")
    blocks_path, blocks = found
    stem = blocks_path.rsplit(".", 1)[0] if "." in blocks_path else ""
    fused = hasattr(blocks[0], "input_layernorm")

    def path(*parts: str) -> str:
        return ".".join(p for p in (stem, *parts) if p)

    def point(module_path: str, kind: str, alias: str, how: str, width: int = hidden, arg_index: int = 0,
              layer: int = -1, attention=None) -> tuple[HookPoint, Site]:
        return (HookPoint(f"{module_path}.{kind}", alias, module_path, kind, width, layer, dtype, attention),
                Site(how, arg_index))

    def attention_points(block: str, b: str, i: int) -> list[tuple[HookPoint, Site]]:
        from . import vllm_compat  # imports the runtime, which imports this module

        layers = vllm_compat.attention_layers(model.get_submodule(block))
        if len(layers) != 1:
            return []
        rel, layer = layers[0]
        geometry = vllm_compat.attention_geometry(layer)
        found = [point(f"{block}.{rel}", "q", f"{b}.attn.hook_q", "input", geometry.q_width, 0, i, geometry)]
        if getattr(layer, "kv_sharing_target_layer_name", None) is None:  # else the layer gets no keys
            found.append(point(f"{block}.{rel}", "k", f"{b}.attn.hook_k", "input", geometry.k_width, 1, i, geometry))
        return found

    points = []
    if fused:
        points.append(point(path("embed_tokens"), "embed", "hook_embed", "output"))
    else:
        points.append(point(path("wte"), "embed", "hook_embed", "output"))
        points.append(point(path("wpe"), "pos_embed", "hook_pos_embed", "output"))
    last = blocks_path.rsplit(".", 1)[-1]
    for i in range(len(blocks)):
        block = path(last, str(i))
        b = f"blocks.{i}"
        if fused:
            points += [
                point(block, "resid_pre", f"{b}.hook_resid_pre", "input_pair_sum", arg_index=1, layer=i),
                *attention_points(block, b, i),
                point(f"{block}.self_attn", "attn_out", f"{b}.hook_attn_out", "output", layer=i),
                point(f"{block}.post_attention_layernorm", "resid_mid", f"{b}.hook_resid_mid",
                      "input_pair_sum", arg_index=0, layer=i),
                point(f"{block}.mlp.down_proj", "mlp_post", f"{b}.mlp.hook_post", "input", intermediate, layer=i),
                point(f"{block}.mlp", "mlp_out", f"{b}.hook_mlp_out", "output", layer=i),
                point(block, "resid_post", f"{b}.hook_resid_post", "output_pair_sum", layer=i),
            ]
        else:
            points += [
                point(block, "resid_pre", f"{b}.hook_resid_pre", "input", layer=i),
                *attention_points(block, b, i),
                point(f"{block}.attn", "attn_out", f"{b}.hook_attn_out", "output", layer=i),
                point(f"{block}.mlp.c_proj", "mlp_post", f"{b}.mlp.hook_post", "input", intermediate, layer=i),
                point(f"{block}.mlp", "mlp_out", f"{b}.hook_mlp_out", "output", layer=i),
                point(block, "resid_post", f"{b}.hook_resid_post", "output", layer=i),
            ]
    points.append(point(path("norm" if fused else "ln_f"), "normalized", "ln_final.hook_normalized", "output"))
    modules = dict(model.named_modules())
    return [(p, site) for p, site in points if p.module_path in modules]


# --- reading and replacing at a site (traced into the compiled graph: no value-dependent Python) ---

def _affine_delta(h, r, scale, bias):
    if r is None:
        return h * scale + bias
    return h * scale + (r * (scale - 1) + bias)


def read_output(site, output):
    if site == "output_pair_sum":
        return output[0] + output[1]
    return output[0] if isinstance(output, tuple) else output


def replace_output(site, output, scale, bias):
    """Apply the affine at an output site; returns (new output, the value that now flows on)."""
    if site == "output_pair_sum":
        h, r = output[0], output[1]
        h2 = _affine_delta(h, r, scale, bias)
        return (h2, r, *output[2:]), h2 + r
    if isinstance(output, tuple):
        v = output[0] * scale + bias
        return (v, *output[1:]), v
    v = output * scale + bias
    return v, v


def _pair_args(site, arg_index, args):
    h = args[arg_index]
    r = args[arg_index + 1] if site == "input_pair_sum" and len(args) > arg_index + 1 else None
    return h, r


def read_input(site, arg_index, args):
    h, r = _pair_args(site, arg_index, args)
    return h.flatten(1) if r is None else h + r


def replace_input(site, arg_index, args, scale, bias):
    """Apply the affine at an input site; returns (new args, the value that now flows on)."""
    h, r = _pair_args(site, arg_index, args)
    if r is None:
        flowing = _affine_delta(h.flatten(1), None, scale, bias)
        h2 = flowing.view(h.shape)
    else:
        h2 = _affine_delta(h, r, scale, bias)
        flowing = h2 + r
    return (*args[:arg_index], h2, *args[arg_index + 1:]), flowing
