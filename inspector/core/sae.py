"""Sparse autoencoders in SAELens's on-disk format, read and checked without torch.

A directory holds ``cfg.json`` and ``sae_weights.safetensors`` (``W_enc [d_in, d_sae]``, ``b_enc``,
``W_dec [d_sae, d_in]``, ``b_dec``, and for JumpReLU ``threshold``, or ``log_threshold`` in older
files). Three architectures encode, as SAELens's inference SAEs do: ``standard`` (ReLU), ``topk`` (the
k largest pre-activations, ReLU'd) and ``jumprelu`` (ReLU where the pre-activation is above the
feature's threshold). The input is first normalised (``normalize_activations``) and, with
``apply_b_dec_to_input``, has ``b_dec`` taken off. ``encode`` here is the reference the engine's
device encoder is checked against; the engine sends only each token's strongest features to the host.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .interventions import FeatureClamp, Intervention

CONFIG_FILE, WEIGHTS_FILE = "cfg.json", "sae_weights.safetensors"
ARCHITECTURES = ("standard", "topk", "jumprelu")
# "expected_average_only_in" is folded into the weights by whoever saved them (SAELens's inference
# SAE applies nothing for it either)
NORMALIZATIONS = ("none", "expected_average_only_in", "constant_norm_rescale", "layer_norm")
MAX_FEATURES = 1 << 24  # feature ids travel as float32 beside their activations: exact up to 2^24


class SaeError(ValueError):
    """A directory that is not an SAE this can use; the message names the file and the field."""


@dataclass(frozen=True)
class SaeConfig:
    """What encoding with an SAE needs, as its directory says; ``hook`` is TransformerLens's name of the
    activation it reads (this project's hook aliases), "" when the file names none."""

    path: str
    architecture: str
    d_in: int
    d_sae: int
    hook: str = ""
    k: int = 0  # topk only: features active per token
    apply_b_dec_to_input: bool = True
    normalize_activations: str = "none"

    @property
    def name(self) -> str:
        return Path(self.path).name

    def as_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


def read_sae(path) -> SaeConfig:
    """The SAE in directory ``path``, its config checked against its weights' shapes (their data is
    not read); SaeError naming the file and field for anything that does not fit."""
    directory = Path(path).expanduser()
    config_file, weights_file = directory / CONFIG_FILE, directory / WEIGHTS_FILE
    for file in (config_file, weights_file):
        if not file.is_file():
            raise SaeError(f"{directory}: no {file.name} (an SAE directory in SAELens's format holds "
                           f"{CONFIG_FILE} and {WEIGHTS_FILE})")
    try:
        cfg = json.loads(config_file.read_text())
    except (OSError, ValueError) as e:
        raise SaeError(f"{config_file}: not readable JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise SaeError(f"{config_file}: a JSON object expected")
    config = SaeConfig(str(directory.resolve()), *_architecture(cfg, config_file), _hook_name(cfg),
                       _k(cfg, config_file), bool(cfg.get("apply_b_dec_to_input", True)),
                       str(cfg.get("normalize_activations") or "none"))
    if config.normalize_activations not in NORMALIZATIONS:
        raise SaeError(f"{config_file}: normalize_activations {config.normalize_activations!r} is not one of "
                       f"{', '.join(NORMALIZATIONS)}")
    if not 0 < config.d_sae <= MAX_FEATURES:
        raise SaeError(f"{config_file}: d_sae {config.d_sae} is outside 1..{MAX_FEATURES}")
    if config.architecture == "topk" and not 0 < config.k <= config.d_sae:
        raise SaeError(f"{config_file}: k {config.k} is outside 1..d_sae ({config.d_sae})")
    _check_shapes(config, weights_file)
    return config


def load_weights(config: SaeConfig) -> dict[str, np.ndarray]:
    """W_enc, b_enc, W_dec, b_dec and (JumpReLU) threshold, float32."""
    from safetensors.numpy import load_file

    tensors = load_file(str(Path(config.path) / WEIGHTS_FILE))
    weights = {name: tensors[name].astype(np.float32) for name in ("W_enc", "b_enc", "W_dec", "b_dec")}
    if config.architecture == "jumprelu":
        weights["threshold"] = (tensors["threshold"].astype(np.float32) if "threshold" in tensors
                                else np.exp(tensors["log_threshold"].astype(np.float32)))
    return weights


def decoder_row(config: SaeConfig, feature: int) -> np.ndarray:
    """``W_dec[feature]`` (float64), read alone from the file: the direction that feature writes."""
    from safetensors import safe_open

    if not 0 <= feature < config.d_sae:
        raise ValueError(f"{config.name}: feature {feature} is outside 0..{config.d_sae - 1}")
    with safe_open(str(Path(config.path) / WEIGHTS_FILE), framework="np") as f:
        return np.asarray(f.get_slice("W_dec")[feature:feature + 1], np.float64)[0]


def clamp_refusal(config: SaeConfig) -> str:
    """Why no feature of this SAE can be clamped ("" when they can): the rule ``feature_clamp`` applies,
    for a button to say before it is pressed."""
    if config.architecture == "topk":
        return ("a top-k SAE's feature cannot be clamped (whether it is active depends on all the others); "
                "steer it by strength instead")
    if config.normalize_activations not in ("none", "expected_average_only_in"):
        return (f"its inputs are normalised ({config.normalize_activations}), so a feature is not one direction "
                "and cannot be clamped; steer it by strength instead")
    return ""


def feature_clamp(config: SaeConfig, feature: int, value: float) -> FeatureClamp:
    """What clamping ``feature`` to ``value`` needs, read alone from the file: its encoder column, bias
    (with ``b_dec`` folded in), threshold and decoder row. A top-k feature's activation depends on every
    other feature's, and a normalised SAE's on the row's norm: neither is a single direction, so both
    are refused (steer those by strength)."""
    from safetensors import safe_open

    refusal = clamp_refusal(config)
    if refusal:
        raise ValueError(f"{config.name}: {refusal}")
    decoder = decoder_row(config, feature)  # checks the feature's range
    with safe_open(str(Path(config.path) / WEIGHTS_FILE), framework="np") as f:
        def read(name, *index):
            return np.asarray(f.get_slice(name)[index], np.float64) if name in f.keys() else None

        encoder = read("W_enc", slice(None), slice(feature, feature + 1))[:, 0]
        offset = float(read("b_enc", slice(feature, feature + 1))[0])
        if config.apply_b_dec_to_input:
            offset -= float(read("b_dec", slice(None)) @ encoder)
        floor = 0.0
        if config.architecture == "jumprelu":
            threshold = read("threshold", slice(feature, feature + 1))
            floor = max(float(threshold[0]) if threshold is not None
                        else float(np.exp(read("log_threshold", slice(feature, feature + 1))[0])), 0.0)
    return FeatureClamp(encoder, offset, floor, decoder, value, f"{config.name}/{feature}")


def encode(config: SaeConfig, weights: dict[str, np.ndarray], x) -> np.ndarray:
    """Feature activations [rows, d_sae] of activation rows ``x`` [rows, d_in] (float32 numpy)."""
    x = normalized(config, np.asarray(x, np.float32))
    if config.apply_b_dec_to_input:
        x = x - weights["b_dec"]
    pre = x @ weights["W_enc"] + weights["b_enc"]
    if config.architecture == "topk":
        keep = np.argpartition(-pre, config.k - 1, axis=1)[:, :config.k]
        out = np.zeros_like(pre)
        np.put_along_axis(out, keep, np.maximum(np.take_along_axis(pre, keep, axis=1), 0), axis=1)
        return out
    acts = np.maximum(pre, 0)
    return acts * (pre > weights["threshold"]) if config.architecture == "jumprelu" else acts


def normalized(config: SaeConfig, x: np.ndarray) -> np.ndarray:
    if config.normalize_activations == "constant_norm_rescale":
        return x * (np.sqrt(config.d_in) / np.linalg.norm(x, axis=1, keepdims=True))
    if config.normalize_activations == "layer_norm":
        centred = x - x.mean(axis=1, keepdims=True)
        return centred / (centred.std(axis=1, ddof=1, keepdims=True) + 1e-5)
    return x


def strongest(acts: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Per row, the ``k`` strongest active features: ids [rows, k] (int32, -1 where fewer are active)
    and activations [rows, k] (float32, 0 there), strongest first."""
    k = min(k, acts.shape[1])
    order = np.argsort(-acts, axis=1, kind="stable")[:, :k]
    values = np.take_along_axis(acts, order, axis=1).astype(np.float32)
    return np.where(values > 0, order, -1).astype(np.int32), np.where(values > 0, values, 0).astype(np.float32)


def _architecture(cfg: dict, file: Path) -> tuple[str, int, int]:
    """(architecture, d_in, d_sae); older files say a top-k SAE with activation_fn_str "topk"."""
    architecture = str(cfg.get("architecture", "standard"))
    if architecture == "standard" and cfg.get("activation_fn_str") == "topk":
        architecture = "topk"
    if architecture not in ARCHITECTURES:
        raise SaeError(f"{file}: architecture {architecture!r} is not one of {', '.join(ARCHITECTURES)}")
    for field in ("d_in", "d_sae"):
        if not isinstance(cfg.get(field), int):
            raise SaeError(f"{file}: {field} must be an integer, not {cfg.get(field)!r}")
    return architecture, cfg["d_in"], cfg["d_sae"]


def _k(cfg: dict, file: Path) -> int:
    k = cfg.get("k", (cfg.get("activation_fn_kwargs") or {}).get("k", 0))
    if not isinstance(k, int):
        raise SaeError(f"{file}: k must be an integer, not {k!r}")
    return k


def _hook_name(cfg: dict) -> str:
    for holder in (cfg.get("metadata"), cfg.get("meta"), cfg):
        if isinstance(holder, dict) and holder.get("hook_name"):
            return str(holder["hook_name"])
    return ""


def _check_shapes(config: SaeConfig, file: Path) -> None:
    from safetensors import safe_open

    try:
        with safe_open(str(file), framework="np") as f:
            shapes = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
    except Exception as e:  # noqa: BLE001 - any failure to parse means the file is not usable
        raise SaeError(f"{file}: not a readable safetensors file ({e})") from None
    expected = {"W_enc": (config.d_in, config.d_sae), "b_enc": (config.d_sae,), "W_dec": (config.d_sae, config.d_in),
                "b_dec": (config.d_in,)}
    if config.architecture == "jumprelu":
        expected["threshold" if "threshold" in shapes or "log_threshold" not in shapes else "log_threshold"] = (
            config.d_sae,)
    for name, shape in expected.items():
        if name not in shapes:
            raise SaeError(f"{file}: no tensor {name!r} (a {config.architecture} SAE needs "
                           f"{', '.join(expected)})")
        if shapes[name] != shape:
            raise SaeError(f"{file}: {name} is {list(shapes[name])}, but {CONFIG_FILE} says d_in {config.d_in} and "
                           f"d_sae {config.d_sae}, so it must be {list(shape)}")


@dataclass(frozen=True)
class AttachedSae:
    """An SAE encoding an installed hook's rows in the engine, each token's ``k`` strongest features
    sent to the host."""

    config: SaeConfig
    hook: str  # the installed hook's name
    k: int

    @property
    def name(self) -> str:
        return self.config.name

    def as_dict(self) -> dict:
        """As run metadata and capture files describe it."""
        return {"config": self.config.as_dict(), "hook": self.hook, "k": self.k}

    @classmethod
    def from_dict(cls, d: dict) -> "AttachedSae":
        return cls(SaeConfig(**d["config"]), str(d["hook"]), int(d["k"]))

    def steering(self, feature: int, strength: float, request_id: str | None = None,
                 positions: tuple[int, ...] | None = None) -> Intervention:
        """Feature steering: ``strength`` times the feature's decoder direction added to the hook's
        activation (an intervention like any other: per request, per position, no recompiling)."""
        return Intervention(self.hook, bias=float(strength) * decoder_row(self.config, feature),
                            request_id=request_id, positions=positions)

    def clamping(self, feature: int, value: float, request_id: str | None = None,
                 positions: tuple[int, ...] | None = None) -> Intervention:
        """Feature clamping: the feature's activation set to ``value`` in every row it applies to, the
        rest of the row kept (``FeatureClamp``); per request, per position, no recompiling."""
        return Intervention(self.hook, clamp=feature_clamp(self.config, feature, value), request_id=request_id,
                            positions=positions)


def checked_attachment(path, hook: str | None, k: int, installed: dict, attached: dict) -> AttachedSae:
    """What every session checks before attaching the SAE in ``path`` to ``hook`` (an installed hook's
    name or alias; default: the one the SAE's config names): SaeError or ValueError with the reason."""
    from .hooks import installed_name

    config = read_sae(path)
    if not hook and not config.hook:
        raise ValueError(f"{config.name}: its {CONFIG_FILE} names no hook; say which hook it reads")
    hook = installed_name(hook or config.hook, installed)
    if config.name in attached:
        raise ValueError(f"an SAE named {config.name!r} is attached already")
    if not 0 < k <= 1024:
        raise ValueError(f"k must be within 1..1024, got {k}")
    if config.d_in != installed[hook].width:
        raise ValueError(f"SAE {config.name} reads {config.d_in}-wide rows, but {installed[hook].alias} is "
                         f"{installed[hook].width} wide")
    return AttachedSae(config, hook, k)
