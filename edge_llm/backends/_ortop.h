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
