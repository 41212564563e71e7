"""Model configuration: `ModelArgs` from an HF config.json, and derived sizes in `Geometry`.

Supported `model_type`s: qwen3_vl (its `text_config`), qwen3, qwen2, llama. Field names follow
HF config.json. Both rope spellings are accepted: `rope_theta` + `rope_scaling` (published
checkpoints) and `rope_parameters` (transformers 5).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from edge_llm.errors import ConfigError
from edge_llm.files import read_regular

SUPPORTED_MODEL_TYPES = ("qwen3_vl", "qwen3", "qwen2", "llama")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
F32_BYTES = 4


@dataclass(frozen=True)
class ModelArgs:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_type: str = "default"
    # rope scaling parameters for linear / llama3 (factor, low/high_freq_factor, original max pos)
    rope_params: tuple[tuple[str, float], ...] = ()
    mrope_section: tuple[int, ...] = ()  # qwen3_vl: (t, h, w) frequency counts, sum == head_dim/2
    mrope_interleaved: bool = False
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # qwen2: q/k/v projections carry a bias
    qk_norm: bool = False  # qwen3*: per-head RMSNorm on q and k
    max_position_embeddings: int = 8192
    bos_token_id: int | None = None
    eos_token_id: tuple[int, ...] = ()
    weight_prefix: str = "model."  # "model.language_model." for qwen3_vl
    lm_head_name: str = "lm_head.weight"

    # ---- construction -------------------------------------------------------------
    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> "ModelArgs":
        """Build from a parsed config.json; unknown keys are ignored, bad ones raise ConfigError."""
        if not isinstance(cfg, dict):
            raise ConfigError("config.json: top level must be a JSON object")
        model_type = cfg.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(
                f"config.json: model_type {model_type!r} is not supported "
                f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
            )
        top = cfg
        if model_type == "qwen3_vl":
            text = cfg.get("text_config")
            if not isinstance(text, dict):
                raise ConfigError("config.json: text_config missing for model_type 'qwen3_vl'")
            # published Qwen3-VL keeps tie_word_embeddings at the top level
            text = {**text}
            if "tie_word_embeddings" not in text and "tie_word_embeddings" in top:
                text["tie_word_embeddings"] = top["tie_word_embeddings"]
            cfg = text

        def req(key: str, typ=int):
            if key not in cfg:
                raise ConfigError(f"config.json: required key {key!r} missing")
            val = cfg[key]
            if typ is int and (isinstance(val, bool) or not isinstance(val, int)):
                raise ConfigError(f"config.json: {key!r} must be an integer, got {val!r}")
            if typ is float and (isinstance(val, bool) or not isinstance(val, (int, float))):
                raise ConfigError(f"config.json: {key!r} must be a number, got {val!r}")
            return typ(val)

        hidden = req("hidden_size")
        n_heads = req("num_attention_heads")
        n_kv = cfg.get("num_key_value_heads", n_heads)
        if isinstance(n_kv, bool) or not isinstance(n_kv, int):
            raise ConfigError(f"config.json: 'num_key_value_heads' must be an integer, got {n_kv!r}")
        head_dim = cfg.get("head_dim")
        if head_dim is None:  # llama / qwen2 omit it; HF derives it the same way
            if n_heads <= 0 or hidden % n_heads:
                raise ConfigError("config.json: 'head_dim' missing and hidden_size % num_attention_heads != 0")
            head_dim = hidden // n_heads
        if isinstance(head_dim, bool) or not isinstance(head_dim, int):
            raise ConfigError(f"config.json: 'head_dim' must be an integer, got {head_dim!r}")

        rope = _rope_fields(cfg)
        eos = cfg.get("eos_token_id", top.get("eos_token_id"))
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if isinstance(eos, int) else ())
        bos = cfg.get("bos_token_id", top.get("bos_token_id"))
        args = cls(
            model_type=model_type,
            vocab_size=req("vocab_size"),
            hidden_size=hidden,
            intermediate_size=req("intermediate_size"),
            num_hidden_layers=req("num_hidden_layers"),
            num_attention_heads=n_heads,
            num_key_value_heads=n_kv,
            head_dim=head_dim,
            rms_norm_eps=req("rms_norm_eps", float),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", model_type == "qwen2")),
            qk_norm=model_type in ("qwen3", "qwen3_vl"),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 8192)),
            bos_token_id=bos if isinstance(bos, int) else None,
            eos_token_id=eos_ids,
            weight_prefix="model.language_model." if model_type == "qwen3_vl" else "model.",
            **rope,
        )
        args.validate()
        return args

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "ModelArgs":
        path = Path(model_dir) / "config.json"
        try:  # a FIFO or device is refused unread (files.open_regular)
            cfg = json.loads(read_regular(path, ConfigError))
        except FileNotFoundError:
            raise ConfigError(f"{path}: not found (is this an HF model directory?)") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ConfigError(f"{path}: invalid JSON: {e}") from None
        except OSError as e:
            raise ConfigError(f"{path}: {e.strerror or e}") from None
        return cls.from_dict(cfg)

    def validate(self) -> None:
        for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                    "num_attention_heads", "num_key_value_heads", "head_dim"):
            if getattr(self, key) <= 0:
                raise ConfigError(f"config.json: {key!r} must be > 0, got {getattr(self, key)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"config.json: 'num_attention_heads' ({self.num_attention_heads}) is not a multiple "
                f"of 'num_key_value_heads' ({self.num_key_value_heads})"
            )
        if self.head_dim % 2:
            raise ConfigError(f"config.json: 'head_dim' must be even for RoPE, got {self.head_dim}")
        if not (self.rms_norm_eps > 0 and math.isfinite(self.rms_norm_eps)):
            raise ConfigError("config.json: 'rms_norm_eps' must be a positive number")
        if not (self.rope_theta > 0 and math.isfinite(self.rope_theta)):
            raise ConfigError("config.json: 'rope_theta' must be a positive number")
        if self.model_type == "qwen3_vl":
            if len(self.mrope_section) != 3 or sum(self.mrope_section) != self.head_dim // 2:
                raise ConfigError(
                    f"config.json: 'mrope_section' {list(self.mrope_section)} must have 3 entries "
                    f"summing to head_dim/2 = {self.head_dim // 2}"
                )

    # ---- derived --------------------------------------------------------------------
    @property
    def kv_dim(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @property
    def q_dim(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def geometry(self) -> "Geometry":
        return Geometry(self.num_hidden_layers, self.num_key_value_heads, self.head_dim)

    def rope_param(self, key: str, default: float | None = None) -> float | None:
        return dict(self.rope_params).get(key, default)

    def identity_fields(self) -> dict[str, Any]:
        """Every config field that determines KV values (docs/identity.md)."""
        d = asdict(self)
        d.pop("bos_token_id", None)
        d.pop("eos_token_id", None)
        d.pop("max_position_embeddings", None)
        return d


@dataclass(frozen=True)
class Geometry:
    """KV geometry: what a snapshot must match to be restored into a cache."""

    n_layers: int
    n_kv_heads: int
    head_dim: int

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V, all layers, F32."""
        return 2 * self.n_layers * self.kv_dim * F32_BYTES


def _rope_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """Normalise `rope_theta`/`rope_scaling` and `rope_parameters` into ModelArgs fields."""
    params = cfg.get("rope_parameters")
    scaling = cfg.get("rope_scaling")
    if params is not None and not isinstance(params, dict):
        raise ConfigError("config.json: 'rope_parameters' must be an object")
    if scaling is not None and not isinstance(scaling, dict):
        raise ConfigError("config.json: 'rope_scaling' must be an object or null")
    merged: dict[str, Any] = {**(scaling or {}), **(params or {})}
    theta = merged.get("rope_theta", cfg.get("rope_theta", 10000.0))
    if isinstance(theta, bool) or not isinstance(theta, (int, float)):
        raise ConfigError(f"config.json: 'rope_theta' must be a number, got {theta!r}")
    rope_type = merged.get("rope_type", merged.get("type", "default")) or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ConfigError(
            f"config.json: rope type {rope_type!r} is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
        )
    section = merged.get("mrope_section") or ()
    if not isinstance(section, (list, tuple)) or not all(isinstance(s, int) for s in section):
        raise ConfigError(f"config.json: 'mrope_section' must be a list of integers, got {section!r}")
    numeric = tuple(
        sorted(
            (k, float(v))
            for k, v in merged.items()
            if k in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
            and isinstance(v, (int, float))
        )
    )
    if rope_type in ("linear", "llama3") and "factor" not in dict(numeric):
        raise ConfigError(f"config.json: rope type {rope_type!r} needs 'factor'")
    return dict(
        rope_theta=float(theta),
        rope_type=rope_type,
        rope_params=numeric,
        mrope_section=tuple(section),
        mrope_interleaved=bool(merged.get("mrope_interleaved", False)),
    )


# ---- vision tower (qwen3_vl) -------------------------------------------------------------------
@dataclass(frozen=True)
class VisionArgs:
    """The Qwen3-VL vision tower's `vision_config` plus the image token ids of the top-level config."""

    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    out_hidden_size: int
    patch_size: int = 16
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    in_channels: int = 3
    num_position_embeddings: int = 2304
    deepstack_visual_indexes: tuple[int, ...] = ()
    hidden_act: str = "gelu_pytorch_tanh"
    rope_theta: float = 10000.0  # the vision tower's 2-D ("axial") rotary base
    image_token_id: int = 151655
    vision_start_token_id: int = 151652
    vision_end_token_id: int = 151653
    weight_prefix: str = "model.visual."

    @classmethod
    def from_config(cls, cfg: dict[str, Any]) -> "VisionArgs | None":
        """From a parsed qwen3_vl config.json; None if it declares no vision tower."""
        vc = cfg.get("vision_config") if isinstance(cfg, dict) else None
        if cfg.get("model_type") != "qwen3_vl" or not isinstance(vc, dict):
            return None

        def num(key: str, default: Any = None, src: dict = vc) -> Any:
            val = src.get(key, default)
            if val is None or isinstance(val, bool) or not isinstance(val, (int, float)):
                raise ConfigError(f"config.json: vision_config {key!r} must be a number, got {val!r}")
            return val

        rope = vc.get("rope_parameters") if isinstance(vc.get("rope_parameters"), dict) else {}
        ds = vc.get("deepstack_visual_indexes", [])
        if not isinstance(ds, (list, tuple)) or not all(isinstance(i, int) for i in ds):
            raise ConfigError(f"config.json: vision_config 'deepstack_visual_indexes' must be a list "
                              f"of integers, got {ds!r}")
        act = vc.get("hidden_act", "gelu_pytorch_tanh")
        if act not in VISION_ACTIVATIONS:
            raise ConfigError(f"config.json: vision_config hidden_act {act!r} is not supported "
                              f"(supported: {', '.join(VISION_ACTIVATIONS)})")
        args = cls(
            depth=int(num("depth")), hidden_size=int(num("hidden_size")),
            intermediate_size=int(num("intermediate_size")), num_heads=int(num("num_heads")),
            out_hidden_size=int(num("out_hidden_size")), patch_size=int(num("patch_size", 16)),
            temporal_patch_size=int(num("temporal_patch_size", 2)),
            spatial_merge_size=int(num("spatial_merge_size", 2)), in_channels=int(num("in_channels", 3)),
            num_position_embeddings=int(num("num_position_embeddings", 2304)),
            deepstack_visual_indexes=tuple(ds), hidden_act=act,
            rope_theta=float(num("rope_theta", 10000.0, rope)),
            image_token_id=int(num("image_token_id", 151655, cfg)),
            vision_start_token_id=int(num("vision_start_token_id", 151652, cfg)),
            vision_end_token_id=int(num("vision_end_token_id", 151653, cfg)),
        )
        args.validate()
        return args

    def validate(self) -> None:
        for key in ("depth", "hidden_size", "intermediate_size", "num_heads", "out_hidden_size",
                    "patch_size", "temporal_patch_size", "spatial_merge_size", "in_channels",
                    "num_position_embeddings"):
            if getattr(self, key) <= 0:
                raise ConfigError(f"config.json: vision_config {key!r} must be > 0, got {getattr(self, key)}")
        if self.hidden_size % self.num_heads or (self.hidden_size // self.num_heads) % 4:
            raise ConfigError("config.json: vision_config hidden_size / num_heads must be a multiple of 4 "
                              "(2-D rotary embedding)")
        side = math.isqrt(self.num_position_embeddings)
        if side * side != self.num_position_embeddings:
            raise ConfigError("config.json: vision_config 'num_position_embeddings' must be a square")
        if any(not 0 <= i < self.depth for i in self.deepstack_visual_indexes):
            raise ConfigError(f"config.json: vision_config 'deepstack_visual_indexes' "
                              f"{list(self.deepstack_visual_indexes)} must lie in [0, depth={self.depth})")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        """Values in one flattened patch: channels x temporal x patch x patch."""
        return self.in_channels * self.temporal_patch_size * self.patch_size * self.patch_size

    @property
    def merged_dim(self) -> int:
        """Width of a 2x2 (merge x merge) group of patch features before the merger MLP."""
        return self.hidden_size * self.spatial_merge_size ** 2

    @property
    def pos_side(self) -> int:
        """Side of the square learned position-embedding grid."""
        return math.isqrt(self.num_position_embeddings)


VISION_ACTIVATIONS = ("gelu_pytorch_tanh", "gelu")


def vision_args_from_dir(model_dir: str | Path) -> VisionArgs | None:
    """VisionArgs of an HF model directory's config.json (None: no vision tower declared)."""
    path = Path(model_dir) / "config.json"
    try:
        cfg = json.loads(read_regular(path, ConfigError))
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path}: {e}") from None
    return VisionArgs.from_config(cfg)
