"""`manifest.json` of a converted graph directory (`edge-llm convert rknn`).

Layout of the directory:
    manifest.json          this file
    onnx/<graph>.onnx      + <graph>.onnx.data (F32 weights), exported with the onnx helper API
    onnx/<graph>.samples.npz   accuracy-check inputs (real activations) and CPU-backend outputs
    rknn/<graph>-<key16>.rknn  fp16 build for rk3588; key = sha256 of the ONNX input + build
                               options + toolkit version, so an unchanged input is never rebuilt
    report.md              per-graph accuracy and compiler cost estimate

Only the hashed part (`identity()`) decides the backend's numerics: the graph set with each
graph's input key, the chunk sizes, the toolkit version and target. Timings, accuracy numbers,
tensor ranges and the `.rknn` bytes (which differ between builds of the same input) are not part of it.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from edge_llm.backends.graph.schema import GraphSpec
from edge_llm.config import ModelArgs
from edge_llm.errors import ConfigError
from edge_llm.files import open_regular, write_atomic
from edge_llm.weights import hash_into

FORMAT = "edge-llm-graphs/1"
MANIFEST = "manifest.json"
TARGET = "rk3588"


CALIB_DIR = "calib"  # int8 builds: every graph's calibration inputs, <graph>.npz


def sha256_files(*paths: Path) -> str:
    """sha256 over the files' bytes one after the other (a graph's `input_key`: .onnx + .onnx.data)."""
    h = hashlib.sha256()
    for p in paths:
        with open_regular(p, ConfigError, buffering=0) as f:
            hash_into(h, f)
    return h.hexdigest()


@dataclass
class GraphEntry:
    name: str
    kind: str
    index: int
    rows: list[int]
    inputs: list[list]  # [[name, width], ...]
    outputs: list[list]
    vocab: list[int]
    onnx: str  # relative path
    input_key: str  # sha256 of the ONNX files
    onnx_bytes: int = 0
    rknn: str | None = None  # relative path, after the rknn build
    rknn_sha256: str | None = None
    rknn_bytes: int | None = None
    build_key: str | None = None
    accuracy: dict | None = None  # rows -> output -> {max_rel, mean_rel, cosine}
    cost: list | None = None  # compiler tables: one per static shape
    build_seconds: float | None = None
    ranges: dict | None = None  # max |value| on real activations: inputs, outputs, intermediates
    dtype: str | None = None  # this graph's build dtype when it differs from the manifest's (w8a8 fallback)

    def spec(self) -> GraphSpec:
        return GraphSpec(self.name, self.kind, self.index, tuple(self.rows),
                         tuple((n, int(w)) for n, w in self.inputs),
                         tuple((n, int(w)) for n, w in self.outputs), tuple(self.vocab))


@dataclass
class Manifest:
    model: dict[str, Any]  # model_type, name, weights_sha256, config (identity fields)
    chunks: list[int]
    layers: int
    head_split: int
    graphs: list[GraphEntry]
    format: str = FORMAT
    target: str = TARGET
    dtype: str = "float16"
    toolkit: str | None = None  # rknn-toolkit2 version of the .rknn builds (None: ONNX only)
    build: dict[str, Any] = field(default_factory=dict)  # times, peak RSS: informational
    # the converter's fp16 range check (source text, tokens, limit); empty: never checked
    calibration: dict[str, Any] = field(default_factory=dict)
    # int8 builds (dtype w8a8): toolkit algorithm/method, smoothing, calibration digest, cpu_side digest
    quant: dict[str, Any] = field(default_factory=dict)

    def graph_dtype(self, g: GraphEntry) -> str:
        return g.dtype or self.dtype

    def quant_request(self, root: Path, g: GraphEntry) -> dict[str, Any] | None:
        """The toolkit worker's "quant" field for building `g` (None: fp16): its calibration
        inputs are `calib/<graph>.npz` under `root` (written by the converter)."""
        if self.graph_dtype(g) == "float16":
            return None
        return {"dtype": self.graph_dtype(g), "algorithm": self.quant["algorithm"], "method": self.quant["method"],
                "max_samples": self.quant["max_samples"], "dataset": str(Path(root).resolve() / CALIB_DIR / f"{g.name}.npz")}

    def specs(self) -> list[GraphSpec]:
        return [g.spec() for g in self.graphs]

    def identity(self) -> str:
        """16 hex digits over what determines the graphs' numerics (see module docstring)."""
        doc = {"format": self.format, "target": self.target, "dtype": self.dtype, "toolkit": self.toolkit,
               "chunks": self.chunks, "head_split": self.head_split,
               "weights": self.model.get("weights_sha256"),
               "graphs": [[g.name, g.input_key, g.rows] + ([g.dtype] if g.dtype else []) for g in self.graphs]}
        if self.quant:  # absent for fp16 directories: their identity is unchanged
            # which graphs fell back to fp16 (and why) is in each graph's dtype above
            doc["quant"] = {k: v for k, v in self.quant.items() if k not in ("fp16_graphs", "min_cosine")}
        blob = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    def onnx_files(self, root: Path) -> dict[str, Path]:
        return {g.name: root / g.onnx for g in self.graphs}

    def rknn_files(self, root: Path) -> dict[str, Path]:
        missing = [g.name for g in self.graphs if not g.rknn]
        if missing:
            raise ConfigError(f"{root}: no .rknn build for {len(missing)} graph(s) ({missing[0]}, ...): "
                              "run `edge-llm convert rknn` to the end")
        return {g.name: root / g.rknn for g in self.graphs}

    def verify(self, root: Path, kind: str) -> None:
        """ConfigError unless the files a runner reads have the digests the conversion recorded
        (docs/npu.md, "Verification at load"): kind "rknn", each graph's `.rknn` (`rknn_sha256`);
        "onnx", each graph's `.onnx` + `.onnx.data` (`input_key`, which the identity hashes)."""
        for g in self.graphs:
            if kind == "rknn":
                paths, claimed, what = [root / str(g.rknn)], g.rknn_sha256, "rknn_sha256"
            else:
                onnx = root / g.onnx
                paths, claimed, what = [onnx, onnx.with_name(onnx.name + ".data")], g.input_key, "input_key"
            try:
                actual = sha256_files(*paths)
            except OSError as e:
                raise ConfigError(f"{paths[0]}: unreadable ({e}): re-run `edge-llm convert rknn`") from None
            if actual != claimed:
                raise ConfigError(f"{' + '.join(map(str, paths))}: sha256 {actual[:16]}... is not the manifest.json's "
                                  f"{what} {str(claimed)[:16]}... of graph {g.name}: changed, truncated or replaced "
                                  "after the conversion wrote it; re-run `edge-llm convert rknn`")

    def check_model(self, args: ModelArgs, weights_sha256: str | None) -> None:
        """ConfigError unless these graphs were made from this model (config + weight bytes)."""
        want = json.loads(json.dumps(args.identity_fields()))
        if self.model.get("config") != want:
            raise ConfigError(f"graphs were converted from a different model config "
                              f"({self.model.get('name')}, {self.model.get('model_type')})")
        if weights_sha256 is not None and self.model.get("weights_sha256") != weights_sha256:
            raise ConfigError(f"graphs were converted from other weights ({self.model.get('name')}): "
                              "re-run `edge-llm convert rknn` for this model")

    def check_fp16(self, root: Path) -> None:
        """ConfigError unless the converter checked these graphs' fp16 range on real activations
        (directories converted before that check can overflow on real weights)."""
        if not self.calibration:
            raise ConfigError(f"{root} was converted without the fp16 range check on real activations "
                              "(an older edge-llm): its fp16 graphs can overflow on real weights; "
                              "re-run `edge-llm convert rknn` (docs/npu.md, 'fp16 range')")

    # ---- files ----------------------------------------------------------------------------
    def write(self, root: Path) -> None:
        doc = {**asdict(self), "identity": self.identity()}
        write_atomic(root / MANIFEST, json.dumps(doc, indent=1) + "\n")

    @classmethod
    def read(cls, root: str | Path) -> "Manifest":
        path = Path(root) / MANIFEST
        try:
            doc = json.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"{path}: not found (make it with `edge-llm convert rknn MODEL {root}`)") from None
        except (OSError, json.JSONDecodeError) as e:
            raise ConfigError(f"{path}: unreadable ({e})") from None
        if doc.get("format") != FORMAT:
            raise ConfigError(f"{path}: format {doc.get('format')!r}, expected {FORMAT!r}")
        doc.pop("identity", None)
        try:
            doc["graphs"] = [GraphEntry(**g) for g in doc["graphs"]]
            return cls(**doc)
        except (TypeError, KeyError) as e:
            raise ConfigError(f"{path}: malformed ({e})") from None
