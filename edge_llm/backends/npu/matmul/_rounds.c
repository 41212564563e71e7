/* One round of the NPU matmul engine (docs/npu.md, "The matmul API binding": "A round in C"):
 * the parts of one int8 x int8 -> int32 product, one matmul context per NPU core, run at the
 * same time, with the rows copied into each part's A buffer before and its C rows copied (or, for
 * a part that cuts K, added) into the caller's output after. backends/npu/matmul/engine.py calls it through
 * ctypes (the GIL is released) with rknn_matmul_run's address from the loaded librknnrt.
 *
 * Why by hand: rknn_matmul_run blocks its thread until its core is done, so the three cores of a
 * round need three threads; Python's thread pool (a queue, a future, two condition variables per
 * call) costs several times a C round's time to hand the calls over (bench/npu/matmul.py measures
 * both), paid 113 times per Qwen3-VL-2B decode token. Here the helper
 * threads live as long as the engine, wait for a round by spinning for a bounded time (the CPU's
 * work between two rounds of a decode token is tens to hundreds of microseconds) and then on a
 * condition variable, and the caller runs the first part itself. Nothing here computes a value:
 * the bits are the library's products, copied.
 */
#define _GNU_SOURCE /* pthread_setname_np */
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#if defined(__x86_64__)
#include <immintrin.h>
#define RELAX() _mm_pause()
#elif defined(__aarch64__)
#define RELAX() __asm__ __volatile__("yield")
#else
#define RELAX() ((void)0)
#endif

typedef int (*edge_npu_run_fn)(uint64_t ctx);

/* One core's part of a weight: rows [k0, k1) of K, columns [n0, n1) of N (engine._Part). */
typedef struct {
    uint64_t ctx;
    int64_t k0, k1, n0, n1;
    int64_t adds;     /* its product is added to columns an earlier part wrote (a cut of K) */
    int8_t *a;        /* the context's A buffer, (shape, k1 - k0) int8 rows */
    const int32_t *c; /* its C buffer, (shape, n1 - n0) int32 rows */
} edge_npu_part;

enum { IDLE, POSTED, DONE, QUIT };
#define MAX_HELPERS 7

typedef struct edge_npu_pool edge_npu_pool;

typedef struct {
    pthread_t thread;
    _Atomic int state;
    _Atomic int helper_sleeping, caller_sleeping; /* who sleeps on cv */
    pthread_mutex_t mu;
    pthread_cond_t cv;
    uint64_t ctx;
    int rc;
    const edge_npu_pool *pool;
} helper;

struct edge_npu_pool {
    edge_npu_run_fn run;
    int64_t spin_ns;
    int n;
    helper h[MAX_HELPERS];
};

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

/* Wait until w's state is one of `want` (a mask of 1 << state): spin for spin_ns (yielding now and
 * then: on a machine with fewer free cores than threads the one being waited for needs this core),
 * then sleep on w's condition variable with *sleeping set. `state` and both flags are sequentially
 * consistent: a setter that reads *sleeping == 0 is seen by the sleeper's check of state under the
 * mutex, and one that reads 1 broadcasts under the mutex. */
static int wait_state(helper *w, unsigned want, _Atomic int *sleeping) {
    int64_t end = now_ns() + w->pool->spin_ns;
    for (unsigned i = 0;; i++) {
        int s = atomic_load(&w->state);
        if (want >> s & 1) return s;
        if ((i & 255) == 255) {
            if (now_ns() > end) break;
            sched_yield();
        }
        RELAX();
    }
    pthread_mutex_lock(&w->mu);
    atomic_store(sleeping, 1);
    int s;
    while (!(want >> (s = atomic_load(&w->state)) & 1)) pthread_cond_wait(&w->cv, &w->mu);
    atomic_store(sleeping, 0);
    pthread_mutex_unlock(&w->mu);
    return s;
}

static void set_state(helper *w, int state, _Atomic int *sleeping) {
    atomic_store(&w->state, state);
    if (atomic_load(sleeping)) {
        pthread_mutex_lock(&w->mu);
        pthread_cond_broadcast(&w->cv);
        pthread_mutex_unlock(&w->mu);
    }
}

static void *helper_main(void *arg) {
    helper *w = arg;
    while (wait_state(w, 1u << POSTED | 1u << QUIT, &w->helper_sleeping) == POSTED) {
        w->rc = w->pool->run(w->ctx);
        set_state(w, DONE, &w->caller_sleeping);
    }
    return NULL;
}

void edge_npu_pool_free(edge_npu_pool *p);

/* A pool of `helpers` threads (0 .. 7) calling `run`; NULL if a thread could not be started. */
edge_npu_pool *edge_npu_pool_new(edge_npu_run_fn run, int helpers, int64_t spin_ns) {
    if (helpers < 0 || helpers > MAX_HELPERS || !run) return NULL;
    edge_npu_pool *p = calloc(1, sizeof *p);
    if (!p) return NULL;
    p->run = run;
    p->spin_ns = spin_ns;
    for (int i = 0; i < helpers; i++) {
        helper *w = &p->h[i];
        atomic_init(&w->state, IDLE);
        atomic_init(&w->helper_sleeping, 0);
        atomic_init(&w->caller_sleeping, 0);
        w->pool = p;
        pthread_mutex_init(&w->mu, NULL);
        pthread_cond_init(&w->cv, NULL);
        if (pthread_create(&w->thread, NULL, helper_main, w) != 0) {
            pthread_mutex_destroy(&w->mu);
            pthread_cond_destroy(&w->cv);
            edge_npu_pool_free(p);
            return NULL;
        }
        pthread_setname_np(w->thread, "npu-round"); /* a name to find them by (ps, the tests) */
        p->n = i + 1;
    }
    return p;
}

void edge_npu_pool_free(edge_npu_pool *p) {
    if (!p) return;
    for (int i = 0; i < p->n; i++) set_state(&p->h[i], QUIT, &p->h[i].helper_sleeping);
    for (int i = 0; i < p->n; i++) {
        pthread_join(p->h[i].thread, NULL);
        pthread_mutex_destroy(&p->h[i].mu);
        pthread_cond_destroy(&p->h[i].cv);
    }
    free(p);
}

/* One chunk of m rows (m <= shape, the contexts' dynamic shape, already bound): a (m, K) int8 rows
 * -> out (m, N) int32. Part 0 runs on the caller's thread, part i on helper i - 1 (nparts - 1 <=
 * the pool's helpers). rcs[i]: part i's return code.
 * Returns the number of parts that failed (out is then not the product), -1 for bad arguments. Parts are applied to
 * out in order, so a part that adds comes after the part that wrote its columns; its int32 sum is
 * exact (|sum| <= 127 * 127 * K < 2^31). */
int edge_npu_chunk(edge_npu_pool *p, const edge_npu_part *parts, int nparts, const int8_t *a, int64_t m,
                   int64_t shape, int64_t K, int32_t *out, int64_t N, int *rcs) {
    if (!p || nparts < 1 || nparts - 1 > p->n || m < 1 || m > shape) return -1;
    for (int i = 0; i < nparts; i++) {
        const edge_npu_part *q = &parts[i];
        int64_t k = q->k1 - q->k0;
        for (int64_t r = 0; r < m; r++) memcpy(q->a + r * k, a + r * K + q->k0, (size_t)k);
        memset(q->a + m * k, 0, (size_t)((shape - m) * k)); /* padding rows: zero, never mixed in */
    }
    for (int i = 1; i < nparts; i++) {
        p->h[i - 1].ctx = parts[i].ctx;
        set_state(&p->h[i - 1], POSTED, &p->h[i - 1].helper_sleeping);
    }
    rcs[0] = p->run(parts[0].ctx);
    for (int i = 1; i < nparts; i++) {
        helper *w = &p->h[i - 1];
        wait_state(w, 1u << DONE, &w->caller_sleeping);
        rcs[i] = w->rc;
        atomic_store(&w->state, IDLE);
    }
    int failed = 0;
    for (int i = 0; i < nparts; i++) failed += rcs[i] != 0;
    if (failed) return failed;
    for (int i = 0; i < nparts; i++) {
        const edge_npu_part *q = &parts[i];
        int64_t n = q->n1 - q->n0;
        for (int64_t r = 0; r < m; r++) {
            int32_t *dst = out + r * N + q->n0;
            const int32_t *src = q->c + r * n;
            if (q->adds)
                for (int64_t j = 0; j < n; j++) dst[j] += src[j];
            else
                memcpy(dst, src, (size_t)n * sizeof *dst);
        }
    }
    return 0;
}
