/* A fake librknnrt.so for the tests: the matmul API entry points edge-llm calls, computed on the CPU.
 *
 * It stands in for Rockchip's closed librknnrt (RKNN runtime), which cannot exist on a machine
 * without an RK3588 NPU. It follows rknn_matmul_api.h of RKNN runtime 2.x (2.1 onwards: the
 * iommu_domain_id field, rknn_matmul_create_dynamic_shape / rknn_matmul_set_dynamic_shape, the
 * 5-argument rknn_B_normal_layout_to_native_layout) and rknn_api.h's rknn_tensor_mem and error
 * codes. The structs are declared here from the header's field lists (written for edge-llm).
 *
 * What it does like the header says (RK3588):
 *   - int8 B native layout (N/32, K/32, 32, 32); above K = 8192, B is split into ceil(K/8192)
 *     segments of K, each in that layout, one after the other;
 *   - A (M, K) and C (M, N) in the normal layout; C = A @ B exactly (int32 accumulation);
 *   - refusals: K or N not a multiple of 32 for int8, K > 10240, a type that is not a
 *     rknn_matmul_type (RKNN_ERR_PARAM_INVALID), a buffer smaller than the io attr's size, an M
 *     that is not one of the context's dynamic shapes, a three-core mask on a matmul context
 *     (reported rejected on boards), more than 4 GiB of rknn_create_mem in one IOMMU domain
 *     (rknn_create_mem returns NULL, as the driver's allocation fails).
 * What is the fake's own choice (marked "fake:" below): only RKNN_INT8_MM_INT8_TO_INT32 and AC in
 * the normal layout are implemented (others are refused); after rknn_matmul_set_dynamic_shape, A
 * and C must be bound again with that shape's attrs before a run (stricter than may be needed:
 * the engine does it either way); destroying a context frees nothing of its buffers (they must be destroyed first).
 * Test hooks (not in the header): fake_live_objects, fake_context_info, fake_domain_bytes,
 * fake_set_domain_limit.
 */
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

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
#define MAX_DOMAINS 16 /* fake: the domain ids it accepts */
#define K_MAX 10240
#define K_SEGMENT 8192
#define TYPE_INT8 2
#define TYPE_INT32 6
#define INT8_MM_INT8_TO_INT32 2
#define LAST_MATMUL_TYPE 12
#define CORE_0_1_2 7
#define CORE_ALL 0xffff

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
    int domain;
    struct mem_rec *next;
} mem_rec;

typedef struct ctx_rec {
    rknn_matmul_info info;
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
static uint64_t domain_bytes[MAX_DOMAINS];
static uint64_t domain_limit = 1ULL << 32; /* 4 GiB per IOMMU domain */

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

static int check_info(const rknn_matmul_info *info) {
    if (info->type < 1 || info->type > LAST_MATMUL_TYPE) return RKNN_ERR_PARAM_INVALID; /* not a rknn_matmul_type */
    if (info->type != INT8_MM_INT8_TO_INT32) return RKNN_ERR_PARAM_INVALID;              /* fake: only this one */
    if (info->K <= 0 || info->N <= 0 || info->K % 32 || info->N % 32) return RKNN_ERR_PARAM_INVALID;
    if (info->K > K_MAX) return RKNN_ERR_PARAM_INVALID;
    if (info->AC_layout != 0) return RKNN_ERR_PARAM_INVALID; /* fake: normal A and C only */
    if (info->B_layout != 0 && info->B_layout != 1) return RKNN_ERR_PARAM_INVALID;
    if (info->iommu_domain_id < 0 || info->iommu_domain_id >= MAX_DOMAINS) return RKNN_ERR_PARAM_INVALID;
    return RKNN_SUCC;
}

static int new_ctx(rknn_context *out, const rknn_matmul_info *info, int n, const int32_t *ms) {
    ctx_rec *c = calloc(1, sizeof *c);
    if (!c) return RKNN_ERR_MALLOC_FAIL;
    c->info = *info;
    c->n_shapes = n;
    for (int i = 0; i < n; i++) c->shapes[i] = ms[i];
    c->cur_m = n == 1 ? ms[0] : 0;
    pthread_mutex_lock(&lock);
    c->next = contexts;
    contexts = c;
    pthread_mutex_unlock(&lock);
    *out = (rknn_context)(uintptr_t)c;
    return RKNN_SUCC;
}

int rknn_matmul_create(rknn_context *ctx, rknn_matmul_info *info, rknn_matmul_io_attr *io) {
    if (!ctx || !info || !io) return RKNN_ERR_PARAM_INVALID;
    int ret = check_info(info);
    if (ret) return ret;
    if (info->M <= 0) return RKNN_ERR_PARAM_INVALID;
    fill_io(info, info->M, io);
    return new_ctx(ctx, info, 1, &info->M);
}

int rknn_matmul_create_dynamic_shape(rknn_context *ctx, rknn_matmul_info *info, int shape_num,
                                     rknn_matmul_shape shapes[], rknn_matmul_io_attr io_attrs[]) {
    if (!ctx || !info || !shapes || !io_attrs || shape_num < 1 || shape_num > MAX_SHAPES) return RKNN_ERR_PARAM_INVALID;
    int32_t ms[MAX_SHAPES];
    rknn_matmul_info i2 = *info;
    i2.K = shapes[0].K;
    i2.N = shapes[0].N;
    int ret = check_info(&i2);
    if (ret) return ret;
    for (int i = 0; i < shape_num; i++) {
        if (shapes[i].K != i2.K || shapes[i].N != i2.N || shapes[i].M <= 0) return RKNN_ERR_PARAM_INVALID;
        ms[i] = shapes[i].M;
    }
    for (int i = 0; i < shape_num; i++) fill_io(&i2, ms[i], &io_attrs[i]);
    return new_ctx(ctx, &i2, shape_num, ms);
}

int rknn_matmul_set_dynamic_shape(rknn_context ctx, rknn_matmul_shape *shape) {
    ctx_rec *c = lookup(ctx);
    if (!c) return RKNN_ERR_CTX_INVALID;
    if (!shape || shape->K != c->info.K || shape->N != c->info.N) return RKNN_ERR_PARAM_INVALID;
    for (int i = 0; i < c->n_shapes; i++)
        if (c->shapes[i] == shape->M) {
            c->cur_m = shape->M;
            return RKNN_SUCC;
        }
    return RKNN_ERR_PARAM_INVALID; /* M outside the dynamic shapes */
}

int rknn_matmul_set_core_mask(rknn_context ctx, int mask) {
    ctx_rec *c = lookup(ctx);
    if (!c) return RKNN_ERR_CTX_INVALID;
    if (mask == CORE_0_1_2 || mask == CORE_ALL) return RKNN_ERR_PARAM_INVALID; /* three cores: refused for matmul */
    if (mask != 0 && mask != 1 && mask != 2 && mask != 4 && mask != 3) return RKNN_ERR_PARAM_INVALID;
    c->core_mask = mask;
    return RKNN_SUCC;
}

rknn_tensor_mem *rknn_create_mem(rknn_context ctx, uint32_t size) {
    pthread_mutex_lock(&lock);
    ctx_rec *c = find_ctx(ctx);
    mem_rec *r = NULL;
    if (c && size > 0) {
        int d = c->info.iommu_domain_id;
        if (domain_bytes[d] + size <= domain_limit && (r = calloc(1, sizeof *r)) != NULL) {
            r->mem.virt_addr = calloc(1, size);
            if (!r->mem.virt_addr) {
                free(r);
                r = NULL;
            } else {
                r->mem.phys_addr = (uint64_t)(uintptr_t)r->mem.virt_addr;
                r->mem.fd = -1;
                r->mem.size = size;
                r->mem.priv_data = r;
                r->domain = d;
                domain_bytes[d] += size;
                r->next = mems;
                mems = r;
            }
        }
    }
    pthread_mutex_unlock(&lock);
    return r ? &r->mem : NULL;
}

int rknn_destroy_mem(rknn_context ctx, rknn_tensor_mem *m) {
    pthread_mutex_lock(&lock);
    int ret = RKNN_ERR_CTX_INVALID;
    if (find_ctx(ctx)) {
        ret = RKNN_ERR_PARAM_INVALID;
        for (mem_rec **p = &mems; *p; p = &(*p)->next)
            if (&(*p)->mem == m) {
                mem_rec *r = *p;
                *p = r->next;
                domain_bytes[r->domain] -= r->mem.size;
                free(r->mem.virt_addr);
                free(r);
                ret = RKNN_SUCC;
                break;
            }
    }
    pthread_mutex_unlock(&lock);
    return ret;
}

int rknn_matmul_set_io_mem(rknn_context ctx, rknn_tensor_mem *m, rknn_matmul_tensor_attr *attr) {
    pthread_mutex_lock(&lock);
    ctx_rec *c = find_ctx(ctx);
    int known = find_mem(m) != NULL;
    pthread_mutex_unlock(&lock);
    if (!c) return RKNN_ERR_CTX_INVALID;
    if (!attr || !m || !known) return RKNN_ERR_PARAM_INVALID;
    if (m->size < attr->size) return RKNN_ERR_PARAM_INVALID; /* buffer too small for the tensor */
    uint32_t K = (uint32_t)c->info.K, N = (uint32_t)c->info.N;
    if (strcmp(attr->name, "B") == 0) {
        if (attr->size != K * N) return RKNN_ERR_PARAM_INVALID;
        c->b = m;
        return RKNN_SUCC;
    }
    int is_a = strcmp(attr->name, "A") == 0;
    if (!is_a && strcmp(attr->name, "C") != 0) return RKNN_ERR_PARAM_INVALID;
    int32_t mm = (int32_t)attr->dims[0];
    if (attr->n_dims != 2 || attr->dims[1] != (is_a ? K : N) || attr->size != (uint32_t)mm * (is_a ? K : N * 4))
        return RKNN_ERR_PARAM_INVALID;
    if (is_a) {
        c->a = m;
        c->a_m = mm;
    } else {
        c->c = m;
        c->c_m = mm;
    }
    return RKNN_SUCC;
}

/* offset of B[k][n] in the int8 native layout (RK3588): segments of 8192 rows of K, each (N/32, Ks/32, 32, 32) */
static size_t native_offset(int k, int n, int K, int N) {
    int seg = k / K_SEGMENT, ks = K - seg * K_SEGMENT;
    if (ks > K_SEGMENT) ks = K_SEGMENT;
    int kk = k - seg * K_SEGMENT;
    size_t base = (size_t)seg * K_SEGMENT * (size_t)N;
    return base + (((size_t)(n / 32) * (size_t)(ks / 32) + (size_t)(kk / 32)) * 1024) + (size_t)(n % 32) * 32 + kk % 32;
}

int rknn_B_normal_layout_to_native_layout(void *b_in, void *b_out, int K, int N, rknn_matmul_info *info) {
    if (!b_in || !b_out || !info) return RKNN_ERR_PARAM_INVALID;
    if (info->type != INT8_MM_INT8_TO_INT32) return RKNN_ERR_PARAM_INVALID; /* fake: int8 only */
    if (K <= 0 || N <= 0 || K % 32 || N % 32 || K > K_MAX) return RKNN_ERR_PARAM_INVALID;
    const int8_t *src = b_in;
    int8_t *dst = b_out;
    for (int k = 0; k < K; k++)
        for (int n = 0; n < N; n++) dst[native_offset(k, n, K, N)] = src[(size_t)k * N + n];
    return RKNN_SUCC;
}

int rknn_matmul_run(rknn_context ctx) {
    ctx_rec *c = lookup(ctx);
    if (!c) return RKNN_ERR_CTX_INVALID;
    int M = c->cur_m, K = c->info.K, N = c->info.N;
    if (M == 0 || !c->b) return RKNN_ERR_INPUT_INVALID;
    if (!c->a || c->a_m != M) return RKNN_ERR_INPUT_INVALID;
    if (!c->c || c->c_m != M) return RKNN_ERR_OUTPUT_INVALID;
    const int8_t *A = c->a->virt_addr, *B = c->b->virt_addr;
    int32_t *C = c->c->virt_addr;
    int native = c->info.B_layout == 1;
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
    return RKNN_SUCC;
}

int rknn_matmul_destroy(rknn_context ctx) {
    pthread_mutex_lock(&lock);
    int ret = RKNN_ERR_CTX_INVALID;
    for (ctx_rec **p = &contexts; *p; p = &(*p)->next)
        if ((rknn_context)(uintptr_t)*p == ctx) {
            ctx_rec *c = *p;
            *p = c->next;
            free(c);
            ret = RKNN_SUCC;
            break;
        }
    pthread_mutex_unlock(&lock);
    return ret;
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

uint64_t fake_domain_bytes(int domain) { return domain >= 0 && domain < MAX_DOMAINS ? domain_bytes[domain] : 0; }

void fake_set_domain_limit(uint64_t bytes) { domain_limit = bytes; }
