"""The module layering of docs/architecture.md, checked on every import (also lazy, function-level
ones): across packages an import goes strictly down the layer table (never to the same layer),
inside a package it goes strictly back along the package's declared module order."""

import ast
import re
import subprocess
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "edge_llm"

# unit (a package or a top-level module, dotted relative to edge_llm) -> layer; a unit imports
# only units of a lower layer. `__init__` is edge_llm/__init__.py (the version).
LAYERS = {
    "errors": 0, "progress": 0, "quality_text": 0, "files": 0, "safetext": 0, "__init__": 0,
    "config": 1, "settings": 1, "token_bound": 1,
    "weights": 2, "tokenizer": 2, "kvcache": 2, "costgate": 2,
    "backends": 3, "snapshot": 3,
    "models": 4, "checkpoints": 4,
    "vision": 5, "sampling": 5, "drafting": 5, "qrecord": 5,
    "engine": 6, "footprint": 6, "convert": 6,
    "runtime": 7, "logsetup": 7, "sdnotify": 7,
    "server": 8, "bench": 8, "doctor": 8,
    "cli": 9,
    "__main__": 10,
}

# package -> its modules low to high: a module imports only modules listed before it
# (`__init__` is the package's own __init__.py; a subpackage is one entry of its parent)
ORDER = {
    "backends": ["gptq", "cost", "record", "kernels", "cpu", "__init__", "graph", "cpuq", "npu", "tower", "choice"],
    "backends.cpu": ["backend", "tower", "__init__"],
    "backends.kernels": ["__init__"],
    "backends.graph": ["schema", "manifest", "cpu_side", "runners", "backend", "onnx_export", "__init__"],
    "backends.cpuq": ["nbits", "nbits_export", "decode_export", "decode_step", "backend", "__init__"],
    "backends.npu": ["graphs", "matmul", "backend", "__init__"],
    "backends.npu.graphs": ["wire", "toolkit_worker", "sim", "rknnlite", "__init__"],
    "backends.npu.matmul": ["int8", "binding", "rounds", "engine", "probes", "selftest", "row_ops", "row_step", "verify", "decoder", "__init__"],
    "backends.tower": ["seam", "export", "graph", "__init__"],
    "snapshot": ["writer", "layout", "encode", "decode", "format", "inspect", "entries", "chains", "catalog",
                 "chain_read", "saver", "identity", "store", "maintenance", "archive", "transfer", "__init__"],
    "kvcache": ["records", "cache", "__init__"],
    "doctor": ["probe", "board", "storage", "__init__"],
    "models": ["rope", "qwen3", "__init__"],
    "checkpoints": ["packaged", "gguf_header", "safetensors_writer", "gguf_import", "synth", "default",
                    "gguf_blocks", "__init__"],
    "vision": ["preprocess", "positions", "encoder", "model", "__init__"],
    "convert": ["report", "calibration_text", "hadamard", "gptq", "npu_mm", "calibration", "w8a8", "rknn", "vision", "__init__"],
    "server": ["errors", "hosts", "schemas", "metrics", "node", "prefetch", "worker", "budget", "images", "streaming", "ui", "events", "state", "storeview", "app",
               "__init__"],
    "bench": ["disk", "procstat", "prompts", "models", "rkllm", "client", "keepalive", "fleet", "fleet_load", "throttle", "restore", "conversation", "ttft",
              "split", "recovery", "quant", "accuracy", "quant_emulate", "quant_variants", "quant_memory", "decode", "npu", "board", "vision", "llamacpp_peer",
              "__init__"],
    "bench.npu": ["predict", "a76", "matmul", "cpu", "run", "__init__"],
    "cli": ["options", "progress", "bench", "convert", "doctor", "generate", "kv", "kv_transfer", "model", "serve", "__init__"],
    "cli.bench": ["common", "accuracy", "board", "compute", "decode", "fleet", "npu", "quant", "recovery", "restore", "vision", "__init__"],
}


def modules():
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__" and len(parts) > 1:
            parts = parts[:-1]
        yield ".".join(parts), path


def packages() -> set[str]:
    return {".".join(p.relative_to(PKG).parent.parts) for p in PKG.rglob("__init__.py") if p.parent != PKG}


def unit_of(dotted: str, layers: dict[str, int]) -> str:
    parts = dotted.split(".")
    for k in range(len(parts), 0, -1):
        if (key := ".".join(parts[:k])) in layers:
            return key
    raise KeyError(f"{dotted}: in no unit of the layer table")


def _member(name: str, pkg: str) -> str:
    """The entry of `pkg`'s order list that `name` (pkg itself or a module below it) falls under."""
    return "__init__" if name == pkg else name[len(pkg) + 1:].split(".")[0]


def violations(graph: dict[str, set[str]], layers: dict[str, int] = LAYERS,
               order: dict[str, list[str]] = ORDER, pkgs: set[str] | None = None) -> list[str]:
    """Every import edge that breaks the layering: across units not strictly down, inside a
    package not strictly back along its order."""
    pkgs = packages() if pkgs is None else pkgs
    bad = []
    for a in sorted(graph):
        for b in sorted(graph[a]):
            ua, ub = unit_of(a, layers), unit_of(b, layers)
            if ua != ub:
                if layers[ub] >= layers[ua]:
                    how = "the same layer" if layers[ub] == layers[ua] else "a higher layer"
                    bad.append(f"{a} (layer {layers[ua]}) imports {b} (layer {layers[ub]}): {how}")
                continue
            pa, pb = a.split("."), b.split(".")
            common = next(k for k in range(min(len(pa), len(pb)), -1, -1) if pa[:k] == pb[:k])
            # the innermost package holding both (a package's own name stands for its __init__)
            pkg = next(".".join(pa[:k]) for k in range(common, 0, -1) if ".".join(pa[:k]) in pkgs)
            ma, mb = _member(a, pkg), _member(b, pkg)
            seq = order.get(pkg)
            if seq is None or ma not in seq or mb not in seq:
                bad.append(f"{a} imports {b}: {pkg} has no order entry for {ma if seq and ma not in seq else mb}")
            elif seq.index(mb) >= seq.index(ma):
                bad.append(f"{a} imports {b}: {mb} is not before {ma} in {pkg}'s order")
    return bad


def test_imports_go_strictly_down():
    assert not (v := violations(import_graph())), "layering broken:\n" + "\n".join(v)


def test_every_package_declares_its_order():
    """Each package's list names exactly its modules (and subpackages), each once."""
    members: dict[str, set[str]] = {}
    for name, _ in modules():
        for pkg in packages():
            if name == pkg or name.startswith(pkg + ".") and "." not in name[len(pkg) + 1:]:
                members.setdefault(pkg, set()).add(_member(name, pkg))
    assert set(ORDER) == set(members)
    for pkg, seq in ORDER.items():
        assert len(seq) == len(set(seq)) and set(seq) == members[pkg], (pkg, sorted(members[pkg] ^ set(seq)))
    assert {unit_of(name, LAYERS) for name, _ in modules()} == set(LAYERS)


def _doc_block(kind: str) -> list[str]:
    text = (PKG.parent / "docs" / "architecture.md").read_text()
    m = re.search(rf"^```{kind}\n(.*?)^```", text, re.M | re.S)
    assert m, f"docs/architecture.md has no ```{kind} block"
    return [line.split() for line in m.group(1).splitlines() if line.strip()]


def test_docs_state_the_same_layering():
    """docs/architecture.md's "Layering" blocks are these tables."""
    assert {u: int(row[0]) for row in _doc_block("layers") for u in row[1:]} == LAYERS
    assert {row[0].rstrip(":"): row[1:] for row in _doc_block("order")} == ORDER


def test_checker_reports_what_the_old_test_let_through():
    """The edges of the cycle this layering removed (backends.quant_export -> models.gguf_import,
    models.qwen3 -> backends: both layer 3 then), a same-layer edge and an intra-package edge
    out of order are each reported; the same graph in legal form is not."""
    pkgs = {"backends", "models", "snapshot", "checkpoints"}
    old = {**LAYERS, "models": 3}
    graph = {"backends.quant_export": {"models.gguf_import"}, "models.qwen3": {"backends"}}
    assert len(violations(graph, old, ORDER, pkgs)) == 2  # the old test skipped same-layer edges
    assert violations(graph, LAYERS, ORDER, pkgs) == [
        "backends.quant_export (layer 3) imports models.gguf_import (layer 4): a higher layer"]
    assert violations({"backends.quant_export": {"checkpoints.gguf_import"}}, LAYERS, ORDER, pkgs)
    assert violations({"engine": {"convert.report"}}, LAYERS, ORDER, pkgs) == [
        "engine (layer 6) imports convert.report (layer 6): the same layer"]
    assert violations({"snapshot.layout": {"snapshot.store"}}, LAYERS, ORDER, pkgs) == [
        "snapshot.layout imports snapshot.store: store is not before layout in snapshot's order"]
    assert violations({"snapshot.store": {"snapshot.layout", "snapshot"}, "backends.graph": {"backends"},
                       "backends": {"backends.cpu"}, "models.qwen3": {"backends", "models.rope"}},
                      LAYERS, ORDER, pkgs) == ["snapshot.store imports snapshot: __init__ is not before store "
                                               "in snapshot's order"]
    nested = {"cli.bench", "cli"}
    assert violations({"cli.bench.npu": {"cli.bench.common", "cli.options"}, "cli.convert": {"cli.bench.common"}},
                      LAYERS, ORDER, nested) == []
    assert violations({"cli.options": {"cli.bench.common"}}, LAYERS, ORDER, nested) == [
        "cli.options imports cli.bench.common: bench is not before options in cli's order"]


def test_snapshot_never_imports_engine_or_server():
    for path in (PKG / "snapshot").glob("*.py"):
        src = path.read_text()
        for banned in ("edge_llm.engine", "edge_llm.server", "edge_llm.runtime", "edge_llm.cli"):
            assert banned not in src, f"{path.name} imports {banned}"


def imported_names():
    """(file, imported module name, imported at module level?) for every import in the package."""
    for path in PKG.rglob("*.py"):
        tree = ast.parse(path.read_text())
        top_level = {id(n) for n in tree.body}
        for node in ast.walk(tree):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module] if isinstance(node, ast.ImportFrom) and node.module else [])
            for n in names:
                yield path, n, id(node) in top_level


def test_toolkit_is_imported_only_by_the_worker():
    """rknn-toolkit2 lives in the converter venv: only toolkit_worker.py (run there) imports it,
    and that file imports nothing of edge_llm; rknnlite is imported lazily by the board runner."""
    for path, n, top in imported_names():
        if n.split(".")[0] == "rknn":
            assert path.name == "toolkit_worker.py", path
        if n.split(".")[0] == "rknnlite":
            assert path.name == "rknnlite.py" or path.parent.name == "doctor", path
            assert not top, path
        if path.name == "toolkit_worker.py":
            assert not n.startswith("edge_llm"), n


def test_llama_cpp_is_imported_only_by_the_bench_peer():
    """llama-cpp-python lives in the benchmark's own venv (tools/setup-bench-llamacpp.sh): only
    bench/llamacpp_peer.py (run there) imports it, and that file imports nothing of edge_llm."""
    for path, n, _ in imported_names():
        if n.split(".")[0] == "llama_cpp":
            assert path.name == "llamacpp_peer.py", path
        if path.name == "llamacpp_peer.py":
            assert not n.startswith("edge_llm"), n


def test_onnx_only_in_the_exporters_and_onnxruntime_only_lazily():
    """The `onnx` package builds graphs: only the exporters import it (the graph family's
    onnx_export.py, cpu-q's decode_export.py and the vision tower's export.py). onnxruntime is
    imported inside the functions that start sessions (graph/runners.py, cpuq/decode_step.py),
    never at module import time, so the F32 backend runs without it."""
    exporters = {"backends/graph/onnx_export.py", "backends/cpuq/decode_export.py", "backends/tower/export.py"}
    seen = set()
    for path, n, top in imported_names():
        rel = path.relative_to(PKG).as_posix()
        if n.split(".")[0] == "onnx":
            assert rel in exporters, path
            seen.add(rel)
        if n.split(".")[0] == "onnxruntime":
            assert not top, path
            seen.add(rel)
    assert exporters | {"backends/graph/runners.py", "backends/cpuq/decode_step.py"} <= seen


def test_runtime_never_imports_torch():
    for path in PKG.rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            assert not any(n.split(".")[0] in ("torch", "transformers") for n in names), path


def _module_names() -> set[str]:
    return {name for name, _ in modules()}


def import_graph() -> dict[str, set[str]]:
    """module -> the edge_llm modules it imports (top-level and lazy, function-level imports)."""
    known = _module_names()
    graph: dict[str, set[str]] = {}
    for name, path in modules():
        deps = graph.setdefault(name, set())
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("edge_llm"):
                base = node.module[len("edge_llm."):] if node.module != "edge_llm" else ""
                for alias in node.names:  # `from edge_llm.checkpoints import default` imports a module
                    sub = f"{base}.{alias.name}" if base else alias.name
                    deps.add(sub if sub in known else base or "__init__")
            elif isinstance(node, ast.Import):
                deps.update(a.name[len("edge_llm."):] for a in node.names if a.name.startswith("edge_llm."))
        deps.discard(name)
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), i.e. import circles."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in graph:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def test_no_import_cycles():
    """No circle of imports anywhere, also inside one package and through lazy imports."""
    cycles = find_cycles(import_graph())
    assert not cycles, f"import cycles: {cycles}"


def test_cycle_detector():
    """The detector finds a circle through three modules and a lazy edge, and none in a chain."""
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []
    graph = import_graph()
    assert "checkpoints.packaged" in graph["checkpoints.synth"]  # real edges are seen (not an empty graph)
    assert "checkpoints.gguf_import" in graph["checkpoints.default"]  # a lazy, function-level import


def test_comments_point_to_the_repos_own_docs():
    """Code and docs cite docs/ pages that exist in the repo, never an outside spec."""
    root = PKG.parent
    cited = set()
    for path in [*root.glob("edge_llm/**/*.py"), *root.glob("tools/*"), *root.glob("docs/**/*.md"),
                 *root.glob("tests/*.py")]:
        if not path.is_file():
            continue
        text = path.read_text(errors="replace")
        assert not re.search(r"SPEC (section|order|formula)", text), f"{path} cites SPEC"
        cited.update(re.findall(r"docs/([\w/-]+\.md)", text))
    missing = sorted(c for c in cited if not (root / "docs" / c).is_file())
    assert not missing, f"cited docs pages that do not exist: {missing}"


def test_no_merge_conflict_markers():
    """A merge that left `<<<<<<<` / `>>>>>>>` lines behind must not pass."""
    root = PKG.parent
    files = subprocess.run(["git", "ls-files"], cwd=root, capture_output=True, text=True).stdout.split()
    marker = re.compile(r"^(<{7}|>{7})( |$)", re.M)
    bad = [f for f in files if (root / f).is_file() and (root / f).suffix in (".py", ".md", ".sh", ".toml", "")
           and marker.search((root / f).read_text(errors="replace"))]
    assert not bad, f"conflict markers in {bad}"
