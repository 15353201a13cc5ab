"""The spec channel from the boot site to vLLM's worker processes.

An environment variable holding JSON: it is inherited by spawned workers (multiprocessing, tensor
parallel), which a module global would not be.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass

from inspector.core.interventions import DEFAULT_MAX_SLOTS
from inspector.core.request_edits import SERVED_SECTION

ENV_VAR = "INSPECTOR_PLUGIN_CONFIG"
DTYPES = ("float32", "float16", "bfloat16")
# A worker without our runtime says this; the driver turns it into advice (spawned workers load the
# plugin only through its installed entry point)
PLUGIN_MISSING = "this engine was booted without the inspector plugin configured"


@dataclass(frozen=True)
class PluginConfig:
    capture_specs: dict[str, tuple[str, int]]
    max_num_batched_tokens: int
    dtype: str
    enable_batching: bool = False
    enable_position_interventions: bool = False
    hook_patterns: tuple[str, ...] = ()  # names, aliases or globs, resolved in the worker
    max_slots: int = DEFAULT_MAX_SLOTS
    feature_clamps: int = 0  # per hook, features an intervention set may clamp (0: no clamp tables, no cost)
    kept_layers: int = 0  # >0: the model was booted with only its first blocks; the checkpoint's others are skipped
    capture_rows: bool = True  # False: only the rows of requests that ask (CAPTURE_KEY) leave the device (an OpenAI server)

    @property
    def eager(self) -> bool:
        """``enable_batching`` is the seed's name for the eager flavour (live hooks, Python per step)."""
        return self.enable_batching

    def to_env(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_env(cls) -> "PluginConfig | None":
        raw = os.environ.get(ENV_VAR)
        if not raw:
            return None
        data = json.loads(raw)
        data["capture_specs"] = {name: (path, int(width)) for name, (path, width) in data["capture_specs"].items()}
        data["hook_patterns"] = tuple(data["hook_patterns"])
        return cls(**data)


# the worker reads the first three; the rest are the API server's (its vectors and capture store)
SERVED_FIELDS = {"hooks": list, "max_slots": int, "feature_clamps": int, "vectors": list, "capture_dir": str,
                 "capture_store_mib": int}


def served_config(section: dict, dtype: str, max_num_batched_tokens: int, eager: bool) -> PluginConfig:
    """The config of an engine that ``vllm serve`` booted with ``--additional-config '{"inspector": {...}}'``:
    ``hooks`` (names, aliases or globs), ``max_slots`` and ``feature_clamps``; the flavour, dtype and
    sizes are vLLM's own. Its requests steer themselves (position edits allowed) and keep rows only when
    they ask."""
    if not isinstance(section, dict):
        raise ValueError(f"--additional-config's {SERVED_SECTION!r} must be a JSON object, got {section!r}")
    unknown = set(section) - SERVED_FIELDS.keys()
    if unknown:
        raise ValueError(f"--additional-config's {SERVED_SECTION!r}: unknown fields {sorted(unknown)} "
                         f"(known: {', '.join(SERVED_FIELDS)})")
    for name, kind in SERVED_FIELDS.items():
        if name in section and not isinstance(section[name], kind):
            raise ValueError(f"--additional-config's {SERVED_SECTION}.{name} must be a JSON {kind.__name__}")
    config = PluginConfig({}, max_num_batched_tokens, dtype, enable_batching=eager, enable_position_interventions=True,
                          hook_patterns=tuple(str(h) for h in section.get("hooks", [])),
                          max_slots=section.get("max_slots", DEFAULT_MAX_SLOTS),
                          feature_clamps=section.get("feature_clamps", 0), capture_rows=False)
    validate(config)
    return config


def validate(config: PluginConfig) -> None:
    """Checks that need no model; the worker checks paths and widths against the real modules."""
    if config.max_num_batched_tokens <= 0:
        raise ValueError(f"max_num_batched_tokens must be positive, got {config.max_num_batched_tokens}")
    if config.dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {config.dtype!r}")
    if not 2 <= config.max_slots <= 4096:
        raise ValueError(f"max_slots must be between 2 and 4096, got {config.max_slots}")
    if config.kept_layers < 0:
        raise ValueError(f"kept_layers must be 0 (every block) or more, got {config.kept_layers}")
    if not 0 <= config.feature_clamps <= 64:
        raise ValueError(f"feature_clamps must be between 0 and 64, got {config.feature_clamps}")
    for name, spec in config.capture_specs.items():
        if not isinstance(name, str) or not name:
            raise ValueError(f"hook names must be non-empty strings, got {name!r}")
        if len(spec) != 2 or not isinstance(spec[0], str) or int(spec[1]) <= 0:
            raise ValueError(f"capture spec for {name!r} must be (module path, positive width), got {spec!r}")
