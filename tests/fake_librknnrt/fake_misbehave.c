/* The fake librknnrt's version query (rknn_query RKNN_QUERY_SDK_VERSION), cache sync (rknn_mem_sync)
 * and its misbehaving builds, one per start-up self-test probe (docs/npu.md, "The start-up
 * self-test"). build.py's `misbehave=` compiles at most one of these defines in:
 *
 *   FAKE_STALE_CACHE   A and C are not coherent without rknn_mem_sync
 *   FAKE_RACING        wrong results when contexts run on several threads at once
 *   FAKE_WRONG_PRODUCT one element of every product at M = 16 is off by one
 *   FAKE_OLD_DRIVER    the driver reports version 0.9.6
 *   FAKE_SWITCH_FAILS  the driver cannot switch IOMMU domains (fake_iommu.c)
 *
 * Every misbehaviour is the fake's own (marked "fake:"): no board is known to do any of them; the
 * probes exist because nothing Rockchip publishes rules them out.
 */
#include "fake_misbehave.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define RKNN_SUCC 0
#define RKNN_ERR_PARAM_INVALID -5
#define RKNN_ERR_CTX_INVALID -7
#define RKNN_QUERY_SDK_VERSION 5       /* rknn_api.h, rknn_query_cmd */
#define RKNN_MEMORY_SYNC_TO_DEVICE 1   /* rknn_api.h, rknn_mem_sync_mode */
#define RKNN_MEMORY_SYNC_FROM_DEVICE 2 /* BIDIRECTIONAL = both bits */

int fake_ctx_valid(uint64_t ctx);                                                      /* fake_rknnrt.c */
int fake_mem_of(uint64_t ctx, void *m, void **virt, void **dev, uint32_t *size); /* fake_rknnrt.c */

typedef struct {
    char api_version[256];
    char drv_version[256];
} rknn_sdk_version; /* rknn_api.h */

#ifdef FAKE_OLD_DRIVER
#define DRIVER_VERSION "0.9.6" /* fake: below the 0.9.7 rknn-llm's maintainers ask for */
#else
#define DRIVER_VERSION "0.9.8" /* rknpu_drv.h of the driver fake_iommu.c models: 0.9.8 */
#endif

/* rknn_api.h: rknn_query(ctx, RKNN_QUERY_SDK_VERSION, &rknn_sdk_version, sizeof) fills both
 * versions; fake: answered for a matmul context too (whether librknnrt does is a board question:
 * the self-test falls back to debugfs), every other query is RKNN_ERR_PARAM_INVALID */
int rknn_query(uint64_t ctx, int cmd, void *info, uint32_t size) {
    if (!fake_ctx_valid(ctx)) return RKNN_ERR_CTX_INVALID;
    if (cmd != RKNN_QUERY_SDK_VERSION || !info || size != sizeof(rknn_sdk_version)) return RKNN_ERR_PARAM_INVALID;
    rknn_sdk_version *v = info;
    memset(v, 0, sizeof *v);
    strcpy(v->api_version, "2.3.2 (fake librknnrt)");
    strcpy(v->drv_version, DRIVER_VERSION);
    return RKNN_SUCC;
}

/* rknn_api.h, rknn_mem_sync(ctx, mem, mode): TO_DEVICE writes the CPU's cache back for the NPU,
 * FROM_DEVICE makes the CPU read what the NPU wrote; a buffer of another context is refused */
int rknn_mem_sync(uint64_t ctx, void *mem, int mode) {
    void *virt, *dev;
    uint32_t size;
    if (!fake_ctx_valid(ctx)) return RKNN_ERR_CTX_INVALID;
    if (mode < 1 || mode > 3 || fake_mem_of(ctx, mem, &virt, &dev, &size)) return RKNN_ERR_PARAM_INVALID;
    if (dev && (mode & RKNN_MEMORY_SYNC_TO_DEVICE)) memcpy(dev, virt, size);
    if (dev && (mode & RKNN_MEMORY_SYNC_FROM_DEVICE)) memcpy(virt, dev, size);
    return RKNN_SUCC;
}

/* fake: (FAKE_STALE_CACHE) the NPU reads and writes its own copy of every buffer; the copies meet
 * only at rknn_mem_sync, and A's when it is bound (so a run after new A without a rebind reads the
 * old A, and C is never seen without FROM_DEVICE) */
void *fake_device_copy(uint32_t size) {
#ifdef FAKE_STALE_CACHE
    return calloc(1, size);
#else
    (void)size;
    return NULL;
#endif
}

void fake_bind_flush(void *dev, const void *virt, uint32_t size) {
    if (dev) memcpy(dev, virt, size);
}

/* fake: (FAKE_RACING) runs that overlap in time clobber each other's results. To make the overlap
 * of a round's parts certain on a busy machine, a run from another thread than the run before it
 * (a round's helper, or a hand-over) waits up to RACE_WAIT_MS for a second run to start; a
 * hand-over sees none and stays exact, so one thread, or threads taking turns, are always right */
#ifdef FAKE_RACING
#define RACE_WAIT_MS 1000
static pthread_mutex_t race_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t race_cond = PTHREAD_COND_INITIALIZER;
static pthread_t last_thread;
static int have_last, active;
static unsigned long starts;
#endif

int fake_race_enter(void) {
#ifdef FAKE_RACING
    pthread_mutex_lock(&race_lock);
    pthread_t me = pthread_self();
    int other = have_last && !pthread_equal(me, last_thread);
    last_thread = me;
    have_last = 1;
    active++;
    unsigned long mine = ++starts;
    pthread_cond_broadcast(&race_cond);
    int raced = active > 1;
    if (other && !raced) {
        struct timespec until;
        clock_gettime(CLOCK_REALTIME, &until);
        until.tv_nsec += RACE_WAIT_MS * 1000000L;
        until.tv_sec += until.tv_nsec / 1000000000L;
        until.tv_nsec %= 1000000000L;
        while (starts == mine && pthread_cond_timedwait(&race_cond, &race_lock, &until) == 0) {
        }
        raced = starts != mine;
    }
    pthread_mutex_unlock(&race_lock);
    return raced;
#else
    return 0;
#endif
}

void fake_misbehave_product(int32_t *C, int M, int raced) {
    (void)M;
#ifdef FAKE_RACING
    pthread_mutex_lock(&race_lock);
    active--;
    pthread_mutex_unlock(&race_lock);
#endif
    if (raced) C[0] ^= 0x5a5a; /* fake: FAKE_RACING's damage */
#ifdef FAKE_WRONG_PRODUCT
    if (M == 16) C[0] += 1; /* fake: the product at M = 16 is wrong */
#endif
}
