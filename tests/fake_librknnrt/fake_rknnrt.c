/* A fake librknnrt.so for the tests: the matmul API entry points edge-llm calls, computed on the CPU.
 *
 * It stands in for Rockchip's closed librknnrt (RKNN runtime), which cannot exist on a machine
 * without an RK3588 NPU, and refuses what Rockchip says the library refuses. Sources (rknn-toolkit2
 * 2.3.2; docs/npu.md, "The fake library", has them line by line): rknn_matmul_api.h ("header"),
 * rknn_api.h, the dynamic-shape demo rknpu2/examples/rknn_matmul_api_demo/src/
 * rknn_matmul_api_dynshape_demo.cpp ("demo"), board reports in rknn-toolkit2's issues, and the NPU
 * driver (fake_iommu.c). The structs are declared here from the header's field lists.
 *
 * Each rule below is marked where it is enforced: "rule:" with its source; "fake:" marks the
 * fake's own choices (a return code no source documents, or a check stricter than stated).
 * Implemented: RKNN_INT8_MM_INT8_TO_INT32 with A and C in the normal layout, B normal or native
 * (RK3588's int8 native layout, K > 8192 in segments), C = A @ B exactly (int32). rknn_query's SDK
 * version, rknn_mem_sync and the misbehaving builds the start-up self-test is tested against:
 * fake_misbehave.c. Test hooks (not in the library): fake_live_objects, fake_context_info,
 * fake_refusals, and fake_iommu.c's.
 */
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "fake_iommu.h"
#include "fake_matmul.h"
#include "fake_misbehave.h"

/* rknn_api.h, "Error code returned by the RKNN API" */
#define RKNN_SUCC 0
#define RKNN_ERR_FAIL -1
#define RKNN_ERR_MALLOC_FAIL -4
#define RKNN_ERR_PARAM_INVALID -5
#define RKNN_ERR_CTX_INVALID -7
#define RKNN_ERR_INPUT_INVALID -8
#define RKNN_ERR_OUTPUT_INVALID -9

#define MAX_NAME_LEN 256
#define MAX_DIMS 16
#define MAX_SHAPES 512 /* RKNN_MAX_DYNAMIC_SHAPE_NUM */
#define K_MAX 10240    /* header, rknn_matmul_set_io_mem: "K max: k <= 10240" */
#define TYPE_INT8 2
#define TYPE_INT32 6
#define INT8_MM_INT8_TO_INT32 2
#define LAST_MATMUL_TYPE 15 /* header, rknn_matmul_type: RKNN_INT8_MM_INT4_TO_FLOAT16 = 15; 13, 14 unused */
#define LAST_QUANT_TYPE 5   /* header, rknn_matmul_quant_type: PER_LAYER_SYM 0 .. PER_GROUP_ASYM 5 */

typedef uint64_t rknn_context;

typedef struct {
    void *virt_addr;
    uint64_t phys_addr;
    int32_t fd;
    int32_t offset;
    uint32_t size;
    uint32_t flags;
    void *priv_data;
} rknn_tensor_mem;

typedef struct {
    int32_t M, K, N;
    int type;
    int16_t B_layout, B_quant_type, AC_layout, AC_quant_type;
    int32_t iommu_domain_id;
    int16_t group_size;
    int8_t reserved[34];
} rknn_matmul_info;

typedef struct {
    char name[MAX_NAME_LEN];
    uint32_t n_dims;
    uint32_t dims[MAX_DIMS];
    uint32_t size;
    int type;
} rknn_matmul_tensor_attr;

typedef struct {
    rknn_matmul_tensor_attr A, B, C;
} rknn_matmul_io_attr;

typedef struct {
    int32_t M, K, N;
} rknn_matmul_shape;

typedef struct mem_rec {
    rknn_tensor_mem mem;
    rknn_context owner; /* the context rknn_create_mem was given */
    int domain;
    void *dev; /* the NPU's view of the buffer when it is not the CPU's (fake_misbehave.c), else NULL */
    struct mem_rec *next;
} mem_rec;

typedef struct ctx_rec {
    rknn_matmul_info info;
    int dynamic; /* made by rknn_matmul_create_dynamic_shape */
    int n_shapes;
    int32_t shapes[MAX_SHAPES]; /* the M values */
    int32_t cur_m;              /* 0: no shape set yet (dynamic contexts) */
    rknn_tensor_mem *a, *b, *c;
    int32_t a_m, c_m; /* the M of the attrs A and C were bound with */
    int core_mask;
    struct ctx_rec *next;
} ctx_rec;

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static ctx_rec *contexts;
static mem_rec *mems;
static int64_t refusals; /* every non-success return and NULL buffer (fake_refusals) */

static int refuse(int code) {
    __atomic_fetch_add(&refusals, 1, __ATOMIC_RELAXED);
    return code;
}

static rknn_tensor_mem *no_mem(void) {
    refuse(0);
    return NULL;
}

static ctx_rec *find_ctx(rknn_context h) {
    for (ctx_rec *c = contexts; c; c = c->next)
        if ((rknn_context)(uintptr_t)c == h) return c;
    return NULL;
}

static ctx_rec *lookup(rknn_context h) { /* find_ctx under the lock (runs on several threads) */
    pthread_mutex_lock(&lock);
    ctx_rec *c = find_ctx(h);
    pthread_mutex_unlock(&lock);
    return c;
}

static mem_rec *find_mem(rknn_tensor_mem *m) {
    for (mem_rec *r = mems; r; r = r->next)
        if (&r->mem == m) return r;
    return NULL;
}

static void set_attr(rknn_matmul_tensor_attr *a, const char *name, int type, uint32_t size, int n, const uint32_t *d) {
    memset(a, 0, sizeof *a);
    strncpy(a->name, name, MAX_NAME_LEN - 1);
    a->type = type;
    a->size = size;
    a->n_dims = (uint32_t)n;
    for (int i = 0; i < n; i++) a->dims[i] = d[i];
}

static void fill_io(const rknn_matmul_info *info, int32_t m, rknn_matmul_io_attr *io) {
    uint32_t K = (uint32_t)info->K, N = (uint32_t)info->N;
    uint32_t da[2] = {(uint32_t)m, K}, dc[2] = {(uint32_t)m, N}, bn[2] = {K, N}, bv[4] = {N / 32, K / 32, 32, 32};
    set_attr(&io->A, "A", TYPE_INT8, (uint32_t)m * K, 2, da);
    if (info->B_layout == 1)
        set_attr(&io->B, "B", TYPE_INT8, K * N, 4, bv);
    else
        set_attr(&io->B, "B", TYPE_INT8, K * N, 2, bn);
    set_attr(&io->C, "C", TYPE_INT32, (uint32_t)m * N * 4, 2, dc);
}

/* rule (header, rknn_matmul_info's K and N, and rknn_matmul_set_io_mem's "limit"): on RK3588 K is
 * aligned to 32 for every type, N to 32 for int8, 16 for float16, 64 for int4 (here: B's type) */
static int n_align(int type) {
    switch (type) {
    case 1: case 4: return 16;                            /* B float16 */
    case 7: case 8: case 10: case 11: case 12: case 15: return 64; /* B int4 */
    default: return 32;                                   /* B int8 */
    }
}

static int check_info(const rknn_matmul_info *info) {
    /* rule (header, rknn_matmul_type): 1..12 and 15 */
    if (info->type < 1 || info->type > LAST_MATMUL_TYPE || info->type == 13 || info->type == 14)
        return RKNN_ERR_PARAM_INVALID;
    if (info->K <= 0 || info->N <= 0 || info->K % 32 || info->N % n_align(info->type))
        return RKNN_ERR_PARAM_INVALID; /* rule: n_align */
    if (info->K > K_MAX) return RKNN_ERR_PARAM_INVALID;                       /* rule (header): K <= 10240 */
    if (info->B_quant_type < 0 || info->B_quant_type > LAST_QUANT_TYPE) return RKNN_ERR_PARAM_INVALID; /* rule */
    if (info->AC_quant_type != 0) return RKNN_ERR_PARAM_INVALID; /* rule (header): "A and C only support 0" */
    if (info->B_layout < 0 || info->B_layout > 2 || info->AC_layout < 0 || info->AC_layout > 1)
        return RKNN_ERR_PARAM_INVALID; /* rule (header, rknn_matmul_layout) */
    /* rule (driver: rknpu_iommu_switch_domain refuses ids outside 0..RKNPU_MAX_IOMMU_DOMAIN_NUM - 1) */
    if (info->iommu_domain_id < 0 || info->iommu_domain_id >= FAKE_DOMAINS) return RKNN_ERR_PARAM_INVALID;
    /* fake: only int8 x int8 -> int32, B normal or native, A and C normal are implemented */
    if (info->type != INT8_MM_INT8_TO_INT32 || info->B_layout == 2 || info->AC_layout != 0) return RKNN_ERR_PARAM_INVALID;
    return RKNN_SUCC;
}

static int new_ctx(rknn_context *out, const rknn_matmul_info *info, int dynamic, int n, const int32_t *ms) {
    ctx_rec *c = calloc(1, sizeof *c);
    if (!c) return RKNN_ERR_MALLOC_FAIL;
    c->info = *info;
    c->dynamic = dynamic;
    c->n_shapes = n;
    for (int i = 0; i < n; i++) c->shapes[i] = ms[i];
    c->cur_m = dynamic ? 0 : ms[0]; /* a dynamic context has no shape until set_dynamic_shape */
    pthread_mutex_lock(&lock);
    c->next = contexts;
    contexts = c;
    pthread_mutex_unlock(&lock);
    *out = (rknn_context)(uintptr_t)c;
    return RKNN_SUCC;
}

int rknn_matmul_create(rknn_context *ctx, rknn_matmul_info *info, rknn_matmul_io_attr *io) {
    if (!ctx || !info || !io) return refuse(RKNN_ERR_PARAM_INVALID);
    int ret = check_info(info);
    if (ret) return refuse(ret);
    if (info->M <= 0) return refuse(RKNN_ERR_PARAM_INVALID);
    fill_io(info, info->M, io);
    return new_ctx(ctx, info, 0, 1, &info->M);
}

/* rule (header, rknn_matmul_create_dynamic_shape: "the original info.M, K, N are invalid"): the
 * shapes give K and N; rule (header, rknn_matmul_set_dynamic_shape: "only support M dynamicly"):
 * every shape has the same K and N */
int rknn_matmul_create_dynamic_shape(rknn_context *ctx, rknn_matmul_info *info, int shape_num,
                                     rknn_matmul_shape shapes[], rknn_matmul_io_attr io_attrs[]) {
    if (!ctx || !info || !shapes || !io_attrs || shape_num < 1 || shape_num > MAX_SHAPES)
        return refuse(RKNN_ERR_PARAM_INVALID);
    int32_t ms[MAX_SHAPES];
    rknn_matmul_info i2 = *info;
    i2.K = shapes[0].K;
    i2.N = shapes[0].N;
    int ret = check_info(&i2);
    if (ret) return refuse(ret);
    for (int i = 0; i < shape_num; i++) {
        if (shapes[i].K != i2.K || shapes[i].N != i2.N || shapes[i].M <= 0) return refuse(RKNN_ERR_PARAM_INVALID);
        ms[i] = shapes[i].M;
    }
    for (int i = 0; i < shape_num; i++) fill_io(&i2, ms[i], &io_attrs[i]);
    return new_ctx(ctx, &i2, 1, shape_num, ms);
}

int rknn_matmul_set_dynamic_shape(rknn_context ctx, rknn_matmul_shape *shape) {
    ctx_rec *c = lookup(ctx);
    if (!c) return refuse(RKNN_ERR_CTX_INVALID);
    if (!shape || shape->K != c->info.K || shape->N != c->info.N) return refuse(RKNN_ERR_PARAM_INVALID);
    for (int i = 0; i < c->n_shapes; i++)
        if (c->shapes[i] == shape->M) {
            c->cur_m = shape->M;
            return RKNN_SUCC;
        }
    return refuse(RKNN_ERR_PARAM_INVALID); /* rule: an M the context was not created with */
}

/* rule (header, rknn_matmul_set_core_mask, lists AUTO, 0, 1, 2, 0_1, 0_1_2; boards answer -1 with
 * "Not support core mask: 3" for 0_1 (rknn-toolkit2 issue #7) and "Not support core mask: 7" for
 * 0_1_2 (rknpu2 issue #105; rknn-toolkit2 #253)): a matmul context takes AUTO or one core; any
 * other mask is RKNN_ERR_FAIL, as boards report it */
int rknn_matmul_set_core_mask(rknn_context ctx, int mask) {
    ctx_rec *c = lookup(ctx);
    if (!c) return refuse(RKNN_ERR_CTX_INVALID);
    if (mask != 0 && mask != 1 && mask != 2 && mask != 4) return refuse(RKNN_ERR_FAIL);
    c->core_mask = mask;
    return RKNN_SUCC;
}

/* rule (driver): the allocation switches to the context's domain (waiting as fake_iommu.c says)
 * and is page-rounded against the domain's 4 GiB; NULL, as the driver's allocation fails */
rknn_tensor_mem *rknn_create_mem(rknn_context ctx, uint32_t size) {
    ctx_rec *c = lookup(ctx);
    if (!c || size == 0) return no_mem();
    int d = c->info.iommu_domain_id;
    if (fake_domain_get(d)) return no_mem();
    mem_rec *r = NULL;
    if (fake_domain_reserve(d, size) == 0) {
        r = calloc(1, sizeof *r);
        if (r) r->mem.virt_addr = calloc(1, size);
        if (!r || !r->mem.virt_addr) {
            free(r);
            r = NULL;
            fake_domain_release(d, size);
        }
    }
    fake_domain_put();
    if (!r) return no_mem();
    r->mem.phys_addr = (uint64_t)(uintptr_t)r->mem.virt_addr;
    r->mem.fd = -1;
    r->mem.size = size;
    r->mem.priv_data = r;
    r->dev = fake_device_copy(size);
    r->owner = ctx;
    r->domain = d;
    pthread_mutex_lock(&lock);
    r->next = mems;
    mems = r;
    pthread_mutex_unlock(&lock);
    return &r->mem;
}

/* rule (rknn_api.h, rknn_destroy_mem(ctx, mem), and the demo's release order: the buffers, then
 * the context): a buffer is destroyed with the context that created it, while that context lives.
 * rule (driver, rknpu_gem_object_destroy): the free switches to the buffer's domain first, trying
 * get_and_switch 3 times; if all time out it gives up and the buffer's pages stay mapped (the
 * fake keeps them counted in the domain); the caller is told nothing (fake: RKNN_SUCC) */
int rknn_destroy_mem(rknn_context ctx, rknn_tensor_mem *m) {
    pthread_mutex_lock(&lock);
    mem_rec *r = NULL;
    int ret = RKNN_ERR_CTX_INVALID;
    if (find_ctx(ctx)) {
        ret = RKNN_ERR_PARAM_INVALID;
        for (mem_rec **p = &mems; *p; p = &(*p)->next)
            if (&(*p)->mem == m) {
                if ((*p)->owner != ctx) break; /* another context's buffer */
                r = *p;
                *p = r->next;
                ret = RKNN_SUCC;
                break;
            }
    }
    pthread_mutex_unlock(&lock);
    if (!r) return refuse(ret);
    int got = -1;
    for (int i = 0; i < 3 && got; i++) got = fake_domain_get(r->domain);
    if (got == 0) {
        fake_domain_release(r->domain, r->mem.size);
        fake_domain_put();
    }
    free(r->mem.virt_addr);
    free(r->dev);
    free(r);
    return RKNN_SUCC;
}

int rknn_matmul_set_io_mem(rknn_context ctx, rknn_tensor_mem *m, rknn_matmul_tensor_attr *attr) {
    pthread_mutex_lock(&lock);
    ctx_rec *c = find_ctx(ctx);
    mem_rec *r = find_mem(m);
    pthread_mutex_unlock(&lock);
    if (!c) return refuse(RKNN_ERR_CTX_INVALID);
    if (!attr || !m || !r) return refuse(RKNN_ERR_PARAM_INVALID);
    if (r->owner != ctx) return refuse(RKNN_ERR_PARAM_INVALID); /* rule: buffers of the context that made them */
    /* rule (demo, before binding B: "rknn_matmul_set_io_mem must call after
     * rknn_matmul_set_dynamic_shape"); fake: the code, RKNN_ERR_FAIL (the demo only checks ret < 0) */
    if (c->dynamic && c->cur_m == 0) return refuse(RKNN_ERR_FAIL);
    if (m->size < attr->size) return refuse(RKNN_ERR_PARAM_INVALID); /* rule: a buffer too small for the tensor */
    uint32_t K = (uint32_t)c->info.K, N = (uint32_t)c->info.N;
    if (strcmp(attr->name, "B") == 0) {
        if (attr->size != K * N) return refuse(RKNN_ERR_PARAM_INVALID);
        c->b = m; /* demo: "B can not be dynamic, only call set_io_mem once" */
        return RKNN_SUCC;
    }
    int is_a = strcmp(attr->name, "A") == 0;
    if (!is_a && strcmp(attr->name, "C") != 0) return refuse(RKNN_ERR_PARAM_INVALID);
    int32_t mm = (int32_t)attr->dims[0];
    if (attr->n_dims != 2 || attr->dims[1] != (is_a ? K : N) || attr->size != (uint32_t)mm * (is_a ? K : N * 4))
        return refuse(RKNN_ERR_PARAM_INVALID);
    /* fake: A and C are bound with the attrs of the shape set now (the demo binds them so, after
     * each rknn_matmul_set_dynamic_shape; whether the library insists is a board question) */
    if (mm != c->cur_m) return refuse(RKNN_ERR_PARAM_INVALID);
    if (is_a) {
        fake_bind_flush(r->dev, m->virt_addr, m->size);
        c->a = m;
        c->a_m = mm;
    } else {
        c->c = m;
        c->c_m = mm;
    }
    return RKNN_SUCC;
}

/* rule (header): B (K, N) as declared by info; fake: info.M must be set (the demo sets it to the
 * largest M before converting; what the library makes of M = 0 is a board question) */
int rknn_B_normal_layout_to_native_layout(void *b_in, void *b_out, int K, int N, rknn_matmul_info *info) {
    if (!b_in || !b_out || !info) return refuse(RKNN_ERR_PARAM_INVALID);
    if (info->type != INT8_MM_INT8_TO_INT32) return refuse(RKNN_ERR_PARAM_INVALID); /* fake: int8 only */
    if (K <= 0 || N <= 0 || K % 32 || N % 32 || K > K_MAX) return refuse(RKNN_ERR_PARAM_INVALID);
    if (info->K != K || info->N != N || info->M <= 0) return refuse(RKNN_ERR_PARAM_INVALID);
    fake_to_native(b_in, b_out, K, N);
    return RKNN_SUCC;
}

int rknn_matmul_run(rknn_context ctx) {
    ctx_rec *c = lookup(ctx);
    if (!c) return refuse(RKNN_ERR_CTX_INVALID);
    int M = c->cur_m, K = c->info.K, N = c->info.N;
    if (M == 0 || !c->b) return refuse(RKNN_ERR_INPUT_INVALID);
    if (!c->a || c->a_m != M) return refuse(RKNN_ERR_INPUT_INVALID);
    if (!c->c || c->c_m != M) return refuse(RKNN_ERR_OUTPUT_INVALID);
    /* rule (driver): the job holds a reference on its domain from commit to completion; a run in
     * another domain waits, up to the switch timeout; fake: the code, RKNN_ERR_FAIL (the driver's
     * -EINVAL as the library reports it is undocumented) */
    if (fake_domain_get(c->info.iommu_domain_id)) return refuse(RKNN_ERR_FAIL);
    fake_run_gate();
    mem_rec *ra = c->a->priv_data, *rc = c->c->priv_data; /* the NPU reads and writes its view */
    int32_t *C = rc->dev ? rc->dev : c->c->virt_addr;
    int raced = fake_race_enter();
    fake_multiply(ra->dev ? ra->dev : c->a->virt_addr, c->b->virt_addr, C, M, K, N, c->info.B_layout == 1);
    fake_misbehave_product(C, M, raced);
    fake_domain_put();
    return RKNN_SUCC;
}

int rknn_matmul_destroy(rknn_context ctx) {
    pthread_mutex_lock(&lock);
    int ret = RKNN_ERR_CTX_INVALID;
    for (ctx_rec **p = &contexts; *p; p = &(*p)->next)
        if ((rknn_context)(uintptr_t)*p == ctx) {
            ctx_rec *c = *p;
            *p = c->next;
            free(c); /* fake: its buffers stay (the demo destroys them first; they can no longer be) */
            ret = RKNN_SUCC;
            break;
        }
    pthread_mutex_unlock(&lock);
    return ret ? refuse(ret) : ret;
}

/* for rknn_mem_sync and rknn_query (fake_misbehave.c): whether `ctx` is a context, and `m` one of its
 * buffers (its CPU and NPU views) */
int fake_ctx_valid(rknn_context ctx) { return lookup(ctx) != NULL; }

int fake_mem_of(rknn_context ctx, void *m, void **virt, void **dev, uint32_t *size) {
    pthread_mutex_lock(&lock);
    mem_rec *r = find_ctx(ctx) ? find_mem(m) : NULL;
    int ok = r && r->owner == ctx;
    if (ok) {
        *virt = r->mem.virt_addr;
        *dev = r->dev;
        *size = r->mem.size;
    }
    pthread_mutex_unlock(&lock);
    return ok ? 0 : -1;
}

/* ---- test hooks (not part of librknnrt) ---- */
void fake_live_objects(int64_t *n_contexts, int64_t *n_mems) {
    int64_t nc = 0, nm = 0;
    pthread_mutex_lock(&lock);
    for (ctx_rec *c = contexts; c; c = c->next) nc++;
    for (mem_rec *r = mems; r; r = r->next) nm++;
    pthread_mutex_unlock(&lock);
    *n_contexts = nc;
    *n_mems = nm;
}

/* the core mask and IOMMU domain a context was given; -1 for a context that does not exist */
int fake_context_info(rknn_context ctx, int *core_mask, int *domain) {
    ctx_rec *c = lookup(ctx);
    if (!c) return -1;
    *core_mask = c->core_mask;
    *domain = c->info.iommu_domain_id;
    return 0;
}

/* how many calls the fake has refused since it was loaded */
int64_t fake_refusals(void) { return __atomic_load_n(&refusals, __ATOMIC_RELAXED); }
