"""Shared fixtures: tiny random HF checkpoints of every supported model_type.

`tiny_model_dir(model_type, **options)` writes (once per session and option set) a 2-layer,
hidden-64 checkpoint with transformers' own `save_pretrained`, so tests read exactly what HF
writes. `tiny_hf_model(path)` loads it back into transformers for reference outputs.
"""

from __future__ import annotations

import os
import subprocess
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach a model hub from tests
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
# servers and CLIs the tests start compare against the exact reference backend unless a test
# names another; the tests of `backend = auto` (the product's default) set their own environment
os.environ.setdefault("EDGE_LLM_BACKEND", "cpu")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

TINY_VOCAB = 256

# text geometry shared by all tiny models: 4 query heads over 2 kv heads (GQA), head_dim 16
_TEXT = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=TINY_VOCAB, max_position_embeddings=512,
             rms_norm_eps=1e-6)


def tiny_hf_config(model_type: str, tied: bool = True, rope_parameters: dict | None = None,
                   **overrides):
    """A transformers config object for a tiny model of `model_type`."""
    import transformers as tf

    text = {**_TEXT, **overrides}
    if model_type == "qwen3_vl":
        rope = rope_parameters or dict(rope_type="default", rope_theta=5e6, mrope_section=[4, 2, 2],
                                       mrope_interleaved=True)
        text = dict(head_dim=16, rope_parameters=rope, **text)
        vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2,
                      out_hidden_size=text["hidden_size"], patch_size=8, spatial_merge_size=2,
                      temporal_patch_size=2, deepstack_visual_indexes=[0])
        return tf.Qwen3VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=tied)
    rope = rope_parameters or dict(rope_type="default", rope_theta=10000.0)
    cls = {"qwen3": tf.Qwen3Config, "qwen2": tf.Qwen2Config, "llama": tf.LlamaConfig}[model_type]
    extra = {"head_dim": 16} if model_type in ("qwen3", "llama") else {}
    if model_type == "llama":
        extra["bos_token_id"], extra["eos_token_id"] = 1, 2
    return cls(**text, **extra, rope_parameters=rope, tie_word_embeddings=tied)


def _randomize(model, seed: int) -> None:
    """Replace HF's tiny init (std 0.02, ones, zeros) with weights that spread the logits,
    so parity and greedy tests compare meaningful, well-separated values."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "visual" in name:
                continue
            if p.ndim == 1:  # norm weights around 1, biases around 0
                base = 1.0 if "norm" in name else 0.0
                p.copy_(base + 0.2 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) * (1.5 / p.shape[1] ** 0.5))


def build_tiny_model(path: Path, model_type: str, tied: bool = True, dtype: str = "float32",
                     seed: int = 0, **config_kw) -> Path:
    """Write a tiny random checkpoint of `model_type` to `path` (HF layout, given dtype)."""
    import torch
    import transformers as tf

    torch.manual_seed(seed)
    cfg = tiny_hf_config(model_type, tied=tied, **config_kw)
    cls = tf.Qwen3VLForConditionalGeneration if model_type == "qwen3_vl" else tf.AutoModelForCausalLM
    model = cls.from_config(cfg) if cls is tf.AutoModelForCausalLM else cls(cfg)
    _randomize(model, seed)
    model = model.to(getattr(torch, dtype))
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """Factory: tiny_model_dir(model_type, tied=True, dtype="float32", seed=0, **config_kw) -> Path.

    Checkpoints are cached per argument set for the whole session; treat them as read-only.
    """
    made: dict[tuple, Path] = {}

    def make(model_type: str, tied: bool = True, dtype: str = "float32", seed: int = 0,
             **config_kw) -> Path:
        key = (model_type, tied, dtype, seed, repr(sorted(config_kw.items())))
        if key not in made:
            path = tmp_path_factory.mktemp(f"tiny-{model_type}")
            made[key] = build_tiny_model(path, model_type, tied=tied, dtype=dtype, seed=seed,
                                         **config_kw)
        return made[key]

    return make


def tiny_hf_model(path: Path):
    """Load a tiny checkpoint back into transformers (float32, eval mode) for reference."""
    import json

    import torch
    import transformers as tf

    model_type = json.loads((Path(path) / "config.json").read_text())["model_type"]
    cls = tf.Qwen3VLForConditionalGeneration if model_type == "qwen3_vl" else tf.AutoModelForCausalLM
    return cls.from_pretrained(path, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def load_hf_model():
    """Fixture form of `tiny_hf_model` for tests that prefer not to import conftest."""
    return tiny_hf_model

# ---- session fixtures shared by the server, engine and restore tests ----------------------------
# Defined here (not imported into test modules): a fixture imported into several modules would be
# a separate session fixture per module, importing the default model once per module.
READY_TIMEOUT = 600


@pytest.fixture(scope="session")
def edge_home(tmp_path_factory) -> Path:
    """A session EDGE_LLM_HOME with the default model imported into it, by a first `generate` as a
    user would run it: the first use shows a progress bar, not only a log line."""
    home = tmp_path_factory.mktemp("edge-home")
    env = {**os.environ, "EDGE_LLM_HOME": str(home)}
    r = subprocess.run([sys.executable, "-m", "edge_llm", "generate", "--model", "default", "--no-disk-kv",
                        "--max-tokens", "1", "-p", "hi"], env=env, capture_output=True, text=True,
                       timeout=READY_TIMEOUT)
    assert r.returncode == 0, r.stderr
    assert "importing the default model (first use)" in r.stderr and "538.1" in r.stderr, r.stderr
    return home


@pytest.fixture(scope="module")
def home(tmp_path_factory) -> Path:
    """An EDGE_LLM_HOME of the test module's own: cpu-q builds its graphs, and the vision tower
    its one graph, under it on first use."""
    mp = pytest.MonkeyPatch()
    h = tmp_path_factory.mktemp("q-home")
    mp.setenv("EDGE_LLM_HOME", str(h))
    yield h
    mp.undo()


@pytest.fixture(scope="session")
def tiny_synth_dir(tmp_path_factory) -> Path:
    """A tiny random qwen3_vl checkpoint with the real Qwen3 tokenizer: fast to run."""
    from edge_llm.checkpoints.synth import synth_checkpoint

    return synth_checkpoint(tmp_path_factory.mktemp("tiny-synth") / "tiny-qwen3vl", preset="tiny")


@pytest.fixture(scope="session")
def default_model_dir(edge_home: Path) -> Path:
    """The default model's directory inside the session's EDGE_LLM_HOME."""
    return next(edge_home.glob("models/*/config.json")).parent


@pytest.fixture(scope="session")
def default_mm_rtn(default_model_dir: Path, tmp_path_factory) -> Path:
    """The default model (real weights) converted by `edge-llm convert npu-mm` with round-to-nearest
    weights (`gptq_tokens=0`: seconds instead of GPTQ's minutes), shared by the tests that compare
    the matmul path's engines and decode paths or time it; the accuracy targets need the default
    conversion, which tests/test_mm8.py makes through the CLI."""
    from edge_llm.convert.npu_mm import convert_mm8

    out = tmp_path_factory.mktemp("default-mm") / "mm"
    # no accuracy record (its host-emulation measurement is minutes here): `auto` does not take this
    # directory; a test that needs auto on it measures a copy (edge_llm/qrecord.py `record_mm`)
    convert_mm8(default_model_dir, out, gptq_tokens=0, record=False)
    return out


@pytest.fixture(scope="session")
def default_mm(edge_home: Path, tmp_path_factory) -> Path:
    """The default model converted by the CLI with its defaults (`edge-llm convert npu-mm default
    OUT`: GPTQ, the rotations, its accuracy record measured in the host emulation: minutes here),
    once a session: tests/test_mm8.py's accuracy targets and the emulated board's `auto`, which
    takes an npu-mm directory only with a passing record (round-to-nearest's fails it)."""
    out = tmp_path_factory.mktemp("npu-mm") / "out"
    r = subprocess.run([sys.executable, "-m", "edge_llm", "convert", "npu-mm", "default", str(out)],
                       env={**os.environ, "EDGE_LLM_HOME": str(edge_home)}, capture_output=True, text=True,
                       timeout=1800)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "30 layers" in r.stdout and "peak RSS" in r.stdout, r.stdout
    return out


@pytest.fixture(scope="session")
def fake_librknnrt(request) -> Path:
    """The fake librknnrt.so built for this host (tests/fake_librknnrt: it stands in for Rockchip's
    closed library, which cannot exist without an RK3588 NPU), compiled once per source into
    pytest's cache directory."""
    from fake_librknnrt.build import build_fake

    return build_fake(Path(request.config.cache.mkdir("fake_librknnrt")))
