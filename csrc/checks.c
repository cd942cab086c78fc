/* Argument checks on imported views, and the one place where engine status
 * codes become Python exceptions. Every message names the argument. */
#include "glue.h"

#include <stdio.h>
#include <string.h>

int64_t mx_numel(const mx_tensor *t)
{
    int64_t n = 1;
    for (int i = 0; i < t->ndim; i++)
        n *= t->shape[i];
    return n;
}

int mx_is_contiguous(const mx_tensor *t)
{
    int64_t step = 1;
    for (int i = t->ndim - 1; i >= 0; i--) {
        if (t->shape[i] != 1 && t->strides[i] != step)
            return 0;
        step *= t->shape[i];
    }
    return 1;
}

static void format_shape(char *buf, size_t size, int ndim, const int64_t *shape)
{
    size_t used = (size_t)snprintf(buf, size, "[");
    for (int i = 0; i < ndim && used < size; i++) {
        if (shape[i] < 0)
            used += (size_t)snprintf(buf + used, size - used, "%s*", i ? ", " : "");
        else
            used += (size_t)snprintf(buf + used, size - used, "%s%lld", i ? ", " : "",
                                     (long long)shape[i]);
    }
    if (used < size)
        snprintf(buf + used, size - used, "]");
}

int mx_check_dtype_in(const mx_tensor *t, const char *name, const mx_dtype *allowed, int n)
{
    for (int i = 0; i < n; i++)
        if (t->dtype == allowed[i])
            return 0;
    char list[128] = "";
    size_t used = 0;
    for (int i = 0; i < n && used < sizeof list; i++)
        used += (size_t)snprintf(list + used, sizeof list - used, "%s%s", i ? ", " : "",
                                 mx_dtype_name(allowed[i]));
    PyErr_Format(PyExc_TypeError, "%s: expected dtype in (%s), got %s", name, list,
                 mx_dtype_name(t->dtype));
    return -1;
}

int mx_check_dtype_is(const mx_tensor *t, const char *name, mx_dtype expected)
{
    if (t->dtype == expected)
        return 0;
    PyErr_Format(PyExc_TypeError, "%s: expected dtype %s, got %s", name, mx_dtype_name(expected),
                 mx_dtype_name(t->dtype));
    return -1;
}

int mx_check_shape(const mx_tensor *t, const char *name, int ndim, const int64_t *expected)
{
    int ok = t->ndim == ndim;
    for (int i = 0; ok && i < ndim; i++)
        ok = expected[i] < 0 || expected[i] == t->shape[i];
    if (ok)
        return 0;
    char want[160], got[160];
    format_shape(want, sizeof want, ndim, expected);
    format_shape(got, sizeof got, t->ndim, t->shape);
    PyErr_Format(PyExc_ValueError, "%s: expected shape %s, got %s", name, want, got);
    return -1;
}

int mx_check_contiguous(const mx_tensor *t, const char *name)
{
    if (mx_is_contiguous(t))
        return 0;
    PyErr_Format(PyExc_ValueError, "%s: expected a contiguous tensor (call .contiguous())", name);
    return -1;
}

int mx_check_same_device(const mx_tensor *t, const char *name, const mx_tensor *ref,
                         const char *ref_name)
{
    if (t->device_type == ref->device_type &&
        (t->device_type == MX_CPU || t->device_id == ref->device_id))
        return 0;
    PyErr_Format(PyExc_ValueError, "%s: expected a tensor on the same device as %s (%s:%d), got %s:%d",
                 name, ref_name, ref->device_type == MX_CUDA ? "cuda" : "cpu", ref->device_id,
                 t->device_type == MX_CUDA ? "cuda" : "cpu", t->device_id);
    return -1;
}

PyObject *mx_raise_status(const mx_status *status)
{
    PyObject *kind;
    switch (status->code) {
    case MX_ERR_VALUE: kind = PyExc_ValueError; break;
    case MX_ERR_TYPE: kind = PyExc_TypeError; break;
    case MX_ERR_NOT_IMPLEMENTED: kind = PyExc_NotImplementedError; break;
    case MX_ERR_MEMORY: kind = PyExc_MemoryError; break;
    default: kind = PyExc_RuntimeError; break;
    }
    PyErr_SetString(kind, status->message[0] ? status->message : "moe_ext engine error");
    return NULL;
}

int mx_parse_activation(PyObject *name, mx_activation *out)
{
    static const struct { const char *name; mx_activation code; } table[] = {
        {"silu", MX_ACT_SILU}, {"gelu", MX_ACT_GELU}, {"swigluoai", MX_ACT_SWIGLUOAI},
        {"relu2", MX_ACT_RELU2},
    };
    const char *text = PyUnicode_Check(name) ? PyUnicode_AsUTF8AndSize(name, NULL) : NULL;
    for (size_t i = 0; text && i < sizeof table / sizeof table[0]; i++) {
        if (strcmp(text, table[i].name) == 0) {
            *out = table[i].code;
            return 0;
        }
    }
    PyErr_Format(PyExc_ValueError, "activation: expected one of 'silu', 'gelu', 'swigluoai', "
                 "'relu2', got %R", name);
    return -1;
}

int mx_parse_scoring(PyObject *name, mx_scoring *out)
{
    const char *text = PyUnicode_Check(name) ? PyUnicode_AsUTF8AndSize(name, NULL) : NULL;
    if (text && strcmp(text, "softmax") == 0) {
        *out = MX_SCORING_SOFTMAX;
        return 0;
    }
    if (text && strcmp(text, "sigmoid") == 0) {
        *out = MX_SCORING_SIGMOID;
        return 0;
    }
    PyErr_Format(PyExc_ValueError, "scoring_func: expected 'softmax' or 'sigmoid', got %R", name);
    return -1;
}

int mx_parse_quant(PyObject *name, mx_quant *out)
{
    static const struct { const char *name; mx_quant code; } table[] = {
        {"none", MX_QUANT_NONE}, {"fp8_tensor", MX_QUANT_FP8_TENSOR},
        {"fp8_block", MX_QUANT_FP8_BLOCK},
    };
    const char *text = PyUnicode_Check(name) ? PyUnicode_AsUTF8AndSize(name, NULL) : NULL;
    for (size_t i = 0; text && i < sizeof table / sizeof table[0]; i++) {
        if (strcmp(text, table[i].name) == 0) {
            *out = table[i].code;
            return 0;
        }
    }
    PyErr_Format(PyExc_ValueError, "quant: expected 'none', 'fp8_tensor' or 'fp8_block', got %R",
                 name);
    return -1;
}
