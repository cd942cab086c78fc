/* The slice of the DLPack C ABI (version 1.x, with the 1.3 exchange-API table)
 * that moe_ext consumes, declared here so the build needs no framework headers.
 * Field order and widths follow the DLPack specification; only the glue
 * (csrc/dlpack_bridge.c) includes this file. */
#ifndef MOE_EXT_DLPACK_ABI_H
#define MOE_EXT_DLPACK_ABI_H

#include <stdint.h>

typedef struct {
    uint32_t major;
    uint32_t minor;
} DLPackVersion;

typedef enum {
    kDLCPU = 1,
    kDLCUDA = 2,
    kDLCUDAHost = 3,
    kDLCUDAManaged = 13,
} DLDeviceType;

typedef struct {
    DLDeviceType device_type;
    int32_t device_id;
} DLDevice;

typedef enum {
    kDLInt = 0,
    kDLUInt = 1,
    kDLFloat = 2,
    kDLBfloat = 4,
    kDLBool = 6,
    kDLFloat8_e4m3fn = 10,
} DLDataTypeCode;

typedef struct {
    uint8_t code;
    uint8_t bits;
    uint16_t lanes;
} DLDataType;

typedef struct {
    void *data;
    DLDevice device;
    int32_t ndim;
    DLDataType dtype;
    int64_t *shape;
    int64_t *strides; /* in elements; NULL means compact row-major */
    uint64_t byte_offset;
} DLTensor;

/* Unversioned managed tensor: what a "dltensor" capsule holds. */
typedef struct DLManagedTensor {
    DLTensor dl_tensor;
    void *manager_ctx;
    void (*deleter)(struct DLManagedTensor *self);
} DLManagedTensor;

/* Versioned managed tensor: what a "dltensor_versioned" capsule holds. */
typedef struct DLManagedTensorVersioned {
    DLPackVersion version;
    void *manager_ctx;
    void (*deleter)(struct DLManagedTensorVersioned *self);
    uint64_t flags;
    DLTensor dl_tensor;
} DLManagedTensorVersioned;

/* The producer's function table, found as the PyCapsule
 * `type(tensor).__dlpack_c_exchange_api__` named "dlpack_exchange_api". */
typedef int (*DLPackManagedTensorAllocator)(
    DLTensor *prototype, DLManagedTensorVersioned **out, void *error_ctx,
    void (*set_error)(void *error_ctx, const char *kind, const char *message));
typedef int (*DLPackManagedTensorFromPyObjectNoSync)(void *py_object,
                                                     DLManagedTensorVersioned **out);
typedef int (*DLPackManagedTensorToPyObjectNoSync)(DLManagedTensorVersioned *tensor,
                                                   void **out_py_object);
typedef int (*DLPackDLTensorFromPyObjectNoSync)(void *py_object, DLTensor *out);
typedef int (*DLPackCurrentWorkStream)(DLDeviceType device_type, int32_t device_id,
                                       void **out_current_stream);

typedef struct DLPackExchangeAPIHeader {
    DLPackVersion version;
    struct DLPackExchangeAPIHeader *prev_api;
} DLPackExchangeAPIHeader;

typedef struct DLPackExchangeAPI {
    DLPackExchangeAPIHeader header;
    DLPackManagedTensorAllocator managed_tensor_allocator;
    DLPackManagedTensorFromPyObjectNoSync managed_tensor_from_py_object_no_sync;
    DLPackManagedTensorToPyObjectNoSync managed_tensor_to_py_object_no_sync;
    DLPackDLTensorFromPyObjectNoSync dltensor_from_py_object_no_sync; /* may be NULL */
    DLPackCurrentWorkStream current_work_stream;
} DLPackExchangeAPI;

#endif /* MOE_EXT_DLPACK_ABI_H */
