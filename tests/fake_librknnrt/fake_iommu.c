/* The RKNPU kernel driver's IOMMU domains, as the fake librknnrt.so models them (sources: the
 * driver's drivers/rknpu/rknpu_iommu.c, rknpu_gem.c, rknpu_job.c and include/rknpu_drv.h, driver
 * 0.9.8; rknn_matmul_api.h's rknn_matmul_info; docs/npu.md, "The fake library", lists them line by
 * line).
 *
 *   - One domain is attached to the NPU at a time (rknpu_iommu_switch_domain: detach the current
 *     domain, attach the new one). rknpu_iommu_domain_get_and_switch takes a reference on the
 *     current domain if it is the one asked for; otherwise it switches only while the current
 *     domain's reference count is 0, and else sleeps and retries for up to
 *     RKNPU_SWITCH_DOMAIN_WAIT_TIME_MS (6000 ms), then fails with -EINVAL.
 *   - A job holds its reference from its commit to its completion (rknpu_job.c: get_and_switch in
 *     the commit, rknpu_iommu_domain_put when the job is done), so a matmul run in one domain
 *     keeps a run in another waiting; an allocation takes and drops one around the mapping
 *     (rknpu_gem.c, rknpu_gem_object_create), and so does a free (rknpu_gem_object_destroy,
 *     which gives up after 3 timed-out tries and leaves the pages mapped).
 *   - Allocations are page-rounded (rknpu_gem_object_create: round_up(size, PAGE_SIZE)) and each
 *     domain maps 4 GiB (rknn_matmul_info's comment "each domain has 4GB of space"; the driver's
 *     dma_limit 1ULL << 32 for a new domain).
 *
 * What is the fake's own: the wait is a condition variable, not a 10-100 us sleep loop (the same
 * rule, without the polling); the timeout can be lowered for tests (fake_set_switch_timeout_ms),
 * and runs can be held at the gate to keep a domain busy (fake_hold_runs). Kernels built without
 * CONFIG_NO_GKI compile the switch as a stub (every domain is domain 0): not modelled, the fake
 * is the stricter kernel.
 */
#include "fake_iommu.h"

#include <errno.h>
#include <pthread.h>
#include <time.h>

#define PAGE 4096ULL
#define SWITCH_WAIT_MS 6000 /* rknpu_iommu.c: RKNPU_SWITCH_DOMAIN_WAIT_TIME_MS */

static pthread_mutex_t dom_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t dom_cond;  /* a reference dropped or the hold lifted; CLOCK_MONOTONIC */
static pthread_cond_t hook_cond; /* a waiter or a held run more (fake_wait_for); CLOCK_MONOTONIC */
static pthread_once_t dom_once = PTHREAD_ONCE_INIT;
static int active;              /* rknpu_dev->iommu_domain_id: 0 at probe (rknpu_iommu_init_domain) */
static int refcount;            /* rknpu_dev->iommu_domain_refcount */
static int waiters;             /* callers waiting for a switch (test hook) */
static uint64_t switches;       /* switches made (test hook) */
static int timeout_ms = SWITCH_WAIT_MS;
static int holding, held;       /* test hook: runs wait at the gate while holding */
static uint64_t bytes[FAKE_DOMAINS];
static uint64_t limit = 1ULL << 32;

static void init_cond(void) {
    pthread_condattr_t a;
    pthread_condattr_init(&a);
    pthread_condattr_setclock(&a, CLOCK_MONOTONIC);
    pthread_cond_init(&dom_cond, &a);
    pthread_cond_init(&hook_cond, &a);
    pthread_condattr_destroy(&a);
}

static struct timespec deadline(int ms) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    t.tv_sec += ms / 1000;
    t.tv_nsec += (long)(ms % 1000) * 1000000L;
    if (t.tv_nsec >= 1000000000L) {
        t.tv_sec++;
        t.tv_nsec -= 1000000000L;
    }
    return t;
}

int fake_domain_get(int domain) {
    pthread_once(&dom_once, init_cond);
    pthread_mutex_lock(&dom_lock);
    struct timespec until = deadline(timeout_ms);
    int ret = 0;
    for (;;) {
        if (domain == active) break; /* the attached domain: take a reference */
#ifdef FAKE_SWITCH_FAILS
        ret = -1; /* fake: (build.py misbehave="domain-switch") every switch fails at once */
        break;
#endif
        if (refcount == 0) {         /* nothing outstanding: detach, attach the asked one */
            active = domain;
            switches++;
            break;
        }
        waiters++;
        pthread_cond_broadcast(&hook_cond);
        int w = pthread_cond_timedwait(&dom_cond, &dom_lock, &until);
        waiters--;
        if (w == ETIMEDOUT && domain != active && refcount != 0) { /* "switch iommu domain time out" */
            ret = -1;
            break;
        }
    }
    if (ret == 0) refcount++;
    pthread_mutex_unlock(&dom_lock);
    return ret;
}

void fake_domain_put(void) {
    pthread_once(&dom_once, init_cond);
    pthread_mutex_lock(&dom_lock);
    refcount--;
    pthread_cond_broadcast(&dom_cond);
    pthread_mutex_unlock(&dom_lock);
}

static uint64_t rounded(uint32_t size) { return ((uint64_t)size + PAGE - 1) / PAGE * PAGE; }

int fake_domain_reserve(int domain, uint32_t size) {
    pthread_mutex_lock(&dom_lock);
    int ok = bytes[domain] + rounded(size) <= limit;
    if (ok) bytes[domain] += rounded(size);
    pthread_mutex_unlock(&dom_lock);
    return ok ? 0 : -1;
}

void fake_domain_release(int domain, uint32_t size) {
    pthread_mutex_lock(&dom_lock);
    bytes[domain] -= rounded(size);
    pthread_mutex_unlock(&dom_lock);
}

void fake_run_gate(void) {
    pthread_once(&dom_once, init_cond);
    pthread_mutex_lock(&dom_lock);
    if (holding) {
        held++;
        pthread_cond_broadcast(&hook_cond);
        while (holding) pthread_cond_wait(&dom_cond, &dom_lock);
        held--;
    }
    pthread_mutex_unlock(&dom_lock);
}

/* ---- test hooks (not part of librknnrt) ---- */
uint64_t fake_domain_bytes(int domain) {
    pthread_mutex_lock(&dom_lock);
    uint64_t b = domain >= 0 && domain < FAKE_DOMAINS ? bytes[domain] : 0;
    pthread_mutex_unlock(&dom_lock);
    return b;
}

void fake_set_domain_limit(uint64_t b) {
    pthread_mutex_lock(&dom_lock);
    limit = b;
    pthread_mutex_unlock(&dom_lock);
}

void fake_set_switch_timeout_ms(int ms) {
    pthread_mutex_lock(&dom_lock);
    timeout_ms = ms;
    pthread_mutex_unlock(&dom_lock);
}

/* the attached domain, and how many switches the fake has made */
int fake_active_domain(uint64_t *n_switches) {
    pthread_mutex_lock(&dom_lock);
    int d = active;
    if (n_switches) *n_switches = switches;
    pthread_mutex_unlock(&dom_lock);
    return d;
}

/* on != 0: runs stop at the gate (holding their domain reference) until called with 0 */
void fake_hold_runs(int on) {
    pthread_once(&dom_once, init_cond);
    pthread_mutex_lock(&dom_lock);
    holding = on;
    pthread_cond_broadcast(&dom_cond);
    pthread_mutex_unlock(&dom_lock);
}

/* wait (up to `ms`) until `n_held` runs are held at the gate and `n_waiting` callers wait for a
 * switch; returns 1 when reached (the tests' way to know a thread got there, without sleeping) */
int fake_wait_for(int n_held, int n_waiting, int ms) {
    pthread_once(&dom_once, init_cond);
    pthread_mutex_lock(&dom_lock);
    struct timespec until = deadline(ms);
    int r = 0;
    while (!(r = held >= n_held && waiters >= n_waiting))
        if (pthread_cond_timedwait(&hook_cond, &dom_lock, &until) == ETIMEDOUT) {
            r = held >= n_held && waiters >= n_waiting;
            break;
        }
    pthread_mutex_unlock(&dom_lock);
    return r;
}
