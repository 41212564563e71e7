"""Build a ready Engine from settings: model dir -> backend choice -> memory admission -> model,
tokenizer, KV cache, snapshot store (edge_llm/backends/choice.py holds the choice, edge_llm/footprint.py the estimate).

Shared by `edge-llm generate`, `edge-llm serve`, `edge-llm doctor` and the benchmarks so all load
(and size) a model the same way. `progress(text)` is called as loading advances (the server turns
it into systemd STATUS= and EXTEND_TIMEOUT_USEC= messages).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from edge_llm.drafting import DraftConfig
from edge_llm.engine import Engine
from edge_llm.backends.choice import BackendChoice, choose_backend, without_npu
from edge_llm.footprint import (ModelSizes, admit, available_memory, calibration_estimate, estimate_memory,
                                record_estimate)
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
        from edge_llm.convert.gptq import CpuqInputs

        return open_cpu_q(model_dir, s.quant, s.threads, progress=say, decode_graph=s.decode_graph,
                          blocks=gguf_blocks(model_dir),
                          calibration=CpuqInputs(model_dir, layers_done=lambda done, total: say(
                              f"GPTQ calibration (weights without exact GGUF blocks): layer {done}/{total}"),
                              refusal=_calibration_refusal(s, model_dir)))
    if name != "rknn":
        return get_backend(name)
    if not s.rknn_dir:
        raise ConfigError("backend rknn needs rknn_dir (an `edge-llm convert rknn` output directory)")
    from edge_llm.backends.npu.backend import open_rknn

    return open_rknn(s.rknn_dir, s.rknn_runner, model_dir=model_dir,
                     progress=lambda spec: say(f"loading NPU graph {spec.name}"))


def _calibration_refusal(s: Settings, model_dir: Path) -> Callable[[], str | None] | None:
    """Asked before cpu-q's GPTQ calibration, which holds the F32 model (a 2B model's 8 GiB on a small
    board): why it cannot run here, or None (docs/quantization.md, "GPTQ for re-quantized weights")."""
    if not s.memory_check:
        return None

    def refusal() -> str | None:
        from edge_llm.convert.gptq import CPUQ_TOKENS

        est, avail = calibration_estimate(ModelSizes.of_dir(model_dir), model_dir, CPUQ_TOKENS), available_memory()
        if est.total <= avail.bytes:
            return None
        return (f"it would hold {est.describe()}, but only {avail.describe()}; build cpu-q where it fits "
                "(`edge-llm model info MODEL --quant q4`) and copy its quant directory")
    return refusal


def _admit(s: Settings, choice: BackendChoice, model_dir: Path) -> None:
    """The start-up memory admission for `choice`, before anything large is allocated (docs/board.md, "Memory")."""
    est = estimate_memory(s, choice.name, ModelSizes.of_dir(model_dir), model_dir)
    if s.memory_check:
        admit(est)
    else:
        log.info("memory: estimated %s (memory_check off: not compared)", est.describe())


def _open_backend(s: Settings, choice: BackendChoice, model_dir: Path, say: Callable[[str], None], backend=None):
    """(backend, the choice it runs under, the NPU self-test's report as a dict or None); `backend`:
    the one `choose_measured` already opened. When the self-test refuses the matmul path
    (`NpuRefused`), `auto` falls back to cpu-q (its record measured first if it has none) or cpu,
    logged and admitted again; a named `--backend rknn` stops with the refusal (docs/npu.md, "The
    start-up self-test")."""
    from edge_llm.errors import NpuRefused

    if backend is not None:
        return backend, choice, None
    try:
        backend = make_backend(s, choice, model_dir, say)
    except NpuRefused as e:
        if not choice.auto or e.report is None:
            raise
        why = f"the NPU matmul path's self-test refused it: {e.report.refused}"
        choice = without_npu(why, model_dir, s.quant)
        if choice.unmeasured == "cpu-q":
            choice, backend = _measure_cpu_q(s, choice, model_dir, say,
                                             lambda: without_npu(why, model_dir, s.quant))
        log.warning("%s", choice.describe())
        _admit(s, choice, model_dir)
        return backend or make_backend(s, choice, model_dir, say), choice, e.report.to_dict()
    if backend.name != "rknn":
        return backend, choice, None
    from edge_llm.backends.npu.matmul.decoder import MmBackend  # the matmul path's, not a graph directory's

    return backend, choice, backend.selftest if isinstance(backend, MmBackend) else None


def choose_measured(s: Settings, model_dir: Path, say: Callable[[str], None]) -> tuple[BackendChoice, object]:
    """`choose_backend`, and what its accuracy records need first (docs/quantization.md, "Accuracy
    record"): `auto` considering cpu-q before its record exists builds cpu-q and measures it, then
    asks again; an explicit cpu-q or npu-mm directory runs as asked, with a warning when its record
    fails or is missing. (choice, the cpu-q backend already opened for it or None)."""
    from edge_llm.backends.choice import cpu_q_record, rknn_record

    choice = choose_backend(s, model_dir)
    if not choice.auto:
        if choice.name == "cpu-q":
            passed, why = cpu_q_record(model_dir, s.quant)
            if passed is None:
                why = f"its accuracy record is missing ({why}; measured when backend auto first considers cpu-q)"
        elif choice.name == "rknn" and s.rknn_dir:
            passed, why = rknn_record(s.rknn_dir)  # None: a graph directory, which carries none
        else:
            passed, why = True, ""
        warn = passed is False or (passed is None and choice.name == "cpu-q")
        return (replace(choice, warning=why if passed is None else f"its {why}") if warn else choice), None
    if choice.unmeasured != "cpu-q":
        return choice, None
    return _measure_cpu_q(s, choice, model_dir, say, lambda: choose_backend(s, model_dir))


def _measure_cpu_q(s: Settings, choice: BackendChoice, model_dir: Path, say: Callable[[str], None],
                   rechoose: Callable[[], BackendChoice]) -> tuple[BackendChoice, object]:
    """`auto`'s choice once cpu-q, which has no accuracy record yet, is built and measured (first
    start): `rechoose()` asked again, cpu-q when its new record passes (with the backend opened for
    the measurement), else the next candidate."""
    from edge_llm.backends.cpuq.backend import mode, quant_dir
    from edge_llm.backends.graph.manifest import Manifest
    from edge_llm.qrecord import record_backend

    if s.memory_check:  # the measurement holds the F32 model beside cpu-q: on a small board it may not fit
        est, avail = record_estimate(s, ModelSizes.of_dir(model_dir), model_dir), available_memory()
        if est.total > avail.bytes:
            why = (f"cpu-q's accuracy record cannot be measured here (estimated {est.describe()}, but only "
                   f"{avail.describe()}): measure it where it fits (`edge-llm model info MODEL --quant {s.quant}`) "
                   "and copy its quant directory, or set backend = \"cpu-q\" (docs/quantization.md, \"Accuracy record\")")
            log.warning("backend auto: %s", why)
            return replace(choice, unmeasured=None, reason=f"{choice.reason}; {why}"), None
    log.info("backend auto: cpu-q's accuracy record is missing (%s): building and measuring it (first start)",
             choice.reason)
    say("backend auto: building cpu-q and measuring its accuracy record against F32 (first start)")
    from edge_llm.errors import EdgeLLMError

    try:
        be = make_backend(s, BackendChoice("cpu-q", "", auto=False), model_dir, say)
    except EdgeLLMError as e:  # e.g. a model cpu-q cannot export: auto's next candidate runs
        log.warning("backend auto: cpu-q did not build (%s): taking cpu", e)
        return replace(choice, unmeasured=None, reason=f"{choice.reason}; cpu-q did not build: {e}"), None
    try:
        root = quant_dir(model_dir, mode(s.quant))
        record_backend(root, Manifest.read(root).identity(), model_dir, be, "cpu-q", say)
        choice = rechoose()
    except BaseException:
        be.close()
        raise
    if choice.name != "cpu-q":
        be.close()
        be = None
    return choice, be


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
    choice, backend = choose_measured(s, model_dir, say)
    log.info("%s", choice.describe())
    if choice.warning:
        log.warning("backend %s runs as asked, but %s (docs/quantization.md, \"Accuracy record\")",
                    choice.name, choice.warning)
    _admit(s, choice, model_dir)
    backend, choice, npu_selftest = _open_backend(s, choice, model_dir, say, backend)
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
