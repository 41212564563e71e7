/* x (T, K) @ W for 4-bit and 8-bit block weights: the onnxruntime custom operator
 * `ai.edge_llm.MatMulQ` of backend cpu-q's decode graph (nbits_export.py writes it;
 * docs/quantization.md, "The weight operator").
 *
 * Why by hand: a decode step reads every weight once, so a step costs the weight bytes over the
 * memory bandwidth, plus what the kernel adds. onnxruntime's MatMulNBits holds an integer zero
 * point but not GGUF Q4_1's float block minimum, so every linear of the graph was MatMulNBits +
 * Reshape + ReduceSum + MatMul + Add (480 of the decode graph's 1052 nodes), and its kernels round
 * one row differently from several on AVX2. No library multiplies these blocks in place
 * (llama.cpp's kernels live inside ggml, behind its own graph and threads).
 *
 * The weights: the blocks of nbits.QuantWeight as they are (GGUF blocks stay exact), centred
 * (nbits.center: W[k, n] = d (q - z) + m, integer q and z, float d and m per column and 32-row
 * block), regrouped for streaming: 16 columns (a tile) x one block per record,
 *     levels   64 * bits bytes: 4-bit: byte 64 i + 4 c + u = q_c[4 i + u] | q_c[16 + 4 i + u] << 4
 *                               8-bit: byte 64 i + 4 c + u = q_c[4 i + u]       (c < 16; i, u < 4 or 8)
 *     d        16 float32          z   16 uint8          m   16 float32 (only with `mins`)
 * (records of a tile are consecutive, tiles follow; columns past N are zero).
 *
 * The arithmetic: each row of x is quantized per 32-block to int8 (xq = round-half-even(x / dx),
 * dx = max|x| / 127, llama.cpp's Q8_1), and the block sum of x is kept in float. Per column and
 * block the integer dot  i = sum_k (q_k - z) xq_k  is exact, whichever instructions compute it:
 * AVX-512 VNNI / AVX-VNNI `vpdpbusd`, AVX2 `vpmaddubsw`, NEON `sdot`, or plain C. Then per
 * column, in block order, acc = fma(d * dx, i, acc) and acc = fma(m, sum x, acc): the same float
 * operations on every path (explicit fma, never a compiler's contraction). So the result is
 * bitwise the same on every CPU, and a row's result depends only on that row (rows never mix).
 * The work items are tiles of 16 columns, spread over onnxruntime's pool threads; the thread
 * count does not change a bit. `edge_qmatmul` is the same computation on one thread (tests).
 *
 * passes = 2 (cpu-q's q4 since quant format 5): the int8 rounding of x is what separated cpu-q's
 * answers from F32's (docs/quantization.md, "Where the error comes from"), so each row is also
 * given its remainder x - dx xq, rounded per block the same way, as a second row: the tile kernels
 * run both (AVX-512 unpacks a block's levels once for the pair) and the two results are added, one
 * float add per output. About 15 bits per activation for twice the integer work and the same weight
 * bytes; every path still gives the same bits.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "_ortop.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define EDGE_X86 1
#elif defined(__aarch64__) && defined(__GNUC__)
#include <arm_neon.h>
#include <sys/auxv.h>
#define EDGE_ARM 1
#endif

#define QB 32             /* weights per block */
#define TILE 16           /* columns per record */
/* record bytes: the levels (16 columns x 32 levels x bits / 8), d, z, m if any */
static int64_t rec_bytes(int bits, int mins) { return 16 * 4 * bits + 64 + 16 + (mins ? 64 : 0); }

/* One row's activations, quantized per block. */
typedef struct {
    const int8_t *xq; /* (nb, 32) */
    const float *dx;  /* (nb) */
    const int32_t *sq; /* (nb) sum of xq */
    const float *sx;  /* (nb) sum of x, in order */
} Row;

/* ---- a tile: 16 columns, all blocks, rows [0, T) ----------------------------------------------
 * Lane c of every vector is column c: the levels of a record are laid out so that one int32 lane
 * sums four products of its own column (vpdpbusd, vpmaddubsw + vpmaddwd and sdot all sum four
 * byte products per lane), so no horizontal sums are needed. Per column and block:
 *     i = sum_k q_k xq_k - z sum_k xq_k   (exact: integers below 2^24, so also exact as the x86
 *                                        paths compute it, fnmadd of their float conversions),
 *     acc = fma(d * dx, (float)i, acc),   acc = fma(m, sum x, acc). */
typedef struct {
    const uint8_t *blocks;
    const Row *rows;
    int64_t T, N, nb, rec, lv; /* record bytes, of which levels */
    int bits, mins;
    float *y; /* (T, N) */
} Job;

static inline const uint8_t *record(const Job *j, int64_t tile, int64_t b) {
    return j->blocks + (tile * j->nb + b) * j->rec;
}

static inline int32_t load32(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

static void store_cols(const Job *j, int64_t t, int64_t tile, const float acc[TILE]) {
    const int64_t c0 = tile * TILE, nc = j->N - c0 < TILE ? j->N - c0 : TILE;
    memcpy(j->y + t * j->N + c0, acc, sizeof(float) * (size_t)nc);
}

/* Level k of column c in a record: 4-bit byte 64 (k % 16 / 4) + 4 c + k % 4, low nibble for k < 16;
 * 8-bit byte 64 (k / 4) + 4 c + k % 4. */
static inline int32_t level(const uint8_t *rec, int bits, int c, int k) {
    if (bits == 8) return rec[64 * (k / 4) + 4 * c + k % 4];
    const uint8_t v = rec[64 * (k % 16 / 4) + 4 * c + k % 4];
    return k < 16 ? v & 15 : v >> 4;
}

/* Plain C: any CPU. */
static void tile_c(const Job *j, int64_t tile) {
    for (int64_t t = 0; t < j->T; t++) {
        const Row *r = &j->rows[t];
        float acc[TILE] = {0};
        for (int64_t b = 0; b < j->nb; b++) {
            const uint8_t *rec = record(j, tile, b), *z = rec + j->lv + 64;
            const int8_t *x = r->xq + b * QB;
            for (int c = 0; c < TILE; c++) {
                int32_t s = 0;
                for (int k = 0; k < QB; k++) s += level(rec, j->bits, c, k) * x[k];
                float d, m;
                memcpy(&d, rec + j->lv + 4 * c, sizeof d);
                acc[c] = fmaf(d * r->dx[b], (float)(s - (int32_t)z[c] * r->sq[b]), acc[c]);
                if (j->mins) {
                    memcpy(&m, rec + j->lv + 80 + 4 * c, sizeof m);
                    acc[c] = fmaf(m, r->sx[b], acc[c]);
                }
            }
        }
        store_cols(j, t, tile, acc);
    }
}

#ifdef EDGE_X86
/* One row's dots with a block's unpacked levels w, added to acc (16 columns). */
__attribute__((target("avx512f,avx512bw,avx512vnni,fma"))) static inline __attribute__((always_inline)) __m512
row_vnni512(const Job *j, const Row *r, int64_t b, const __m512i w[8], __m512 z, __m512 d, __m512 m, __m512 acc) {
    const int8_t *x = r->xq + b * QB;
    __m512i sl = _mm512_setzero_si512(), sh = _mm512_setzero_si512();
    for (int i = 0; i < 4; i++) {
        sl = _mm512_dpbusd_epi32(sl, w[i], _mm512_set1_epi32(load32(x + 4 * i)));
        sh = _mm512_dpbusd_epi32(sh, w[4 + i], _mm512_set1_epi32(load32(x + 16 + 4 * i)));
    }
    const __m512 is = _mm512_fnmadd_ps(z, _mm512_set1_ps((float)r->sq[b]), _mm512_cvtepi32_ps(_mm512_add_epi32(sl, sh)));
    acc = _mm512_fmadd_ps(_mm512_mul_ps(d, _mm512_set1_ps(r->dx[b])), is, acc);
    return j->mins ? _mm512_fmadd_ps(m, _mm512_set1_ps(r->sx[b]), acc) : acc;
}

/* Rows t and, if `two`, t + 1: a block's levels are unpacked once for both (a verify forward's
 * rows); each row gets the same operations either way. */
__attribute__((target("avx512f,avx512bw,avx512vnni,fma"))) static inline __attribute__((always_inline)) void
rows_vnni512(const Job *j, int64_t tile, int64_t t, const int two) {
    const __m512i m4 = _mm512_set1_epi8(15);
    const Row *r0 = &j->rows[t], *r1 = two ? r0 + 1 : r0;
    __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
    for (int64_t b = 0; b < j->nb; b++) {
        const uint8_t *rec = record(j, tile, b), *dz = rec + j->lv;
        if (b + 1 < j->nb) __builtin_prefetch(rec + j->rec + j->lv);
        __m512i w[8]; /* w[i] multiplies activations 4 i .. 4 i + 3 */
        for (int i = 0; i < 4; i++) {
            const __m512i v = _mm512_loadu_si512((const void *)(rec + 64 * i));
            if (j->bits == 4) {
                w[i] = _mm512_and_si512(v, m4);
                w[4 + i] = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
            } else {
                w[i] = v;
                w[4 + i] = _mm512_loadu_si512((const void *)(rec + 256 + 64 * i));
            }
        }
        const __m512 z = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(dz + 64))));
        const __m512 d = _mm512_loadu_ps((const float *)dz);
        const __m512 m = j->mins ? _mm512_loadu_ps((const float *)(dz + 80)) : _mm512_setzero_ps();
        acc0 = row_vnni512(j, r0, b, w, z, d, m, acc0);
        if (two) acc1 = row_vnni512(j, r1, b, w, z, d, m, acc1);
    }
    float out[TILE];
    _mm512_storeu_ps(out, acc0);
    store_cols(j, t, tile, out);
    if (two) {
        _mm512_storeu_ps(out, acc1);
        store_cols(j, t + 1, tile, out);
    }
}

/* AVX-512 VNNI: the 16 columns in one register; vpdpbusd multiplies the unsigned levels by the
 * signed activations (four per lane). */
__attribute__((target("avx512f,avx512bw,avx512vnni,fma"))) static void tile_vnni512(const Job *j, int64_t tile) {
    int64_t t = 0;
    for (; t + 1 < j->T; t += 2) rows_vnni512(j, tile, t, 1);
    if (t < j->T) rows_vnni512(j, tile, t, 0);
}

/* AVX2 / AVX-VNNI: 8 columns per register, two halves. MAC(acc, u8, s8) adds per int32 lane the
 * lane's four byte products: vpdpbusd (AVX-VNNI), or vpmaddubsw + vpmaddwd (AVX2: a pair of
 * products is at most 2 * 15 * 127 for 4-bit levels, so the 16-bit sums never saturate). 8-bit
 * levels (up to 255) could saturate vpmaddubsw, so they are taken signed, q - 128, through the
 * sign trick (|q - 128| times x with q - 128's sign: pairs at most 2 * 128 * 127), and z - 128
 * is subtracted instead of z; both sums are the exact integer. */
#define TILE256(NAME, TARGET, MAC)                                                                               \
    __attribute__((target(TARGET))) static void NAME(const Job *j, int64_t tile) {                              \
        const __m256i m4 = _mm256_set1_epi8(15), bias = _mm256_set1_epi8((char)0x80);                           \
        const int zoff = j->bits == 8 ? 128 : 0;                                                                 \
        for (int64_t t = 0; t < j->T; t++) {                                                                     \
            const Row *r = &j->rows[t];                                                                          \
            __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};                                         \
            for (int64_t b = 0; b < j->nb; b++) {                                                                \
                const uint8_t *rec = record(j, tile, b), *dz = rec + j->lv;                                      \
                if (b + 1 < j->nb) __builtin_prefetch(rec + j->rec + j->lv);                                     \
                const int8_t *x = r->xq + b * QB;                                                                \
                const __m256 dx = _mm256_set1_ps(r->dx[b]), sx = _mm256_set1_ps(r->sx[b]);                       \
                const __m256 sq = _mm256_set1_ps((float)r->sq[b]);                                               \
                for (int h = 0; h < 2; h++) {                                                                    \
                    __m256i sl = _mm256_setzero_si256(), sh = _mm256_setzero_si256();                            \
                    if (j->bits == 4)                                                                            \
                        for (int i = 0; i < 4; i++) {                                                            \
                            const __m256i v = _mm256_loadu_si256((const __m256i *)(rec + 64 * i + 32 * h));      \
                            sl = MAC(sl, _mm256_and_si256(v, m4), _mm256_set1_epi32(load32(x + 4 * i)));         \
                            sh = MAC(sh, _mm256_and_si256(_mm256_srli_epi16(v, 4), m4),                          \
                                     _mm256_set1_epi32(load32(x + 16 + 4 * i)));                                 \
                        }                                                                                        \
                    else                                                                                         \
                        for (int i = 0; i < 8; i++) {                                                            \
                            const __m256i v = _mm256_xor_si256(                                                  \
                                _mm256_loadu_si256((const __m256i *)(rec + 64 * i + 32 * h)), bias);             \
                            const __m256i xv = _mm256_set1_epi32(load32(x + 4 * i));                             \
                            sl = MAC(sl, _mm256_abs_epi8(v), _mm256_sign_epi8(xv, v));                           \
                        }                                                                                        \
                    const __m256 z = _mm256_cvtepi32_ps(_mm256_sub_epi32(                                        \
                        _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(dz + 64 + 8 * h))),               \
                        _mm256_set1_epi32(zoff)));                                                               \
                    const __m256 is = _mm256_fnmadd_ps(z, sq, _mm256_cvtepi32_ps(_mm256_add_epi32(sl, sh)));     \
                    const __m256 p = _mm256_mul_ps(_mm256_loadu_ps((const float *)dz + 8 * h), dx);              \
                    acc[h] = _mm256_fmadd_ps(p, is, acc[h]);                                                     \
                    if (j->mins) acc[h] = _mm256_fmadd_ps(_mm256_loadu_ps((const float *)(dz + 80) + 8 * h), sx, acc[h]); \
                }                                                                                                \
            }                                                                                                    \
            float out[TILE];                                                                                     \
            _mm256_storeu_ps(out, acc[0]);                                                                       \
            _mm256_storeu_ps(out + 8, acc[1]);                                                                   \
            store_cols(j, t, tile, out);                                                                         \
        }                                                                                                        \
    }
#define MAC_VNNI(acc, a, b) _mm256_dpbusd_avx_epi32(acc, a, b)
#define MAC_AVX2(acc, a, b) _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(a, b), _mm256_set1_epi16(1)))
TILE256(tile_avxvnni, "avx2,fma,avxvnni", MAC_VNNI)
TILE256(tile_avx2, "avx2,fma", MAC_AVX2)
#endif

#ifdef EDGE_ARM
/* NEON with the dot-product extension (Cortex-A76 and later): 4 columns per register; sdot's lane
 * form multiplies each column's 4 levels by the same 4 activations. sdot is signed: 4-bit levels
 * (0..15) are valid signed bytes; 8-bit levels are taken as q - 128 and z - 128 subtracted. */
#define SDOT4(s, v, xl, xh, i)                                                                      \
    do {                                                                                            \
        s = vdotq_laneq_s32(s, vreinterpretq_s8_u8(vandq_u8(v, m4)), xl, i);                        \
        s = vdotq_laneq_s32(s, vreinterpretq_s8_u8(vshrq_n_u8(v, 4)), xh, i);                       \
    } while (0)
#define SDOT8(s, p, x, i) s = vdotq_laneq_s32(s, vreinterpretq_s8_u8(veorq_u8(vld1q_u8(p), bias)), x, i)
__attribute__((target("arch=armv8.2-a+dotprod"))) static void tile_sdot(const Job *j, int64_t tile) {
    const uint8x16_t m4 = vdupq_n_u8(15), bias = vdupq_n_u8(0x80);
    const int32x4_t zoff = vdupq_n_s32(j->bits == 8 ? 128 : 0);
    for (int64_t t = 0; t < j->T; t++) {
        const Row *r = &j->rows[t];
        float32x4_t acc[4] = {vdupq_n_f32(0), vdupq_n_f32(0), vdupq_n_f32(0), vdupq_n_f32(0)};
        for (int64_t b = 0; b < j->nb; b++) {
            const uint8_t *rec = record(j, tile, b), *dz = rec + j->lv;
            if (b + 1 < j->nb) __builtin_prefetch(rec + j->rec + j->lv);
            const int8x16_t xl = vld1q_s8(r->xq + b * QB), xh = vld1q_s8(r->xq + b * QB + 16);
            const float32x4_t dx = vdupq_n_f32(r->dx[b]), sx = vdupq_n_f32(r->sx[b]);
            const int32x4_t sq = vdupq_n_s32(r->sq[b]);
            const uint16x8_t z16 = vmovl_u8(vld1_u8(dz + 64)), z16h = vmovl_u8(vld1_u8(dz + 72));
            const uint32x4_t zs[4] = {vmovl_u16(vget_low_u16(z16)), vmovl_u16(vget_high_u16(z16)),
                                      vmovl_u16(vget_low_u16(z16h)), vmovl_u16(vget_high_u16(z16h))};
            for (int g = 0; g < 4; g++) {
                int32x4_t s = vdupq_n_s32(0);
                const uint8_t *p = rec + 16 * g;
                if (j->bits == 4) {
                    SDOT4(s, vld1q_u8(p), xl, xh, 0);
                    SDOT4(s, vld1q_u8(p + 64), xl, xh, 1);
                    SDOT4(s, vld1q_u8(p + 128), xl, xh, 2);
                    SDOT4(s, vld1q_u8(p + 192), xl, xh, 3);
                } else {
                    SDOT8(s, p, xl, 0), SDOT8(s, p + 64, xl, 1), SDOT8(s, p + 128, xl, 2), SDOT8(s, p + 192, xl, 3);
                    SDOT8(s, p + 256, xh, 0), SDOT8(s, p + 320, xh, 1), SDOT8(s, p + 384, xh, 2);
                    SDOT8(s, p + 448, xh, 3);
                }
                const int32x4_t z = vsubq_s32(vreinterpretq_s32_u32(zs[g]), zoff);
                const int32x4_t is = vsubq_s32(s, vmulq_s32(z, sq));
                const float32x4_t pd = vmulq_f32(vld1q_f32((const float *)dz + 4 * g), dx);
                acc[g] = vfmaq_f32(acc[g], pd, vcvtq_f32_s32(is));
                if (j->mins) acc[g] = vfmaq_f32(acc[g], vld1q_f32((const float *)(dz + 80) + 4 * g), sx);
            }
        }
        float out[TILE];
        for (int g = 0; g < 4; g++) vst1q_f32(out + 4 * g, acc[g]);
        store_cols(j, t, tile, out);
    }
}
#endif

typedef void (*tile_fn)(const Job *, int64_t);
static const struct {
    const char *name;
    tile_fn fn;
} PATHS[] = {
#ifdef EDGE_X86
    {"avx512vnni", tile_vnni512},
    {"avxvnni", tile_avxvnni},
    {"avx2", tile_avx2},
#endif
#ifdef EDGE_ARM
    {"sdot", tile_sdot},
#endif
    {"c", tile_c},
};
#define N_PATHS ((int)(sizeof PATHS / sizeof PATHS[0]))

static int supported(int i) {
    const char *n = PATHS[i].name;
    (void)n;
#ifdef EDGE_X86
    __builtin_cpu_init();
    if (!strcmp(n, "avx512vnni"))
        return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
               __builtin_cpu_supports("avx512vnni");
    if (!strcmp(n, "avxvnni"))
        return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("avxvnni");
    if (!strcmp(n, "avx2")) return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#endif
#ifdef EDGE_ARM
    if (!strcmp(n, "sdot")) return (getauxval(AT_HWCAP) & HWCAP_ASIMDDP) != 0;
#endif
    return 1;
}

static int chosen = -1; /* index into PATHS: the first this CPU supports, or one forced */

static int find(const char *name) {
    for (int i = 0; i < N_PATHS; i++)
        if (!strcmp(PATHS[i].name, name) && supported(i)) return i;
    return -1;
}

/* The first path this CPU supports, unless EDGE_QMATMUL_ISA names another it supports (benchmarks
 * of a slower path, e.g. AVX2 on an AVX-512 machine; the bits are the same). */
static int path(void) {
    int p = __atomic_load_n(&chosen, __ATOMIC_RELAXED);
    if (p < 0) {
        const char *env = getenv("EDGE_QMATMUL_ISA");
        p = env != NULL && *env ? find(env) : -1;
        if (p < 0)
            for (p = 0; p < N_PATHS - 1 && !supported(p); p++) {
            }
        __atomic_store_n(&chosen, p, __ATOMIC_RELAXED);
    }
    return p;
}

/* The path this CPU runs: "avx512vnni", "avxvnni", "avx2", "sdot" or "c" (all give the same bits). */
const char *edge_qmatmul_isa(void) { return PATHS[path()].name; }

/* Run `name` from now on (tests compare the paths); returns 0, or -1 if this CPU lacks it. */
int edge_qmatmul_force(const char *name) {
    const int i = find(name);
    if (i >= 0) __atomic_store_n(&chosen, i, __ATOMIC_RELAXED);
    return i >= 0 ? 0 : -1;
}

/* ---- the rows ---------------------------------------------------------------------------------- */
/* Bytes of scratch for T rows of K (a multiple of 32). */
int64_t edge_qmatmul_work_size(int64_t T, int64_t K) {
    const int64_t nb = K / QB;
    return T * (K + nb * 16 + (int64_t)sizeof(Row));
}

/* Bytes of scratch for T rows of K (a multiple of 32) in `passes` passes (1 or 2) and N outputs. */
int64_t edge_qmatmul_passes_work_size(int64_t T, int64_t K, int64_t N, int passes) {
    if (passes == 1) return edge_qmatmul_work_size(T, K);
    return edge_qmatmul_work_size(2 * T, K) + (int64_t)sizeof(float) * T * (K + 2 * N);
}

/* One row x (K) -> its quantized blocks in r (storage: q (K), dx and sx (nb each), sq (nb)).
 * Plain C on the calling thread, one order of operations everywhere (the compiler barrier keeps
 * x * (1 / dx) from being fused into the rounding's add). */
static void quantize_row(const float *x, int64_t K, Row *r, int8_t *q, float *dx, float *sx, int32_t *sqt) {
    const int64_t nb = K / QB;
    r->xq = q, r->dx = dx, r->sx = sx, r->sq = sqt;
    for (int64_t b = 0; b < nb; b++) {
        const float *xb = x + b * QB;
        float amax = 0.0f, sum = 0.0f, s[QB];
        for (int i = 0; i < QB; i++) {
            const float a = fabsf(xb[i]);
            amax = a > amax ? a : amax;
            sum += xb[i];
        }
        const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
        for (int i = 0; i < QB; i++) s[i] = xb[i] * id;
        __asm__ volatile("" : : "r"(s) : "memory");
        int32_t n = 0;
        for (int i = 0; i < QB; i++) {
            const float magic = 12582912.0f; /* 1.5 * 2^23: adding it rounds half to even */
            const int32_t v = (int32_t)((s[i] + magic) - magic);
            q[b * QB + i] = (int8_t)v;
            n += v;
        }
        dx[b] = d, sx[b] = sum, sqt[b] = n;
    }
}

/* x (T, K) -> the rows' quantized blocks in work. passes = 2: row 2t is row t rounded as above,
 * row 2t + 1 its remainder x - dx q (one explicit fma per element, the same bits everywhere)
 * rounded the same way, with a block sum of 0 (the float minimum's term is row 2t's alone). */
static Row *quantize_rows(const float *x, int64_t T, int64_t K, int passes, uint8_t *work) {
    const int64_t nb = K / QB, R = T * passes;
    Row *rows = (Row *)work;
    int8_t *xq = (int8_t *)(work + R * (int64_t)sizeof(Row));
    float *f = (float *)(xq + R * K); /* dx, sx per row */
    int32_t *sq = (int32_t *)(f + 2 * R * nb);
    float *rem = (float *)(work + edge_qmatmul_work_size(R, K)); /* passes = 2: one row's remainder */
    for (int64_t t = 0; t < R; t++) {
        const int64_t src = t / passes;
        float *dx = f + 2 * t * nb, *sx = dx + nb;
        if (t % passes == 0) {
            quantize_row(x + src * K, K, &rows[t], xq + t * K, dx, sx, sq + t * nb);
            continue;
        }
        const Row *p = &rows[t - 1];
        for (int64_t k = 0; k < K; k++) rem[k] = fmaf(-p->dx[k / QB], (float)p->xq[k], x[src * K + k]);
        quantize_row(rem, K, &rows[t], xq + t * K, dx, sx, sq + t * nb);
        for (int64_t b = 0; b < nb; b++) sx[b] = 0.0f;
    }
    return rows;
}

/* passes = 2: the job computes 2T rows into scratch in work; `combine` adds each pair into y. */
static int job_init(Job *j, const float *x, const uint8_t *blocks, int64_t T, int64_t K, int64_t N, int bits,
                    int mins, int passes, float *y, uint8_t *work) {
    if (T < 1 || K < QB || K % QB || N < 1 || (bits != 4 && bits != 8) || (passes != 1 && passes != 2)) return -1;
    j->blocks = blocks, j->T = T * passes, j->N = N, j->nb = K / QB, j->bits = bits, j->mins = mins;
    j->y = passes == 1 ? y : (float *)(work + edge_qmatmul_work_size(2 * T, K)) + T * K;
    j->lv = 16 * 4 * bits, j->rec = rec_bytes(bits, mins);
    j->rows = quantize_rows(x, T, K, passes, work);
    return 0;
}

/* passes = 2: y[t] = (row 2t's result) + (row 2t + 1's), one float add per output. */
static void combine(const Job *j, float *y) {
    if (j->y == y) return;
    for (int64_t t = 0; t < j->T / 2; t++)
        for (int64_t n = 0; n < j->N; n++) y[t * j->N + n] = j->y[2 * t * j->N + n] + j->y[(2 * t + 1) * j->N + n];
}

static void job_item(void *arg, size_t tile) {
    const Job *j = (const Job *)arg;
    PATHS[path()].fn(j, (int64_t)tile);
}

static int64_t n_tiles(int64_t N) { return (N + TILE - 1) / TILE; }

/* y (T, N) = x (T, K) @ W, W as records (see the top); on the calling thread. work:
 * edge_qmatmul_work_size(T, K) bytes. Returns 0, or -1 on bad sizes. */
int edge_qmatmul_passes(const float *x, const uint8_t *blocks, int64_t T, int64_t K, int64_t N, int bits, int mins,
                        int passes, float *y, uint8_t *work) {
    Job j;
    if (job_init(&j, x, blocks, T, K, N, bits, mins, passes, y, work) != 0) return -1;
    for (int64_t t = 0; t < n_tiles(N); t++) job_item(&j, (size_t)t);
    combine(&j, y);
    return 0;
}

/* The same in one pass (work: edge_qmatmul_work_size(T, K)). */
int edge_qmatmul(const float *x, const uint8_t *blocks, int64_t T, int64_t K, int64_t N, int bits, int mins,
                 float *y, uint8_t *work) {
    return edge_qmatmul_passes(x, blocks, T, K, N, bits, mins, 1, y, work);
}

/* ---- the onnxruntime operator ai.edge_llm.MatMulQ ----------------------------------------------
 * inputs   x (T, K) float, blocks (tiles, K / 32, record bytes) uint8
 * output   y (T, N) float                   attributes  N, K, bits (4 or 8), mins (0 or 1), passes (1 or 2,
 *                                           optional, default 1: the activations' rounding, see the top)  (int64) */
static const OrtApi *ort;

typedef struct {
    int64_t N, K, bits, mins, passes;
} MatMulQ;

static OrtStatusPtr fail(const char *msg) { return ort->CreateStatus(ORT_INVALID_ARGUMENT, msg); }

static OrtStatusPtr input(OrtKernelContext *ctx, size_t index, const void **data, int64_t *dims, size_t rank) {
    return op_input(ort, ctx, index, data, dims, rank, "MatMulQ: x must be 2-D and blocks 3-D");
}

static OrtStatusPtr op_create(const OrtCustomOp *op, const OrtApi *api, const OrtKernelInfo *info, void **out) {
    (void)op;
    MatMulQ *a = calloc(1, sizeof *a);
    if (a == NULL) return api->CreateStatus(ORT_FAIL, "MatMulQ: out of memory");
    OrtStatusPtr st = api->KernelInfoGetAttribute_int64(info, "N", &a->N);
    if (st == NULL) st = api->KernelInfoGetAttribute_int64(info, "K", &a->K);
    if (st == NULL) st = api->KernelInfoGetAttribute_int64(info, "bits", &a->bits);
    if (st == NULL) st = api->KernelInfoGetAttribute_int64(info, "mins", &a->mins);
    if (st == NULL) { /* optional: 1 when absent */
        OrtStatusPtr none = api->KernelInfoGetAttribute_int64(info, "passes", &a->passes);
        if (none != NULL) api->ReleaseStatus(none), a->passes = 1;
    }
    if (st == NULL && (a->N < 1 || a->K < QB || a->K % QB || (a->bits != 4 && a->bits != 8) ||
                       (a->mins != 0 && a->mins != 1) || (a->passes != 1 && a->passes != 2)))
        st = api->CreateStatus(ORT_INVALID_ARGUMENT,
                               "MatMulQ: N >= 1, K a positive multiple of 32, bits 4 or 8, mins 0 or 1, passes 1 or 2");
    if (st != NULL) {
        free(a);
        return st;
    }
    *out = a;
    return NULL;
}

static OrtStatusPtr op_compute(void *kernel, OrtKernelContext *ctx) {
    const MatMulQ *a = (const MatMulQ *)kernel;
    const float *x;
    const uint8_t *blocks;
    int64_t xd[2], bd[3];
    CHECK(input(ctx, 0, (const void **)&x, xd, 2));
    CHECK(input(ctx, 1, (const void **)&blocks, bd, 3));
    const int64_t T = xd[0];
    if (T < 1 || xd[1] != a->K) return fail("MatMulQ: x must be (T >= 1, K)");
    if (bd[0] != n_tiles(a->N) || bd[1] != a->K / QB || bd[2] != rec_bytes((int)a->bits, (int)a->mins))
        return fail("MatMulQ: blocks must be (ceil(N / 16), K / 32, 64 bits + 80, + 64 with mins)");
    OrtValue *out_value;
    float *y;
    const int64_t od[2] = {T, a->N};
    CHECK(ort->KernelContext_GetOutput(ctx, 0, od, 2, &out_value));
    CHECK(ort->GetTensorMutableData(out_value, (void **)&y));
    uint8_t *work = malloc((size_t)edge_qmatmul_passes_work_size(T, a->K, a->N, (int)a->passes));
    if (work == NULL) return ort->CreateStatus(ORT_FAIL, "MatMulQ: out of memory");
    Job j;
    job_init(&j, x, blocks, T, a->K, a->N, (int)a->bits, (int)a->mins, (int)a->passes, y, work);
    OrtStatusPtr st = ort->KernelContext_ParallelFor(ctx, job_item, (size_t)n_tiles(a->N), 0, &j);
    if (st == NULL) combine(&j, y);
    free(work);
    return st;
}

static const char *op_name(const OrtCustomOp *op) { (void)op; return "MatMulQ"; }
static ONNXTensorElementDataType op_in_type(const OrtCustomOp *op, size_t i) {
    (void)op;
    return i == 1 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8 : ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
}
static ONNXTensorElementDataType op_out_type(const OrtCustomOp *op, size_t i) {
    (void)op, (void)i;
    return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
}
static size_t op_inputs(const OrtCustomOp *op) { (void)op; return 2; }
static size_t op_outputs(const OrtCustomOp *op) { (void)op; return 1; }

static OrtCustomOp matmul_q_op = ORT_CUSTOM_OP(op_name, op_in_type, op_inputs, op_out_type, op_outputs, op_create, op_compute);

/* The operator, for RegisterCustomOps (_attn.c, the library's one entry point). */
OrtCustomOp *edge_qmatmul_op(const OrtApi *api) {
    ort = api;
    (void)path();
    return &matmul_q_op;
}
