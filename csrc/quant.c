/* FP8 entry points of moe_ext._C: fp8_quant (the three quantizers of
 * numerics.md, writing into tensors the caller allocated, so a reload can
 * re-quantize parameters in place) and fp8_linear (moe_ext.Linear's forward).
 * moe_ext/fp8.py is the caller. */
#include "glue.h"


static const mx_dtype half_dtypes[] = {MX_F16, MX_BF16};
static const mx_dtype float_dtypes[] = {MX_F32, MX_F16, MX_BF16};

static int64_t ceil_div(int64_t a, int64_t b)
{
    return (a + b - 1) / b;
}

/* One quantizer or linear call, run by run_on on the tensor's device. */
typedef struct quant_call {
    const mx_fp8_quant_problem *quant;
    const mx_fp8_linear_problem *linear;
    void *workspace;
} quant_call;

static size_t linear_workspace_on(const mx_tensor *where, const mx_fp8_linear_problem *p)
{
#ifdef MOE_EXT_WITH_CUDA
    if (where->device_type == MX_CUDA)
        return mx_cuda_fp8_linear_workspace_bytes(p);
#endif
    (void)where;
    return mx_cpu_fp8_linear_workspace_bytes(p);
}

/* 0 => ok; -1 => error set. */
static int run_on(mx_module_state *st, const mx_tensor *where, const quant_call *call)
{
    mx_device_scope scope;
    if (mx_enter_device(st, where, &scope) < 0)
        return -1;
    mx_status status;
#ifdef MOE_EXT_WITH_CUDA
    if (where->device_type == MX_CUDA)
        status = call->quant ? mx_cuda_fp8_quant(call->quant, scope.stream)
                             : mx_cuda_fp8_linear(call->linear, call->workspace, scope.stream);
    else
#endif
        status = call->quant ? mx_cpu_fp8_quant(call->quant)
                             : mx_cpu_fp8_linear(call->linear, call->workspace);
    mx_leave_device(&scope);
    if (status.code != MX_OK) {
        mx_raise_status(&status);
        return -1;
    }
    return 0;
}

/* Fills the sizes of p from x and the mode; checks q and scale. 0 => ok. */
static int plan_quant(mx_fp8_quant_problem *p, const mx_tensor *x, const mx_tensor *q,
                      const mx_tensor *scale)
{
    if (mx_check_dtype_in(x, "x", float_dtypes, 3) < 0 || mx_check_contiguous(x, "x") < 0 ||
        mx_check_dtype_is(q, "out", MX_F8E4M3) < 0 || mx_check_shape(q, "out", x->ndim, x->shape) < 0 ||
        mx_check_contiguous(q, "out") < 0 || mx_check_same_device(q, "out", x, "x") < 0 ||
        mx_check_dtype_is(scale, "scale", MX_F32) < 0 || mx_check_contiguous(scale, "scale") < 0 ||
        mx_check_same_device(scale, "scale", x, "x") < 0)
        return -1;
    int64_t numel = mx_numel(x), want;
    int64_t cols = x->ndim ? x->shape[x->ndim - 1] : 1;
    switch (p->mode) {
    case MX_FP8_PER_TENSOR:
        p->batch = mx_numel(scale);
        if (p->batch < 1 || numel % p->batch) {
            PyErr_Format(PyExc_ValueError, "scale: %lld scales do not split the %lld elements of x "
                         "into equal slices", (long long)p->batch, (long long)numel);
            return -1;
        }
        p->rows = 1;
        p->cols = numel / p->batch;
        return 0;
    case MX_FP8_PER_BLOCK:
        if (x->ndim < 2) {
            PyErr_Format(PyExc_ValueError, "x: per-block quantization needs >= 2 dimensions, got %d",
                         x->ndim);
            return -1;
        }
        p->rows = x->shape[x->ndim - 2];
        p->cols = cols;
        p->batch = p->rows * p->cols > 0 ? numel / (p->rows * p->cols) : 0;
        want = p->batch * ceil_div(p->rows, p->block_rows) * ceil_div(p->cols, p->block_cols);
        break;
    default:
        p->batch = 1;
        p->cols = cols;
        p->rows = cols ? numel / cols : 0;
        want = p->rows * ceil_div(p->cols, p->block_cols);
        break;
    }
    if (mx_numel(scale) != want) {
        PyErr_Format(PyExc_ValueError, "scale: expected %lld elements for x of this shape and "
                     "block size, got %lld", (long long)want, (long long)mx_numel(scale));
        return -1;
    }
    return 0;
}

/* fp8_quant(x, out, scale, mode, block_rows=128, block_cols=128, use_ue8m0=False,
 *           scale_given=False): mode 0 per tensor, 1 per block, 2 per token group. */
PyObject *mx_py_fp8_quant(PyObject *module, PyObject *args, PyObject *kwargs)
{
    static char *keywords[] = {
        "x", "out", "scale", "mode", "block_rows", "block_cols", "use_ue8m0", "scale_given", NULL,
    };
    PyObject *objs[3];
    int mode, block_rows = MX_FP8_BLOCK, block_cols = MX_FP8_BLOCK, ue8m0 = 0, given = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOOi|iipp", keywords, &objs[0], &objs[1],
                                     &objs[2], &mode, &block_rows, &block_cols, &ue8m0, &given))
        return NULL;
    if (mode < MX_FP8_PER_TENSOR || mode > MX_FP8_PER_TOKEN_GROUP || block_rows < 1 ||
        block_cols < 1) {
        PyErr_Format(PyExc_ValueError, "mode/block: expected mode in 0..2 and positive blocks, got "
                     "%d, %d x %d", mode, block_rows, block_cols);
        return NULL;
    }
    mx_module_state *st = mx_state(module);
    mx_imports keep = {0};
    mx_tensor x, q, scale;
    PyObject *result = NULL;
    if (mx_import(st, &keep, objs[0], "x", &x) < 0 || mx_import(st, &keep, objs[1], "out", &q) < 0 ||
        mx_import(st, &keep, objs[2], "scale", &scale) < 0)
        goto done;
    mx_fp8_quant_problem p = {
        .mode = (mx_fp8_mode)mode, .dtype = x.dtype, .x = x.data, .block_rows = block_rows,
        .block_cols = block_cols, .use_ue8m0 = ue8m0, .scale_given = given, .q = q.data,
        .scale = scale.data,
    };
    if (plan_quant(&p, &x, &q, &scale) < 0)
        goto done;
    quant_call call = {.quant = &p};
    if (mx_numel(&x) > 0 && run_on(st, &x, &call) < 0)
        goto done;
    result = Py_NewRef(Py_None);
done:
    mx_imports_release(&keep);
    return result;
}

/* fp8_linear(x, weight, weight_scale, bias, quant) -> x @ weight.T (+ bias) */
PyObject *mx_py_fp8_linear(PyObject *module, PyObject *args)
{
    PyObject *objs[4], *quant_name;
    if (!PyArg_ParseTuple(args, "OOOOU", &objs[0], &objs[1], &objs[2], &objs[3], &quant_name))
        return NULL;
    mx_quant quant;
    if (mx_parse_quant(quant_name, &quant) < 0)
        return NULL;
    if (quant == MX_QUANT_NONE) {
        PyErr_SetString(PyExc_ValueError, "quant: fp8_linear needs 'fp8_tensor' or 'fp8_block'");
        return NULL;
    }
    mx_module_state *st = mx_state(module);
    mx_imports keep = {0};
    mx_tensor x, w, ws, bias;
    PyObject *out = NULL, *workspace = NULL;
    const int64_t any2[2] = {-1, -1};
    if (mx_import(st, &keep, objs[0], "x", &x) < 0 || mx_import(st, &keep, objs[1], "weight", &w) < 0 ||
        mx_import(st, &keep, objs[2], "weight_scale", &ws) < 0 ||
        mx_import_optional(st, &keep, objs[3], "bias", &bias) < 0)
        goto error;
    if (mx_check_dtype_in(&x, "x", half_dtypes, 2) < 0 || mx_check_shape(&x, "x", 2, any2) < 0 ||
        mx_check_contiguous(&x, "x") < 0 || mx_check_dtype_is(&w, "weight", MX_F8E4M3) < 0)
        goto error;
    int64_t rows = x.shape[0], in = x.shape[1];
    const int64_t w_want[2] = {-1, in};
    if (mx_check_shape(&w, "weight", 2, w_want) < 0 || mx_check_contiguous(&w, "weight") < 0 ||
        mx_check_same_device(&w, "weight", &x, "x") < 0)
        goto error;
    int64_t outf = w.shape[0];
    const int64_t s_tensor[1] = {1}, s_block[2] = {ceil_div(outf, MX_FP8_BLOCK),
                                                   ceil_div(in, MX_FP8_BLOCK)};
    if ((quant == MX_QUANT_FP8_TENSOR ? mx_check_shape(&ws, "weight_scale", 1, s_tensor)
                                      : mx_check_shape(&ws, "weight_scale", 2, s_block)) < 0 ||
        mx_check_dtype_is(&ws, "weight_scale", MX_F32) < 0 ||
        mx_check_contiguous(&ws, "weight_scale") < 0 ||
        mx_check_same_device(&ws, "weight_scale", &x, "x") < 0)
        goto error;
    if (bias.data) {
        const int64_t b_want[1] = {outf};
        if (mx_check_dtype_is(&bias, "bias", x.dtype) < 0 || mx_check_shape(&bias, "bias", 1, b_want) < 0 ||
            mx_check_contiguous(&bias, "bias") < 0 || mx_check_same_device(&bias, "bias", &x, "x") < 0)
            goto error;
    }
    int64_t out_shape[2] = {rows, outf};
    mx_tensor out_view, ws_view;
    out = mx_new_tensor(st, x.dtype, 2, out_shape, x.device_type, x.device_id, &out_view);
    if (!out)
        goto error;
    if (rows > 0 && outf > 0) {
        mx_fp8_linear_problem p = {
            .rows = rows, .in_features = in, .out_features = outf, .quant = quant,
            .act_dtype = x.dtype, .x = x.data, .weight = w.data, .weight_scale = ws.data,
            .bias = bias.data, .output = out_view.data,
        };
        int64_t bytes[1] = {(int64_t)linear_workspace_on(&x, &p) + 256};
        workspace = mx_new_tensor(st, MX_U8, 1, bytes, x.device_type, x.device_id, &ws_view);
        if (!workspace)
            goto error;
        quant_call call = {
            .linear = &p,
            .workspace = (void *)(((uintptr_t)ws_view.data + 255) & ~(uintptr_t)255),
        };
        if (run_on(st, &x, &call) < 0)
            goto error;
        Py_CLEAR(workspace);
    }
    mx_imports_release(&keep);
    return out;
error:
    Py_XDECREF(workspace);
    Py_XDECREF(out);
    mx_imports_release(&keep);
    return NULL;
}
