"""Synthetic checkpoints with the exact Qwen3-VL-2B text geometry.

Weights are random (seeded per tensor name, so the values do not depend on the shard plan) and
written BF16 tensor by tensor through `safetensors_writer`: peak memory is one tensor, not the
model. The tokenizer is the real Qwen3 one, so prompts tokenise exactly as on the real model.
"""

from __future__ import annotations

import logging
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from edge_llm.checkpoints.packaged import qwen3_tokenizer_dir
from edge_llm.checkpoints.safetensors_writer import (
    DEFAULT_SHARD_BYTES,
    Progress,
    TensorPlan,
    f32_to_bf16_bits,
    write_checkpoint,
    write_json_atomic,
)
from edge_llm.config import VisionArgs
from edge_llm.errors import ModelImportError
from edge_llm.safetext import printable
from edge_llm.files import write_atomic
from edge_llm.weights import vision_tensors

log = logging.getLogger(__name__)

INIT_STD = 0.02

QWEN3_VL_2B_TEXT: dict[str, Any] = {
    "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 151643, "dtype": "bfloat16",
    "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu", "hidden_size": 2048,
    "initializer_range": 0.02, "intermediate_size": 6144, "max_position_embeddings": 262144,
    "model_type": "qwen3_vl_text", "num_attention_heads": 16, "num_hidden_layers": 28,
    "num_key_value_heads": 8, "rms_norm_eps": 1e-06,
    "rope_scaling": {"mrope_interleaved": True, "mrope_section": [24, 20, 20], "rope_type": "default"},
    "rope_theta": 5000000, "tie_word_embeddings": True, "use_cache": True, "vocab_size": 151936,
}
QWEN3_VL_2B_VISION: dict[str, Any] = {
    "deepstack_visual_indexes": [5, 11, 17], "depth": 24, "hidden_act": "gelu_pytorch_tanh",
    "hidden_size": 1024, "in_channels": 3, "initializer_range": 0.02, "intermediate_size": 4096,
    "model_type": "qwen3_vl", "num_heads": 16, "num_position_embeddings": 2304, "out_hidden_size": 2048,
    "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2,
}
# tiny keeps the real vocab (the tokenizer is real) and the mrope split rule (sum == head_dim / 2)
TINY_TEXT_OVERRIDES: dict[str, Any] = {
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16,
    "rope_scaling": {"mrope_interleaved": True, "mrope_section": [4, 2, 2], "rope_type": "default"},
}
# tiny's vision tower keeps the published patch/merge geometry (images tokenise as on the real
# model) with small widths; its output width is the tiny text hidden size
TINY_VISION_OVERRIDES: dict[str, Any] = {
    "depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2,
    "deepstack_visual_indexes": [0, 1],
}
# the published Qwen3-VL preprocessor_config.json (Qwen2VLImageProcessor with patch 16, mean/std 0.5)
QWEN3_VL_PREPROCESSOR: dict[str, Any] = {
    "do_convert_rgb": True, "do_normalize": True, "do_rescale": True, "do_resize": True,
    "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "image_processor_type": "Qwen2VLImageProcessor",
    "merge_size": 2, "patch_size": 16, "processor_class": "Qwen3VLProcessor", "resample": 3,
    "rescale_factor": 1 / 255, "size": {"longest_edge": 16777216, "shortest_edge": 65536},
    "temporal_patch_size": 2,
}
PRESETS = ("qwen3-vl-2b", "tiny")
GENERATION_CONFIG = {"bos_token_id": 151643, "pad_token_id": 151643, "do_sample": False,
                     "eos_token_id": [151645, 151643]}


# ---- random weights ------------------------------------------------------------------------
def synth_tensor_f32(name: str, shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    """The F32 value of a synthetic tensor before BF16 rounding: norms are 1, the rest N(0, 0.02).

    Seeded by (seed, crc32(name)) so a tensor's values do not depend on which others are written.
    """
    if name.endswith(("norm.weight", "norm1.weight", "norm2.weight")):
        return np.ones(shape, dtype=np.float32)
    if name.endswith("norm.bias") or name.endswith(("norm1.bias", "norm2.bias")):
        return np.zeros(shape, dtype=np.float32)
    rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
    out = rng.standard_normal(shape, dtype=np.float32)
    out *= np.float32(INIT_STD)
    return out


def synth_tensor_bf16_blocks(name: str, shape: tuple[int, ...], seed: int = 0,
                             block_elems: int = 1 << 24) -> Iterator[np.ndarray]:
    """`f32_to_bf16_bits(synth_tensor_f32(...))` in row blocks of about `block_elems` values.

    numpy's Generator yields the same stream whether drawn at once or in pieces, so the blocks
    concatenate to exactly the whole-tensor result while peak memory stays one block.
    """
    if name.endswith("norm.weight") or len(shape) < 2:
        yield f32_to_bf16_bits(synth_tensor_f32(name, shape, seed))
        return
    rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
    row = int(np.prod(shape[1:]))
    step = max(1, block_elems // row)
    for start in range(0, shape[0], step):
        block = rng.standard_normal((min(step, shape[0] - start), *shape[1:]), dtype=np.float32)
        block *= np.float32(INIT_STD)
        yield f32_to_bf16_bits(block)


def text_config(preset: str, layers: int | None = None) -> dict[str, Any]:
    if preset not in PRESETS:
        raise ModelImportError(f"unknown synth preset {preset!r} (choose from {', '.join(PRESETS)})")
    cfg = dict(QWEN3_VL_2B_TEXT)
    if preset == "tiny":
        cfg.update(TINY_TEXT_OVERRIDES)
    if layers is not None:
        if layers < 1:
            raise ModelImportError(f"--layers must be >= 1, got {layers}")
        cfg["num_hidden_layers"] = layers
    return cfg


def qwen3_vl_plans(tc: dict[str, Any]) -> list[TensorPlan]:
    """Text-model tensor names/shapes of an HF qwen3_vl checkpoint (tied embeddings: no lm_head)."""
    h, inter, hd = tc["hidden_size"], tc["intermediate_size"], tc["head_dim"]
    q, kv = tc["num_attention_heads"] * hd, tc["num_key_value_heads"] * hd
    pre = "model.language_model."
    plans = [TensorPlan(pre + "embed_tokens.weight", "BF16", (tc["vocab_size"], h))]
    for i in range(tc["num_hidden_layers"]):
        lp = f"{pre}layers.{i}."
        for name, shape in (("input_layernorm", (h,)), ("post_attention_layernorm", (h,)),
                            ("self_attn.q_proj", (q, h)), ("self_attn.k_proj", (kv, h)),
                            ("self_attn.v_proj", (kv, h)), ("self_attn.o_proj", (h, q)),
                            ("self_attn.q_norm", (hd,)), ("self_attn.k_norm", (hd,)),
                            ("mlp.gate_proj", (inter, h)), ("mlp.up_proj", (inter, h)),
                            ("mlp.down_proj", (h, inter))):
            plans.append(TensorPlan(lp + name + ".weight", "BF16", shape))
    plans.append(TensorPlan(pre + "norm.weight", "BF16", (h,)))
    return plans


def synth_checkpoint(out_dir: str | Path, preset: str = "qwen3-vl-2b", layers: int | None = None,
                     seed: int = 0, progress: Progress | None = None,
                     max_shard_bytes: int = DEFAULT_SHARD_BYTES, durable: bool = True,
                     vision: bool = True) -> Path:
    """Write a random-weight HF `qwen3_vl` checkpoint (BF16) with the real Qwen3 tokenizer.

    With `vision` (default) the vision tower is written too (qwen3-vl-2b: the published Qwen3-VL-2B
    vision geometry; tiny: small widths) with the published `preprocessor_config.json`.
    `durable=False` skips the fsyncs (scratch checkpoints in tests and benchmarks)."""
    tok_dir = qwen3_tokenizer_dir()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tc = text_config(preset, layers)
    config = {
        "architectures": ["Qwen3VLForConditionalGeneration"], "image_token_id": 151655,
        "model_type": "qwen3_vl", "text_config": tc, "tie_word_embeddings": True,
        "video_token_id": 151656, "vision_config": dict(QWEN3_VL_2B_VISION),
        "vision_end_token_id": 151653, "vision_start_token_id": 151652,
        "edge_llm_synthetic": {"preset": preset, "seed": seed, "init_std": INIT_STD},
    }
    if preset == "tiny":
        config["vision_config"].update(TINY_VISION_OVERRIDES, out_hidden_size=tc["hidden_size"])
    for name in ("tokenizer.json", "tokenizer_config.json"):
        write_atomic(out / name, (tok_dir / name).read_bytes(), durable=durable)
    write_json_atomic(out / "generation_config.json", GENERATION_CONFIG, durable=durable)
    plans = qwen3_vl_plans(tc)
    if vision:
        vargs = VisionArgs.from_config(config)
        assert vargs is not None
        plans += [TensorPlan(n, "BF16", shape) for n, shape in vision_tensors(vargs).items()]
        write_json_atomic(out / "preprocessor_config.json", QWEN3_VL_PREPROCESSOR, durable=durable)
    else:
        (out / "preprocessor_config.json").unlink(missing_ok=True)
    names = write_checkpoint(out, plans, lambda p: synth_tensor_bf16_blocks(p.name, p.shape, seed),
                             max_shard_bytes=max_shard_bytes, progress=progress, durable=durable)
    write_json_atomic(out / "config.json", config, durable=durable)  # last: a directory with config.json is complete
    log.info("synthetic %s checkpoint (%d layers) -> %s (%s)", preset, tc["num_hidden_layers"], printable(out),
             ", ".join(names))
    return out
