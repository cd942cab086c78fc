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
 *         swiglu_alpha=1.702, swiglu_limit=7.0, quant="none", w13_scale=None,
 *         w2_scale=None) -> output */
PyObject *mx_py_experts(PyObject *module, PyObject *args, PyObject *kwargs)
{
    static char *keywords[] = {
        "hidden_states", "w13", "w2", "topk_weights", "topk_ids", "activation",
        "is_act_and_mul", "w13_bias", "w2_bias", "expert_map", "global_num_experts",
        "apply_router_weight_on_input", "swiglu_alpha", "swiglu_limit", "quant", "w13_scale",
        "w2_scale", NULL,
    };
    static const char *const names[] = {
        "hidden_states", "w13", "w2", "topk_weights", "topk_ids", "w13_bias", "w2_bias",
        "expert_map", "w13_scale", "w2_scale",
    };
    static const size_t fields[] = {
        MX_VIEW(x), MX_VIEW(w13), MX_VIEW(w2), MX_VIEW(topk_weights), MX_VIEW(topk_ids),
        MX_VIEW(w13_bias), MX_VIEW(w2_bias), MX_VIEW(expert_map), MX_VIEW(w13_scale),
        MX_VIEW(w2_scale),
    };
    PyObject *objs[10] = {NULL}, *activation = NULL, *quant = NULL;
    long long global = -1;
    mx_experts_args a = {.is_act_and_mul = 1, .swiglu_alpha = 1.702f, .swiglu_limit = 7.0f};
    for (int i = 5; i < 10; i++)
        objs[i] = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOOOO|UpOOOLpffUOO", keywords, &objs[0],
                                     &objs[1], &objs[2], &objs[3], &objs[4], &activation,
                                     &a.is_act_and_mul, &objs[5], &objs[6], &objs[7], &global,
                                     &a.apply_router_weight_on_input, &a.swiglu_alpha,
                                     &a.swiglu_limit, &quant, &objs[8], &objs[9]))
        return NULL;
    a.global_num_experts = global;
    a.activation = MX_ACT_SILU;
    a.quant = MX_QUANT_NONE;
    if ((activation && mx_parse_activation(activation, &a.activation) < 0) ||
        (quant && mx_parse_quant(quant, &a.quant) < 0))
        return NULL;
    mx_module_state *st = mx_state(module);
    mx_imports keep = {0};
    mx_moe_views v;
    mx_route_args unused = {0};
    PyObject *result = NULL;
    if (mx_import_views(st, &keep, objs, 10, 5, fields, names, &v) == 0)
        result = mx_run_moe(st, &unused, &a, &v);
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
    mx_status status = {MX_OK, ""};
    if (mx_numel(&dst) > 0) {
        mx_device_scope scope;
        if (mx_enter_device(st, &dst, &scope) < 0)
            goto done;
#ifdef MOE_EXT_WITH_CUDA
        if (dst.device_type == MX_CUDA)
            status = mx_cuda_copy(&dst, &src, scope.stream);
        else
#endif
            status = mx_cpu_copy(&dst, &src);
        mx_leave_device(&scope);
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
