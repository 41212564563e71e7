"""Build a ready Engine from settings: model dir -> backend choice -> memory admission -> model,
tokenizer, KV cache, snapshot store (edge_llm/backends/choice.py holds the choice, edge_llm/footprint.py the estimate).

Shared by `edge-llm generate`, `edge-llm serve`, `edge-llm doctor` and the benchmarks so all load
(and size) a model the same way. `progress(text)` is called as loading advances (the server turns
it into systemd STATUS= and EXTEND_TIMEOUT_USEC= messages).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

from edge_llm.drafting import DraftConfig
from edge_llm.engine import Engine
from edge_llm.backends.choice import BackendChoice, choose_backend, without_npu
from edge_llm.footprint import ModelSizes, admit, estimate_memory
from edge_llm.kvcache import KVCache
from edge_llm.safetext import printable
from edge_llm.settings import Settings, resolve

log = logging.getLogger(__name__)


def make_backend(s: Settings, choice: BackendChoice, model_dir: Path, say: Callable[[str], None] = lambda _t: None):
    """The backend `choice` names (edge_llm/backends/choice.py), loaded with the settings."""
    from edge_llm.backends import get_backend
    from edge_llm.errors import ConfigError

    name = choice.name
    if name == "cpu-q":
        from edge_llm.backends.cpuq.backend import open_cpu_q
        from edge_llm.checkpoints.gguf_blocks import gguf_blocks

        return open_cpu_q(model_dir, s.quant, s.threads, progress=say, decode_graph=s.decode_graph,
                          blocks=gguf_blocks(model_dir))
    if name != "rknn":
        return get_backend(name)
    if not s.rknn_dir:
        raise ConfigError("backend rknn needs rknn_dir (an `edge-llm convert rknn` output directory)")
    from edge_llm.backends.npu.backend import open_rknn

    return open_rknn(s.rknn_dir, s.rknn_runner, model_dir=model_dir,
                     progress=lambda spec: say(f"loading NPU graph {spec.name}"))


def _admit(s: Settings, choice: BackendChoice, model_dir: Path) -> None:
    """The start-up memory admission for `choice`, before anything large is allocated (docs/board.md, "Memory")."""
    est = estimate_memory(s, choice.name, ModelSizes.of_dir(model_dir), model_dir)
    if s.memory_check:
        admit(est)
    else:
        log.info("memory: estimated %s (memory_check off: not compared)", est.describe())


def _open_backend(s: Settings, choice: BackendChoice, model_dir: Path, say: Callable[[str], None]):
    """(backend, the choice it runs under, the NPU self-test's report as a dict or None). When the
    self-test refuses the matmul path (`NpuRefused`), `auto` falls back to cpu-q or cpu, logged and
    admitted again; a named `--backend rknn` stops with the refusal (docs/npu.md, "The start-up self-test")."""
    from edge_llm.errors import NpuRefused

    try:
        backend = make_backend(s, choice, model_dir, say)
    except NpuRefused as e:
        if not choice.auto or e.report is None:
            raise
        choice = without_npu(f"the NPU matmul path's self-test refused it: {e.report.refused}")
        log.warning("%s", choice.describe())
        _admit(s, choice, model_dir)
        return make_backend(s, choice, model_dir, say), choice, e.report.to_dict()
    return backend, choice, getattr(backend, "selftest", None)


def make_tower_graph(s: Settings, choice: BackendChoice, model_dir: Path, say: Callable[[str], None]):
    """The vision tower as one graph for the chosen backend (docs/vision.md), or None: numpy."""
    if not s.vision_graph:
        return None
    if choice.name == "cpu-q":
        from edge_llm.backends.tower.graph import open_ort_tower

        return open_ort_tower(model_dir, threads=s.threads, progress=say)
    if choice.name == "rknn" and s.rknn_dir:
        from edge_llm.backends.graph.runners import RunnerError
        from edge_llm.backends.tower.graph import open_rknn_tower

        try:
            # an npu-mm decoder's runners run int8 matmuls; a tower graph beside it runs on the graph runners
            runner = {"librknnrt": "rknnlite", "host": "onnxruntime"}.get(s.rknn_runner, s.rknn_runner)
            return open_rknn_tower(s.rknn_dir, runner, model_dir=model_dir, progress=say)
        except RunnerError as e:  # e.g. the NPU's 4 GB window full with an fp16 decoder (docs/vision.md)
            log.warning("vision: the NPU tower did not load (%s): images take the numpy tower", e)
            return None
    return None


def load_runtime(settings: Settings, progress: Callable[[str], None] | None = None,
                 import_progress=None) -> Engine:
    """Load model + tokenizer, allocate the KV cache, open and scan the snapshot store.

    `import_progress(done, total, what)`: byte progress of a first-use default-model import."""
    from edge_llm.checkpoints.default import resolve_model_dir
    from edge_llm.models.qwen3 import Model
    from edge_llm.tokenizer import Tokenizer

    s = resolve(settings)
    say = progress or (lambda _text: None)
    say("resolving model")
    model_dir = Path(resolve_model_dir(s.model, progress=import_progress))
    choice = choose_backend(s, model_dir)
    log.info("%s", choice.describe())
    _admit(s, choice, model_dir)
    backend, choice, npu_selftest = _open_backend(s, choice, model_dir, say)
    model = Model.load(model_dir, backend=backend,
                       progress=lambda done, total: say(f"loading weights {done}/{total} tensors"))
    vision = None
    if model.args.model_type == "qwen3_vl":
        from edge_llm.vision.model import VisionModel
        from edge_llm.vision.preprocess import ImageLimits

        say("loading the vision tower")
        vision = VisionModel.load(model_dir, model.args, backend="cpu",
                                  limits=ImageLimits(s.max_image_bytes, s.max_image_pixels),
                                  graph=make_tower_graph(s, choice, model_dir, say))
    tokenizer = Tokenizer.from_dir(model_dir)
    say("allocating the KV cache")
    cache = KVCache(model.args.geometry, max_seq=s.max_seq, kv_bs=s.kv_bs)
    chunk = model.chunk_size(s.prefill_chunk)  # the chunk rows are batched in: identity, gate, engine
    store, disk_kv_error = None, None
    if s.disk_kv is not None:
        from edge_llm.snapshot.identity import Identity
        from edge_llm.snapshot.store import SnapshotStore

        identity = Identity.for_model(model_dir, model.args, model.backend.numerics, progress=say,
                                      prefill_chunk=chunk)
        say("scanning snapshots")
        try:
            store = SnapshotStore(
                Path(s.disk_kv), identity, model.args.geometry,
                min_lcp=s.disk_kv_min_lcp, max_files=s.disk_kv_max_files,
                max_bytes=s.disk_kv_max_bytes, max_tokens=s.disk_kv_max_tokens, kv_bs=s.kv_bs,
                max_chain=s.disk_kv_max_chain, compact_idle=s.disk_kv_compact_idle,
                group_read=s.disk_kv_group_read,
            )
            store.scan()
        except OSError as e:  # a disk problem is not a reason to stop serving (nor a crash loop)
            disk_kv_error = f"disk KV unavailable: {s.disk_kv}: {e.strerror or e}"
            log.error("[KV-DISK] %s; serving without snapshots until a restart finds it usable",
                      printable(disk_kv_error))
            store = None
    gate = None
    if store is not None:  # estimates persist per namespace: same disk, same backend numerics
        from edge_llm.costgate import CostGate

        gate = CostGate(cache.geometry.kv_bytes_per_token, s.disk_kv_restore, chunk,
                        state_dir=store.ns, file_mode=store.modes.file)
    engine = Engine(model, tokenizer, cache, store=store, prefill_chunk=s.prefill_chunk,
                    model_dir=model_dir, vision=vision, restore_mode=s.disk_kv_restore, gate=gate,
                    disk_kv_error=disk_kv_error, backend_reason=choice.describe(),
                    draft=DraftConfig(s.draft, s.draft_max, s.draft_ngram), npu_selftest=npu_selftest)
    log.info("runtime ready: model %s (%s), KV cache %d MiB (max_seq %d)", printable(model_dir.name),
             model.backend.numerics, cache.nbytes >> 20, s.max_seq)
    return engine
