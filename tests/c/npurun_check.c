/* A stress check of the NPU engine's round (edge_llm/backends/npu/matmul/_rounds.c), built with ThreadSanitizer
 * by tests/test_npu_round.py. A stand-in run function plays rknn_matmul_run: it spends a few
 * microseconds, writes a pattern of (round, part) into the part's C rows and fails when asked.
 * Every round's output is checked (copies, and the sums of the parts that cut K), every failure
 * must be reported, and the helpers are driven through both of their waits: spinning (back-to-back
 * rounds) and sleeping on the condition variable (a pause longer than the spin between rounds).
 *
 *     npurun_check ROUNDS SPIN_NS PAUSE_NS     prints "ok <rounds> <failures seen>" or exits 1
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef struct {
    uint64_t ctx;
    int64_t k0, k1, n0, n1, adds;
    int8_t *a;
    const int32_t *c;
} edge_npu_part;
void *edge_npu_pool_new(int (*run)(uint64_t), int helpers, int64_t spin_ns);
void edge_npu_pool_free(void *p);
int edge_npu_chunk(void *p, const edge_npu_part *parts, int nparts, const int8_t *a, int64_t m, int64_t shape,
                   int64_t K, int32_t *out, int64_t N, int *rcs);

enum { K = 96, N = 64, SHAPE = 4, PARTS = 3 };
static int8_t abuf[PARTS][SHAPE * K];
static int32_t cbuf[PARTS][SHAPE * N];
static int round_no, fail_part = -1; /* written by the caller before a round, read by the runs */

static void pause_ns(long ns) {
    struct timespec t0, t;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    do clock_gettime(CLOCK_MONOTONIC, &t);
    while ((t.tv_sec - t0.tv_sec) * 1000000000L + (t.tv_nsec - t0.tv_nsec) < ns);
}

/* part i (ctx i): row r, column j of its C = its A's row r first byte + round + i + j */
static int run(uint64_t ctx) {
    int i = (int)ctx;
    pause_ns(1000L * (i + 1));
    int width = i == 2 ? N : N / 2;
    for (int r = 0; r < SHAPE; r++)
        for (int j = 0; j < width; j++) cbuf[i][r * width + j] = abuf[i][r * (K / 2)] + round_no + i + j;
    return i == fail_part ? -5 : 0;
}

int main(int argc, char **argv) {
    if (argc != 4) return 2;
    int rounds = atoi(argv[1]);
    long spin = atol(argv[2]), pause = atol(argv[3]);
    /* the mixed cut: halves of N over rows [0, K/2), all of N over [K/2, K) adding */
    edge_npu_part parts[PARTS] = {
        {0, 0, K / 2, 0, N / 2, 0, abuf[0], cbuf[0]},
        {1, 0, K / 2, N / 2, N, 0, abuf[1], cbuf[1]},
        {2, K / 2, K, 0, N, 1, abuf[2], cbuf[2]},
    };
    void *pool = edge_npu_pool_new(run, PARTS - 1, spin);
    if (!pool) return 1;
    int8_t a[3 * K];
    int32_t out[3 * N];
    int rcs[PARTS], failures = 0;
    for (int t = 0; t < rounds; t++) {
        int m = 1 + t % 3;
        round_no = t;
        fail_part = t % 97 == 5 ? t % PARTS : -1;
        for (int r = 0; r < m; r++)
            for (int k = 0; k < K; k++) a[r * K + k] = (int8_t)(r * 7 + k + t);
        int got = edge_npu_chunk(pool, parts, PARTS, a, m, SHAPE, K, out, N, rcs);
        if (fail_part >= 0) {
            if (got != 1 || rcs[fail_part] != -5) { printf("round %d: failure not reported (%d)\n", t, got); return 1; }
            failures++;
        } else {
            if (got != 0) { printf("round %d: returned %d\n", t, got); return 1; }
            for (int r = 0; r < m; r++)
                for (int j = 0; j < N; j++) {
                    int lo = j < N / 2 ? 0 : 1;
                    int32_t want = (a[r * K] + t + lo + (j - lo * N / 2)) + (a[r * K + K / 2] + t + 2 + j);
                    if (out[r * N + j] != want) { printf("round %d: out[%d][%d] %d != %d\n", t, r, j, out[r * N + j], want); return 1; }
                }
            for (int r = m; r < SHAPE; r++) /* padding rows of every A are zero */
                if (abuf[0][r * (K / 2)] || abuf[2][r * (K / 2) + 1]) { printf("round %d: padding row %d\n", t, r); return 1; }
        }
        if (pause) pause_ns(pause);
    }
    edge_npu_pool_free(pool);
    printf("ok %d %d\n", rounds, failures);
    return 0;
}
