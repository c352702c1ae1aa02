//! The MoE layer the ways PyTorch computes it (feature `libtorch`), written once for the
//! benchmark's peers and the trainer's libtorch implementations:
//!
//! - [`hf_router`]: Hugging Face's Qwen3-MoE router, `softmax` in f32, `topk`, optionally
//!   divided by the top-k sum;
//! - [`experts_loop`]: Hugging Face's eager experts, one expert at a time over the tokens that
//!   chose it (`nonzero`, `index_select`, the projections, `index_add`);
//! - [`experts_grouped_mm`]: the token copies sorted by expert, `torch._grouped_mm` for the
//!   gate/up and down projections, `index_add` back to token order.
//!
//! Shapes: `x [T, H]`, `expert_index [T, K]` (int64), `affinities [T, K]`, the experts'
//! `gate_up [E, H, 2, I]` and `down [E, I, H]`; the experts return `[T, H]`. Everything runs
//! under autograd.

use tch::{Kind, TchError, Tensor};

/// Hugging Face's router on `router_logits [T, E]`: `p = softmax(logits)` in f32, the top K of
/// `p + selection_bias` (sorted; ties to the lower id), their `p` divided by its sum when
/// `norm_topk_prob`. Returns `(affinities [T, K] f32, expert_index [T, K] int64)`.
pub fn hf_router(
    router_logits: &Tensor,
    k: i64,
    norm_topk_prob: bool,
    selection_bias: Option<&Tensor>,
) -> (Tensor, Tensor) {
    let probs = router_logits.softmax(-1, Kind::Float);
    let (_, expert_index) = match selection_bias {
        Some(bias) => (&probs + bias).topk(k, -1, true, true),
        None => probs.topk(k, -1, true, true),
    };
    let mut affinities = probs.gather(-1, &expert_index, false);
    if norm_topk_prob {
        affinities = &affinities / affinities.sum_dim_intlist(-1, true, Kind::Float);
    }
    (affinities, expert_index)
}

/// One expert's projections: `gate [H, I]`, `up [H, I]` and `down [I, H]`.
pub type ExpertProjections = (Tensor, Tensor, Tensor);

/// Hugging Face's eager experts: for each expert at least one token chose (found with one host
/// sync, as in Hugging Face), its tokens' rows through `silu(x·gate) ⊙ (x·up) · down`, scaled by
/// their affinities and added into the output. `projections(e)` gives expert e's weights: views
/// of fused `[E, H, 2, I]` / `[E, I, H]` tensors, or one parameter per expert.
pub fn experts_loop(
    x: &Tensor,
    expert_index: &Tensor,
    affinities: &Tensor,
    experts: i64,
    projections: impl Fn(i64) -> ExpertProjections,
) -> Result<Tensor, TchError> {
    let chosen = expert_index.flatten(0, 1).bincount(None::<Tensor>, experts);
    let chosen = Vec::<i64>::try_from(chosen.nonzero().flatten(0, 1))?;
    let mut out = x.zeros_like();
    for expert in chosen {
        let hit = expert_index.eq(expert).nonzero(); // [n, 2]: (token, slot)
        let (token, slot) = (hit.select(1, 0), hit.select(1, 1));
        let xs = x.index_select(0, &token);
        let (gate, up, down) = projections(expert);
        let act = xs.f_matmul(&gate)?.silu() * xs.f_matmul(&up)?;
        let weight = affinities
            .index(&[Some(token.shallow_clone()), Some(slot)])
            .unsqueeze(-1);
        let y = act.f_matmul(&down)? * weight;
        out = out.f_index_add(0, &token, &y)?;
    }
    Ok(out)
}

/// Expert e's projections as views of the fused `gate_up [E, H, 2, I]` and `down [E, I, H]`.
pub fn fused_projections<'w>(
    gate_up: &'w Tensor,
    down: &'w Tensor,
) -> impl Fn(i64) -> ExpertProjections + 'w {
    move |expert| {
        let pair = gate_up.get(expert);
        (pair.select(1, 0), pair.select(1, 1), down.get(expert))
    }
}

/// The T·K token copies sorted by expert (stable), gate/up and down as two grouped matmuls with
/// per-expert offsets, scaled by the affinities and added back in token order. Needs H and I
/// rows of a multiple of 16 bytes (see [`grouped_mm_alignment`]).
pub fn experts_grouped_mm(
    x: &Tensor,
    expert_index: &Tensor,
    affinities: &Tensor,
    gate_up: &Tensor,
    down: &Tensor,
) -> Result<Tensor, TchError> {
    let (experts, h, _, i) = gate_up.size4()?;
    let k = expert_index.size()[1];
    let flat = expert_index.flatten(0, 1);
    let order = flat.argsort_stable(true, 0, false);
    let offsets = flat.bincount(None::<Tensor>, experts).cumsum(0, Kind::Int);
    let token = order.floor_divide_scalar(k);
    let xs = x.index_select(0, &token);
    let projected = xs.f_internal_grouped_mm(
        &gate_up.reshape([experts, h, 2 * i]),
        Some(&offsets),
        None::<&Tensor>,
        None::<Kind>,
    )?;
    let act = projected.narrow(-1, 0, i).silu() * projected.narrow(-1, i, i);
    let y = act.f_internal_grouped_mm(down, Some(&offsets), None::<&Tensor>, None::<Kind>)?;
    let weight = affinities
        .flatten(0, 1)
        .index_select(0, &order)
        .unsqueeze(-1);
    x.zeros_like().f_index_add(0, &token, &(y * weight))
}

/// `torch._grouped_mm` needs every row stride to be a multiple of 16 bytes: H and I (in
/// elements of `elem_bytes`) must be multiples of 16 / `elem_bytes`. The first size that is
/// not, as `(name, size)`.
pub fn grouped_mm_alignment(
    hidden: usize,
    intermediate: usize,
    elem_bytes: usize,
) -> Option<(&'static str, usize)> {
    [
        ("hidden_size", hidden),
        ("moe_intermediate_size", intermediate),
    ]
    .into_iter()
    .find(|&(_, size)| !(size * elem_bytes).is_multiple_of(16))
}
