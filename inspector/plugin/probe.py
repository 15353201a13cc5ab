"""Self-verification at boot: one short forward checks that the catalogue's points tie together as
TransformerLens defines them, so a family nobody tested cannot show silently wrong numbers.

The probe runs before our hooks are installed and before vLLM compiles: plain read-only hooks on every
point, the model called eagerly on a few random tokens (``vllm_compat.probe_forward``, attention
outputs seeded random values since there is no KV cache yet; the stream's bookkeeping is what is
checked, so every branch must carry something). For block
i: ``resid_mid = resid_pre + attn_out``, ``resid_post = resid_mid + mlp_out`` (sequential) or
``resid_pre + attn_out + mlp_out`` (parallel), ``resid_post(i) = resid_pre(i+1)``, and the final norm of
the last ``resid_post`` is ``normalized``. A point whose rows are not ``[tokens, width]`` is withdrawn,
so is one whose hook the forward never reached (a model that calls ``module.forward`` directly), one
where the identity intervention (what a compiled engine applies at every point) would not give back
the very values it was given, and every point of a failed identity that no identity which held vouches
for, naming it. A router point's routing rule is checked on the same forward against the layer's own
router choosing from the logits read there; where they differ, the point keeps its logits and says why
its chosen experts are not recomputed.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, replace
from typing import Callable

import numpy as np
import torch
from torch import nn

from inspector.core.hooks import HookPoint
from inspector.core.routing import Routing, dense_weights, route

from . import hookpoints as hp
from . import vllm_compat

FLOAT32_TOLERANCE, HALF_TOLERANCE = 1e-4, 3e-2  # relative L2 per row; half precision rounds each sum


@dataclass
class Verdict:
    """What the probe found: points to withdraw ({name: the identity it failed}), router points whose
    chosen experts cannot be recomputed ({name: its routing, marked unsupported with why}) and points
    that read right but cannot be steered."""

    withdrawn: dict[str, str]
    unrouted: dict[str, Routing]
    unsteerable: dict[str, str]  # name: why an intervention there would not act as its kind says (read-only)


@torch.inference_mode()
def verify(model: nn.Module, points: list[tuple[HookPoint, hp.Site]], dtype: str,
           forward: Callable[[], None]) -> Verdict:
    """The verdict on a catalogue after one probe ``forward``. The last block is steered on the way: a
    random bias at each of its points in the identities, so that each identity there holds only if
    what a point's intervention sends on is what the model then computes with (a steering round trip)."""
    steered_layer = max((p.layer for p, _ in points), default=-1)
    seen: dict[str, torch.Tensor] = {}
    steered: dict[str, torch.Tensor] = {}  # a steered point's value as it flowed on, bias included
    router_inputs: dict[str, torch.Tensor] = {}  # router point -> the gate's input, for the router's own choice
    altered: dict[str, str] = {}  # points where an identity replacement would not leave the values as they were
    handles = []
    for point, site in points:
        module = model.get_submodule(point.module_path)
        steer = steered if point.layer == steered_layer and point.kind in STEERED else None
        if site.is_pre_hook:
            handles.append(module.register_forward_pre_hook(
                lambda m, args, kwargs, p=point, s=site, st=steer: _probe_input(p, s, args, kwargs, seen, altered, st),
                with_kwargs=True))
        else:
            handles.append(module.register_forward_hook(
                lambda m, args, out, p=point, s=site, st=steer: _probe(p, s, out, hp.read_output, hp.replace_output,
                                                                       seen, altered, st)))
        if point.routing is not None and not point.routing.unsupported:
            handles.append(module.register_forward_pre_hook(
                lambda m, args, p=point: router_inputs.update({p.name: args[0].clone()})))
    calls: dict[str, int] = {}  # module path -> how often it was called ("": the model, once a forward)
    for path in {"", *(p.module_path for p, _ in points)}:
        handles.append(model.get_submodule(path).register_forward_hook(
            lambda m, args, out, path=path: calls.update({path: calls.get(path, 0) + 1})))
    try:
        forward()
    finally:
        for handle in handles:
            handle.remove()
    misread = {p.name: f"it reads a {list(seen[p.name].shape)} tensor where [tokens, {s.local_width(p)}] rows belong"
               for p, s in points if p.name in seen and (seen[p.name].dim() != 2
                                                         or seen[p.name].shape[1] != s.local_width(p))}
    misread.update(altered)
    misread.update({p.name: "the boot probe's forward never reached its hook (the model calls the module around "
                            "its hooks, e.g. through .forward)" for p, _ in points if p.name not in seen})
    for name in misread:
        seen.pop(name, None)
    by_kind = {(p.layer, p.kind): p.name for p, _ in points}
    tolerance = FLOAT32_TOLERANCE if dtype == "float32" else HALF_TOLERANCE
    results: list[tuple[str, list[str], float, bool]] = []  # identity, its points, relative error, may fail
    unsteerable: dict[str, str] = {}  # points read right where an intervention does not act on the stream

    def check(identity: str, left: list[tuple[int, str]], right: list[tuple[int, str]], may_fail=False) -> None:
        names = [by_kind.get(key) for key in left + right]
        if None in names or any(n not in seen for n in names):
            return
        total = sum(steered.get(by_kind[key], seen[by_kind[key]]) for key in left)
        expected = sum(seen[by_kind[key]] for key in right)
        worst = _error(total, expected)
        for name in (by_kind[key] for key in left if by_kind[key] in steered):
            bias = steered[name] - seen[name]  # what was added there; if it never arrived, it explains the gap
            if worst > tolerance and _error(total - bias, expected) <= tolerance:
                unsteerable[name] = (f"a bias there does not reach what the model computes next ({identity} holds "
                                     "as read, not with the bias added)")
                worst = _error(total - bias, expected)
        results.append((identity, names, worst, may_fail))

    layers = sorted({layer for layer, _ in by_kind if layer >= 0})
    check("embeddings = blocks.0.resid_pre", [(-1, k) for k in ("embed", "pos_embed") if (-1, k) in by_kind],
          [(0, "resid_pre")], may_fail=True)  # Gemma scales its embeddings: this only vouches
    for i in layers:
        if (i, "resid_mid") not in by_kind:  # a parallel block (or one with neither branch: nothing to check)
            check(f"blocks.{i}: resid_pre + attn_out + mlp_out = resid_post",
                  [(i, "resid_pre"), (i, "attn_out"), (i, "mlp_out")], [(i, "resid_post")])
        else:
            check(f"blocks.{i}: resid_pre + attn_out = resid_mid", [(i, "resid_pre"), (i, "attn_out")],
                  [(i, "resid_mid")])
            check(f"blocks.{i}: resid_mid + mlp_out = resid_post", [(i, "resid_mid"), (i, "mlp_out")],
                  [(i, "resid_post")])
        if i + 1 in layers:
            check(f"blocks.{i}.resid_post = blocks.{i + 1}.resid_pre", [(i, "resid_post")], [(i + 1, "resid_pre")])
    sites = {p.name: s for p, s in points}
    for i in layers:  # the heads' outputs, through the output projection, are the attention branch's
        z, branch = by_kind.get((i, "z")), by_kind.get((i, "attn_raw")) or by_kind.get((i, "attn_out"))
        if z in seen and branch in seen and sites[z].shards == 1:
            module = model.get_submodule(next(p.module_path for p, _ in points if p.name == z))
            projected = _through(module, steered.get(z, seen[z]))
            seen[z + THROUGH] = projected * sites[branch].factor
            by_kind[(i, THROUGH)] = z + THROUGH
            check(f"blocks.{i}: the output projection of z = the attention output", [(i, THROUGH)],
                  [(i, "attn_raw" if (i, "attn_raw") in by_kind else "attn_out")])
    final = by_kind.get((-1, "normalized"))
    last = by_kind.get((layers[-1], "resid_post")) if layers else None
    if final in seen and last in seen:
        norm = model.get_submodule(next(p.module_path for p, _ in points if p.name == final))
        seen[last + FINAL_NORM] = _through(norm, steered.get(last, seen[last]))
        by_kind[(-1, FINAL_NORM)] = last + FINAL_NORM
        check(f"the final norm of blocks.{layers[-1]}.resid_post = normalized", [(-1, FINAL_NORM)],
              [(-1, "normalized")])
    forwards = max(1, calls.get("", 0))  # a dummy run may run the model more than once
    for p, _ in points:  # NanoChat norms its embeddings with its final norm, before the blocks
        if calls.get(p.module_path, 0) > forwards and p.name not in unsteerable:
            unsteerable[p.name] = (f"its module runs {calls[p.module_path] // forwards} times a forward: it is read at "
                                   "its last call, and an edit there would act on every call")
    withdrawn = {**misread, **_blame(results, tolerance)}
    unrouted = {p.name: replace(p.routing, unsupported=why) for p, _ in points if p.name in router_inputs
                and p.name not in withdrawn and (why := _routing_differs(model, p, router_inputs[p.name], seen[p.name]))}
    return Verdict(withdrawn, unrouted, _alike(model, points, unsteerable, withdrawn))


def _alike(model: nn.Module, points: list[tuple[HookPoint, hp.Site]], found: dict[str, str],
           withdrawn: dict[str, str]) -> dict[str, str]:
    """``found`` (of the steered last block) carried to every block's point of the same kind, read the
    same way from the same class of module: only the last block was steered, the others are built alike."""
    def key(point: HookPoint, site: hp.Site):
        return point.kind, site.how, site.arg_index, type(model.get_submodule(point.module_path)).__name__

    why = {key(p, s): found[p.name] for p, s in points if p.name in found}
    return {p.name: why[key(p, s)] for p, s in points if key(p, s) in why and p.name not in withdrawn}


def _routing_differs(model: nn.Module, point: HookPoint, hidden: torch.Tensor, logits: torch.Tensor) -> str:
    """Why the choice recomputed from the router ``logits`` as captured (in the capture dtype) is not the
    one the layer's own router makes ("" when it is)."""
    try:
        weights, ids = vllm_compat.chosen_experts(model.get_submodule(point.module_path.rpartition(".")[0]),
                                                  hidden, logits)
    except (RuntimeError, TypeError, ValueError, AttributeError, AssertionError) as e:
        return f"the layer's own router could not be asked to confirm the rule ({type(e).__name__}: {e})"
    captured = logits.to(getattr(torch, point.dtype)).float().cpu().numpy()
    ours = dense_weights(*route(captured, point.routing), point.width)
    theirs = dense_weights(ids.cpu().numpy(), weights.float().cpu().numpy(), point.width)
    if not np.array_equal(ours > 0, theirs > 0):
        return "the recomputed rule chooses other experts than the layer's own router in the boot probe"
    error = float(np.abs(ours - theirs).max())
    if error > ROUTING_TOLERANCE:
        return f"the recomputed rule weighs the chosen experts unlike the layer's own router (by {error:.2g})"
    return ""


ROUTING_TOLERANCE = 1e-5  # both compute routing weights in float32


STEERED = ("resid_pre", "z", "attn_out", "resid_mid", "mlp_out", "resid_post")  # the kinds the identities tie


def _probe_input(point: HookPoint, site: hp.Site, args, kwargs, seen: dict, altered: dict, steered: dict | None):
    """``_probe`` at an input site: on the call's arguments, keyword ones included."""
    new = _probe(point, site, hp.call_arguments(args, kwargs), hp.read_input, hp.replace_input, seen, altered, steered)
    return None if new is None else hp.split_arguments(new, args, kwargs)


def _probe(point: HookPoint, site: hp.Site, value, read, replace, seen: dict, altered: dict, steered: dict | None):
    """Read a point, and check that the identity affine (what a compiled engine applies at every point,
    every forward) gives back the very tensors it was given, bit for bit, and the value read; then,
    where ``steered`` is given, add a seeded random bias there, keeping the value that flows on."""
    seen[point.name] = _copy(read(site, value))
    first = value[site.arg_index] if site.is_pre_hook else (value[0] if isinstance(value, tuple) else value)
    try:
        n = hp.row_count(site, first)
        ones = torch.ones(n, site.local_width(point), dtype=first.dtype, device=first.device)
        new, flowing = replace(site, value, ones, torch.zeros_like(ones))
        same = _identical(new, value) and _identical(_copy(flowing), seen[point.name])
    except (RuntimeError, IndexError, TypeError, ValueError) as e:
        altered[point.name] = f"an identity intervention cannot be applied there: {type(e).__name__}: {e}"
        return
    if not same:
        altered[point.name] = "an identity intervention there would change the model's values (not bit-identical)"
    elif steered is not None:
        generator = torch.Generator(first.device).manual_seed(zlib.crc32(point.name.encode()))
        bias = torch.randn(ones.shape, generator=generator, device=first.device).mul(seen[point.name].std() / 2)
        new, flowing = replace(site, value, ones, bias.to(first.dtype))
        steered[point.name] = _copy(flowing)
        return new
    return None


def _error(got: torch.Tensor | int, expected: torch.Tensor) -> float:
    """``hookpoints.row_error``; ``got`` may be the 0 of an empty sum."""
    return hp.row_error(got if isinstance(got, torch.Tensor) else torch.zeros_like(expected) + got, expected)


def _identical(a, b) -> bool:
    """The same structure of tensors, each with the same shape, dtype and bits; NaN where the other has
    NaN counts as the same (a state-space layer's dummy forward reads uninitialised state, and an identity
    keeps NaN as NaN, whatever its bits)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape
                and a.dtype == b.dtype):
            return False
        nan = a.isnan()
        return torch.equal(nan, b.isnan()) and torch.equal(a.masked_fill(nan, 0), b.masked_fill(nan, 0))
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(_identical(x, y) for x, y in zip(a, b))
    return a is b or a == b


FINAL_NORM = " (through the final norm)"  # a point's name + this: its rows normed, standing for the point
THROUGH = " (through its module)"  # z's name + this: its rows through the output projection


def _through(module: nn.Module, rows: torch.Tensor) -> torch.Tensor:
    """``rows`` through ``module`` alone, in the model's dtype, as float32."""
    dtype = next((p.dtype for p in module.parameters()), rows.dtype)
    out = module.forward(rows.to(dtype))
    return _copy(out[0] if isinstance(out, tuple) else out)


def _blame(results: list[tuple[str, list[str], float, bool]], tolerance: float) -> dict[str, str]:
    """The points to withdraw: of each failed identity, those no identity that held vouches for (all of
    them when every one is vouched for)."""
    results = [(identity, [n.removesuffix(FINAL_NORM).removesuffix(THROUGH) for n in names], error, may_fail)
               for identity, names, error, may_fail in results]
    trusted = {name for _, names, error, _ in results if error <= tolerance for name in names}
    failed: dict[str, str] = {}
    for identity, names, error, may_fail in results:
        if error > tolerance and not may_fail:
            for name in [n for n in names if n not in trusted] or names:
                failed.setdefault(name, f"{identity} does not hold in the boot probe (relative error {error:.2g})")
    return failed


def _copy(value: torch.Tensor) -> torch.Tensor:
    """A float32 copy: fused norms update their residual argument in place after the hook has run."""
    return value.to(torch.float32, copy=True)
