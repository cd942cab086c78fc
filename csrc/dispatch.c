/* Checks a forward's views and runs routing and the experts on the CPU or
 * CUDA engine: the one code path behind MoECore.forward and the functional
 * API. Everything is checked before anything is allocated or written. */
#include "glue.h"

#include <string.h>

#define WORKSPACE_ALIGN 256

static const mx_dtype float_dtypes[] = {MX_F32, MX_F16, MX_BF16};

static size_t align_up(size_t n)
{
    return (n + WORKSPACE_ALIGN - 1) / WORKSPACE_ALIGN * WORKSPACE_ALIGN;
}

static mx_status route_on(const mx_tensor *where, const mx_routing_problem *p, void *stream)
{
#ifdef MOE_EXT_WITH_CUDA
    if (where->device_type == MX_CUDA)
        return mx_cuda_route(p, stream);
#else
    (void)stream;
#endif
    (void)where;
    return mx_cpu_route(p);
}

static size_t experts_workspace_on(const mx_tensor *where, const mx_experts_problem *p)
{
#ifdef MOE_EXT_WITH_CUDA
    if (where->device_type == MX_CUDA)
        return mx_cuda_experts_workspace_bytes(p);
#endif
    (void)where;
    return mx_cpu_experts_workspace_bytes(p);
}

static mx_status experts_on(const mx_tensor *where, const mx_experts_problem *p, void *ws,
                            void *stream)
{
#ifdef MOE_EXT_WITH_CUDA
    if (where->device_type == MX_CUDA)
        return mx_cuda_experts(p, ws, stream);
#else
    (void)stream;
#endif
    (void)where;
    return mx_cpu_experts(p, ws);
}

/* Checks router_logits [M, E] and the optional bias [E]; 0 => ok. */
static int check_routing_inputs(const mx_route_args *a, const mx_tensor *logits,
                                const mx_tensor *bias)
{
    const int64_t any2[2] = {-1, -1};
    if (mx_check_dtype_in(logits, "router_logits", float_dtypes, 3) < 0 ||
        mx_check_shape(logits, "router_logits", 2, any2) < 0 ||
        mx_check_contiguous(logits, "router_logits") < 0)
        return -1;
    int64_t experts = logits->shape[1];
    if (a->top_k < 1 || a->top_k > experts) {
        PyErr_Format(PyExc_ValueError, "top_k: expected 1 <= top_k <= %lld experts, got %d",
                     (long long)experts, a->top_k);
        return -1;
    }
    if (a->num_expert_group > 0) {
        if (experts % a->num_expert_group != 0) {
            PyErr_Format(PyExc_ValueError, "num_expert_group: %d does not divide the %lld experts",
                         a->num_expert_group, (long long)experts);
            return -1;
        }
        if (a->topk_group < 1 || a->topk_group > a->num_expert_group) {
            PyErr_Format(PyExc_ValueError, "topk_group: expected 1 <= topk_group <= %d, got %d",
                         a->num_expert_group, a->topk_group);
            return -1;
        }
        if ((int64_t)a->topk_group * (experts / a->num_expert_group) < a->top_k) {
            PyErr_Format(PyExc_ValueError, "top_k: %d exceeds the %lld experts in the %d kept groups",
                         a->top_k, (long long)(a->topk_group * (experts / a->num_expert_group)),
                         a->topk_group);
            return -1;
        }
    }
    if (bias->data) {
        const int64_t want[1] = {experts};
        if (mx_check_dtype_in(bias, "e_score_correction_bias", float_dtypes, 3) < 0 ||
            mx_check_shape(bias, "e_score_correction_bias", 1, want) < 0 ||
            mx_check_contiguous(bias, "e_score_correction_bias") < 0 ||
            mx_check_same_device(bias, "e_score_correction_bias", logits, "router_logits") < 0)
            return -1;
    }
    return 0;
}

static void fill_routing_problem(mx_routing_problem *p, const mx_route_args *a,
                                 const mx_tensor *logits, const mx_tensor *bias, float *weights,
                                 int32_t *ids)
{
    memset(p, 0, sizeof *p);
    p->num_tokens = logits->shape[0];
    p->num_experts = logits->shape[1];
    p->top_k = a->top_k;
    p->scoring = a->scoring;
    p->renormalize = a->renormalize;
    p->num_expert_group = a->num_expert_group;
    p->topk_group = a->topk_group;
    p->routed_scaling_factor = a->routed_scaling_factor;
    p->logits_dtype = logits->dtype;
    p->router_logits = logits->data;
    p->bias_dtype = bias->data ? bias->dtype : MX_F32;
    p->correction_bias = bias->data;
    p->topk_weights = weights;
    p->topk_ids = ids;
}

PyObject *mx_run_route(mx_module_state *st, const mx_route_args *a, const mx_tensor *logits,
                       const mx_tensor *bias)
{
    if (check_routing_inputs(a, logits, bias) < 0)
        return NULL;
    int64_t shape[2] = {logits->shape[0], a->top_k};
    mx_tensor wv, iv;
    PyObject *weights = mx_new_tensor(st, MX_F32, 2, shape, logits->device_type,
                                      logits->device_id, &wv);
    PyObject *ids = weights ? mx_new_tensor(st, MX_I32, 2, shape, logits->device_type,
                                            logits->device_id, &iv) : NULL;
    if (!ids)
        goto error;
    if (shape[0] > 0) {
        mx_device_scope scope;
        if (mx_enter_device(st, logits, &scope) < 0)
            goto error;
        mx_routing_problem p;
        fill_routing_problem(&p, a, logits, bias, wv.data, iv.data);
        mx_status status = route_on(logits, &p, scope.stream);
        mx_leave_device(&scope);
        if (status.code != MX_OK) {
            mx_raise_status(&status);
            goto error;
        }
    }
    PyObject *result = PyTuple_Pack(2, weights, ids);
    Py_DECREF(weights);
    Py_DECREF(ids);
    return result;
error:
    Py_XDECREF(weights);
    Py_XDECREF(ids);
    return NULL;
}

/* Checks weights, biases and expert_map against x; fills the size fields of p. */
static int64_t blocks_of(int64_t n)
{
    return (n + MX_FP8_BLOCK - 1) / MX_FP8_BLOCK;
}

/* Checks the FP8 weight scales of an FP8 layer. */
static int check_fp8_scales(const mx_experts_args *a, const mx_moe_views *v, int64_t experts,
                            int64_t n1, int64_t hidden, int64_t inter)
{
    const char *names[2] = {"w13_scale", "w2_scale"};
    const mx_tensor *scales[2] = {&v->w13_scale, &v->w2_scale};
    int64_t tensor_shape[1] = {experts};
    int64_t block_shapes[2][3] = {{experts, blocks_of(n1), blocks_of(hidden)},
                                  {experts, blocks_of(hidden), blocks_of(inter)}};
    for (int i = 0; i < 2; i++) {
        if (!scales[i]->data) {
            PyErr_Format(PyExc_ValueError, "%s: required for an FP8 layer", names[i]);
            return -1;
        }
        int rc = a->quant == MX_QUANT_FP8_TENSOR
                     ? mx_check_shape(scales[i], names[i], 1, tensor_shape)
                     : mx_check_shape(scales[i], names[i], 3, block_shapes[i]);
        if (rc < 0 || mx_check_dtype_is(scales[i], names[i], MX_F32) < 0 ||
            mx_check_contiguous(scales[i], names[i]) < 0 ||
            mx_check_same_device(scales[i], names[i], &v->x, "hidden_states") < 0)
            return -1;
    }
    if (v->x.dtype == MX_F32) {
        PyErr_SetString(PyExc_TypeError, "hidden_states: FP8 layers take float16 or bfloat16 "
                        "activations, got float32");
        return -1;
    }
    return 0;
}

/* Packed weights (abi.h weights_packed): whole 64-row blocks and 128-byte
 * k slices (w13 [E, n1, H], w2 [E, H, I] of weight_bytes elements),
 * 16-bit activations. */
static int check_packed_shapes(const mx_tensor *x, int64_t weight_bytes, int64_t n1, int64_t hidden,
                               int64_t inter)
{
    if (x->dtype != MX_BF16 && x->dtype != MX_F16) {
        PyErr_SetString(PyExc_TypeError, "hidden_states: packed expert weights take float16 or "
                        "bfloat16 activations");
        return -1;
    }
    if (n1 % 64 || hidden % 64 || (hidden * weight_bytes) % 128 || (inter * weight_bytes) % 128) {
        PyErr_Format(PyExc_ValueError, "w13, w2: the packed layout needs weight rows in multiples of "
                     "64 and rows of multiples of 128 bytes (w13 [%lld, %lld], w2 [%lld, %lld])",
                     (long long)n1, (long long)hidden, (long long)hidden, (long long)inter);
        return -1;
    }
    return 0;
}

static int check_expert_inputs(const mx_experts_args *a, const mx_moe_views *v,
                               mx_experts_problem *p)
{
    const mx_tensor *x = &v->x, *w13 = &v->w13, *w2 = &v->w2, *w13_bias = &v->w13_bias,
                    *w2_bias = &v->w2_bias, *expert_map = &v->expert_map;
    mx_dtype weight_dtype = a->quant == MX_QUANT_NONE ? x->dtype : MX_F8E4M3;
    const int64_t any2[2] = {-1, -1}, any3[3] = {-1, -1, -1};
    if (mx_check_dtype_in(x, "hidden_states", float_dtypes, 3) < 0 ||
        mx_check_shape(x, "hidden_states", 2, any2) < 0 ||
        mx_check_contiguous(x, "hidden_states") < 0)
        return -1;
    if (mx_check_shape(w2, "w2", 3, any3) < 0)
        return -1;
    int64_t hidden = x->shape[1], experts = w2->shape[0], inter = w2->shape[2];
    if (a->intermediate_size > 0 && inter != a->intermediate_size) {
        const int64_t want[3] = {-1, hidden, a->intermediate_size};
        return mx_check_shape(w2, "w2", 3, want);
    }
    int64_t n1 = a->is_act_and_mul ? 2 * inter : inter;
    const int64_t w13_want[3] = {experts, n1, hidden}, w2_want[3] = {experts, hidden, inter};
    if (mx_check_dtype_is(w13, "w13", weight_dtype) < 0 ||
        mx_check_shape(w13, "w13", 3, w13_want) < 0 || mx_check_contiguous(w13, "w13") < 0 ||
        mx_check_same_device(w13, "w13", x, "hidden_states") < 0 ||
        mx_check_dtype_is(w2, "w2", weight_dtype) < 0 || mx_check_shape(w2, "w2", 3, w2_want) < 0 ||
        mx_check_contiguous(w2, "w2") < 0 ||
        mx_check_same_device(w2, "w2", x, "hidden_states") < 0)
        return -1;
    if (a->quant != MX_QUANT_NONE && check_fp8_scales(a, v, experts, n1, hidden, inter) < 0)
        return -1;
    if (w13_bias->data) {
        const int64_t want[2] = {experts, n1};
        if (mx_check_dtype_is(w13_bias, "w13_bias", x->dtype) < 0 ||
            mx_check_shape(w13_bias, "w13_bias", 2, want) < 0 ||
            mx_check_contiguous(w13_bias, "w13_bias") < 0 ||
            mx_check_same_device(w13_bias, "w13_bias", x, "hidden_states") < 0)
            return -1;
    }
    if (w2_bias->data) {
        const int64_t want[2] = {experts, hidden};
        if (mx_check_dtype_is(w2_bias, "w2_bias", x->dtype) < 0 ||
            mx_check_shape(w2_bias, "w2_bias", 2, want) < 0 ||
            mx_check_contiguous(w2_bias, "w2_bias") < 0 ||
            mx_check_same_device(w2_bias, "w2_bias", x, "hidden_states") < 0)
            return -1;
    }
    int64_t global = a->global_num_experts > 0 ? a->global_num_experts : experts;
    if (expert_map->data) {
        const int64_t want[1] = {expert_map->ndim == 1 ? expert_map->shape[0] : -1};
        if (mx_check_dtype_is(expert_map, "expert_map", MX_I32) < 0 ||
            mx_check_shape(expert_map, "expert_map", 1, want) < 0 ||
            mx_check_contiguous(expert_map, "expert_map") < 0 ||
            mx_check_same_device(expert_map, "expert_map", x, "hidden_states") < 0)
            return -1;
        global = expert_map->shape[0];
    } else if (global != experts) {
        PyErr_Format(PyExc_ValueError, "expert_map: required when the %lld global experts differ "
                     "from the %lld local ones", (long long)global, (long long)experts);
        return -1;
    }
    if (a->activation == MX_ACT_SWIGLUOAI && !a->is_act_and_mul) {
        PyErr_SetString(PyExc_ValueError, "activation: 'swigluoai' is gated; it needs is_act_and_mul=True");
        return -1;
    }
    if (a->activation == MX_ACT_RELU2 && a->is_act_and_mul) {
        PyErr_SetString(PyExc_ValueError, "activation: 'relu2' is only supported non-gated "
                        "(is_act_and_mul=False)");
        return -1;
    }
    if (a->weights_packed &&
        check_packed_shapes(x, a->quant == MX_QUANT_NONE ? 2 : 1, n1, hidden, inter) < 0)
        return -1;
    memset(p, 0, sizeof *p);
    p->weights_packed = a->weights_packed;
    p->num_tokens = x->shape[0];
    p->hidden_size = hidden;
    p->intermediate_size = inter;
    p->num_local_experts = experts;
    p->global_num_experts = global;
    p->activation = a->activation;
    p->is_act_and_mul = a->is_act_and_mul;
    p->swiglu_alpha = a->swiglu_alpha;
    p->swiglu_limit = a->swiglu_limit;
    p->apply_router_weight_on_input = a->apply_router_weight_on_input;
    p->act_dtype = x->dtype;
    p->hidden_states = x->data;
    p->w13 = w13->data;
    p->w2 = w2->data;
    p->w13_bias = w13_bias->data;
    p->w2_bias = w2_bias->data;
    p->expert_map = expert_map->data;
    p->quant = a->quant;
    p->w13_scale = v->w13_scale.data;
    p->w2_scale = v->w2_scale.data;
    return 0;
}

static int check_topk(const mx_tensor *x, const mx_tensor *topk_weights, const mx_tensor *topk_ids)
{
    const int64_t want[2] = {x->shape[0], topk_ids->ndim == 2 ? topk_ids->shape[1] : -1};
    if (mx_check_dtype_is(topk_ids, "topk_ids", MX_I32) < 0 ||
        mx_check_shape(topk_ids, "topk_ids", 2, want) < 0 ||
        mx_check_contiguous(topk_ids, "topk_ids") < 0 ||
        mx_check_same_device(topk_ids, "topk_ids", x, "hidden_states") < 0 ||
        mx_check_dtype_is(topk_weights, "topk_weights", MX_F32) < 0 ||
        mx_check_shape(topk_weights, "topk_weights", 2, want) < 0 ||
        mx_check_contiguous(topk_weights, "topk_weights") < 0 ||
        mx_check_same_device(topk_weights, "topk_weights", x, "hidden_states") < 0)
        return -1;
    if (want[1] < 1) {
        PyErr_SetString(PyExc_ValueError, "topk_ids: expected at least one expert per token");
        return -1;
    }
    return 0;
}

PyObject *mx_run_moe(mx_module_state *st, const mx_route_args *ra, const mx_experts_args *ea,
                     const mx_moe_views *v)
{
    const mx_tensor *x = &v->x, *logits = &v->router_logits, *bias = &v->correction_bias,
                    *topk_weights = &v->topk_weights, *topk_ids = &v->topk_ids;
    mx_experts_problem p;
    if (check_expert_inputs(ea, v, &p) < 0)
        return NULL;
    int routed_here = topk_ids->data == NULL;
    int top_k;
    if (routed_here) {
        if (check_routing_inputs(ra, logits, bias) < 0 ||
            mx_check_same_device(logits, "router_logits", x, "hidden_states") < 0)
            return NULL;
        const int64_t want[2] = {x->shape[0], p.global_num_experts};
        if (mx_check_shape(logits, "router_logits", 2, want) < 0)
            return NULL;
        top_k = ra->top_k;
    } else {
        if (check_topk(x, topk_weights, topk_ids) < 0)
            return NULL;
        top_k = (int)topk_ids->shape[1];
    }
    if (ea->apply_router_weight_on_input && top_k != 1) {
        PyErr_Format(PyExc_ValueError, "apply_router_weight_on_input: only supported with top_k == 1, "
                     "got top_k = %d", top_k);
        return NULL;
    }
    p.top_k = top_k;

    int64_t out_shape[2] = {x->shape[0], x->shape[1]};
    mx_tensor out_view;
    PyObject *out = mx_new_tensor(st, x->dtype, 2, out_shape, x->device_type, x->device_id,
                                  &out_view);
    if (!out || x->shape[0] == 0)
        return out;
    p.output = out_view.data;

    size_t pairs = (size_t)x->shape[0] * (size_t)top_k;
    size_t routing_bytes = routed_here ? 2 * align_up(pairs * 4) : 0;
    size_t engine_bytes = experts_workspace_on(x, &p);
    int64_t ws_shape[1] = {(int64_t)(routing_bytes + align_up(engine_bytes) + WORKSPACE_ALIGN)};
    mx_tensor ws_view;
    PyObject *workspace = mx_new_tensor(st, MX_U8, 1, ws_shape, x->device_type, x->device_id,
                                        &ws_view);
    if (!workspace)
        goto error;
    char *ws = (char *)(((uintptr_t)ws_view.data + WORKSPACE_ALIGN - 1) &
                        ~(uintptr_t)(WORKSPACE_ALIGN - 1));

    mx_device_scope scope;
    if (mx_enter_device(st, x, &scope) < 0)
        goto error;
    mx_routing_problem rp;
    if (routed_here) { /* the engine routes first (the CUDA one fused with its sort) */
        float *weights = (float *)ws;
        int32_t *ids = (int32_t *)(ws + align_up(pairs * 4));
        fill_routing_problem(&rp, ra, logits, bias, weights, ids);
        p.routing = &rp;
        p.topk_weights = weights;
        p.topk_ids = ids;
    } else {
        p.topk_weights = topk_weights->data;
        p.topk_ids = topk_ids->data;
    }
    mx_status status = experts_on(x, &p, ws + routing_bytes, scope.stream);
    mx_leave_device(&scope);
    Py_DECREF(workspace); /* stream-ordered reuse in torch's caching allocator */
    workspace = NULL;
    if (status.code != MX_OK) {
        mx_raise_status(&status);
        goto error;
    }
    return out;
error:
    Py_XDECREF(workspace);
    Py_DECREF(out);
    return NULL;
}

int mx_import_views(mx_module_state *st, mx_imports *keep, PyObject *const *objs, int n,
                    int required, const size_t *fields, const char *const *names,
                    mx_moe_views *v)
{
    memset(v, 0, sizeof *v);
    for (int i = 0; i < n; i++) {
        mx_tensor *view = (mx_tensor *)((char *)v + fields[i]);
        int rc = i < required ? mx_import(st, keep, objs[i], names[i], view)
                              : mx_import_optional(st, keep, objs[i], names[i], view);
        if (rc < 0)
            return -1;
    }
    return 0;
}
