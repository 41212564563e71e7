"""safetensors loading: exact BF16/F16 widening, shards, name/shape/dtype checks, weight digest."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil

import numpy as np
import pytest
import torch
from safetensors.numpy import save_file
from safetensors.torch import load_file

from edge_llm.config import ModelArgs
from edge_llm.errors import WeightsError
from edge_llm.models.qwen3 import Model
from edge_llm.weights import (
    digest_cache_path,
    expected_tensors,
    load_weights,
    weight_digest,
)


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_loads_exactly(tiny_model_dir, dtype):
    path = tiny_model_dir("qwen3_vl", tied=False, dtype=dtype)
    ref = load_file(path / "model.safetensors")
    assert ref["lm_head.weight"].dtype == getattr(torch, dtype)
    weights = load_weights(path, ModelArgs.from_dir(path))
    for name in weights:
        ours = weights[name]
        theirs = ref[name].float().numpy()  # torch's own widening
        assert ours.dtype == np.float32 and ours.flags.c_contiguous
        assert np.array_equal(ours.view(np.uint32), theirs.view(np.uint32)), name


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_mapped_matrix_widens_exactly_and_holds_no_copy(tiny_model_dir, dtype):
    """The vision tower's matrices stay in the file: `t()` is torch's widening, transposed."""
    path = tiny_model_dir("qwen3_vl", tied=False, dtype=dtype)
    ref = load_file(path / "model.safetensors")
    weights = load_weights(path, ModelArgs.from_dir(path))
    name = "model.language_model.layers.0.mlp.gate_proj.weight"
    m = weights.pop_matrix(name)
    assert name not in weights and m.shape == tuple(ref[name].shape)
    assert _in_map(m)  # a view of the mapped file, not an owned copy
    got = m.t()
    assert got.dtype == np.float32 and got.shape == m.shape[::-1]
    assert np.array_equal(got.view(np.uint32), ref[name].float().numpy().T.view(np.uint32))
    assert m.t() is not got  # widened afresh on each use (nothing kept between uses)


def test_vision_tower_ignored_and_tied_head_not_required(tiny_model_dir):
    path = tiny_model_dir("qwen3_vl", tied=True)
    args = ModelArgs.from_dir(path)
    weights = load_weights(path, args)
    assert set(weights) == set(expected_tensors(args))
    assert all(n.startswith("model.language_model.") for n in weights)
    assert "lm_head.weight" not in weights


def test_sharded_checkpoint_gives_identical_logits(tiny_model_dir, tmp_path, load_hf_model):
    path = tiny_model_dir("qwen3", tied=False)
    load_hf_model(path).save_pretrained(tmp_path, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    ids = np.arange(20) * 7 % 256
    one = Model.load(path).forward(ids, Model.load(path).new_cache(32, check_memory=False))
    sharded = Model.load(tmp_path)
    two = sharded.forward(ids, sharded.new_cache(32, check_memory=False))
    assert np.array_equal(one, two)


def _rewrite(path, mutate):
    """Rewrite model.safetensors (as F32) after `mutate(dict)`."""
    tensors = {k: v.float().numpy() for k, v in load_file(path / "model.safetensors").items()}
    mutate(tensors)
    save_file(tensors, str(path / "model.safetensors"))


def test_missing_tensor_names_it(tiny_model_dir, tmp_path):
    path = _copy(tiny_model_dir("qwen2", tied=True), tmp_path / "m")
    name = "model.layers.1.self_attn.k_proj.bias"
    _rewrite(path, lambda t: t.pop(name))
    with pytest.raises(WeightsError, match=name.replace(".", r"\.")):
        Model.load(path)


def test_wrong_shape_names_it(tiny_model_dir, tmp_path):
    path = _copy(tiny_model_dir("llama", tied=False), tmp_path / "m")
    name = "model.layers.0.mlp.up_proj.weight"
    _rewrite(path, lambda t: t.__setitem__(name, t[name][:-1]))
    with pytest.raises(WeightsError, match=rf"{re.escape(name)}.*\[127, 64\].*\[128, 64\]"):
        Model.load(path)


def test_untied_model_needs_lm_head(tiny_model_dir, tmp_path):
    path = _copy(tiny_model_dir("llama", tied=False), tmp_path / "m")
    _rewrite(path, lambda t: t.pop("lm_head.weight"))
    with pytest.raises(WeightsError, match="lm_head.weight"):
        Model.load(path)


def test_unsupported_dtype_names_it(tiny_model_dir, tmp_path):
    path = _copy(tiny_model_dir("llama", tied=True), tmp_path / "m")
    name = "model.norm.weight"
    _rewrite(path, lambda t: t.__setitem__(name, t[name].astype(np.int32)))
    with pytest.raises(WeightsError, match=f"{name}.*I32"):
        Model.load(path)


def test_corrupt_file_and_missing_shard(tiny_model_dir, tmp_path):
    path = _copy(tiny_model_dir("llama", tied=True), tmp_path / "m")
    (path / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{garbage")
    with pytest.raises(WeightsError, match="model.safetensors"):
        Model.load(path)
    (path / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"model.norm.weight": "model-00002-of-00002.safetensors"}}))
    with pytest.raises(WeightsError, match="model-00002-of-00002"):
        Model.load(path)


def test_no_safetensors(tmp_path):
    with pytest.raises(WeightsError, match="no \\*.safetensors"):
        weight_digest(tmp_path)


def test_weight_digest_is_cached_by_path_size_mtime(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("EDGE_LLM_HOME", str(tmp_path / "home"))
    path = _copy(tiny_model_dir("qwen3", tied=True), tmp_path / "m")
    f = path / "model.safetensors"
    file_sha = hashlib.sha256(f.read_bytes()).hexdigest()
    expect = hashlib.sha256(f"model.safetensors:{file_sha}\n".encode()).hexdigest()
    assert weight_digest(path) == expect
    cache = json.loads(digest_cache_path().read_text())
    entry = cache[str(f.resolve())]
    assert entry["sha256"] == file_sha and entry["size"] == f.stat().st_size

    # a second call trusts the cache (proved by planting a different digest in it)
    entry["sha256"] = "0" * 64
    digest_cache_path().write_text(json.dumps(cache))
    planted = weight_digest(path)
    assert planted != expect

    # a new mtime invalidates the entry; changed bytes change the digest
    st = f.stat()
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    assert weight_digest(path) == expect
    data = bytearray(f.read_bytes())
    data[-1] ^= 1
    f.write_bytes(bytes(data))
    assert weight_digest(path) not in (expect, planted)


def test_weight_digest_survives_unwritable_cache(tiny_model_dir, tmp_path, monkeypatch):
    blocker = tmp_path / "file-not-dir"
    blocker.write_text("x")
    monkeypatch.setenv("EDGE_LLM_HOME", str(blocker))  # mkdir under a file fails
    assert len(weight_digest(tiny_model_dir("qwen3", tied=True))) == 64


def test_vision_tower_matrices_stay_in_the_file(tiny_synth_dir):
    """Between images the tower holds only norms, biases and the patch/position tables in RAM."""
    from edge_llm.vision.model import VisionModel
    from edge_llm.weights import index_tensors

    vm = VisionModel.load(tiny_synth_dir, ModelArgs.from_dir(tiny_synth_dir))
    f32 = sum(4 * int(np.prod(t.shape)) for n, t in index_tensors(tiny_synth_dir).items()
              if n.startswith(vm.args.weight_prefix))
    be = vm.encoder.backend
    mats = [getattr(B, a) for B in be.blocks for a in ("w_qkv", "w_proj", "w1", "w2")]
    mats += [getattr(M, a) for M in be.mergers for a in ("w1", "w2")]
    assert len(mats) == 4 * len(be.blocks) + 2 * len(be.mergers) and all(_in_map(m) for m in mats)
    assert len({id(m.rows._mm) for m in mats}) == 1  # one map of the checkpoint file, shared
    held = be.nbytes
    assert held < 0.5 * f32, (held, f32)  # tiny model: 24 % (norms, biases, patch); as F32 arrays: 66 %


def _in_map(m) -> bool:
    """The matrix's stored elements lie inside its file's mmap (not in an anonymous copy)."""
    from edge_llm.weights import MappedMatrix

    mapped = np.frombuffer(m.rows._mm, np.uint8)
    return isinstance(m, MappedMatrix) and np.shares_memory(m.rows._raw, mapped)
