/* The fake librknnrt's arithmetic: RK3588's int8 native layout of B and C = A @ B (int32). */
#include "fake_matmul.h"

#include <string.h>

#define K_SEGMENT 8192 /* rknn_matmul_api.h: on RK3588, B is split into ceil(K / 8192) segments of K */

/* offset of B[k][n] in the int8 native layout (RK3588): segments of 8192 rows of K, each (N/32, Ks/32, 32, 32) */
static size_t native_offset(int k, int n, int K, int N) {
    int seg = k / K_SEGMENT, ks = K - seg * K_SEGMENT;
    if (ks > K_SEGMENT) ks = K_SEGMENT;
    int kk = k - seg * K_SEGMENT;
    size_t base = (size_t)seg * K_SEGMENT * (size_t)N;
    return base + (((size_t)(n / 32) * (size_t)(ks / 32) + (size_t)(kk / 32)) * 1024) + (size_t)(n % 32) * 32 + kk % 32;
}

void fake_to_native(const int8_t *src, int8_t *dst, int K, int N) {
    for (int k = 0; k < K; k++)
        for (int n = 0; n < N; n++) dst[native_offset(k, n, K, N)] = src[(size_t)k * N + n];
}

void fake_multiply(const int8_t *A, const int8_t *B, int32_t *C, int M, int K, int N, int native) {
    /* one 32-column block of C at a time, its 32 sums of a row in acc: the block's B (K x 32) is
       read once per row from cache; int32 accumulation is exact (|sum| <= 128 * 128 * 10240) */
    for (int nb = 0; nb < N; nb += 32)
        for (int m = 0; m < M; m++) {
            int32_t acc[32] = {0};
            const int8_t *arow = A + (size_t)m * K;
            for (int k0 = 0; k0 < K; k0 += 32) {
                const int8_t *a = arow + k0;
                if (native) {
                    const int8_t *blk = B + native_offset(k0, nb, K, N);
                    for (int j = 0; j < 32; j++) {
                        int32_t s = 0;
                        for (int t = 0; t < 32; t++) s += (int32_t)a[t] * (int32_t)blk[j * 32 + t];
                        acc[j] += s;
                    }
                } else {
                    for (int t = 0; t < 32; t++)
                        for (int j = 0; j < 32; j++) acc[j] += (int32_t)a[t] * (int32_t)B[(size_t)(k0 + t) * N + nb + j];
                }
            }
            memcpy(C + (size_t)m * N + nb, acc, sizeof acc);
        }
}
