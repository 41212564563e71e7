"""Every setting and its default, declared once; the home directory, resolved once.

`Settings` is the single declaration: each field carries its default, its help text, its type
and which commands expose it. The TOML keys of `board/edge-llm.toml.example`, the
`EDGE_LLM_<KEY>` environment variables and the `--flags` of `serve`, `generate` and `doctor`
(`edge_llm/cli/options.py`) are all generated from it. Precedence: flag > environment > TOML file
> default. Lower modules (KV cache, store, engine) take their defaults from `DEFAULTS`.

Optional paths have one meaning for "off": `None`. `disk_kv` and `log_file` default to `AUTO`,
which `load_settings`/`resolve` turn into a directory below systemd's `STATE_DIRECTORY` /
`LOGS_DIRECTORY` or below the home directory (`home_dir`). See docs/configuration.md.
"""

from __future__ import annotations

import ipaddress
import os
import re
import socket
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

from edge_llm.errors import ConfigError

ENV_PREFIX = "EDGE_LLM_"
HOME_ENV = "EDGE_LLM_HOME"
CONFIG_ENV = "EDGE_LLM_CONFIG"
AUTO = "auto"  # disk_kv / log_file: the default location (resolved by `resolve`)
BACKEND_NAMES = ("cpu", "cpu-q", "rknn", "auto")  # edge_llm/runtime.make_backend maps these to backends
QUANT_MODES = ("q4", "q4-int8")  # backend cpu-q; edge_llm/backends/cpuq/backend.MODES defines them
RKNN_RUNNERS = ("auto", "rknnlite", "sim", "onnxruntime", "host", "librknnrt")  # docs/npu.md
MM_RUNNERS = ("host", "librknnrt")  # the ones of an `edge-llm convert npu-mm` directory (docs/npu.md, "The matmul path")
# `edge-llm convert npu-mm`'s choices and defaults (convert/npu_mm.py; measured in docs/npu.md, "The matmul path")
MM_ROTATIONS = ("none", "hadamard")
MM_CLIPS = ("none", "mse")
# how cpu-q quantizes a weight without exact GGUF blocks (backends/cpuq/nbits_export.py)
CPUQ_REQUANTS = ("rtn", "gptq", "gptq-mse")
MM_ROTATION, MM_DOWN_ROTATION, MM_CLIP, MM_GPTQ_TOKENS = "hadamard", "hadamard", "mse", 2048
MM_VO_ROTATION = "hadamard"
LIBRKNNRT_ENV = "EDGE_LLM_LIBRKNNRT"  # the NPU matmul engine's library file (docs/npu.md, "The matmul API binding")
LIBRKNNRT_NAME = "librknnrt.so"  # without it: found by the dynamic loader
RESTORE_MODES = ("pipelined", "sequential", "split")  # how a disk prefix is restored (docs/store.md)
PREFETCH_MODES = ("off", "latest")
DRAFT_MODES = ("ngram", "off")  # speculative decoding: prompt-lookup drafts or none (docs/speculative.md)  # what the server restores while idle after start-up (docs/store.md)
_OFF = {"", "0", "false", "no", "off", "none"}
_ON = {"1", "true", "yes", "on", AUTO}

SERVE, GENERATE, DOCTOR = "serve", "generate", "doctor"
_ALL = (SERVE, GENERATE, DOCTOR)


def _opt(default: Any, help: str, kind: type | str = int, commands: tuple[str, ...] = _ALL,
         minimum: float | None = None, maximum: float | None = None,
         choices: tuple[str, ...] | None = None, nullable: bool = False, metavar: str | None = None,
         shown_default: str | None = None, null_word: str = "none") -> Any:
    """A settings field: default + the metadata the CLI, env and TOML readers need. A nullable
    field reads `null_word` (and "none", and an empty value) as None, in every channel."""
    return field(default=default, metadata=dict(
        help=help, kind=kind, commands=commands, minimum=minimum, maximum=maximum, choices=choices,
        nullable=nullable, metavar=metavar, shown_default=shown_default, null_word=null_word))


@dataclass(frozen=True)
class Settings:
    # not a setting: where each value that was given came from, (key, "on the command line
    # (--backend)" | "in the configuration (FILE)" | "in the environment (EDGE_LLM_BACKEND)"),
    # filled by `load_settings`, so a message can say why a value is what it is (`source`)
    sources: tuple[tuple[str, str], ...] = field(default=(), compare=False, repr=False)
    # ---- model and compute ----------------------------------------------------------------------
    model: str = _opt("default", "HF model directory, or 'default' for the embedded SmolLM2-135M.", str,
                      metavar="DIR")
    backend: str = _opt("auto", "Compute backend: auto (the fastest that can run here: rknn when an NPU and "
                        "a matching rknn_dir exist, else cpu-q when onnxruntime is installed, else cpu; "
                        "the choice and its reason are logged and shown in /health), cpu (numpy F32, the "
                        "exact reference), cpu-q (4-bit weights on onnxruntime, see `quant`), rknn (the "
                        "RK3588 NPU, from rknn_dir, whose manifest says which of two paths: the graphs "
                        "`edge-llm convert rknn` compiles, fp16 or w8a8, run by rknn-toolkit-lite2; or the "
                        "matmul path of `edge-llm convert npu-mm`, every linear an int8 matmul through "
                        "librknnrt's matmul API with norms and attention on the CPU).", str,
                        choices=BACKEND_NAMES)
    quant: str = _opt("q4", "Weight format of backend cpu-q: q4 (4-bit blocks of 32, GGUF Q4_0/Q4_1/Q8_0 "
                      "blocks kept exactly, activations in float for prompts and in two int8 passes for "
                      "decode), q4-int8 (the same weights, int8 activations: faster, further from F32); "
                      "built on first use under "
                      "$EDGE_LLM_HOME/quant.", str, choices=QUANT_MODES)
    threads: int | None = _opt(None, "Compute threads of backend cpu-q (onnxruntime); auto: one per core, "
                               "on a big.LITTLE CPU one per big core with the process pinned to them "
                               "(RK3588: the four Cortex-A76).", minimum=1, nullable=True,
                               shown_default="auto", null_word="auto")
    decode_graph: bool = _opt(True, "Backend cpu-q runs each one-row step (decode, the last prompt token) as "
                              "one onnxruntime call over the whole decoder (faster decode; about +1.4 GiB "
                              "RAM for Qwen3-VL-2B: a second copy of the quantized weights). false: "
                              "per-layer graphs only (other numerics).", bool)
    vision_graph: bool = _opt(True, "Backend cpu-q encodes images through the vision tower exported as one "
                              "onnxruntime graph (F32, 1.3-2x the numpy tower's speed; built on first use under "
                              "$EDGE_LLM_HOME/quant, twice the checkpoint's BF16 tower bytes on disk); backend "
                              "rknn through the tower graphs of its rknn_dir when it has them. Images no graph "
                              "shape holds, and every image with false, take the numpy tower (other "
                              "numerics: other image keys).", bool)
    memory_check: bool = _opt(True, "Refuse to start (exit 78) when the memory estimate of this "
                              "configuration (weights in the backend's format, KV for max_seq, vision "
                              "tower, runtime) exceeds the memory available to the process, MemAvailable "
                              "or the cgroup limit (docs/board.md, Memory). false: start anyway.", bool)
    rknn_dir: str | None = _opt(None, "Directory made by `edge-llm convert rknn` (graphs) or `edge-llm convert "
                                "npu-mm` (int8 matmul weights); its manifest says which (backend rknn/auto).",
                                "path", nullable=True, metavar="DIR", shown_default="none")
    rknn_runner: str = _opt("auto", "What runs the rknn graphs: auto (the NPU), rknnlite, sim (the "
                            "rknn-toolkit2 simulator, hosts only) or onnxruntime (F32); an npu-mm directory: "
                            "auto (the NPU), librknnrt or host (the exact emulation).", str,
                            choices=RKNN_RUNNERS)
    max_seq: int = _opt(8192, "Context window in tokens (prompt + completion); the KV cache is "
                        "preallocated for it.", minimum=1)
    kv_bs: int = _opt(64, "KV rows per snapshot block (the unit of CRC checks and partial restore).",
                      minimum=1)
    prefill_chunk: int = _opt(128, "Prompt rows computed per prefill step (a cancelled prefill "
                              "keeps whole chunks; progress and the watchdog go per decoder layer "
                              "at any size); chunks start at its multiples, and a reused "
                              "prefix is cut back to one so that a restore is bitwise a recompute "
                              "(up to chunk-1 matched rows recomputed). Part of the snapshot identity.",
                              minimum=1)
    draft: str = _opt("ngram", "Speculative decoding: 'ngram' drafts the tokens that followed the last "
                      "n-gram's earlier occurrence in the conversation and verifies them in one "
                      "multi-row forward, when the acceptance so far and the backend's cost profile say "
                      "it is faster (same request, same text); 'off': one forward per token, plain "
                      "decoding's text.", str,
                      choices=DRAFT_MODES)
    draft_max: int = _opt(8, "Most tokens drafted per verify forward.", minimum=1, maximum=64)
    draft_ngram: int = _opt(3, "Longest n-gram matched for a draft (down to 2).", minimum=2, maximum=16)
    # ---- disk KV snapshots ----------------------------------------------------------------------
    disk_kv: str | None = _opt(AUTO, "Snapshot directory, or 'off'.", "dir-or-off", metavar="DIR|off",
                               shown_default="$STATE_DIRECTORY/kv, else $EDGE_LLM_HOME/kv")
    disk_kv_min_lcp: int = _opt(16, "Shortest common prefix (tokens) worth restoring from disk; also "
                                "the fewest rows an interrupted prefill saves.", minimum=1)
    disk_kv_max_files: int = _opt(8, "Conversations kept per model namespace: a snapshot and its deltas count as one (LRU eviction).", minimum=1)
    disk_kv_max_bytes: int | None = _opt(None, "Byte cap of a namespace's snapshots (bytes, or with a "
                                         "binary unit: 512MiB, 4G).", "bytes", minimum=1,
                                         nullable=True, shown_default="no cap")
    disk_kv_max_tokens: int = _opt(8192, "Tokens stored per snapshot (longer conversations are cut).",
                                   minimum=1)
    disk_kv_max_chain: int = _opt(8, "Files per snapshot chain: a save writes only the rows its longest "
                                  "stored prefix lacks (a delta file on it); a chain this long is "
                                  "rewritten as one file instead. 1 = every save is a full file.", minimum=1)
    disk_kv_compact_idle: float | None = _opt(600.0, "Seconds without a save after which every chain is "
                                              "compacted into one file in the background, or 'none'.",
                                              float, minimum=0, nullable=True, shown_default="600.0")
    disk_kv_group_read: bool = _opt(False, "Let the service's group read snapshot files and directories "
                                    "(0640/0750 instead of 0600/0700): for a lab whose students are in "
                                    "the group.", bool)
    disk_kv_restore: str = _opt("pipelined", "How a disk prefix is restored: 'pipelined' (one reader "
                                "thread reads layer l+1 while the tail is computed on layer l, bitwise "
                                "equal to 'sequential'), 'sequential', or 'split' (the cost gate may load "
                                "only the front and recompute the rest: faster on a slow disk, not "
                                "bitwise equal to the RAM path).", str, choices=RESTORE_MODES)
    disk_kv_prefetch: str = _opt("off", "What the server restores into the RAM cache while idle after "
                                 "start-up: 'off', or 'latest' (the most recently used conversation, for "
                                 "a board that serves one user: its first request after a restart reuses "
                                 "the rows from RAM; a request for another conversation preempts it).",
                                 str, choices=PREFETCH_MODES, commands=(SERVE,))
    # ---- server ---------------------------------------------------------------------------------
    host: str = _opt("127.0.0.1", "Bind address of the HTTP API.", str, commands=(SERVE,))
    port: int = _opt(8080, "TCP port of the HTTP API.", commands=(SERVE,), minimum=1, maximum=65535)
    allowed_hosts: tuple[str, ...] | None = _opt(
        None, "Names and addresses a request's Host header may carry (any port; case and a trailing dot "
        "ignored), comma-separated; '*.example.com' allows its subdomains, '*' any name. Any other Host is "
        "refused with 421 before anything else (DNS rebinding: a web page must not reach the server "
        "through a name of its own); a request without Host (HTTP/1.0, HAProxy's health check) passes; "
        "localhost, 127.0.0.1 and ::1 are always allowed. auto: the bind address and the addresses it "
        "resolves to (with host 0.0.0.0 or ::, the machine's hostname, <hostname>.local and every "
        "interface address). Behind a proxy, list the name clients use for the proxy.", "hosts",
        commands=(SERVE,), nullable=True, metavar="NAMES", shown_default="auto", null_word="auto")
    node_name: str = _opt(socket.gethostname(), "This board's name in the X-Edge-LLM-Node header of "
                          "every response: which board of a fleet answered (docs/fleet.md); 1-64 letters, digits, "
                          "'.', '_', ':' or '-'.", "name",
                          commands=(SERVE,), shown_default="the hostname")
    queue_size: int = _opt(16, "Requests waiting behind the running one; beyond: 503.",
                           commands=(SERVE,), minimum=1)
    api_key_file: str | None = _opt(None, "Require 'Authorization: Bearer <key>' with a key from this "
                                    "file.", "path", commands=(SERVE,), nullable=True, metavar="FILE",
                                    shown_default="no authentication")
    log_file: str | None = _opt(AUTO, "Append-only log file, or 'off'.", "file-or-off", commands=(SERVE,),
                                metavar="FILE|off",
                                shown_default="$LOGS_DIRECTORY/edge-llm.log, else $EDGE_LLM_HOME/logs/edge-llm.log")
    grace_seconds: float = _opt(30.0, "How long a running request may continue after SIGTERM or SIGINT "
                                "before it is cancelled (its completed rows are then saved); a second "
                                "signal cancels it at once.", float,
                                commands=(SERVE,), minimum=0)
    max_body_bytes: int = _opt(32 * 1024 * 1024, "Largest accepted request body (413 beyond); the default "
                               "holds an image of max_image_bytes as a base64 data: URL.",
                               commands=(SERVE,), minimum=1)
    metrics_public: bool = _opt(False, "Serve /metrics without the API key (for a Prometheus scraper "
                                "that sends none); without api_key_file it is public anyway.", bool,
                                commands=(SERVE,))
    ui: bool = _opt(True, "Serve the built-in page at /ui/ (chat, per-turn timings, the snapshot store, live "
                    "[KV-DISK] and [PREFILL-TIMING] events) on the API's host and port; its "
                    "data endpoints need the API key like the API. false: /ui/ is a 404.", bool,
                    commands=(SERVE,))
    default_max_tokens: int | None = _opt(1024, "Completion tokens of a chat request that sets no "
                                          "max_tokens (at most what the context window leaves); shown "
                                          "in /v1/models. none: the rest of the context window.",
                                          commands=(SERVE,), minimum=1, nullable=True)
    chat_special_tokens: bool = _opt(False, "Parse special-token strings typed into chat message text "
                                     "(<|im_start|>, <|im_end|>, ...) as control tokens: a client can then "
                                     "forge roles, so only for trusted clients. false: message text is "
                                     "plain text (as vLLM and llama.cpp's server do); completion prompts "
                                     "are always parsed.", bool, commands=(SERVE,))
    # ---- images (Qwen3-VL) ----------------------------------------------------------------------
    image_dir: str | None = _opt(None, "Chat image_url parts may name files under this directory "
                                 "(never a network URL).", "path", commands=(SERVE,), nullable=True,
                                 metavar="DIR", shown_default="data: URLs only")
    max_image_bytes: int = _opt(20 * 1024 * 1024, "Largest accepted image in bytes.",
                                commands=(SERVE, GENERATE), minimum=1)
    max_image_pixels: int = _opt(64 * 1024 * 1024, "Largest accepted image in width x height, checked "
                                 "before decoding (decompression bombs).", commands=(SERVE, GENERATE),
                                 minimum=1)
    max_images: int = _opt(8, "Images accepted in one chat request (400 beyond). Every image's tokens are "
                           "counted from its header and the request refused past max_seq before any "
                           "pixel is decoded; this caps the rest of what one request holds and reads "
                           "(up to max_images x max_image_bytes of --image-dir files). 8: a few pages or "
                           "screenshots per turn.", commands=(SERVE,), minimum=1)
    max_image_decodes: int = _opt(1, "Images decoded at the same time, over all requests. One decode "
                                  "briefly holds the source pixels (4 bytes per pixel, more with alpha) "
                                  "and float arrays of up to about 72 KiB per image token; 1 bounds that to one "
                                  "image at a time (the single worker runs one request at a time anyway). "
                                  "More only helps concurrent image requests on a board with RAM to spare.",
                                  commands=(SERVE,), minimum=1)

    @property
    def disk_kv_enabled(self) -> bool:
        return self.disk_kv is not None

    def source(self, key: str) -> str | None:
        """Where `key`'s value was given ("on the command line (--backend)", "in the configuration
        (FILE)", "in the environment (EDGE_LLM_BACKEND)"); None: its default, or set by code."""
        return dict(self.sources).get(key)


DEFAULTS = Settings()
FIELDS = {f.name: f for f in fields(Settings) if f.metadata}  # the settings (`sources` is not one)


def env_name(key: str) -> str:
    return ENV_PREFIX + key.upper()


# ---- the home directory and the default locations -----------------------------------------------
def expand_path(value: str | os.PathLike[str]) -> Path:
    """`~` expanded and made absolute against the current directory, once, at start-up."""
    return Path(os.path.abspath(os.path.expanduser(os.fspath(value))))


def home_dir(env: Mapping[str, str] | None = None) -> Path:
    """$EDGE_LLM_HOME (with `~` and relative paths resolved), else ~/.cache/edge-llm.

    The one place that reads EDGE_LLM_HOME: models, the weight-digest cache, snapshots and logs
    live below it unless systemd's directories say otherwise."""
    env = os.environ if env is None else env
    value = env.get(HOME_ENV)
    return expand_path(value) if value else Path.home() / ".cache" / "edge-llm"


def models_dir(env: Mapping[str, str] | None = None) -> Path:
    return home_dir(env) / "models"


def digest_cache_path(env: Mapping[str, str] | None = None) -> Path:
    return home_dir(env) / "digests.json"


def _first_dir(value: str | None) -> Path | None:
    """systemd passes *_DIRECTORY as a colon-separated list; the first entry is ours."""
    if not value:
        return None
    first = value.split(":")[0]
    return Path(first) if first else None


def default_disk_kv(env: Mapping[str, str]) -> str:
    state = _first_dir(env.get("STATE_DIRECTORY"))
    return str((state if state else home_dir(env)) / "kv")


def default_log_file(env: Mapping[str, str]) -> str:
    logs = _first_dir(env.get("LOGS_DIRECTORY"))
    return str((logs if logs else home_dir(env) / "logs") / "edge-llm.log")


def resolve(s: Settings, env: Mapping[str, str] | None = None) -> Settings:
    """Replace AUTO locations with real paths (idempotent)."""
    env = os.environ if env is None else env
    if s.disk_kv == AUTO:
        s = replace(s, disk_kv=default_disk_kv(env))
    if s.log_file == AUTO:
        s = replace(s, log_file=default_log_file(env))
    return s


# ---- reading values -------------------------------------------------------------------------------
_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:i?B)?\s*", re.IGNORECASE)
_NAME = re.compile(r"[A-Za-z0-9._:-]{1,64}")
_HOST_NAME = re.compile(r"[a-z0-9_-]{1,63}(\.[a-z0-9_-]{1,63})*")  # labels; 253 characters at most
_SIZE_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def normal_host(text: str) -> str | None:
    """A host name or IP address as compared with a Host header: lower case, without a trailing
    dot, an IPv6 address without brackets and in its compressed form; None if `text` is neither
    (a name is letters, digits, '-', '_' and dots)."""
    text = text.strip().lower()
    bracketed = text.startswith("[") and text.endswith("]")
    if bracketed:
        text = text[1:-1]
    if bracketed or ":" in text:  # only an IPv6 address holds a colon (a port is not part of an entry)
        try:
            return str(ipaddress.IPv6Address(text))
        except ValueError:
            return None
    if text.endswith("."):
        text = text[:-1]
    return text if len(text) <= 253 and _HOST_NAME.fullmatch(text) else None


def host_pattern(text: str) -> str | None:
    """An `allowed_hosts` entry, normalised: '*', '*.<domain>' or a `normal_host`; None if invalid."""
    text = text.strip()
    if text == "*":
        return text
    if text.startswith("*."):
        rest = normal_host(text[2:])
        return "*." + rest if rest is not None and ":" not in rest else None
    return normal_host(text)


def parse_size(text: str) -> int:
    """A byte size: '1500000', '512M', '512MiB', '1.5G' (units are binary: K = 1024) -> bytes.
    ValueError if `text` is not one. Read for settings of kind "bytes" (disk_kv_max_bytes) and by
    `kv gc --max-bytes`, so both spell a size alike."""
    m = _SIZE.fullmatch(text)
    if not m:
        raise ValueError(f"{text!r} is not a size (e.g. 1500000, 512M, 1.5GiB)")
    return int(float(m.group(1)) * _SIZE_UNITS[m.group(2).upper()])


def convert(key: str, value: Any, source: str) -> Any:
    """Coerce a raw value (TOML type, env string or flag) to the field's type; ConfigError if bad."""
    meta = FIELDS[key].metadata
    kind = meta["kind"]
    text = value.strip() if isinstance(value, str) else None
    if kind in ("dir-or-off", "file-or-off"):
        if value is False or value is None or (text is not None and text.lower() in _OFF):
            return None
        if value is True or (text is not None and text.lower() in _ON):
            return AUTO
        if text is not None:
            return str(expand_path(text))
        what = "a directory" if kind == "dir-or-off" else "a file"
        raise ConfigError(f"{source}: {key} must be {what} or false/off, got {value!r}")
    if meta["nullable"] and (value is None or (text is not None and text.lower() in ("", "none", meta["null_word"]))):
        return None
    if kind == "path":
        if text is None:
            raise ConfigError(f"{source}: {key} must be a path, got {value!r}")
        return str(expand_path(text))
    if kind is bool:
        if isinstance(value, bool):
            return value
        if text is not None and text.lower() in _OFF | _ON - {AUTO}:
            return text.lower() in _ON
        raise ConfigError(f"{source}: {key} must be true or false, got {value!r}")
    if kind == "hosts":
        items = value if isinstance(value, (list, tuple)) else text.split(",") if text is not None else None
        if items is None or not all(isinstance(i, str) for i in items):
            raise ConfigError(f"{source}: {key} must be a list of host names or addresses, got {value!r}")
        entries = [i.strip() for i in items if i.strip()]
        if not entries:
            raise ConfigError(f"{source}: {key} names no host (use '*' to allow any, 'auto' for the default)")
        out = []
        for entry in entries:
            pattern = host_pattern(entry)
            if pattern is None:
                raise ConfigError(f"{source}: {key}: {entry!r} is not a host name, an IP address, "
                                  "'*.<domain>' or '*'")
            out.append(pattern)
        return tuple(dict.fromkeys(out))
    if kind == "name":  # sent in a response header: a plain token, never a control byte
        if text is None or not _NAME.fullmatch(text):
            raise ConfigError(f"{source}: {key} must be 1-64 letters, digits, '.', '_', ':' or '-', "
                              f"got {value!r}")
        return text
    typ = {int: int, float: float, str: str, "bytes": int}[kind]
    try:
        if kind == "bytes" and text is not None:
            text = str(parse_size(text))
        if isinstance(value, bool) or (typ is str and not isinstance(value, str)):
            raise ValueError
        if typ is int and isinstance(value, float):
            raise ValueError
        out = typ(text) if text is not None else typ(value)
    except (TypeError, ValueError):
        what = "a size in bytes (e.g. 4294967296, 4GiB)" if kind == "bytes" else typ.__name__
        raise ConfigError(f"{source}: {key} must be {what}, got {value!r}") from None
    lo, hi = meta["minimum"], meta["maximum"]
    if lo is not None and out < lo:
        rel = "> 0" if lo == 1 and typ is int else f">= {lo}"
        raise ConfigError(f"{source}: {key} must be {rel}, got {out!r}")
    if hi is not None and out > hi:
        raise ConfigError(f"{source}: {key} must be <= {hi}, got {out!r}")
    if meta["choices"] and out not in meta["choices"]:
        raise ConfigError(f"{source}: {key} {out!r} is not available (available: {', '.join(meta['choices'])})")
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
    unknown = sorted(set(data) - set(FIELDS))
    if unknown:
        raise ConfigError(f"config file {p}: unknown key(s) {', '.join(unknown)} "
                          f"(known: {', '.join(FIELDS)})")
    return {k: convert(k, v, f"config file {p}") for k, v in data.items()}


def read_env(env: Mapping[str, str]) -> dict[str, Any]:
    """EDGE_LLM_<KEY> variables that name a setting (EDGE_LLM_HOME/CONFIG are not settings)."""
    return {key: convert(key, env[env_name(key)], f"environment {env_name(key)}")
            for key in FIELDS if env_name(key) in env}


def load_settings(flags: Mapping[str, Any] | None = None, config_file: str | Path | None = None,
                  env: Mapping[str, str] | None = None) -> Settings:
    """Merge the sources and resolve locations. `flags` holds only flags the user gave."""
    env = os.environ if env is None else env
    config_file = config_file or env.get(CONFIG_ENV) or None
    merged: dict[str, Any] = {}
    sources: dict[str, str] = {}
    if config_file:
        merged.update(read_toml(config_file))
        sources.update(dict.fromkeys(merged, f"in the configuration ({config_file})"))
    from_env = read_env(env)
    merged.update(from_env)
    sources.update({k: f"in the environment ({env_name(k)})" for k in from_env})
    for k, v in (flags or {}).items():
        if k not in FIELDS:
            raise ConfigError(f"unknown setting {k!r}")
        flag = f"--{k.replace('_', '-')}"
        merged[k] = convert(k, v, flag)
        sources[k] = f"on the command line ({flag})"
    return resolve(replace(DEFAULTS, **merged, sources=tuple(sorted(sources.items()))), env)


def describe_default(key: str) -> str:
    """The default as the docs and `--help` show it."""
    meta = FIELDS[key].metadata
    if meta["shown_default"]:
        return meta["shown_default"]
    return str(FIELDS[key].default)
