/* What both operators of the library (_attn.c: AttnRow, _qmatmul.c: MatMulQ) declare to
 * onnxruntime the same way: CPU, inputs and outputs required, default memory, no variadics, every
 * opset. Each file supplies its name, counts, types, create and compute to ORT_CUSTOM_OP. */
#ifndef EDGE_ORTOP_H
#define EDGE_ORTOP_H

#include <stdlib.h>

#include "onnxruntime_c_api.h"

#define CHECK(expr)                  \
    do {                             \
        OrtStatusPtr st_ = (expr);   \
        if (st_ != NULL) return st_; \
    } while (0)

/* Input `index` of a kernel call: its data and its `rank` dimensions; rank_error if it has another rank. */
static inline OrtStatusPtr op_input(const OrtApi *ort, OrtKernelContext *ctx, size_t index, const void **data,
                                    int64_t *dims, size_t rank, const char *rank_error) {
    const OrtValue *value;
    OrtTensorTypeAndShapeInfo *info;
    size_t n;
    CHECK(ort->KernelContext_GetInput(ctx, index, &value));
    CHECK(ort->GetTensorTypeAndShape(value, &info));
    OrtStatusPtr st = ort->GetDimensionsCount(info, &n);
    if (st == NULL && n != rank) st = ort->CreateStatus(ORT_INVALID_ARGUMENT, rank_error);
    if (st == NULL) st = ort->GetDimensions(info, dims, rank);
    ort->ReleaseTensorTypeAndShapeInfo(info);
    CHECK(st);
    return ort->GetTensorMutableData((OrtValue *)value, (void **)data);
}

static inline void op_destroy(void *kernel) { free(kernel); }
static inline const char *op_provider(const OrtCustomOp *op) { (void)op; return NULL; }
static inline OrtCustomOpInputOutputCharacteristic op_required(const OrtCustomOp *op, size_t i) {
    (void)op, (void)i;
    return INPUT_OUTPUT_REQUIRED;
}
static inline OrtMemType op_memtype(const OrtCustomOp *op, size_t i) { (void)op, (void)i; return OrtMemTypeDefault; }
static inline int op_one(const OrtCustomOp *op) { (void)op; return 1; }
static inline int op_until(const OrtCustomOp *op) { (void)op; return 2147483647; }

#define ORT_CUSTOM_OP(NAME, IN_TYPE, N_IN, OUT_TYPE, N_OUT, CREATE, COMPUTE) \
    {                                                                        \
        .version = ORT_API_VERSION,                                          \
        .GetName = NAME,                                                     \
        .GetExecutionProviderType = op_provider,                             \
        .GetInputType = IN_TYPE,                                             \
        .GetInputTypeCount = N_IN,                                           \
        .GetOutputType = OUT_TYPE,                                           \
        .GetOutputTypeCount = N_OUT,                                         \
        .KernelDestroy = op_destroy,                                         \
        .GetInputCharacteristic = op_required,                               \
        .GetOutputCharacteristic = op_required,                              \
        .GetInputMemoryType = op_memtype,                                    \
        .GetVariadicInputMinArity = op_one,                                  \
        .GetVariadicInputHomogeneity = op_one,                               \
        .GetVariadicOutputMinArity = op_one,                                 \
        .GetVariadicOutputHomogeneity = op_one,                              \
        .CreateKernelV2 = CREATE,                                            \
        .KernelComputeV2 = COMPUTE,                                          \
        .GetStartVersion = op_one,                                           \
        .GetEndVersion = op_until,                                           \
    }

#endif
