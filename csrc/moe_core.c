/* MoECore: the C type behind moe_ext.FusedMoE. It holds a layer's routing
 * and expert configuration; forward() is the layer's one C call per step.
 *
 * Python equivalent:
 *     class MoECore:
 *         def __init__(self, top_k, activation="silu", is_act_and_mul=True,
 *                      scoring_func="softmax", renormalize=True, num_expert_group=0,
 *                      topk_group=0, routed_scaling_factor=1.0,
 *                      apply_router_weight_on_input=False, swiglu_alpha=1.702,
 *                      swiglu_limit=7.0, intermediate_size=0, global_num_experts=0,
 *                      quant="none"): ...   # or "fp8_tensor" | "fp8_block"
 *         def forward(self, x, router_logits, w13, w2, w13_bias, w2_bias, w13_scale,
 *                     w2_scale, e_score_correction_bias, expert_map) -> out: ...
 *         def forward_routed(self, x, topk_weights, topk_ids, w13, w2, w13_bias,
 *                            w2_bias, w13_scale, w2_scale, expert_map) -> out: ...
 *         weights_packed: bool   # w13 / w2 in the Hopper packed layout (abi.h)
 */
#include "glue.h"

typedef struct {
    PyObject_HEAD
    mx_route_args route;
    mx_experts_args experts;
} MoECoreObject;

static int core_init(PyObject *self, PyObject *args, PyObject *kwargs)
{
    static char *keywords[] = {
        "top_k", "activation", "is_act_and_mul", "scoring_func", "renormalize",
        "num_expert_group", "topk_group", "routed_scaling_factor",
        "apply_router_weight_on_input", "swiglu_alpha", "swiglu_limit", "intermediate_size",
        "global_num_experts", "quant", NULL,
    };
    MoECoreObject *core = (MoECoreObject *)self;
    int top_k, is_act_and_mul = 1, renormalize = 1, groups = 0, topk_group = 0, on_input = 0;
    float scaling = 1.0f, alpha = 1.702f, limit = 7.0f;
    long long inter = 0, global = 0;
    PyObject *activation = NULL, *scoring = NULL, *quant = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "i|UpUpiifpffLLU", keywords, &top_k,
                                     &activation, &is_act_and_mul, &scoring, &renormalize,
                                     &groups, &topk_group, &scaling, &on_input, &alpha, &limit,
                                     &inter, &global, &quant))
        return -1;
    core->experts.activation = MX_ACT_SILU;
    core->route.scoring = MX_SCORING_SOFTMAX;
    core->experts.quant = MX_QUANT_NONE;
    core->experts.weights_packed = 0;
    if ((activation && mx_parse_activation(activation, &core->experts.activation) < 0) ||
        (scoring && mx_parse_scoring(scoring, &core->route.scoring) < 0) ||
        (quant && mx_parse_quant(quant, &core->experts.quant) < 0))
        return -1;
    if (top_k < 1) {
        PyErr_Format(PyExc_ValueError, "top_k: expected >= 1, got %d", top_k);
        return -1;
    }
    core->route.top_k = top_k;
    core->route.renormalize = renormalize;
    core->route.num_expert_group = groups;
    core->route.topk_group = topk_group;
    core->route.routed_scaling_factor = scaling;
    core->experts.is_act_and_mul = is_act_and_mul;
    core->experts.apply_router_weight_on_input = on_input;
    core->experts.swiglu_alpha = alpha;
    core->experts.swiglu_limit = limit;
    core->experts.intermediate_size = inter;
    core->experts.global_num_experts = global;
    return 0;
}

/* The tensor arguments of one MoECore method, in order. */
typedef struct core_signature {
    const char *what;             /* method name for errors */
    int required;                 /* leading arguments that must be tensors */
    const char *const names[10];  /* argument names for errors */
    const size_t fields[10];      /* where each lands in mx_moe_views */
} core_signature;

static PyObject *core_call(PyObject *self, PyObject *const *args, Py_ssize_t nargs,
                           const core_signature *sig)
{
    if (nargs != 10) {
        PyErr_Format(PyExc_TypeError, "MoECore.%s takes 10 arguments (%zd given)", sig->what,
                     nargs);
        return NULL;
    }
    MoECoreObject *core = (MoECoreObject *)self;
    mx_module_state *st = mx_state_by_type(Py_TYPE(self));
    mx_imports keep = {0};
    mx_moe_views v;
    PyObject *result = NULL;
    if (mx_import_views(st, &keep, args, 10, sig->required, sig->fields, sig->names, &v) == 0)
        result = mx_run_moe(st, &core->route, &core->experts, &v);
    mx_imports_release(&keep);
    return result;
}

/* forward(x, router_logits, w13, w2, w13_bias, w2_bias, w13_scale, w2_scale,
 *         e_score_correction_bias, expert_map) */
static PyObject *core_forward(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    static const core_signature sig = {
        "forward", 4,
        {"hidden_states", "router_logits", "w13", "w2", "w13_bias", "w2_bias", "w13_scale",
         "w2_scale", "e_score_correction_bias", "expert_map"},
        {MX_VIEW(x), MX_VIEW(router_logits), MX_VIEW(w13), MX_VIEW(w2), MX_VIEW(w13_bias),
         MX_VIEW(w2_bias), MX_VIEW(w13_scale), MX_VIEW(w2_scale), MX_VIEW(correction_bias),
         MX_VIEW(expert_map)},
    };
    return core_call(self, args, nargs, &sig);
}

/* forward_routed(x, topk_weights, topk_ids, w13, w2, w13_bias, w2_bias, w13_scale,
 *                w2_scale, expert_map) */
static PyObject *core_forward_routed(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    static const core_signature sig = {
        "forward_routed", 5,
        {"hidden_states", "topk_weights", "topk_ids", "w13", "w2", "w13_bias", "w2_bias",
         "w13_scale", "w2_scale", "expert_map"},
        {MX_VIEW(x), MX_VIEW(topk_weights), MX_VIEW(topk_ids), MX_VIEW(w13), MX_VIEW(w2),
         MX_VIEW(w13_bias), MX_VIEW(w2_bias), MX_VIEW(w13_scale), MX_VIEW(w2_scale),
         MX_VIEW(expert_map)},
    };
    return core_call(self, args, nargs, &sig);
}

PyObject *mx_core_run(mx_module_state *st, PyObject *core, const mx_moe_views *v)
{
    if (!PyObject_TypeCheck(core, st->core_type)) {
        PyErr_SetString(PyExc_TypeError, "layer._core: expected a moe_ext._C.MoECore");
        return NULL;
    }
    MoECoreObject *c = (MoECoreObject *)core;
    return mx_run_moe(st, &c->route, &c->experts, v);
}

static PyMethodDef core_methods[] = {
    {"forward", (PyCFunction)(void (*)(void))core_forward, METH_FASTCALL,
     "forward(x, router_logits, w13, w2, w13_bias, w2_bias, w13_scale, w2_scale, "
     "e_score_correction_bias, expert_map) -> output: routing and experts in one call."},
    {"forward_routed", (PyCFunction)(void (*)(void))core_forward_routed, METH_FASTCALL,
     "forward_routed(x, topk_weights, topk_ids, w13, w2, w13_bias, w2_bias, w13_scale, "
     "w2_scale, expert_map) -> output: the experts for routing computed elsewhere."},
    {NULL, NULL, 0, NULL},
};

static PyObject *core_get_packed(PyObject *self, void *closure)
{
    (void)closure;
    return PyBool_FromLong(((MoECoreObject *)self)->experts.weights_packed);
}

static int core_set_packed(PyObject *self, PyObject *value, void *closure)
{
    (void)closure;
    if (!value) {
        PyErr_SetString(PyExc_AttributeError, "weights_packed: cannot be deleted");
        return -1;
    }
    int packed = PyObject_IsTrue(value);
    if (packed < 0)
        return -1;
    ((MoECoreObject *)self)->experts.weights_packed = packed;
    return 0;
}

static PyGetSetDef core_getset[] = {
    {"weights_packed", core_get_packed, core_set_packed,
     "Whether forward's w13 / w2 hold the Hopper packed layout (abi.h weights_packed).", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyType_Slot core_slots[] = {
    {Py_tp_getset, core_getset},
    {Py_tp_doc, "Configuration and dispatch of one FusedMoE layer (moe_ext._C)."},
    {Py_tp_init, core_init},
    {Py_tp_dealloc, mx_heap_dealloc},
    {Py_tp_methods, core_methods},
    {Py_tp_new, PyType_GenericNew},
    {0, NULL},
};

static PyType_Spec core_spec = {
    .name = "moe_ext._C.MoECore",
    .basicsize = sizeof(MoECoreObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_IMMUTABLETYPE,
    .slots = core_slots,
};

int mx_setup_core_type(PyObject *module)
{
    PyObject *type = PyType_FromModuleAndSpec(module, &core_spec, NULL);
    if (!type)
        return -1;
    mx_state(module)->core_type = (PyTypeObject *)type;
    return PyModule_AddObjectRef(module, "MoECore", type);
}
