/*
 * moekit's declarations of the Neuron runtime (libnrt) subset it uses.
 *
 * Written from the public Neuron Runtime API reference (nrt.h, nrt_experimental.h and
 * nrt_version.h as documented at awsdocs-neuron.readthedocs-hosted.com, "Neuron Runtime API"),
 * not copied from the SDK's headers. build.rs binds this file when the SDK's headers are not
 * installed; it binds the SDK's own headers where they are. Only the names, types and values
 * below are relied on; the runtime's structures stay opaque.
 */
#ifndef MOEKIT_NRT_H
#define MOEKIT_NRT_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Status codes returned by every call that can fail (the documented NRT_STATUS values). */
typedef enum {
    NRT_SUCCESS = 0,
    NRT_FAILURE = 1,
    NRT_INVALID = 2,
    NRT_INVALID_HANDLE = 3,
    NRT_RESOURCE = 4,
    NRT_TIMEOUT = 5,
    NRT_HW_ERROR = 6,
    NRT_QUEUE_FULL = 7,
    NRT_LOAD_NOT_ENOUGH_NC = 9,
    NRT_UNSUPPORTED_NEFF_VERSION = 10,
    NRT_FAIL_HOST_MEM_ALLOC = 11,
    NRT_UNINITIALIZED = 13,
    NRT_CLOSED = 14,
    NRT_QUEUE_EMPTY = 15,
    NRT_EXEC_UNIT_UNRECOVERABLE = 101,
    NRT_EXEC_BAD_INPUT = 1002,
    NRT_EXEC_COMPLETED_WITH_NUM_ERR = 1003,
    NRT_EXEC_COMPLETED_WITH_ERR = 1004,
    NRT_EXEC_NC_BUSY = 1005,
    NRT_EXEC_OOB = 1006,
    NRT_COLL_PENDING = 1100,
    NRT_EXEC_HW_ERR_COLLECTIVES = 1200,
    NRT_EXEC_HW_ERR_HBM_UE = 1201,
    NRT_EXEC_HW_ERR_NC_UE = 1202,
    NRT_EXEC_HW_ERR_DMA_ABORT = 1203,
    NRT_EXEC_SW_NQ_OVERFLOW = 1204,
    NRT_EXEC_HW_ERR_REPAIRABLE_HBM_UE = 1205,
    NRT_NETWORK_PROXY_FAILURE = 1206
} NRT_STATUS;

/* Where a tensor's memory lives. */
typedef enum {
    NRT_TENSOR_PLACEMENT_DEVICE = 0,
    NRT_TENSOR_PLACEMENT_HOST = 1,
    NRT_TENSOR_PLACEMENT_VIRTUAL = 2
} nrt_tensor_placement_t;

/* The framework that initialises the runtime; moekit is none of the listed frameworks. */
typedef enum {
    NRT_FRAMEWORK_TYPE_INVALID = 0,
    NRT_FRAMEWORK_TYPE_NO_FW = 1,
    NRT_FRAMEWORK_TYPE_TENSORFLOW = 2,
    NRT_FRAMEWORK_TYPE_PYTORCH = 3,
    NRT_FRAMEWORK_TYPE_MXNET = 4,
    NRT_FRAMEWORK_TYPE_PRECHECK = 5
} nrt_framework_type_t;

/* Element types of a NEFF's tensors. */
typedef enum nrt_dtype {
    NRT_DTYPE_UNKNOWN = 0x0,
    NRT_DTYPE_UINT64 = 0x1,
    NRT_DTYPE_INT8 = 0x2,
    NRT_DTYPE_UINT8 = 0x3,
    NRT_DTYPE_INT16 = 0x4,
    NRT_DTYPE_UINT16 = 0x5,
    NRT_DTYPE_BFLOAT16 = 0x6,
    NRT_DTYPE_FLOAT16 = 0x7,
    NRT_DTYPE_INT32 = 0x8,
    NRT_DTYPE_UINT32 = 0x9,
    NRT_DTYPE_FLOAT32 = 0xA,
    NRT_DTYPE_FP32R = 0xB,
    NRT_DTYPE_INT64 = 0xC,
    NRT_DTYPE_FP8_E3 = 0xD,
    NRT_DTYPE_FP8_E4 = 0xE,
    NRT_DTYPE_FP8_E5 = 0xF
} nrt_dtype_t;

/* Opaque runtime objects. */
typedef struct nrt_model nrt_model_t;
typedef struct nrt_tensor nrt_tensor_t;
typedef struct nrt_tensor_set nrt_tensor_set_t;

/* nrt_version.h */
#define RT_VERSION_DETAIL_LEN 128
#define GIT_HASH_LEN 64

typedef struct nrt_version {
    uint64_t rt_major;
    uint64_t rt_minor;
    uint64_t rt_patch;
    uint64_t rt_maintenance;
    char rt_detail[RT_VERSION_DETAIL_LEN];
    char git_hash[GIT_HASH_LEN];
} nrt_version_t;

/* nrt_experimental.h: a loaded NEFF's input and output tensors. */
#define NRT_TENSOR_NAME_MAX 256

typedef enum nrt_tensor_usage {
    NRT_TENSOR_USAGE_INPUT = 0,
    NRT_TENSOR_USAGE_OUTPUT = 1
} nrt_tensor_usage_t;

typedef struct nrt_tensor_info {
    char name[NRT_TENSOR_NAME_MAX];
    nrt_tensor_usage_t usage;
    size_t size;
    nrt_dtype_t dtype;
    uint32_t *shape;
    uint32_t ndim;
} nrt_tensor_info_t;

typedef struct nrt_tensor_info_array {
    uint64_t tensor_count;
    nrt_tensor_info_t tensor_array[];
} nrt_tensor_info_array_t;

/* Runtime lifecycle. nrt_get_total_vnc_count may be called before nrt_init. */
NRT_STATUS nrt_init(nrt_framework_type_t framework, const char *fw_version, const char *fal_version);
void nrt_close(void);
NRT_STATUS nrt_get_version(nrt_version_t *ver, size_t size);
NRT_STATUS nrt_get_total_vnc_count(uint32_t *vnc_count);
NRT_STATUS nrt_get_visible_vnc_count(uint32_t *vnc_count);

/* Models: a NEFF image loaded on `vnc_count` virtual cores starting at `start_vnc` (-1: any). */
NRT_STATUS nrt_load(const void *neff_bytes, size_t size, int32_t start_vnc, int32_t vnc_count, nrt_model_t **model);
NRT_STATUS nrt_unload(nrt_model_t *model);

/* Tensors. */
NRT_STATUS nrt_tensor_allocate(nrt_tensor_placement_t placement, int vnc, size_t size, const char *name, nrt_tensor_t **tensor);
void nrt_tensor_free(nrt_tensor_t **tensor);
NRT_STATUS nrt_tensor_write(nrt_tensor_t *tensor, const void *buf, size_t offset, size_t size);
NRT_STATUS nrt_tensor_read(const nrt_tensor_t *tensor, void *buf, size_t offset, size_t size);
size_t nrt_tensor_get_size(const nrt_tensor_t *tensor);

/* Tensor sets: a model's inputs or outputs, bound by name. */
NRT_STATUS nrt_allocate_tensor_set(nrt_tensor_set_t **result);
void nrt_destroy_tensor_set(nrt_tensor_set_t **tensor_set);
NRT_STATUS nrt_add_tensor_to_tensor_set(nrt_tensor_set_t *tensor_set, const char *tensor_name, nrt_tensor_t *tensor);
NRT_STATUS nrt_get_tensor_from_tensor_set(nrt_tensor_set_t *tensor_set, const char *tensor_name, nrt_tensor_t **tensor);

/* Execution. */
NRT_STATUS nrt_execute(nrt_model_t *model, const nrt_tensor_set_t *input_set, nrt_tensor_set_t *output_set);
NRT_STATUS nrt_execute_repeat(nrt_model_t *model, const nrt_tensor_set_t *input_set, nrt_tensor_set_t *output_set, int repeat_count);

/* nrt_experimental.h: tensor information of a loaded model; free with nrt_free_model_tensor_info. */
NRT_STATUS nrt_get_model_tensor_info(nrt_model_t *model, nrt_tensor_info_array_t **tensor_info);
NRT_STATUS nrt_free_model_tensor_info(nrt_tensor_info_array_t *tensor_info);

#ifdef __cplusplus
}
#endif

#endif /* MOEKIT_NRT_H */
