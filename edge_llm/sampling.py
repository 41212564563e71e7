"""Token sampling: greedy, temperature, top-k, top-p, reproducible with a seed; the defaults a
request gets for what it omits.

Defaults (as vLLM does): a request that omits temperature / top_p / top_k gets the model's own
recommended values from its `generation_config.json` (written from GGUF metadata on import),
else OpenAI's (temperature 1, top_p 1, no top_k). HF semantics: `do_sample: false` recommends
greedy decoding. See docs/api.md.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 => greedy
    top_k: int = 0  # 0 => off
    top_p: float = 1.0  # 1 => off
    seed: int | None = None

    def __post_init__(self) -> None:
        if not (self.temperature >= 0 and np.isfinite(self.temperature)):
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.seed is not None and not 0 <= self.seed < 2**64:
            raise ValueError(f"seed must be in [0, 2**64), got {self.seed}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1


class Sampler:
    """Picks the next token from a logits vector. One instance per request (owns the RNG)."""

    def __init__(self, params: SamplingParams):
        self.params = params
        self.rng = np.random.default_rng(params.seed)

    def __call__(self, logits: np.ndarray) -> int:
        p = self.params
        if p.greedy:
            return int(np.argmax(logits))
        with np.errstate(over="ignore"):
            x = logits.astype(np.float64) / p.temperature
        if not np.isfinite(x.max()):  # a temperature so small that it overflows: the limit is greedy
            return int(np.argmax(logits))
        if 0 < p.top_k < x.size:
            kth = np.partition(x, -p.top_k)[-p.top_k]
            x = np.where(x < kth, -np.inf, x)
        x -= x.max()
        probs = np.exp(x)
        probs /= probs.sum()
        if p.top_p < 1.0:
            order = np.argsort(-probs, kind="stable")
            cum = np.cumsum(probs[order])
            # keep the smallest prefix whose mass reaches top_p (always at least one token)
            keep = order[: int(np.searchsorted(cum, p.top_p) + 1)]
            mask = np.zeros_like(probs, dtype=bool)
            mask[keep] = True
            probs = np.where(mask, probs, 0.0)
            probs /= probs.sum()
        return int(self.rng.choice(probs.size, p=probs))


@dataclass(frozen=True)
class SamplingDefaults:
    """What a request gets for omitted sampling fields, and where the values come from."""

    temperature: float = 1.0  # OpenAI's defaults
    top_p: float = 1.0
    top_k: int = 0
    source: str = "openai"

    def params(self, temperature: float | None = None, top_p: float | None = None, top_k: int | None = None,
               seed: int | None = None) -> SamplingParams:
        """Request values where given, these defaults for the rest."""
        return SamplingParams(self.temperature if temperature is None else temperature,
                              self.top_k if top_k is None else top_k,
                              self.top_p if top_p is None else top_p, seed)

    def to_dict(self) -> dict:
        return asdict(self)


OPENAI_DEFAULTS = SamplingDefaults()


def model_sampling_defaults(model_dir: str | Path) -> SamplingDefaults:
    """The model's recommended sampling from `generation_config.json`, else OpenAI's."""
    path = Path(model_dir) / "generation_config.json"
    try:
        cfg = json.loads(path.read_text())
    except FileNotFoundError:
        return OPENAI_DEFAULTS
    except (OSError, ValueError) as e:
        log.warning("%s unreadable (%s): OpenAI's sampling defaults apply", path, e)
        return OPENAI_DEFAULTS
    if not isinstance(cfg, dict):
        return OPENAI_DEFAULTS
    if cfg.get("do_sample") is False:
        return SamplingDefaults(0.0, 1.0, 0, "generation_config.json (do_sample: false = greedy)")
    keys = [k for k in ("temperature", "top_p", "top_k") if isinstance(cfg.get(k), (int, float))
            and not isinstance(cfg.get(k), bool)]
    if not keys:
        return OPENAI_DEFAULTS
    try:
        d = SamplingDefaults(float(cfg.get("temperature", 1.0)), float(cfg.get("top_p", 1.0)),
                             int(cfg.get("top_k", 0)), "generation_config.json")
        d.params()  # validate the ranges
    except ValueError as e:
        log.warning("%s: sampling values out of range (%s): OpenAI's defaults apply", path, e)
        return OPENAI_DEFAULTS
    return d
