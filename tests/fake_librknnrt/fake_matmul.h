/* The fake librknnrt's arithmetic (fake_matmul.c). */
#ifndef FAKE_MATMUL_H
#define FAKE_MATMUL_H

#include <stdint.h>

/* B (K, N) in the normal layout -> RK3588's int8 native layout (rknn_matmul_api.h) */
void fake_to_native(const int8_t *src, int8_t *dst, int K, int N);
/* C (M, N) = A (M, K) @ B, B native (native != 0) or normal; exact int32 */
void fake_multiply(const int8_t *A, const int8_t *B, int32_t *C, int M, int K, int N, int native);

#endif
