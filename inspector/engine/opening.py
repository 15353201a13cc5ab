"""Opening a session's engine: the model resolved, vLLM booted with the plugin (each stage reported as
it goes), and what the workers describe read back as hook points. Every failure is a ``SessionError``
that says what went wrong and what to do; ``Session`` itself starts from an engine that runs."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Callable

from inspector.core.hooks import HookPoint, check_patterns
from inspector.core.models import model_config, resolve_model
from inspector.core.protocol import MODES, BootProgress, SessionError, SessionOptions
from inspector.core.ranks import merge_descriptions
from inspector.core.windows import windows_from_patterns
from inspector.plugin.config import PLUGIN_MISSING

from .boot import boot_llm, own_options_among, shutdown_llm


def open_engine(options: SessionOptions, report: Callable[[BootProgress], None]
                ) -> tuple[SessionOptions, object, Path, list[HookPoint], dict[str, HookPoint], str, dict[str, str]]:
    """(``options`` with the context the model allows, the ``LLM``, the model's path, and
    ``describe_engine``'s catalogue, installed points, block family and refused kinds) of an engine booted
    for ``options``, its hooks and windows checked."""
    if options.mode not in MODES:
        raise SessionError(f"engine mode must be one of {MODES}, got {options.mode!r}")
    report(BootProgress("resolving", f"resolving model {options.model}"))
    try:
        path = resolve_model(options.model)
    except ValueError as e:
        raise SessionError(str(e)) from None
    options = fitted_context(options, path, report)
    llm = boot_engine(options, path, report)
    try:
        catalogue, installed, family, refused = describe_engine(llm)
    except Exception as e:
        shutdown_llm(llm)
        if PLUGIN_MISSING in str(e):
            raise SessionError("the engine's worker processes started without the inspector's vLLM plugin: "
                               "spawned workers (tensor parallel) load it through the project's installed entry "
                               "point, so install the project into this Python environment (pip install -e . "
                               "in its checkout, as the README's set-up does) rather than putting it on "
                               "PYTHONPATH") from None
        raise
    try:
        check_patterns(options.hooks, catalogue)  # each pipeline stage matched only the points it holds
        windows_from_patterns(options.windows, installed)
    except ValueError as e:
        shutdown_llm(llm)
        raise SessionError(str(e)) from None
    report(BootProgress("ready", f"{path.name} ready ({options.mode}, {len(installed)} hooks)"))
    return options, llm, path, catalogue, installed, family, refused


POSITION_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "max_sequence_length",
                 "max_seq_length", "seq_len")  # where configs name their longest context (vLLM reads these)


def context_limit(path: Path) -> int | None:
    """The longest context the config of the model at ``path`` names, or None where it names none."""
    try:
        config = model_config(path)
    except (OSError, ValueError):
        return None
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    found = [int(text[k]) for k in POSITION_KEYS if isinstance(text.get(k), (int, float)) and text[k] > 0]
    return min(found) if found else None


def fitted_context(options: SessionOptions, path: Path, report: Callable[[BootProgress], None]) -> SessionOptions:
    """``options`` with a context no longer than the model's own (a default of 1024 tokens would stop
    a model of 512 from booting at all), saying so when it is shortened."""
    longest = context_limit(path)
    if longest is None or options.max_model_len <= longest:
        return options
    report(BootProgress("resolving", f"{path.name} reads at most {longest} tokens: the context is {longest}, "
                                     f"not {options.max_model_len}"))
    return replace(options, max_model_len=longest)


def boot_engine(options: SessionOptions, path, report: Callable[[BootProgress], None]):
    """vLLM booted on the model at ``path`` as ``options`` say, reporting loading (vLLM's start and
    the weights), probing (the hook points found) and compiling (or warming up)."""
    from inspector.plugin import worker_extension

    if (refused := own_options_among(options.engine_args)) is not None:
        raise SessionError(refused)

    def probing():
        report(BootProgress("probing", "weights loaded; a probe forward reads the model's blocks"))

    def compiling():
        report(BootProgress("compiling", "hooks installed; "
                            + ("compiling the model (the first boot of a model takes longest)"
                               if options.mode == "compiled" else "warming up")))

    report(BootProgress("loading", f"loading {path.name} ({options.dtype}, {options.mode})"))
    listeners = ((worker_extension.on_weights_loaded, probing), (worker_extension.on_hooks_installed, compiling))
    for listening, listener in listeners:
        listening.append(listener)
    try:
        return boot_llm(str(path), mode=options.mode, dtype=options.dtype, hook_patterns=tuple(options.hooks),
                        max_num_batched_tokens=options.max_num_batched_tokens, max_model_len=options.max_model_len,
                        enable_position_interventions=options.enable_position_interventions,
                        max_slots=options.max_slots, feature_clamps=options.feature_clamps,
                        kept_layers=options.kept_layers, **options.engine_args)
    except Exception as e:
        raise SessionError(f"could not start the engine on {path}: {_root_cause(e)}") from e
    finally:
        for listening, listener in listeners:
            listening.remove(listener)


def _root_cause(e: BaseException) -> str:
    while e.__cause__ is not None or (e.__context__ is not None and not e.__suppress_context__):
        e = e.__cause__ or e.__context__
    return f"{type(e).__name__}: {e}" if str(e).strip() else f"{type(e).__name__}{where_raised(e)}"


def where_raised(e: BaseException) -> str:
    """For an exception that says nothing (a bare ``assert`` in vLLM), where it was raised: `` at
    FILE:LINE (SOURCE)``; "" for one with a message."""
    if str(e).strip() or e.__traceback__ is None:
        return ""
    import traceback

    frame = traceback.extract_tb(e.__traceback__)[-1]
    return f" at {frame.filename.rpartition('site-packages/')[2]}:{frame.lineno} ({frame.line})"


def describe_engine(llm) -> tuple[list[HookPoint], dict[str, HookPoint], str, dict[str, str]]:
    """The catalogue, the installed points, the block family they follow and why kinds are missing."""
    info = merge_descriptions(llm.collective_rpc("inspector_describe"))
    catalogue = [HookPoint.from_dict(p) for p in info["hook_points"]]
    by_name = {h.name: h for h in catalogue}
    installed = {name: replace(by_name[point], name=name) for name, point in info["installed"].items()}
    return catalogue, installed, info["family"], dict(info.get("refused", {}))
