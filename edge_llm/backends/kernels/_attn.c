/* Query rows of grouped-query attention over a layer's F32 KV rows: the onnxruntime custom
 * operator `ai.edge_llm.AttnRow` of backend cpu-q's decode graph (decode_export.py).
 *
 * Why by hand: the cache holds a layer's rows as (S, n_kv * D) F32, one row per token, and a
 * decode step reads every row once, so attention is bound by how fast those bytes stream.
 * onnxruntime's MatMul packs an operand per call (a copy of every row), its attention operators
 * want (n_kv, S, D) pasts (a transposed copy per token); no library reads this layout in place.
 * docs/quantization.md ("The attention operator") has the measurements.
 *
 * The result depends only on the inputs and S, never on the thread count: the rows are cut into
 * fixed chunks of CHUNK rows, each chunk's partial softmax (its max, sum and weighted V rows) is
 * computed in one fixed order by whichever of onnxruntime's pool threads takes it
 * (KernelContext_ParallelFor), and the chunks are merged in order on the calling thread (split-K
 * "flash decoding"). The new token's own row, not yet in the cache, is one more chunk of one row,
 * so the cache is only read here. A speculative verify forward brings T query rows and T new rows
 * (causal among them): row t's result is bitwise a one-row call's over the rows before it
 * (`edge_attn_rows`), and the chunks wholly in the cache are read once for all T query rows.
 *
 * Plain C with GCC vector extensions (no intrinsics): one source for x86-64 (AVX-512, AVX2 and
 * SSE2 clones picked at load time) and aarch64 (NEON). Common head shapes (D = 64 or 128, up to
 * 4 query heads per KV head) get a body that keeps q and the accumulators in vector registers;
 * other shapes take the generic loop. Built by setup.py against the vendored C API header
 * (third_party/onnxruntime); `edge_attn_row(s)` is the same computation on one thread, for tests.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "_ortop.h"

#define CHUNK 256  /* rows per chunk: changing it changes the bits (it is in the numerics) */
#define PREFETCH 8 /* rows ahead */

/* EDGE_ATTN_ONE_ISA: no clones, the code of -march alone (tests/test_attn_op.py builds the AVX2 and
 * SSE2 paths that way, to check them on a CPU whose clone dispatch would pick AVX-512) */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && !defined(EDGE_ATTN_ONE_ISA)
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

/* One row's nv vectors of one KV head into x; pf: first prefetch the whole row PREFETCH rows ahead. */
static inline __attribute__((always_inline)) void load_row(const float *r, int64_t ld, int pf, int nv, vf x[8]) {
    if (pf)
        for (int64_t b = 0; b < ld; b += VL) __builtin_prefetch(r + PREFETCH * ld + b);
    for (int j = 0; j < nv; j++) x[j] = load(r + j * VL);
}

/* Row s of a chunk whose first n1 rows are at a (the cache) and the rest at b (new rows). */
static inline const float *row_at(const float *a, const float *b, int64_t n1, int64_t s, int64_t ld) {
    return s < n1 ? a + s * ld : b + (s - n1) * ld;
}

/* One KV head's D columns of a chunk of `rows` rows (row stride ld; its first n1 rows at k1/v1,
 * the rest at k2/v2) against nq query rows, each with `rep` query heads (rep, D) at q + t * qs:
 * per query row t the chunk's partial softmax m, l (rep) and o (rep, D) at + t * os. Every
 * query row gets the same operations in the same order whatever nq is (the rows are walked in
 * blocks of SB so that a block stays in L1 while each query row reads it; a query row's
 * accumulators go through o between blocks, exactly): a row's result does not depend on the
 * rows computed beside it. D and rep are constants after inlining, so q and the accumulators live
 * in registers. pf: prefetch whole rows ahead (set for the first KV head of a row; the others
 * then find the row in cache). */
#define SB 16
static inline __attribute__((always_inline)) void group_body(const float *q, int64_t qs, int nq, const float *k1,
                                                             const float *v1, int64_t n1, const float *k2,
                                                             const float *v2, int64_t rows, int64_t ld, float *m,
                                                             float *l, float *o, int64_t os, float *sc,
                                                             int64_t scs, int pf, const int D, const int rep) {
    const int nv = D / VL;
    for (int64_t s0 = 0; s0 < rows; s0 += SB) {
        const int64_t s1 = s0 + SB < rows ? s0 + SB : rows;
        for (int t = 0; t < nq; t++) {
            const float *qt = q + t * qs;
            float *st = sc + t * scs;
            vf qv[4][8];
            for (int r = 0; r < rep; r++)
                for (int j = 0; j < nv; j++) qv[r][j] = load(qt + r * D + j * VL);
            for (int64_t s = s0; s < s1; s++) {
                vf kv[8];
                load_row(row_at(k1, k2, n1, s, ld), ld, pf && t == 0, nv, kv);
                for (int r = 0; r < rep; r++) {
                    vf a = qv[r][0] * kv[0];
                    for (int j = 1; j < nv; j++) a += qv[r][j] * kv[j];
                    st[(int64_t)r * CHUNK + s] = hsum(a);
                }
            }
        }
    }
    for (int t = 0; t < nq; t++) softmax_part(sc + t * scs, rows, rep, m + t * os, l + t * os);
    for (int64_t s0 = 0; s0 < rows; s0 += SB) {
        const int64_t s1 = s0 + SB < rows ? s0 + SB : rows;
        for (int t = 0; t < nq; t++) {
            const float *st = sc + t * scs;
            float *ot = o + t * os;
            vf acc[4][8];
            for (int r = 0; r < rep; r++)
                for (int j = 0; j < nv; j++) acc[r][j] = s0 == 0 ? (vf){0} : load(ot + r * D + j * VL);
            for (int64_t s = s0; s < s1; s++) {
                vf vv[8];
                load_row(row_at(v1, v2, n1, s, ld), ld, pf && t == 0, nv, vv);
                for (int r = 0; r < rep; r++) {
                    const float p = st[(int64_t)r * CHUNK + s];
                    for (int j = 0; j < nv; j++) acc[r][j] += p * vv[j];
                }
            }
            for (int r = 0; r < rep; r++)
                for (int j = 0; j < nv; j++) *(vf *)(ot + r * D + j * VL) = acc[r][j];
        }
    }
}

typedef void (*group_fn)(const float *, int64_t, int, const float *, const float *, int64_t, const float *,
                         const float *, int64_t, int64_t, float *, float *, float *, int64_t, float *, int64_t, int);

#define SPECIALIZE(D, REP)                                                                                  \
    CLONES static void group_##D##_##REP(const float *q, int64_t qs, int nq, const float *k1, const float *v1, \
                                         int64_t n1, const float *k2, const float *v2, int64_t rows,          \
                                         int64_t ld, float *m, float *l, float *o, int64_t os, float *sc,     \
                                         int64_t scs, int pf) {                                               \
        group_body(q, qs, nq, k1, v1, n1, k2, v2, rows, ld, m, l, o, os, sc, scs, pf, D, REP);               \
    }
SPECIALIZE(64, 1) SPECIALIZE(64, 2) SPECIALIZE(64, 3) SPECIALIZE(64, 4)
SPECIALIZE(128, 1) SPECIALIZE(128, 2) SPECIALIZE(128, 3) SPECIALIZE(128, 4)

/* Any D and rep: the same order of operations per query head, with loops instead of registers. */
CLONES static void group_any(const float *q, int64_t qs, int nq, const float *k1, const float *v1, int64_t n1,
                             const float *k2, const float *v2, int64_t rows, int64_t ld, float *m, float *l,
                             float *o, int64_t os, float *sc, int64_t scs, int D, int rep) {
    for (int t = 0; t < nq; t++) {
        const float *qt = q + t * qs;
        float *st = sc + t * scs, *ot = o + t * os;
        for (int64_t s = 0; s < rows; s++) {
            const float *kr = row_at(k1, k2, n1, s, ld);
            for (int r = 0; r < rep; r++) {
                float a = 0.0f;
                for (int d = 0; d < D; d++) a += qt[r * D + d] * kr[d];
                st[(int64_t)r * CHUNK + s] = a;
            }
        }
        softmax_part(st, rows, rep, m + t * os, l + t * os);
        memset(ot, 0, sizeof(float) * (size_t)rep * (size_t)D);
        for (int64_t s = 0; s < rows; s++) {
            const float *vr = row_at(v1, v2, n1, s, ld);
            for (int r = 0; r < rep; r++) {
                const float p = st[(int64_t)r * CHUNK + s];
                for (int d = 0; d < D; d++) ot[r * D + d] += p * vr[d];
            }
        }
    }
}

static group_fn specialized(int D, int rep) {
    static const group_fn d64[] = {group_64_1, group_64_2, group_64_3, group_64_4};
    static const group_fn d128[] = {group_128_1, group_128_2, group_128_3, group_128_4};
    if (rep < 1 || rep > 4) return 0;
    return D == 64 ? d64[rep - 1] : D == 128 ? d128[rep - 1] : 0;
}

/* T query rows: row t sees the S cached rows, the new rows 0..t-1 after them (its "past" of
 * S + t rows, cut into chunks at multiples of CHUNK as a one-row call over S + t cached rows
 * would cut them) and its own new row t, one more chunk of one row. The chunks that lie wholly
 * in the cache (the first F = S / CHUNK) are shared: one work item computes them for every query
 * row, reading the rows once. Each query row's remaining chunks and its own row are items of
 * their own. */
static int64_t n_chunks(int64_t past) { return (past + CHUNK - 1) / CHUNK; }

static int64_t tail_items(int64_t S, int64_t T) {
    int64_t n = 0, F = S / CHUNK;
    for (int64_t t = 0; t < T; t++) n += n_chunks(S + t) - F + 1;
    return n;
}

/* Scratch floats edge_attn_rows needs for S cached rows and T query rows. */
int64_t edge_attn_rows_work_size(int64_t S, int64_t T, int H, int D) {
    const int64_t slots = n_chunks(S + T - 1) + 1, F = S / CHUNK;
    return T * slots * (int64_t)H * (D + 2) + (F * T + tail_items(S, T)) * (int64_t)H * CHUNK;
}

/* Scratch floats edge_attn_row needs for S cached rows. */
int64_t edge_attn_work_size(int64_t S, int H, int D) { return edge_attn_rows_work_size(S, 1, H, D); }

typedef struct {
    const float *q, *k, *v, *k_new, *v_new;
    int64_t S, T, ld, F, slots, per, items;
    int H, n_kv, D, rep;
    group_fn fn;
    float *res, *sc; /* partial results (T, slots, per); scores */
} Job;

static int job_init(Job *j, const float *q, const float *k, const float *v, const float *k_new,
                    const float *v_new, int64_t S, int64_t T, int64_t ld, int H, int n_kv, int D, float *work) {
    if (S < 0 || T < 1 || H <= 0 || n_kv <= 0 || D <= 0 || H % n_kv != 0 || ld < (int64_t)n_kv * D) return -1;
    j->q = q, j->k = k, j->v = v, j->k_new = k_new, j->v_new = v_new;
    j->S = S, j->T = T, j->ld = ld, j->H = H, j->n_kv = n_kv, j->D = D, j->rep = H / n_kv;
    j->fn = specialized(D, j->rep);
    j->F = S / CHUNK;
    j->slots = n_chunks(S + T - 1) + 1;
    j->per = (int64_t)H * (D + 2);
    j->items = j->F + tail_items(S, T);
    j->res = work;
    j->sc = work + T * j->slots * j->per;
    return 0;
}

/* The chunk's rows for one KV head into fn (or the generic loop). */
static void run_group(const Job *j, int g, const float *q, int nq, const float *k1, const float *v1, int64_t n1,
                      const float *k2, const float *v2, int64_t rows, float *r, float *sc, int pf) {
    const int64_t D = j->D, rep = j->rep, H = j->H, os = j->slots * j->per;
    const float *qg = q + g * rep * D;
    float *m = r + g * rep, *l = r + H + g * rep, *o = r + 2 * H + g * rep * D, *scg = sc + g * rep * CHUNK;
    const int64_t off = (int64_t)g * D, qs = H * D, scs = H * CHUNK;
    const float *k2g = k2 ? k2 + off : 0, *v2g = v2 ? v2 + off : 0;
    if (j->fn)
        j->fn(qg, qs, nq, k1 + off, v1 + off, n1, k2g, v2g, rows, j->ld, m, l, o, os, scg, scs, pf);
    else
        group_any(qg, qs, nq, k1 + off, v1 + off, n1, k2g, v2g, rows, j->ld, m, l, o, os, scg, scs, (int)D,
                  (int)rep);
}

/* Work item i of a job, into its own slices of the scratch. */
static void job_item(void *arg, size_t i_) {
    const Job *j = (const Job *)arg;
    const int64_t H = j->H, ld = j->ld, S = j->S, hc = H * CHUNK;
    int64_t i = (int64_t)i_;
    if (i < j->F) { /* a chunk of the cache shared by every query row */
        const float *k = j->k + i * CHUNK * ld, *v = j->v + i * CHUNK * ld;
        for (int g = 0; g < j->n_kv; g++)
            run_group(j, g, j->q, (int)j->T, k, v, CHUNK, 0, 0, CHUNK, j->res + i * j->per, j->sc + i * j->T * hc,
                      g == 0);
        return;
    }
    float *sc = j->sc + j->F * j->T * hc + (i - j->F) * hc;
    i -= j->F;
    int64_t t = 0, c;
    for (;; t++) { /* query row t's items: chunks F .. n_chunks(S + t) - 1, then its own row */
        const int64_t n = n_chunks(S + t) - j->F + 1;
        if (i < n) break;
        i -= n;
    }
    c = j->F + i;
    const float *q = j->q + t * H * j->D;
    float *r = j->res + (t * j->slots + c) * j->per;
    const int64_t past = S + t;
    if (c == n_chunks(past)) { /* its own new row */
        for (int g = 0; g < j->n_kv; g++)
            run_group(j, g, q, 1, j->k_new + t * ld, j->v_new + t * ld, 1, 0, 0, 1, r, sc, 0);
        return;
    }
    const int64_t a0 = c * CHUNK, a1 = a0 + CHUNK < past ? a0 + CHUNK : past;
    const int64_t n1 = a0 < S ? (a1 < S ? a1 : S) - a0 : 0, b0 = (a0 > S ? a0 : S) - S;
    const float *k1 = n1 ? j->k + a0 * ld : j->k_new + b0 * ld, *v1 = n1 ? j->v + a0 * ld : j->v_new + b0 * ld;
    for (int g = 0; g < j->n_kv; g++)
        run_group(j, g, q, 1, k1, v1, n1 ? n1 : a1 - a0, j->k_new + b0 * ld, j->v_new + b0 * ld, a1 - a0, r, sc,
                  g == 0);
}

/* Merge query row t's chunks in order into out (H, D). */
static void job_merge(const Job *j, int64_t t, float *out) {
    const int64_t chunks = n_chunks(j->S + t) + 1, per = j->per, H = j->H, D = j->D;
    const float *work = j->res + t * j->slots * per;
    for (int64_t h = 0; h < H; h++) {
        float mx = work[h], denom = 0.0f, *oh = out + h * D;
        for (int64_t c = 1; c < chunks; c++) mx = work[c * per + h] > mx ? work[c * per + h] : mx;
        for (int64_t d = 0; d < D; d++) oh[d] = 0.0f;
        for (int64_t c = 0; c < chunks; c++) {
            const float *w = work + c * per, a = exp_neg(w[h] - mx), *o = w + 2 * H + h * D;
            denom += a * w[H + h];
            for (int64_t d = 0; d < D; d++) oh[d] += a * o[d];
        }
        const float inv = 1.0f / denom;
        for (int64_t d = 0; d < D; d++) oh[d] *= inv;
    }
}

/* out (T, H, D): query row t (q row t, (H, D), already rotated and scaled by 1/sqrt(D)) attends
 * to the S cached rows k/v (row stride ld floats), then the new rows k_new/v_new 0..t (causal),
 * on the calling thread. Query head h reads KV head h / (H / n_kv). Row t's result is bitwise
 * that of a one-row call over S + t cached rows (the same rows) and new row t. work:
 * edge_attn_rows_work_size(S, T, H, D) floats. Returns 0, or -1 on bad sizes. The operator below
 * computes exactly this, its work items spread over threads. */
int edge_attn_rows(const float *q, const float *k, const float *v, const float *k_new, const float *v_new,
                   int64_t S, int64_t T, int64_t ld, int H, int n_kv, int D, float *out, float *work) {
    Job j;
    if (job_init(&j, q, k, v, k_new, v_new, S, T, ld, H, n_kv, D, work) != 0) return -1;
    for (int64_t i = 0; i < j.items; i++) job_item(&j, (size_t)i);
    for (int64_t t = 0; t < T; t++) job_merge(&j, t, out + t * H * D);
    return 0;
}

/* edge_attn_rows with one query row (T = 1). */
int edge_attn_row(const float *q, const float *k, const float *v, const float *k_new, const float *v_new,
                  int64_t S, int64_t ld, int H, int n_kv, int D, float *out, float *work) {
    return edge_attn_rows(q, k, v, k_new, v_new, S, 1, ld, H, n_kv, D, out, work);
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

/* ---- the onnxruntime operator ai.edge_llm.AttnRow ---------------------------------------------
 * inputs  q (T, H * D), k (S, n_kv * D), v (S, n_kv * D), k_new (T, n_kv * D), v_new (T, n_kv * D)
 * output  attn (T, H * D)                   attributes  num_heads = H, kv_heads = n_kv  (int64)
 * T = 1 is a decode step; T > 1 verifies drafted tokens (causal among the new rows). */
static const OrtApi *ort;

typedef struct {
    int64_t H, n_kv;
} AttnRow;

static OrtStatusPtr fail(const char *msg) { return ort->CreateStatus(ORT_INVALID_ARGUMENT, msg); }

/* A 2-D float tensor's data and shape. */
static OrtStatusPtr tensor2d(OrtKernelContext *ctx, size_t index, const float **data, int64_t dims[2]) {
    return op_input(ort, ctx, index, (const void **)data, dims, 2, "AttnRow: every input must be 2-D");
}

static OrtStatusPtr op_create(const OrtCustomOp *op, const OrtApi *api, const OrtKernelInfo *info, void **out) {
    (void)op;
    AttnRow *a = calloc(1, sizeof *a);
    if (a == NULL) return api->CreateStatus(ORT_FAIL, "AttnRow: out of memory");
    OrtStatusPtr st = api->KernelInfoGetAttribute_int64(info, "num_heads", &a->H);
    if (st == NULL) st = api->KernelInfoGetAttribute_int64(info, "kv_heads", &a->n_kv);
    if (st == NULL && (a->H <= 0 || a->n_kv <= 0 || a->H % a->n_kv != 0))
        st = api->CreateStatus(ORT_INVALID_ARGUMENT, "AttnRow: num_heads must be a positive multiple of kv_heads");
    if (st != NULL) {
        free(a);
        return st;
    }
    *out = a;
    return NULL;
}

static OrtStatusPtr op_compute(void *kernel, OrtKernelContext *ctx) {
    const AttnRow *a = (const AttnRow *)kernel;
    const float *in[5];
    int64_t dims[5][2];
    for (size_t i = 0; i < 5; i++) CHECK(tensor2d(ctx, i, &in[i], dims[i]));
    const int64_t H = a->H, n_kv = a->n_kv, T = dims[0][0], S = dims[1][0], ld = dims[1][1];
    if (T < 1 || dims[0][1] % H != 0) return fail("AttnRow: q must be (T >= 1, num_heads * D)");
    const int64_t D = dims[0][1] / H;
    if (ld != n_kv * D || dims[2][0] != S || dims[2][1] != ld) return fail("AttnRow: k, v must be (S, kv_heads * D)");
    if (dims[3][0] != T || dims[3][1] != ld || dims[4][0] != T || dims[4][1] != ld)
        return fail("AttnRow: k_new, v_new must be (T, kv_heads * D), T = q's rows");
    OrtValue *out_value;
    float *out;
    CHECK(ort->KernelContext_GetOutput(ctx, 0, dims[0], 2, &out_value));
    CHECK(ort->GetTensorMutableData(out_value, (void **)&out));
    float *work = malloc(sizeof(float) * (size_t)edge_attn_rows_work_size(S, T, (int)H, (int)D));
    if (work == NULL) return ort->CreateStatus(ORT_FAIL, "AttnRow: out of memory");
    Job j;
    job_init(&j, in[0], in[1], in[2], in[3], in[4], S, T, ld, (int)H, (int)n_kv, (int)D, work);
    OrtStatusPtr st = ort->KernelContext_ParallelFor(ctx, job_item, (size_t)j.items, 0, &j);
    if (st == NULL)
        for (int64_t t = 0; t < T; t++) job_merge(&j, t, out + t * H * D);
    free(work);
    return st;
}

static const char *op_name(const OrtCustomOp *op) { (void)op; return "AttnRow"; }
static ONNXTensorElementDataType op_type(const OrtCustomOp *op, size_t i) {
    (void)op, (void)i;
    return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
}
static size_t op_inputs(const OrtCustomOp *op) { (void)op; return 5; }
static size_t op_outputs(const OrtCustomOp *op) { (void)op; return 1; }

static OrtCustomOp attn_row_op = ORT_CUSTOM_OP(op_name, op_type, op_inputs, op_type, op_outputs, op_create, op_compute);

OrtCustomOp *edge_qmatmul_op(const OrtApi *api);

/* Called by onnxruntime for SessionOptions.register_custom_ops_library(this library): both of
 * its operators, AttnRow (here) and MatMulQ (_qmatmul.c). */
__attribute__((visibility("default"))) OrtStatus *RegisterCustomOps(OrtSessionOptions *options,
                                                                    const OrtApiBase *api_base) {
    ort = api_base->GetApi(ORT_API_VERSION);
    if (ort == NULL) return NULL; /* an onnxruntime older than this header: the graph then fails to load */
    OrtCustomOpDomain *domain;
    CHECK(ort->CreateCustomOpDomain("ai.edge_llm", &domain)); /* lives as long as the process */
    CHECK(ort->CustomOpDomain_Add(domain, &attn_row_op));
    CHECK(ort->CustomOpDomain_Add(domain, edge_qmatmul_op(ort))); /* the 4-bit weights' matmul, _qmatmul.c */
    return ort->AddCustomOpDomain(options, domain);
}
