"""The Qwen3-VL vision encoder in numpy: patch embedding, learned position embeddings resampled to
the image grid (bilinear, align_corners=True, as the reference), 2-D rotary embeddings, the
transformer blocks with full attention within each image, the 2x2 patch merger into the text
hidden size, and the DeepStack mergers whose outputs the decoder adds to its hidden states at
the image positions after its first layers.

Dense work goes through a `VisionBackend`; this module owns positions and attention. With a
`TowerGraph` (the whole tower as one graph: onnxruntime for cpu-q, the NPU for rknn), an image
whose patch count a graph shape holds runs there instead, fed this module's positions and
rotary tables, padded up to the shape with masked patches; any other image runs here, logged.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np

from edge_llm.backends.graph.schema import KEY_PAD
from edge_llm.backends.tower.seam import VisionBackend
from edge_llm.backends.tower.graph import TowerGraph
from edge_llm.config import VisionArgs
from edge_llm.models.rope import apply_rope
from edge_llm.progress import NO_WORK, VISION, Work
from edge_llm.weights import Weights

log = logging.getLogger(__name__)

ATTN_SCORE_BYTES = 64 << 20  # bound of the reused (queries, N) float32 score buffer


@dataclass
class ImageFeatures:
    """Decoder inputs for one image's token run."""

    embeds: np.ndarray  # (n_tokens, text hidden): replaces the image pad embeddings
    deepstack: list[np.ndarray]  # each (n_tokens, text hidden), added after decoder layer l


def merge_block_coords(gh: int, gw: int, m: int) -> tuple[np.ndarray, np.ndarray]:
    """(row, col) of each patch in the merge-block order the preprocessor emits."""
    idx = np.arange(gh * gw)
    in_col, in_row = idx % m, (idx // m) % m
    block_col = (idx // (m * m)) % (gw // m)
    block_row = idx // (m * m * (gw // m))
    return block_row * m + in_row, block_col * m + in_col


def _axis_taps(index: np.ndarray, size: int, side: int) -> tuple[np.ndarray, np.ndarray]:
    """Bilinear taps (floor, floor+1, clamped) and weights, align_corners=True, in float32."""
    src = index.astype(np.float32) * np.float32(side - 1) / np.float32(max(size - 1, 1))
    floor = np.floor(src)
    taps = np.clip(floor.astype(np.int64)[:, None] + np.arange(2), 0, side - 1)
    weights = np.clip(np.float32(1) - np.abs(src[:, None] - floor[:, None] - np.arange(2, dtype=np.float32)),
                      0, None).astype(np.float32)
    return taps, weights


class VisionEncoder:
    def __init__(self, args: VisionArgs, backend: VisionBackend, pos_table: np.ndarray,
                 graph: TowerGraph | None = None):
        self.args, self.backend, self.graph = args, backend, graph
        self.pos_table = pos_table  # (num_position_embeddings, hidden)
        d = args.head_dim // 2  # the 2-D rotary rotates head_dim/2 frequencies per axis pair
        self.inv_freq = (np.float32(1.0) / np.power(
            np.float32(args.rope_theta), np.arange(0, d, 2, dtype=np.float32) / np.float32(d))).astype(np.float32)
        self.scale = np.float32(args.head_dim ** -0.5)

    @classmethod
    def from_weights(cls, args: VisionArgs, weights: Weights, backend: VisionBackend,
                     graph: TowerGraph | None = None) -> "VisionEncoder":
        pos = weights.pop(f"{args.weight_prefix}pos_embed.weight")
        backend.load_vision(args, weights)
        return cls(args, backend, pos, graph)

    @property
    def numerics(self) -> str:
        """The tower path's numerics: the numpy backend's, and the graph's when there is one."""
        return self.backend.numerics + (f"+{self.graph.numerics}" if self.graph is not None else "")

    def graph_shape(self, grid_thw: tuple[int, int, int]) -> int | None:
        """The graph shape an image of this grid runs at, or None: the numpy tower encodes it."""
        t, gh, gw = grid_thw
        return self.graph.shape_for(gh * gw) if self.graph is not None and t == 1 else None

    # ---- positions -----------------------------------------------------------------------
    def position_embeddings(self, gh: int, gw: int) -> np.ndarray:
        """The learned (side x side) table resampled to a (gh, gw) grid, in merge-block order."""
        side, m = self.args.pos_side, self.args.spatial_merge_size
        row, col = merge_block_coords(gh, gw, m)
        ht, hw = _axis_taps(row, gh, side)
        wt, ww = _axis_taps(col, gw, side)
        idx = (ht[:, :, None] * side + wt[:, None, :]).reshape(-1, 4)  # (N, 4)
        wts = (hw[:, :, None] * ww[:, None, :]).reshape(-1, 4)
        return (self.pos_table[idx] * wts[:, :, None]).sum(axis=1, dtype=np.float32)

    def rotary(self, gh: int, gw: int) -> tuple[np.ndarray, np.ndarray]:
        """cos, sin (N, head_dim): frequencies [h-angles | w-angles] repeated twice (rotate-half)."""
        row, col = merge_block_coords(gh, gw, self.args.spatial_merge_size)
        fh = row.astype(np.float32)[:, None] * self.inv_freq
        fw = col.astype(np.float32)[:, None] * self.inv_freq
        half = np.concatenate([fh, fw], axis=1)
        emb = np.concatenate([half, half], axis=1)
        return np.cos(emb), np.sin(emb)

    # ---- forward ---------------------------------------------------------------------------
    def attention(self, qkv: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
        """Full (non-causal) attention over one frame's patches: qkv (N, 3*hidden) -> (N, hidden).

        Head by head into one reused score buffer: a fresh (heads, N, N) array per block would
        be page-faulted in every time (40 MB at 448x448), which cost more than the matmuls."""
        N, H, D = qkv.shape[0], self.args.num_heads, self.args.head_dim
        qkv = qkv.reshape(N, 3, H, D)
        q = apply_rope(qkv[:, 0], cos, sin)
        q *= self.scale  # folding the scale into q: N*H*D multiplies instead of H*N*N
        k = apply_rope(qkv[:, 1], cos, sin)
        out = np.empty((N, H, D), dtype=np.float32)
        block = max(64, min(N, ATTN_SCORE_BYTES // (4 * N)))
        scores = np.empty((block, N), dtype=np.float32)
        for h in range(H):
            qh = np.ascontiguousarray(q[:, h])  # (N, D)
            kt = np.ascontiguousarray(k[:, h].T)  # (D, N)
            vh = np.ascontiguousarray(qkv[:, 2, h])  # (N, D)
            for a in range(0, N, block):
                rows = min(block, N - a)
                s = np.matmul(qh[a:a + rows], kt, out=scores[:rows])
                s -= s.max(axis=-1, keepdims=True)
                np.exp(s, out=s)
                denom = s.sum(axis=-1, keepdims=True)
                o = s @ vh  # normalise the D-wide output, not the N-wide scores
                o /= denom
                out[a:a + rows, h] = o
        return out.reshape(N, H * D)

    def encode(self, pixel_values: np.ndarray, grid_thw: tuple[int, int, int],
               work: Work = NO_WORK) -> ImageFeatures:
        """One image (or video) -> merged embeddings + DeepStack features for its token run.
        Each block reports to `work` (stage vision, block / depth), which may cancel."""
        t, gh, gw = grid_thw
        a = self.args
        if pixel_values.shape != (t * gh * gw, a.patch_dim):
            raise ValueError(f"pixel_values {pixel_values.shape} do not match grid {grid_thw} "
                             f"x patch_dim {a.patch_dim}")
        shape = self.graph_shape(grid_thw)
        if shape is not None:
            return self.encode_graph(pixel_values, gh, gw, shape, work)
        if self.graph is not None:
            log.info("vision: an image of %dx%d patches has no graph shape (%s): the numpy tower encodes it",
                     gh, gw, list(self.graph.rows) or f"at most {self.graph.max_patches} patches")
        return self.backend_encode(pixel_values, grid_thw, work)

    def backend_encode(self, pixel_values: np.ndarray, grid_thw: tuple[int, int, int],
                       work: Work = NO_WORK) -> ImageFeatures:
        """The tower block by block on the `VisionBackend` (numpy), whatever graph there is."""
        t, gh, gw = grid_thw
        a, be = self.args, self.backend
        x = be.vis_patch_embed(np.ascontiguousarray(pixel_values, dtype=np.float32))
        x += np.tile(self.position_embeddings(gh, gw), (t, 1))
        cos, sin = self.rotary(gh, gw)
        frame = gh * gw
        deepstack: list[np.ndarray] = []
        for i in range(a.depth):
            qkv = be.vis_qkv(i, x)
            # attention stays within one frame (an image is one frame)
            attn = np.concatenate([self.attention(qkv[f:f + frame], cos, sin) for f in range(0, t * frame, frame)])
            x = be.vis_attn_out(i, attn, x)
            x = be.vis_mlp(i, x)
            if i in a.deepstack_visual_indexes:
                deepstack.append(be.vis_merge(1 + a.deepstack_visual_indexes.index(i), x))
            work.report(VISION, i + 1, a.depth)
        return ImageFeatures(be.vis_merge(0, x), deepstack)

    def encode_graph(self, pixel_values: np.ndarray, gh: int, gw: int, shape: int,
                     work: Work = NO_WORK) -> ImageFeatures:
        """One image through the tower graph(s) at `shape` rows: patches [n, shape) are zeros
        whose keys carry KEY_PAD, so no real patch attends to them; whole 2x2 groups of them are
        padding, and their output rows are dropped. A tower in segments reports each to `work`."""
        assert self.graph is not None
        n, a = gh * gw, self.args
        group, out = a.spatial_merge_size ** 2, a.out_hidden_size
        cos, sin = self.rotary(gh, gw)
        kbias = np.zeros((shape, 1), np.float32)
        kbias[n:] = KEY_PAD

        def padded(x: np.ndarray) -> np.ndarray:
            buf = np.zeros((shape, x.shape[1]), np.float32)
            buf[:n] = x
            return buf

        feed = {"pixels": padded(pixel_values), "pos": padded(self.position_embeddings(gh, gw)),
                "cos": padded(cos), "sin": padded(sin), "kbias": kbias}
        embeds, deepstack = None, []
        work.report(VISION, 0, a.depth)
        for i, spec in enumerate(self.graph.specs):
            res = self.graph.run(spec, [feed[name] for name, _ in spec.inputs])
            last = "h_out" not in res
            if not last:
                feed["h"] = res["h_out"]
            if "features" in res:
                feats = res["features"].reshape(shape // group, -1)[:n // group]
                parts = [np.ascontiguousarray(feats[:, j * out:(j + 1) * out]) for j in range(feats.shape[1] // out)]
                if last:
                    embeds, parts = parts[0], parts[1:]
                deepstack += parts
            done = self.graph.specs[i + 1].index if not last else a.depth
            work.report(VISION, done, a.depth)
        assert embeds is not None
        return ImageFeatures(embeds, deepstack)
