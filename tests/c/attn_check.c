/* Checks edge_attn_row (edge_llm/backends/kernels/_attn.c) against a float64 reference of GQA softmax
 * attention, for head shapes that take the specialized and the generic bodies and row counts on
 * both sides of its 256-row chunks; one head has a peaked softmax. Prints the code path and the
 * worst error; exit 0 if it is below 5e-6 and edge_attn_rows (T query rows, causal among the new
 * rows) gives each row bitwise what edge_attn_row gives over the rows before it. Built and run by tests/test_attn_op.py, e.g. as an
 * aarch64 (NEON) program under qemu-user: the board's build, on a host without a board. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int edge_attn_row(const float *q, const float *k, const float *v, const float *k_new, const float *v_new,
                  int64_t S, int64_t ld, int H, int n_kv, int D, float *out, float *work);
int64_t edge_attn_work_size(int64_t S, int H, int D);
int edge_attn_rows(const float *q, const float *k, const float *v, const float *k_new, const float *v_new,
                   int64_t S, int64_t T, int64_t ld, int H, int n_kv, int D, float *out, float *work);
int64_t edge_attn_rows_work_size(int64_t S, int64_t T, int H, int D);
const char *edge_attn_isa(void);

static float uniform(void) { return (float)rand() / (float)RAND_MAX * 2.0f - 1.0f; }

int main(void) {
    static const int shapes[][3] = {{9, 3, 64}, {16, 8, 128}, {4, 1, 64}, {12, 3, 32}, {10, 2, 48}};
    static const int64_t counts[] = {0, 1, 255, 256, 257, 1000};
    double worst = 0.0;
    srand(7);
    for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++) {
        for (size_t ri = 0; ri < sizeof counts / sizeof counts[0]; ri++) {
            const int H = shapes[si][0], n_kv = shapes[si][1], D = shapes[si][2], rep = H / n_kv;
            const int64_t S = counts[ri], ld = (int64_t)n_kv * D;
            float *K = malloc(sizeof(float) * (size_t)((S + 1) * ld)), *V = malloc(sizeof(float) * (size_t)((S + 1) * ld));
            float *q = malloc(sizeof(float) * (size_t)(H * D)), *out = malloc(sizeof(float) * (size_t)(H * D));
            float *work = malloc(sizeof(float) * (size_t)edge_attn_work_size(S, H, D));
            double *p = malloc(sizeof(double) * (size_t)(S + 1));
            for (int64_t i = 0; i < (S + 1) * ld; i++) K[i] = uniform(), V[i] = uniform();
            for (int i = 0; i < H * D; i++) q[i] = 0.3f * uniform() * (i < D ? 20.0f : 1.0f);
            if (edge_attn_row(q, K, V, K + S * ld, V + S * ld, S, ld, H, n_kv, D, out, work) != 0) {
                printf("refused H=%d n_kv=%d D=%d S=%lld\n", H, n_kv, D, (long long)S);
                return 2;
            }
            for (int h = 0; h < H; h++) {
                const int g = h / rep;
                double mx = -INFINITY, sum = 0.0;
                for (int64_t s = 0; s <= S; s++) {
                    double a = 0.0;
                    for (int d = 0; d < D; d++) a += (double)q[h * D + d] * K[s * ld + g * D + d];
                    p[s] = a;
                    mx = a > mx ? a : mx;
                }
                for (int64_t s = 0; s <= S; s++) sum += (p[s] = exp(p[s] - mx));
                for (int d = 0; d < D; d++) {
                    double o = 0.0;
                    for (int64_t s = 0; s <= S; s++) o += p[s] * V[s * ld + g * D + d];
                    const double err = fabs(o / sum - out[h * D + d]);
                    worst = err > worst ? err : worst;
                }
            }
            free(K), free(V), free(q), free(out), free(work), free(p);
        }
    }
    /* T query rows against T one-row calls, new rows crossing a chunk edge */
    for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++) {
        const int H = shapes[si][0], n_kv = shapes[si][1], D = shapes[si][2];
        const int64_t S = 250, T = 9, ld = (int64_t)n_kv * D;
        float *K = malloc(sizeof(float) * (size_t)((S + T) * ld)), *V = malloc(sizeof(float) * (size_t)((S + T) * ld));
        float *q = malloc(sizeof(float) * (size_t)(T * H * D)), *out = malloc(sizeof(float) * (size_t)(T * H * D));
        float *one = malloc(sizeof(float) * (size_t)(H * D));
        float *work = malloc(sizeof(float) * (size_t)edge_attn_rows_work_size(S, T, H, D));
        float *work1 = malloc(sizeof(float) * (size_t)edge_attn_work_size(S + T, H, D));
        for (int64_t i = 0; i < (S + T) * ld; i++) K[i] = uniform(), V[i] = uniform();
        for (int64_t i = 0; i < T * H * D; i++) q[i] = 0.3f * uniform();
        if (edge_attn_rows(q, K, V, K + S * ld, V + S * ld, S, T, ld, H, n_kv, D, out, work) != 0) return 2;
        for (int64_t t = 0; t < T; t++) {
            edge_attn_row(q + t * H * D, K, V, K + (S + t) * ld, V + (S + t) * ld, S + t, ld, H, n_kv, D, one, work1);
            if (memcmp(one, out + t * H * D, sizeof(float) * (size_t)(H * D)) != 0) {
                printf("rows differ from one-row calls: H=%d D=%d t=%lld\n", H, D, (long long)t);
                return 1;
            }
        }
        free(K), free(V), free(q), free(out), free(one), free(work), free(work1);
    }
    printf("%s worst %.3g\n", edge_attn_isa(), worst);
    return worst < 5e-6 ? 0 : 1;
}
