"""The block reader: what each decoder block's modules mean, read off one forward of the model vLLM built.

No description names the block's modules here. Every module under the block list is watched through
one eager forward of a few random tokens (the boot probe's, ``vllm_compat.probe_forward``), and each
block's points are found by what the values do, in TransformerLens's terms:

- the stream: the block's input and output read so that one block's output is the next one's input
  and the final norm of the last block's output is the model's normalized output (vLLM's fused
  ``(hidden, residual)`` pairs summed, or not: some blocks pass a residual they ignore);
- the branches: the module outputs that, times a constant (a residual multiplier, or 1), are what the
  block adds to the stream: ``resid_mid = resid_pre + c·attn_out`` and ``resid_post = resid_mid +
  c'·mlp_out`` for sequential blocks, where ``resid_mid`` is the input some later module receives (a
  norm, or the MLP itself), or ``resid_post = resid_pre + c·attn_out + c'·mlp_out`` for parallel ones;
  the attention branch is the one whose values come from the attention layer, whatever its name;
  where a post-branch norm (any name) lies between the branch and the stream, the branch's own output
  is ``attn_raw``/``mlp_raw``;
- inside a branch: the input of the linear whose output is the branch's output (``mlp_post`` for the
  MLP: its neurons; ``z`` for attention: the heads' outputs before the output projection), and a
  mixture of experts' router: the linear whose output the experts are handed.

Each point found is then checked like every other by the boot probe (``probe.py``), on its own
forward, and withdrawn where an identity fails. A block whose kinds cannot be found says which and
why (``Reading.refused``), never a generic refusal.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn


from . import hookpoints as hp
from . import vllm_compat
from .families import Family, Point, Reading

READ = "read from its forward"  # how every family's name ends: no description names any model's modules
ROW_TOLERANCE = {True: 1e-4, False: 3e-2}  # relative L2 per row: float32, half precision
ONE = 1e-3  # a fitted constant this close to 1 is 1


@dataclass
class Call:
    """One module call of the watched forward, its tensors copied as they were."""

    path: str
    order: int
    args: tuple  # positional arguments, then keyword ones (``hookpoints.call_arguments``)
    output: object = None


@dataclass
class Candidate:
    """A value some hook site would read: ``site`` at ``call``'s module, its rows as float32."""

    call: Call
    site: hp.Site
    rows: torch.Tensor


class Recorder:
    """Hooks on every module under ``roots`` that copy each call's arguments and output."""

    def __init__(self, model: nn.Module, roots: list[str]):
        self.every: dict[str, list[Call]] = {}  # path -> its calls, in order
        self._open: dict[str, list[Call]] = {}
        self._order = 0
        self._handles = []
        for path, module in model.named_modules():
            if any(path == r or path.startswith(r + ".") for r in roots):
                self._handles.append(module.register_forward_pre_hook(
                    lambda m, args, kwargs, p=path: self._enter(p, args, kwargs), with_kwargs=True))
                self._handles.append(module.register_forward_hook(
                    lambda m, args, kwargs, out, p=path: self._leave(p, out), with_kwargs=True))

    def _enter(self, path: str, args, kwargs) -> None:
        call = Call(path, self._order, _copy(hp.call_arguments(args, kwargs)))
        self._order += 1
        self.every.setdefault(path, []).append(call)
        self._open.setdefault(path, []).append(call)

    def _leave(self, path: str, output) -> None:
        if self._open.get(path):
            self._open[path].pop().output = _copy(output)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


def _copy(value):
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, (tuple, list)):  # a named tuple's type is not kept: only its items are read
        return tuple(_copy(v) for v in value)
    if isinstance(value, dict):
        return {k: _copy(v) for k, v in value.items()}
    return value


def _rows_of(tensor, tokens: int) -> tuple[torch.Tensor | None, bool]:
    """(rows [tokens, width] as float32, whether a batch of one leads) of a tensor, or (None, False)."""
    if not isinstance(tensor, torch.Tensor) or tensor.dim() < 2:
        return None, False
    if tensor.dim() >= 3 and tensor.shape[0] == 1 and tensor.shape[1] == tokens:
        return tensor[0].flatten(1).float(), True
    if tensor.shape[0] == tokens:
        return tensor.flatten(1).float(), False
    return None, False


def inputs(call: Call, tokens: int) -> list[Candidate]:
    """What an input site at ``call`` could read: each positional tensor, and each with the next one of
    its shape summed (a ``(hidden, residual)`` pair; the residual may be None). Sums are taken in
    float32: in half precision a small branch would drown in the rounding of the stream it joins."""
    found = []
    for i, arg in enumerate(call.args):
        rows, batched = _rows_of(arg, tokens)
        if rows is None:
            continue
        found.append(Candidate(call, hp.Site("input", i, batched), rows))
        for j in range(i + 1, len(call.args) if not batched else i + 1):  # GPT-OSS: (hidden, positions, residual)
            other = call.args[j]
            if other is None or (isinstance(other, torch.Tensor) and other.shape == arg.shape):
                site = hp.Site("input_pair_sum", i, pair_offset=j - i)
                found.append(Candidate(call, site, rows if other is None else rows + _rows_of(other, tokens)[0]))
                break
    return found


def outputs(call: Call, tokens: int) -> list[Candidate]:
    """What an output site at ``call`` could read: the output (or its first element), and a pair's sum."""
    out = call.output
    first = out[0] if isinstance(out, tuple) and out else out
    rows, batched = _rows_of(first, tokens)
    if rows is None:
        return []
    found = [Candidate(call, hp.Site("output", 0, batched), rows)]
    if (isinstance(out, tuple) and len(out) > 1 and isinstance(out[1], torch.Tensor) and out[1].shape == first.shape
            and not batched):
        found.append(Candidate(call, hp.Site("output_pair_sum"), rows + _rows_of(out[1], tokens)[0]))
    return found


def _error(got: torch.Tensor, want: torch.Tensor) -> float:
    return hp.row_error(got, want) if got.shape == want.shape else float("inf")


def _finite_rows(*tensors: torch.Tensor) -> torch.Tensor:
    """Rows finite in every tensor: constants are fitted there (a state-space layer's dummy forward
    reads uninitialised state, NaN in some rows; ``row_error`` leaves them out likewise)."""
    return torch.stack([torch.isfinite(t).all(-1) for t in tensors]).all(0)


def _fit(target: torch.Tensor, base: torch.Tensor, value: torch.Tensor, tolerance: float) -> float | None:
    """The constant c with ``target ≈ base + c·value`` (the stream-relative error within ``tolerance``;
    1 when 1 will do, so that a branch too small to pin c down, as in half precision, reads as 1)."""
    if value.shape != target.shape or float(value.norm()) == 0.0:
        return None
    if _error(base + value, target) <= tolerance:
        return 1.0
    rows = _finite_rows(target, base, value)
    difference, value_there = (target - base)[rows], value[rows]
    c = float((difference * value_there).sum() / (value_there * value_there).sum())
    c = 1.0 if abs(c - 1.0) < ONE else c
    return c if c != 0.0 and _error(base + c * value, target) <= tolerance else None


def _fit_two(target, base, a, b, tolerance: float) -> tuple[float, float] | None:
    """Constants (c, c') with ``target ≈ base + c·a + c'·b``, as ``_fit``."""
    if a.shape != target.shape or b.shape != target.shape:
        return None
    if _error(base + a + b, target) <= tolerance:
        return 1.0, 1.0
    rows = _finite_rows(target, base, a, b)
    if not bool(rows.any()):
        return None
    basis = torch.stack([a[rows].flatten(), b[rows].flatten()], dim=1).double()
    solution = torch.linalg.lstsq(basis, (target - base)[rows].flatten().double().unsqueeze(1)).solution.flatten()
    c, c2 = (1.0 if abs(float(x) - 1.0) < ONE else float(x) for x in solution)
    if c == 0.0 or c2 == 0.0:
        return None
    return (c, c2) if _error(base + c * a + c2 * b, target) <= tolerance else None


def _depth(path: str) -> int:
    return path.count(".")


def _within(path: str, root: str) -> bool:
    return path == root or path.startswith(root + ".")


def read(model: nn.Module, blocks_path: str, blocks, final_norm: str, embeds: tuple,
         hidden: int, dtype: str, forward: Callable[[Callable], None], first: int = 0) -> Reading:
    """Read the blocks through one ``forward(on_attention)`` (``vllm_compat.probe_forward``): ``blocks``
    are the list's blocks from index ``first`` on (a pipeline stage's, in order), the family's points
    one tuple for each."""
    roots = [f"{blocks_path}.{first + i}" for i in range(len(blocks))]
    recorder = Recorder(model, roots + [final_norm] * bool(final_norm))
    attention: set[str] = set()  # the attention layers called, however they were (module call or .forward)
    paths = {id(m): p for p, m in model.named_modules()}
    try:
        forward(lambda layer, args, output: attention.add(paths[id(layer)]))
    finally:
        recorder.remove()
    calls = {path: every[0] for path, every in recorder.every.items()}  # a shared module: its first call
    last_block = calls.get(roots[-1])
    if last_block is not None:  # the final norm's call after the blocks (NanoChat norms the embeddings with it too)
        calls[final_norm] = next((c for c in recorder.every.get(final_norm, []) if c.order > last_block.order), None)
    return _derive(model, roots, blocks, final_norm, embeds, hidden, ROW_TOLERANCE[dtype == "float32"],
                   calls, attention)


def _derive(model, roots, blocks, final_norm, embeds, hidden, tolerance, calls, attention) -> Reading:
    """The family from the recorded ``calls``: the stream first (it must chain), then each block's
    branches; ValueError naming the model where the stream cannot be read."""
    names = sorted({type(b).__name__ for b in blocks})
    block_calls = [calls.get(root) for root in roots]
    if any(c is None or c.output is None for c in block_calls):
        raise ValueError(f"{type(model).__name__}: the boot forward did not pass through every decoder block "
                         f"({', '.join(names)}); hook a module by path instead")
    tokens = next((r.shape[0] for c in block_calls[:1] for r in [_stream_rows(c, hidden)] if r is not None), None)
    if tokens is None:
        raise ValueError(f"{type(model).__name__}: its decoder blocks ({', '.join(names)}) take no [tokens, {hidden}] "
                         "stream as an argument; hook a module by path instead")
    stream = _stream(model, block_calls, calls.get(final_norm), final_norm, tokens, hidden, tolerance)
    if stream is None:
        raise ValueError(f"{type(model).__name__}: no reading of its decoder blocks' ({', '.join(names)}) inputs and "
                         "outputs carries the stream from one block to the next and into the final norm; hook a "
                         "module by path instead")
    per_block, refused = [], {}
    for i, (root, (pre, post)) in enumerate(zip(roots, stream)):
        inside = sorted((c for p, c in calls.items() if p.startswith(root + ".") and c.output is not None),
                        key=lambda c: c.order)
        layers = [p for p in attention if _within(p, root)]
        points, why = _branches(model, root, inside, layers, pre, post, tokens, hidden, tolerance)
        per_block.append((Point("resid_pre", "", pre.site.how, pre.site.arg_index, batched=pre.site.batched,
                                pair_offset=pre.site.pair_offset),
                          *points, Point("resid_post", "", post.site.how, batched=post.site.batched)))
        for kind, reason in why.items():
            refused.setdefault(kind, f"{reason} (block {root.rpartition('.')[2]}, {type(blocks[i]).__name__})")
    kinds = {p.kind for points in per_block for p in points}
    style = ("fused" if stream[-1][1].site.how == "output_pair_sum" else
             "parallel" if "attn_out" in kinds and "resid_mid" not in kinds else "sequential")
    family = Family(f"{style} ({', '.join(names)}), {READ}", tuple(per_block), embeds, final_norm,
                    batched=stream[0][0].site.batched)
    return Reading(family, refused)


def _stream_rows(call: Call, hidden: int):
    for arg in call.args:
        if isinstance(arg, torch.Tensor) and arg.dim() >= 2 and arg.shape[-1] == hidden:
            return arg.reshape(-1, hidden)
    return None


def _stream(model, block_calls, norm_call, final_norm, tokens, hidden, tolerance):
    """Per block (resid_pre, resid_post) candidates: the first reading, pairs summed or not, under which
    each block's output is the next one's input and the final norm of the last is the model's."""
    ins = [[c for c in inputs(call, tokens) if c.rows.shape[1] == hidden] for call in block_calls]
    outs = [[c for c in outputs(call, tokens) if c.rows.shape[1] == hidden] for call in block_calls]
    normalized = outputs(norm_call, tokens) if norm_call is not None and norm_call.output is not None else []
    norm = model.get_submodule(final_norm) if normalized else None
    for pre_how in ("input_pair_sum", "input"):
        for post_how in ("output_pair_sum", "output"):
            pres = [next((c for c in found if c.site.how == pre_how), None) for found in ins]
            posts = [next((c for c in found if c.site.how == post_how), None) for found in outs]
            if None in pres or None in posts:
                continue
            if any(_error(posts[i].rows, pres[i + 1].rows) > tolerance for i in range(len(pres) - 1)):
                continue
            if normalized and _error(_normed(norm, posts[-1]), normalized[0].rows) > tolerance:
                continue
            return list(zip(pres, posts))
    return None


@torch.inference_mode()
def _normed(norm: nn.Module, value: Candidate) -> torch.Tensor:
    dtype = next((p.dtype for p in norm.parameters()), value.rows.dtype)
    out = norm.forward(value.rows.to(dtype))
    return (out[0] if isinstance(out, tuple) else out).float()


def _branches(model, root, inside, layers, pre, post, tokens, hidden, tolerance):
    """The points between a block's input and output, and why each kind not found is not offered."""
    rel = lambda path: path[len(root) + 1:]  # noqa: E731 - a path within the block
    outs = [c for call in inside for c in outputs(call, tokens) if c.rows.shape[1] == hidden
            and c.site.how == "output" and not _passes_through(call, c, tokens)]
    ins = [c for call in inside for c in inputs(call, tokens) if c.rows.shape[1] == hidden]
    if not layers:
        return [], {k: "its token mixer is not attention (no attention layer in the block)"
                    for k in ("attn_out", "resid_mid", "mlp_out")}
    attentive = _attention_side(model, inside, layers, tokens)
    x, y = pre.rows, post.rows
    found = _sequential(outs, ins, attentive, x, y, tolerance) or _parallel(outs, attentive, x, y, tolerance)
    if found is None:
        why = "no module's output is what the block adds to the stream, times a constant"
        return [], {k: why for k in ("attn_out", "resid_mid", "mlp_out")}
    (a, c_a), mid, (m, c_m) = found
    points, refused = [], {}
    raw_attention = _raw(model, a, inside, tokens)
    if raw_attention is not a:
        points.append(Point("attn_raw", rel(raw_attention.call.path), "output", batched=raw_attention.site.batched))
    z = _projection_input(model, raw_attention, inside, tokens)
    if z is not None:
        points.append(Point("z", rel(z.call.path), "input", z.site.arg_index, "in", batched=z.site.batched))
    else:
        refused["z"] = "no linear's output is the attention branch's output (no output projection to read before)"
    points.append(Point("attn_out", rel(a.call.path), "output", factor=c_a, batched=a.site.batched))
    if mid is not None:
        points.append(Point("resid_mid", rel(mid.call.path), mid.site.how, mid.site.arg_index,
                            batched=mid.site.batched, pair_offset=mid.site.pair_offset))
    else:
        refused["resid_mid"] = "its attention and MLP branches both read resid_pre (a parallel block)"
    raw_mlp = _raw(model, m, inside, tokens)
    router = _router(model, raw_mlp, inside, tokens)
    if router is not None:
        points.append(Point("router", rel(router.call.path), "output", width="out", batched=router.site.batched))
    mlp_post = _projection_input(model, raw_mlp, inside, tokens)
    if mlp_post is not None:
        points.append(Point("mlp_post", rel(mlp_post.call.path), "input", mlp_post.site.arg_index, "in",
                            batched=mlp_post.site.batched))
    else:
        refused["mlp_post"] = ("its MLP is a mixture of experts, with no single output projection"
                               if router is not None else "no linear of its MLP gives the MLP's output")
    if raw_mlp is not m:
        points.append(Point("mlp_raw", rel(raw_mlp.call.path), "output", batched=raw_mlp.site.batched))
    points.append(Point("mlp_out", rel(m.call.path), "output", factor=c_m, batched=m.site.batched))
    return points, refused


def _passes_through(call: Call, out: Candidate, tokens: int) -> bool:
    """Whether a module gives back its input (dropout at inference): the value is its producer's."""
    return any(c.site.how == "input" and c.rows.shape == out.rows.shape and torch.equal(c.rows, out.rows)
               for c in inputs(call, tokens))


def _attention_side(model: nn.Module, inside: list[Call], layers: list[str], tokens: int) -> dict[str, bool]:
    """Module path -> whether its output is the attention branch's: it holds an attention layer, or it
    holds no linear and its one tensor argument is such an output (a post-attention norm, dropout).
    A norm handed a (hidden, residual) pair mixes in the stream, and is not."""
    side: dict[str, bool] = {}
    attention_outputs: list[torch.Tensor] = []
    for call in inside:
        tensors = [a for a in call.args if isinstance(a, torch.Tensor)]
        first = _rows_of(tensors[0], tokens)[0] if len(tensors) == 1 else None
        fed = (first is not None and not _holds_linear(model, call.path)
               and any(o.shape == first.shape and torch.equal(o, first) for o in attention_outputs))
        side[call.path] = any(_within(layer, call.path) for layer in layers) or fed
        if side[call.path]:
            attention_outputs += [c.rows for c in outputs(call, tokens)]
    return side


def _holds_linear(model: nn.Module, path: str) -> bool:
    return any(vllm_compat.is_linear(m) for m in model.get_submodule(path).modules())


def _best(candidates: list[tuple[Candidate, float]]) -> tuple[Candidate, float] | None:
    """Of modules giving the same value: the one nearest the block (its own child), then the last called."""
    return min(candidates, key=lambda cc: (cc[1] != 1.0, _depth(cc[0].call.path), -cc[0].call.order), default=None)


def _sequential(outs, ins, attentive, x, y, tolerance):
    """((attn_out, c), resid_mid, (mlp_out, c')) of a block whose MLP reads resid_pre + c·attn_out."""
    for mid in ins:
        if _error(mid.rows, x) <= tolerance:  # the block's input handed on: no branch added yet
            continue
        before = [c for c in outs if c.call.order < mid.call.order and attentive.get(c.call.path)]
        a = _best([(c, k) for c in before if (k := _fit(mid.rows, x, c.rows, tolerance)) is not None])
        if a is None:
            continue
        after = [c for c in outs if c.call.order >= mid.call.order and not attentive.get(c.call.path)]
        m = _best([(c, k) for c in after if (k := _fit(y, mid.rows, c.rows, tolerance)) is not None])
        if m is not None:
            return a, mid, m
    return None


def _parallel(outs, attentive, x, y, tolerance):
    """((attn_out, c), None, (mlp_out, c')) of a block whose branches both read resid_pre."""
    fits = []
    for a in (c for c in outs if attentive.get(c.call.path)):
        for m in (c for c in outs if not attentive.get(c.call.path)):
            k = _fit_two(y, x, a.rows, m.rows, tolerance)
            if k is not None:
                fits.append((a, m, k))
    if not fits:
        return None
    a, m, (c_a, c_m) = min(fits, key=lambda f: (f[2] != (1.0, 1.0), _depth(f[0].call.path) + _depth(f[1].call.path),
                                                 -f[0].call.order - f[1].call.order))
    return (a, c_a), None, (m, c_m)


def _raw(model: nn.Module, branch: Candidate, inside: list[Call], tokens: int) -> Candidate:
    """The branch's own output where a post-branch norm (a module holding no linear) lies between it
    and the stream: the output of the module that norm is handed; else the branch itself."""
    first = next((c.rows for c in inputs(branch.call, tokens) if c.site.how == "input"), None)
    if first is None or _holds_linear(model, branch.call.path):
        return branch
    found = [(out, 1.0) for call in inside if call.order < branch.call.order and _holds_linear(model, call.path)
             for out in outputs(call, tokens)
             if out.site.how == "output" and out.rows.shape == first.shape and torch.equal(out.rows, first)]
    return _best(found)[0] if found else branch


def _projection_input(model: nn.Module, branch: Candidate, inside: list[Call], tokens: int) -> Candidate | None:
    """The input of the linear (the branch's module or one within it) whose output is the branch's."""
    for call in sorted((c for c in inside if _within(c.path, branch.call.path)), key=lambda c: -c.order):
        if not vllm_compat.is_linear(model.get_submodule(call.path)):
            continue
        out = next((o for o in outputs(call, tokens) if o.site.how == "output"), None)
        if out is not None and _error(out.rows, branch.rows) <= 1e-6:
            return next((c for c in inputs(call, tokens) if c.site.how == "input"), None)
    return None


def _router(model: nn.Module, mlp: Candidate, inside: list[Call], tokens: int) -> Candidate | None:
    """A linear within the MLP whose output (one logit per expert) a later module of it is handed beside
    the tokens' hidden states (the experts, choosing from them; an activation gets its input alone);
    else, where vLLM's fused experts call their gate themselves, the linear with one output per expert."""
    within = [c for c in inside if _within(c.path, mlp.call.path) and c.path != mlp.call.path]
    experts = vllm_compat.expert_counts(model.get_submodule(mlp.call.path))
    gates = [o for c in within if vllm_compat.is_linear(model.get_submodule(c.path))
             for o in outputs(c, tokens) if o.site.how == "output" and o.rows.shape[1] in experts]
    for call in within:
        if not vllm_compat.is_linear(model.get_submodule(call.path)):
            continue
        out = next((o for o in outputs(call, tokens) if o.site.how == "output"), None)
        if out is None or out.rows.shape[1] == mlp.rows.shape[1]:
            continue
        raw = call.output[0] if isinstance(call.output, tuple) else call.output
        for later in (c for c in within if c.order > call.order and not _within(c.path, call.path)):
            given = [g for g in later.args if isinstance(g, torch.Tensor)]
            if (len(given) > 1 and not (given[0].shape == raw.shape and torch.equal(given[0], raw))
                    and any(g.shape[-1] == mlp.rows.shape[1] for g in given)
                    and any(g.shape == raw.shape and torch.equal(g, raw) for g in given[1:])):
                return out
    return min(gates, key=lambda o: _depth(o.call.path), default=None)
