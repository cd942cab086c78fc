/* The DLPack bridge: torch tensors in as mx_tensor views, new tensors out.
 *
 * Fast path (torch >= 2.10): the DLPack 1.3 exchange table found on the
 * tensor type (`torch.Tensor.__dlpack_c_exchange_api__`): non-owning import
 * (`dltensor_from_py_object_no_sync`), allocation through torch's caching
 * allocator (`managed_tensor_allocator`) and torch's current stream
 * (`current_work_stream`). Slow path for older producers: `__dlpack__()`
 * capsules, and Python callables registered by moe_ext/_bridge.py for
 * allocation and the stream. */
#include "glue.h"

#include <string.h>

/* 0 => ok; -1 => unsupported. */
static int dtype_from_dl(DLDataType dl, mx_dtype *out)
{
    if (dl.lanes != 1)
        return -1;
    switch (dl.code) {
    case kDLFloat:
        if (dl.bits == 32) { *out = MX_F32; return 0; }
        if (dl.bits == 16) { *out = MX_F16; return 0; }
        if (dl.bits == 64) { *out = MX_F64; return 0; }
        return -1;
    case kDLBfloat:
        if (dl.bits == 16) { *out = MX_BF16; return 0; }
        return -1;
    case kDLInt:
        if (dl.bits == 32) { *out = MX_I32; return 0; }
        if (dl.bits == 64) { *out = MX_I64; return 0; }
        if (dl.bits == 8) { *out = MX_I8; return 0; }
        return -1;
    case kDLUInt:
        if (dl.bits == 8) { *out = MX_U8; return 0; }
        return -1;
    case kDLBool:
        *out = MX_BOOL;
        return 0;
    case kDLFloat8_e4m3fn:
        *out = MX_F8E4M3;
        return 0;
    default:
        return -1;
    }
}

static DLDataType dtype_to_dl(mx_dtype dtype)
{
    static const uint8_t codes[] = {
        [MX_F32] = kDLFloat, [MX_F16] = kDLFloat, [MX_BF16] = kDLBfloat,
        [MX_F64] = kDLFloat, [MX_I32] = kDLInt,   [MX_I64] = kDLInt,
        [MX_U8] = kDLUInt,   [MX_I8] = kDLInt,    [MX_F8E4M3] = kDLFloat8_e4m3fn,
        [MX_BOOL] = kDLBool,
    };
    DLDataType dl = {codes[dtype], (uint8_t)(8 * mx_dtype_size(dtype)), 1};
    return dl;
}

/* 0 => ok; -1 => error set. */
static int view_from_dl(const DLTensor *dl, const char *name, mx_tensor *out)
{
    if (dl->ndim < 0 || dl->ndim > MX_MAX_DIMS) {
        PyErr_Format(PyExc_ValueError, "%s: tensors of %d dimensions are not supported (at most %d)",
                     name, (int)dl->ndim, MX_MAX_DIMS);
        return -1;
    }
    if (dtype_from_dl(dl->dtype, &out->dtype) < 0) {
        PyErr_Format(PyExc_TypeError, "%s: unsupported dtype (DLPack code %d, %d bits, %d lanes)",
                     name, dl->dtype.code, dl->dtype.bits, dl->dtype.lanes);
        return -1;
    }
    switch (dl->device.device_type) {
    case kDLCPU: case kDLCUDAHost:
        out->device_type = MX_CPU;
        break;
    case kDLCUDA: case kDLCUDAManaged:
        out->device_type = MX_CUDA;
        break;
    default:
        PyErr_Format(PyExc_ValueError, "%s: tensors on DLPack device type %d are not supported "
                     "(expected cpu or cuda)", name, (int)dl->device.device_type);
        return -1;
    }
    out->device_id = dl->device.device_id;
    out->ndim = dl->ndim;
    out->data = (char *)dl->data + dl->byte_offset;
    int64_t step = 1;
    for (int i = dl->ndim - 1; i >= 0; i--) {
        out->shape[i] = dl->shape[i];
        out->strides[i] = dl->strides ? dl->strides[i] : step;
        step *= dl->shape[i];
    }
    return 0;
}

/* Re-raises the pending exception as `kind` with the argument name in front. */
static void reraise_named(PyObject *kind, const char *name, const char *what)
{
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyObject *text = value ? PyObject_Str(value) : NULL;
    const char *msg = text ? PyUnicode_AsUTF8AndSize(text, NULL) : NULL;
    if (!msg)
        PyErr_Clear();
    /* Keep the first line: torch appends a C++ backtrace to its messages. */
    char detail[200] = "";
    if (msg) {
        size_t len = strcspn(msg, "\n");
        len = len < sizeof detail - 1 ? len : sizeof detail - 1;
        memcpy(detail, msg, len);
        detail[len] = '\0';
    }
    PyErr_Format(kind, "%s: %s (%s)", name, what, detail);
    Py_XDECREF(text);
    Py_XDECREF(type);
    Py_XDECREF(value);
    Py_XDECREF(tb);
}

static int import_fallback(mx_imports *keep, PyObject *obj, const char *name, mx_tensor *out)
{
    if (keep->count >= MX_MAX_KEPT) {
        PyErr_Format(PyExc_RuntimeError, "%s: too many tensors in one call", name);
        return -1;
    }
    PyObject *capsule = PyObject_CallMethod(obj, "__dlpack__", NULL);
    if (!capsule) {
        reraise_named(PyExc_ValueError, name, "cannot be read through DLPack");
        return -1;
    }
    DLManagedTensor *managed = PyCapsule_GetPointer(capsule, "dltensor");
    if (!managed) {
        Py_DECREF(capsule);
        reraise_named(PyExc_ValueError, name, "__dlpack__ returned no 'dltensor' capsule");
        return -1;
    }
    keep->kept[keep->count++] = capsule; /* its destructor runs the deleter */
    return view_from_dl(&managed->dl_tensor, name, out);
}

int mx_import(mx_module_state *st, mx_imports *keep, PyObject *obj, const char *name,
              mx_tensor *out)
{
    if (st->api && st->tensor_type && PyObject_TypeCheck(obj, (PyTypeObject *)st->tensor_type)) {
        DLTensor dl;
        if (st->api->dltensor_from_py_object_no_sync(obj, &dl) != 0) {
            reraise_named(PyExc_ValueError, name, "cannot be read through DLPack "
                          "(meta tensors hold no data)");
            return -1;
        }
        return view_from_dl(&dl, name, out);
    }
    if (!PyObject_HasAttrString(obj, "__dlpack__")) {
        PyObject *tname = PyObject_GetAttrString((PyObject *)Py_TYPE(obj), "__name__");
        PyErr_Format(PyExc_TypeError, "%s: expected a torch.Tensor, got %S", name,
                     tname ? tname : Py_None);
        Py_XDECREF(tname);
        return -1;
    }
    return import_fallback(keep, obj, name, out);
}

int mx_import_optional(mx_module_state *st, mx_imports *keep, PyObject *obj, const char *name,
                       mx_tensor *out)
{
    if (obj == NULL || obj == Py_None) {
        memset(out, 0, sizeof *out);
        return 0;
    }
    return mx_import(st, keep, obj, name, out);
}

void mx_imports_release(mx_imports *keep)
{
    for (int i = 0; i < keep->count; i++)
        Py_CLEAR(keep->kept[i]);
    keep->count = 0;
}

static void set_alloc_error(void *ctx, const char *kind, const char *message)
{
    (void)ctx;
    PyObject *exc = strcmp(kind, "MemoryError") == 0 ? PyExc_MemoryError : PyExc_RuntimeError;
    PyErr_Format(exc, "tensor allocation failed: %s", message);
}

static PyObject *new_tensor_fallback(mx_module_state *st, mx_dtype dtype, int ndim,
                                     const int64_t *shape, mx_device_type device_type,
                                     int device_id)
{
    if (!st->fallback_empty) {
        PyErr_SetString(PyExc_RuntimeError, "moe_ext: no tensor allocator registered "
                        "(import moe_ext, not moe_ext._C)");
        return NULL;
    }
    PyObject *dims = PyTuple_New(ndim);
    if (!dims)
        return NULL;
    for (int i = 0; i < ndim; i++)
        PyTuple_SetItem(dims, i, PyLong_FromLongLong(shape[i]));
    PyObject *result = device_type == MX_CUDA
        ? PyObject_CallFunction(st->fallback_empty, "Osi", dims, mx_dtype_name(dtype), device_id)
        : PyObject_CallFunction(st->fallback_empty, "Oss", dims, mx_dtype_name(dtype), "cpu");
    Py_DECREF(dims);
    return result;
}

PyObject *mx_new_tensor(mx_module_state *st, mx_dtype dtype, int ndim, const int64_t *shape,
                        mx_device_type device_type, int device_id, mx_tensor *view)
{
    PyObject *result;
    if (st->api) {
        int64_t dims[MX_MAX_DIMS];
        memcpy(dims, shape, sizeof(int64_t) * (size_t)ndim);
        DLTensor prototype = {
            .data = NULL,
            .device = {device_type == MX_CUDA ? kDLCUDA : kDLCPU, device_id},
            .ndim = ndim,
            .dtype = dtype_to_dl(dtype),
            .shape = dims,
            .strides = NULL,
            .byte_offset = 0,
        };
        DLManagedTensorVersioned *managed = NULL;
        if (st->api->managed_tensor_allocator(&prototype, &managed, NULL, set_alloc_error) != 0 ||
            !managed) {
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_MemoryError, "tensor allocation failed");
            return NULL;
        }
        void *object = NULL;
        if (st->api->managed_tensor_to_py_object_no_sync(managed, &object) != 0)
            return NULL;
        result = (PyObject *)object;
    } else {
        result = new_tensor_fallback(st, dtype, ndim, shape, device_type, device_id);
        if (!result)
            return NULL;
    }
    if (view) {
        mx_imports keep = {0};
        int rc = mx_import(st, &keep, result, "output", view);
        /* The fallback capsule may go: `result` keeps the storage alive. */
        mx_imports_release(&keep);
        if (rc < 0) {
            Py_DECREF(result);
            return NULL;
        }
    }
    return result;
}

int mx_current_stream(mx_module_state *st, int device_id, void **stream)
{
    if (st->api)
        return st->api->current_work_stream(kDLCUDA, device_id, stream);
    if (!st->fallback_stream) {
        PyErr_SetString(PyExc_RuntimeError, "moe_ext: no stream provider registered");
        return -1;
    }
    PyObject *handle = PyObject_CallFunction(st->fallback_stream, "i", device_id);
    if (!handle)
        return -1;
    *stream = PyLong_AsVoidPtr(handle);
    Py_DECREF(handle);
    return PyErr_Occurred() ? -1 : 0;
}
