"""Synthetic qwen3_vl checkpoints: real layout and geometry, BF16 = round-to-nearest-even of the
seeded F32 draws, sharding, and the `model synth/info/digest` commands."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from edge_llm.checkpoints.safetensors_writer import (
    bf16_bits_to_f32,
    f32_to_bf16_bits,
    read_safetensors_header,
)
from edge_llm.checkpoints.synth import (
    qwen3_vl_plans,
    synth_checkpoint,
    synth_tensor_bf16_blocks,
    synth_tensor_f32,
    text_config,
)
from edge_llm.config import ModelArgs, VisionArgs
from edge_llm.errors import ModelImportError
from edge_llm.weights import (
    expected_tensors,
    index_tensors,
    safetensors_files,
    vision_tensors,
)

torch = pytest.importorskip("torch")


def _bf16_reference(x: np.ndarray) -> np.ndarray:
    """torch's F32 -> BF16 conversion (round to nearest even), as raw bits."""
    return torch.from_numpy(np.ascontiguousarray(x)).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)


def _raw_tensor(info) -> np.ndarray:
    n = int(np.prod(info.shape))
    dtype = {"BF16": np.uint16, "F32": np.float32}[info.dtype]
    return np.fromfile(info.file, dtype=dtype, count=n, offset=info.offset).reshape(info.shape)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("synth") / "tiny"
    calls = []
    synth_checkpoint(d, preset="tiny", seed=11, progress=lambda done, total, name: calls.append((done, total)))
    return d, calls


def test_tiny_layout_and_config(tiny):
    d, calls = tiny
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["model_type"] == "qwen3_vl" and "vision_config" in cfg and cfg["tie_word_embeddings"] is True
    args = ModelArgs.from_dir(d)
    assert (args.model_type, args.vocab_size, args.hidden_size, args.num_hidden_layers) == ("qwen3_vl", 151936, 64, 2)
    assert args.mrope_interleaved and sum(args.mrope_section) == args.head_dim // 2
    assert args.weight_prefix == "model.language_model." and args.tie_word_embeddings
    tensors = index_tensors(d)
    vargs = VisionArgs.from_config(cfg)
    assert {k: v.shape for k, v in tensors.items()} == expected_tensors(args) | vision_tensors(vargs)
    assert (vargs.patch_size, vargs.spatial_merge_size, vargs.out_hidden_size) == (16, 2, 64)
    assert json.loads((d / "preprocessor_config.json").read_text())["size"]["shortest_edge"] == 65536
    assert {v.dtype for v in tensors.values()} == {"BF16"}
    gen = json.loads((d / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [151645, 151643]
    assert (d / "tokenizer.json").is_file() and (d / "tokenizer_config.json").is_file()
    total = sum(p.nbytes for p in qwen3_vl_plans(text_config("tiny"))) + 2 * sum(
        int(np.prod(s)) for s in vision_tensors(vargs).values())
    assert calls[-1] == (total, total) and all(a[0] < b[0] for a, b in zip(calls, calls[1:]))


def test_tiny_bf16_bits_are_rne_of_the_f32_draws(tiny):
    d, _ = tiny
    for name, info in index_tensors(d).items():
        want = _bf16_reference(synth_tensor_f32(name, info.shape, seed=11))
        np.testing.assert_array_equal(_raw_tensor(info), want, err_msg=name)
    emb = bf16_bits_to_f32(_raw_tensor(index_tensors(d)["model.language_model.embed_tokens.weight"]))
    assert 0.019 < float(emb.std()) < 0.021  # the N(0, 0.02) init survives rounding
    norm = bf16_bits_to_f32(_raw_tensor(index_tensors(d)["model.language_model.norm.weight"]))
    assert (norm == 1.0).all()


def test_tiny_loads_through_the_weight_loader(tiny):
    from edge_llm.weights import load_weights

    d, _ = tiny
    args = ModelArgs.from_dir(d)
    w = load_weights(d, args)
    q = w["model.language_model.layers.1.self_attn.q_proj.weight"]
    want = bf16_bits_to_f32(f32_to_bf16_bits(synth_tensor_f32("model.language_model.layers.1.self_attn.q_proj.weight",
                                                               q.shape, seed=11)))
    assert q.dtype == np.float32
    np.testing.assert_array_equal(q, want)


def test_sharded_equals_single_file_and_is_deterministic(tiny, tmp_path):
    d, _ = tiny
    sharded = synth_checkpoint(tmp_path / "sharded", preset="tiny", seed=11, max_shard_bytes=64 << 10)
    files = safetensors_files(sharded)
    assert len(files) > 2 and (sharded / "model.safetensors.index.json").is_file()
    a, b = index_tensors(d), index_tensors(sharded)
    assert a.keys() == b.keys()
    for name in a:
        np.testing.assert_array_equal(_raw_tensor(a[name]), _raw_tensor(b[name]), err_msg=name)
    # rewriting the same directory unsharded drops the old shards and index
    synth_checkpoint(sharded, preset="tiny", seed=12)
    assert [f.name for f in safetensors_files(sharded)] == ["model.safetensors"]
    assert not (sharded / "model.safetensors.index.json").exists()
    other = index_tensors(sharded)["model.language_model.layers.0.mlp.up_proj.weight"]
    assert not np.array_equal(_raw_tensor(other), _raw_tensor(a["model.language_model.layers.0.mlp.up_proj.weight"]))


def test_qwen3_vl_2b_one_layer_geometry_from_headers(tmp_path):
    d = synth_checkpoint(tmp_path / "2b", preset="qwen3-vl-2b", layers=1, seed=0, durable=False)
    cfg = json.loads((d / "config.json").read_text())
    tc = cfg["text_config"]
    assert (tc["hidden_size"], tc["intermediate_size"], tc["num_hidden_layers"], tc["num_attention_heads"],
            tc["num_key_value_heads"], tc["head_dim"], tc["vocab_size"]) == (2048, 6144, 1, 16, 8, 128, 151936)
    assert tc["rms_norm_eps"] == 1e-6 and tc["rope_theta"] == 5000000
    assert tc["rope_scaling"] == {"mrope_section": [24, 20, 20], "mrope_interleaved": True, "rope_type": "default"}
    assert cfg["tie_word_embeddings"] is True
    args = ModelArgs.from_dir(d)
    assert args.geometry.kv_bytes_per_token * 28 == 229_376  # one of 28 layers: Qwen3-VL-2B's bytes/token
    header = {}
    for f in safetensors_files(d):
        header |= {k: v for k, v in read_safetensors_header(f).items() if k != "__metadata__"}
    vargs = VisionArgs.from_config(cfg)
    assert {k: tuple(v["shape"]) for k, v in header.items()} == expected_tensors(args) | vision_tensors(vargs)
    # the published Qwen3-VL-2B vision tower: 24 blocks of width 1024, DeepStack after 5, 11, 17
    assert header["model.visual.patch_embed.proj.weight"]["shape"] == [1024, 3, 2, 16, 16]
    assert header["model.visual.merger.linear_fc2.weight"]["shape"] == [2048, 4096]
    assert header["model.visual.deepstack_merger_list.2.norm.weight"]["shape"] == [4096]
    assert vargs.depth == 24 and vargs.deepstack_visual_indexes == (5, 11, 17)
    n_vis = sum(int(np.prod(s)) for s in vision_tensors(vargs).values())
    assert 4.0e8 < n_vis < 4.1e8  # Qwen3-VL-2B's vision tower: ~0.41B params
    assert header["model.language_model.embed_tokens.weight"]["shape"] == [151936, 2048]
    assert header["model.language_model.layers.0.self_attn.k_proj.weight"]["shape"] == [1024, 2048]
    assert header["model.language_model.layers.0.mlp.down_proj.weight"]["shape"] == [2048, 6144]
    assert {v["dtype"] for v in header.values()} == {"BF16"}
    full = qwen3_vl_plans(text_config("qwen3-vl-2b"))
    assert len(full) == 2 + 28 * 11
    assert 1.7e9 < sum(int(np.prod(p.shape)) for p in full) < 1.75e9  # Qwen3-VL-2B text: ~1.72B params


def test_blockwise_generation_equals_whole_tensor():
    name = "model.language_model.layers.3.mlp.up_proj.weight"
    blocks = list(synth_tensor_bf16_blocks(name, (1000, 37), seed=5, block_elems=37 * 64))
    assert len(blocks) == 16
    np.testing.assert_array_equal(np.concatenate(blocks), _bf16_reference(synth_tensor_f32(name, (1000, 37), seed=5)))


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=64))
def test_bf16_rounding_matches_torch(bits):
    x = np.array(bits, dtype=np.uint32).view(np.float32)
    finite = np.isfinite(x)
    got, want = f32_to_bf16_bits(x), _bf16_reference(x)
    np.testing.assert_array_equal(got[finite], want[finite])
    assert np.isnan(bf16_bits_to_f32(got[np.isnan(x)])).all()
    assert (bf16_bits_to_f32(got[np.isinf(x)]) == x[np.isinf(x)]).all()


def test_bad_preset_and_layers(tmp_path):
    with pytest.raises(ModelImportError, match="preset"):
        synth_checkpoint(tmp_path / "x", preset="qwen9")
    with pytest.raises(ModelImportError, match="layers"):
        synth_checkpoint(tmp_path / "x", preset="tiny", layers=0)


def test_cli_synth_info_digest(tmp_path, monkeypatch):
    from click.testing import CliRunner

    from edge_llm.cli import cli

    monkeypatch.setenv("EDGE_LLM_HOME", str(tmp_path / "home"))  # weight digest cache
    out = tmp_path / "m"
    r = CliRunner().invoke(cli, ["model", "synth", "--preset", "tiny", "--layers", "3", "--seed", "4", str(out)])
    assert r.exit_code == 0, r.output
    assert ModelArgs.from_dir(out).num_hidden_layers == 3
    r = CliRunner().invoke(cli, ["model", "info", str(out), "--max-seq", "1000"])
    assert r.exit_code == 0, r.output
    per_token = 2 * 3 * 2 * 16 * 4
    assert f"{per_token:,}" in r.output and f"{per_token * 1000:,}" in r.output
    n_params = sum(int(np.prod(p.shape)) for p in qwen3_vl_plans(text_config("tiny", 3)))
    assert f"{n_params:,}" in r.output
    r1 = CliRunner().invoke(cli, ["model", "digest", str(out)])
    r2 = CliRunner().invoke(cli, ["model", "digest", str(out)])
    assert r1.exit_code == 0 and r1.output == r2.output and "model_id" in r1.output
    r = CliRunner().invoke(cli, ["model", "info", str(tmp_path / "missing")])
    assert r.exit_code != 0 and "not a model directory" in r.output
