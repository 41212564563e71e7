/* Runs the matmul path's per-row ops (edge_llm/backends/npu/matmul/_row_ops.c) on inputs from a file and writes
 * their outputs to another, for tests/test_mm8_ops.py: built for aarch64 and run under qemu-user, its
 * outputs must be bitwise the x86 library's on the same inputs.
 *
 * Input: 8 int64 (T, n, inter, m, mr, H, n_kv, D), float eps, then float32 / int32 arrays:
 *   x (T n), gu (T 2 inter, int32), rs (T), gu_scale (2 inter), block (m m), rot_block (mr mr),
 *   rot_scale (n), qkv (T (H + 2 n_kv) D), q_gain (D), k_gain (D), cos (T D/2), sin (T D/2),
 *   o (T n, int32), o_scale (n).
 * Output: norm_quant q, s; swiglu_quant q, s; rotate y; qk_rope q, k, v; dequant_add h, q, s. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

void edge_mm8_norm_quant(const float *x, int64_t T, int64_t n, float eps, int8_t *q, float *scale);
void edge_mm8_dequant_add(const int32_t *c, const float *row_scale, const float *col_scale, const float *x,
                          int64_t T, int64_t n, float eps, float *h, int8_t *q, float *scale);
void edge_mm8_swiglu_quant(const int32_t *c, const float *row_scale, const float *col_scale, int64_t T,
                           int64_t inter, const float *block, int64_t m, int8_t *q, float *scale, float *work);
void edge_mm8_rotate(const float *x, int64_t T, int64_t n, const float *block, int64_t m, const float *col_scale,
                     float *y, float *work);
void edge_mm8_qk_rope(const float *q, const float *k, const float *v, int64_t ld, int64_t T, int64_t H,
                      int64_t n_kv, int64_t D, const float *q_gain, const float *k_gain, float eps,
                      const float *cos_t, const float *sin_t, float scale, float *q_out, float *k_out,
                      float *v_out);

static FILE *in, *out;

static void *take(size_t bytes) {
    void *p = malloc(bytes ? bytes : 1);
    if (!p || fread(p, 1, bytes, in) != bytes) {
        fprintf(stderr, "short input\n");
        exit(2);
    }
    return p;
}

static void put(const void *p, size_t bytes) { fwrite(p, 1, bytes, out); }

int main(int argc, char **argv) {
    if (argc != 3 || !(in = fopen(argv[1], "rb")) || !(out = fopen(argv[2], "wb"))) return 2;
    int64_t *h = take(8 * sizeof(int64_t));
    int64_t T = h[0], n = h[1], I = h[2], m = h[3], mr = h[4], H = h[5], K = h[6], D = h[7];
    float eps = *(float *)take(4);
    float *x = take(T * n * 4);
    int32_t *gu = take(T * 2 * I * 4);
    float *rs = take(T * 4), *gs = take(2 * I * 4), *block = take(m * m * 4), *rb = take(mr * mr * 4),
          *rsc = take(n * 4), *qkv = take(T * (H + 2 * K) * D * 4), *qg = take(D * 4), *kg = take(D * 4),
          *cs = take(T * D / 2 * 4), *sn = take(T * D / 2 * 4);
    int32_t *o = take(T * n * 4);
    float *os = take(n * 4);
    int8_t *q = malloc(T * (n > I ? n : I));
    float *s = malloc(T * 4), *work = malloc(2 * (I > n ? I : n) * 4), *y = malloc(T * n * 4);
    float *qo = malloc(T * H * D * 4), *ko = malloc(T * K * D * 4), *vo = malloc(T * K * D * 4);
    edge_mm8_norm_quant(x, T, n, eps, q, s);
    put(q, T * n), put(s, T * 4);
    edge_mm8_swiglu_quant(gu, rs, gs, T, I, m > 1 ? block : NULL, m, q, s, work);
    put(q, T * I), put(s, T * 4);
    edge_mm8_rotate(x, T, n, rb, mr, rsc, y, work);
    put(y, T * n * 4);
    int64_t ld = (H + 2 * K) * D;
    edge_mm8_qk_rope(qkv, qkv + H * D, qkv + (H + K) * D, ld, T, H, K, D, qg, kg, eps, cs, sn, 0.125f, qo, ko, vo);
    put(qo, T * H * D * 4), put(ko, T * K * D * 4), put(vo, T * K * D * 4);
    edge_mm8_dequant_add(o, rs, os, x, T, n, eps, y, q, s);
    put(y, T * n * 4), put(q, T * n), put(s, T * 4);
    fclose(out);
    printf("aarch64 ok\n");
    return 0;
}
