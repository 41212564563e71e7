"""Server settings: command-line flag > EDGE_LLM_* environment variable > TOML file > default.

Key names are the TOML keys of `board/edge-llm.toml.example` (flags use dashes, environment
variables are `EDGE_LLM_<KEY upper>`). `disk_kv` is a directory, or false/"off" to disable disk KV.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

from edge_llm.errors import ConfigError
from edge_llm.runtime import RuntimeOptions

log = logging.getLogger(__name__)

ENV_PREFIX = "EDGE_LLM_"
_OFF = {"", "0", "false", "no", "off", "none"}
_ON = {"1", "true", "yes", "on"}


@dataclass(frozen=True)
class Settings:
    model: str = "default"
    host: str = "127.0.0.1"
    port: int = 8080
    disk_kv: str | None = None  # resolved by `default_disk_kv()` when left unset
    disk_kv_min_lcp: int = 16
    disk_kv_max_files: int = 8
    disk_kv_max_bytes: int | None = None
    disk_kv_max_tokens: int = 8192
    kv_bs: int = 64
    max_seq: int = 8192
    queue_size: int = 16
    api_key_file: str | None = None
    log_file: str | None = None  # resolved by `default_log_file()` when left unset; "" = none
    backend: str = "cpu"
    grace_seconds: float = 30.0
    max_body_bytes: int = 4 * 1024 * 1024
    image_dir: str | None = None  # local image files allowed under this directory; None = data: URLs only
    max_image_bytes: int = 20 * 1024 * 1024
    max_image_pixels: int = 64 * 1024 * 1024  # width x height of an encoded image (decompression bombs)

    def runtime_options(self) -> RuntimeOptions:
        """The engine-loading subset of these settings."""
        return RuntimeOptions(
            model=self.model, backend=self.backend, max_seq=self.max_seq, kv_bs=self.kv_bs,
            disk_kv=self.disk_kv or None, disk_kv_min_lcp=self.disk_kv_min_lcp,
            disk_kv_max_files=self.disk_kv_max_files, disk_kv_max_bytes=self.disk_kv_max_bytes,
            disk_kv_max_tokens=self.disk_kv_max_tokens, max_image_bytes=self.max_image_bytes,
            max_image_pixels=self.max_image_pixels,
        )


_FIELDS = {f.name: f for f in fields(Settings)}
# keys whose value may be absent (None) after conversion
_OPTIONAL = {"disk_kv", "disk_kv_max_bytes", "api_key_file", "log_file", "image_dir"}
_POSITIVE = {"port", "disk_kv_min_lcp", "disk_kv_max_files", "disk_kv_max_bytes", "disk_kv_max_tokens",
             "kv_bs", "max_seq", "queue_size", "max_body_bytes", "max_image_bytes", "max_image_pixels"}


def edge_home(env: Mapping[str, str] | None = None) -> Path:
    """$EDGE_LLM_HOME, else ~/.cache/edge-llm (models, kv snapshots and logs live below)."""
    env = os.environ if env is None else env
    home = env.get("EDGE_LLM_HOME")
    return Path(home) if home else Path.home() / ".cache" / "edge-llm"


def _first_dir(value: str | None) -> Path | None:
    """systemd passes *_DIRECTORY as a colon-separated list; the first entry is ours."""
    if not value:
        return None
    first = value.split(":")[0]
    return Path(first) if first else None


def default_disk_kv(env: Mapping[str, str]) -> str:
    state = _first_dir(env.get("STATE_DIRECTORY"))
    return str((state if state else edge_home(env)) / "kv")


def default_log_file(env: Mapping[str, str]) -> str:
    logs = _first_dir(env.get("LOGS_DIRECTORY"))
    return str((logs if logs else edge_home(env) / "logs") / "edge-llm.log")


def _convert(key: str, value: Any, source: str) -> Any:
    """Coerce a raw value (TOML type or env string) to the field's type; ConfigError if bad."""
    if key == "disk_kv":
        if value is False or (isinstance(value, str) and value.strip().lower() in _OFF):
            return ""  # explicitly off (distinct from None = use the default directory)
        if value is True or (isinstance(value, str) and value.strip().lower() in _ON):
            return None  # explicitly on, default directory
        if isinstance(value, str):
            return value
        raise ConfigError(f"{source}: disk_kv must be a directory or false, got {value!r}")
    if key in _OPTIONAL and (value is None or (isinstance(value, str) and value.strip().lower() in ("none", ""))):
        return "" if key == "log_file" else None
    typ = {"model": str, "host": str, "api_key_file": str, "log_file": str, "backend": str,
           "grace_seconds": float, "image_dir": str}.get(key, int)
    try:
        if isinstance(value, bool) or (typ is str and not isinstance(value, str)):
            raise ValueError
        out = typ(value.strip()) if isinstance(value, str) else typ(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{source}: {key} must be {typ.__name__}, got {value!r}") from None
    if key in _POSITIVE and out <= 0:
        raise ConfigError(f"{source}: {key} must be > 0, got {out!r}")
    if key == "port" and out > 65535:
        raise ConfigError(f"{source}: port must be <= 65535, got {out}")
    if key == "grace_seconds" and out < 0:
        raise ConfigError(f"{source}: grace_seconds must be >= 0, got {out}")
    return out


def read_toml(path: str | Path) -> dict[str, Any]:
    """Parse a settings TOML file; unknown keys are an error (a typo must not pass silently)."""
    p = Path(path)
    try:
        data = tomllib.loads(p.read_text())
    except FileNotFoundError:
        raise ConfigError(f"config file {p}: not found") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"config file {p}: {e}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {p}: invalid TOML: {e}") from None
    unknown = sorted(set(data) - set(_FIELDS))
    if unknown:
        raise ConfigError(f"config file {p}: unknown key(s) {', '.join(unknown)} "
                          f"(known: {', '.join(_FIELDS)})")
    return {k: _convert(k, v, f"config file {p}") for k, v in data.items()}


def read_env(env: Mapping[str, str]) -> dict[str, Any]:
    """EDGE_LLM_<KEY> variables that name a setting (EDGE_LLM_HOME/CONFIG are not settings)."""
    out = {}
    for key in _FIELDS:
        name = ENV_PREFIX + key.upper()
        if name in env:
            out[key] = _convert(key, env[name], f"environment {name}")
    return out


def load_settings(flags: Mapping[str, Any] | None = None, config_file: str | Path | None = None,
                  env: Mapping[str, str] | None = None) -> Settings:
    """Merge the sources. `flags` holds only flags the user gave (None values are ignored)."""
    env = os.environ if env is None else env
    config_file = config_file or env.get(ENV_PREFIX + "CONFIG") or None
    merged: dict[str, Any] = {}
    if config_file:
        merged.update(read_toml(config_file))
    merged.update(read_env(env))
    for k, v in (flags or {}).items():
        if k not in _FIELDS:
            raise ConfigError(f"unknown setting {k!r}")
        if v is not None:
            merged[k] = _convert(k, v, f"--{k.replace('_', '-')}")
    s = replace(Settings(), **merged)
    if s.disk_kv is None:
        s = replace(s, disk_kv=default_disk_kv(env))
    if s.log_file is None:
        s = replace(s, log_file=default_log_file(env))
    if s.backend != "cpu":
        raise ConfigError(f"backend {s.backend!r} is not available (available: cpu)")
    return s
