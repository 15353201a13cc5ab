"""Per-worker capture and intervention state: hooks, static buffers, slot tables, step records.

Hooks write each forward's rows into static ``[max_tokens, width]`` buffers and apply
``value * scale[slot] + bias[slot]`` (then the slot's feature clamps, ``clamps``) with the slot gathered
per row from ``row_slot``. In the compiled flavour both are traced into the graph, so the hooks'
Python never runs again: everything that varies (which request owns which row, which interventions
apply) is written into those buffers *between* forwards by ``before_forward``, and ``after_forward``
queues one copy of the live rows to the host per stack of same-width hooks (``copyout``), or of the
rows that requests' capture windows keep (``row_windows``). Splitting rows per request (``gather``)
waits until the driver drains, keeping the per-step work small. The logprobs of tokens a request
asked to score come from the model's logits (``scores``).
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Callable, Collection

import numpy as np
import torch
from torch import nn

from inspector.core.drained import DrainedRequest
from inspector.core.hooks import HookPoint
from inspector.core.interventions import Intervention, check_clamp_capacity, validate
from inspector.core.sae import AttachedSae

from . import hookpoints as hp
from .clamps import ClampTable
from .config import PluginConfig
from .copyout import HostQueue
from .features import DeviceSae
from .gather import QueuedForward, SaeStack, drained_requests
from .python_hooks import PythonHooks
from .row_windows import SlotIndex, WindowTable
from .scores import TokenScores
from .slots import SlotPlanner, compose
from .uploads import to_device, upload
from .vllm_compat import StepInfo

logger = logging.getLogger(__name__)


@dataclass
class ActiveHook:
    """One installed hook point. Its tensors are also registered as (non-persistent) buffers of the
    hooked module, and the hook reads them from there: the compiler then treats them like weights,
    as graph inputs, so the compiled pieces of identical layers stay identical and can be shared."""

    point: HookPoint
    site: hp.Site
    buffer: torch.Tensor | None  # None: this rank does not send the point's rows (tensor parallel)
    scale: torch.Tensor
    bias: torch.Tensor
    row_slot: torch.Tensor  # [max_tokens]: each row's slot in scale/bias, written between forwards
    prefix: str
    clamps: ClampTable | None = None  # None: its features cannot be clamped (none asked for at boot, or sharded)
    handle: torch.utils.hooks.RemovableHandle | None = None

    def tensors(self) -> dict[str, torch.Tensor]:
        found = {"scale": self.scale, "bias": self.bias, "row_slot": self.row_slot,
                 **(self.clamps.tensors() if self.clamps else {})}
        return found if self.buffer is None else {"rows": self.buffer, **found}

    def attach(self, module: nn.Module) -> None:
        for suffix, tensor in self.tensors().items():
            module.register_buffer(f"{self.prefix}_{suffix}", tensor, persistent=False)

    def detach(self, module: nn.Module) -> None:
        self.handle.remove()
        for suffix in self.tensors():
            del module._buffers[f"{self.prefix}_{suffix}"]


@dataclass
class RowStack:
    """Capture buffers of hooks of one width, stacked so that a step's rows leave in one copy."""

    tensor: torch.Tensor  # [hooks, max_tokens, width]
    names: list[str | None]  # hook per slot; None once removed
    arena: torch.Tensor | None = None  # where a forward's rows wait for their copy to the host (``copyout``)


class InspectorRuntime:
    def __init__(self, model: nn.Module, points: list[tuple[HookPoint, hp.Site]], config: PluginConfig,
                 device: torch.device, max_tokens: int, max_model_len: int, family: str = "",
                 refused: dict[str, str] | None = None, elsewhere: tuple[str, ...] = ()):
        self.model = model
        # module paths another pipeline stage holds: their hooks, patterns and edits are that stage's
        self.elsewhere = elsewhere
        self.family = family  # the block description the catalogue follows (families.py), for the record
        self.refused = dict(refused or {})  # kind -> why this model offers no point of it
        self.probe_seconds = 0.0  # what reading the blocks and the boot probe took (for the record)
        self.config = config
        self.catalogue = {p.name: p for p, _ in points}
        self.sites = {p.name: site for p, site in points}
        self.by_alias = {p.alias: p for p, _ in points}
        self.device = device
        self.dtype = getattr(torch, config.dtype)
        self.max_tokens = max_tokens
        self.max_model_len = max_model_len
        self.active: dict[str, ActiveHook] = {}
        self._stacks: list[RowStack] = []
        self._slot_index = SlotIndex([], frozenset(), {})
        self.planner = SlotPlanner(config.max_slots)
        # The compiled graph must contain the affine, since interventions arrive after tracing.
        self._affine_in_graph = not config.eager
        self._has_interventions = False
        self._driver_interventions: list[Intervention] = []
        self._request_edits: dict[str, list[Intervention]] = {}  # request -> the edits it carries
        self._slotted: set[str] = set()  # hooks whose row_slot is not all zeros
        self._clamped: set[str] = set()  # hooks whose interventions clamp features
        self._no_capture: set[str] = set()  # requests whose rows nobody reads (per-request options)
        self._scores = TokenScores()  # the logprobs of tokens requests asked to score
        self._windows = WindowTable()  # requests that keep only some of their rows
        self._logits_step: StepInfo | None = None  # the forward whose logits come next
        self.saes: dict[str, DeviceSae] = {}  # attached SAEs whose hook's rows this rank sends
        self._in_flight = HostQueue(device)  # queued forwards: their rows and host copies, until drained
        self.python_hooks = PythonHooks()  # set only in eager mode, where a forward can run any Python
        # (req_ids, query_start_loc, positions, [(hook names, [hooks, rows, width])]) -> None: the caller's own
        # consumer of each forward's rows on the device (an engine in its process), in place of the host copies
        self.row_sink: Callable | None = None

    # --- hook set ---

    def resolve(self, name: str, module_path: str, width: int) -> HookPoint:
        """The catalogue point a spec means: by name or alias, else the point at that module's output."""
        point = self.catalogue.get(name) or self.by_alias.get(name)
        if point is None:
            candidates = [p for p in self.catalogue.values() if p.module_path == module_path]
            point = next((p for p in candidates if not self.sites[p.name].is_pre_hook),
                         candidates[0] if candidates else None)
        if point is None:
            modules = dict(self.model.named_modules())
            if module_path not in modules:
                raise ValueError(f"hook {name!r}: unknown module path {module_path!r}")
            raise ValueError(f"hook {name!r}: module {module_path!r} ({type(modules[module_path]).__name__}) "
                             "is not a hook point; see the catalogue for the points this model offers")
        if point.withdrawn:
            raise ValueError(f"hook {name!r} ({point.alias}) is withdrawn: {point.withdrawn}")
        if point.module_path != module_path:
            raise ValueError(f"hook {name!r} is {point.name} at module {point.module_path!r}, "
                             f"but the spec says {module_path!r}")
        if int(width) != point.width:
            raise ValueError(f"hook {name!r}: width {width} does not match {point.module_path!r}, "
                             f"which is {point.width} wide")
        return point

    def held_elsewhere(self, module_path: str) -> bool:
        """Whether another pipeline stage holds the module at ``module_path``."""
        return any(module_path == path or module_path.startswith(path + ".") for path in self.elsewhere)

    def head_elsewhere(self) -> bool:
        """Whether another pipeline stage holds the final norm and the model's head (the lens's)."""
        return bool(self.elsewhere) and not any(p.kind == "normalized" for p in self.catalogue.values())

    def local(self, specs: dict[str, tuple[str, int]]) -> dict[str, tuple[str, int]]:
        """Of hook specs, those of modules this pipeline stage holds."""
        return {name: spec for name, spec in specs.items() if not self.held_elsewhere(spec[0])}

    def match(self, patterns: tuple[str, ...]) -> dict[str, tuple[str, int]]:
        """Specs for every point whose name or alias matches one of the glob patterns; on a pipeline
        stage, a pattern may match none of its points (the driver checks that some stage's match)."""
        specs = {}
        for pattern in patterns:
            hits = [p for p in self.catalogue.values() if p.matches(pattern)]
            if not hits and self.elsewhere:
                continue
            if not hits:
                refusals = [why for kind, why in self.refused.items() if kind in pattern]
                raise ValueError(f"hook pattern {pattern!r} matches no hook point of this model"
                                 + "".join(f"; {why}" for why in refusals))
            if all(p.withdrawn for p in hits):
                raise ValueError(f"hook pattern {pattern!r} matches only withdrawn points: {hits[0].withdrawn}")
            hits = [p for p in hits if not p.withdrawn]
            specs.update({p.name: (p.module_path, p.width) for p in hits})
        return specs

    def install(self, specs: dict[str, tuple[str, int]]) -> None:
        """Validate every spec first, then install all: a bad spec changes nothing. A spec of a module
        another pipeline stage holds is that stage's to install."""
        specs = self.local(specs)
        resolved = {}
        taken = {hook.point.name: name for name, hook in self.active.items()}
        for name, (path, width) in specs.items():
            if name in self.active or name in resolved:
                raise ValueError(f"duplicate hook name {name!r}")
            point = self.resolve(name, path, width)
            if point.name in taken:
                raise ValueError(f"hook {name!r} is {point.name}, already installed as {taken[point.name]!r}")
            resolved[name], taken[point.name] = point, name
        copied = {name: self.sites[p.name].local_width(p) for name, p in resolved.items() if self.sites[p.name].copies}
        for width in sorted(set(copied.values())):
            names = [name for name, w in copied.items() if w == width]
            with torch.inference_mode():
                rows = torch.zeros(len(names), self.max_tokens, width, dtype=self.dtype, device=self.device)
                stack = RowStack(rows, list(names), self._in_flight.copy_out.arena(rows))
            self._stacks.append(stack)
            for index, name in enumerate(names):
                self._install(name, resolved[name], stack.tensor[index])
        for name in resolved.keys() - copied.keys():
            self._install(name, resolved[name], None)
        self._index_slots()

    def _install(self, name: str, point: HookPoint, buffer: torch.Tensor | None) -> None:
        site = self.sites[point.name]
        with torch.inference_mode():
            hook = ActiveHook(
                point,
                site,
                buffer=buffer,
                scale=torch.ones(self.config.max_slots, site.local_width(point), dtype=self.dtype, device=self.device),
                bias=torch.zeros(self.config.max_slots, site.local_width(point), dtype=self.dtype, device=self.device),
                row_slot=torch.zeros(self.max_tokens, dtype=torch.long, device=self.device),
                prefix=f"_inspector_{point.kind}",
                clamps=(ClampTable.allocate(self.config.feature_clamps, self.config.max_slots, point.width, self.dtype,
                                            self.device) if self.config.feature_clamps and site.shards == 1 else None),
            )
        self.planner.forget([name])  # its tables are new
        module = self.model.get_submodule(point.module_path)
        hook.attach(module)
        if hook.site.is_pre_hook:
            hook.handle = module.register_forward_pre_hook(functools.partial(self._on_input, hook), with_kwargs=True)
        else:
            hook.handle = module.register_forward_hook(functools.partial(self._on_output, hook))
        self.active[name] = hook

    def _index_slots(self) -> None:
        slots = [(s, h, name) for s, stack in enumerate(self._stacks) for h, name in enumerate(stack.names)
                 if name is not None]
        by_stack: dict[int, list[int]] = {}
        for s, h, _ in slots:
            by_stack.setdefault(s, []).append(h)
        self._slot_index = SlotIndex(slots, frozenset(name for _, _, name in slots), by_stack)

    def allocated_bytes(self) -> int:
        """Device memory held for the installed hooks: capture buffers and intervention tables."""
        tensors = [*(s.tensor for s in self._stacks),  # rows: in the stacks, and staged for the host
                   *(s.arena for s in self._stacks if s.arena is not None),
                   *(t for h in self.active.values() for name, t in h.tensors().items() if name != "rows")]
        return sum(t.numel() * t.element_size() for t in tensors)

    def remove(self, names: list[str]) -> None:
        missing = [n for n in names if n not in self.active]
        if missing:
            raise ValueError(f"hooks {missing} are not installed")
        for name in names:
            hook = self.active.pop(name)
            hook.detach(self.model.get_submodule(hook.point.module_path))
            for stack in self._stacks:
                stack.names = [None if n == name else n for n in stack.names]
        self._stacks = [stack for stack in self._stacks if any(stack.names)]
        self._index_slots()
        self.saes = {name: sae for name, sae in self.saes.items() if sae.attached.hook not in names}
        self._request_edits = {rid: [iv for iv in edits if iv.hook not in names]
                               for rid, edits in self._request_edits.items()}
        self.set_interventions([iv for iv in self._driver_interventions if iv.hook not in names])

    def attach_sae(self, attached: AttachedSae) -> None:
        """Encode an installed hook's rows with an SAE after every forward, on the device."""
        hook = self.active.get(attached.hook)
        if hook is None and self.elsewhere:
            return  # another pipeline stage holds the hook (the driver checked that one does)
        if hook is None:
            raise ValueError(f"SAE {attached.name}: hook {attached.hook!r} is not installed")
        if hook.site.shards > 1:
            raise ValueError(f"SAE {attached.name}: {hook.point.alias} is split over the tensor-parallel ranks; an SAE "
                             "reads a replicated point (the residual stream, an attention or MLP output)")
        if attached.config.d_in != hook.point.width:
            raise ValueError(f"SAE {attached.name} reads {attached.config.d_in}-wide rows, but {hook.point.alias} is "
                             f"{hook.point.width} wide")
        if attached.name in self.saes:
            raise ValueError(f"an SAE named {attached.name!r} is attached already")
        if hook.buffer is not None:  # else another rank sends this hook's rows, and encodes them
            self.saes[attached.name] = DeviceSae(attached, self.device, self.dtype)

    def detach_sae(self, name: str) -> None:
        self.saes.pop(name, None)

    # --- the hooks (traced in the compiled flavour) ---

    def _use_affine(self) -> bool:
        return self._affine_in_graph or self._has_interventions

    def _gather(self, hook: ActiveHook, module, n):
        """Each row's scale and bias, and what ``hookpoints.clamp_delta`` needs (None: no clamps here)."""
        prefix = hook.prefix
        rows = getattr(module, f"{prefix}_row_slot").narrow(0, 0, n)
        clamp = None
        if hook.clamps is not None and (self._affine_in_graph or hook.point.name in self._clamped):
            clamp = (rows, *(getattr(module, f"{prefix}_{name}") for name in hook.clamps.tensors()))
        return (getattr(module, f"{prefix}_scale").index_select(0, rows),
                getattr(module, f"{prefix}_bias").index_select(0, rows), clamp)

    def _on_output(self, hook: ActiveHook, module, args, output):
        site, prefix = hook.site, hook.prefix
        if self._use_affine():
            n = hp.row_count(site, output[0] if isinstance(output, tuple) else output)
            output, value = hp.replace_output(site, output, *self._gather(hook, module, n))
            replaced = output
        else:
            value, replaced = hp.read_output(site, output), None
        if (delta := self._python_delta(hook, value)) is not None:
            replaced, value = hp.replace_output(site, output, 1.0, delta)
        if hook.buffer is not None:
            getattr(module, f"{prefix}_rows").narrow(0, 0, value.shape[0]).copy_(value)
        return replaced

    def _on_input(self, hook: ActiveHook, module, args, kwargs):
        site, prefix = hook.site, hook.prefix
        arguments, replaced = hp.call_arguments(args, kwargs), None
        if self._use_affine():
            n = hp.row_count(site, arguments[site.arg_index])
            arguments, value = hp.replace_input(site, arguments, *self._gather(hook, module, n))
            replaced = hp.split_arguments(arguments, args, kwargs)
        else:
            value = hp.read_input(site, arguments)
        if (delta := self._python_delta(hook, value)) is not None:
            arguments, value = hp.replace_input(site, arguments, 1.0, delta)
            replaced = hp.split_arguments(arguments, args, kwargs)
        if hook.buffer is not None:
            getattr(module, f"{prefix}_rows").narrow(0, 0, value.shape[0]).copy_(value)
        return replaced

    def _python_delta(self, hook: ActiveHook, value: torch.Tensor) -> torch.Tensor | None:
        """What the hook's Python function (eager mode only) adds to the forward's rows, if it has one."""
        if self._affine_in_graph or not self.python_hooks.functions:  # compiled: nothing here is traced
            return None
        step = self._logits_step
        if step is None:
            return None
        return self.python_hooks.delta(hook.point.name, value, step.req_ids, step.query_start_loc, step.positions)

    # --- between forwards ---

    def before_forward(self, step: StepInfo) -> None:
        n = step.num_tokens
        slots, writes = (self.planner.plan(step.req_ids, step.query_start_loc, step.positions)
                         if self._has_interventions else ({}, []))
        with torch.inference_mode():
            for name, slot, ivs in writes:
                hook = self.active[name]
                columns = hook.site.local_columns(hook.point)  # a sharded point's slice of the vectors
                scale, bias = compose(ivs, name, hook.point.width)
                upload(hook.scale[slot], scale[columns])
                upload(hook.bias[slot], bias[columns])
                if hook.clamps is not None:
                    hook.clamps.write_slot(slot, ivs)
            for name in self._slotted - slots.keys():
                if name in self.active:  # not removed since
                    self.active[name].row_slot.zero_()
            for name, rows in slots.items():
                upload(self.active[name].row_slot[:n], rows)  # each step of a steered batch: never a wait
        self._slotted = set(slots)
        self._logits_step = step

    def after_forward(self, step: StepInfo, input_ids: torch.Tensor | None) -> None:
        """Queue the copy of this forward's live rows to the host: one per stack of same-width hooks, and
        each attached SAE's strongest features of its hook's rows. With a ``row_sink``, the rows go to it
        instead, on the device."""
        if self.row_sink is not None:
            n = step.num_tokens
            self.row_sink(step.req_ids, step.query_start_loc, step.positions[:n],
                          [(stack.names, stack.tensor[:, :n]) for stack in self._stacks])
            return
        rows_wanted = not (self._no_capture and self._no_capture.issuperset(step.req_ids))
        if not rows_wanted and not self.saes:
            return  # nothing of it is wanted
        windowed = rows_wanted and self._windows.applies(step)
        n = step.num_tokens
        whole = rows_wanted and not windowed
        tensors = [stack.tensor[:, :n] for stack in self._stacks] if whole else []
        arenas = [stack.arena for stack in self._stacks] if whole else []
        names = [list(stack.names) for stack in self._stacks] if whole else []
        for name, sae in self.saes.items():  # encoded now, on the device: only the strongest features leave it
            tensors.append(sae.strongest(self.active[sae.attached.hook].buffer[:n]))
            arenas.append(None)
            names.append(SaeStack(name))
        if windowed:
            self._queue_windowed(step, input_ids)
        if not tensors:
            return
        self._in_flight.send(QueuedForward(step.req_ids, step.query_start_loc, step.positions, names, []),
                    tensors, arenas, input_ids, slice(0, n))

    def _queue_windowed(self, step: StepInfo, input_ids: torch.Tensor | None) -> None:
        """Rows of a step where some request has a capture window: hooks keeping the same rows are grouped,
        and each group's rows are sent as a forward of their own (a range of them staged like a whole
        step's, scattered ones gathered on the device), so rows outside the windows never leave it.
        This runs between a prefill's launch and its end, where the host sets the pace: it stays lean."""
        bounds = step.query_start_loc
        spans = [(rid, slice(a, b)) for rid, a, b in zip(step.req_ids, bounds[:-1], bounds[1:]) if b > a]
        self._windows.note_forward(step, spans)
        with torch.inference_mode():
            for keep, members in self._windows.row_groups(step, spans, self._slot_index, self._no_capture):
                kept = np.flatnonzero(keep)
                if not len(kept):
                    continue
                in_range = kept[-1] - kept[0] + 1 == len(kept)
                rows = slice(int(kept[0]), int(kept[-1]) + 1) if in_range else to_device(kept, self.device)
                tensors, arenas, names = [], [], []
                for s, hooks in members.items():
                    stack = self._stacks[s]
                    all_hooks = len(hooks) == len(stack.names) - stack.names.count(None)
                    if all_hooks:
                        tensors.append(stack.tensor[:, rows] if in_range else stack.tensor.index_select(1, rows))
                        names.append(list(stack.names))
                    else:
                        some = to_device(np.array(hooks, dtype=np.int64), self.device)
                        tensors.append(stack.tensor[:, rows].index_select(0, some) if in_range
                                       else stack.tensor[some[:, None], rows[None, :]])  # one gather
                        names.append([stack.names[h] for h in hooks])
                    arenas.append(stack.arena if all_hooks and in_range else None)  # a gather is a tensor of its own
                starts = np.concatenate([[0], np.cumsum(keep)])[bounds]  # each request's kept rows
                self._in_flight.send(QueuedForward(step.req_ids, starts, step.positions[kept], names, []),
                            tensors, arenas, input_ids, rows)

    def on_logits(self, logits: torch.Tensor | None) -> None:
        """The model's logits of a forward, one row per request (its last row): keep the logprobs of
        the tokens each scored request asked for. Other calls (a dummy run, prompt logprobs) find no
        forward waiting, or rows that are not one per request, and are left alone."""
        step, self._logits_step = self._logits_step, None
        if step is not None and logits is not None:
            self._scores.read(step, logits)

    # --- driver-facing operations (through the worker extension) ---

    def set_request_options(self, options: dict[str, dict], forget: list[str]) -> None:
        """Per request, each option only where given: ``capture`` (False: no rows are kept),
        ``score_token_ids`` (their logprobs at every forward's last row of the request), and ``windows``
        (installed hook name -> capture window text; hooks not named keep every row) with
        ``prompt_tokens``, the prompt's length they count from. ``forget``: requests that are over."""
        for rid in forget:
            self._no_capture.discard(rid)
            self._scores.forget(rid)
            self._windows.forget(rid)
        for rid, option in options.items():
            if "capture" in option:
                (self._no_capture.discard if option["capture"] else self._no_capture.add)(rid)
            if "score_token_ids" in option:
                self._scores.set(rid, option["score_token_ids"])
            if "windows" in option:  # a hook removed since (eager mode) is never looked up
                self._windows.set(rid, option["windows"], int(option["prompt_tokens"]))

    def set_interventions(self, interventions: list[Intervention]) -> None:
        """The driver's interventions (the app's, a session's); the requests' own edits stay."""
        interventions = self._held(interventions)
        self._check(interventions)
        check_clamp_capacity([*interventions, *self._edit_list()], self.config.feature_clamps)
        self._driver_interventions = list(interventions)
        self._apply_interventions()

    def set_request_edits(self, added: dict[str, list[Intervention]], finished: set[str]) -> None:
        """Edits that requests carry (``request_edits``): ``added`` start with their requests, those of
        ``finished`` requests end. The server checked them; one that still fails here is logged and its
        request runs unedited, since an exception in a step would stop the engine for every request."""
        changed = bool(finished & self._request_edits.keys())
        for rid in finished:
            self._request_edits.pop(rid, None)
        for rid, edits in added.items():
            edits = self._held(edits)
            if not edits:
                continue
            try:
                self._check(edits)
                check_clamp_capacity([*self._driver_interventions, *self._edit_list(), *edits],
                                     self.config.feature_clamps)
            except ValueError as e:
                logger.error("request %s runs without its edit: %s", rid, e)
                continue
            self._request_edits[rid] = edits
            changed = True
        if changed:
            self._apply_interventions()

    def _held(self, interventions: list[Intervention]) -> list[Intervention]:
        """Of edits the driver checked against every stage's hooks, this pipeline stage's (all of them
        without pipeline parallelism, where an unknown hook is an error)."""
        return [iv for iv in interventions if iv.hook in self.active] if self.elsewhere else list(interventions)

    def _edit_list(self) -> list[Intervention]:
        return [iv for edits in self._request_edits.values() for iv in edits]

    def _check(self, interventions: list[Intervention]) -> None:
        widths = {name: hook.point.width for name, hook in self.active.items()}
        for iv in interventions:
            validate(iv, widths, self.max_model_len, self.config.enable_position_interventions, self.config.dtype)
            if self.active[iv.hook].point.unsteerable:
                raise ValueError(f"{self.active[iv.hook].point.alias} cannot be steered: "
                                 f"{self.active[iv.hook].point.unsteerable}")
            if iv.clamp is not None and self.active[iv.hook].site.shards > 1:
                raise ValueError(f"a feature clamp on {self.active[iv.hook].point.alias}, which is split over the "
                                 "tensor-parallel ranks; clamp features of a replicated point")

    def _apply_interventions(self) -> None:
        """The planner's new set. Slots keep what they hold (the planner rewrites a slot before a row
        uses it), except at hooks whose clamped features change: their clamp tables start over."""
        interventions = [*self._driver_interventions, *self._edit_list()]
        clamps_at: dict[str, list] = {}
        for iv in interventions:
            if iv.clamp is not None:
                clamps_at.setdefault(iv.hook, []).append(iv.clamp)
        with torch.inference_mode():
            for name, hook in self.active.items():
                if hook.clamps is None:
                    continue
                clamps = clamps_at.get(name, [])
                if list(dict.fromkeys(c.direction for c in clamps)) != list(hook.clamps.directions):
                    hook.clamps.set_directions(clamps)
                    self.planner.forget([name])
        self.planner.set(interventions)
        self._clamped = {self.active[hook].point.name for hook in clamps_at}
        self._has_interventions = bool(interventions)

    def drain(self, wait: bool | Collection[str] = True) -> dict[str, DrainedRequest]:
        """Captures since the last drain, by request: its rows by hook, its SAE features and its scores.

        ``wait=False`` never waits for the GPU: steps whose copies are still in flight stay for the
        next drain (rows still arrive in step order); request ids: waits for those requests' rows.
        Where tensor-parallel ranks each hold a slice of a hook's columns, every drain waits for all:
        the ranks must send the same rows."""
        if any(hook.site.shards > 1 for hook in self.active.values()):
            wait = True
        return drained_requests(self._in_flight.take(wait), self._scores.take(), self._no_capture)

    def queued_positions(self, request_ids: list[str]) -> dict[str, int]:
        """Per request, the position after the last row of a forward already queued but not drained:
        where an intervention set now starts to apply (a later forward)."""
        wanted = set(request_ids)
        nxt = self._in_flight.positions_after(wanted)
        for rid in wanted & self._windows.ran_to.keys():  # a window may have kept none of a forward's rows
            nxt[rid] = max(nxt.get(rid, 0), self._windows.ran_to[rid])
        return nxt

    def describe(self) -> dict:
        return {
            "mode": "eager" if self.config.eager else "compiled",
            "family": self.family,
            "dtype": self.config.dtype,
            "max_tokens": self.max_tokens,
            "max_model_len": self.max_model_len,
            "max_slots": self.config.max_slots,
            "feature_clamps": self.config.feature_clamps,
            "allocated_bytes": self.allocated_bytes(),
            "enable_position_interventions": self.config.enable_position_interventions,
            "modules": [(path, type(m).__name__) for path, m in self.model.named_modules()
                        if not self.held_elsewhere(path)],  # not another pipeline stage's placeholders
            "hook_points": [p.as_dict() for p in self.catalogue.values()],
            "refused": dict(self.refused),
            "probe_seconds": self.probe_seconds,
            "installed": {name: hook.point.name for name, hook in self.active.items()},
        }
