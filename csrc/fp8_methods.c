/* The online FP8 quantization methods (vLLM seeds 000 and 002) as C types:
 * Fp8PerTensorOnlineMoEMethod, Fp8PerBlockOnlineMoEMethod,
 * Fp8PerTensorOnlineLinearMethod, Fp8PerBlockOnlineLinearMethod.
 *
 * The forward (`apply`) runs here in C on the layer's quantized parameters;
 * the loading orchestration (meta parameters, materialize on first write,
 * quantize per expert as soon as its weights have arrived, in-place reload)
 * lives in moe_ext/fp8_online.py, which create_weights and
 * process_weights_after_loading call.
 *
 * Python equivalent:
 *     class Fp8PerBlockOnlineMoEMethod:
 *         supports_eplb = True; uses_meta_device = True
 *         weight_block_size = [128, 128]          # None for the per-tensor ones
 *         def __init__(self, *, layer=None): ...
 *         def create_weights(self, layer, *args, **kwargs):
 *             return fp8_online.create_weights(self, layer, *args, **kwargs)
 *         def process_weights_after_loading(self, layer):
 *             return fp8_online.process_weights_after_loading(self, layer)
 *         def get_fused_moe_quant_config(self, layer) -> dict: ...
 *         def apply(self, layer, x, topk_weights, topk_ids, shared_experts_input=None): ...
 *     # the Linear methods: apply(self, layer, x, bias=None)
 */
#include "glue.h"

typedef struct {
    PyObject_HEAD
    int block; /* 128x128 blocks (1) or per tensor (0) */
    int linear; /* for moe_ext.Linear (1) or FusedMoE (0) */
} Fp8MethodObject;

typedef struct {
    const char *name;
    int block;
    int linear;
} method_kind;

static const method_kind kinds[4] = {
    {"moe_ext._C.Fp8PerTensorOnlineMoEMethod", 0, 0},
    {"moe_ext._C.Fp8PerBlockOnlineMoEMethod", 1, 0},
    {"moe_ext._C.Fp8PerTensorOnlineLinearMethod", 0, 1},
    {"moe_ext._C.Fp8PerBlockOnlineLinearMethod", 1, 1},
};

static int method_init(PyObject *self, PyObject *args, PyObject *kwargs)
{
    static char *keywords[] = {"layer", NULL};
    PyObject *layer = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "|$O", keywords, &layer))
        return -1;
    Fp8MethodObject *m = (Fp8MethodObject *)self;
    mx_module_state *st = mx_state_by_type(Py_TYPE(self));
    for (int i = 0; i < 4; i++) {
        if (PyObject_TypeCheck(self, st->fp8_method_types[i])) {
            m->block = kinds[i].block;
            m->linear = kinds[i].linear;
        }
    }
    return 0;
}

/* Calls moe_ext.fp8_online.<name>(self, *args, **kwargs). */
static PyObject *call_online(PyObject *self, const char *name, PyObject *args, PyObject *kwargs)
{
    PyObject *module = PyImport_ImportModule("moe_ext.fp8_online");
    if (!module)
        return NULL;
    PyObject *func = PyObject_GetAttrString(module, name);
    Py_DECREF(module);
    if (!func)
        return NULL;
    Py_ssize_t n = PyTuple_Size(args);
    PyObject *full = PyTuple_New(n + 1);
    if (!full) {
        Py_DECREF(func);
        return NULL;
    }
    PyTuple_SetItem(full, 0, Py_NewRef(self));
    for (Py_ssize_t i = 0; i < n; i++)
        PyTuple_SetItem(full, i + 1, Py_NewRef(PyTuple_GetItem(args, i)));
    PyObject *result = PyObject_Call(func, full, kwargs);
    Py_DECREF(full);
    Py_DECREF(func);
    return result;
}

static PyObject *method_create_weights(PyObject *self, PyObject *args, PyObject *kwargs)
{
    return call_online(self, "create_weights", args, kwargs);
}

static PyObject *method_process(PyObject *self, PyObject *args, PyObject *kwargs)
{
    return call_online(self, "process_weights_after_loading", args, kwargs);
}

static const char *scale_name(const Fp8MethodObject *m, int w2)
{
    if (m->linear)
        return m->block ? "weight_scale_inv" : "weight_scale";
    if (m->block)
        return w2 ? "w2_weight_scale_inv" : "w13_weight_scale_inv";
    return w2 ? "w2_weight_scale" : "w13_weight_scale";
}

/* Attribute or None (missing attributes read as None). New reference. */
static PyObject *attr_or_none(PyObject *obj, const char *name)
{
    PyObject *value = PyObject_GetAttrString(obj, name);
    if (!value && PyErr_ExceptionMatches(PyExc_AttributeError)) {
        PyErr_Clear();
        value = Py_NewRef(Py_None);
    }
    return value;
}

static int check_ready(PyObject *layer)
{
    PyObject *ready = attr_or_none(layer, "_fp8_ready");
    if (!ready)
        return -1;
    int ok = PyObject_IsTrue(ready);
    Py_DECREF(ready);
    if (ok == 1)
        return 0;
    if (ok == 0)
        PyErr_SetString(PyExc_RuntimeError, "layer: the FP8 layer is not fully loaded yet "
                        "(some experts' w1/w2/w3 have not arrived through weight_loader)");
    return -1;
}

/* MoE: apply(layer, x, topk_weights, topk_ids, shared_experts_input=None) */
static PyObject *apply_moe(Fp8MethodObject *m, PyObject *args, PyObject *kwargs)
{
    static char *keywords[] = {"layer", "x", "topk_weights", "topk_ids", "shared_experts_input",
                               NULL};
    PyObject *layer, *x, *weights, *ids, *shared = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOOO|O", keywords, &layer, &x, &weights, &ids,
                                     &shared))
        return NULL;
    if (check_ready(layer) < 0)
        return NULL;
    static const char *const names[] = {
        "x", "topk_weights", "topk_ids", "w13_weight", "w2_weight", "w13_bias", "w2_bias",
        "w13_scale", "w2_scale", "expert_map",
    };
    static const size_t fields[] = {
        MX_VIEW(x), MX_VIEW(topk_weights), MX_VIEW(topk_ids), MX_VIEW(w13), MX_VIEW(w2),
        MX_VIEW(w13_bias), MX_VIEW(w2_bias), MX_VIEW(w13_scale), MX_VIEW(w2_scale),
        MX_VIEW(expert_map),
    };
    const char *attrs[] = {"w13_weight", "w2_weight", "w13_bias", "w2_bias",
                           scale_name(m, 0), scale_name(m, 1), "_expert_map"};
    PyObject *objs[10] = {x, weights, ids};
    PyObject *core = PyObject_GetAttrString(layer, "_core");
    PyObject *result = NULL;
    int fetched = 0;
    mx_imports keep = {0};
    for (; core && fetched < 7; fetched++)
        if (!(objs[3 + fetched] = attr_or_none(layer, attrs[fetched])))
            goto done;
    mx_module_state *st = mx_state_by_type(Py_TYPE((PyObject *)m));
    mx_moe_views v;
    if (core && mx_import_views(st, &keep, objs, 10, 5, fields, names, &v) == 0)
        result = mx_core_run(st, core, &v);
done:
    mx_imports_release(&keep);
    for (int i = 0; i < fetched; i++)
        Py_XDECREF(objs[3 + i]);
    Py_XDECREF(core);
    return result;
}

/* Linear: apply(layer, x, bias=None) */
static PyObject *apply_linear(Fp8MethodObject *m, PyObject *args, PyObject *kwargs)
{
    static char *keywords[] = {"layer", "x", "bias", NULL};
    PyObject *layer, *x, *bias = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OO|O", keywords, &layer, &x, &bias))
        return NULL;
    if (check_ready(layer) < 0)
        return NULL;
    PyObject *weight = PyObject_GetAttrString(layer, "weight");
    PyObject *scale = weight ? PyObject_GetAttrString(layer, scale_name(m, 0)) : NULL;
    PyObject *result = NULL;
    if (scale) {
        PyObject *call_args = Py_BuildValue("(OOOOs)", x, weight, scale, bias,
                                            m->block ? "fp8_block" : "fp8_tensor");
        PyObject *module = PyType_GetModule(Py_TYPE((PyObject *)m));
        if (call_args)
            result = mx_py_fp8_linear(module, call_args);
        Py_XDECREF(call_args);
    }
    Py_XDECREF(scale);
    Py_XDECREF(weight);
    return result;
}

static PyObject *method_apply(PyObject *self, PyObject *args, PyObject *kwargs)
{
    Fp8MethodObject *m = (Fp8MethodObject *)self;
    return m->linear ? apply_linear(m, args, kwargs) : apply_moe(m, args, kwargs);
}

/* get_fused_moe_quant_config(layer) -> dict of the FP8 layout the kernels read. */
static PyObject *method_quant_config(PyObject *self, PyObject *layer)
{
    Fp8MethodObject *m = (Fp8MethodObject *)self;
    PyObject *w1 = attr_or_none(layer, scale_name(m, 0));
    PyObject *w2 = w1 ? attr_or_none(layer, scale_name(m, 1)) : NULL;
    PyObject *b1 = w2 ? attr_or_none(layer, "w13_bias") : NULL;
    PyObject *b2 = b1 ? attr_or_none(layer, "w2_bias") : NULL;
    PyObject *result = NULL;
    if (b2) {
        PyObject *block = m->block ? Py_BuildValue("[ii]", MX_FP8_BLOCK, MX_FP8_BLOCK)
                                   : Py_NewRef(Py_None);
        if (block)
            result = Py_BuildValue(
                "{s:s,s:O,s:O,s:O,s:O,s:O,s:O,s:O,s:s}", "quant_dtype", "float8_e4m3fn",
                "block_shape", block, "per_act_token_quant", Py_False, "w1_scale", w1,
                "w2_scale", w2, "a1_scale", Py_None, "a2_scale", Py_None, "w1_bias", b1,
                "activation_quant", m->block ? "dynamic_per_token_group_128" : "dynamic_per_tensor");
        Py_XDECREF(block);
        if (result && PyDict_SetItemString(result, "w2_bias", b2) < 0)
            Py_CLEAR(result);
    }
    Py_XDECREF(w1);
    Py_XDECREF(w2);
    Py_XDECREF(b1);
    Py_XDECREF(b2);
    return result;
}

static PyObject *get_true(PyObject *self, void *closure)
{
    (void)self;
    (void)closure;
    Py_RETURN_TRUE;
}

static PyObject *get_block_size(PyObject *self, void *closure)
{
    (void)closure;
    if (((Fp8MethodObject *)self)->block)
        return Py_BuildValue("[ii]", MX_FP8_BLOCK, MX_FP8_BLOCK);
    Py_RETURN_NONE;
}

static PyObject *get_block_quant(PyObject *self, void *closure)
{
    (void)closure;
    return PyBool_FromLong(((Fp8MethodObject *)self)->block);
}

static PyGetSetDef method_getset[] = {
    {"supports_eplb", get_true, NULL, "True, as in vLLM (the load balancer itself is not built).",
     NULL},
    {"uses_meta_device", get_true, NULL, "Full-precision weights start on the meta device.", NULL},
    {"weight_block_size", get_block_size, NULL, "[128, 128] for block methods, else None.", NULL},
    {"block_quant", get_block_quant, NULL, "Whether weights use 128x128 block scales.", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyMethodDef method_methods[] = {
    {"create_weights", (PyCFunction)(void (*)(void))method_create_weights,
     METH_VARARGS | METH_KEYWORDS, "Registers the layer's parameters on the meta device."},
    {"process_weights_after_loading", (PyCFunction)(void (*)(void))method_process,
     METH_VARARGS | METH_KEYWORDS,
     "No-op once every weight has arrived (quantization happens while loading)."},
    {"apply", (PyCFunction)(void (*)(void))method_apply, METH_VARARGS | METH_KEYWORDS,
     "MoE: apply(layer, x, topk_weights, topk_ids, shared_experts_input=None); "
     "Linear: apply(layer, x, bias=None)."},
    {"get_fused_moe_quant_config", method_quant_config, METH_O,
     "The FP8 layout (scales, block shape, activation quantization) as a dict."},
    {NULL, NULL, 0, NULL},
};

static PyType_Slot method_slots[] = {
    {Py_tp_doc, "An online FP8 quantization method (moe_ext._C)."},
    {Py_tp_init, method_init},
    {Py_tp_dealloc, mx_heap_dealloc},
    {Py_tp_methods, method_methods},
    {Py_tp_getset, method_getset},
    {Py_tp_new, PyType_GenericNew},
    {0, NULL},
};

int mx_setup_fp8_method_types(PyObject *module)
{
    mx_module_state *st = mx_state(module);
    for (int i = 0; i < 4; i++) {
        PyType_Spec spec = {
            .name = kinds[i].name,
            .basicsize = sizeof(Fp8MethodObject),
            .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_IMMUTABLETYPE,
            .slots = method_slots,
        };
        PyObject *type = PyType_FromModuleAndSpec(module, &spec, NULL);
        if (!type)
            return -1;
        st->fp8_method_types[i] = (PyTypeObject *)type;
        if (PyModule_AddObjectRef(module, kinds[i].name + sizeof "moe_ext._C." - 1, type) < 0)
            return -1;
    }
    return 0;
}
