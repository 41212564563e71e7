"""Identity: model_id digest, namespaces and identity.json (docs/identity.md)."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest

from edge_llm.config import ModelArgs
from edge_llm.snapshot.identity import (
    IDENTITY_FILE,
    LAYOUT_VERSION,
    Identity,
    ensure_namespace,
    namespace_dir,
    read_identity,
)

QWEN3_CFG = dict(model_type="qwen3", vocab_size=256, hidden_size=64, intermediate_size=128,
                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                 rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=True)


def make_identity(**kw) -> Identity:
    base = dict(config=ModelArgs.from_dict(QWEN3_CFG).identity_fields(), weights_digest="ab" * 32,
                tokenizer_digest="cd" * 32)
    return Identity(**{**base, **kw})


def test_model_id_is_first_8_bytes_of_sha256_of_canonical_json_le():
    ident = make_identity()
    canon = json.dumps(ident.canonical(), sort_keys=True, separators=(",", ":"))
    expected = int.from_bytes(hashlib.sha256(canon.encode()).digest()[:8], "little")
    assert ident.model_id == expected
    assert 0 <= ident.model_id < 2**64
    assert ident.namespace == f"{expected:016x}" and len(ident.namespace) == 16


def test_model_id_independent_of_dict_order_and_tuple_vs_list():
    a = make_identity()
    reordered = dict(reversed(list(a.config.items())))
    listed = {k: list(v) if isinstance(v, tuple) else v for k, v in a.config.items()}
    assert make_identity(config=reordered).model_id == a.model_id
    assert make_identity(config=listed).model_id == a.model_id


@pytest.mark.parametrize("change", [
    dict(weights_digest="ef" * 32),
    dict(tokenizer_digest="00" * 32),
    dict(layout=LAYOUT_VERSION + "-x"),
    dict(backend_numerics="rknn-w8a8:1234"),
    dict(prefill_chunk=32),  # rows batched otherwise: other bits (docs/store.md)
])
def test_every_identity_field_changes_model_id(change):
    assert make_identity(**change).model_id != make_identity().model_id


@pytest.mark.parametrize("key,value", [("rope_theta", 5e6), ("rms_norm_eps", 1e-5),
                                       ("vocab_size", 512), ("tie_word_embeddings", False)])
def test_config_fields_change_model_id(key, value):
    other = ModelArgs.from_dict({**QWEN3_CFG, key: value}).identity_fields()
    assert make_identity(config=other).model_id != make_identity().model_id


def test_model_dir_is_informational_only():
    assert make_identity(model_dir="/a").model_id == make_identity(model_dir="/b").model_id


def test_namespace_dir_and_identity_json(tmp_path):
    ident = make_identity(model_dir="somewhere")
    ns = ensure_namespace(tmp_path, ident)
    assert ns == namespace_dir(tmp_path, ident) == tmp_path / ident.namespace
    doc = read_identity(ns)
    assert doc["model_id"] == ident.namespace
    assert doc["weights_sha256"] == ident.weights_digest
    assert doc["backend_numerics"] == "cpu-f32"
    assert doc["config"]["num_hidden_layers"] == 2
    assert "\n  " in (ns / IDENTITY_FILE).read_text()  # indented: meant to be read by people
    assert Identity.from_json((ns / IDENTITY_FILE).read_text()).model_id == ident.model_id
    assert not list(ns.glob("*.tmp"))
    # unchanged identity: the file is not rewritten (same inode)
    ino = (ns / IDENTITY_FILE).stat().st_ino
    ensure_namespace(tmp_path, ident)
    assert (ns / IDENTITY_FILE).stat().st_ino == ino


def test_changed_model_gets_new_namespace_old_one_kept(tmp_path):
    a, b = make_identity(), make_identity(weights_digest="99" * 32)
    ns_a = ensure_namespace(tmp_path, a)
    (ns_a / "kv_0000000000000001.kv").write_bytes(b"x")
    ns_b = ensure_namespace(tmp_path, b)
    assert ns_a != ns_b and ns_a.is_dir() and (ns_a / "kv_0000000000000001.kv").exists()
    assert ensure_namespace(tmp_path, a) == ns_a


def _write_model_dir(path, seed=0):
    from safetensors.numpy import save_file

    path.mkdir()
    (path / "config.json").write_text(json.dumps(QWEN3_CFG))
    rng = np.random.default_rng(seed)
    save_file({"model.embed_tokens.weight": rng.standard_normal((256, 64), dtype=np.float32)},
              str(path / "model.safetensors"))
    (path / "tokenizer.json").write_text('{"version": "1.0"}')
    return path


def test_for_model_digests_weights_and_tokenizer(tmp_path, monkeypatch):
    monkeypatch.setenv("EDGE_LLM_HOME", str(tmp_path / "home"))  # weight digest cache
    from edge_llm.weights import weight_digest

    d1 = _write_model_dir(tmp_path / "m1", seed=0)
    args = ModelArgs.from_dir(d1)
    ident = Identity.for_model(d1, args)
    assert ident.weights_digest == weight_digest(d1)
    assert ident.tokenizer_digest == hashlib.sha256(b'{"version": "1.0"}').hexdigest()
    assert ident.config == args.identity_fields()
    # same bytes elsewhere: same identity; different weights: different identity
    d2 = _write_model_dir(tmp_path / "m2", seed=0)
    d3 = _write_model_dir(tmp_path / "m3", seed=1)
    assert Identity.for_model(d2, args).model_id == ident.model_id
    assert Identity.for_model(d3, args).model_id != ident.model_id
    assert Identity.for_model(d1, args, backend_numerics="rknn").model_id != ident.model_id
    (d2 / "tokenizer.json").write_text('{"version": "2.0"}')
    assert Identity.for_model(d2, args).model_id != ident.model_id
