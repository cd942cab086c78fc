/* Module-level functions of moe_ext._C: route (select_experts / fused_topk /
 * grouped_topk), experts (fused_experts) and copy_ (the weight loader's
 * copy). moe_ext/functional.py and moe_ext/layer.py are their callers. */
#include "glue.h"

/* route(router_logits, top_k, scoring_func="softmax", renormalize=True,
 *       num_expert_group=0, topk_group=0, routed_scaling_factor=1.0,
 *       e_score_correction_bias=None) -> (topk_weights, topk_ids) */
PyObject *mx_py_route(PyObject *module, PyObject *args, PyObject *kwargs)
{
    static char *keywords[] = {
        "router_logits", "top_k", "scoring_func", "renormalize", "num_expert_group",
        "topk_group", "routed_scaling_factor", "e_score_correction_bias", NULL,
    };
    PyObject *logits_obj, *scoring = NULL, *bias_obj = Py_None;
    mx_route_args a = {.renormalize = 1, .routed_scaling_factor = 1.0f};
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "Oi|UpiifO", keywords, &logits_obj, &a.top_k,
                                     &scoring, &a.renormalize, &a.num_expert_group, &a.topk_group,
                                     &a.routed_scaling_factor, &bias_obj))
        return NULL;
    a.scoring = MX_SCORING_SOFTMAX;
    if (scoring && mx_parse_scoring(scoring, &a.scoring) < 0)
        return NULL;
    mx_module_state *st = mx_state(module);
    mx_imports keep = {0};
    mx_tensor logits, bias;
    PyObject *result = NULL;
    if (mx_import(st, &keep, logits_obj, "router_logits", &logits) < 0 ||
        mx_import_optional(st, &keep, bias_obj, "e_score_correction_bias", &bias) < 0)
        goto done;
    result = mx_run_route(st, &a, &logits, &bias);
done:
    mx_imports_release(&keep);
    return result;
}

/* experts(hidden_states, w13, w2, topk_weights, topk_ids, activation="silu",
 *         is_act_and_mul=True, w13_bias=None, w2_bias=None, expert_map=None,
 *         global_num_experts=-1, apply_router_weight_on_input=False,
 *         swiglu_alpha=1.702, swiglu_limit=7.0) -> output */
PyObject *mx_py_experts(PyObject *module, PyObject *args, PyObject *kwargs)
{
    static char *keywords[] = {
        "hidden_states", "w13", "w2", "topk_weights", "topk_ids", "activation",
        "is_act_and_mul", "w13_bias", "w2_bias", "expert_map", "global_num_experts",
        "apply_router_weight_on_input", "swiglu_alpha", "swiglu_limit", NULL,
    };
    PyObject *objs[5], *activation = NULL;
    PyObject *w13_bias_obj = Py_None, *w2_bias_obj = Py_None, *map_obj = Py_None;
    long long global = -1;
    mx_experts_args a = {.is_act_and_mul = 1, .swiglu_alpha = 1.702f, .swiglu_limit = 7.0f};
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOOOO|UpOOOLpff", keywords, &objs[0],
                                     &objs[1], &objs[2], &objs[3], &objs[4], &activation,
                                     &a.is_act_and_mul, &w13_bias_obj, &w2_bias_obj, &map_obj,
                                     &global, &a.apply_router_weight_on_input, &a.swiglu_alpha,
                                     &a.swiglu_limit))
        return NULL;
    a.global_num_experts = global;
    a.activation = MX_ACT_SILU;
    if (activation && mx_parse_activation(activation, &a.activation) < 0)
        return NULL;
    static const char *const names[] = {"hidden_states", "w13", "w2", "topk_weights", "topk_ids"};
    mx_module_state *st = mx_state(module);
    mx_imports keep = {0};
    mx_tensor v[5], w13_bias, w2_bias, expert_map, none = {0};
    mx_route_args unused = {0};
    PyObject *result = NULL;
    for (int i = 0; i < 5; i++)
        if (mx_import(st, &keep, objs[i], names[i], &v[i]) < 0)
            goto done;
    if (mx_import_optional(st, &keep, w13_bias_obj, "w13_bias", &w13_bias) < 0 ||
        mx_import_optional(st, &keep, w2_bias_obj, "w2_bias", &w2_bias) < 0 ||
        mx_import_optional(st, &keep, map_obj, "expert_map", &expert_map) < 0)
        goto done;
    result = mx_run_moe(st, &unused, &a, &v[0], &none, &none, &v[3], &v[4], &v[1], &v[2],
                        &w13_bias, &w2_bias, &expert_map);
done:
    mx_imports_release(&keep);
    return result;
}

/* copy_(dst, src): dst[...] = src[...] with dtype conversion; same device, equal shapes. */
PyObject *mx_py_copy(PyObject *module, PyObject *args, PyObject *kwargs)
{
    static char *keywords[] = {"dst", "src", NULL};
    PyObject *dst_obj, *src_obj;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OO", keywords, &dst_obj, &src_obj))
        return NULL;
    mx_module_state *st = mx_state(module);
    mx_imports keep = {0};
    mx_tensor dst, src;
    PyObject *result = NULL;
    if (mx_import(st, &keep, dst_obj, "dst", &dst) < 0 ||
        mx_import(st, &keep, src_obj, "src", &src) < 0 ||
        mx_check_same_device(&src, "src", &dst, "dst") < 0)
        goto done;
    if (mx_check_shape(&src, "src", dst.ndim, dst.shape) < 0)
        goto done;
    mx_status status;
    if (mx_numel(&dst) == 0) {
        status.code = MX_OK;
    } else if (dst.device_type == MX_CUDA) {
#ifdef MOE_EXT_WITH_CUDA
        int previous;
        void *stream;
        status = mx_cuda_swap_device(dst.device_id, &previous);
        if (status.code == MX_OK) {
            if (mx_current_stream(st, dst.device_id, &stream) < 0) {
                mx_cuda_swap_device(previous, &previous);
                goto done;
            }
            status = mx_cuda_copy(&dst, &src, stream);
            mx_cuda_swap_device(previous, &previous);
        }
#else
        PyErr_SetString(PyExc_NotImplementedError, "dst: this moe_ext build has no CUDA engine");
        goto done;
#endif
    } else {
        status = mx_cpu_copy(&dst, &src);
    }
    if (status.code != MX_OK) {
        mx_raise_status(&status);
        goto done;
    }
    result = Py_NewRef(Py_None);
done:
    mx_imports_release(&keep);
    return result;
}
