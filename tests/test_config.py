"""ModelArgs from config.json: every model_type, both rope spellings, and each ConfigError."""

from __future__ import annotations

import copy
import json

import pytest

from edge_llm.config import ModelArgs
from edge_llm.errors import ConfigError

# The published Qwen3-VL-2B-Instruct text geometry (legacy rope_theta + rope_scaling spelling)
QWEN3_VL_2B = {
    "model_type": "qwen3_vl",
    "tie_word_embeddings": True,
    "text_config": {
        "model_type": "qwen3_vl_text", "hidden_size": 2048, "intermediate_size": 6144,
        "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8,
        "head_dim": 128, "vocab_size": 151936, "rms_norm_eps": 1e-6, "rope_theta": 5000000,
        "max_position_embeddings": 262144, "bos_token_id": 151643, "eos_token_id": 151645,
        "rope_scaling": {"mrope_interleaved": True, "mrope_section": [24, 20, 20], "rope_type": "default"},
    },
}


def test_qwen3_vl_2b_published_config():
    a = ModelArgs.from_dict(QWEN3_VL_2B)
    assert (a.num_hidden_layers, a.num_key_value_heads, a.head_dim, a.q_dim) == (28, 8, 128, 2048)
    assert a.tie_word_embeddings and a.qk_norm and not a.attention_bias
    assert a.mrope_section == (24, 20, 20) and a.mrope_interleaved and a.rope_theta == 5e6
    assert a.weight_prefix == "model.language_model."
    assert a.geometry.kv_bytes_per_token == 229_376  # Qwen3-VL-2B: 28 x 8 x 128 x 4 B x 2
    assert a.eos_token_id == (151645,)


def test_both_rope_spellings_give_the_same_args():
    new = copy.deepcopy(QWEN3_VL_2B)
    t = new["text_config"]
    t["rope_parameters"] = {**t.pop("rope_scaling"), "rope_theta": t.pop("rope_theta")}
    assert ModelArgs.from_dict(new) == ModelArgs.from_dict(QWEN3_VL_2B)


@pytest.mark.parametrize("model_type,tied", [("qwen3_vl", True), ("qwen3", False), ("qwen2", True), ("llama", False)])
def test_configs_written_by_transformers(tiny_model_dir, model_type, tied):
    a = ModelArgs.from_dir(tiny_model_dir(model_type, tied=tied))
    assert a.model_type == model_type and a.tie_word_embeddings == tied
    assert (a.hidden_size, a.num_attention_heads, a.num_key_value_heads, a.head_dim) == (64, 4, 2, 16)
    assert a.attention_bias == (model_type == "qwen2")
    assert a.qk_norm == (model_type in ("qwen3", "qwen3_vl"))
    if model_type == "qwen3_vl":
        assert a.mrope_section == (4, 2, 2) and a.weight_prefix == "model.language_model."


def test_llama3_rope_parameters(tiny_model_dir):
    rope = dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
                high_freq_factor=4.0, original_max_position_embeddings=64)
    a = ModelArgs.from_dir(tiny_model_dir("llama", tied=False, rope_parameters=rope))
    assert a.rope_type == "llama3" and a.rope_theta == 500000.0
    assert a.rope_param("factor") == 8.0 and a.rope_param("original_max_position_embeddings") == 64


def _text(**changes):
    cfg = copy.deepcopy(QWEN3_VL_2B)
    for k, v in changes.items():
        if v is None:
            cfg["text_config"].pop(k)
        else:
            cfg["text_config"][k] = v
    return cfg


@pytest.mark.parametrize("cfg,key", [
    (_text(hidden_size=None), "hidden_size"),
    (_text(vocab_size=None), "vocab_size"),
    (_text(rms_norm_eps=None), "rms_norm_eps"),
    (_text(num_hidden_layers="28"), "num_hidden_layers"),
    (_text(num_key_value_heads=6), "num_key_value_heads"),
    (_text(head_dim=127), "head_dim"),
    (_text(rope_scaling={"mrope_section": [24, 20, 10], "rope_type": "default"}), "mrope_section"),
    (_text(rope_scaling={"mrope_section": [24, 40], "rope_type": "default"}), "mrope_section"),
    (_text(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "yarn"),
    (_text(rope_scaling={"rope_type": "linear"}), "factor"),
    ({**QWEN3_VL_2B, "model_type": "mistral"}, "model_type"),
    ({"model_type": "qwen3_vl"}, "text_config"),
])
def test_bad_config_names_the_key(cfg, key):
    with pytest.raises(ConfigError, match=key):
        ModelArgs.from_dict(cfg)


def test_config_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        ModelArgs.from_dir(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="invalid JSON"):
        ModelArgs.from_dir(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_VL_2B))
    assert ModelArgs.from_dir(tmp_path).num_hidden_layers == 28
