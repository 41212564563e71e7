"""`edge-llm model`: import-gguf, synth, info, digest."""

from __future__ import annotations

import logging
from pathlib import Path

import click

from edge_llm.cli.progress import progress_bar, resolve_model_with_bar, step_progress
from edge_llm.logsetup import setup_cli_logging
from edge_llm.settings import DEFAULTS


def _fail(e: Exception) -> None:
    raise click.ClickException(str(e))


@click.group("model")
def model() -> None:
    """Import, synthesise and inspect model directories."""
    setup_cli_logging(logging.WARNING)


@model.command("import-gguf")
@click.argument("gguf_file", type=click.Path(exists=True, dir_okay=False))
@click.argument("out_dir", type=click.Path(file_okay=False))
def import_gguf_cmd(gguf_file: str, out_dir: str) -> None:
    """Import a GGUF (llama / qwen2 / qwen3) into an HF directory with F32 weights."""
    from edge_llm.checkpoints.gguf_import import import_gguf
    from edge_llm.errors import EdgeLLMError

    try:
        with progress_bar("dequantising") as cb:
            out = import_gguf(gguf_file, out_dir, progress=cb)
    except EdgeLLMError as e:
        _fail(e)
    click.echo(f"imported {gguf_file} -> {out}")


@model.command("synth")
@click.option("--preset", type=click.Choice(["qwen3-vl-2b", "tiny"]), default="qwen3-vl-2b", show_default=True,
              help="Geometry: Qwen3-VL-2B's published one, or a tiny one for fast tests.")
@click.option("--layers", type=click.IntRange(1), default=None, help="Number of decoder layers (default: preset's).")
@click.option("--seed", type=int, default=0, show_default=True,
              help="Seed of the random weights (each tensor seeded by it and its name).")
@click.option("--vision/--no-vision", default=True, show_default=True,
              help="Write the vision tower (published Qwen3-VL-2B vision geometry for qwen3-vl-2b).")
@click.argument("out_dir", type=click.Path(file_okay=False))
def synth_cmd(preset: str, layers: int | None, seed: int, vision: bool, out_dir: str) -> None:
    """Write a random-weight qwen3_vl checkpoint (BF16) with the real Qwen3 tokenizer."""
    from edge_llm.checkpoints.synth import synth_checkpoint
    from edge_llm.errors import EdgeLLMError

    try:
        with progress_bar(f"synth {preset}") as cb:
            out = synth_checkpoint(out_dir, preset=preset, layers=layers, seed=seed, progress=cb,
                                       vision=vision)
    except EdgeLLMError as e:
        _fail(e)
    click.echo(f"wrote {preset} checkpoint -> {out}")


def _param_counts(model_dir, prefix: str, vision_prefix: str = "model.visual."
                  ) -> tuple[int, int, int, dict[str, int], int]:
    """(all, text-model, vision-tower params, dtype -> count, bytes on disk) from safetensors headers."""
    from edge_llm.checkpoints.safetensors_writer import read_safetensors_header
    from edge_llm.weights import safetensors_files

    total = text = vis = size = 0
    dtypes: dict[str, int] = {}
    for path in safetensors_files(model_dir):
        size += path.stat().st_size
        for name, entry in read_safetensors_header(path).items():
            if name == "__metadata__":
                continue
            n = 1
            for d in entry["shape"]:
                n *= d
            total += n
            dtypes[entry["dtype"]] = dtypes.get(entry["dtype"], 0) + n
            if name.startswith(prefix) or name == "lm_head.weight":
                text += n
            elif name.startswith(vision_prefix):
                vis += n
    return total, text, vis, dtypes, size


@model.command("info")
@click.argument("model_dir", default="default")
@click.option("--max-seq", type=click.IntRange(1), default=DEFAULTS.max_seq, show_default=True,
              help="Context length for the KV size line.")
@click.option("--quant", type=click.Choice(["q4"]), default=None,
              help="Also build (or find) backend cpu-q's quantized weights and list which are exact.")
def info_cmd(model_dir: str, max_seq: int, quant: str | None) -> None:
    """Geometry, KV bytes per token and parameter count of MODEL_DIR (or 'default'), and its
    quantized weights for backend cpu-q (which GGUF blocks are kept exactly, which re-quantized)."""
    from edge_llm.config import ModelArgs, vision_args_from_dir
    from edge_llm.errors import EdgeLLMError

    try:
        d = resolve_model_with_bar(model_dir)
        a = ModelArgs.from_dir(d)
        v = vision_args_from_dir(d)
        total, text, vis, dtypes, size = _param_counts(d, a.weight_prefix)
    except EdgeLLMError as e:
        _fail(e)
    g = a.geometry
    rope = f"theta {a.rope_theta:g}, {a.rope_type}"
    if a.mrope_section:
        rope += f", mrope {list(a.mrope_section)}{' interleaved' if a.mrope_interleaved else ''}"
    rows = [
        ("directory", str(d)),
        ("model_type", a.model_type),
        ("layers", a.num_hidden_layers),
        ("hidden / intermediate", f"{a.hidden_size} / {a.intermediate_size}"),
        ("heads (q / kv) x head_dim", f"{a.num_attention_heads} / {a.num_key_value_heads} x {a.head_dim}"),
        ("vocab", a.vocab_size),
        ("tied embeddings", a.tie_word_embeddings),
        ("qk-norm / qkv bias", f"{a.qk_norm} / {a.attention_bias}"),
        ("rope", rope),
        ("rms_norm_eps", f"{a.rms_norm_eps:g}"),
        ("KV bytes per token (F32)", f"{g.kv_bytes_per_token:,}"),
        (f"KV bytes at {max_seq} tokens", f"{g.kv_bytes_per_token * max_seq:,} ({g.kv_bytes_per_token * max_seq / 2**20:.1f} MiB)"),
        ("parameters (text model)", f"{text:,}"),
        ("vision tower", "none" if v is None or not vis else
         f"{v.depth} blocks, hidden {v.hidden_size} / {v.intermediate_size}, {v.num_heads} heads, "
         f"patch {v.patch_size} x{v.temporal_patch_size}, merge {v.spatial_merge_size}, "
         f"deepstack {list(v.deepstack_visual_indexes)} -> {v.out_hidden_size}"),
        ("parameters (vision tower)", f"{vis:,}"),
        ("parameters (all tensors)", f"{total:,}"),
        ("weights on disk", f"{size:,} bytes ({', '.join(f'{k}: {v:,}' for k, v in sorted(dtypes.items()))})"),
    ]
    try:
        rows += _quant_rows(d, quant)
    except EdgeLLMError as e:
        _fail(e)
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        click.echo(f"{k:<{width}}  {v}")


def _quant_rows(model_dir, build: str | None) -> list[tuple[str, str]]:
    """One row per cpu-q weight set of this model (built first for `build`)."""
    from collections import Counter

    from edge_llm.backends.choice import cpu_q_record as record_of
    from edge_llm.backends.cpuq import backend as cpuq
    from edge_llm.backends.graph.manifest import Manifest
    from edge_llm.checkpoints.gguf_blocks import gguf_blocks
    from edge_llm.convert.gptq import CpuqInputs

    if build:
        with step_progress(f"cpu-q {build}") as cb:
            cpuq.ensure_quantized(model_dir, cpuq.mode(build), progress=cb,
                                  blocks=gguf_blocks(model_dir), calibration=CpuqInputs(model_dir))
            if record_of(model_dir, build)[0] is None:  # built now, or before records existed
                from edge_llm.qrecord import record_backend

                be = cpuq.open_cpu_q(model_dir, build, blocks=gguf_blocks(model_dir), calibration=CpuqInputs(model_dir))
                try:
                    root = cpuq.quant_dir(model_dir, cpuq.mode(build))
                    record_backend(root, Manifest.read(root).identity(), model_dir, be, "cpu-q", cb)
                finally:
                    be.close()
    out = []
    for name, qm in cpuq.MODES.items():
        # the directory name holds the weight digest: hash the checkpoint (seconds for GBs) only
        # when a weight set of this model and mode exists at all
        if not any(cpuq.quant_root().glob(f"{Path(model_dir).resolve().name}-*-{qm.name}/manifest.json")):
            continue
        root = cpuq.quant_dir(model_dir, qm)
        if not (root / "manifest.json").is_file():
            continue
        weights = Manifest.read(root).build.get("weights", [])
        exact = Counter(w["origin"] for w in weights if w["exact"])
        req = Counter(f"{w['origin']} -> {w['bits']}-bit" for w in weights if not w["exact"])
        nbytes = sum(w["bytes"] for w in weights)
        desc = [f"{sum(exact.values())} exact ({', '.join(f'{k}: {v}' for k, v in sorted(exact.items()))})" if exact else "0 exact",
                f"{sum(req.values())} re-quantized" + (f" ({', '.join(f'{k}: {v}' for k, v in sorted(req.items()))})"
                                                       if req else "")]
        out.append((f"cpu-q {name} weights ({qm.label})", f"{'; '.join(desc)}; {nbytes / 1e6:.1f} MB in {root}"))
        passed, why = record_of(model_dir, name)
        out.append((f"cpu-q {name} accuracy", why + (" (measured when backend auto first considers cpu-q, or by "
                                                      f"`edge-llm model info --quant {name}`)" if passed is None else "")))
    if not out:
        out.append(("cpu-q weights", "not built yet (`edge-llm model info --quant q4`, or first use of --backend cpu-q)"))
    return out


@model.command("digest")
@click.argument("model_dir", default="default")
def digest_cmd(model_dir: str) -> None:
    """Weight, tokenizer and model_id digests of MODEL_DIR (backend cpu, this machine's numpy kernels)."""
    from edge_llm.backends.cpu.backend import cpu_numerics
    from edge_llm.config import ModelArgs
    from edge_llm.errors import EdgeLLMError
    from edge_llm.snapshot.identity import Identity

    try:
        d = resolve_model_with_bar(model_dir)
        ident = Identity.for_model(d, ModelArgs.from_dir(d), cpu_numerics())
    except EdgeLLMError as e:
        _fail(e)
    click.echo(f"weights    {ident.weights_digest}")
    click.echo(f"tokenizer  {ident.tokenizer_digest}")
    click.echo(f"model_id   {ident.model_id:016x}  (backend {ident.backend_numerics}, prefill chunk {ident.prefill_chunk}; "
               f"namespace {ident.namespace})")
