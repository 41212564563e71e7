"""The module layering of docs/architecture.md: a module imports only from lower layers."""

import ast
import re
import subprocess
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "edge_llm"

# module (dotted, relative to edge_llm) -> layer; a package maps all its modules
LAYERS = {
    "errors": 0, "progress": 0,
    "config": 1, "settings": 1,
    "weights": 2, "tokenizer": 2, "kvcache": 2, "costgate": 2,
    "backends": 3, "models": 3, "vision": 3, "snapshot.format": 3, "snapshot.layout": 3, "snapshot.encode": 3, "snapshot.decode": 3,
    "snapshot.inspect": 3,
    "snapshot.identity": 4, "snapshot.store": 4, "snapshot": 4,
    "sampling": 5, "engine": 5, "runtime": 5,
    "server": 6, "bench": 6, "logsetup": 6, "sdnotify": 6, "doctor": 6, "convert": 6,
    "cli": 7, "__main__": 8, "__init__": 0,
}


def layer_of(dotted: str) -> int:
    parts = dotted.split(".")
    for k in range(len(parts), 0, -1):
        key = ".".join(parts[:k])
        if key in LAYERS:
            return LAYERS[key]
    raise KeyError(dotted)


def modules():
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__" and len(parts) > 1:
            parts = parts[:-1]
        yield ".".join(parts), path


@pytest.mark.parametrize("name,path", list(modules()), ids=lambda v: str(v) if isinstance(v, str) else "")
def test_imports_respect_layers(name, path):
    own = layer_of(name)
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        targets = []
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("edge_llm"):
            targets = [node.module]
        elif isinstance(node, ast.Import):
            targets = [a.name for a in node.names if a.name.startswith("edge_llm")]
        for t in targets:
            sub = t[len("edge_llm."):] if t != "edge_llm" else "__init__"
            if sub.split(".")[0] == name.split(".")[0] and own >= 3:
                continue  # inside one package (e.g. snapshot.store -> snapshot.format is checked below)
            assert layer_of(sub) <= own, f"{name} (layer {own}) imports {t} (layer {layer_of(sub)})"


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
            assert path.name in ("rknnlite.py", "doctor.py") and not top, path
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
    """The `onnx` package builds graphs: only the exporters import it (onnx_export.py and cpu-q's
    decode_export.py). onnxruntime is imported inside the functions that start sessions
    (runners.py, decode_step.py), never at module import time, so the F32 backend runs without it."""
    seen = set()
    for path, n, top in imported_names():
        if n.split(".")[0] == "onnx":
            assert path.name in ("onnx_export.py", "decode_export.py"), path
            seen.add(path.name)
        if n.split(".")[0] == "onnxruntime":
            assert not top, path
            seen.add(path.name)
    assert {"onnx_export.py", "decode_export.py", "runners.py", "decode_step.py"} <= seen


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
                for alias in node.names:  # `from edge_llm.models import default` imports a module
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
    assert "models.packaged" in graph["models.synth"]  # real edges are seen (not an empty graph)
    assert "models.gguf_import" in graph["models.default"]  # a lazy, function-level import


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
