//! Every kernel's tensors, declared once: a module per kernel with a [`TensorSpec`] for each of
//! its tensors (nki-library's names and layouts where nki-library has the kernel) and its
//! `INPUTS` and `OUTPUTS` in contract order. The contract modules check inputs against these,
//! the catalog prints them, `moekit run` binds tensors by their names, the output dtypes
//! follow their [`DTypeSpec::Like`] and the `neuron` backend binds NEFF tensors by them.
//!
//! [`DTypeSpec::Like`]: super::spec::DTypeSpec::Like

use super::spec::{DTypeSpec, TensorSpec, any, float, index, like};

/// `router_topk` (nki-library's `router_topk`).
pub mod router_topk {
    use super::*;

    /// `[T, H]` (`x_hbm_layout = 1`) or `[H, T]` (0).
    pub const X: TensorSpec = float("x", "[T, H]|[H, T]");
    pub const W: TensorSpec = float("w", "[H, E]");
    pub const W_BIAS: TensorSpec = float("w_bias", "[E]|[1, E]").optional();
    /// moekit's own: moves the choice of experts, not the affinities.
    pub const SELECTION_BIAS: TensorSpec = float("selection_bias", "[E]").optional();
    pub const INPUTS: &[TensorSpec] = &[X, W, W_BIAS, SELECTION_BIAS];

    pub const ROUTER_LOGITS: TensorSpec = like("router_logits", "[T, E]", &X);
    pub const EXPERT_INDEX: TensorSpec = index("expert_index", "[T, K]");
    /// nki-library's eager affinities (`return_eager_affi`).
    pub const TOPK_AFFINITIES: TensorSpec = like("topk_affinities", "[T, K]", &X);
    pub const EXPERT_AFFINITIES: TensorSpec = like("expert_affinities", "[T, E]", &X);
    pub const OUTPUTS: &[TensorSpec] = &[
        ROUTER_LOGITS,
        EXPERT_INDEX,
        TOPK_AFFINITIES,
        EXPERT_AFFINITIES,
    ];
}

/// `router_topk_bwd` (moekit's own).
pub mod router_topk_bwd {
    pub use super::router_topk::{EXPERT_INDEX, W, X};
    use super::*;

    pub const ROUTER_LOGITS: TensorSpec = float("router_logits", "[T, E]");
    pub const D_TOPK_AFFINITIES: TensorSpec = float("d_topk_affinities", "[T, K]");
    /// The gradient of `router_logits` from its other consumers (the aux loss).
    pub const D_ROUTER_LOGITS: TensorSpec = float("d_router_logits", "[T, E]").optional();
    pub const INPUTS: &[TensorSpec] = &[
        X,
        W,
        ROUTER_LOGITS,
        EXPERT_INDEX,
        D_TOPK_AFFINITIES,
        D_ROUTER_LOGITS,
    ];

    pub const D_X: TensorSpec = like("d_x", "[T, H]|[H, T]", &X);
    pub const D_W: TensorSpec = like("d_w", "[H, E]", &W);
    pub const D_W_BIAS: TensorSpec = like("d_w_bias", "[E]", &W);
    pub const OUTPUTS: &[TensorSpec] = &[D_X, D_W, D_W_BIAS];
}

/// `load_balancing_loss` (moekit's own: Hugging Face Qwen3-MoE's aux loss).
pub mod load_balancing_loss {
    use super::*;

    /// `[L, T, E]`, or `[T, E]` for one layer.
    pub const ROUTER_LOGITS: TensorSpec = float("router_logits", "[L, T, E]");
    pub const EXPERT_INDEX: TensorSpec = index("expert_index", "[L, T, K]");
    pub const INPUTS: &[TensorSpec] = &[ROUTER_LOGITS, EXPERT_INDEX];

    pub const AUX_LOSS: TensorSpec = TensorSpec::new("aux_loss", "[1]", DTypeSpec::F32);
    pub const EXPERT_COUNTS: TensorSpec = index("expert_counts", "[L, E]");
    pub const OUTPUTS: &[TensorSpec] = &[AUX_LOSS, EXPERT_COUNTS];
}

/// `load_balancing_loss_bwd` (moekit's own).
pub mod load_balancing_loss_bwd {
    pub use super::load_balancing_loss::{EXPERT_INDEX, ROUTER_LOGITS};
    use super::*;

    pub const D_AUX_LOSS: TensorSpec = float("d_aux_loss", "[1]");
    pub const INPUTS: &[TensorSpec] = &[ROUTER_LOGITS, EXPERT_INDEX, D_AUX_LOSS];

    pub const D_ROUTER_LOGITS: TensorSpec = like("d_router_logits", "[L, T, E]", &ROUTER_LOGITS);
    pub const OUTPUTS: &[TensorSpec] = &[D_ROUTER_LOGITS];
}

/// `permute` (moekit's own: nki-library's block plan).
pub mod permute {
    use super::*;

    /// Expert ids in `[0, E)`, or −1 (`SKIP`).
    pub const EXPERT_INDEX: TensorSpec = index("expert_index", "[T, K]");
    pub const TOPK_AFFINITIES: TensorSpec = float("topk_affinities", "[T, K]");
    pub const INPUTS: &[TensorSpec] = &[EXPERT_INDEX, TOPK_AFFINITIES];

    pub const EXPERT_COUNTS: TensorSpec = index("expert_counts", "[E]");
    pub const TOKEN_POSITION_TO_ID: TensorSpec = super::blockwise_mm::TOKEN_POSITION_TO_ID;
    pub const BLOCK_TO_EXPERT: TensorSpec = super::blockwise_mm::BLOCK_TO_EXPERT;
    pub const EXPERT_AFFINITIES_MASKED: TensorSpec =
        like("expert_affinities_masked", "[(T+1)·E, 1]", &TOPK_AFFINITIES);
    pub const NUM_USED_BLOCKS: TensorSpec = index("num_used_blocks", "[1]");
    pub const OUTPUTS: &[TensorSpec] = &[
        EXPERT_COUNTS,
        TOKEN_POSITION_TO_ID,
        BLOCK_TO_EXPERT,
        EXPERT_AFFINITIES_MASKED,
        NUM_USED_BLOCKS,
    ];
}

/// `permute_bwd` (moekit's own).
pub mod permute_bwd {
    pub use super::permute::EXPERT_INDEX;
    use super::*;

    pub const EXPERT_AFFINITIES_MASKED_GRAD: TensorSpec =
        float("expert_affinities_masked_grad", "[(T+1)·E, 1]");
    pub const INPUTS: &[TensorSpec] = &[EXPERT_INDEX, EXPERT_AFFINITIES_MASKED_GRAD];

    pub const D_TOPK_AFFINITIES: TensorSpec = like(
        "d_topk_affinities",
        "[T, K]",
        &EXPERT_AFFINITIES_MASKED_GRAD,
    );
    pub const OUTPUTS: &[TensorSpec] = &[D_TOPK_AFFINITIES];
}

/// `blockwise_mm` (nki-library's `moe_cte`).
pub mod blockwise_mm {
    use super::*;

    /// Row T is the all-zero padding token.
    pub const HIDDEN_STATES: TensorSpec = float("hidden_states", "[T+1, H]");
    /// `[(T+1)·E]` is accepted too.
    pub const EXPERT_AFFINITIES_MASKED: TensorSpec =
        float("expert_affinities_masked", "[(T+1)·E, 1]");
    /// `[E, H, 2, I]` (`weight_layout` nki) or `[E, 2, I, H]` (linear); the axis of extent 2
    /// holds the gate projection at 0 and the up projection at 1. With `up_proj_weight`, the
    /// gate projection's `[E, I, H]` alone.
    pub const GATE_UP_PROJ_WEIGHT: TensorSpec =
        float("gate_up_proj_weight", "[E, H, 2, I]|[E, 2, I, H]|[E, I, H]");
    /// `[E, I, H]` (`weight_layout` nki) or `[E, H, I]` (linear).
    pub const DOWN_PROJ_WEIGHT: TensorSpec = float("down_proj_weight", "[E, I, H]|[E, H, I]");
    /// T in padding slots.
    pub const TOKEN_POSITION_TO_ID: TensorSpec = index("token_position_to_id", "[N·B]");
    /// `[N]` is accepted too.
    pub const BLOCK_TO_EXPERT: TensorSpec = index("block_to_expert", "[N, 1]");
    pub const GATE_AND_UP_PROJ_BIAS: TensorSpec =
        float("gate_and_up_proj_bias", "[E, 2, I]").optional();
    pub const DOWN_PROJ_BIAS: TensorSpec = float("down_proj_bias", "[E, H]").optional();
    /// moekit's own, with `weight_layout` linear only: the up projection's weights in a tensor
    /// of their own (torchtitan's `w3`), `gate_up_proj_weight` then holding the gate
    /// projection's (`w1`). Read where they lie, never stacked; the weight gradient is still
    /// the stacked `[E, 2, I, H]`.
    pub const UP_PROJ_WEIGHT: TensorSpec = float("up_proj_weight", "[E, I, H]").optional();
    pub const INPUTS: &[TensorSpec] = &[
        HIDDEN_STATES,
        EXPERT_AFFINITIES_MASKED,
        GATE_UP_PROJ_WEIGHT,
        DOWN_PROJ_WEIGHT,
        TOKEN_POSITION_TO_ID,
        BLOCK_TO_EXPERT,
        GATE_AND_UP_PROJ_BIAS,
        DOWN_PROJ_BIAS,
        UP_PROJ_WEIGHT,
    ];

    pub const OUTPUT: TensorSpec = like("output", "[T+1, H]", &HIDDEN_STATES);
    /// The gate/up projections (with their biases, clamped) before the activation.
    pub const GATE_UP_ACTIVATIONS_T: TensorSpec = like(
        "gate_up_activations_T",
        "[N, 2, I, B]",
        &GATE_UP_PROJ_WEIGHT,
    )
    .optional();
    /// The down projection (with its bias) before the affinity scaling.
    pub const DOWN_ACTIVATIONS: TensorSpec =
        like("down_activations", "[N, B, H]", &DOWN_PROJ_WEIGHT).optional();
    pub const OUTPUTS: &[TensorSpec] = &[OUTPUT, GATE_UP_ACTIVATIONS_T, DOWN_ACTIVATIONS];
}

/// `blockwise_mm_bwd` (nki-library's `blockwise_mm_bwd`).
pub mod blockwise_mm_bwd {
    pub use super::blockwise_mm::{
        BLOCK_TO_EXPERT, DOWN_PROJ_BIAS, DOWN_PROJ_WEIGHT, EXPERT_AFFINITIES_MASKED,
        GATE_AND_UP_PROJ_BIAS, GATE_UP_PROJ_WEIGHT, HIDDEN_STATES, TOKEN_POSITION_TO_ID,
        UP_PROJ_WEIGHT,
    };
    use super::*;

    /// The forward's `gate_up_activations_T`.
    pub const GATE_UP_PROJ_ACT_CHECKPOINT_T: TensorSpec =
        float("gate_up_proj_act_checkpoint_T", "[N, 2, I, B]");
    /// The forward's `down_activations`.
    pub const DOWN_PROJ_ACT_CHECKPOINT: TensorSpec = float("down_proj_act_checkpoint", "[N, B, H]");
    /// Row T must be zero.
    pub const OUTPUT_HIDDEN_STATES_GRAD: TensorSpec =
        float("output_hidden_states_grad", "[T+1, H]");
    /// moekit's own: with it the backward also returns `d_topk_affinities`.
    pub const EXPERT_INDEX: TensorSpec = index("expert_index", "[T, K]").optional();
    pub const INPUTS: &[TensorSpec] = &[
        HIDDEN_STATES,
        EXPERT_AFFINITIES_MASKED,
        GATE_UP_PROJ_WEIGHT,
        DOWN_PROJ_WEIGHT,
        TOKEN_POSITION_TO_ID,
        BLOCK_TO_EXPERT,
        GATE_AND_UP_PROJ_BIAS,
        DOWN_PROJ_BIAS,
        UP_PROJ_WEIGHT,
        GATE_UP_PROJ_ACT_CHECKPOINT_T,
        DOWN_PROJ_ACT_CHECKPOINT,
        OUTPUT_HIDDEN_STATES_GRAD,
        EXPERT_INDEX,
    ];

    pub const HIDDEN_STATES_GRAD: TensorSpec =
        like("hidden_states_grad", "[T+1, H]", &HIDDEN_STATES);
    pub const EXPERT_AFFINITIES_MASKED_GRAD: TensorSpec = like(
        "expert_affinities_masked_grad",
        "[(T+1)·E, 1]",
        &EXPERT_AFFINITIES_MASKED,
    );
    /// In the weights' layout (`[E, 2, I, H]`, gate then up, with `up_proj_weight`).
    pub const GATE_UP_PROJ_WEIGHT_GRAD: TensorSpec = like(
        "gate_up_proj_weight_grad",
        "[E, H, 2, I]|[E, 2, I, H]",
        &GATE_UP_PROJ_WEIGHT,
    );
    /// In the weights' layout.
    pub const DOWN_PROJ_WEIGHT_GRAD: TensorSpec = like(
        "down_proj_weight_grad",
        "[E, I, H]|[E, H, I]",
        &DOWN_PROJ_WEIGHT,
    );
    /// moekit's own, with `expert_index`: the gradient of `permute`'s `topk_affinities`.
    pub const D_TOPK_AFFINITIES: TensorSpec =
        like("d_topk_affinities", "[T, K]", &EXPERT_AFFINITIES_MASKED).optional();
    /// With `bias`; nki-library gives the bias gradients their weights' dtype.
    pub const GATE_AND_UP_PROJ_BIAS_GRAD: TensorSpec = like(
        "gate_and_up_proj_bias_grad",
        "[E, 2, I]",
        &GATE_UP_PROJ_WEIGHT,
    )
    .optional();
    pub const DOWN_PROJ_BIAS_GRAD: TensorSpec =
        like("down_proj_bias_grad", "[E, H]", &DOWN_PROJ_WEIGHT).optional();
    pub const OUTPUTS: &[TensorSpec] = &[
        HIDDEN_STATES_GRAD,
        EXPERT_AFFINITIES_MASKED_GRAD,
        GATE_UP_PROJ_WEIGHT_GRAD,
        DOWN_PROJ_WEIGHT_GRAD,
        D_TOPK_AFFINITIES,
        GATE_AND_UP_PROJ_BIAS_GRAD,
        DOWN_PROJ_BIAS_GRAD,
    ];

    /// The forward's checkpoints and the backward inputs they become, nki-library's names.
    pub const CHECKPOINTS: [(TensorSpec, TensorSpec); 2] = [
        (
            super::blockwise_mm::GATE_UP_ACTIVATIONS_T,
            GATE_UP_PROJ_ACT_CHECKPOINT_T,
        ),
        (
            super::blockwise_mm::DOWN_ACTIVATIONS,
            DOWN_PROJ_ACT_CHECKPOINT,
        ),
    ];
}

/// `moe_tkg` (nki-library's decode-time experts, `core/moe/moe_tkg`).
pub mod moe_tkg {
    use super::*;

    pub const HIDDEN_INPUT: TensorSpec = float("hidden_input", "[T, H]");
    /// 0 gate, 1 up.
    pub const EXPERT_GATE_UP_WEIGHTS: TensorSpec =
        float("expert_gate_up_weights", "[E_L, H, 2, I]");
    pub const EXPERT_DOWN_WEIGHTS: TensorSpec = float("expert_down_weights", "[E_L, I, H]");
    pub const EXPERT_AFFINITIES: TensorSpec = float("expert_affinities", "[T, E]");
    pub const EXPERT_INDEX: TensorSpec = index("expert_index", "[T, K]");
    /// uint32 in nki-library; i32 here like every index.
    pub const RANK_ID: TensorSpec = index("rank_id", "[1, 1]").optional();
    pub const EXPERT_GATE_UP_BIAS: TensorSpec =
        float("expert_gate_up_bias", "[E_L, 2, I]").optional();
    pub const EXPERT_DOWN_BIAS: TensorSpec = float("expert_down_bias", "[E_L, H]").optional();
    pub const EXPERT_AFFINITIES_EAGER: TensorSpec =
        float("expert_affinities_eager", "[T, K]").optional();
    pub const INPUTS: &[TensorSpec] = &[
        HIDDEN_INPUT,
        EXPERT_GATE_UP_WEIGHTS,
        EXPERT_DOWN_WEIGHTS,
        EXPERT_AFFINITIES,
        EXPERT_INDEX,
        RANK_ID,
        EXPERT_GATE_UP_BIAS,
        EXPERT_DOWN_BIAS,
        EXPERT_AFFINITIES_EAGER,
    ];

    pub const OUTPUT: TensorSpec = like("output", "[T, H]", &HIDDEN_INPUT);
    pub const OUTPUTS: &[TensorSpec] = &[OUTPUT];
}

/// `rmsnorm_router_topk_tkg` (nki-library's `experimental/moe_block` kernel).
pub mod rmsnorm_router_topk_tkg {
    use super::*;

    /// T = B·S tokens.
    pub const HIDDEN_STATES: TensorSpec = float("hidden_states", "[B, S, H]|[T, H]");
    pub const GAMMA: TensorSpec = float("gamma", "[1, H]|[H]");
    /// In `router_mm_dtype`.
    pub const ROUTER_WEIGHTS: TensorSpec = float("router_weights", "[H, E]");
    pub const ROUTER_BIAS: TensorSpec = float("router_bias", "[1, E]|[E]").optional();
    pub const INPUTS: &[TensorSpec] = &[HIDDEN_STATES, GAMMA, ROUTER_WEIGHTS, ROUTER_BIAS];

    /// In `router_mm_dtype`, which is `router_weights`' dtype.
    pub const NORM_OUTPUT: TensorSpec = like("norm_output", "[T, H]", &ROUTER_WEIGHTS);
    pub const EXPERT_INDEX: TensorSpec = index("expert_index", "[T, K]");
    /// `[T, K]` with `store_eager_affi_only`.
    pub const EXPERT_AFFINITIES: TensorSpec =
        TensorSpec::new("expert_affinities", "[T, E]|[T, K]", DTypeSpec::BF16);
    pub const OUTPUTS: &[TensorSpec] = &[NORM_OUTPUT, EXPERT_INDEX, EXPERT_AFFINITIES];
}

/// `rmsnorm_router_topk_tkg_bwd` (moekit's own).
pub mod rmsnorm_router_topk_tkg_bwd {
    pub use super::rmsnorm_router_topk_tkg::{
        EXPERT_INDEX, GAMMA, HIDDEN_STATES, ROUTER_BIAS, ROUTER_WEIGHTS,
    };
    use super::*;

    /// `[T, K]` with `store_eager_affi_only`.
    pub const D_EXPERT_AFFINITIES: TensorSpec = float("d_expert_affinities", "[T, E]|[T, K]");
    pub const D_NORM_OUTPUT: TensorSpec = float("d_norm_output", "[T, H]").optional();
    pub const INPUTS: &[TensorSpec] = &[
        HIDDEN_STATES,
        GAMMA,
        ROUTER_WEIGHTS,
        ROUTER_BIAS,
        EXPERT_INDEX,
        D_EXPERT_AFFINITIES,
        D_NORM_OUTPUT,
    ];

    pub const D_HIDDEN_STATES: TensorSpec =
        like("d_hidden_states", "[B, S, H]|[T, H]", &HIDDEN_STATES);
    pub const D_GAMMA: TensorSpec = like("d_gamma", "[1, H]|[H]", &GAMMA);
    pub const D_ROUTER_WEIGHTS: TensorSpec = like("d_router_weights", "[H, E]", &ROUTER_WEIGHTS);
    pub const D_ROUTER_BIAS: TensorSpec = like("d_router_bias", "[1, E]|[E]", &ROUTER_WEIGHTS);
    pub const OUTPUTS: &[TensorSpec] = &[D_HIDDEN_STATES, D_GAMMA, D_ROUTER_WEIGHTS, D_ROUTER_BIAS];
}

/// `moe_block_tkg` (nki-library's `moe_block_tkg`): `rmsnorm_router_topk_tkg`'s norm and
/// router inputs, `moe_tkg`'s experts.
pub mod moe_block_tkg {
    pub use super::moe_tkg::{
        EXPERT_DOWN_BIAS, EXPERT_DOWN_WEIGHTS, EXPERT_GATE_UP_BIAS, EXPERT_GATE_UP_WEIGHTS, RANK_ID,
    };
    pub use super::rmsnorm_router_topk_tkg::{GAMMA, ROUTER_BIAS, ROUTER_WEIGHTS};
    use super::*;

    /// T = B·S tokens.
    pub const INP: TensorSpec = float("inp", "[B, S, H]|[T, H]");
    /// nki-library adds it only with MX weights (Trainium3); refused.
    pub const RESIDUAL: TensorSpec = float("residual", "[B, S, H]|[T, H]").optional();
    pub const INPUTS: &[TensorSpec] = &[
        INP,
        GAMMA,
        ROUTER_WEIGHTS,
        EXPERT_GATE_UP_WEIGHTS,
        EXPERT_DOWN_WEIGHTS,
        ROUTER_BIAS,
        EXPERT_GATE_UP_BIAS,
        EXPERT_DOWN_BIAS,
        RANK_ID,
        RESIDUAL,
    ];

    pub const OUT: TensorSpec = like("out", "[T, H]", &INP);
    /// Before the activation; absent with `skip_router_logits`.
    pub const ROUTER_LOGITS: TensorSpec = like("router_logits", "[T, E]", &INP).optional();
    pub const OUTPUTS: &[TensorSpec] = &[OUT, ROUTER_LOGITS];
}

/// `topk` (nki-library's `topk` and its `rotational_topk` kernel).
pub mod topk {
    use super::*;

    /// Rank ≥ 2; the leading axes are the rows.
    pub const INP: TensorSpec = float("inp", "[..., V]");
    pub const INPUTS: &[TensorSpec] = &[INP];

    pub const TOPK_VALUES: TensorSpec = like("topk_values", "[..., K]", &INP);
    /// Positions along `inp`'s last axis (uint32 in nki-library).
    pub const TOPK_INDICES: TensorSpec = index("topk_indices", "[..., K]");
    pub const OUTPUTS: &[TensorSpec] = &[TOPK_VALUES, TOPK_INDICES];
}

/// `topk_reduce` (nki-library's `experimental/collectives/topk_reduce`).
pub mod topk_reduce {
    use super::*;

    /// Rows of H values, then the row's token id as a little-endian i32 in the bits of the
    /// last two columns (column H the low half).
    pub const INPUT: TensorSpec = TensorSpec::new("input", "[TK_padded, H+2]", DTypeSpec::BF16);
    pub const INPUTS: &[TensorSpec] = &[INPUT];

    pub const OUTPUT: TensorSpec = like("output", "[T, H]", &INPUT);
    pub const OUTPUTS: &[TensorSpec] = &[OUTPUT];
}

/// `find_nonzero_indices` (nki-library's `core/subkernels/find_nonzero_indices`).
pub mod find_nonzero_indices {
    use super::*;

    /// Searched down each column.
    pub const INPUT_TENSOR: TensorSpec = any("input_tensor", "[T, C_full]");
    /// The first column searched (with `n_cols`).
    pub const COL_START_ID: TensorSpec = index("col_start_id", "[1]").optional();
    pub const INPUTS: &[TensorSpec] = &[INPUT_TENSOR, COL_START_ID];

    /// Each column's nonzero rows, ascending, then −1.
    pub const INDICES: TensorSpec = index("indices", "[C, T]");
    pub const NONZERO_COUNTS: TensorSpec = index("nonzero_counts", "[C]");
    pub const OUTPUTS: &[TensorSpec] = &[INDICES, NONZERO_COUNTS];
}

/// `indexed_flatten` (nki-library's `core/subkernels/indexed_flatten`).
pub mod indexed_flatten {
    use super::*;

    pub const INPUT_TENSOR: TensorSpec = any("input_tensor", "[E, T]");
    /// Each row's first output block, in blocks of `f_len`.
    pub const ROW_OFFSETS: TensorSpec = index("row_offsets", "[N]");
    /// The first entry of `row_offsets` read.
    pub const ROW_OFFSETS_START: TensorSpec = index("row_offsets_start", "[1]").optional();
    pub const INPUTS: &[TensorSpec] = &[INPUT_TENSOR, ROW_OFFSETS, ROW_OFFSETS_START];

    pub const FLATTENED_ARRAY: TensorSpec = like("flattened_array", "[output_len]", &INPUT_TENSOR);
    pub const OUTPUTS: &[TensorSpec] = &[FLATTENED_ARRAY];
}

/// `a2av_routing` (moekit's own: the routing table of nki-library's `permute_a2av`).
pub mod a2av_routing {
    use super::*;

    /// Expert ids in `[0, E)`, or −1 (`SKIP`: sends nothing).
    pub const EXPERT_INDEX: TensorSpec = index("expert_index", "[T, K]");
    pub const INPUTS: &[TensorSpec] = &[EXPERT_INDEX];

    pub const SEND_INDICES: TensorSpec = index("send_indices", "[T, EP]");
    pub const SEND_COUNTS: TensorSpec = index("send_counts", "[1, EP]");
    pub const OUTPUTS: &[TensorSpec] = &[SEND_INDICES, SEND_COUNTS];
}
