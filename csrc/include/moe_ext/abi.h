/* Kernel ABI of moe_ext: plain C structs shared by the Python glue (the C files in csrc/),
 * the CPU engine (csrc/cpu/) and the CUDA engine (csrc/cuda/).
 *
 * No Python.h and no CUDA headers here; the only code is two dtype helpers. Every engine entry point returns an
 * mx_status; a non-MX_OK code carries a message that the glue turns into a
 * Python exception (MX_ERR_VALUE -> ValueError, MX_ERR_TYPE -> TypeError,
 * MX_ERR_NOT_IMPLEMENTED -> NotImplementedError, others -> RuntimeError).
 * Engines never abort and never print.
 *
 * Pointers in the problem structs point to contiguous row-major storage; the
 * glue has checked shapes, dtypes, devices and contiguity before calling. */
#ifndef MOE_EXT_ABI_H
#define MOE_EXT_ABI_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef enum mx_code {
    MX_OK = 0,
    MX_ERR_VALUE = 1,
    MX_ERR_TYPE = 2,
    MX_ERR_NOT_IMPLEMENTED = 3,
    MX_ERR_CUDA = 4,
    MX_ERR_MEMORY = 5,
} mx_code;

typedef struct mx_status {
    mx_code code;
    char message[256];
} mx_status;

typedef enum mx_dtype {
    MX_F32 = 0,
    MX_F16 = 1,
    MX_BF16 = 2,
    MX_F64 = 3,
    MX_I32 = 4,
    MX_I64 = 5,
    MX_U8 = 6,
    MX_I8 = 7,
    MX_F8E4M3 = 8, /* float8_e4m3fn */
    MX_BOOL = 9,
} mx_dtype;

/* Bytes per element, and the torch name of a dtype (for messages). */
static inline size_t mx_dtype_size(mx_dtype dtype)
{
    switch (dtype) {
    case MX_F64: case MX_I64: return 8;
    case MX_F32: case MX_I32: return 4;
    case MX_F16: case MX_BF16: return 2;
    case MX_U8: case MX_I8: case MX_F8E4M3: case MX_BOOL: return 1;
    }
    return 0;
}

static inline const char *mx_dtype_name(mx_dtype dtype)
{
    switch (dtype) {
    case MX_F32: return "float32";
    case MX_F16: return "float16";
    case MX_BF16: return "bfloat16";
    case MX_F64: return "float64";
    case MX_I32: return "int32";
    case MX_I64: return "int64";
    case MX_U8: return "uint8";
    case MX_I8: return "int8";
    case MX_F8E4M3: return "float8_e4m3fn";
    case MX_BOOL: return "bool";
    }
    return "unknown dtype";
}

typedef enum mx_device_type {
    MX_CPU = 0,
    MX_CUDA = 1,
} mx_device_type;

#define MX_MAX_DIMS 6

/* A strided view (shape and strides in elements), as the glue imported it. */
typedef struct mx_tensor {
    void *data;
    mx_dtype dtype;
    mx_device_type device_type;
    int device_id;
    int ndim;
    int64_t shape[MX_MAX_DIMS];
    int64_t strides[MX_MAX_DIMS];
} mx_tensor;

typedef enum mx_scoring {
    MX_SCORING_SOFTMAX = 0,
    MX_SCORING_SIGMOID = 1,
} mx_scoring;

typedef enum mx_activation {
    MX_ACT_SILU = 0,
    MX_ACT_GELU = 1,      /* erf form */
    MX_ACT_SWIGLUOAI = 2, /* GPT-OSS; gate/up rows interleaved; gated only */
    MX_ACT_RELU2 = 3,     /* relu(h)^2; non-gated only */
} mx_activation;

/* Weight formats of the expert engine (numerics.md "FP8"). */
typedef enum mx_quant {
    MX_QUANT_NONE = 0,       /* weights in act_dtype */
    MX_QUANT_FP8_TENSOR = 1, /* float8_e4m3fn weights, one scale per expert and matrix;
                                activations quantized per tensor, dynamically */
    MX_QUANT_FP8_BLOCK = 2,  /* float8_e4m3fn weights, one scale per 128x128 block;
                                activations quantized per token and 128 columns */
} mx_quant;

#define MX_FP8_BLOCK 128

/* Top-k routing (numerics.md "Routing"): all math in float32, ties go to the
 * lower expert index. */
typedef struct mx_routing_problem {
    int64_t num_tokens;        /* M (>= 1) */
    int64_t num_experts;       /* E */
    int top_k;                 /* 1 <= k <= E */
    mx_scoring scoring;
    int renormalize;
    int num_expert_group;      /* 0: not grouped; else E % groups == 0 */
    int topk_group;            /* groups kept when grouped */
    float routed_scaling_factor;
    mx_dtype logits_dtype;     /* F32 | F16 | BF16 */
    const void *router_logits; /* [M, E] */
    mx_dtype bias_dtype;       /* F32 | F16 | BF16 */
    const void *correction_bias; /* [E] or NULL */
    float *topk_weights;       /* out [M, k] */
    int32_t *topk_ids;         /* out [M, k] */
} mx_routing_problem;

/* The expert computation (numerics.md "Experts"):
 *   for each token t and slot j: e = topk_ids[t, j] (global id); with
 *   expert_map, e = expert_map[e] and e == -1 contributes nothing;
 *   h = x_t @ w13[e].T (+ w13_bias[e]); a = act(h) rounded to act_dtype;
 *   y = a @ w2[e].T (+ w2_bias[e]); out_t = sum_j topk_weights[t, j] * y
 *   (float32 sum in slot order, rounded once). With
 *   apply_router_weight_on_input (top_k == 1), x_t is scaled by the weight
 *   before the first GEMM instead. Every output row is written. */
typedef struct mx_experts_problem {
    int64_t num_tokens;          /* M (>= 1) */
    int64_t hidden_size;         /* H */
    int64_t intermediate_size;   /* I (per partition) */
    int64_t num_local_experts;   /* rows of w13 / w2 */
    int64_t global_num_experts;  /* valid topk_ids are [0, global_num_experts) */
    int top_k;
    mx_activation activation;
    int is_act_and_mul;          /* 1: w13 has 2I rows (gate, up); 0: I rows */
    float swiglu_alpha;
    float swiglu_limit;
    int apply_router_weight_on_input;
    mx_dtype act_dtype;          /* dtype of x, w13, w2, biases, output */
    const void *hidden_states;   /* [M, H] */
    const void *w13;             /* [E_local, N1, H], N1 = 2I or I */
    const void *w2;              /* [E_local, H, I] */
    const void *w13_bias;        /* [E_local, N1] or NULL */
    const void *w2_bias;         /* [E_local, H] or NULL */
    const float *topk_weights;   /* [M, k] */
    const int32_t *topk_ids;     /* [M, k] */
    const int32_t *expert_map;   /* [global_num_experts] or NULL */
    void *output;                /* [M, H] */
    /* FP8 w8a8. With quant != MX_QUANT_NONE, w13 and w2 hold float8_e4m3fn
     * (biases stay in act_dtype) and the engine quantizes each GEMM's input
     * dynamically: x (after apply_router_weight_on_input) for GEMM1, and the
     * activation output (already rounded to act_dtype) for GEMM2, over the rows
     * of local experts only. FP8_TENSOR: one scale over all those rows; FP8_BLOCK:
     * per row and 128 columns (per_token_group_quant_fp8). GEMM output =
     * (qa @ qw.T) * sa * sw, float32 accumulation; in the block case each 128-K
     * slice's partial sum is scaled by sa[row, kb] * sw[nb, kb] before adding. */
    mx_quant quant;
    const float *w13_scale;      /* TENSOR [E_local]; BLOCK [E_local, ceil(N1/128), ceil(H/128)] */
    const float *w2_scale;       /* TENSOR [E_local]; BLOCK [E_local, ceil(H/128), ceil(I/128)] */
    /* Routing the engine runs first (its outputs are topk_weights / topk_ids
     * above, router logits of E_global experts), or NULL when the caller
     * routed. The CUDA engine fuses it with its sort when M is small. */
    const mx_routing_problem *routing;
    /* 1: w13 and w2 hold the packed layout of the Hopper kernels, each
     * expert's [N, K] as [N / 64, K / (128 bytes), 64, 128 bytes] (every
     * 64-row block of a 128-byte k slice one contiguous 8 KB piece; biases
     * and scales keep their layout). Needs N multiples of 64 rows and K of
     * 128 bytes, 16-bit activations, and a device the sm_90a kernels run
     * on: other engines refuse it (MX_ERR_NOT_IMPLEMENTED). */
    int weights_packed;
} mx_experts_problem;

/* FP8 quantizers (numerics.md "FP8"); x in F32/F16/BF16, q float8_e4m3fn bytes,
 * all contiguous. CPU and CUDA results agree bit for bit. */
typedef enum mx_fp8_mode {
    MX_FP8_PER_TENSOR = 0, /* x [batch, n]: scale[b] = max(amax/448, 1/(448*512)) unless
                              scale_given; q = fp8(clamp(x * (1/scale), -448, 448)) */
    MX_FP8_PER_BLOCK = 1,  /* x [batch, rows, cols]: blocks block_rows x block_cols (edge blocks
                              partial); sf = max(amax, 1e-4)/448 (use_ue8m0: 2^ceil(log2 sf));
                              q = fp8(x * (1/sf)); scale [batch, ceil(rows/br), ceil(cols/bc)] */
    MX_FP8_PER_TOKEN_GROUP = 2, /* x [batch=1, rows, cols]: per row and block_cols columns,
                                   s = max(amax, 1e-10)/448; q = fp8(clamp(x / s, -448, 448));
                                   scale [rows, ceil(cols/block_cols)] */
} mx_fp8_mode;

typedef struct mx_fp8_quant_problem {
    mx_fp8_mode mode;
    mx_dtype dtype;
    const void *x;
    int64_t batch;        /* PER_TENSOR: number of slices; PER_BLOCK: matrices */
    int64_t rows;         /* PER_TENSOR: 1 */
    int64_t cols;         /* PER_TENSOR: elements per slice */
    int block_rows;       /* PER_BLOCK */
    int block_cols;       /* PER_BLOCK, PER_TOKEN_GROUP */
    int use_ue8m0;        /* PER_BLOCK */
    int scale_given;      /* PER_TENSOR: use scale[] as given (static) */
    uint8_t *q;
    float *scale;
} mx_fp8_quant_problem;

/* A dense FP8 w8a8 linear layer (moe_ext.Linear): out = x @ W.T (+ bias) with
 * x quantized dynamically as in the expert engine (TENSOR: per tensor; BLOCK: per
 * token and 128 columns). */
typedef struct mx_fp8_linear_problem {
    int64_t rows, in_features, out_features;
    mx_quant quant;              /* FP8_TENSOR or FP8_BLOCK */
    mx_dtype act_dtype;          /* x, bias and output */
    const void *x;               /* [rows, in_features] */
    const uint8_t *weight;       /* [out_features, in_features] float8_e4m3fn */
    const float *weight_scale;   /* TENSOR [1]; BLOCK [ceil(out/128), ceil(in/128)] */
    const void *bias;            /* [out_features] or NULL */
    void *output;                /* [rows, out_features] */
} mx_fp8_linear_problem;

/* ---- CPU engine (csrc/cpu/) ---------------------------------------------- */
mx_status mx_cpu_route(const mx_routing_problem *p);
/* Bytes of scratch mx_cpu_experts needs; the glue allocates it (64-byte aligned). */
size_t mx_cpu_experts_workspace_bytes(const mx_experts_problem *p);
/* Returns MX_ERR_VALUE naming the first out-of-range id in topk_ids. */
mx_status mx_cpu_experts(const mx_experts_problem *p, void *workspace);
/* dst = src elementwise over equal shapes, converting between F32/F16/BF16/F64
 * (other dtypes only to themselves). Both on the CPU; any strides. */
mx_status mx_cpu_copy(const mx_tensor *dst, const mx_tensor *src);
mx_status mx_cpu_fp8_quant(const mx_fp8_quant_problem *p);
size_t mx_cpu_fp8_linear_workspace_bytes(const mx_fp8_linear_problem *p);
mx_status mx_cpu_fp8_linear(const mx_fp8_linear_problem *p, void *workspace);

/* ---- CUDA engine (csrc/cuda/), compiled only when MOE_EXT_WITH_CUDA ------ */
/* stream is a cudaStream_t; nothing here synchronizes with the host. */
int mx_cuda_device_count(void);
/* Makes `device` current for this host thread and returns the one that was
 * (csrc/cuda/device_guard.cu); the glue restores it after the call. */
mx_status mx_cuda_swap_device(int device, int *previous);
/* 1 when `device` runs the sm_90a kernels of this build (compute capability
 * 9.0, sm_90a code, a driver with TMA), which alone read packed weights. */
int mx_cuda_sm90_kernels(int device);
mx_status mx_cuda_route(const mx_routing_problem *p, void *stream);
size_t mx_cuda_experts_workspace_bytes(const mx_experts_problem *p);
/* Out-of-range ids contribute nothing on the GPU (no host sync to report them). */
mx_status mx_cuda_experts(const mx_experts_problem *p, void *workspace, void *stream);
/* Whether mx_cuda_experts may run a decode forward (M <= 2) as one launch
 * (csrc/cuda/decode_fused.cu; on by default); returns the previous setting.
 * For tests and benchmarks that compare it with the multi-launch pipeline. */
int mx_cuda_set_decode_fused(int enabled);
/* The persistent Hopper kernel's GEMM2 picks how many k slices to run on the
 * device (csrc/cuda/gemm_configs.cuh mx_sm90_down_split); n >= 1 makes it
 * run exactly n where K allows (at most 4), 0 restores the pick. Returns
 * the previous setting. For tests. */
int mx_cuda_set_sm90_down_splits(int n);
/* That pick as the kernel makes it, for units work units on slots CTAs
 * (count slices of len k blocks). For tests. */
void mx_cuda_sm90_down_split_rule(int units, int slots, int max_splits, int k_blocks, int align, int *count, int *len);
mx_status mx_cuda_copy(const mx_tensor *dst, const mx_tensor *src, void *stream);
mx_status mx_cuda_fp8_quant(const mx_fp8_quant_problem *p, void *stream);
size_t mx_cuda_fp8_linear_workspace_bytes(const mx_fp8_linear_problem *p);
mx_status mx_cuda_fp8_linear(const mx_fp8_linear_problem *p, void *workspace, void *stream);

#ifdef __cplusplus
}
#endif

#endif /* MOE_EXT_ABI_H */
