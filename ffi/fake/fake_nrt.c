/*
 * A fake Neuron runtime: the `nrt_*` symbols of ffi/nrt.h emulated on the host, so that moekit's
 * binding and its `neuron` backend can be tested through the real dynamic-loading path without
 * Trainium hardware.
 *
 * It reproduces the runtime's observable behaviour, not its numerics or performance: tensors
 * live in host memory, tensor sets bind them by name, sizes and bounds are checked and reported
 * with the real status codes, and calls before nrt_init or after nrt_close fail. In place of a
 * NEFF it loads a text stand-in of its own that declares the model's tensors and names the host
 * computation to run:
 *
 *     moekit-fake-neff 1
 *     kernel router_topk            (or blockwise_mm, blockwise_mm_bwd, moe_tkg,
 *                                    rmsnorm_router_topk_tkg, moe_block_tkg, topk, topk_reduce,
 *                                    find_nonzero_indices, indexed_flatten, or copy: each
 *                                    output = the same-index input)
 *     param act_fn SOFTMAX          (router_topk: SOFTMAX | SIGMOID)
 *     param router_pre_norm 1       (router_topk: 1 = ACT1, the default | 0 = ACT2)
 *     param norm_topk_prob 1        (router_topk: 0 | 1)
 *     param x_hbm_layout 1          (router_topk: 1 = x [T, H], the default | 0 = x [H, T])
 *     param activation_function GELU  (blockwise_mm, or activation_type for blockwise_mm_bwd:
 *                                    SiLU, the default | GELU | GELU_Tanh_Approx | Swish | ReLU |
 *                                    SquaredReLU)
 *     param expert_affinities_scaling_mode NO_SCALE  (blockwise_mm and its backward: POST_SCALE,
 *                                    the default | NO_SCALE | PRE_SCALE | PRE_SCALE_DELAYED)
 *     param gate_clamp_upper_limit 1.5  (blockwise_mm: gate_ / up_clamp_lower / upper_limit; the
 *                                    backward: non_linear_ (gate) / linear_ (up) clamp limits)
 *     param skip_token 1            (both blockwise: SkipMode's skip_token, hidden_states [T, H]
 *                                    and −1 in padding slots | 0, the default: [T+1, H], T)
 *     param is_tensor_update_accumulating 0  (blockwise_mm: 0 stores each slot's row of output
 *                                    instead of adding it | 1, the default)
 *     param is_all_expert 1         (moe_tkg: 1 = every expert held for every token | 0 = each
 *                                    token's K, the default; with it, also activation_fn (the
 *                                    ActFnType members), expert_affinities_scaling_mode (NO_SCALE,
 *                                    moe_tkg's default, or POST_SCALE), the gate_ / up_
 *                                    clamp limits and mask_unselected_experts 0 | 1)
 *     param router_act_fn SOFTMAX   (rmsnorm_router_topk_tkg: SIGMOID, the default | SOFTMAX;
 *                                    with it, eps (1e-6 by default), hidden_actual (H) and
 *                                    store_eager_affi_only 0 | 1)
 *     param top_k 2                 (moe_block_tkg: K, 1 by default; with it, router_act_fn
 *                                    (SIGMOID, the default), router_pre_norm, norm_topk_prob,
 *                                    eps, hidden_actual, hidden_act_fn (the ActFnType members),
 *                                    expert_affinities_scaling_mode (NO_SCALE, the default, or
 *                                    POST_SCALE), is_all_expert and the clamp limits)
 *     param sorted_flag 0           (topk: 1, the default, descending | 0, ascending position)
 *     param K 2                     (topk_reduce: the most rows summed per token, required; with
 *                                    it, token_base_index, 1 by default, any i32)
 *     param chunk_size 128          (find_nonzero_indices: must divide T; T by default)
 *     param f_len 4                 (indexed_flatten: the block length, required; with it,
 *                                    padding_val, -1 by default, any i32)
 *     input x f32 4 8               (name, dtype f32 | bf16 | i32, then the dimensions; the
 *                                    computation ignores names it does not know, which moekit's
 *                                    backend must catch)
 *     output router_logits f32 4 4
 *
 * moe_tkg takes hidden_input [T, H], expert_gate_up_weights [E_L, H, 2, I], expert_down_weights
 * [E_L, I, H], expert_affinities [T, E] and expert_index [T, K] (i32), optionally rank_id [1, 1]
 * (i32; all-expert POST_SCALE reads columns rank_id·E_L.. of the affinities), expert_gate_up_bias
 * [E_L, 2, I], expert_down_bias [E_L, H] and expert_affinities_eager [T, K], and returns output
 * [T, H]; an expert id out of range, or a rank_id out of range where it is read (all-expert
 * POST_SCALE), is NRT_EXEC_OOB. Its scaling mode defaults to NO_SCALE, as moe_tkg's does.
 * rmsnorm_router_topk_tkg takes hidden_states [T, H] (or [B, S, H]), gamma [1, H] (or [H]),
 * router_weights [H, E] and optionally router_bias [1, E] (or [E]), and returns norm_output
 * [T, H], expert_index [T, K] and expert_affinities [T, E] (scattered), or [T, K] (eager): the
 * RMSNorm, rounded to router_weights' dtype for the router, then router_topk's ACT2.
 * moe_block_tkg takes inp [T, H] (or [B, S, H]), gamma, router_weights [H, E], the experts'
 * weights (all E of them, or E_L with is_all_expert and rank_id [1, 1]) and optionally
 * router_bias and the experts' biases, and returns out [T, H] and, where declared,
 * router_logits [T, E]: the RMSNorm rounded to inp's dtype, router_topk's pipeline on it in
 * router_weights' dtype, and moe_tkg's experts on the norm (under POST_SCALE, all-expert mode
 * masks the unselected experts where ACT1's affinities are dense); a rank_id out of range is
 * NRT_EXEC_OOB.
 * topk takes inp [..., V] and returns topk_values and topk_indices [..., K] (i32): each row's K
 * largest values, equal ones by position, the lower first, descending (or in ascending
 * position), and where K = V the row as given with positions 0..V.
 * topk_reduce takes input [TK_padded, H+2] bf16, each row H values then its token id in the
 * bits of the last two columns (the low half first), and returns output [T, H]: for each token
 * t the sum of the first K rows carrying id token_base_index + t; a token without one is
 * NRT_EXEC_BAD_INPUT.
 * find_nonzero_indices takes input_tensor [T, C_full] (f32, bf16 or i32) and optionally
 * col_start_id [1] (i32), and returns indices [C, T] and nonzero_counts [C] (i32): for each
 * searched column (col_start_id[0] + c, or c, all C_full without it) its nonzero rows ascending
 * then -1, and their count; columns past C_full are NRT_EXEC_OOB.
 * indexed_flatten takes input_tensor [E, T], row_offsets [N] (i32) and optionally
 * row_offsets_start [1] (i32), and returns flattened_array [output_len] in input_tensor's
 * dtype: padding_val, then each row's T / f_len blocks of f_len elements copied, rows in order,
 * to blocks row_offsets[start + e] + p, those outside the output skipped; offsets read past N
 * are NRT_EXEC_OOB.
 * blockwise_mm takes the optional inputs gate_and_up_proj_bias and down_proj_bias, and
 * blockwise_mm_bwd the optional outputs gate_and_up_proj_bias_grad and down_proj_bias_grad.
 * router_topk, blockwise_mm (with or without its checkpoint outputs) and blockwise_mm_bwd follow
 * moekit's contracts (kernels/contracts) with f32 or bf16 inputs and f64 accumulation. blockwise_mm reports an out-of-range token id with
 * NRT_EXEC_OOB, as the hardware's indirect DMA does.
 *
 * Built by build.rs as a shared library; with -DFAKE_NRT_OMIT_EXECUTE_REPEAT it lacks
 * nrt_execute_repeat, to test a library with a missing symbol.
 */
#include "nrt.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define FAKE_VNC_COUNT 2
#define MAX_TENSORS 16
#define MAX_DIMS 8
#define MAX_MODELS 64

typedef enum { STATE_UNINITIALIZED, STATE_RUNNING, STATE_CLOSED } runtime_state_t;

static runtime_state_t state = STATE_UNINITIALIZED;

struct nrt_tensor {
    char name[NRT_TENSOR_NAME_MAX];
    size_t size;
    unsigned char *data;
};

typedef struct binding {
    char name[NRT_TENSOR_NAME_MAX];
    nrt_tensor_t *tensor;
    struct binding *next;
} binding_t;

struct nrt_tensor_set {
    binding_t *head;
};

typedef enum {
    KERNEL_COPY,
    KERNEL_ROUTER_TOPK,
    KERNEL_BLOCKWISE_MM,
    KERNEL_BLOCKWISE_MM_BWD,
    KERNEL_MOE_TKG,
    KERNEL_RMSNORM_ROUTER_TOPK_TKG,
    KERNEL_MOE_BLOCK_TKG,
    KERNEL_TOPK,
    KERNEL_TOPK_REDUCE,
    KERNEL_FIND_NONZERO_INDICES,
    KERNEL_INDEXED_FLATTEN
} kernel_t;

/* nki-library's ActFnType members, in its order. */
static const char *const ACT_FN_NAMES[] = {"SiLU", "GELU", "GELU_Tanh_Approx", "Swish", "ReLU", "SquaredReLU"};
#define ACT_FN_COUNT ((int)(sizeof ACT_FN_NAMES / sizeof ACT_FN_NAMES[0]))

/* nki-library's ExpertAffinityScaleMode members, POST_SCALE (the default) first. */
static const char *const SCALE_MODE_NAMES[] = {"POST_SCALE", "NO_SCALE", "PRE_SCALE", "PRE_SCALE_DELAYED"};
#define SCALE_MODE_COUNT ((int)(sizeof SCALE_MODE_NAMES / sizeof SCALE_MODE_NAMES[0]))

/* The gate activation f(g) of member `fn`, and its derivative in *deriv. */
static double gate_act(int fn, double g, double *deriv) {
    const double pi = 3.14159265358979323846;
    switch (fn) {
    case 1: { /* GELU */
        double cdf = 0.5 * (1.0 + erf(g / sqrt(2.0))), pdf = exp(-0.5 * g * g) / sqrt(2.0 * pi);
        *deriv = cdf + g * pdf;
        return g * cdf;
    }
    case 2: { /* GELU_Tanh_Approx */
        double c = sqrt(2.0 / pi), t = tanh(c * (g + 0.044715 * g * g * g));
        *deriv = 0.5 * (1.0 + t) + 0.5 * g * (1.0 - t * t) * c * (1.0 + 3.0 * 0.044715 * g * g);
        return 0.5 * g * (1.0 + t);
    }
    case 3: { /* Swish: g·σ(1.702 g) */
        double s = 1.0 / (1.0 + exp(-1.702 * g));
        *deriv = s + 1.702 * g * s * (1.0 - s);
        return g * s;
    }
    case 4: /* ReLU */
        *deriv = g > 0.0 ? 1.0 : 0.0;
        return g > 0.0 ? g : 0.0;
    case 5: /* SquaredReLU */
        *deriv = g > 0.0 ? 2.0 * g : 0.0;
        return g > 0.0 ? g * g : 0.0;
    default: { /* SiLU */
        double s = 1.0 / (1.0 + exp(-g));
        *deriv = s * (1.0 + g * (1.0 - s));
        return g * s;
    }
    }
}

typedef struct {
    char name[NRT_TENSOR_NAME_MAX];
    nrt_tensor_usage_t usage;
    nrt_dtype_t dtype;
    uint32_t ndim;
    uint32_t shape[MAX_DIMS];
    size_t size;
} decl_t;

struct nrt_model {
    kernel_t kernel;
    int sigmoid;
    int act2; /* router_pre_norm = 0 */
    int norm_topk_prob;
    int x_h_t; /* x_hbm_layout = 0: x [H, T] */
    int act_fn; /* the experts' gate activation: an index into ACT_FN_NAMES */
    int scaling; /* an index into SCALE_MODE_NAMES; 0 is POST_SCALE */
    int skip_token;   /* hidden_states [T, H], −1 in padding slots */
    int store_blocks; /* is_tensor_update_accumulating = 0 */
    int all_expert;   /* moe_tkg, moe_block_tkg: is_all_expert */
    int mask_unselected; /* moe_tkg: mask_unselected_experts */
    double eps;             /* rmsnorm_router_topk_tkg, moe_block_tkg */
    uint32_t hidden_actual; /* rmsnorm_router_topk_tkg, moe_block_tkg; 0: H */
    int eager;              /* rmsnorm_router_topk_tkg: store_eager_affi_only */
    uint32_t top_k;         /* moe_block_tkg's K (no tensor of its shows it); 0: 1 */
    int unsorted;           /* topk: sorted_flag = 0 */
    uint32_t rows_per_token; /* topk_reduce's K; 0: not given */
    int32_t token_base;     /* topk_reduce's token_base_index */
    uint32_t chunk_size;    /* find_nonzero_indices; 0: T */
    uint32_t f_len;         /* indexed_flatten; 0: not given */
    int32_t padding_val;    /* indexed_flatten */
    /* The blockwise clamp limits: [0 gate | 1 up][0 lower | 1 upper], where has_clamp is set. */
    double clamp[2][2];
    int has_clamp[2][2];
    int count;
    decl_t decls[MAX_TENSORS];
};

static nrt_model_t *live_models[MAX_MODELS];

static NRT_STATUS check_running(void) {
    if (state == STATE_UNINITIALIZED) return NRT_UNINITIALIZED;
    if (state == STATE_CLOSED) return NRT_CLOSED;
    return NRT_SUCCESS;
}

static int model_is_live(const nrt_model_t *model) {
    for (int i = 0; i < MAX_MODELS; i++)
        if (model != NULL && live_models[i] == model) return 1;
    return 0;
}

/* ---- lifecycle ---- */

NRT_STATUS nrt_init(nrt_framework_type_t framework, const char *fw_version, const char *fal_version) {
    if (framework == NRT_FRAMEWORK_TYPE_INVALID || fw_version == NULL || fal_version == NULL)
        return NRT_INVALID;
    if (state == STATE_RUNNING) return NRT_INVALID;
    state = STATE_RUNNING;
    return NRT_SUCCESS;
}

void nrt_close(void) {
    if (state != STATE_RUNNING) return;
    /* Closing releases every loaded model, as the runtime does. */
    for (int i = 0; i < MAX_MODELS; i++) {
        free(live_models[i]);
        live_models[i] = NULL;
    }
    state = STATE_CLOSED;
}

NRT_STATUS nrt_get_version(nrt_version_t *ver, size_t size) {
    nrt_version_t v;
    if (ver == NULL || size > sizeof v) return NRT_INVALID;
    memset(&v, 0, sizeof v);
    v.rt_major = 2;
    v.rt_minor = 0;
    v.rt_patch = 0;
    v.rt_maintenance = 0;
    snprintf(v.rt_detail, sizeof v.rt_detail, "moekit fake runtime");
    snprintf(v.git_hash, sizeof v.git_hash, "fake");
    memcpy(ver, &v, size);
    return NRT_SUCCESS;
}

NRT_STATUS nrt_get_total_vnc_count(uint32_t *vnc_count) {
    if (vnc_count == NULL) return NRT_INVALID;
    *vnc_count = FAKE_VNC_COUNT;
    return NRT_SUCCESS;
}

NRT_STATUS nrt_get_visible_vnc_count(uint32_t *vnc_count) {
    NRT_STATUS s = check_running();
    if (s != NRT_SUCCESS) return s;
    if (vnc_count == NULL) return NRT_INVALID;
    *vnc_count = FAKE_VNC_COUNT;
    return NRT_SUCCESS;
}

/* ---- the NEFF stand-in ---- */

static size_t dtype_size(nrt_dtype_t dtype) {
    switch (dtype) {
    case NRT_DTYPE_FLOAT32:
    case NRT_DTYPE_INT32: return 4;
    case NRT_DTYPE_BFLOAT16: return 2;
    default: return 0;
    }
}

static int parse_dtype(const char *s, nrt_dtype_t *dtype) {
    if (strcmp(s, "f32") == 0) *dtype = NRT_DTYPE_FLOAT32;
    else if (strcmp(s, "bf16") == 0) *dtype = NRT_DTYPE_BFLOAT16;
    else if (strcmp(s, "i32") == 0) *dtype = NRT_DTYPE_INT32;
    else return 0;
    return 1;
}

static const decl_t *find_decl(const nrt_model_t *m, const char *name, nrt_tensor_usage_t usage) {
    for (int i = 0; i < m->count; i++)
        if (m->decls[i].usage == usage && strcmp(m->decls[i].name, name) == 0) return &m->decls[i];
    return NULL;
}

static uint32_t dim(const nrt_model_t *m, const char *name, nrt_tensor_usage_t usage, uint32_t axis) {
    const decl_t *d = find_decl(m, name, usage);
    return (d != NULL && axis < d->ndim) ? d->shape[axis] : 0;
}

/* Whether tensor `name` is declared with exactly the given shape (ndim 0: must be absent). */
static int has_shape(const nrt_model_t *m, const char *name, nrt_tensor_usage_t usage, uint32_t ndim,
                     const uint32_t *shape) {
    const decl_t *d = find_decl(m, name, usage);
    if (d == NULL) return ndim == 0;
    if (d->ndim != ndim) return 0;
    for (uint32_t i = 0; i < ndim; i++)
        if (d->shape[i] != shape[i]) return 0;
    return 1;
}

/* (T+1)·E as a dimension, or 0 when it does not fit one. */
static uint32_t masked_rows(uint32_t rows, uint32_t e) {
    uint64_t product = (uint64_t)rows * e;
    return product > UINT32_MAX ? 0 : (uint32_t)product;
}

/* Checks that a router_topk or blockwise_mm stand-in declares a consistent set of tensors. */
static int kernel_tensors_consistent(const nrt_model_t *m) {
    const nrt_tensor_usage_t in = NRT_TENSOR_USAGE_INPUT, out = NRT_TENSOR_USAGE_OUTPUT;
    if (m->kernel == KERNEL_ROUTER_TOPK) {
        uint32_t t = dim(m, "x", in, m->x_h_t), h = dim(m, "x", in, !m->x_h_t), e = dim(m, "w", in, 1);
        uint32_t k = dim(m, "expert_index", out, 1);
        uint32_t te[2] = {t, e}, tk[2] = {t, k}, hw[2] = {h, e}, eb[2] = {1, e};
        const decl_t *bias = find_decl(m, "w_bias", in), *selection = find_decl(m, "selection_bias", in);
        return t > 0 && h > 0 && e > 0 && k > 0 && k <= e && has_shape(m, "w", in, 2, hw) &&
               has_shape(m, "router_logits", out, 2, te) && has_shape(m, "expert_index", out, 2, tk) &&
               has_shape(m, "expert_affinities", out, 2, te) &&
               (find_decl(m, "topk_affinities", out) == NULL || has_shape(m, "topk_affinities", out, 2, tk)) &&
               (bias == NULL || has_shape(m, "w_bias", in, 1, eb + 1) || has_shape(m, "w_bias", in, 2, eb)) &&
               (selection == NULL || has_shape(m, "selection_bias", in, 1, eb + 1));
    }
    if (m->kernel == KERNEL_BLOCKWISE_MM_BWD) {
        uint32_t rows = dim(m, "hidden_states", in, 0), h = dim(m, "hidden_states", in, 1);
        uint32_t e = dim(m, "gate_up_proj_weight", in, 0), i = dim(m, "gate_up_proj_weight", in, 3);
        uint32_t n = dim(m, "block_to_expert", in, 0), nb = dim(m, "token_position_to_id", in, 0);
        uint32_t b = n > 0 ? nb / n : 0, gu[4] = {e, h, 2, i}, dn[3] = {e, i, h}, th[2] = {rows, h};
        uint32_t aff[2] = {masked_rows(rows, e), 1}, gut[4] = {n, 2, i, b}, dna[3] = {n, b, h};
        uint32_t gub[3] = {e, 2, i}, db[2] = {e, h};
        return rows > (m->skip_token ? 0u : 1u) && h > 0 && e > 0 && i > 0 && n > 0 && nb % n == 0 && nb > 0 &&
               aff[0] > 0 &&
               has_shape(m, "gate_up_proj_weight", in, 4, gu) && has_shape(m, "down_proj_weight", in, 3, dn) &&
               (has_shape(m, "expert_affinities_masked", in, 1, aff) ||
                has_shape(m, "expert_affinities_masked", in, 2, aff)) &&
               has_shape(m, "gate_up_proj_act_checkpoint_T", in, 4, gut) &&
               has_shape(m, "down_proj_act_checkpoint", in, 3, dna) &&
               has_shape(m, "output_hidden_states_grad", in, 2, th) && has_shape(m, "hidden_states_grad", out, 2, th) &&
               (has_shape(m, "expert_affinities_masked_grad", out, 1, aff) ||
                has_shape(m, "expert_affinities_masked_grad", out, 2, aff)) &&
               has_shape(m, "gate_up_proj_weight_grad", out, 4, gu) && has_shape(m, "down_proj_weight_grad", out, 3, dn) &&
               /* the bias gradients: both or neither */
               (find_decl(m, "gate_and_up_proj_bias_grad", out) == NULL) ==
                   (find_decl(m, "down_proj_bias_grad", out) == NULL) &&
               (find_decl(m, "gate_and_up_proj_bias_grad", out) == NULL ||
                has_shape(m, "gate_and_up_proj_bias_grad", out, 3, gub)) &&
               (find_decl(m, "down_proj_bias_grad", out) == NULL || has_shape(m, "down_proj_bias_grad", out, 2, db));
    }
    if (m->kernel == KERNEL_MOE_TKG) {
        uint32_t t = dim(m, "hidden_input", in, 0), h = dim(m, "hidden_input", in, 1);
        uint32_t el = dim(m, "expert_gate_up_weights", in, 0), i = dim(m, "expert_gate_up_weights", in, 3);
        uint32_t e = dim(m, "expert_affinities", in, 1), k = dim(m, "expert_index", in, 1);
        uint32_t gu[4] = {el, h, 2, i}, dn[3] = {el, i, h}, te[2] = {t, e}, tk[2] = {t, k}, th[2] = {t, h};
        uint32_t one[2] = {1, 1}, gub[3] = {el, 2, i}, db[2] = {el, h};
        return t > 0 && h > 0 && el > 0 && i > 0 && e >= el && k > 0 &&
               has_shape(m, "expert_gate_up_weights", in, 4, gu) && has_shape(m, "expert_down_weights", in, 3, dn) &&
               has_shape(m, "expert_affinities", in, 2, te) && has_shape(m, "expert_index", in, 2, tk) &&
               has_shape(m, "output", out, 2, th) &&
               (find_decl(m, "rank_id", in) == NULL || has_shape(m, "rank_id", in, 2, one)) &&
               (find_decl(m, "expert_gate_up_bias", in) == NULL || has_shape(m, "expert_gate_up_bias", in, 3, gub)) &&
               (find_decl(m, "expert_down_bias", in) == NULL || has_shape(m, "expert_down_bias", in, 2, db)) &&
               (find_decl(m, "expert_affinities_eager", in) == NULL ||
                has_shape(m, "expert_affinities_eager", in, 2, tk));
    }
    if (m->kernel == KERNEL_RMSNORM_ROUTER_TOPK_TKG) {
        const decl_t *x = find_decl(m, "hidden_states", in);
        if (x == NULL || x->ndim < 2 || x->ndim > 3) return 0;
        uint32_t h = x->shape[x->ndim - 1], t = x->ndim == 3 ? x->shape[0] * x->shape[1] : x->shape[0];
        uint32_t e = dim(m, "router_weights", in, 1), k = dim(m, "expert_index", out, 1);
        uint32_t he[2] = {h, e}, th[2] = {t, h}, tk[2] = {t, k}, te[2] = {t, e}, row[2] = {1, h}, eb[2] = {1, e};
        return t > 0 && h > 0 && e > 0 && k > 0 && k <= e && m->hidden_actual <= h &&
               (x->ndim == 2 || (uint64_t)x->shape[0] * x->shape[1] == t) &&
               (has_shape(m, "gamma", in, 2, row) || has_shape(m, "gamma", in, 1, row + 1)) &&
               has_shape(m, "router_weights", in, 2, he) && has_shape(m, "norm_output", out, 2, th) &&
               has_shape(m, "expert_index", out, 2, tk) &&
               has_shape(m, "expert_affinities", out, 2, m->eager ? tk : te) &&
               (find_decl(m, "router_bias", in) == NULL || has_shape(m, "router_bias", in, 2, eb) ||
                has_shape(m, "router_bias", in, 1, eb + 1));
    }
    if (m->kernel == KERNEL_MOE_BLOCK_TKG) {
        const decl_t *x = find_decl(m, "inp", in);
        if (x == NULL || x->ndim < 2 || x->ndim > 3) return 0;
        uint32_t h = x->shape[x->ndim - 1], t = x->ndim == 3 ? x->shape[0] * x->shape[1] : x->shape[0];
        uint32_t e = dim(m, "router_weights", in, 1);
        uint32_t el = dim(m, "expert_gate_up_weights", in, 0), i = dim(m, "expert_gate_up_weights", in, 3);
        uint32_t he[2] = {h, e}, th[2] = {t, h}, te[2] = {t, e}, row[2] = {1, h}, eb[2] = {1, e};
        uint32_t gu[4] = {el, h, 2, i}, dn[3] = {el, i, h}, gub[3] = {el, 2, i}, db[2] = {el, h}, one[2] = {1, 1};
        return t > 0 && h > 0 && e > 0 && el > 0 && i > 0 && m->hidden_actual <= h && m->top_k <= e &&
               (m->all_expert ? e % el == 0 && find_decl(m, "rank_id", in) != NULL : el == e) &&
               (x->ndim == 2 || (uint64_t)x->shape[0] * x->shape[1] == t) &&
               (has_shape(m, "gamma", in, 2, row) || has_shape(m, "gamma", in, 1, row + 1)) &&
               has_shape(m, "router_weights", in, 2, he) && has_shape(m, "expert_gate_up_weights", in, 4, gu) &&
               has_shape(m, "expert_down_weights", in, 3, dn) && has_shape(m, "out", out, 2, th) &&
               (find_decl(m, "router_logits", out) == NULL || has_shape(m, "router_logits", out, 2, te)) &&
               (find_decl(m, "router_bias", in) == NULL || has_shape(m, "router_bias", in, 2, eb) ||
                has_shape(m, "router_bias", in, 1, eb + 1)) &&
               (find_decl(m, "rank_id", in) == NULL || has_shape(m, "rank_id", in, 2, one)) &&
               (find_decl(m, "expert_gate_up_bias", in) == NULL || has_shape(m, "expert_gate_up_bias", in, 3, gub)) &&
               (find_decl(m, "expert_down_bias", in) == NULL || has_shape(m, "expert_down_bias", in, 2, db));
    }
    if (m->kernel == KERNEL_BLOCKWISE_MM) {
        uint32_t rows = dim(m, "hidden_states", in, 0), h = dim(m, "hidden_states", in, 1);
        uint32_t e = dim(m, "gate_up_proj_weight", in, 0), i = dim(m, "gate_up_proj_weight", in, 3);
        uint32_t n = dim(m, "block_to_expert", in, 0);
        uint32_t nb = dim(m, "token_position_to_id", in, 0);
        uint32_t gu[4] = {e, h, 2, i}, dn[3] = {e, i, h}, th[2] = {rows, h};
        uint32_t aff[2] = {masked_rows(rows, e), 1}; /* [(T+1)·E] or NKI's [(T+1)·E, 1] */
        uint32_t b = n > 0 ? nb / n : 0, gut[4] = {n, 2, i, b}, dna[3] = {n, b, h};
        uint32_t gub[3] = {e, 2, i}, db[2] = {e, h};
        return rows > (m->skip_token ? 0u : 1u) && h > 0 && e > 0 && i > 0 && n > 0 && nb % n == 0 && nb > 0 &&
               aff[0] > 0 &&
               has_shape(m, "gate_up_proj_weight", in, 4, gu) && has_shape(m, "down_proj_weight", in, 3, dn) &&
               (has_shape(m, "expert_affinities_masked", in, 1, aff) ||
                has_shape(m, "expert_affinities_masked", in, 2, aff)) &&
               has_shape(m, "output", out, 2, th) &&
               /* the checkpoints: both or neither */
               (find_decl(m, "gate_up_activations_T", out) == NULL) == (find_decl(m, "down_activations", out) == NULL) &&
               (find_decl(m, "gate_up_activations_T", out) == NULL || has_shape(m, "gate_up_activations_T", out, 4, gut)) &&
               (find_decl(m, "down_activations", out) == NULL || has_shape(m, "down_activations", out, 3, dna)) &&
               (find_decl(m, "gate_and_up_proj_bias", in) == NULL || has_shape(m, "gate_and_up_proj_bias", in, 3, gub)) &&
               (find_decl(m, "down_proj_bias", in) == NULL || has_shape(m, "down_proj_bias", in, 2, db));
    }
    if (m->kernel == KERNEL_TOPK) {
        const decl_t *x = find_decl(m, "inp", in), *values = find_decl(m, "topk_values", out);
        if (x == NULL || values == NULL || x->ndim < 2 || values->ndim != x->ndim) return 0;
        uint32_t shape[MAX_DIMS], v = x->shape[x->ndim - 1], k = values->shape[x->ndim - 1];
        memcpy(shape, x->shape, x->ndim * sizeof *shape);
        shape[x->ndim - 1] = k;
        return x->dtype != NRT_DTYPE_INT32 && k <= v && has_shape(m, "topk_values", out, x->ndim, shape) &&
               has_shape(m, "topk_indices", out, x->ndim, shape);
    }
    if (m->kernel == KERNEL_TOPK_REDUCE) {
        const decl_t *x = find_decl(m, "input", in);
        uint32_t t = dim(m, "output", out, 0), h = dim(m, "output", out, 1), rows = dim(m, "input", in, 0);
        uint32_t shape[2] = {rows, h + 2}, th[2] = {t, h};
        return x != NULL && x->dtype == NRT_DTYPE_BFLOAT16 && m->rows_per_token > 0 && t > 0 && h > 0 && t <= rows &&
               has_shape(m, "input", in, 2, shape) && has_shape(m, "output", out, 2, th);
    }
    if (m->kernel == KERNEL_FIND_NONZERO_INDICES) {
        uint32_t t = dim(m, "input_tensor", in, 0), c_full = dim(m, "input_tensor", in, 1);
        uint32_t c = dim(m, "indices", out, 0), ct[2] = {c, t}, tc[2] = {t, c_full}, one = 1;
        const decl_t *start = find_decl(m, "col_start_id", in);
        return t > 0 && c > 0 && has_shape(m, "input_tensor", in, 2, tc) && has_shape(m, "indices", out, 2, ct) &&
               has_shape(m, "nonzero_counts", out, 1, &c) && (m->chunk_size == 0 || t % m->chunk_size == 0) &&
               (start == NULL ? c == c_full : c <= c_full && has_shape(m, "col_start_id", in, 1, &one));
    }
    if (m->kernel == KERNEL_INDEXED_FLATTEN) {
        const decl_t *x = find_decl(m, "input_tensor", in), *flat = find_decl(m, "flattened_array", out);
        uint32_t e = dim(m, "input_tensor", in, 0), t = dim(m, "input_tensor", in, 1);
        uint32_t n = dim(m, "row_offsets", in, 0), len = dim(m, "flattened_array", out, 0), f = m->f_len, one = 1;
        const decl_t *start = find_decl(m, "row_offsets_start", in);
        return x != NULL && flat != NULL && x->ndim == 2 && flat->ndim == 1 && flat->dtype == x->dtype && f > 0 &&
               e > 0 && t % f == 0 && len % f == 0 && has_shape(m, "row_offsets", in, 1, &n) &&
               (start == NULL ? n == e : n >= e && has_shape(m, "row_offsets_start", in, 1, &one));
    }
    /* copy: output j has the size of input j. */
    int inputs = 0, outputs = 0;
    size_t in_sizes[MAX_TENSORS];
    for (int j = 0; j < m->count; j++)
        if (m->decls[j].usage == in) in_sizes[inputs++] = m->decls[j].size;
    for (int j = 0; j < m->count; j++)
        if (m->decls[j].usage == out && (outputs >= inputs || m->decls[j].size != in_sizes[outputs++])) return 0;
    return outputs > 0;
}

/* Whether one of the first `count` declarations is called `name`. */
static int name_taken(const nrt_model_t *m, const char *name, int count) {
    for (int i = 0; i < count; i++)
        if (strcmp(m->decls[i].name, name) == 0) return 1;
    return 0;
}

/* Parses the stand-in; returns NRT_SUCCESS, NRT_INVALID or NRT_UNSUPPORTED_NEFF_VERSION. */
/* Whether `name` is a clamp limit, and which: *which 0 = gate, 1 = up; *limit 0 = lower, 1 = upper
 * (the forward's gate_ / up_clamp_*_limit, the backward's non_linear_ / linear_clamp_*_limit). */
static int clamp_param(const char *name, int *which, int *limit) {
    static const char *const NAMES[2][2][2] = {
        {{"gate_clamp_lower_limit", "non_linear_clamp_lower_limit"},
         {"gate_clamp_upper_limit", "non_linear_clamp_upper_limit"}},
        {{"up_clamp_lower_limit", "linear_clamp_lower_limit"}, {"up_clamp_upper_limit", "linear_clamp_upper_limit"}},
    };
    for (int w = 0; w < 2; w++)
        for (int l = 0; l < 2; l++)
            for (int form = 0; form < 2; form++)
                if (strcmp(name, NAMES[w][l][form]) == 0) {
                    *which = w, *limit = l;
                    return 1;
                }
    return 0;
}

/* Projection `which` (0 gate, 1 up) clamped to the model's limits. */
static double clamp_apply(const nrt_model_t *m, int which, double v) {
    if (m->has_clamp[which][0] && v < m->clamp[which][0]) v = m->clamp[which][0];
    if (m->has_clamp[which][1] && v > m->clamp[which][1]) v = m->clamp[which][1];
    return v;
}

/* Whether the gradient flows through the clamp at a clamped value v: strictly inside the limits. */
static int clamp_passes(const nrt_model_t *m, int which, double v) {
    return (!m->has_clamp[which][0] || v > m->clamp[which][0]) && (!m->has_clamp[which][1] || v < m->clamp[which][1]);
}

static NRT_STATUS parse_neff(const char *bytes, size_t size, nrt_model_t *m) {
    char *text = malloc(size + 1);
    if (text == NULL) return NRT_FAIL_HOST_MEM_ALLOC;
    memcpy(text, bytes, size);
    text[size] = '\0';
    NRT_STATUS status = NRT_SUCCESS;
    int line_no = 0, have_kernel = 0, have_scaling = 0, have_router_act_fn = 0;
    char *save = NULL;
    memset(m, 0, sizeof *m);
    m->eps = 1e-6;
    m->token_base = 1;
    m->padding_val = -1;
    for (char *line = strtok_r(text, "\n", &save); line != NULL; line = strtok_r(NULL, "\n", &save), line_no++) {
        char word[64], name[NRT_TENSOR_NAME_MAX], value[64];
        int version, used = 0, which, bound_index;
        if (line_no == 0) {
            if (sscanf(line, "moekit-fake-neff %d%n", &version, &used) != 1 || line[used] != '\0') {
                status = NRT_INVALID;
                break;
            }
            if (version != 1) {
                status = NRT_UNSUPPORTED_NEFF_VERSION;
                break;
            }
            continue;
        }
        if (line[0] == '\0') continue;
        if (sscanf(line, "%63s", word) != 1) {
            status = NRT_INVALID;
            break;
        }
        if (strcmp(word, "kernel") == 0 && sscanf(line, "kernel %63s", value) == 1 && !have_kernel) {
            have_kernel = 1;
            if (strcmp(value, "copy") == 0) m->kernel = KERNEL_COPY;
            else if (strcmp(value, "router_topk") == 0) m->kernel = KERNEL_ROUTER_TOPK;
            else if (strcmp(value, "blockwise_mm") == 0) m->kernel = KERNEL_BLOCKWISE_MM;
            else if (strcmp(value, "blockwise_mm_bwd") == 0) m->kernel = KERNEL_BLOCKWISE_MM_BWD;
            else if (strcmp(value, "moe_tkg") == 0) m->kernel = KERNEL_MOE_TKG;
            else if (strcmp(value, "rmsnorm_router_topk_tkg") == 0) m->kernel = KERNEL_RMSNORM_ROUTER_TOPK_TKG;
            else if (strcmp(value, "moe_block_tkg") == 0) m->kernel = KERNEL_MOE_BLOCK_TKG;
            else if (strcmp(value, "topk") == 0) m->kernel = KERNEL_TOPK;
            else if (strcmp(value, "topk_reduce") == 0) m->kernel = KERNEL_TOPK_REDUCE;
            else if (strcmp(value, "find_nonzero_indices") == 0) m->kernel = KERNEL_FIND_NONZERO_INDICES;
            else if (strcmp(value, "indexed_flatten") == 0) m->kernel = KERNEL_INDEXED_FLATTEN;
            else status = NRT_INVALID;
        } else if (strcmp(word, "param") == 0 && sscanf(line, "param %255s %63s", name, value) == 2) {
            int flag = strcmp(value, "0") == 0 || strcmp(value, "1") == 0;
            int router_act = strcmp(name, "act_fn") == 0 || strcmp(name, "router_act_fn") == 0;
            char *end;
            if (router_act && strcmp(value, "SOFTMAX") == 0) m->sigmoid = 0, have_router_act_fn = 1;
            else if (router_act && strcmp(value, "SIGMOID") == 0) m->sigmoid = 1, have_router_act_fn = 1;
            else if (strcmp(name, "eps") == 0) {
                m->eps = strtod(value, &end);
                if (*end != '\0' || !isfinite(m->eps) || m->eps <= 0.0) status = NRT_INVALID;
            } else if (strcmp(name, "hidden_actual") == 0) {
                unsigned long actual = strtoul(value, &end, 10);
                if (*end != '\0' || actual == 0 || actual > UINT32_MAX) status = NRT_INVALID;
                m->hidden_actual = (uint32_t)actual;
            } else if (strcmp(name, "top_k") == 0) {
                unsigned long k = strtoul(value, &end, 10);
                if (*end != '\0' || k == 0 || k > UINT32_MAX) status = NRT_INVALID;
                m->top_k = (uint32_t)k;
            } else if (strcmp(name, "K") == 0 || strcmp(name, "chunk_size") == 0 || strcmp(name, "f_len") == 0) {
                unsigned long size = strtoul(value, &end, 10);
                if (*end != '\0' || value[0] == '-' || size == 0 || size > UINT32_MAX) status = NRT_INVALID;
                *(name[0] == 'K' ? &m->rows_per_token : name[0] == 'c' ? &m->chunk_size : &m->f_len) = (uint32_t)size;
            } else if (strcmp(name, "token_base_index") == 0 || strcmp(name, "padding_val") == 0) {
                long v = strtol(value, &end, 10);
                if (*end != '\0' || v < INT32_MIN || v > INT32_MAX) status = NRT_INVALID;
                *(name[0] == 't' ? &m->token_base : &m->padding_val) = (int32_t)v;
            } else if (strcmp(name, "sorted_flag") == 0 && flag) m->unsorted = value[0] == '0';
            else if (strcmp(name, "store_eager_affi_only") == 0 && flag) m->eager = value[0] == '1';
            else if (strcmp(name, "router_pre_norm") == 0 && flag) m->act2 = value[0] == '0';
            else if (strcmp(name, "norm_topk_prob") == 0 && flag) m->norm_topk_prob = value[0] == '1';
            else if (strcmp(name, "x_hbm_layout") == 0 && flag) m->x_h_t = value[0] == '0';
            else if (strcmp(name, "skip_token") == 0 && flag) m->skip_token = value[0] == '1';
            else if (strcmp(name, "is_tensor_update_accumulating") == 0 && flag) m->store_blocks = value[0] == '0';
            else if (strcmp(name, "is_all_expert") == 0 && flag) m->all_expert = value[0] == '1';
            else if (strcmp(name, "mask_unselected_experts") == 0 && flag) m->mask_unselected = value[0] == '1';
            else if (strcmp(name, "activation_function") == 0 || strcmp(name, "activation_type") == 0 ||
                     strcmp(name, "activation_fn") == 0 || strcmp(name, "hidden_act_fn") == 0) {
                m->act_fn = -1;
                for (int f = 0; f < ACT_FN_COUNT; f++)
                    if (strcmp(value, ACT_FN_NAMES[f]) == 0) m->act_fn = f;
                if (m->act_fn < 0) status = NRT_INVALID;
            } else if (clamp_param(name, &which, &bound_index)) {
                char *end;
                double limit = strtod(value, &end);
                if (*end != '\0' || !isfinite(limit)) status = NRT_INVALID;
                m->clamp[which][bound_index] = limit;
                m->has_clamp[which][bound_index] = 1;
            } else if (strcmp(name, "expert_affinities_scaling_mode") == 0) {
                have_scaling = 1;
                m->scaling = -1;
                for (int s = 0; s < SCALE_MODE_COUNT; s++)
                    if (strcmp(value, SCALE_MODE_NAMES[s]) == 0) m->scaling = s;
                if (m->scaling < 0) status = NRT_INVALID;
            } else status = NRT_INVALID;
        } else if ((strcmp(word, "input") == 0 || strcmp(word, "output") == 0) && m->count < MAX_TENSORS) {
            decl_t *d = &m->decls[m->count++];
            char dtype[16];
            if (sscanf(line, "%*s %255s %15s%n", d->name, dtype, &used) != 2 || !parse_dtype(dtype, &d->dtype) ||
                name_taken(m, d->name, m->count - 1)) {
                status = NRT_INVALID;
                break;
            }
            d->usage = word[0] == 'i' ? NRT_TENSOR_USAGE_INPUT : NRT_TENSOR_USAGE_OUTPUT;
            d->size = dtype_size(d->dtype);
            const char *rest = line + used;
            unsigned long extent;
            int n;
            while (sscanf(rest, " %lu%n", &extent, &n) == 1) {
                if (d->ndim == MAX_DIMS || extent == 0 || extent > UINT32_MAX || extent > SIZE_MAX / d->size) {
                    status = NRT_INVALID;
                    break;
                }
                d->shape[d->ndim++] = (uint32_t)extent;
                d->size *= extent;
                rest += n;
            }
            if (sscanf(rest, " %63s", value) == 1) status = NRT_INVALID;
        } else {
            status = NRT_INVALID;
        }
        if (status != NRT_SUCCESS) break;
    }
    free(text);
    /* moe_tkg's and moe_block_tkg's default is NO_SCALE (the blockwise kernels': POST_SCALE,
     * index 0). */
    if ((m->kernel == KERNEL_MOE_TKG || m->kernel == KERNEL_MOE_BLOCK_TKG) && !have_scaling) m->scaling = 1;
    /* The decode kernels' router_act_fn defaults to SIGMOID (router_topk's to SOFTMAX). */
    if ((m->kernel == KERNEL_RMSNORM_ROUTER_TOPK_TKG || m->kernel == KERNEL_MOE_BLOCK_TKG) && !have_router_act_fn)
        m->sigmoid = 1;
    if (m->top_k == 0) m->top_k = 1;
    if (status == NRT_SUCCESS && line_no == 0) status = NRT_INVALID;
    if (status == NRT_SUCCESS && (!have_kernel || !kernel_tensors_consistent(m))) status = NRT_INVALID;
    return status;
}

/* ---- models ---- */

NRT_STATUS nrt_load(const void *neff_bytes, size_t size, int32_t start_vnc, int32_t vnc_count, nrt_model_t **model) {
    NRT_STATUS s = check_running();
    if (s != NRT_SUCCESS) return s;
    if (neff_bytes == NULL || model == NULL || size == 0) return NRT_INVALID;
    int64_t first = start_vnc < 0 ? 0 : start_vnc, count = vnc_count < 0 ? 1 : vnc_count;
    if (start_vnc < -1 || vnc_count == 0 || vnc_count < -1 || first + count > FAKE_VNC_COUNT)
        return NRT_LOAD_NOT_ENOUGH_NC;
    nrt_model_t *m = malloc(sizeof *m);
    if (m == NULL) return NRT_FAIL_HOST_MEM_ALLOC;
    s = parse_neff(neff_bytes, size, m);
    if (s != NRT_SUCCESS) {
        free(m);
        return s;
    }
    for (int i = 0; i < MAX_MODELS; i++) {
        if (live_models[i] == NULL) {
            live_models[i] = m;
            *model = m;
            return NRT_SUCCESS;
        }
    }
    free(m);
    return NRT_RESOURCE;
}

NRT_STATUS nrt_unload(nrt_model_t *model) {
    NRT_STATUS s = check_running();
    if (s != NRT_SUCCESS) return s;
    for (int i = 0; i < MAX_MODELS; i++) {
        if (model != NULL && live_models[i] == model) {
            live_models[i] = NULL;
            free(model);
            return NRT_SUCCESS;
        }
    }
    return NRT_INVALID_HANDLE;
}

NRT_STATUS nrt_get_model_tensor_info(nrt_model_t *model, nrt_tensor_info_array_t **tensor_info) {
    NRT_STATUS s = check_running();
    if (s != NRT_SUCCESS) return s;
    if (!model_is_live(model)) return NRT_INVALID_HANDLE;
    if (tensor_info == NULL) return NRT_INVALID;
    nrt_tensor_info_array_t *info = calloc(1, sizeof *info + (size_t)model->count * sizeof(nrt_tensor_info_t));
    if (info == NULL) return NRT_FAIL_HOST_MEM_ALLOC;
    info->tensor_count = (uint64_t)model->count;
    for (int i = 0; i < model->count; i++) {
        const decl_t *d = &model->decls[i];
        nrt_tensor_info_t *t = &info->tensor_array[i];
        snprintf(t->name, sizeof t->name, "%s", d->name);
        t->usage = d->usage;
        t->size = d->size;
        t->dtype = d->dtype;
        t->ndim = d->ndim;
        t->shape = calloc(d->ndim > 0 ? d->ndim : 1, sizeof(uint32_t));
        if (t->shape == NULL) {
            info->tensor_count = (uint64_t)i;
            nrt_free_model_tensor_info(info);
            return NRT_FAIL_HOST_MEM_ALLOC;
        }
        memcpy(t->shape, d->shape, d->ndim * sizeof(uint32_t));
    }
    *tensor_info = info;
    return NRT_SUCCESS;
}

NRT_STATUS nrt_free_model_tensor_info(nrt_tensor_info_array_t *tensor_info) {
    if (tensor_info == NULL) return NRT_INVALID;
    for (uint64_t i = 0; i < tensor_info->tensor_count; i++) free(tensor_info->tensor_array[i].shape);
    free(tensor_info);
    return NRT_SUCCESS;
}

/* ---- tensors and tensor sets ---- */

NRT_STATUS nrt_tensor_allocate(nrt_tensor_placement_t placement, int vnc, size_t size, const char *name,
                               nrt_tensor_t **tensor) {
    NRT_STATUS s = check_running();
    if (s != NRT_SUCCESS) return s;
    if (tensor == NULL || placement > NRT_TENSOR_PLACEMENT_VIRTUAL) return NRT_INVALID;
    if (placement == NRT_TENSOR_PLACEMENT_DEVICE && (vnc < 0 || vnc >= FAKE_VNC_COUNT)) return NRT_INVALID;
    nrt_tensor_t *t = calloc(1, sizeof *t);
    if (t == NULL) return NRT_FAIL_HOST_MEM_ALLOC;
    t->data = calloc(size > 0 ? size : 1, 1);
    if (t->data == NULL) {
        free(t);
        return NRT_FAIL_HOST_MEM_ALLOC;
    }
    t->size = size;
    snprintf(t->name, sizeof t->name, "%s", name != NULL ? name : "");
    *tensor = t;
    return NRT_SUCCESS;
}

void nrt_tensor_free(nrt_tensor_t **tensor) {
    if (tensor == NULL || *tensor == NULL) return;
    free((*tensor)->data);
    free(*tensor);
    *tensor = NULL;
}

NRT_STATUS nrt_tensor_write(nrt_tensor_t *tensor, const void *buf, size_t offset, size_t size) {
    NRT_STATUS s = check_running();
    if (s != NRT_SUCCESS) return s;
    if (tensor == NULL || (buf == NULL && size > 0)) return NRT_INVALID;
    if (offset > tensor->size || size > tensor->size - offset) return NRT_INVALID;
    if (size > 0) memcpy(tensor->data + offset, buf, size);
    return NRT_SUCCESS;
}

NRT_STATUS nrt_tensor_read(const nrt_tensor_t *tensor, void *buf, size_t offset, size_t size) {
    NRT_STATUS s = check_running();
    if (s != NRT_SUCCESS) return s;
    if (tensor == NULL || (buf == NULL && size > 0)) return NRT_INVALID;
    if (offset > tensor->size || size > tensor->size - offset) return NRT_INVALID;
    if (size > 0) memcpy(buf, tensor->data + offset, size);
    return NRT_SUCCESS;
}

size_t nrt_tensor_get_size(const nrt_tensor_t *tensor) { return tensor == NULL ? 0 : tensor->size; }

NRT_STATUS nrt_allocate_tensor_set(nrt_tensor_set_t **result) {
    NRT_STATUS s = check_running();
    if (s != NRT_SUCCESS) return s;
    if (result == NULL) return NRT_INVALID;
    *result = calloc(1, sizeof **result);
    return *result == NULL ? NRT_FAIL_HOST_MEM_ALLOC : NRT_SUCCESS;
}

void nrt_destroy_tensor_set(nrt_tensor_set_t **tensor_set) {
    if (tensor_set == NULL || *tensor_set == NULL) return;
    for (binding_t *b = (*tensor_set)->head; b != NULL;) {
        binding_t *next = b->next;
        free(b);
        b = next;
    }
    free(*tensor_set);
    *tensor_set = NULL;
}

static binding_t *find_binding(const nrt_tensor_set_t *set, const char *name) {
    for (binding_t *b = set->head; b != NULL; b = b->next)
        if (strcmp(b->name, name) == 0) return b;
    return NULL;
}

NRT_STATUS nrt_add_tensor_to_tensor_set(nrt_tensor_set_t *tensor_set, const char *tensor_name, nrt_tensor_t *tensor) {
    NRT_STATUS s = check_running();
    if (s != NRT_SUCCESS) return s;
    if (tensor_set == NULL || tensor_name == NULL || tensor == NULL || strlen(tensor_name) >= NRT_TENSOR_NAME_MAX)
        return NRT_INVALID;
    binding_t *b = find_binding(tensor_set, tensor_name);
    if (b == NULL) {
        b = calloc(1, sizeof *b);
        if (b == NULL) return NRT_FAIL_HOST_MEM_ALLOC;
        snprintf(b->name, sizeof b->name, "%s", tensor_name);
        b->next = tensor_set->head;
        tensor_set->head = b;
    }
    b->tensor = tensor;
    return NRT_SUCCESS;
}

NRT_STATUS nrt_get_tensor_from_tensor_set(nrt_tensor_set_t *tensor_set, const char *tensor_name, nrt_tensor_t **tensor) {
    NRT_STATUS s = check_running();
    if (s != NRT_SUCCESS) return s;
    if (tensor_set == NULL || tensor_name == NULL || tensor == NULL) return NRT_INVALID;
    binding_t *b = find_binding(tensor_set, tensor_name);
    if (b == NULL) return NRT_INVALID;
    *tensor = b->tensor;
    return NRT_SUCCESS;
}

/* ---- host computations ---- */

static double load(const nrt_tensor_t *t, nrt_dtype_t dtype, size_t i) {
    if (dtype == NRT_DTYPE_BFLOAT16) {
        uint16_t bits;
        uint32_t wide;
        float f;
        memcpy(&bits, t->data + 2 * i, 2);
        wide = (uint32_t)bits << 16;
        memcpy(&f, &wide, 4);
        return f;
    }
    if (dtype == NRT_DTYPE_INT32) {
        int32_t v;
        memcpy(&v, t->data + 4 * i, 4);
        return v;
    }
    float f;
    memcpy(&f, t->data + 4 * i, 4);
    return f;
}

/* The bf16 nearest (ties to even) to `f`, as its bits. */
static uint16_t bf16_bits(float f) {
    uint32_t bits;
    memcpy(&bits, &f, 4);
    if (f != f) bits = 0x7FC00000; /* a quiet NaN stays NaN */
    else bits += 0x7FFF + ((bits >> 16) & 1); /* round to nearest even */
    return (uint16_t)(bits >> 16);
}

/* `value` rounded to float dtype `dtype` (f32, or f32 then bf16 as store writes it). */
static double rounded_to(nrt_dtype_t dtype, double value) {
    float f = (float)value;
    if (dtype != NRT_DTYPE_BFLOAT16) return f;
    uint32_t wide = (uint32_t)bf16_bits(f) << 16;
    memcpy(&f, &wide, 4);
    return f;
}

static void store(nrt_tensor_t *t, nrt_dtype_t dtype, size_t i, double value) {
    if (dtype == NRT_DTYPE_INT32) {
        int32_t v = (int32_t)value;
        memcpy(t->data + 4 * i, &v, 4);
        return;
    }
    float f = (float)value;
    if (dtype == NRT_DTYPE_BFLOAT16) {
        uint16_t half = bf16_bits(f);
        memcpy(t->data + 2 * i, &half, 2);
        return;
    }
    memcpy(t->data + 4 * i, &f, 4);
}

/* The bound tensors of one execution, in declaration order. */
typedef struct {
    const nrt_model_t *model;
    nrt_tensor_t *tensors[MAX_TENSORS];
} bound_t;

static nrt_tensor_t *bound(const bound_t *b, const char *name, nrt_tensor_usage_t usage, nrt_dtype_t *dtype) {
    const decl_t *d = find_decl(b->model, name, usage);
    if (d == NULL) return NULL;
    *dtype = d->dtype;
    return b->tensors[d - b->model->decls];
}

/* The `k` distinct indices of the largest of `e` scores, descending, ties to the lower index. */
static void choose_top_k(const double *score, size_t e, size_t k, size_t *chosen) {
    for (size_t slot = 0; slot < k; slot++) {
        size_t best = e;
        for (size_t j = 0; j < e; j++) {
            int taken = 0;
            for (size_t s = 0; s < slot; s++) taken |= chosen[s] == j;
            if (!taken && (best == e || score[j] > score[best])) best = j;
        }
        chosen[slot] = best;
    }
}

/* One token's routing by router_topk's pipelines from its logits `row [E]`: `chosen [K]` and
 * `aff [E]`, the affinities as stored (dense under ACT1 without norm_topk_prob, else zero
 * outside the K). `score [E]` holds the selection bias on entry (it moves the choice, never the
 * affinities) and is scratch after. */
static void route_token(const nrt_model_t *m, const double *row, size_t e, size_t k, double *score, double *aff,
                        size_t *chosen) {
    double max = -INFINITY, sum = 0.0, chosen_sum = 0.0;
    for (size_t j = 0; j < e; j++)
        if (row[j] > max) max = row[j];
    for (size_t j = 0; j < e; j++) {
        aff[j] = m->sigmoid ? 1.0 / (1.0 + exp(-row[j])) : exp(row[j] - max);
        sum += aff[j];
    }
    if (!m->sigmoid)
        for (size_t j = 0; j < e; j++) aff[j] /= sum;
    /* ACT1 chooses by affinity, ACT2 by logit. */
    for (size_t j = 0; j < e; j++) score[j] += (m->act2 ? row : aff)[j];
    choose_top_k(score, e, k, chosen);
    /* ACT2 activates the K chosen logits: a softmax over them, or a sigmoid of each. */
    if (m->act2)
        for (size_t slot = 0; slot < k; slot++) {
            double l = row[chosen[slot]];
            aff[chosen[slot]] = m->sigmoid ? 1.0 / (1.0 + exp(-l)) : exp(l - row[chosen[0]]);
        }
    for (size_t slot = 0; slot < k; slot++) chosen_sum += aff[chosen[slot]];
    /* Renormalised: ACT1 with norm_topk_prob, ACT2's softmax; dense: ACT1 without it. */
    int renormalise = m->act2 ? !m->sigmoid : m->norm_topk_prob, dense = !m->act2 && !m->norm_topk_prob;
    for (size_t slot = 0; slot < k; slot++) {
        double a = aff[chosen[slot]];
        score[chosen[slot]] = renormalise ? a / chosen_sum : a;
    }
    if (!dense)
        for (size_t j = 0; j < e; j++) aff[j] = 0.0;
    for (size_t slot = 0; slot < k; slot++) aff[chosen[slot]] = score[chosen[slot]];
}

static NRT_STATUS run_router_topk(const bound_t *b) {
    const nrt_model_t *m = b->model;
    const nrt_tensor_usage_t in = NRT_TENSOR_USAGE_INPUT, out = NRT_TENSOR_USAGE_OUTPUT;
    size_t t = dim(m, "x", in, m->x_h_t), h = dim(m, "x", in, !m->x_h_t), e = dim(m, "w", in, 1);
    size_t k = dim(m, "expert_index", out, 1);
    nrt_dtype_t dx, dw, db = NRT_DTYPE_FLOAT32, ds = NRT_DTYPE_FLOAT32, dl, di, da, dt = NRT_DTYPE_FLOAT32;
    nrt_tensor_t *x = bound(b, "x", in, &dx), *w = bound(b, "w", in, &dw), *bias = bound(b, "w_bias", in, &db);
    nrt_tensor_t *selection = bound(b, "selection_bias", in, &ds);
    nrt_tensor_t *logits = bound(b, "router_logits", out, &dl), *index = bound(b, "expert_index", out, &di);
    nrt_tensor_t *aff = bound(b, "expert_affinities", out, &da), *topk = bound(b, "topk_affinities", out, &dt);
    double *row = malloc(e * sizeof *row), *p = malloc(e * sizeof *p), *score = malloc(e * sizeof *score);
    size_t *chosen = malloc(k * sizeof *chosen);
    if (row == NULL || p == NULL || score == NULL || chosen == NULL) {
        free(row), free(p), free(score), free(chosen);
        return NRT_FAIL_HOST_MEM_ALLOC;
    }
    for (size_t tok = 0; tok < t; tok++) {
        for (size_t j = 0; j < e; j++) {
            double dot = bias != NULL ? load(bias, db, j) : 0.0;
            for (size_t c = 0; c < h; c++)
                dot += load(x, dx, m->x_h_t ? c * t + tok : tok * h + c) * load(w, dw, c * e + j);
            row[j] = (float)dot;
        }
        for (size_t j = 0; j < e; j++) score[j] = selection != NULL ? load(selection, ds, j) : 0.0;
        route_token(m, row, e, k, score, p, chosen);
        for (size_t j = 0; j < e; j++) {
            store(logits, dl, tok * e + j, row[j]);
            store(aff, da, tok * e + j, p[j]);
        }
        for (size_t slot = 0; slot < k; slot++) {
            store(index, di, tok * k + slot, (double)chosen[slot]);
            if (topk != NULL) store(topk, dt, tok * k + slot, p[chosen[slot]]);
        }
    }
    free(row), free(p), free(score), free(chosen);
    return NRT_SUCCESS;
}

static NRT_STATUS run_rmsnorm_router_topk_tkg(const bound_t *b) {
    const nrt_model_t *m = b->model;
    const nrt_tensor_usage_t in = NRT_TENSOR_USAGE_INPUT, out = NRT_TENSOR_USAGE_OUTPUT;
    size_t t = dim(m, "norm_output", out, 0), h = dim(m, "norm_output", out, 1);
    size_t e = dim(m, "router_weights", in, 1), k = dim(m, "expert_index", out, 1);
    size_t divisor = m->hidden_actual != 0 ? m->hidden_actual : h;
    int eager = m->eager;
    nrt_dtype_t dx, dg, dw, db = NRT_DTYPE_FLOAT32, dn, di, da;
    nrt_tensor_t *x = bound(b, "hidden_states", in, &dx), *gamma = bound(b, "gamma", in, &dg);
    nrt_tensor_t *w = bound(b, "router_weights", in, &dw), *bias = bound(b, "router_bias", in, &db);
    nrt_tensor_t *norm = bound(b, "norm_output", out, &dn), *index = bound(b, "expert_index", out, &di);
    nrt_tensor_t *aff = bound(b, "expert_affinities", out, &da);
    double *normed = malloc(h * sizeof *normed), *row = malloc(e * sizeof *row);
    size_t *chosen = malloc(k * sizeof *chosen);
    if (normed == NULL || row == NULL || chosen == NULL) {
        free(normed), free(row), free(chosen);
        return NRT_FAIL_HOST_MEM_ALLOC;
    }
    for (size_t tok = 0; tok < t; tok++) {
        double squares = 0.0;
        for (size_t c = 0; c < h; c++) squares += load(x, dx, tok * h + c) * load(x, dx, tok * h + c);
        double r = 1.0 / sqrt(squares / (double)divisor + m->eps);
        for (size_t c = 0; c < h; c++) {
            double y = load(x, dx, tok * h + c) * r * load(gamma, dg, c);
            store(norm, dn, tok * h + c, y);
            /* The router reads the norm in its operands' dtype. */
            normed[c] = rounded_to(dw, y);
        }
        for (size_t j = 0; j < e; j++) {
            double dot = bias != NULL ? load(bias, db, j) : 0.0;
            for (size_t c = 0; c < h; c++) dot += normed[c] * load(w, dw, c * e + j);
            row[j] = (float)dot;
        }
        /* ACT2: the K largest logits, activated among themselves. */
        choose_top_k(row, e, k, chosen);
        double sum = 0.0;
        for (size_t slot = 0; slot < k; slot++) sum += exp(row[chosen[slot]] - row[chosen[0]]);
        if (!eager)
            for (size_t j = 0; j < e; j++) store(aff, da, tok * e + j, 0.0);
        for (size_t slot = 0; slot < k; slot++) {
            double l = row[chosen[slot]];
            double a = m->sigmoid ? 1.0 / (1.0 + exp(-l)) : exp(l - row[chosen[0]]) / sum;
            store(index, di, tok * k + slot, (double)chosen[slot]);
            store(aff, da, eager ? tok * k + slot : tok * e + chosen[slot], a);
        }
    }
    free(normed), free(row), free(chosen);
    return NRT_SUCCESS;
}

/* The block plan of a blockwise_mm (or backward) stand-in and the sizes its tensors imply. */
typedef struct {
    /* T tokens; `rows` of hidden_states: T+1, or T with skip_token. */
    size_t t, rows, h, e, inter, n, bs;
    int skip_token;
    const nrt_tensor_t *pos, *blk;
    nrt_dtype_t dp, de;
} plan_t;

static plan_t blockwise_plan(const bound_t *b) {
    const nrt_model_t *m = b->model;
    const nrt_tensor_usage_t in = NRT_TENSOR_USAGE_INPUT;
    plan_t p;
    p.skip_token = m->skip_token;
    p.rows = dim(m, "hidden_states", in, 0);
    p.t = p.rows - (m->skip_token ? 0 : 1);
    p.h = dim(m, "hidden_states", in, 1);
    p.e = dim(m, "gate_up_proj_weight", in, 0);
    p.inter = dim(m, "gate_up_proj_weight", in, 3);
    p.n = dim(m, "block_to_expert", in, 0);
    p.bs = dim(m, "token_position_to_id", in, 0) / p.n;
    p.pos = bound(b, "token_position_to_id", in, &p.dp);
    p.blk = bound(b, "block_to_expert", in, &p.de);
    return p;
}

/* Slot `slot` of block `blockn`: whether it holds a real token (padding is T, the zero row, or −1
 * with skip_token), and that token (T for padding) and expert; NRT_EXEC_OOB for an id out of
 * range (NaN included), as the hardware's indirect DMA reports it. */
static NRT_STATUS plan_slot(const plan_t *p, size_t blockn, size_t slot, int *used, size_t *token, size_t *expert) {
    double expert_id = load(p->blk, p->de, blockn), token_id = load(p->pos, p->dp, blockn * p->bs + slot);
    double padding = p->skip_token ? -1.0 : (double)p->t;
    if (!(expert_id >= 0 && expert_id < (double)p->e) ||
        !(token_id == padding || (token_id >= 0 && token_id < (double)p->t)))
        return NRT_EXEC_OOB;
    *used = token_id != padding;
    *token = *used ? (size_t)token_id : p->t;
    *expert = (size_t)expert_id;
    return NRT_SUCCESS;
}

static NRT_STATUS run_blockwise_mm(const bound_t *b) {
    const nrt_tensor_usage_t in = NRT_TENSOR_USAGE_INPUT, out = NRT_TENSOR_USAGE_OUTPUT;
    const plan_t plan = blockwise_plan(b);
    size_t t = plan.t, h = plan.h, e = plan.e, inter = plan.inter, n = plan.n, bs = plan.bs;
    nrt_dtype_t dx, da, dg, dd, dout;
    nrt_tensor_t *x = bound(b, "hidden_states", in, &dx), *aff = bound(b, "expert_affinities_masked", in, &da);
    nrt_tensor_t *gu = bound(b, "gate_up_proj_weight", in, &dg), *down = bound(b, "down_proj_weight", in, &dd);
    nrt_dtype_t dgt = NRT_DTYPE_FLOAT32, ddn = NRT_DTYPE_FLOAT32, dgb = NRT_DTYPE_FLOAT32, ddb = NRT_DTYPE_FLOAT32;
    nrt_tensor_t *output = bound(b, "output", out, &dout);
    /* Optional biases [E, 2, I] and [E, H], added before the clamps and the affinity scaling. */
    nrt_tensor_t *gu_bias = bound(b, "gate_and_up_proj_bias", in, &dgb);
    nrt_tensor_t *down_bias = bound(b, "down_proj_bias", in, &ddb);
    /* Optional checkpoints: gate/up before the activation [N, 2, I, B], the down projection
     * before affinity scaling [N, B, H]; zeros in padding slots. */
    nrt_tensor_t *gate_up_t = bound(b, "gate_up_activations_T", out, &dgt);
    nrt_tensor_t *down_act = bound(b, "down_activations", out, &ddn);
    if (gate_up_t != NULL) memset(gate_up_t->data, 0, gate_up_t->size);
    if (down_act != NULL) memset(down_act->data, 0, down_act->size);
    /* output [T+1, H] ([T, H] with skip_token), accumulated in T+1 rows. A padding slot runs its
     * block's expert on the zero row T (non-zero with a bias or a clamp that moves 0), weighted by
     * row T's zero affinity under POST_SCALE. */
    double *acc = calloc((t + 1) * h, sizeof *acc), *act = malloc(inter * sizeof *act);
    if (acc == NULL || act == NULL) {
        free(acc), free(act);
        return NRT_FAIL_HOST_MEM_ALLOC;
    }
    NRT_STATUS status = NRT_SUCCESS;
    for (size_t blockn = 0; blockn < n && status == NRT_SUCCESS; blockn++) {
        for (size_t slot = 0; slot < bs; slot++) {
            size_t tok, ex;
            int used;
            status = plan_slot(&plan, blockn, slot, &used, &tok, &ex);
            if (status != NRT_SUCCESS) break;
            /* PRE_SCALE multiplies the token row by the affinity, POST_SCALE the output. Row T
             * is zeros, in hidden_states or (skip_token) never read. */
            int in_rows = tok < plan.rows;
            double a = in_rows ? load(aff, da, tok * e + ex) : 0.0;
            double row_scale = b->model->scaling >= 2 ? a : 1.0, out_scale = b->model->scaling == 0 ? a : 1.0;
            for (size_t j = 0; j < inter; j++) {
                double gate = 0.0, up = 0.0;
                for (size_t c = 0; c < h; c++) {
                    double xv = in_rows ? row_scale * load(x, dx, tok * h + c) : 0.0;
                    gate += xv * load(gu, dg, ((ex * h + c) * 2 + 0) * inter + j);
                    up += xv * load(gu, dg, ((ex * h + c) * 2 + 1) * inter + j);
                }
                if (gu_bias != NULL) {
                    gate += load(gu_bias, dgb, (ex * 2 + 0) * inter + j);
                    up += load(gu_bias, dgb, (ex * 2 + 1) * inter + j);
                }
                gate = clamp_apply(b->model, 0, gate);
                up = clamp_apply(b->model, 1, up);
                double unused;
                act[j] = gate_act(b->model->act_fn, gate, &unused) * up;
                if (gate_up_t != NULL) {
                    store(gate_up_t, dgt, ((blockn * 2 + 0) * inter + j) * bs + slot, gate);
                    store(gate_up_t, dgt, ((blockn * 2 + 1) * inter + j) * bs + slot, up);
                }
            }
            for (size_t c = 0; c < h; c++) {
                double y = 0.0;
                for (size_t j = 0; j < inter; j++) y += act[j] * load(down, dd, (ex * inter + j) * h + c);
                if (down_bias != NULL) y += load(down_bias, ddb, ex * h + c);
                if (b->model->store_blocks) acc[tok * h + c] = out_scale * y;
                else acc[tok * h + c] += out_scale * y;
                if (down_act != NULL) store(down_act, ddn, (blockn * bs + slot) * h + c, y);
            }
        }
    }
    if (status == NRT_SUCCESS)
        for (size_t i = 0; i < plan.rows * h; i++) store(output, dout, i, acc[i]);
    free(acc), free(act);
    return status;
}

/* blockwise_mm's backward from the forward's checkpoints: per slot of token t on expert e with
 * affinity a and output gradient g, d_affinity += g·down, then through the down projection
 * (scaled by a) and SwiGLU back to the weights and to hidden_states. */
static NRT_STATUS run_blockwise_mm_bwd(const bound_t *b) {
    const nrt_tensor_usage_t in = NRT_TENSOR_USAGE_INPUT, out = NRT_TENSOR_USAGE_OUTPUT;
    const plan_t plan = blockwise_plan(b);
    size_t rows = plan.rows, h = plan.h, e = plan.e, inter = plan.inter, n = plan.n, bs = plan.bs;
    nrt_dtype_t dx, da, dg, dd, dgt, ddn, dy, o1, o2, o3, o4;
    nrt_tensor_t *x = bound(b, "hidden_states", in, &dx), *aff = bound(b, "expert_affinities_masked", in, &da);
    nrt_tensor_t *gu = bound(b, "gate_up_proj_weight", in, &dg), *down = bound(b, "down_proj_weight", in, &dd);
    nrt_tensor_t *gate_up_t = bound(b, "gate_up_proj_act_checkpoint_T", in, &dgt);
    nrt_tensor_t *down_act = bound(b, "down_proj_act_checkpoint", in, &ddn);
    nrt_tensor_t *grad = bound(b, "output_hidden_states_grad", in, &dy);
    nrt_tensor_t *dx_out = bound(b, "hidden_states_grad", out, &o1);
    nrt_tensor_t *daff_out = bound(b, "expert_affinities_masked_grad", out, &o2);
    nrt_tensor_t *dgu_out = bound(b, "gate_up_proj_weight_grad", out, &o3);
    nrt_tensor_t *ddown_out = bound(b, "down_proj_weight_grad", out, &o4);
    /* Optional bias gradients [E, 2, I] and [E, H]. */
    nrt_dtype_t o5 = NRT_DTYPE_FLOAT32, o6 = NRT_DTYPE_FLOAT32;
    nrt_tensor_t *dgub_out = bound(b, "gate_and_up_proj_bias_grad", out, &o5);
    nrt_tensor_t *ddb_out = bound(b, "down_proj_bias_grad", out, &o6);
    /* hidden_states_grad [T+1, H] ([T, H] with skip_token): the padding row's gradient is zero. */
    double *dxs = calloc(rows * h, sizeof *dxs), *daff = calloc(rows * e, sizeof *daff);
    double *dgu = calloc(e * h * 2 * inter, sizeof *dgu), *ddown = calloc(e * inter * h, sizeof *ddown);
    double *dgate = malloc(inter * sizeof *dgate), *dup = malloc(inter * sizeof *dup);
    double *dgub = calloc(e * 2 * inter, sizeof *dgub), *ddb = calloc(e * h, sizeof *ddb);
    NRT_STATUS status = NRT_SUCCESS;
    if (dxs == NULL || daff == NULL || dgu == NULL || ddown == NULL || dgate == NULL || dup == NULL || dgub == NULL ||
        ddb == NULL)
        status = NRT_FAIL_HOST_MEM_ALLOC;
    for (size_t blockn = 0; blockn < n && status == NRT_SUCCESS; blockn++) {
        for (size_t slot = 0; slot < bs; slot++) {
            size_t tok, ex;
            int used;
            status = plan_slot(&plan, blockn, slot, &used, &tok, &ex);
            if (status != NRT_SUCCESS) break;
            if (!used) continue;
            double a = load(aff, da, tok * e + ex), d_a = 0.0;
            int pre = b->model->scaling >= 2, post = b->model->scaling == 0;
            double row_scale = pre ? a : 1.0, out_scale = post ? a : 1.0;
            if (post)
                for (size_t c = 0; c < h; c++)
                    d_a += load(grad, dy, tok * h + c) * load(down_act, ddn, (blockn * bs + slot) * h + c);
            for (size_t j = 0; j < inter; j++) {
                double gate = load(gate_up_t, dgt, ((blockn * 2 + 0) * inter + j) * bs + slot);
                double up = load(gate_up_t, dgt, ((blockn * 2 + 1) * inter + j) * bs + slot);
                double f_grad, f = gate_act(b->model->act_fn, gate, &f_grad), d_act = 0.0;
                for (size_t c = 0; c < h; c++) {
                    double g = out_scale * load(grad, dy, tok * h + c);
                    d_act += load(down, dd, (ex * inter + j) * h + c) * g;
                    ddown[(ex * inter + j) * h + c] += f * up * g;
                }
                /* The checkpoint holds the clamped projections: no gradient at or past a limit. */
                dgate[j] = clamp_passes(b->model, 0, gate) ? d_act * up * f_grad : 0.0;
                dup[j] = clamp_passes(b->model, 1, up) ? d_act * f : 0.0;
                dgub[(ex * 2 + 0) * inter + j] += dgate[j];
                dgub[(ex * 2 + 1) * inter + j] += dup[j];
            }
            for (size_t c = 0; c < h; c++) ddb[ex * h + c] += out_scale * load(grad, dy, tok * h + c);
            /* The projection saw x' = row_scale · x: d x = row_scale · d x', and under PRE_SCALE
             * d affinity = <d x', x>. */
            for (size_t c = 0; c < h; c++) {
                double raw = load(x, dx, tok * h + c), xv = row_scale * raw, acc = 0.0;
                for (size_t j = 0; j < inter; j++) {
                    dgu[((ex * h + c) * 2 + 0) * inter + j] += xv * dgate[j];
                    dgu[((ex * h + c) * 2 + 1) * inter + j] += xv * dup[j];
                    acc += load(gu, dg, ((ex * h + c) * 2 + 0) * inter + j) * dgate[j] +
                           load(gu, dg, ((ex * h + c) * 2 + 1) * inter + j) * dup[j];
                }
                dxs[tok * h + c] += row_scale * acc;
                if (pre) d_a += raw * acc;
            }
            daff[tok * e + ex] += d_a;
        }
    }
    if (status == NRT_SUCCESS) {
        for (size_t i = 0; i < rows * h; i++) store(dx_out, o1, i, dxs[i]);
        for (size_t i = 0; i < rows * e; i++) store(daff_out, o2, i, daff[i]);
        for (size_t i = 0; i < e * h * 2 * inter; i++) store(dgu_out, o3, i, dgu[i]);
        for (size_t i = 0; i < e * inter * h; i++) store(ddown_out, o4, i, ddown[i]);
        if (dgub_out != NULL)
            for (size_t i = 0; i < e * 2 * inter; i++) store(dgub_out, o5, i, dgub[i]);
        if (ddb_out != NULL)
            for (size_t i = 0; i < e * h; i++) store(ddb_out, o6, i, ddb[i]);
    }
    free(dxs), free(daff), free(dgu), free(ddown), free(dgate), free(dup), free(dgub), free(ddb);
    return status;
}

/* moe_tkg: each token through its routes' experts (its K, or every expert held), each output
 * weighted (NO_SCALE: 1; POST_SCALE: the affinity, eager or gathered, masked by the selection
 * count in all-expert mode) and summed in f64. */
/* The experts' weights and biases of a moe_tkg or moe_block_tkg stand-in. */
typedef struct {
    const nrt_model_t *model;
    size_t h, inter;
    const nrt_tensor_t *gu;
    nrt_dtype_t dg;
    const nrt_tensor_t *down;
    nrt_dtype_t dd;
    const nrt_tensor_t *gu_bias;
    nrt_dtype_t dgb;
    const nrt_tensor_t *down_bias;
    nrt_dtype_t ddb;
} experts_t;

/* acc [H] += weight · expert ex's gated MLP of row [H] (act: [I] scratch). */
static void expert_add(const experts_t *o, size_t ex, const double *row, double weight, double *act, double *acc) {
    size_t h = o->h, inter = o->inter;
    for (size_t j = 0; j < inter; j++) {
        double gate = 0.0, up = 0.0;
        for (size_t c = 0; c < h; c++) {
            gate += row[c] * load(o->gu, o->dg, ((ex * h + c) * 2 + 0) * inter + j);
            up += row[c] * load(o->gu, o->dg, ((ex * h + c) * 2 + 1) * inter + j);
        }
        if (o->gu_bias != NULL) {
            gate += load(o->gu_bias, o->dgb, (ex * 2 + 0) * inter + j);
            up += load(o->gu_bias, o->dgb, (ex * 2 + 1) * inter + j);
        }
        double unused;
        act[j] = gate_act(o->model->act_fn, clamp_apply(o->model, 0, gate), &unused) * clamp_apply(o->model, 1, up);
    }
    for (size_t c = 0; c < h; c++) {
        double y = 0.0;
        for (size_t j = 0; j < inter; j++) y += act[j] * load(o->down, o->dd, (ex * inter + j) * h + c);
        if (o->down_bias != NULL) y += load(o->down_bias, o->ddb, ex * h + c);
        acc[c] += weight * y;
    }
}

static NRT_STATUS run_moe_tkg(const bound_t *b) {
    const nrt_model_t *m = b->model;
    const nrt_tensor_usage_t in = NRT_TENSOR_USAGE_INPUT, out = NRT_TENSOR_USAGE_OUTPUT;
    size_t t = dim(m, "hidden_input", in, 0), h = dim(m, "hidden_input", in, 1);
    size_t el = dim(m, "expert_gate_up_weights", in, 0), inter = dim(m, "expert_gate_up_weights", in, 3);
    size_t e = dim(m, "expert_affinities", in, 1), k = dim(m, "expert_index", in, 1);
    nrt_dtype_t dx, dg, dd, da, di, dout, dr = NRT_DTYPE_INT32, dgb = NRT_DTYPE_FLOAT32, ddb = NRT_DTYPE_FLOAT32;
    nrt_dtype_t dea = NRT_DTYPE_FLOAT32;
    nrt_tensor_t *x = bound(b, "hidden_input", in, &dx), *gu = bound(b, "expert_gate_up_weights", in, &dg);
    nrt_tensor_t *down = bound(b, "expert_down_weights", in, &dd), *aff = bound(b, "expert_affinities", in, &da);
    nrt_tensor_t *index = bound(b, "expert_index", in, &di), *output = bound(b, "output", out, &dout);
    nrt_tensor_t *rank_id = bound(b, "rank_id", in, &dr), *gu_bias = bound(b, "expert_gate_up_bias", in, &dgb);
    nrt_tensor_t *down_bias = bound(b, "expert_down_bias", in, &ddb);
    nrt_tensor_t *eager = bound(b, "expert_affinities_eager", in, &dea);
    int post_scale = m->scaling == 0;
    size_t first = 0, routes = m->all_expert ? el : k;
    if (m->all_expert && post_scale) {
        double rank = rank_id != NULL ? load(rank_id, dr, 0) : -1.0;
        if (!(rank >= 0 && (rank + 1.0) * (double)el <= (double)e)) return NRT_EXEC_OOB;
        first = (size_t)rank * el;
    }
    for (size_t i = 0; i < t * k; i++) {
        double id = load(index, di, i);
        if (!(id >= 0 && id < (double)(m->all_expert ? e : el))) return NRT_EXEC_OOB;
    }
    double *acc = calloc(t * h, sizeof *acc), *act = malloc(inter * sizeof *act), *row = malloc(h * sizeof *row);
    if (acc == NULL || act == NULL || row == NULL) {
        free(acc), free(act), free(row);
        return NRT_FAIL_HOST_MEM_ALLOC;
    }
    const experts_t ops = {m, h, inter, gu, dg, down, dd, gu_bias, dgb, down_bias, ddb};
    for (size_t tok = 0; tok < t; tok++) {
        for (size_t route = 0; route < routes; route++) {
            size_t ex = m->all_expert ? route : (size_t)load(index, di, tok * k + route);
            double weight = 1.0;
            if (post_scale && m->all_expert) {
                weight = load(aff, da, tok * e + first + ex);
                if (m->mask_unselected) {
                    double count = 0.0;
                    for (size_t slot = 0; slot < k; slot++) count += load(index, di, tok * k + slot) == (double)(first + ex);
                    weight *= count;
                }
            } else if (post_scale) {
                weight = eager != NULL ? load(eager, dea, tok * k + route) : load(aff, da, tok * e + ex);
            }
            if (weight == 0.0) continue;
            for (size_t c = 0; c < h; c++) row[c] = load(x, dx, tok * h + c);
            expert_add(&ops, ex, row, weight, act, acc + tok * h);
        }
    }
    for (size_t i = 0; i < t * h; i++) store(output, dout, i, acc[i]);
    free(acc), free(act), free(row);
    return NRT_SUCCESS;
}

/* moe_block_tkg: the RMSNorm rounded to inp's dtype, the router on it in its operands' dtype
 * (router_topk's pipelines), and moe_tkg's experts on the norm (unselected experts masked
 * where ACT1's affinities are dense). */
static NRT_STATUS run_moe_block_tkg(const bound_t *b) {
    const nrt_model_t *m = b->model;
    const nrt_tensor_usage_t in = NRT_TENSOR_USAGE_INPUT, out = NRT_TENSOR_USAGE_OUTPUT;
    size_t t = dim(m, "out", out, 0), h = dim(m, "out", out, 1), e = dim(m, "router_weights", in, 1);
    size_t el = dim(m, "expert_gate_up_weights", in, 0), inter = dim(m, "expert_gate_up_weights", in, 3);
    size_t k = m->top_k, divisor = m->hidden_actual != 0 ? m->hidden_actual : h;
    nrt_dtype_t dx, dgm, dw, db = NRT_DTYPE_FLOAT32, dg, dd, dr = NRT_DTYPE_INT32, dgb = NRT_DTYPE_FLOAT32;
    nrt_dtype_t ddb = NRT_DTYPE_FLOAT32, dout, dl = NRT_DTYPE_FLOAT32;
    nrt_tensor_t *x = bound(b, "inp", in, &dx), *gamma = bound(b, "gamma", in, &dgm);
    nrt_tensor_t *w = bound(b, "router_weights", in, &dw), *bias = bound(b, "router_bias", in, &db);
    nrt_tensor_t *gu = bound(b, "expert_gate_up_weights", in, &dg), *down = bound(b, "expert_down_weights", in, &dd);
    nrt_tensor_t *gu_bias = bound(b, "expert_gate_up_bias", in, &dgb);
    nrt_tensor_t *down_bias = bound(b, "expert_down_bias", in, &ddb), *rank_id = bound(b, "rank_id", in, &dr);
    nrt_tensor_t *output = bound(b, "out", out, &dout), *logits = bound(b, "router_logits", out, &dl);
    if (k == 0 || k > e) return NRT_INVALID;
    size_t first = 0;
    if (m->all_expert) {
        double rank = rank_id != NULL ? load(rank_id, dr, 0) : -1.0;
        if (!(rank >= 0 && (rank + 1.0) * (double)el <= (double)e)) return NRT_EXEC_OOB;
        first = (size_t)rank * el;
    }
    double *normed = malloc(h * sizeof *normed), *row = malloc(e * sizeof *row), *aff = malloc(e * sizeof *aff);
    double *score = malloc(e * sizeof *score), *act = malloc(inter * sizeof *act), *acc = malloc(h * sizeof *acc);
    size_t *chosen = malloc(k * sizeof *chosen);
    if (normed == NULL || row == NULL || aff == NULL || score == NULL || act == NULL || acc == NULL || chosen == NULL) {
        free(normed), free(row), free(aff), free(score), free(act), free(acc), free(chosen);
        return NRT_FAIL_HOST_MEM_ALLOC;
    }
    const experts_t ops = {m, h, inter, gu, dg, down, dd, gu_bias, dgb, down_bias, ddb};
    int post_scale = m->scaling == 0, masked = !m->act2 && !m->norm_topk_prob;
    for (size_t tok = 0; tok < t; tok++) {
        double squares = 0.0;
        for (size_t c = 0; c < h; c++) squares += load(x, dx, tok * h + c) * load(x, dx, tok * h + c);
        double r = 1.0 / sqrt(squares / (double)divisor + m->eps);
        for (size_t c = 0; c < h; c++) normed[c] = rounded_to(dx, load(x, dx, tok * h + c) * r * load(gamma, dgm, c));
        for (size_t j = 0; j < e; j++) {
            double dot = bias != NULL ? load(bias, db, j) : 0.0;
            for (size_t c = 0; c < h; c++) dot += rounded_to(dw, normed[c]) * load(w, dw, c * e + j);
            row[j] = (float)dot;
            score[j] = 0.0;
            if (logits != NULL) store(logits, dl, tok * e + j, row[j]);
        }
        route_token(m, row, e, k, score, aff, chosen);
        for (size_t c = 0; c < h; c++) acc[c] = 0.0;
        for (size_t route = 0; route < (m->all_expert ? el : k); route++) {
            size_t ex = m->all_expert ? route : chosen[route];
            double weight = post_scale ? aff[first + ex] : 1.0;
            if (m->all_expert && post_scale && masked) {
                double count = 0.0;
                for (size_t slot = 0; slot < k; slot++) count += chosen[slot] == first + ex;
                weight *= count;
            }
            if (weight != 0.0) expert_add(&ops, ex, normed, weight, act, acc);
        }
        for (size_t c = 0; c < h; c++) store(output, dout, tok * h + c, acc[c]);
    }
    free(normed), free(row), free(aff), free(score), free(act), free(acc), free(chosen);
    return NRT_SUCCESS;
}

/* topk: per row of inp (its leading axes), the K largest values of the last axis and their
 * positions, picked one by one (the first of equal values first), then put in ascending
 * position where sorted_flag is 0; K = V is the row as given. */
static NRT_STATUS run_topk(const bound_t *b) {
    const nrt_model_t *m = b->model;
    const nrt_tensor_usage_t in = NRT_TENSOR_USAGE_INPUT, out = NRT_TENSOR_USAGE_OUTPUT;
    const decl_t *d = find_decl(m, "inp", in);
    size_t v = d->shape[d->ndim - 1], k = dim(m, "topk_values", out, d->ndim - 1), rows = 1;
    for (uint32_t axis = 0; axis + 1 < d->ndim; axis++) rows *= d->shape[axis];
    nrt_dtype_t dx, dv, di;
    nrt_tensor_t *x = bound(b, "inp", in, &dx), *values = bound(b, "topk_values", out, &dv);
    nrt_tensor_t *indices = bound(b, "topk_indices", out, &di);
    unsigned char *taken = malloc(v);
    size_t *chosen = malloc(k * sizeof *chosen);
    if (taken == NULL || chosen == NULL) {
        free(taken), free(chosen);
        return NRT_FAIL_HOST_MEM_ALLOC;
    }
    for (size_t r = 0; r < rows; r++) {
        memset(taken, 0, v);
        for (size_t slot = 0; slot < k; slot++) {
            size_t best = slot; /* K = V: the row as given */
            if (k < v) {
                best = v;
                for (size_t j = 0; j < v; j++)
                    if (!taken[j] && (best == v || load(x, dx, r * v + j) > load(x, dx, r * v + best))) best = j;
            }
            chosen[slot] = best;
            taken[best] = 1;
        }
        /* Unsorted: the chosen positions ascending. */
        if (m->unsorted)
            for (size_t j = 0, next = 0; j < v && next < k; j++)
                if (taken[j]) chosen[next++] = j;
        for (size_t slot = 0; slot < k; slot++) {
            store(values, dv, r * k + slot, load(x, dx, r * v + chosen[slot]));
            store(indices, di, r * k + slot, (double)chosen[slot]);
        }
    }
    free(taken), free(chosen);
    return NRT_SUCCESS;
}

/* topk_reduce: output[t] = the sum (f64) of the first K rows of input whose token id, the bits
 * of columns H (low half) and H + 1 (high half), is token_base_index + t. */
static NRT_STATUS run_topk_reduce(const bound_t *b) {
    const nrt_model_t *m = b->model;
    const nrt_tensor_usage_t in = NRT_TENSOR_USAGE_INPUT, out = NRT_TENSOR_USAGE_OUTPUT;
    size_t t = dim(m, "output", out, 0), h = dim(m, "output", out, 1), rows = dim(m, "input", in, 0);
    nrt_dtype_t dx, dout;
    nrt_tensor_t *x = bound(b, "input", in, &dx), *output = bound(b, "output", out, &dout);
    double *acc = calloc(t * h, sizeof *acc);
    size_t *summed = calloc(t, sizeof *summed);
    if (acc == NULL || summed == NULL) {
        free(acc), free(summed);
        return NRT_FAIL_HOST_MEM_ALLOC;
    }
    for (size_t r = 0; r < rows; r++) {
        uint16_t low, high;
        memcpy(&low, x->data + 2 * (r * (h + 2) + h), 2);
        memcpy(&high, x->data + 2 * (r * (h + 2) + h + 1), 2);
        int64_t token = (int64_t)(int32_t)((uint32_t)high << 16 | low) - m->token_base;
        if (token < 0 || token >= (int64_t)t || summed[token] == m->rows_per_token) continue;
        summed[token]++;
        for (size_t c = 0; c < h; c++) acc[token * h + c] += load(x, dx, r * (h + 2) + c);
    }
    NRT_STATUS s = NRT_SUCCESS;
    for (size_t tok = 0; tok < t; tok++)
        if (summed[tok] == 0) s = NRT_EXEC_BAD_INPUT;
    for (size_t i = 0; s == NRT_SUCCESS && i < t * h; i++) store(output, dout, i, acc[i]);
    free(acc), free(summed);
    return s;
}

/* find_nonzero_indices: for each searched column, its nonzero rows ascending, then -1, and
 * their count. */
static NRT_STATUS run_find_nonzero_indices(const bound_t *b) {
    const nrt_model_t *m = b->model;
    const nrt_tensor_usage_t in = NRT_TENSOR_USAGE_INPUT, out = NRT_TENSOR_USAGE_OUTPUT;
    size_t t = dim(m, "input_tensor", in, 0), c_full = dim(m, "input_tensor", in, 1), c = dim(m, "indices", out, 0);
    nrt_dtype_t dx, ds = NRT_DTYPE_INT32, di, dc;
    nrt_tensor_t *x = bound(b, "input_tensor", in, &dx), *start = bound(b, "col_start_id", in, &ds);
    nrt_tensor_t *indices = bound(b, "indices", out, &di), *counts = bound(b, "nonzero_counts", out, &dc);
    double first = start != NULL ? load(start, ds, 0) : 0.0;
    if (!(first >= 0 && first + (double)c <= (double)c_full)) return NRT_EXEC_OOB;
    for (size_t col = 0; col < c; col++) {
        size_t found = 0;
        for (size_t row = 0; row < t; row++)
            if (load(x, dx, row * c_full + (size_t)first + col) != 0.0) store(indices, di, col * t + found++, (double)row);
        store(counts, dc, col, (double)found);
        for (; found < t; found++) store(indices, di, col * t + found, -1.0);
    }
    return NRT_SUCCESS;
}

/* indexed_flatten: padding_val everywhere, then each row's blocks of f_len elements copied as
 * stored, rows in order, to output block row_offsets[start + e] + p where that is inside the
 * output. */
static NRT_STATUS run_indexed_flatten(const bound_t *b) {
    const nrt_model_t *m = b->model;
    const nrt_tensor_usage_t in = NRT_TENSOR_USAGE_INPUT, out = NRT_TENSOR_USAGE_OUTPUT;
    size_t e = dim(m, "input_tensor", in, 0), t = dim(m, "input_tensor", in, 1), n = dim(m, "row_offsets", in, 0);
    size_t len = dim(m, "flattened_array", out, 0), f = m->f_len;
    nrt_dtype_t dx, dr, ds = NRT_DTYPE_INT32, dout;
    nrt_tensor_t *x = bound(b, "input_tensor", in, &dx), *offsets = bound(b, "row_offsets", in, &dr);
    nrt_tensor_t *start = bound(b, "row_offsets_start", in, &ds), *flat = bound(b, "flattened_array", out, &dout);
    double first = start != NULL ? load(start, ds, 0) : 0.0;
    if (!(first >= 0 && first + (double)e <= (double)n)) return NRT_EXEC_OOB;
    size_t bytes = dtype_size(dout);
    for (size_t i = 0; i < len; i++) store(flat, dout, i, m->padding_val);
    for (size_t row = 0; row < e; row++) {
        double offset = load(offsets, dr, (size_t)first + row);
        for (size_t p = 0; p < t / f; p++) {
            double block = offset + (double)p;
            if (block < 0 || block >= (double)(len / f)) continue;
            memcpy(flat->data + (size_t)block * f * bytes, x->data + (row * t + p * f) * bytes, f * bytes);
        }
    }
    return NRT_SUCCESS;
}

static NRT_STATUS run_copy(const bound_t *b) {
    const nrt_model_t *m = b->model;
    int next_input = 0;
    for (int j = 0; j < m->count; j++) {
        if (m->decls[j].usage != NRT_TENSOR_USAGE_OUTPUT) continue;
        while (m->decls[next_input].usage != NRT_TENSOR_USAGE_INPUT) next_input++;
        memcpy(b->tensors[j]->data, b->tensors[next_input]->data, m->decls[j].size);
        next_input++;
    }
    return NRT_SUCCESS;
}

/* Binds every declared tensor from the two sets: a missing one is NRT_INVALID, one of the wrong
 * size NRT_EXEC_BAD_INPUT. */
static NRT_STATUS bind(const nrt_model_t *model, const nrt_tensor_set_t *inputs, const nrt_tensor_set_t *outputs,
                       bound_t *b) {
    b->model = model;
    for (int j = 0; j < model->count; j++) {
        const decl_t *d = &model->decls[j];
        const binding_t *found = find_binding(d->usage == NRT_TENSOR_USAGE_INPUT ? inputs : outputs, d->name);
        if (found == NULL) return NRT_INVALID;
        if (found->tensor->size != d->size) return NRT_EXEC_BAD_INPUT;
        b->tensors[j] = found->tensor;
    }
    return NRT_SUCCESS;
}

static NRT_STATUS execute(nrt_model_t *model, const nrt_tensor_set_t *input_set, nrt_tensor_set_t *output_set,
                          int repeat_count) {
    NRT_STATUS s = check_running();
    if (s != NRT_SUCCESS) return s;
    if (!model_is_live(model)) return NRT_INVALID_HANDLE;
    if (input_set == NULL || output_set == NULL || repeat_count < 1) return NRT_INVALID;
    bound_t b;
    s = bind(model, input_set, output_set, &b);
    for (int r = 0; r < repeat_count && s == NRT_SUCCESS; r++) {
        switch (model->kernel) {
        case KERNEL_ROUTER_TOPK: s = run_router_topk(&b); break;
        case KERNEL_BLOCKWISE_MM: s = run_blockwise_mm(&b); break;
        case KERNEL_BLOCKWISE_MM_BWD: s = run_blockwise_mm_bwd(&b); break;
        case KERNEL_MOE_TKG: s = run_moe_tkg(&b); break;
        case KERNEL_RMSNORM_ROUTER_TOPK_TKG: s = run_rmsnorm_router_topk_tkg(&b); break;
        case KERNEL_MOE_BLOCK_TKG: s = run_moe_block_tkg(&b); break;
        case KERNEL_TOPK: s = run_topk(&b); break;
        case KERNEL_TOPK_REDUCE: s = run_topk_reduce(&b); break;
        case KERNEL_FIND_NONZERO_INDICES: s = run_find_nonzero_indices(&b); break;
        case KERNEL_INDEXED_FLATTEN: s = run_indexed_flatten(&b); break;
        default: s = run_copy(&b); break;
        }
    }
    return s;
}

NRT_STATUS nrt_execute(nrt_model_t *model, const nrt_tensor_set_t *input_set, nrt_tensor_set_t *output_set) {
    return execute(model, input_set, output_set, 1);
}

#ifndef FAKE_NRT_OMIT_EXECUTE_REPEAT
NRT_STATUS nrt_execute_repeat(nrt_model_t *model, const nrt_tensor_set_t *input_set, nrt_tensor_set_t *output_set,
                              int repeat_count) {
    return execute(model, input_set, output_set, repeat_count);
}
#endif
