//! The shapes a manifest's NEFFs were compiled for, as [`FixedShape`]s: the MoE layer each
//! entry's calls come from and the kernel parameters it was compiled with, so a tool can feed
//! every NEFF a call it runs (what `moekit check` does on the `neuron` backend).
//!
//! Entries must name every size: `t`, `h`, `e`, `k` (`router_topk`), `t`, `h`, `e`, `i`,
//! `block_size`, `num_blocks` (the blockwise kernels; K is the smallest top-k whose static block
//! count is `num_blocks`), `t`, `h`, `e`, `k`, `i` (`moe_tkg`, whose checks hold every expert:
//! `e_local`, where given, must be `e`), `t`, `h`, `e`, `top_k` (`rmsnorm_router_topk_tkg`),
//! `t`, `h`, `e`, `i`, `top_k` (`moe_block_tkg`, likewise with every expert held), `rows`, `v`,
//! `k` (`topk`, over the router logits of `rows` tokens and `v` experts), `t`, `h`, `k`
//! (`topk_reduce`, over the layer's T·K exchanged rows: `tk_padded`, where given, must be
//! T·K), `t`, `c_full` (`find_nonzero_indices`, over the routed affinities of `c_full` experts;
//! with `col_start_id` the last `n_cols` of them) or `e`, `t`, `f_len`, `output_len`
//! (`indexed_flatten`, over the token lists of `e` experts in blocks of `f_len`, one
//! `row_offsets` entry per row: `n`, where given, must be `e`, and without
//! `row_offsets_start`).

use super::limits::broken_limits;
use super::manifest::{Entry, Manifest, Value};
use crate::backend::{FixedShape, FixedShapes, LayerSizes};
use crate::contracts::{
    ActFnType, ExpertAffinityScaleMode, MoeBlockTkgParams, RmsNormRouterParams, RouterActFnType,
    TopkParams, XHbmLayout, static_block_count,
};
use crate::error::{Error, Result};
use crate::kernel::{Kernel, Params};

impl Manifest {
    /// Every entry's shape, in manifest order, with the nki-library limits it breaks as
    /// warnings.
    pub fn fixed_shapes(&self) -> Result<FixedShapes> {
        let shapes = self
            .entries
            .iter()
            .enumerate()
            .map(|(index, entry)| self.fixed_shape(index, entry))
            .collect::<Result<_>>()?;
        Ok(FixedShapes {
            declared_in: self.path.clone(),
            shapes,
        })
    }

    fn fixed_shape(&self, index: usize, entry: &Entry) -> Result<FixedShape> {
        let source = format!("kernel entry {} ({})", index + 1, entry.neff.display());
        let error = |message: String| Error::Format {
            path: self.path.clone(),
            message: format!("{source}: {message}"),
        };
        let int = |key: &str| match entry.params.get(key) {
            Some(Value::Int(v)) => Ok(*v),
            _ => Err(error(format!(
                "`check` needs `{key}`, the size the NEFF was compiled for"
            ))),
        };
        let flag = |key: &str| matches!(entry.params.get(key), Some(Value::Bool(true)));
        let signed = |key: &str| match entry.params.get(key) {
            Some(&Value::Signed(v)) => Some(v),
            _ => None,
        };
        // An `ActFnType` or `ExpertAffinityScaleMode` member, where the entry names one.
        let activation = |key: &str| match entry.params.get(key) {
            Some(Value::Str(name)) => ActFnType::parse(key, name).map(Some),
            _ => Ok(None),
        };
        let scaling = || {
            const KEY: &str = "expert_affinities_scaling_mode";
            match entry.params.get(KEY) {
                Some(Value::Str(name)) => ExpertAffinityScaleMode::parse(KEY, name).map(Some),
                _ => Ok(None),
            }
        };
        // The decode kernels' RMSNorm and router: K, and the entry's `eps`, `hidden_actual`,
        // `router_mm_dtype` and `router_act_fn`, nki-library's defaults where it leaves them out.
        let decode_router = |k: usize| -> Result<Params> {
            let text = |key: &str| match entry.params.get(key) {
                Some(Value::Str(text)) => Some(text.as_str()),
                _ => None,
            };
            let default = RmsNormRouterParams::default();
            Ok(Params {
                top_k: Some(k),
                eps: text("eps")
                    .map(str::parse)
                    .transpose()
                    .map_err(|_| error("`eps` is not a number".to_owned()))?,
                hidden_actual: int("hidden_actual").ok(),
                router_mm_dtype: Some(
                    text("router_mm_dtype")
                        .map(str::parse)
                        .transpose()?
                        .unwrap_or(default.router_mm_dtype),
                ),
                router_act_fn: Some(
                    text("router_act_fn")
                        .map(str::parse)
                        .transpose()?
                        .unwrap_or(default.router_act_fn),
                ),
                ..Params::default()
            })
        };
        let (sizes, params) = match entry.kernel {
            Kernel::RouterTopk => {
                let act_fn = match entry.params.get("act_fn") {
                    Some(Value::Str(name)) => name.parse()?,
                    _ => RouterActFnType::Softmax,
                };
                let x_hbm_layout = match entry.params.get("x_hbm_layout") {
                    Some(&Value::Int(0)) => XHbmLayout::HT,
                    _ => XHbmLayout::TH,
                };
                let k = int("k")?;
                let sizes = LayerSizes {
                    t: int("t")?,
                    h: int("h")?,
                    e: int("e")?,
                    k,
                    i: 1,
                    b: 1,
                };
                let params = Params {
                    k: Some(k),
                    act_fn: Some(act_fn),
                    // nki-library's default is ACT1.
                    router_pre_norm: Some(!matches!(
                        entry.params.get("router_pre_norm"),
                        Some(Value::Bool(false))
                    )),
                    norm_topk_prob: Some(flag("norm_topk_prob")),
                    x_hbm_layout: Some(x_hbm_layout),
                    ..Params::default()
                };
                (sizes, params)
            }
            Kernel::MoeTkg => {
                let (e, k) = (int("e")?, int("k")?);
                if matches!(entry.params.get("e_local"), Some(&Value::Int(held)) if held != e) {
                    return Err(error(format!(
                        "`check` runs moe_tkg with every expert held, but e_local is not e = {e}"
                    )));
                }
                let sizes = LayerSizes {
                    t: int("t")?,
                    h: int("h")?,
                    e,
                    k,
                    i: int("i")?,
                    b: 1,
                };
                let params = Params {
                    k: Some(k),
                    is_all_expert: Some(flag("is_all_expert")),
                    scaling_mode: scaling()?,
                    activation_fn: activation("activation_fn")?,
                    mask_unselected_experts: Some(flag("mask_unselected_experts")),
                    ..Params::default()
                };
                (sizes, params)
            }
            Kernel::RmsNormRouterTopkTkg => {
                let k = int("top_k")?;
                let sizes = LayerSizes {
                    t: int("t")?,
                    h: int("h")?,
                    e: int("e")?,
                    k,
                    i: 1,
                    b: 1,
                };
                let params = Params {
                    store_eager_affi_only: Some(flag("store_eager_affi_only")),
                    ..decode_router(k)?
                };
                (sizes, params)
            }
            Kernel::MoeBlockTkg => {
                let (e, k) = (int("e")?, int("top_k")?);
                if matches!(entry.params.get("e_local"), Some(&Value::Int(held)) if held != e) {
                    return Err(error(format!(
                        "`check` runs moe_block_tkg with every expert held, but e_local is not \
                         e = {e}"
                    )));
                }
                let sizes = LayerSizes {
                    t: int("t")?,
                    h: int("h")?,
                    e,
                    k,
                    i: int("i")?,
                    b: 1,
                };
                let default = MoeBlockTkgParams::default();
                let params = Params {
                    router_pre_norm: Some(match entry.params.get("router_pre_norm") {
                        Some(&Value::Bool(pre_norm)) => pre_norm,
                        _ => default.router_pre_norm,
                    }),
                    norm_topk_prob: Some(flag("norm_topk_prob")),
                    scaling_mode: scaling()?,
                    hidden_act_fn: activation("hidden_act_fn")?,
                    is_all_expert: Some(flag("is_all_expert")),
                    skip_router_logits: Some(flag("skip_router_logits")),
                    ..decode_router(k)?
                };
                (sizes, params)
            }
            // The top-k over the router logits [T, E] of `rows` tokens and `v` experts, routed
            // to their k best.
            Kernel::Topk => {
                let k = int("k")?;
                let sizes = LayerSizes {
                    t: int("rows")?,
                    h: 1,
                    e: int("v")?,
                    k,
                    i: 1,
                    b: 1,
                };
                let default = TopkParams::new(k);
                let params = Params {
                    k: Some(k),
                    sorted_flag: Some(match entry.params.get("sorted_flag") {
                        Some(&Value::Bool(sorted)) => sorted,
                        _ => default.sorted_flag,
                    }),
                    method: Some(match entry.params.get("method") {
                        Some(Value::Str(name)) => name.parse()?,
                        _ => default.method,
                    }),
                    ..Params::default()
                };
                (sizes, params)
            }
            // The layer's exchanged rows, each token's K from K source ranks (K experts, blocks
            // of one): T·K rows, no padding.
            Kernel::TopkReduce => {
                let (t, k) = (int("t")?, int("k")?);
                if let Some(&Value::Int(rows)) = entry.params.get("tk_padded")
                    && t.checked_mul(k) != Some(rows)
                {
                    return Err(error(format!(
                        "`check` feeds topk_reduce the layer's T·K exchanged rows, but \
                         tk_padded = {rows} is not t·k = {t}·{k}"
                    )));
                }
                let sizes = LayerSizes {
                    t,
                    h: int("h")?,
                    e: k,
                    k,
                    i: 1,
                    b: 1,
                };
                let params = Params {
                    token_count: Some(t),
                    rows_per_token: Some(k),
                    token_base_index: signed("token_base_index"),
                    ..Params::default()
                };
                (sizes, params)
            }
            // The routed affinities [T, E] of `c_full` experts, each token routed to one; with
            // `col_start_id`, `check` searches their last `n_cols` columns.
            Kernel::FindNonzeroIndices => {
                let (t, c_full) = (int("t")?, int("c_full")?);
                let n_cols = match (flag("col_start_id"), entry.params.get("n_cols")) {
                    (true, Some(&Value::Int(n_cols))) => Some(n_cols),
                    (true, _) => {
                        return Err(error(
                            "`check` needs `n_cols`, the columns a NEFF that takes col_start_id \
                             searches"
                                .to_owned(),
                        ));
                    }
                    (false, Some(&Value::Int(n_cols))) if n_cols != c_full => {
                        return Err(error(format!(
                            "`n_cols` = {n_cols} is not c_full = {c_full}, but without \
                             col_start_id = true every column is searched"
                        )));
                    }
                    (false, _) => None,
                };
                let sizes = LayerSizes {
                    t,
                    h: 1,
                    e: c_full,
                    k: 1,
                    i: 1,
                    b: 1,
                };
                let params = Params {
                    n_cols,
                    ..Params::default()
                };
                (sizes, params)
            }
            // The token lists of `e` experts, each token routed to one, in blocks of `f_len`
            // (the layer's block size), one `row_offsets` entry per row.
            Kernel::IndexedFlatten => {
                let (e, t, f_len) = (int("e")?, int("t")?, int("f_len")?);
                if flag("row_offsets_start") {
                    return Err(error(
                        "`check` feeds row_offsets [E], one offset per row, and no \
                         row_offsets_start, but the entry sets row_offsets_start = true"
                            .to_owned(),
                    ));
                }
                if let Some(&Value::Int(n)) = entry.params.get("n")
                    && n != e
                {
                    return Err(error(format!(
                        "`check` feeds row_offsets [E], one offset per row, but n = {n} is not \
                         e = {e}"
                    )));
                }
                let sizes = LayerSizes {
                    t,
                    h: 1,
                    e,
                    k: 1,
                    i: 1,
                    b: f_len,
                };
                let params = Params {
                    f_len: Some(f_len),
                    output_len: Some(int("output_len")?),
                    padding_val: signed("padding_val"),
                    ..Params::default()
                };
                (sizes, params)
            }
            _ => {
                let (t, e, b, n) = (int("t")?, int("e")?, int("block_size")?, int("num_blocks")?);
                let k = top_k_for_blocks(t, e, b, n).ok_or_else(|| {
                    error(format!(
                        "no top-k gives num_blocks = {n} for t={t} e={e} block_size={b}"
                    ))
                })?;
                // nki-library's default is to accumulate; storing needs one slot per token.
                let accumulating = !matches!(
                    entry.params.get("is_tensor_update_accumulating"),
                    Some(Value::Bool(false))
                );
                if !accumulating && k != 1 {
                    return Err(error(format!(
                        "is_tensor_update_accumulating = false stores each slot's row, which \
                         needs top-k 1, but num_blocks = {n} is the plan of top-k {k}"
                    )));
                }
                let sizes = LayerSizes {
                    t,
                    h: int("h")?,
                    e,
                    k,
                    i: int("i")?,
                    b,
                };
                let params = Params {
                    checkpoint_activation: Some(flag("checkpoint_activation")),
                    activation_function: activation("activation_function")?,
                    activation_type: activation("activation_type")?,
                    scaling_mode: scaling()?,
                    skip_token: Some(flag("skip_token")),
                    is_tensor_update_accumulating: Some(accumulating),
                    ..Params::default()
                };
                (sizes, params)
            }
        };
        Ok(FixedShape {
            kernel: entry.kernel,
            sizes,
            params,
            warnings: broken_limits(entry),
            source,
        })
    }
}

/// The smallest K ≤ E whose static block count for T tokens over E experts in blocks of B is N.
fn top_k_for_blocks(t: usize, e: usize, b: usize, n: usize) -> Option<usize> {
    // The count never decreases as K grows (a T·K past usize counts as past N), so the first
    // K that reaches N is found by bisection, whatever the sizes.
    let reaches = |k: usize| {
        t.checked_mul(k)
            .and_then(|m| static_block_count(m, e, b, 1))
            .is_none_or(|count| count >= n)
    };
    let (mut lo, mut hi) = (1, e);
    if lo > hi {
        return None;
    }
    while lo < hi {
        let mid = lo + (hi - lo) / 2;
        if reaches(mid) {
            hi = mid;
        } else {
            lo = mid + 1;
        }
    }
    (t.checked_mul(lo)
        .and_then(|m| static_block_count(m, e, b, 1))
        == Some(n))
    .then_some(lo)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn top_k_for_blocks_is_the_first_k_with_the_block_count() {
        for t in 1..12 {
            for e in 1..10 {
                for b in 1..6 {
                    for n in 0..40 {
                        let linear =
                            (1..=e).find(|&k| static_block_count(t * k, e, b, 1) == Some(n));
                        assert_eq!(top_k_for_blocks(t, e, b, n), linear, "{t} {e} {b} {n}");
                    }
                }
            }
        }
    }

    #[test]
    fn top_k_for_blocks_answers_at_once_for_sizes_no_loop_could_walk() {
        let huge = usize::MAX / 2;
        // Blocks of one slot: N = T·K, and no K gives an odd N for T = 2.
        assert_eq!(top_k_for_blocks(2, huge, 1, 3), None);
        assert_eq!(top_k_for_blocks(2, huge, 1, 4), Some(2));
        // T·K overflows long before K reaches E.
        assert_eq!(top_k_for_blocks(huge, huge, 1, usize::MAX), None);
        assert_eq!(top_k_for_blocks(3, 0, 1, 0), None);
    }
}
