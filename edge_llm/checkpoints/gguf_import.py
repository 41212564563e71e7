"""Import a GGUF file (architectures llama, qwen2, qwen3) into an HF-layout model directory.

Every tensor is dequantised to F32 with `gguf.quants.dequantize` and renamed to its HF name;
llama.cpp's Q/K row permutation (applied by convert_hf_to_gguf for `llama`) is undone. The
tokenizer.json is rebuilt from the GGUF vocabulary, merges and pre-tokenizer name.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

import numpy as np

from edge_llm.checkpoints.safetensors_writer import (
    Progress,
    TensorPlan,
    write_checkpoint,
    write_json_atomic,
)
from edge_llm.errors import ModelImportError
from edge_llm.files import open_regular, write_atomic

log = logging.getLogger(__name__)

ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_BLK = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")
_GLOBAL = re.compile(r"^([a-z_]+)\.(weight|bias)$")

# pre-tokenizer regexes, as in llama.cpp's llama-vocab.cpp and the HF tokenizers they came from
QWEN2_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")
LLAMA3_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_PRE_FAMILY = {
    "qwen2": "qwen2", "deepseek-r1-qwen": "qwen2",
    "llama-bpe": "llama3", "llama3": "llama3", "smaug-bpe": "llama3",
    "smollm": "digits", "starcoder": "digits", "refact": "digits",
    "gpt-2": "gpt2", "gpt2": "gpt2", "default": "gpt2",
}
TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED = 3, 4
# what an imported directory records about its source (gguf_blocks.py finds the GGUF by it)
IMPORT_RECORD = "edge_llm_import.json"


def hf_name(gguf_name: str) -> str:
    """GGUF tensor name -> HF name; unknown names raise (silently dropping one would be wrong)."""
    if m := _BLK.match(gguf_name):
        layer, part, kind = m.groups()
        if part in _LAYER_NAMES:
            return f"model.layers.{layer}.{_LAYER_NAMES[part]}.{kind}"
    elif (m := _GLOBAL.match(gguf_name)) and m.group(1) in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[m.group(1)]}.{m.group(2)}"
    raise ModelImportError(f"GGUF tensor {gguf_name!r} has no HF equivalent this importer knows")


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Invert convert_hf_to_gguf's `permute`: reshape(n_head, 2, d/2, ...).swapaxes(1, 2).

    llama.cpp stores each head's rotary pairs interleaved (Meta layout); HF keeps the two halves.
    """
    shape = w.shape
    return w.reshape(n_head, shape[0] // n_head // 2, 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


class _Meta:
    """Typed access to GGUF key/values."""

    def __init__(self, reader: Any):
        self.fields = reader.fields

    def get(self, key: str, default: Any = None) -> Any:
        f = self.fields.get(key)
        return default if f is None else f.contents()

    def req(self, key: str) -> Any:
        if key not in self.fields:
            raise ModelImportError(f"GGUF metadata key {key!r} missing")
        return self.fields[key].contents()


def _f32_clean(x: float) -> float:
    # GGUF stores eps/theta as F32 (9.99999974e-06); write the shortest decimal of that F32 (1e-05)
    return float(str(np.float32(x)))


def build_config(meta: _Meta, arch: str, n_vocab: int, tied: bool, has_qkv_bias: bool) -> dict[str, Any]:
    """HF config.json fields from GGUF metadata."""
    a = arch
    hidden = int(meta.req(f"{a}.embedding_length"))
    n_head = int(meta.req(f"{a}.attention.head_count"))
    n_kv = int(meta.get(f"{a}.attention.head_count_kv", n_head))
    head_dim = int(meta.get(f"{a}.attention.key_length", hidden // n_head))
    rot = meta.get(f"{a}.rope.dimension_count")
    if rot is not None and int(rot) != head_dim:
        raise ModelImportError(f"partial rotary (rope.dimension_count {rot} != head_dim {head_dim}) is not supported")
    cfg: dict[str, Any] = {
        "architectures": [ARCHITECTURES[arch]], "model_type": arch, "hidden_act": "silu",
        "vocab_size": n_vocab, "hidden_size": hidden,
        "intermediate_size": int(meta.req(f"{a}.feed_forward_length")),
        "num_hidden_layers": int(meta.req(f"{a}.block_count")),
        "num_attention_heads": n_head, "num_key_value_heads": n_kv, "head_dim": head_dim,
        "rms_norm_eps": _f32_clean(meta.req(f"{a}.attention.layer_norm_rms_epsilon")),
        "rope_theta": _f32_clean(meta.get(f"{a}.rope.freq_base", 10000.0)),
        "max_position_embeddings": int(meta.get(f"{a}.context_length", 2048)),
        "tie_word_embeddings": tied, "torch_dtype": "float32",
    }
    if arch != "qwen2":  # Qwen2 always has q/k/v bias and no such key
        cfg["attention_bias"] = has_qkv_bias
    if arch == "llama":
        cfg["mlp_bias"] = False
    scaling = meta.get(f"{a}.rope.scaling.type")
    if scaling not in (None, "none"):
        if scaling != "linear":
            raise ModelImportError(f"rope scaling {scaling!r} is not supported by the importer")
        cfg["rope_scaling"] = {"rope_type": "linear", "factor": float(meta.req(f"{a}.rope.scaling.factor"))}
    for key, gkey in (("bos_token_id", "tokenizer.ggml.bos_token_id"), ("eos_token_id", "tokenizer.ggml.eos_token_id")):
        if (v := meta.get(gkey)) is not None:
            cfg[key] = int(v)
    return cfg


def build_tokenizer(meta: _Meta) -> tuple[str, dict[str, Any], list[int]]:
    """Rebuild tokenizer.json (byte-level BPE) from GGUF metadata.

    Returns (tokenizer.json text, tokenizer_config.json dict, eos ids for generation_config).
    """
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
    )

    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ModelImportError(f"tokenizer.ggml.model {kind!r} is not supported (only byte-level BPE 'gpt2')")
    tokens = list(meta.req("tokenizer.ggml.tokens"))
    types = list(meta.get("tokenizer.ggml.token_type", [1] * len(tokens)))
    merges = [tuple(m.split(" ", 1)) for m in meta.req("tokenizer.ggml.merges")]
    pre = meta.get("tokenizer.ggml.pre", "default")
    family = _PRE_FAMILY.get(pre)
    if family is None:
        log.warning("GGUF pre-tokenizer %r unknown; using the GPT-2 byte-level split", pre)
        family = "gpt2"
    vocab = {t: i for i, t in enumerate(tokens)}
    tk = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=(family == "llama3"),
                              fuse_unk=False, byte_fallback=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    if family == "gpt2":
        tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    elif family == "digits":  # llama.cpp: "\p{N}" then the GPT-2 regex, i.e. HF Digits + ByteLevel
        tk.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)])
    else:
        regex = QWEN2_REGEX if family == "qwen2" else LLAMA3_REGEX
        tk.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(regex), behavior="isolated", invert=False), byte_level])
        if family == "qwen2":  # Qwen's HF tokenizer normalises to NFC
            tk.normalizer = normalizers.NFC()
    tk.decoder = decoders.ByteLevel()
    added = [AddedToken(tokens[i], special=(t == TOKEN_TYPE_CONTROL), normalized=False)
             for i, t in enumerate(types) if t in (TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED)]
    tk.add_tokens(added)  # content already in the vocab: ids are kept; `special` flags are honoured

    def tok(key: str) -> tuple[int | None, str | None]:
        i = meta.get(key)
        return (int(i), tokens[int(i)]) if i is not None and 0 <= int(i) < len(tokens) else (None, None)

    bos_id, bos = tok("tokenizer.ggml.bos_token_id")
    eos_id, eos = tok("tokenizer.ggml.eos_token_id")
    _, pad = tok("tokenizer.ggml.padding_token_id")
    _, unk = tok("tokenizer.ggml.unknown_token_id")
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False)) and bos is not None
    if add_bos:
        tk.post_processor = processors.TemplateProcessing(
            single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1", special_tokens=[(bos, bos_id)])
    else:
        tk.post_processor = processors.ByteLevel(trim_offsets=False)
    eos_ids = [i for i in (eos_id, tok("tokenizer.ggml.eot_token_id")[0], tok("tokenizer.ggml.eom_token_id")[0])
               if i is not None]
    tcfg: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": add_bos, "add_eos_token": False,
        "bos_token": bos, "eos_token": eos, "pad_token": pad, "unk_token": unk,
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(meta.get(f"{meta.get('general.architecture')}.context_length", 2048)),
    }
    if (template := meta.get("tokenizer.chat_template")) is not None:
        tcfg["chat_template"] = template
    return tk.to_str(), tcfg, list(dict.fromkeys(eos_ids))


# llama.cpp's recommended-sampling keys (general.sampling.*) -> generation_config.json names
_SAMPLING_KEYS = {"general.sampling.temp": "temperature", "general.sampling.top_p": "top_p",
                  "general.sampling.top_k": "top_k"}


def sampling_from_gguf(meta: _Meta) -> dict[str, Any]:
    """The GGUF's recommended sampling values, if it carries any (do_sample implied)."""
    out = {name: meta.get(key) for key, name in _SAMPLING_KEYS.items() if meta.get(key) is not None}
    if "top_k" in out:
        out["top_k"] = int(out["top_k"])
    for k in ("temperature", "top_p"):
        if k in out:
            out[k] = _f32_clean(float(out[k]))
    if out:
        out["do_sample"] = True
    return out


def _write_tokenizer_files(meta: _Meta, bos_id: int | None, out: Path) -> list[int]:
    """tokenizer.json, tokenizer_config.json and generation_config.json; returns the eos ids."""
    tok_json, tcfg, eos_ids = build_tokenizer(meta)
    out.mkdir(parents=True, exist_ok=True)
    write_atomic(out / "tokenizer.json", tok_json)
    write_json_atomic(out / "tokenizer_config.json", tcfg)
    gen: dict[str, Any] = {}
    if eos_ids:
        gen["eos_token_id"] = eos_ids[0] if len(eos_ids) == 1 else eos_ids
    if bos_id is not None:
        gen["bos_token_id"] = bos_id
    gen.update(sampling_from_gguf(meta))
    write_json_atomic(out / "generation_config.json", gen)
    return eos_ids


def _open(path: Path) -> Any:
    import gguf

    try:
        # a FIFO or device is refused unread: the reader's own open would block on a FIFO
        with open_regular(path, ModelImportError):
            pass
    except FileNotFoundError:
        raise ModelImportError(f"{path}: no such GGUF file") from None
    except OSError as e:
        raise ModelImportError(f"{path}: cannot be opened ({e.strerror or e})") from None
    try:
        return gguf.GGUFReader(path)
    except Exception as e:  # GGUFReader raises ValueError/struct errors on foreign or truncated files
        raise ModelImportError(f"{path}: not a readable GGUF file: {e}") from None


def import_tokenizer(gguf_path: str | Path, out_dir: str | Path) -> Path:
    """Only the tokenizer files of `gguf_path` (no weights) into `out_dir`."""
    meta = _Meta(_open(Path(gguf_path)))
    bos = meta.get("tokenizer.ggml.bos_token_id")
    _write_tokenizer_files(meta, None if bos is None else int(bos), Path(out_dir))
    return Path(out_dir)


def import_gguf(gguf_path: str | Path, out_dir: str | Path, progress: Progress | None = None) -> Path:
    """Import `gguf_path` into the HF directory `out_dir` (config, F32 safetensors, tokenizer)."""
    import gguf

    path = Path(gguf_path)
    reader = _open(path)
    meta = _Meta(reader)
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise ModelImportError(f"{path}: architecture {arch!r} is not supported "
                               f"(supported: {', '.join(ARCHITECTURES)})")
    by_hf = {hf_name(t.name): t for t in reader.tensors}
    if "model.embed_tokens.weight" not in by_hf:
        raise ModelImportError(f"{path}: no token_embd tensor")
    n_vocab = int(by_hf["model.embed_tokens.weight"].shape[-1])
    tied = "lm_head.weight" not in by_hf
    has_bias = "model.layers.0.self_attn.q_proj.bias" in by_hf
    cfg = build_config(meta, arch, n_vocab, tied, has_bias)
    n_head, n_kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]

    def produce(p: TensorPlan) -> np.ndarray:
        t = by_hf[p.name]
        w = gguf.quants.dequantize(t.data, t.tensor_type).reshape(p.shape)
        if arch == "llama" and ".self_attn.q_proj." in p.name:
            w = unpermute_qk(w, n_head)
        elif arch == "llama" and ".self_attn.k_proj." in p.name:
            w = unpermute_qk(w, n_kv)
        return np.ascontiguousarray(w, dtype=np.float32)

    # GGUF lists dimensions fastest-first (ne0 = input features); HF/numpy order is the reverse
    plans = [TensorPlan(n, "F32", tuple(int(d) for d in reversed(t.shape.tolist()))) for n, t in by_hf.items()]
    plans.sort(key=_hf_order)
    out = Path(out_dir)
    eos_ids = _write_tokenizer_files(meta, cfg.get("bos_token_id"), out)
    if eos_ids:
        cfg["eos_token_id"] = eos_ids[0] if len(eos_ids) == 1 else eos_ids
    write_checkpoint(out, plans, produce, max_shard_bytes=4 << 30, progress=progress)
    write_json_atomic(out / "config.json", cfg)  # last: a directory with config.json is complete
    # source_path lets the quantized CPU backend take the GGUF's blocks as they are (it checks
    # them bitwise against these F32 tensors first, so a moved or changed file is only slower)
    src = {"source": path.name, "source_path": str(path.resolve()), "architecture": arch, "tensors": len(plans),
           "file_types": sorted({t.tensor_type.name for t in reader.tensors})}
    write_json_atomic(out / IMPORT_RECORD, src)
    log.info("imported %s (%s, %d tensors) -> %s", path.name, arch, len(plans), out)
    return out


def _hf_order(p: TensorPlan) -> tuple[int, int, str]:
    m = re.match(r"model\.layers\.(\d+)\.", p.name)
    if m:
        return (1, int(m.group(1)), p.name)
    return (0 if "embed_tokens" in p.name else 2, 0, p.name)
