"""The NPU matmul path's start-up self-test: `run_self_test` -> `SelfTestReport`, cached per library
and driver, and `open_checked`, the engine opened with what the answers decide (docs/npu.md, "The
start-up self-test").

What Rockchip's sources leave open is settled on the board, before the ready line: the library's
and driver's versions, one small matmul per core mask at every M shape (bitwise the host
emulation's), whether A and C need `rknn_mem_sync` around a run, whether the parts of a round may
run at once, whether the driver switches IOMMU domains, and the model's largest part in one
context (probes.py). The engine acts on the answers: `sync` (rknn_mem_sync around every run),
`serialize` (a round's parts one after another), or a refusal (`NpuRefused`) naming the probe.

The answers are kept in `$EDGE_LLM_HOME/npu/selftest.json`, one entry per key: the library's id
(`engine.library_id`), the driver's version, `PROBE_SET`, the cores, domain and largest part; a
second start with the same key runs no probe. A refusal by a refused call (`RknnMatmulError`: the
NPU may have been busy) is not kept.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from edge_llm.backends.npu.matmul import binding as api
from edge_llm.backends.npu.matmul import probes
from edge_llm.backends.npu.matmul.engine import CORES, DECODER_DOMAIN, NpuInt8Matmul, library_id, split_weight
from edge_llm.errors import NpuRefused
from edge_llm.files import write_atomic
from edge_llm.settings import home_dir

log = logging.getLogger(__name__)

PROBE_SET = 1  # the probes' version: a change to what they check re-runs them everywhere
# rknn-llm's maintainers ask for NPU driver 0.9.7 or 0.9.8 before their own w8a8 matmuls run (the
# rknn-llm README's requirements and its issue threads); older drivers are refused
MIN_DRIVER = (0, 9, 7)
CACHE_NAME = "npu/selftest.json"


@dataclass(frozen=True)
class SelfTestReport:
    """The self-test's answers and the decisions taken on them (`to_dict` for /health, doctor and
    `bench board`; `lines` the log's and doctor's one line per decision)."""

    library: str  # engine.library_id: the first 12 hex digits of the file's sha256
    api_version: str
    driver_version: str
    driver_source: str  # rknn_query | debugfs | none
    cores: tuple[int, ...]
    domain: int
    part: tuple[int, int]  # the largest (K, N) part the engine creates for the model
    probes: dict[str, dict] = field(default_factory=dict)  # name -> {"ok": bool, "text": str}
    sync: bool = False  # rknn_mem_sync around every run
    serialize: bool = False  # a round's parts one after another
    refused: str | None = None  # why the matmul path is refused, else None
    seconds: float = 0.0  # the probes' time when they ran
    concurrent_ms: float | None = None
    serial_ms: float | None = None
    cached: bool = False  # read from the cache: no probe ran at this start
    transient: bool = False  # refused by a refused call: not cached

    def to_dict(self) -> dict:
        d = asdict(self)
        d["cores"], d["part"] = list(self.cores), list(self.part)
        d["summary"] = self.summary()
        return d

    @classmethod
    def from_dict(cls, d: dict) -> SelfTestReport:
        d = {k: v for k, v in d.items() if k in cls.__dataclass_fields__}
        return cls(**{**d, "cores": tuple(d["cores"]), "part": tuple(d["part"])})

    def summary(self) -> str:
        """One line: the outcome and the decisions (the page's server panel, /health)."""
        if self.refused:
            return f"refused: {self.refused}"
        how = ["rknn_mem_sync around runs" if self.sync else "no rknn_mem_sync",
               "rounds serialized" if self.serialize else "rounds in parallel"]
        return f"passed, driver {self.driver_version}: {', '.join(how)}" + (" (cached)" if self.cached else "")

    def lines(self) -> list[str]:
        """One line per answer and decision, as logged at start-up and shown by doctor."""
        p = self.probes
        when = "cached, no probe ran" if self.cached else f"probes ran in {self.seconds:.2f} s"
        out = [f"NPU self-test: librknnrt {self.library} (api {self.api_version}), driver {self.driver_version} "
               f"(from {self.driver_source}); {when}"]
        if "driver" in p:
            out.append(f"NPU self-test: driver: {p['driver']['text']}")
        if "coherency" in p:
            out.append(f"NPU self-test: coherency: {p['coherency']['text']} -> "
                       + ("rknn_mem_sync on A before and C after every run" if self.sync else "no rknn_mem_sync"))
        if "products" in p:
            out.append(f"NPU self-test: products: {p['products']['text']}")
        if "concurrency" in p:
            out.append(f"NPU self-test: concurrency: {p['concurrency']['text']} -> "
                       + ("rounds serialized on one thread" if self.serialize else "a round's parts at once"))
        if "domain" in p:
            out.append(f"NPU self-test: IOMMU domain {self.domain} used; {p['domain']['text']}")
        if "head" in p:
            out.append(f"NPU self-test: largest part: {p['head']['text']}")
        out.append(f"NPU self-test: matmul path refused: {self.refused}" if self.refused
                   else "NPU self-test: matmul path accepted")
        return out

    def markdown(self) -> str:
        return "\n".join(f"- {line.removeprefix('NPU self-test: ')}" for line in self.lines())


def largest_part(shapes: Sequence[tuple[int, int]], cores: Sequence[int] = CORES) -> tuple[int, int]:
    """The (K, N) of the widest block (then the tallest) `split_weight` cuts the weights into."""
    blocks = [b for k, n in shapes for b in split_weight(k, n, len(cores))]
    b = max(blocks, key=lambda b: (b.n1 - b.n0, b.k1 - b.k0))
    return b.k1 - b.k0, b.n1 - b.n0


def cache_path() -> Path:
    return home_dir() / CACHE_NAME


def _key(library: str, driver: str, cores: Sequence[int], domain: int, part: tuple[int, int]) -> str:
    return (f"library {library}|driver {driver}|probes {PROBE_SET}|cores {','.join(map(str, cores))}|"
            f"domain {domain}|part {part[0]}x{part[1]}")


def _read_cache(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
        return data if isinstance(data, dict) else {}
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:  # a damaged cache costs one run of the probes, nothing else
        log.warning("NPU self-test: cache %s unreadable (%s): running the probes", path, e)
        return {}


def _write_cache(path: Path, key: str, report: SelfTestReport) -> None:
    data = _read_cache(path)
    data[key] = {k: v for k, v in report.to_dict().items() if k not in ("summary", "cached")}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, json.dumps(data, indent=1, sort_keys=True) + "\n")
    except OSError as e:
        log.warning("NPU self-test: cannot keep the answers in %s (%s): they run again next start", path, e)


def run_self_test(lib: api.MatmulLib, part: tuple[int, int], cores: Sequence[int] = CORES,
                  domain: int = DECODER_DOMAIN, cache: Path | None = None, sysroot: str | Path = "/") -> SelfTestReport:
    """The answers for this library, driver and model part: from `cache` (None: `cache_path()`)
    when its key is there, else from the probes (then kept there unless `transient`)."""
    cache = cache_path() if cache is None else cache
    cores = tuple(cores)
    t0 = time.perf_counter()
    api_v, drv, source = probes.versions(lib, cores[0], domain, sysroot)
    lib_id = library_id(lib.path)
    key = _key(lib_id, drv, cores, domain, part)
    hit = _read_cache(cache).get(key)
    if hit is not None:
        try:
            return replace(SelfTestReport.from_dict(hit), cached=True)
        except (KeyError, TypeError, ValueError) as e:
            log.warning("NPU self-test: cache entry unusable (%s): running the probes", e)
    base = SelfTestReport(lib_id, api_v, drv, source, cores, domain, part)
    report = _probe(lib, base)
    report = replace(report, seconds=round(time.perf_counter() - t0, 4))
    if not report.transient:
        _write_cache(cache, key, report)
    return report


def _probe(lib: api.MatmulLib, r: SelfTestReport) -> SelfTestReport:
    """The probes in order, each deciding on the answers before it; the first refusal ends them."""
    found: dict[str, dict] = {}

    def done(name: str, p: probes.Probe) -> bool:
        found[name] = {"ok": p.ok, "text": p.text}
        return p.ok

    def refuse(why: str, p: probes.Probe | None = None, **kw) -> SelfTestReport:
        call = bool(p and p.call)  # a refused call: name the domain the contexts were in
        return replace(r, probes=found, refused=why + (f" (contexts in IOMMU domain {r.domain})" if call else ""),
                       transient=call, **kw)

    drv = probes.parse_driver(r.driver_version)
    least = ".".join(map(str, MIN_DRIVER))
    if drv is not None and drv < MIN_DRIVER:
        done("driver", probes.Probe(False, f"{r.driver_version} is older than {least}"))
        return refuse(f"NPU driver {r.driver_version} is older than {least}, the oldest rknn-llm's maintainers "
                      "support for w8a8 matmuls: update the board's kernel (docs/board.md)")
    done("driver", probes.Probe(True, f"{r.driver_version} (at least {least})" if drv else
                                f"version unknown (no rknn_query answer, no debugfs): not checked against {least}"))
    core = r.cores[0]
    sync = False
    p = probes.coherency(lib, core, r.domain, sync=False)
    if not done("coherency", p):
        if p.call:
            return refuse(f"the coherency probe failed: {p.text}", p)
        if not lib.has("rknn_mem_sync"):
            return refuse(f"A or C not coherent ({p.text}) and the library has no rknn_mem_sync", p)
        p2 = probes.coherency(lib, core, r.domain, sync=True)
        if not done("coherency", p2):
            return refuse(f"A or C wrong even with rknn_mem_sync: {p2.text}", p2)
        found["coherency"]["text"] = f"without rknn_mem_sync: {p.text}; with it: coherent"
        sync = True
    p = probes.products(lib, r.cores, r.domain, sync)
    if not done("products", p):
        return refuse(f"a product differs from the host emulation: {p.text}", p, sync=sync)
    serialize, t_once, t_one = False, None, None
    if len(r.cores) > 1:
        p, t_once, t_one = probes.concurrency(lib, r.cores, r.domain, sync)
        if not done("concurrency", p):
            if not p.serialize:
                return refuse(f"the concurrency probe failed: {p.text}", p, sync=sync)
            serialize = True
    done("domain", probes.domain_switch(lib, core, r.domain))
    p = probes.head_part(lib, core, r.domain, r.part, sync)
    if not done("head", p):
        return refuse(f"the model's largest part fails: {p.text}", p, sync=sync, serialize=serialize)
    return replace(r, probes=found, sync=sync, serialize=serialize,
                   concurrent_ms=None if t_once is None else round(t_once * 1e3, 4),
                   serial_ms=None if t_one is None else round(t_one * 1e3, 4))


def open_checked(part: tuple[int, int], lib: str | None = None, cores: Sequence[int] = CORES,
                 domain: int = DECODER_DOMAIN, cache: Path | None = None) -> NpuInt8Matmul:
    """The engine over `lib` (None: `$EDGE_LLM_LIBRKNNRT`, else the loader's librknnrt.so) after the
    self-test for a model whose largest part is `part`: its lines logged, the engine set as they
    decide; `NpuRefused` (with the report) when they refuse the matmul path."""
    m = api.load_library(api.library_path(lib))
    report = run_self_test(m, part, cores, domain, cache)
    for line in report.lines():
        log.log(logging.WARNING if report.refused else logging.INFO, "%s", line)
    if report.refused:
        raise NpuRefused(f"the NPU matmul path's self-test refused it: {report.refused}", report)
    eng = NpuInt8Matmul(m, cores, domain, sync=report.sync, serial=report.serialize)
    eng.selftest = report
    return eng
