/* Internal header of the Python glue (the C files in csrc/): module state, the DLPack
 * bridge, argument checks and error mapping. Engines never include it. */
#ifndef MOE_EXT_GLUE_H
#define MOE_EXT_GLUE_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stddef.h>

#include "moe_ext/abi.h"
#include "moe_ext/dlpack_abi.h"

/* Everything the module holds, reached through mx_state(module). */
typedef struct mx_module_state {
    PyTypeObject *core_type;        /* MoECore */
    PyTypeObject *fp8_method_types[4]; /* csrc/fp8_methods.c, in its table order */
    PyObject *tensor_type;          /* torch.Tensor, set by register_torch (module.c) */
    const DLPackExchangeAPI *api;   /* the tensor type's exchange table, or NULL */
    PyObject *fallback_empty;       /* (shape, dtype_name, device_str) -> tensor */
    PyObject *fallback_stream;      /* (device_index) -> int cudaStream_t */
} mx_module_state;

mx_module_state *mx_state(PyObject *module);
mx_module_state *mx_state_by_type(PyTypeObject *type);

/* Fallback __dlpack__ capsules kept alive for the duration of one call. */
#define MX_MAX_KEPT 16
typedef struct mx_imports {
    PyObject *kept[MX_MAX_KEPT];
    int count;
} mx_imports;

/* Imports `obj` (a tensor) as a view. name is the argument name used in
 * errors. 0 => ok; -1 => error set (TypeError/ValueError naming `name`). */
int mx_import(mx_module_state *st, mx_imports *keep, PyObject *obj, const char *name,
              mx_tensor *out);
/* As mx_import, but None gives a view with data == NULL. */
int mx_import_optional(mx_module_state *st, mx_imports *keep, PyObject *obj,
                       const char *name, mx_tensor *out);
void mx_imports_release(mx_imports *keep);

/* A new, uninitialised contiguous tensor through the producer's allocator
 * (torch's caching allocator). Returns a new reference and fills `view`;
 * NULL => error set. */
PyObject *mx_new_tensor(mx_module_state *st, mx_dtype dtype, int ndim, const int64_t *shape,
                        mx_device_type device_type, int device_id, mx_tensor *view);

/* The producer's current work stream on a CUDA device. 0 => ok; -1 => error set. */
int mx_current_stream(mx_module_state *st, int device_id, void **stream);

/* The device a call runs on: mx_enter_device makes the tensor's CUDA device
 * current and fetches the current stream (NULL on the CPU); mx_leave_device
 * restores the caller's device. 0 => ok; -1 => error set (also for CUDA
 * tensors in a build without CUDA). */
typedef struct mx_device_scope {
    int previous;
    void *stream;
    int swapped;
} mx_device_scope;
int mx_enter_device(mx_module_state *st, const mx_tensor *t, mx_device_scope *scope);
void mx_leave_device(mx_device_scope *scope);

/* Raises the Python exception matching a failed status; always returns NULL. */
PyObject *mx_raise_status(const mx_status *status);

/* ---- argument checks (0 => ok; -1 => exception naming the argument) ---- */
int mx_check_dtype_in(const mx_tensor *t, const char *name, const mx_dtype *allowed, int n);
int mx_check_dtype_is(const mx_tensor *t, const char *name, mx_dtype expected);
/* expected[i] < 0 accepts any extent in dimension i. */
int mx_check_shape(const mx_tensor *t, const char *name, int ndim, const int64_t *expected);
int mx_check_contiguous(const mx_tensor *t, const char *name);
int mx_check_same_device(const mx_tensor *t, const char *name, const mx_tensor *ref,
                         const char *ref_name);
int mx_is_contiguous(const mx_tensor *t);
int64_t mx_numel(const mx_tensor *t);

/* tp_dealloc of moe_ext's heap types (no GC-tracked fields). */
void mx_heap_dealloc(PyObject *self);

/* Type setup, called in order by module exec. 0 => ok; -1 => error. */
int mx_setup_core_type(PyObject *module);

/* Module-level functions defined outside module.c. */
PyObject *mx_py_route(PyObject *module, PyObject *args, PyObject *kwargs);
PyObject *mx_py_experts(PyObject *module, PyObject *args, PyObject *kwargs);
PyObject *mx_py_copy(PyObject *module, PyObject *args, PyObject *kwargs);
PyObject *mx_py_fp8_quant(PyObject *module, PyObject *args, PyObject *kwargs);
PyObject *mx_py_fp8_linear(PyObject *module, PyObject *args);


/* The shared engine calls behind MoECore and the functional API. Views are
 * already imported; these check them, allocate outputs and dispatch to the
 * CPU or CUDA engine. New reference or NULL with an exception set. */
typedef struct mx_route_args {
    int top_k;
    mx_scoring scoring;
    int renormalize;
    int num_expert_group;
    int topk_group;
    float routed_scaling_factor;
} mx_route_args;

typedef struct mx_experts_args {
    int64_t intermediate_size; /* 0: infer from w2 */
    int64_t global_num_experts; /* <= 0: number of local experts */
    mx_activation activation;
    int is_act_and_mul;
    float swiglu_alpha;
    float swiglu_limit;
    int apply_router_weight_on_input;
    mx_quant quant;
    int weights_packed;        /* abi.h mx_experts_problem.weights_packed (MoECore only) */
} mx_experts_args;

/* The tensors of one forward; a view with data == NULL is absent. */
typedef struct mx_moe_views {
    mx_tensor x;               /* hidden_states [M, H] */
    mx_tensor router_logits;   /* [M, E], absent when topk_ids is given */
    mx_tensor correction_bias; /* e_score_correction_bias [E] */
    mx_tensor topk_weights;    /* [M, k] float32, with topk_ids */
    mx_tensor topk_ids;        /* [M, k] int32: routing done elsewhere */
    mx_tensor w13, w2, w13_bias, w2_bias;
    mx_tensor w13_scale, w2_scale; /* FP8 only */
    mx_tensor expert_map;
} mx_moe_views;

/* Returns a tuple (topk_weights, topk_ids). */
PyObject *mx_run_route(mx_module_state *st, const mx_route_args *a, const mx_tensor *logits,
                       const mx_tensor *bias);
/* Routing then experts in one call; returns the output tensor. topk_ids given
 * (data != NULL) skips routing. */
PyObject *mx_run_moe(mx_module_state *st, const mx_route_args *ra, const mx_experts_args *ea,
                     const mx_moe_views *v);
#define MX_VIEW(field) offsetof(mx_moe_views, field)

/* Imports `objs[i]` into the view fields named by `fields` (offsets into
 * mx_moe_views); the first `required` must be tensors, the rest may be None. */
int mx_import_views(mx_module_state *st, mx_imports *keep, PyObject *const *objs, int n,
                    int required, const size_t *fields, const char *const *names,
                    mx_moe_views *v);
int mx_parse_quant(PyObject *name, mx_quant *out);

/* Runs a MoECore (csrc/moe_core.c) on imported views; NULL => error set. */
PyObject *mx_core_run(mx_module_state *st, PyObject *core, const mx_moe_views *v);
int mx_setup_fp8_method_types(PyObject *module);

int mx_parse_activation(PyObject *name, mx_activation *out);
int mx_parse_scoring(PyObject *name, mx_scoring *out);

#endif /* MOE_EXT_GLUE_H */
