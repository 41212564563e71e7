"""cpu-q's decode on the RK3588's four Cortex-A76 cores, predicted next to the matmul path's
(docs/npu.md, "NPU or CPU decode").

A decode token of cpu-q reads every 4-bit weight once; on a board it is bandwidth-bound, so

    tok/s = the A76 cluster's effective bandwidth / cpu-q's weight bytes per token

The bandwidth is derived from one published measurement, not assumed: rk-llama.cpp's README (as
issue 48 quotes it) gives Gemma3-1B Q4_0 at 28.3 tok/s decoding on the four A76 cores (and its
NPU Q8_0 path at 16.5 tok/s). Gemma3-1B's linears (26 layers of q 1152 x 1024, k and v 1152 x 256
each, o 1024 x 1152, gate/up 1152 x 2 x 6912, down 6912 x 1152, and the tied 1152 x 262144 head)
are 999,751,680 weights; Q4_0 stores a block of 32 as 16 bytes of 4-bit codes + a 2-byte float16
scale, 0.5625 bytes a weight: 562.4 MB a token, x 28.3 = 15.9 GB/s. Assumed (not stated by the
source): every linear, the head included, is Q4_0, and the KV reads of a short context are small
beside the weights. cpu-q's bytes per token come from the model's geometry the same way
(`predict.linears`, the matmul path's own list): 4-bit codes + a float32 scale per block of 32
(`backends/cpuq/nbits.QuantWeight.nbytes` without zero points, as the GGUF's Q4_0 blocks import).

This is a prediction: `auto` never chooses from it (docs/npu.md): only the board report's
measured decode figures (`edge-llm bench board`) can show the CPU ahead of the NPU.
"""

from __future__ import annotations

from edge_llm.backends.cpuq.backend import BLOCK
from edge_llm.bench.npu.predict import linears
from edge_llm.config import ModelArgs

SOURCE = ("rk-llama.cpp's README (quoted in issue 48): Gemma3-1B Q4_0 decodes at 28.3 tok/s on the four A76 "
          "cores, its NPU Q8_0 path at 16.5 tok/s")
GEMMA3_1B = ModelArgs(model_type="gemma3", vocab_size=262144, hidden_size=1152, intermediate_size=6912,
                      num_hidden_layers=26, num_attention_heads=4, num_key_value_heads=1, head_dim=256,
                      rms_norm_eps=1e-6, rope_theta=1e6, tie_word_embeddings=True)
GEMMA3_Q4_0_TOK_S = 28.3  # the four A76 cores (SOURCE)
GEMMA3_NPU_Q8_0_TOK_S = 16.5  # the same model on the NPU, Q8_0 (SOURCE)
Q4_0_BYTES_PER_WEIGHT = (16 + 2) / 32  # GGUF Q4_0: 32 4-bit codes + a float16 scale
CPU_Q_BYTES_PER_WEIGHT = 0.5 + 4 / BLOCK  # cpu-q: 4-bit codes + a float32 scale per block


def weights(args: ModelArgs) -> int:
    """The weights one decode token reads: every linear of every layer, and the head."""
    return sum(lin.k * lin.n * lin.count for lin in linears(args))


def a76_bandwidth() -> float:
    """Bytes per second the four A76 cores stream in a decode, from Gemma3-1B Q4_0's published rate."""
    return weights(GEMMA3_1B) * Q4_0_BYTES_PER_WEIGHT * GEMMA3_Q4_0_TOK_S


def predict_cpu_q(args: ModelArgs) -> dict:
    """cpu-q's decode tok/s on the four A76 cores for `args`' geometry (the derivation in the docstring)."""
    nbytes = weights(args) * CPU_Q_BYTES_PER_WEIGHT
    bw = a76_bandwidth()
    return {"bytes_per_token": nbytes, "a76_gbs": bw / 1e9, "tok_s": bw / nbytes, "layers": args.num_hidden_layers,
            "source": SOURCE, "anchor": {"model": "Gemma3-1B", "weights": weights(GEMMA3_1B),
                                         "q4_0_bytes_per_token": weights(GEMMA3_1B) * Q4_0_BYTES_PER_WEIGHT,
                                         "cpu_tok_s": GEMMA3_Q4_0_TOK_S, "npu_q8_0_tok_s": GEMMA3_NPU_Q8_0_TOK_S}}


def markdown(cpu_q: dict, npu_tok_s: float | None) -> str:
    """The two predictions side by side, with the source and the derivation."""
    a = cpu_q["anchor"]
    npu = f"{npu_tok_s:.2f} tok/s" if npu_tok_s is not None else "not predicted"
    return "\n".join([
        f"## NPU or CPU decode: cpu-q on the four A76 cores, {cpu_q['layers']} layers", "",
        f"- cpu-q predicted {cpu_q['tok_s']:.2f} tok/s: {cpu_q['bytes_per_token'] / 1e9:.3f} GB of 4-bit weights a "
        f"token over {cpu_q['a76_gbs']:.1f} GB/s; the matmul path (NPU) predicted {npu} at the shortest context",
        f"- the A76 bandwidth: {a['model']} Q4_0's {a['q4_0_bytes_per_token'] / 1e6:.1f} MB a token "
        f"({a['weights']:,} weights x 18 B / 32) x {a['cpu_tok_s']} tok/s; source: {cpu_q['source']}",
        "- a prediction only: `auto` does not choose from it; the measured decode of `bench board` on a board does "
        "the comparison (docs/npu.md, \"NPU or CPU decode\")", ""])
