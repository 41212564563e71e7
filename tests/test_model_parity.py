"""The numpy decoder against HF transformers (torch CPU, float32) on tiny random checkpoints."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from edge_llm.backends import Backend, get_backend, pick_chunk
from edge_llm.backends.cpu.backend import CPUBackend
from edge_llm.config import ModelArgs
from edge_llm.errors import ConfigError, KVCacheError
from edge_llm.models.qwen3 import Model
from edge_llm.models.rope import Rope

# (model_type, tied, extra config): every family, tied and untied heads, each rope scaling kind
CASES = {
    "qwen3_vl-tied": ("qwen3_vl", True, {}),
    "qwen3_vl-untied": ("qwen3_vl", False, {}),
    "qwen3-untied": ("qwen3", False, {}),
    "qwen2-bias-tied": ("qwen2", True, {}),
    "llama-llama3rope": ("llama", False, {"rope_parameters": dict(
        rope_type="llama3", rope_theta=10000.0, factor=8.0, low_freq_factor=1.0,
        high_freq_factor=4.0, original_max_position_embeddings=64)}),
    "llama-linear-tied": ("llama", True, {"rope_parameters": dict(
        rope_type="linear", rope_theta=10000.0, factor=2.0)}),
}
REL_TOL = 1e-4  # max abs diff relative to the logit scale (max |logit|)
ROUNDING = 1e-5  # same model, different batch shapes: F32 rounding only


@pytest.fixture(scope="module", params=sorted(CASES))
def pair(request, tiny_model_dir, load_hf_model):
    model_type, tied, extra = CASES[request.param]
    path = tiny_model_dir(model_type, tied=tied, **extra)
    return request.param, Model.load(path), load_hf_model(path)


def _ids(n: int, seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n)


def _hf_logits(hf, ids: np.ndarray, **kw) -> np.ndarray:
    with torch.no_grad():
        return hf(torch.tensor(ids[None]), **kw).logits[0].float().numpy()


def _rel(ours: np.ndarray, ref: np.ndarray) -> float:
    return float(np.abs(ours - ref).max() / np.abs(ref).max())


def test_logits_match_transformers(pair, record_property):
    name, model, hf = pair
    ids = _ids(48)
    ref = _hf_logits(hf, ids)
    all_rows = model.forward(ids, model.new_cache(64, check_memory=False), all_logits=True)
    cache = model.new_cache(64, check_memory=False)
    last = model.forward(ids, cache)
    assert all_rows.dtype == np.float32 and all_rows.shape == (48, 256) and last.shape == (256,)
    assert cache.length == 48 and cache.tokens == ids.tolist()
    rel_all, rel_last = _rel(all_rows, ref), _rel(last, ref[-1])
    record_property("max_rel_diff_all", rel_all)
    print(f"{name}: all-position rel diff {rel_all:.2e}, last {rel_last:.2e}")
    assert rel_all <= REL_TOL and rel_last <= REL_TOL


def test_chunked_prefill_equals_one_shot(pair, record_property):
    _, model, _ = pair
    ids = _ids(45, seed=2)
    one = model.new_cache(64, check_memory=False)
    ref = model.forward(ids, one)
    for chunk in (1, 7, 16):
        c = model.new_cache(64, check_memory=False)
        got = model.prefill(ids, c, chunk=chunk)
        kv_diff = np.abs(c.data[:, :, :45] - one.data[:, :, :45]).max()
        rel = _rel(got, ref)
        record_property(f"chunk{chunk}_rel_diff", rel)
        print(f"chunk {chunk}: logits rel diff {rel:.2e}, KV abs diff {kv_diff:.2e}")
        assert c.tokens == ids.tolist()
        assert rel <= ROUNDING and kv_diff <= ROUNDING * np.abs(one.data).max()


def test_prefill_then_decode_equals_full_forward(pair, record_property):
    _, model, _ = pair
    ids = _ids(40, seed=3)
    full = model.forward(ids, model.new_cache(64, check_memory=False), all_logits=True)
    cache = model.new_cache(64, check_memory=False)
    steps = [model.prefill(ids[:30], cache, chunk=8)]
    steps += [model.forward(ids[t:t + 1], cache) for t in range(30, 40)]
    rel = _rel(np.stack(steps), full[29:40])
    record_property("decode_rel_diff", rel)
    print(f"prefill + 10 decode steps vs full forward: rel diff {rel:.2e}")
    assert rel <= ROUNDING


def test_greedy_matches_generate(pair):
    _, model, hf = pair
    prompt = _ids(12, seed=4)
    hf.generation_config.eos_token_id = None  # generate exactly 20 tokens, like our loop
    with torch.no_grad():
        out = hf.generate(torch.tensor(prompt[None]), attention_mask=torch.ones(1, 12, dtype=torch.long),
                          max_new_tokens=20, do_sample=False, pad_token_id=0)
    ref = out[0, 12:].tolist()
    cache = model.new_cache(64, check_memory=False)
    logits = model.prefill(prompt, cache)
    ours = []
    for _ in range(20):
        ours.append(int(np.argmax(logits)))
        logits = model.forward([ours[-1]], cache)
    assert ours == ref


def test_same_rows_same_chunk_is_bitwise_identical(pair):
    """The restore contract: rows copied into a fresh cache + the same tail chunk => same bits."""
    _, model, _ = pair
    ids = _ids(50, seed=5)
    a = model.new_cache(64, check_memory=False)
    model.prefill(ids[:36], a, chunk=12)
    tail_a = model.prefill(ids[36:], a, chunk=16)
    b = model.new_cache(64, check_memory=False)
    b.data[:, :, :36] = a.data[:, :, :36]  # what a disk restore does
    b.set_tokens(ids[:36].tolist())
    tail_b = model.prefill(ids[36:], b, chunk=16)
    assert np.array_equal(tail_a, tail_b)
    assert np.array_equal(a.data[:, :, :50], b.data[:, :, :50])


@pytest.mark.parametrize("tied", [True])
def test_mrope_with_distinct_thw_positions(tiny_model_dir, load_hf_model, tied):
    """Image-like positions (t, h, w differ) exercise the interleaved MRoPE sections."""
    path = tiny_model_dir("qwen3_vl", tied=tied)
    model, hf = Model.load(path), load_hf_model(path)
    rng = np.random.default_rng(6)
    T = 24
    pos = np.stack([np.sort(rng.integers(0, 40, T)) for _ in range(3)])  # (3, T)
    ref = _hf_logits(hf, _ids(T, 7), position_ids=torch.tensor(pos[:, None, :]))
    ours = model.forward(_ids(T, 7), model.new_cache(32, check_memory=False), all_logits=True, positions=pos)
    assert _rel(ours, ref) <= REL_TOL
    # and text positions really are the t=h=w special case
    text = model.forward(_ids(T, 7), model.new_cache(32, check_memory=False), all_logits=True)
    assert not np.allclose(text, ours)


def test_rope_tables_match_transformers(tiny_model_dir, load_hf_model):
    path = tiny_model_dir("qwen3_vl", tied=True)
    hf = load_hf_model(path)
    rope = Rope(ModelArgs.from_dir(path))
    pos = np.array([[0, 5, 9, 300], [0, 1, 7, 2], [0, 3, 3, 11]])
    rotary = hf.model.language_model.rotary_emb
    with torch.no_grad():
        cos_ref, sin_ref = rotary(torch.zeros(1), torch.tensor(pos[:, None, :]))
    cos, sin = rope.cos_sin(pos)
    assert np.abs(cos - cos_ref[0].numpy()).max() <= 1e-6
    assert np.abs(sin - sin_ref[0].numpy()).max() <= 1e-6
    np.testing.assert_allclose(rope.inv_freq, rotary.inv_freq.numpy(), rtol=1e-6)


class StaticShapeBackend(CPUBackend):
    """What an NPU backend does at the seam: run every dense op at one static row count."""

    chunk_sizes = (16,)

    def __init__(self):
        super().__init__()
        self.seen_rows: set[int] = set()

    def _padded(self, fn, x, *rest):
        T = x.shape[0]
        assert T <= 16
        pad = np.zeros((16, x.shape[1]), dtype=np.float32)
        pad[:T] = x
        rest = [np.concatenate([r, np.zeros((16 - T, r.shape[1]), np.float32)]) for r in rest]
        self.seen_rows.add(pad.shape[0])
        out = fn(pad, *rest)
        return tuple(o[:T] for o in out) if isinstance(out, tuple) else out[:T]

    def qkv(self, layer, x):
        return self._padded(lambda p: super(StaticShapeBackend, self).qkv(layer, p), x)

    def attn_out(self, layer, attn, x):
        return self._padded(lambda a, p: super(StaticShapeBackend, self).attn_out(layer, a, p), attn, x)

    def mlp(self, layer, x):
        return self._padded(lambda p: super(StaticShapeBackend, self).mlp(layer, p), x)


def test_static_shape_backend_seam(tiny_model_dir):
    path = tiny_model_dir("qwen3_vl", tied=True)
    be = StaticShapeBackend()
    assert isinstance(be, Backend) and pick_chunk(be, 128) == 16 and pick_chunk(be, 8) == 16
    npu_like, ref = Model.load(path, backend=be), Model.load(path)
    ids = _ids(40, seed=8)
    got = npu_like.prefill(ids, npu_like.new_cache(64, check_memory=False), chunk=128)
    want = ref.forward(ids, ref.new_cache(64, check_memory=False))
    assert be.seen_rows == {16}
    assert _rel(got, want) <= ROUNDING


def test_forward_rejects_bad_input(tiny_model_dir):
    model = Model.load(tiny_model_dir("qwen3", tied=False))
    cache = model.new_cache(8, check_memory=False)
    with pytest.raises(ValueError, match="out of range"):
        model.forward([1, 256], cache)
    with pytest.raises(KVCacheError, match="max_seq"):
        model.forward(list(range(9)), cache)
    assert cache.length == 0  # nothing was appended by the failed calls
    with pytest.raises(ConfigError, match="backend"):
        get_backend("npu-that-does-not-exist")
    from edge_llm.backends.cpu.backend import numpy_kernels

    assert CPUBackend().numerics == f"cpu-f32:{numpy_kernels()}"  # numpy's kernels decide the bits
