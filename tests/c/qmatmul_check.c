/* Runs edge_qmatmul (edge_llm/backends/kernels/_qmatmul.c) on the path this CPU picks, then on every code
 * path it has, on inputs from a file, and writes each run's output: tests/test_qmatmul_op.py runs
 * it under qemu-user, built for aarch64 (the board's build, on a host without a board) and for
 * x86-64 on CPUs this host is not (AVX2 only, no AVX), and compares the bytes with the library's.
 *
 *   qmatmul_check IN OUT     IN: int64 T, K, N, bits, mins, passes; float x (T, K); uint8 records (the rest)
 *                            OUT: per run, float y (T, N); stdout: the picked path, then the paths run */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

int edge_qmatmul_passes(const float *x, const uint8_t *blocks, int64_t T, int64_t K, int64_t N, int bits, int mins,
                        int passes, float *y, uint8_t *work);
int64_t edge_qmatmul_passes_work_size(int64_t T, int64_t K, int64_t N, int passes);
int edge_qmatmul_force(const char *name);
const char *edge_qmatmul_isa(void);

int main(int argc, char **argv) {
    static const char *paths[] = {"avx512vnni", "avxvnni", "avx2", "sdot", "c"};
    if (argc != 3) return 2;
    FILE *in = fopen(argv[1], "rb"), *out = fopen(argv[2], "wb");
    if (in == NULL || out == NULL) return 2;
    int64_t h[6];
    if (fread(h, sizeof h[0], 6, in) != 6) return 2;
    const int64_t T = h[0], K = h[1], N = h[2], rec = 64 * h[3] + 80 + (h[4] ? 64 : 0);
    const size_t nrec = (size_t)((N + 15) / 16 * (K / 32) * rec);
    float *x = malloc(sizeof(float) * (size_t)(T * K)), *y = malloc(sizeof(float) * (size_t)(T * N));
    uint8_t *blocks = malloc(nrec), *work = malloc((size_t)edge_qmatmul_passes_work_size(T, K, N, (int)h[5]));
    if (fread(x, sizeof(float), (size_t)(T * K), in) != (size_t)(T * K) || fread(blocks, 1, nrec, in) != nrec) return 2;
    printf("%s\n", edge_qmatmul_isa()); /* the path this CPU picks by itself: its output first */
    if (edge_qmatmul_passes(x, blocks, T, K, N, (int)h[3], (int)h[4], (int)h[5], y, work) != 0) return 3;
    fwrite(y, sizeof(float), (size_t)(T * N), out);
    for (size_t p = 0; p < sizeof paths / sizeof paths[0]; p++) {
        if (edge_qmatmul_force(paths[p]) != 0) continue;
        if (edge_qmatmul_passes(x, blocks, T, K, N, (int)h[3], (int)h[4], (int)h[5], y, work) != 0) return 3;
        fwrite(y, sizeof(float), (size_t)(T * N), out);
        printf("%s\n", paths[p]);
    }
    fclose(out);
    return 0;
}
