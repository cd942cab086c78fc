/* moe_ext._C: module definition, module state and the registration hook
 * through which moe_ext/__init__.py hands over torch's tensor type.
 *
 * Python equivalent:
 *     MoECore                      # csrc/moe_core.c
 *     Fp8PerTensorOnlineMoEMethod, Fp8PerBlockOnlineMoEMethod,
 *     Fp8PerTensorOnlineLinearMethod, Fp8PerBlockOnlineLinearMethod  # csrc/fp8_methods.c
 *     def fp8_quant(...), fp8_linear(...)                           # csrc/quant.c
 *     def route(...), experts(...), copy_(dst, src)   # csrc/functional.c
 *     def register_torch(tensor_type, empty, stream): ...
 *     def has_exchange_api() -> bool: ...
 *     def cuda_device_count() -> int: ...   # 0 in a CPU-only build
 *     def sm90_kernels(device_index) -> bool: ...   # the device runs the sm_90a kernels
 *     def _set_decode_fused(enabled) -> bool: ...   # the one-launch decode path
 *     def _set_sm90_down_splits(n) -> int: ...      # the persistent GEMM2's k slices
 *     def _sm90_down_split(units, slots, max_splits, k_blocks, align) -> (count, len)
 *     built_with_cuda: bool
 */
#include "glue.h"

static struct PyModuleDef module_def;

mx_module_state *mx_state(PyObject *module)
{
    return (mx_module_state *)PyModule_GetState(module);
}

mx_module_state *mx_state_by_type(PyTypeObject *type)
{
    return mx_state(PyType_GetModule(type));
}

void mx_heap_dealloc(PyObject *self)
{
    PyTypeObject *type = Py_TYPE(self);
    freefunc tp_free = (freefunc)PyType_GetSlot(type, Py_tp_free);
    tp_free(self);
    Py_DECREF(type); /* instances of heap types own a reference to their type */
}

/* register_torch(tensor_type, empty, stream, exchange_api=True): the exchange
 * table is looked up on tensor_type (unless exchange_api is false: then every
 * tensor takes the __dlpack__ path); empty(shape, dtype_name, device) and
 * stream(device_index) serve producers without one. */
static PyObject *register_torch(PyObject *module, PyObject *args)
{
    PyObject *tensor_type, *empty, *stream;
    int use_api = 1;
    if (!PyArg_ParseTuple(args, "OOO|p", &tensor_type, &empty, &stream, &use_api))
        return NULL;
    if (!PyType_Check(tensor_type)) {
        PyErr_SetString(PyExc_TypeError, "tensor_type: expected a type");
        return NULL;
    }
    mx_module_state *st = mx_state(module);
    const DLPackExchangeAPI *api = NULL;
    PyObject *capsule = use_api ? PyObject_GetAttrString(tensor_type, "__dlpack_c_exchange_api__")
                                : NULL;
    if (capsule) {
        api = PyCapsule_GetPointer(capsule, "dlpack_exchange_api");
        Py_DECREF(capsule);
        if (!api)
            return NULL;
        if (api->header.version.major != 1 || !api->dltensor_from_py_object_no_sync)
            api = NULL; /* an ABI we do not know: use the slow path */
    } else if (use_api) {
        PyErr_Clear();
    }
    Py_CLEAR(st->tensor_type);
    Py_CLEAR(st->fallback_empty);
    Py_CLEAR(st->fallback_stream);
    st->tensor_type = Py_NewRef(tensor_type);
    st->fallback_empty = Py_NewRef(empty);
    st->fallback_stream = Py_NewRef(stream);
    st->api = api;
    Py_RETURN_NONE;
}

static PyObject *has_exchange_api(PyObject *module, PyObject *unused)
{
    (void)unused;
    return PyBool_FromLong(mx_state(module)->api != NULL);
}

static PyObject *cuda_device_count(PyObject *module, PyObject *unused)
{
    (void)module;
    (void)unused;
#ifdef MOE_EXT_WITH_CUDA
    return PyLong_FromLong(mx_cuda_device_count());
#else
    return PyLong_FromLong(0);
#endif
}

static PyObject *sm90_kernels(PyObject *module, PyObject *arg)
{
    (void)module;
    const long device = PyLong_AsLong(arg);
    if (device == -1 && PyErr_Occurred())
        return NULL;
#ifdef MOE_EXT_WITH_CUDA
    if (device < 0 || device >= mx_cuda_device_count()) {
        PyErr_Format(PyExc_ValueError, "sm90_kernels: device_index %ld is not a CUDA device here", device);
        return NULL;
    }
    return PyBool_FromLong(mx_cuda_sm90_kernels((int)device));
#else
    Py_RETURN_FALSE;
#endif
}

static PyObject *set_decode_fused(PyObject *module, PyObject *arg)
{
    (void)module;
    const int enabled = PyObject_IsTrue(arg);
    if (enabled < 0)
        return NULL;
#ifdef MOE_EXT_WITH_CUDA
    return PyBool_FromLong(mx_cuda_set_decode_fused(enabled));
#else
    Py_RETURN_FALSE;
#endif
}

static PyObject *set_sm90_down_splits(PyObject *module, PyObject *arg)
{
    (void)module;
    const long n = PyLong_AsLong(arg);
    if (n == -1 && PyErr_Occurred())
        return NULL;
    if (n < 0 || n > 64) {
        PyErr_SetString(PyExc_ValueError, "n: expected 0 (the kernel picks) to 64");
        return NULL;
    }
#ifdef MOE_EXT_WITH_CUDA
    return PyLong_FromLong(mx_cuda_set_sm90_down_splits((int)n));
#else
    return PyLong_FromLong(0);
#endif
}

static PyObject *sm90_down_split(PyObject *module, PyObject *args)
{
    (void)module;
    long long units, slots;
    int max_splits, k_blocks, align;
    if (!PyArg_ParseTuple(args, "LLiii", &units, &slots, &max_splits, &k_blocks, &align))
        return NULL;
    if (k_blocks < 1 || align < 1 || max_splits < 1 || max_splits > 64 || units < 0 || slots < 1 ||
        units > (1 << 24) || slots > (1 << 24) || k_blocks > (1 << 24) || align > (1 << 24)) {
        PyErr_SetString(PyExc_ValueError, "need 1 <= k_blocks, align <= 2^24, 1 <= max_splits <= 64, "
                                          "0 <= units <= 2^24 and 1 <= slots <= 2^24");
        return NULL;
    }
#ifdef MOE_EXT_WITH_CUDA
    int count = 1, len = k_blocks;
    mx_cuda_sm90_down_split_rule((int)units, (int)slots, max_splits, k_blocks, align, &count, &len);
    return Py_BuildValue("(ii)", count, len);
#else
    PyErr_SetString(PyExc_NotImplementedError, "_sm90_down_split: built without CUDA");
    return NULL;
#endif
}

static PyMethodDef module_methods[] = {
    {"register_torch", register_torch, METH_VARARGS,
     "register_torch(tensor_type, empty, stream, exchange_api=True): hand over the tensor "
     "type and the fallbacks (exchange_api=False forces the __dlpack__ path)."},
    {"has_exchange_api", has_exchange_api, METH_NOARGS,
     "Whether tensors come in through the DLPack C exchange API (else __dlpack__)."},
    {"cuda_device_count", cuda_device_count, METH_NOARGS,
     "Number of CUDA devices the CUDA engine sees (0 without CUDA)."},
    {"sm90_kernels", sm90_kernels, METH_O,
     "sm90_kernels(device_index) -> bool: whether that CUDA device runs this build's sm_90a "
     "kernels, the only ones that read packed weights (False in a CPU-only build)."},
    {"_set_decode_fused", set_decode_fused, METH_O,
     "_set_decode_fused(enabled) -> previous: whether the CUDA engine may run a few-token forward "
     "as one launch (tests and benchmarks)."},
    {"_set_sm90_down_splits", set_sm90_down_splits, METH_O,
     "_set_sm90_down_splits(n) -> previous: 0 lets the persistent Hopper GEMM2 pick its k slices, "
     "n >= 1 makes it run exactly n where K allows (tests)."},
    {"_sm90_down_split", sm90_down_split, METH_VARARGS,
     "_sm90_down_split(units, slots, max_splits, k_blocks, align) -> (count, len): the slices the "
     "persistent Hopper GEMM2 picks (tests)."},
    {"route", (PyCFunction)(void (*)(void))mx_py_route, METH_VARARGS | METH_KEYWORDS,
     "route(router_logits, top_k, ...) -> (topk_weights float32, topk_ids int32)."},
    {"experts", (PyCFunction)(void (*)(void))mx_py_experts, METH_VARARGS | METH_KEYWORDS,
     "experts(hidden_states, w13, w2, topk_weights, topk_ids, ...) -> output."},
    {"copy_", (PyCFunction)(void (*)(void))mx_py_copy, METH_VARARGS | METH_KEYWORDS,
     "copy_(dst, src): elementwise copy with dtype conversion on one device."},
    {"fp8_quant", (PyCFunction)(void (*)(void))mx_py_fp8_quant, METH_VARARGS | METH_KEYWORDS,
     "fp8_quant(x, out, scale, mode, block_rows=128, block_cols=128, use_ue8m0=False, "
     "scale_given=False): FP8 quantization into out/scale (mode 0 tensor, 1 block, 2 group)."},
    {"fp8_linear", mx_py_fp8_linear, METH_VARARGS,
     "fp8_linear(x, weight, weight_scale, bias, quant) -> x @ weight.T (+ bias), w8a8."},
    {NULL, NULL, 0, NULL},
};

static int module_exec(PyObject *module)
{
    if (mx_setup_core_type(module) < 0 || mx_setup_fp8_method_types(module) < 0)
        return -1;
#ifdef MOE_EXT_WITH_CUDA
    return PyModule_AddObjectRef(module, "built_with_cuda", Py_True);
#else
    return PyModule_AddObjectRef(module, "built_with_cuda", Py_False);
#endif
}

static int module_traverse(PyObject *module, visitproc visit, void *arg)
{
    mx_module_state *st = mx_state(module);
    Py_VISIT(st->core_type);
    for (int i = 0; i < 4; i++)
        Py_VISIT(st->fp8_method_types[i]);
    Py_VISIT(st->tensor_type);
    Py_VISIT(st->fallback_empty);
    Py_VISIT(st->fallback_stream);
    return 0;
}

static int module_clear(PyObject *module)
{
    mx_module_state *st = mx_state(module);
    Py_CLEAR(st->core_type);
    for (int i = 0; i < 4; i++)
        Py_CLEAR(st->fp8_method_types[i]);
    Py_CLEAR(st->tensor_type);
    Py_CLEAR(st->fallback_empty);
    Py_CLEAR(st->fallback_stream);
    st->api = NULL;
    return 0;
}

static void module_free(void *module)
{
    module_clear((PyObject *)module);
}

static PyModuleDef_Slot module_slots[] = {
    {Py_mod_exec, module_exec},
    {0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT,
    .m_name = "moe_ext._C",
    .m_doc = "moe_ext's C engine: FusedMoE dispatch over DLPack.",
    .m_size = sizeof(mx_module_state),
    .m_methods = module_methods,
    .m_slots = module_slots,
    .m_traverse = module_traverse,
    .m_clear = module_clear,
    .m_free = module_free,
};

PyMODINIT_FUNC PyInit__C(void)
{
    return PyModuleDef_Init(&module_def);
}
