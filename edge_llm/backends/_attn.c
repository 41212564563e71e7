/* One query row of grouped-query attention over a layer's F32 KV rows (backend cpu-q's decode).
 *
 * Why by hand: the cache holds a layer's rows as (S, n_kv * D) F32, one row per token, and a
 * decode step reads every row once, so attention is bound by how fast those bytes stream.
 * onnxruntime's MatMul packs an operand per call (a copy of every row), its attention operators
 * want (n_kv, S, D) pasts (a transposed copy per token), and numpy needs ~20 calls per layer; no
 * library reads this layout in place. Measured in docs/quantization.md ("The attention kernel").
 *
 * The result depends only on the inputs and S, never on the thread count: the rows are cut into
 * fixed chunks of CHUNK rows, each chunk's partial softmax (its max, sum and weighted V rows) is
 * computed in one fixed order by whichever thread takes it, and the chunks are merged in order
 * on the calling thread (split-K "flash decoding"). The new token's own row, not yet in the
 * cache, is one more chunk of one row, so the cache is only read here.
 *
 * Plain C with GCC vector extensions (no intrinsics): one source for x86-64 (AVX-512, AVX2 and
 * SSE2 clones picked at load time) and aarch64 (NEON). Common head shapes (D = 64 or 128, up to
 * 4 query heads per KV head) get a specialized body that keeps q and the accumulators in vector
 * registers; other shapes take the generic loop. No Python.h: loaded with ctypes
 * (attn_kernel.py), which releases the GIL for the call.
 */
#include <stdint.h>
#include <string.h>

#define CHUNK 256  /* rows per chunk: changing it changes the bits (it is in the numerics) */
#define PREFETCH 8 /* rows ahead */

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define CLONES __attribute__((target_clones("avx512f", "avx2,fma", "default")))
#else
#define CLONES
#endif

typedef float vf __attribute__((vector_size(64), aligned(4))); /* 16 floats, any alignment */
typedef float vf8 __attribute__((vector_size(32), aligned(4)));
typedef float vf4 __attribute__((vector_size(16), aligned(4)));
#define VL 16

static inline vf load(const float *p) { return *(const vf *)p; }

static inline float hsum(vf v) {
    vf8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
            __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
    vf4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
    return (b[0] + b[2]) + (b[1] + b[3]);
}

/* e^x for x <= 0, ~2 ulp (Cephes expf) in plain arithmetic the compiler vectorizes. */
static inline float exp_neg(float x) {
    x = x < -87.0f ? -87.0f : x;
    const float magic = 12582912.0f; /* 1.5 * 2^23: adding it rounds to an integer */
    float n = (x * 1.44269504088896341f + magic) - magic;
    float r = x - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

/* sc[r * CHUNK + s] (rows of one head contiguous) -> e^(score - max); m[r] = max, l[r] = sum. */
static inline __attribute__((always_inline)) void softmax_part(float *sc, int64_t rows, int rep, float *m,
                                                               float *l) {
    for (int r = 0; r < rep; r++) {
        float *sh = sc + (int64_t)r * CHUNK, mx = sh[0], sum = 0.0f;
#pragma omp simd reduction(max : mx)
        for (int64_t s = 0; s < rows; s++) mx = sh[s] > mx ? sh[s] : mx;
#pragma omp simd reduction(+ : sum)
        for (int64_t s = 0; s < rows; s++) {
            sh[s] = exp_neg(sh[s] - mx);
            sum += sh[s];
        }
        m[r] = mx;
        l[r] = sum;
    }
}

/* One KV head's D columns of `rows` rows (row stride ld) against its `rep` query heads q
 * (rep, D): the chunk's partial softmax m, l (rep) and o (rep, D). D and rep are constants
 * after inlining, so q and the accumulators live in registers. pf: prefetch whole rows ahead
 * (set for the first KV head of a row; the others then find the row in cache). */
static inline __attribute__((always_inline)) void group_body(const float *q, const float *k, const float *v,
                                                             int64_t rows, int64_t ld, float *m, float *l,
                                                             float *o, float *sc, int pf, const int D,
                                                             const int rep) {
    const int nv = D / VL;
    vf qv[4][8], acc[4][8];
    for (int r = 0; r < rep; r++)
        for (int j = 0; j < nv; j++) qv[r][j] = load(q + r * D + j * VL);
    for (int64_t s = 0; s < rows; s++) {
        const float *kr = k + s * ld;
        if (pf)
            for (int64_t b = 0; b < ld; b += VL) __builtin_prefetch(kr + PREFETCH * ld + b);
        vf kv[8];
        for (int j = 0; j < nv; j++) kv[j] = load(kr + j * VL);
        for (int r = 0; r < rep; r++) {
            vf a = qv[r][0] * kv[0];
            for (int j = 1; j < nv; j++) a += qv[r][j] * kv[j];
            sc[(int64_t)r * CHUNK + s] = hsum(a);
        }
    }
    softmax_part(sc, rows, rep, m, l);
    for (int r = 0; r < rep; r++)
        for (int j = 0; j < nv; j++) acc[r][j] = (vf){0};
    for (int64_t s = 0; s < rows; s++) {
        const float *vr = v + s * ld;
        if (pf)
            for (int64_t b = 0; b < ld; b += VL) __builtin_prefetch(vr + PREFETCH * ld + b);
        vf vv[8];
        for (int j = 0; j < nv; j++) vv[j] = load(vr + j * VL);
        for (int r = 0; r < rep; r++) {
            const float p = sc[(int64_t)r * CHUNK + s];
            for (int j = 0; j < nv; j++) acc[r][j] += p * vv[j];
        }
    }
    for (int r = 0; r < rep; r++)
        for (int j = 0; j < nv; j++) *(vf *)(o + r * D + j * VL) = acc[r][j];
}

typedef void (*group_fn)(const float *, const float *, const float *, int64_t, int64_t, float *, float *,
                         float *, float *, int);

#define SPECIALIZE(D, REP)                                                                             \
    CLONES static void group_##D##_##REP(const float *q, const float *k, const float *v, int64_t rows,  \
                                         int64_t ld, float *m, float *l, float *o, float *sc, int pf) { \
        group_body(q, k, v, rows, ld, m, l, o, sc, pf, D, REP);                                        \
    }
SPECIALIZE(64, 1) SPECIALIZE(64, 2) SPECIALIZE(64, 3) SPECIALIZE(64, 4)
SPECIALIZE(128, 1) SPECIALIZE(128, 2) SPECIALIZE(128, 3) SPECIALIZE(128, 4)

/* Any D and rep: the same order of operations per head, with loops instead of registers. */
CLONES static void group_any(const float *q, const float *k, const float *v, int64_t rows, int64_t ld,
                             float *m, float *l, float *o, float *sc, int D, int rep) {
    for (int64_t s = 0; s < rows; s++)
        for (int r = 0; r < rep; r++) {
            float a = 0.0f;
            for (int d = 0; d < D; d++) a += q[r * D + d] * k[s * ld + d];
            sc[(int64_t)r * CHUNK + s] = a;
        }
    softmax_part(sc, rows, rep, m, l);
    memset(o, 0, sizeof(float) * (size_t)rep * (size_t)D);
    for (int64_t s = 0; s < rows; s++)
        for (int r = 0; r < rep; r++) {
            const float p = sc[(int64_t)r * CHUNK + s];
            for (int d = 0; d < D; d++) o[r * D + d] += p * v[s * ld + d];
        }
}

static group_fn specialized(int D, int rep) {
    static const group_fn d64[] = {group_64_1, group_64_2, group_64_3, group_64_4};
    static const group_fn d128[] = {group_128_1, group_128_2, group_128_3, group_128_4};
    if (rep < 1 || rep > 4) return 0;
    return D == 64 ? d64[rep - 1] : D == 128 ? d128[rep - 1] : 0;
}

/* Scratch floats edge_attn_row needs for S cached rows. */
int64_t edge_attn_work_size(int64_t S, int H, int D) {
    return ((S + CHUNK - 1) / CHUNK + 1) * (int64_t)H * (D + 2 + CHUNK);
}

/* out (H, D) = softmax(q K^T) V over the S cached rows k/v (row stride ld floats) and the new row
 * k_new/v_new. q (H, D) is already rotated and scaled by 1/sqrt(D); query head h reads KV head
 * h / (H / n_kv). work: edge_attn_work_size(S, H, D) floats. Returns 0, or -1 on bad sizes. */
int edge_attn_row(const float *q, const float *k, const float *v, const float *k_new, const float *v_new,
                  int64_t S, int64_t ld, int H, int n_kv, int D, float *out, float *work, int threads) {
    if (S < 0 || H <= 0 || n_kv <= 0 || D <= 0 || H % n_kv != 0 || ld < (int64_t)n_kv * D) return -1;
    const int rep = H / n_kv;
    const group_fn fn = specialized(D, rep);
    const int64_t full = (S + CHUNK - 1) / CHUNK, chunks = full + 1;
    const int64_t per = (int64_t)H * (D + 2 + CHUNK);
#pragma omp parallel for schedule(static) num_threads(threads) if (full > 1)
    for (int64_t c = 0; c < chunks; c++) {
        float *w = work + c * per, *m = w, *l = w + H, *o = w + 2 * H, *sc = o + (int64_t)H * D;
        const int64_t s0 = c * CHUNK, rows = c < full ? (S - s0 < CHUNK ? S - s0 : CHUNK) : 1;
        const float *kc = c < full ? k + s0 * ld : k_new, *vc = c < full ? v + s0 * ld : v_new;
        for (int g = 0; g < n_kv; g++) {
            const float *qg = q + (int64_t)g * rep * D, *kg = kc + (int64_t)g * D, *vg = vc + (int64_t)g * D;
            float *og = o + (int64_t)g * rep * D, *scg = sc + (int64_t)g * rep * CHUNK;
            if (fn)
                fn(qg, kg, vg, rows, ld, m + g * rep, l + g * rep, og, scg, g == 0 && c < full);
            else
                group_any(qg, kg, vg, rows, ld, m + g * rep, l + g * rep, og, scg, D, rep);
        }
    }
    for (int h = 0; h < H; h++) { /* merge the chunks in order */
        float mx = work[h], denom = 0.0f, *oh = out + (int64_t)h * D;
        for (int64_t c = 1; c < chunks; c++) mx = work[c * per + h] > mx ? work[c * per + h] : mx;
        for (int d = 0; d < D; d++) oh[d] = 0.0f;
        for (int64_t c = 0; c < chunks; c++) {
            const float *w = work + c * per, a = exp_neg(w[h] - mx), *o = w + 2 * H + (int64_t)h * D;
            denom += a * w[H + h];
            for (int d = 0; d < D; d++) oh[d] += a * o[d];
        }
        const float inv = 1.0f / denom;
        for (int d = 0; d < D; d++) oh[d] *= inv;
    }
    return 0;
}

/* The code path this CPU runs (part of the backend's numerics: clones round differently). */
const char *edge_attn_isa(void) {
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f")) return "x86_64-avx512f";
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return "x86_64-avx2";
    return "x86_64-sse2";
#elif defined(__aarch64__)
    return "aarch64-neon";
#else
    return "generic";
#endif
}

/* CHUNK, for the numerics string. */
int edge_attn_chunk(void) { return CHUNK; }
