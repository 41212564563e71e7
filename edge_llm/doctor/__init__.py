"""Board health checks for `edge-llm doctor`: each returns a `Check` (pass / warn / fail / n/a).

Every filesystem path is read below `sysroot` (default "/"), so tests can point the checks at
a fabricated /sys, /proc, /dev and /etc tree and exercise the RK3588 branch on any machine.
On machines that are not an RK3588 the NPU items report "n/a" instead of failing (on other
aarch64 machines the rknn-toolkit-lite2 package is still checked, as a warning at worst).

Here: the order they run in, the software and model checks, the backend `auto` would choose,
and the memory check (the estimate and the availability the server's start-up admission uses,
edge_llm/footprint.py). The board's checks are `board.py`, the kv
directory's `storage.py`; what they share (`Check`, `Probe`: settings + sysroot) `probe.py`.
"""

from __future__ import annotations

import importlib.metadata as md
import logging
import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import psutil

from edge_llm.config import ModelArgs
from edge_llm.backends.choice import BackendChoice, choose_backend, quant_runtime
from edge_llm.footprint import available_memory, estimate_memory, refusal
from edge_llm.settings import Settings, models_dir
from edge_llm.doctor.board import BoardChecks
from edge_llm.doctor.probe import FAIL, NA, PASS, WARN, Check, ModelSizes
from edge_llm.doctor.storage import StorageChecks
from edge_llm.snapshot.layout import SNAPSHOT_GLOB

if TYPE_CHECKING:
    from edge_llm.snapshot.identity import Identity

log = logging.getLogger(__name__)

__all__ = ["FAIL", "NA", "PASS", "WARN", "Check", "Doctor", "ModelSizes", "run_checks"]


class Doctor(BoardChecks, StorageChecks):
    """Runs the checks against the serve settings (`model` "" = not configured); `run()` returns
    them in a fixed order. `sysroot`: read /sys, /proc, /dev, /etc below this directory."""

    def run(self) -> list[Check]:
        try:  # the model's sizes feed the memory and kv-space checks: computed once, passed on
            model, sizes = self.model()
        except Exception as e:
            log.exception("doctor check model failed")
            model, sizes = Check("model", WARN, f"check crashed: {e!r}", "report this as a bug"), None
        # (name, function, RK3588 only); rknn-toolkit-lite2 is also checked on any aarch64 machine,
        # where the `board` extra installs it (the package, not the NPU)
        checks: list[tuple[str, Callable[[], Check], bool]] = [
            ("python", self.python, False), ("packages", self.packages, False), ("board", self.board, False),
            ("rknn-toolkit-lite2", self.rknn_lite, not self.aarch64), ("librknnrt", self.librknnrt, True),
            ("npu-driver", self.npu_driver, True), ("npu-device", self.npu_device, True),
            ("cpu-governor", self.cpu_governor, False),
            ("npu-governor", lambda: self.devfreq("npu-governor", "*npu*"), True),
            ("ddr-governor", lambda: self.devfreq("ddr-governor", "*dmc*"), True),
            ("open-files", self.open_files, False), ("rknn-dir", self.rknn_dir, False),
            ("npu-selftest", self.npu_selftest, False),
            ("model", lambda: model, False), ("backend", self.backend, False),
            ("memory", lambda: self.memory(sizes), False),
            ("kv-filesystem", self.kv_filesystem, False), ("kv-space", lambda: self.kv_space(sizes), False),
            ("kv-private", self.kv_private, False),
            ("emmc-life", self.emmc_life, False), ("clock", self.clock, False)]
        out = []
        for name, fn, rk_only in checks:
            if rk_only and not self.rk3588:
                out.append(Check(name, NA, self.not_rk))
                continue
            try:
                out.append(fn())
            except Exception as e:  # a broken check must not hide the others
                log.exception("doctor check %s failed", name)
                out.append(Check(name, WARN, f"check crashed: {e!r}", "report this as a bug"))
        return out

    # ---- software --------------------------------------------------------------------
    def python(self) -> Check:
        v = sys.version.split()[0]
        if sys.version_info >= (3, 10):
            return Check("python", PASS, f"Python {v} ({sys.executable})")
        return Check("python", FAIL, f"Python {v}", "install Python >= 3.10")

    def packages(self) -> Check:
        try:
            reqs = md.requires("edge-llm") or []
            own = md.version("edge-llm")
        except md.PackageNotFoundError:
            return Check("packages", FAIL, "edge-llm is not installed as a package", "pip install .[board]")
        try:
            from packaging.requirements import Requirement
        except ImportError:  # pip vendors packaging but does not always install it
            Requirement = None
        missing, bad, seen = [], [], []
        for line in reqs:
            name = re.split(r"[ ;<>=!~\[]", line, 1)[0]
            if Requirement is not None:
                req = Requirement(line)
                if req.marker is not None and not req.marker.evaluate({"extra": ""}):
                    continue
            elif "extra ==" in line:
                continue
            try:
                ver = md.version(name)
            except md.PackageNotFoundError:
                missing.append(name)
                continue
            seen.append(f"{name} {ver}")
            if Requirement is not None and not req.specifier.contains(ver, prereleases=True):
                bad.append(f"{name} {ver} (needs {req.specifier})")
        detail = f"edge-llm {own}; {len(seen)} requirements installed (numpy {md.version('numpy')})"
        if missing or bad:
            return Check("packages", FAIL, detail + "; missing: " + ", ".join(missing + bad),
                         "pip install --upgrade 'edge-llm[board,quant]' in the service venv")
        return Check("packages", PASS, detail)

    # ---- model and memory ------------------------------------------------------------
    def model(self) -> tuple[Check, ModelSizes | None]:
        """The model check, and the model's sizes when they could be read."""
        if self.o.model in (None, ""):
            return Check("model", WARN, "no model configured", "set model = \"DIR\" in /etc/edge-llm/edge-llm.toml"), None
        d = Path(self.o.model)
        if self.o.model == "default":
            from edge_llm.checkpoints import (
                default as dm,  # lazy: the importer pulls in gguf
            )
            from edge_llm.checkpoints.gguf_header import gguf_sizes

            if not dm.default_model_ready():
                try:
                    gguf = dm.default_gguf_path()
                except Exception as e:
                    return Check("model", FAIL, f"embedded default model: {e}", dm.SMOLLM2_PIP), None
                params, bpt = gguf_sizes(gguf)
                return Check("model", PASS, f"embedded default model {gguf.name} ({params / 1e6:.0f}M "
                             f"parameters), imported into {models_dir()} on first start"), \
                    ModelSizes.of_params("default model", params, bpt, 1)
            d = models_dir() / dm.DEFAULT_MODEL_NAME
        try:
            args = ModelArgs.from_dir(d)
            sizes = ModelSizes.of_dir(d)  # headers only
        except Exception as e:  # ConfigError / WeightsError name the problem
            return Check("model", FAIL, str(e), "point `model` at a complete HF model directory"), None
        self.model_dir = d
        f32 = sizes.weights_f32
        detail = f"{d}: {args.model_type}, {args.num_hidden_layers} layers, {f32 / 2**30:.2f} GiB as F32"
        if not (d / "tokenizer.json").is_file():
            return Check("model", FAIL, detail + "; tokenizer.json missing", "copy tokenizer.json into the model dir"), sizes
        try:
            from edge_llm.backends.cpu.backend import cpu_numerics
            from edge_llm.snapshot.identity import (
                Identity,  # lazy: hashes the weights once (cached)
            )

            ident = Identity.for_model(d, args, cpu_numerics(), prefill_chunk=self.o.prefill_chunk)
        except Exception as e:
            return Check("model", WARN, detail + f"; identity not computed: {e}"), sizes
        choice = self.choice()
        backend = choice.name
        # auto's cpu while cpu-q's accuracy record is unmeasured is not yet what the server runs: its first
        # start measures the record and may take cpu-q (docs/quantization.md, "Accuracy record")
        if backend == "cpu" and not choice.unmeasured:
            ns = Path(self.o.disk_kv or "") / ident.namespace
            n = len(list(ns.glob(SNAPSHOT_GLOB))) if self.o.disk_kv and ns.is_dir() else 0
            return Check("model", PASS, detail + f"; model_id {ident.namespace} ({n} snapshot(s) in its namespace)"), sizes
        # another backend's numerics (graph manifest, runtime version, threads) are known only once
        # it is loaded: name the namespaces this model already has instead of guessing one
        if choice.unmeasured:
            backend = f"{backend} until cpu-q's accuracy record is measured"
        return Check("model", PASS, detail + f"; backend {backend}: its namespace is named at start-up "
                     f"from its numerics; {self._model_namespaces(ident)}"), sizes

    def _model_namespaces(self, ident: Identity) -> str:
        """The kv dir's namespaces of this model (any backend): 'name (numerics, N snapshot(s))'."""
        if not self.o.disk_kv or not Path(self.o.disk_kv).is_dir():
            return "no namespaces yet"
        from edge_llm.snapshot.identity import read_identity

        want = {k: v for k, v in ident.canonical().items() if k != "backend_numerics"}
        found = []
        for ns in sorted(p for p in Path(self.o.disk_kv).iterdir() if p.is_dir()):
            doc = read_identity(ns) or {}
            if {k: doc.get(k) for k in want} == want:
                found.append(f"{ns.name} ({doc.get('backend_numerics', '?')}, "
                             f"{len(list(ns.glob(SNAPSHOT_GLOB)))} snapshot(s))")
        return "namespaces of this model: " + ", ".join(found) if found else "no namespace of this model yet"

    def choice(self) -> BackendChoice:
        """The backend the server would run here (computed once: the model, backend and memory
        checks all use it)."""
        if self._choice is None:
            self._choice = choose_backend(self.o, self.model_dir or "", self.root)
        return self._choice

    def backend(self) -> Check:
        """The backend the server would run: `auto`'s choice and its reason (as logged at start).

        cpu-q missing is a warning only when something asks for the fastest backend: `auto` named
        by the configuration, the environment or a flag (the service's configuration does). A
        named `cpu` (`make serve`'s default) and the built-in default `auto` that nobody set get it
        as information (docs/board.md, "Which backend runs")."""
        c = self.choice()
        fix = "pip install 'edge-llm[board,quant]' in the service venv for the 4-bit backend (board/install.sh does)"
        if c.name == "cpu" and c.auto and self.o.source("backend") is not None and quant_runtime() is None:
            return Check("backend", WARN, c.describe(), fix)
        # cpu-q installed but not taken: its accuracy record fails or is not measured yet, which
        # the reason says (docs/quantization.md, "Accuracy record"); installing fixes nothing
        if c.name == "cpu" and not c.auto and quant_runtime() is None:
            return Check("backend", PASS, c.describe() + "; cpu-q is not installed here (onnxruntime not "
                         "importable), not needed for backend cpu")
        return Check("backend", PASS, c.describe())

    def memory(self, sizes: ModelSizes | None) -> Check:
        """The start-up admission's estimate against what is available (the same numbers)."""
        vm = psutil.virtual_memory()
        if sizes is None:
            return Check("memory", NA, f"model not usable; {vm.available / 2**30:.2f} GiB available "
                         f"of {vm.total / 2**30:.2f} GiB")
        est = estimate_memory(self.o, self.choice().name, sizes, self.model_dir)
        avail = available_memory()
        detail = f"{sizes.label}: estimated {est.describe()}; {avail.describe()}, {vm.total / 2**30:.2f} GiB total"
        line = refusal(est, avail)
        if line is not None:
            fix = line.split("; fix: ", 1)[1]
            if not self.o.memory_check:
                return Check("memory", WARN, detail + "; memory_check is off: the server starts anyway", fix)
            return Check("memory", FAIL, detail + "; the server refuses to start (exit 78)", fix)
        if est.total > 0.9 * vm.total:  # the unit's MemoryMax=90%: refused under systemd
            return Check("memory", FAIL, detail + "; above the unit's MemoryMax=90%", "a smaller max_seq")
        return Check("memory", PASS, detail)

    # ---- storage ---------------------------------------------------------------------

def run_checks(settings: Settings, sysroot: str = "/") -> list[Check]:
    """All checks for these settings, in display order."""
    return Doctor(settings, sysroot).run()
