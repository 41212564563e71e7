/* The matmul path's per-row float32 ops (docs/npu.md, "The matmul path (w8a8 on librknnrt)": "The
 * CPU side in C"): what runs on the CPU between a layer's int8 x int8 -> int32 products, a handful of
 * calls per layer instead of ~30 numpy calls, and the residual rotation as a fast transform.
 *
 * Why by hand: each op is a few float32 operations per element over rows of 576 .. 12288 values, so
 * numpy's cost is its per-call overhead and its temporaries (~1 ms per layer per decode row on the
 * 2B), and no library fuses RMSNorm + row quantization, or dequantization + SwiGLU + a Hadamard
 * transform + quantization, into one pass over a row. The numpy code in backends/npu/matmul/row_ops.py
 * (`NumpyOps`) is the readable reference of the same formulas; tests/test_mm8_ops.py holds these
 * functions to it on the default model's real activations.
 *
 * Bit rules (a row's bits must not depend on the CPU's vector width, nor on the other rows):
 * - no contraction into fused multiply-adds (the pragmas below: every product and sum is rounded
 *   on its own, as numpy rounds it), no -ffast-math reassociation;
 * - every reduction in one fixed order: the sum of squares in LANES interleaved float32 partial
 *   sums merged pairwise, the Hadamard's small block and the rotation's block in index order
 *   (absmax is a max: exact in any order);
 * - each row is computed from that row alone, one thread; no OpenMP;
 * - rounding to int8 is round half to even ((v + 1.5 * 2^23) - 1.5 * 2^23, exact for |v| < 2^22,
 *   the same values as nearbyintf in the default rounding mode; it vectorizes without SSE4.1);
 * - exp is plain arithmetic here (Cephes' expf polynomial), not libm's, whose x86 variants are
 *   picked at run time by the CPU's features.
 * So the same inputs give the same bits on any x86-64 or aarch64 CPU and in any batch.
 */
#if defined(__clang__)
#pragma STDC FP_CONTRACT OFF
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

#include <math.h>
#include <stdint.h>
#include <string.h>

/* Clones for AVX-512, AVX2 and the x86-64 baseline, picked at load time: they differ in vector width
 * only, never in bits (the rules above). EDGE_MM8_ONE_ISA: no clones, the code of -march alone
 * (tests/test_mm8_ops.py builds the baseline that way and compares its bits with this CPU's clone). */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && !defined(EDGE_MM8_ONE_ISA)
#define CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define CLONES
#endif

#define LANES 16           /* partial sums of the sum of squares (fixed: part of the bits) */
#define QMAX 127.0f
#define ROUND_MAGIC 12582912.0f /* 1.5 * 2^23 */

typedef float vf __attribute__((vector_size(64), aligned(4))); /* 16 floats, any alignment */
#define SHUF __builtin_shufflevector

static inline float round_even(float v) { return (v + ROUND_MAGIC) - ROUND_MAGIC; }

/* e^x, ~2 ulp, overflow to inf above ~88.72, 0 below ~-104 (Cephes expf; 2^n in two factors). */
static inline float exp_f(float x) {
    x = x > 89.0f ? 89.0f : x;
    x = x < -104.0f ? -104.0f : x;
    float n = round_even(x * 1.44269504088896341f);
    float r = (x - n * 0.693359375f) - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = (p * (r * r) + r) + 1.0f;
    int32_t ni = (int32_t)n, n1 = ni / 2, n2 = ni - n1;
    int32_t b1 = (n1 + 127) << 23, b2 = (n2 + 127) << 23;
    float s1, s2;
    memcpy(&s1, &b1, 4);
    memcpy(&s2, &b2, 4);
    return (p * s1) * s2;
}

static inline float sum_squares(const float *x, int64_t n) {
    float acc[LANES] = {0};
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES)
        for (int j = 0; j < LANES; j++) acc[j] += x[i + j] * x[i + j];
    for (int j = 0; i < n; i++, j++) acc[j] += x[i] * x[i];
    for (int w = LANES / 2; w > 0; w /= 2)
        for (int j = 0; j < w; j++) acc[j] += acc[j + w];
    return acc[0];
}

/* 1 / sqrt(mean(x^2) + eps): the reciprocal RMS of backends/cpu/backend.rms_norm, in its float32 steps. */
static inline float inv_rms(const float *x, int64_t n, float eps) {
    float var = sum_squares(x, n) / (float)n;
    return 1.0f / sqrtf(var + eps);
}

/* q = clip(round_even((x * mul) / scale)), scale = absmax(x * mul) / 127 (1 for a zero row). With
 * mul == 1 the products are x itself: `int8.quantize_rows` bit for bit. */
static inline void quantize_row(const float *x, int64_t n, float mul, int8_t *q, float *scale) {
    float mx[LANES] = {0}; /* lane maxima (a max is exact in any order; lanes let it vectorize) */
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES)
        for (int j = 0; j < LANES; j++) {
            float a = fabsf(x[i + j] * mul);
            mx[j] = a > mx[j] ? a : mx[j];
        }
    for (int j = 0; i < n; i++, j++) {
        float a = fabsf(x[i] * mul);
        mx[j] = a > mx[j] ? a : mx[j];
    }
    float amax = 0.0f;
    for (int j = 0; j < LANES; j++) amax = mx[j] > amax ? mx[j] : amax;
    float s = amax / QMAX;
    s = amax == 0.0f ? 1.0f : s;
    for (i = 0; i < n; i++) {
        float v = round_even((x[i] * mul) / s);
        v = v > QMAX ? QMAX : v;
        v = v < -QMAX ? -QMAX : v;
        q[i] = (int8_t)v;
    }
    *scale = s;
}

/* RMSNorm (unit gain: the gains are folded into the weights) of each row, quantized: the input of
 * q/k/v, gate/up and the head. x (T, n) -> q (T, n) int8, scale (T). */
CLONES void edge_mm8_norm_quant(const float *x, int64_t T, int64_t n, float eps, int8_t *q, float *scale) {
    for (int64_t t = 0; t < T; t++)
        quantize_row(x + t * n, n, inv_rms(x + t * n, n, eps), q + t * n, scale + t);
}

/* Rows quantized as they are (attention's output before o). */
CLONES void edge_mm8_quant(const float *x, int64_t T, int64_t n, int8_t *q, float *scale) {
    for (int64_t t = 0; t < T; t++) quantize_row(x + t * n, n, 1.0f, q + t * n, scale + t);
}

/* y = ((float)c * row_scale) * col_scale (+ bias if not NULL): `int8.dequantize` bit for bit. */
CLONES void edge_mm8_dequant(const int32_t *c, const float *row_scale, const float *col_scale, const float *bias,
                      int64_t T, int64_t n, float *y) {
    for (int64_t t = 0; t < T; t++) {
        const int32_t *ct = c + t * n;
        float *yt = y + t * n, rs = row_scale[t];
        if (bias)
            for (int64_t i = 0; i < n; i++) yt[i] = ((float)ct[i] * rs) * col_scale[i] + bias[i];
        else
            for (int64_t i = 0; i < n; i++) yt[i] = ((float)ct[i] * rs) * col_scale[i];
    }
}

/* h = x + dequant(c): a residual addition ((x + o) + m, in that order, over two calls). h may be x.
 * With q and scale not NULL, also RMSNorm(h) quantized (the next linear's input) in the same pass. */
CLONES void edge_mm8_dequant_add(const int32_t *c, const float *row_scale, const float *col_scale, const float *x,
                          int64_t T, int64_t n, float eps, float *h, int8_t *q, float *scale) {
    for (int64_t t = 0; t < T; t++) {
        const int32_t *ct = c + t * n;
        const float *xt = x + t * n;
        float *ht = h + t * n, rs = row_scale[t];
        for (int64_t i = 0; i < n; i++) ht[i] = xt[i] + ((float)ct[i] * rs) * col_scale[i];
        if (q) quantize_row(ht, n, inv_rms(ht, n, eps), q + t * n, scale + t);
    }
}

/* 16 values (y[i], y[i + h]) -> (y[i] + y[i + h], y[i] - y[i + h]) for h = 1, 2, 4, 8 in a vector:
 * the same operations, so the same bits, as the scalar butterflies of these four stages. */
static inline void butterflies16(float *y) {
    vf v = *(vf *)y, p;
    p = SHUF(v, v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
    v = SHUF(v + p, p - v, 0, 17, 2, 19, 4, 21, 6, 23, 8, 25, 10, 27, 12, 29, 14, 31);
    p = SHUF(v, v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
    v = SHUF(v + p, p - v, 0, 1, 18, 19, 4, 5, 22, 23, 8, 9, 26, 27, 12, 13, 30, 31);
    p = SHUF(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
    v = SHUF(v + p, p - v, 0, 1, 2, 3, 20, 21, 22, 23, 8, 9, 10, 11, 28, 29, 30, 31);
    p = SHUF(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
    v = SHUF(v + p, p - v, 0, 1, 2, 3, 4, 5, 6, 7, 24, 25, 26, 27, 28, 29, 30, 31);
    *(vf *)y = v;
}

/* a (m * s) in place: a @ (block ⊗ H_s) / sqrt(s), H_s Sylvester's (s a power of two), block (m, m)
 * row-major, normalized (m == 1: no block). `row_ops.fwht`, in a fixed order; tmp holds m * s. */
static inline void hadamard_row(float *a, int64_t m, int64_t s, const float *block, float *tmp) {
    for (int64_t seg = 0; seg < m; seg++) {
        float *y = a + seg * s;
        int64_t h = 1;
        if (s % 16 == 0) { /* the first four stages in registers */
            for (int64_t b = 0; b < s; b += 16) butterflies16(y + b);
            h = 16;
        }
        for (; h < s; h *= 2)
            for (int64_t b = 0; b < s; b += 2 * h)
                for (int64_t i = b; i < b + h; i++) {
                    float u = y[i], v = y[i + h];
                    y[i] = u + v;
                    y[i + h] = u - v;
                }
    }
    float norm = (float)(1.0 / sqrt((double)s));
    for (int64_t i = 0; i < m * s; i++) a[i] *= norm;
    if (m == 1) return;
    for (int64_t i = 0; i < m; i++) { /* out segment i = sum_j block[j, i] * segment j */
        float *o = tmp + i * s;
        float w = block[i];
        for (int64_t k = 0; k < s; k++) o[k] = w * a[k];
        for (int64_t j = 1; j < m; j++) {
            const float *y = a + j * s;
            w = block[j * m + i];
            for (int64_t k = 0; k < s; k++) o[k] += w * y[k];
        }
    }
    memcpy(a, tmp, (size_t)(m * s) * sizeof(float));
}

/* The MLP's middle: gate/up dequantized, SiLU(g) * u (g / (1 + e^-g) * u, `cpu.backend.swiglu`'s order), the
 * online Hadamard of down_proj's input if block is not NULL (m * s = inter), quantized for down.
 * c (T, 2 inter) int32, col_scale (2 inter) -> q (T, inter) int8, scale (T); work: 2 inter floats. */
CLONES void edge_mm8_swiglu_quant(const int32_t *c, const float *row_scale, const float *col_scale, int64_t T,
                           int64_t inter, const float *block, int64_t m, int8_t *q, float *scale, float *work) {
    float *a = work, *tmp = work + inter;
    for (int64_t t = 0; t < T; t++) {
        const int32_t *g = c + t * 2 * inter, *u = g + inter;
        float rs = row_scale[t];
        for (int64_t i = 0; i < inter; i++) {
            float gv = ((float)g[i] * rs) * col_scale[i];
            float uv = ((float)u[i] * rs) * col_scale[inter + i];
            a[i] = (gv / (exp_f(-gv) + 1.0f)) * uv;
        }
        if (block) hadamard_row(a, m, inter / m, block, tmp);
        quantize_row(a, inter, 1.0f, q + t * inter, scale + t);
    }
}

/* Rows times the residual rotation R = (H_p ⊗ block) diag(col_scale), H_p Sylvester's (p = n / m a
 * power of two), block (m, m) row-major, col_scale = signs / sqrt(n) (`convert/hadamard.py`: the
 * randomized Hadamard matrix, Sylvester outer, the block inner): p-point butterflies over the row's
 * m-wide segments, each segment times the block (index order), then the column scales. O(n (log p +
 * m)) instead of the dense n x n product. x (T, n) -> y (T, n), y != x. */
CLONES void edge_mm8_rotate(const float *x, int64_t T, int64_t n, const float *block, int64_t m, const float *col_scale,
                     float *y, float *work) {
    int64_t p = n / m;
    for (int64_t t = 0; t < T; t++) {
        float *z = work, *yt = y + t * n;
        memcpy(z, x + t * n, (size_t)n * sizeof(float));
        for (int64_t h = 1; h < p; h *= 2)
            for (int64_t b = 0; b < p; b += 2 * h)
                for (int64_t i = b; i < b + h; i++) {
                    float *u = z + i * m, *v = z + (i + h) * m;
                    for (int64_t k = 0; k < m; k++) {
                        float a = u[k], d = v[k];
                        u[k] = a + d;
                        v[k] = a - d;
                    }
                }
        for (int64_t i = 0; i < p; i++) {
            const float *zi = z + i * m;
            float *o = yt + i * m;
            for (int64_t k = 0; k < m; k++) o[k] = zi[0] * block[k];
            for (int64_t j = 1; j < m; j++) {
                float w = zi[j];
                const float *bj = block + j * m;
                for (int64_t k = 0; k < m; k++) o[k] += w * bj[k];
            }
        }
        for (int64_t i = 0; i < n; i++) yt[i] *= col_scale[i];
    }
}

/* The row step's q/k/v rows after the qkv product: per-head RMSNorm of q and k with their gains
 * (q_gain, k_gain; NULL: a model without q/k norms), RoPE by the half tables cos/sin (T, D/2) (the
 * model's apply_rope: lo c - hi s, hi c + lo s), q times scale; q, k, v rows (T, ...) with row stride
 * ld (views of one (T, ld) product) -> q_out (T, H D), k_out and v_out (T, n_kv D). The model's
 * float32 steps (models/qwen3.py, models/rope.py) with the sums of squares in this file's order. */
CLONES void edge_mm8_qk_rope(const float *q, const float *k, const float *v, int64_t ld, int64_t T, int64_t H,
                             int64_t n_kv, int64_t D, const float *q_gain, const float *k_gain, float eps,
                             const float *cos_t, const float *sin_t, float scale, float *q_out, float *k_out,
                             float *v_out) {
    int64_t half = D / 2;
    for (int64_t t = 0; t < T; t++) {
        const float *c = cos_t + t * half, *s = sin_t + t * half;
        for (int64_t head = 0; head < H + n_kv; head++) {
            int is_q = head < H;
            const float *x = is_q ? q + t * ld + head * D : k + t * ld + (head - H) * D;
            const float *gain = is_q ? q_gain : k_gain;
            float *o = is_q ? q_out + (t * H + head) * D : k_out + (t * n_kv + head - H) * D;
            float xn[D > 0 ? D : 1];
            if (gain) {
                float inv = inv_rms(x, D, eps);
                for (int64_t d = 0; d < D; d++) xn[d] = gain[d] * (x[d] * inv);
            } else {
                memcpy(xn, x, (size_t)D * sizeof(float));
            }
            for (int64_t d = 0; d < half; d++) {
                float lo = xn[d], hi = xn[d + half];
                o[d] = lo * c[d] - hi * s[d];
                o[d + half] = hi * c[d] + lo * s[d];
            }
            if (is_q)
                for (int64_t d = 0; d < D; d++) o[d] *= scale;
        }
        memcpy(v_out + t * n_kv * D, v + t * ld, (size_t)(n_kv * D) * sizeof(float));
    }
}
