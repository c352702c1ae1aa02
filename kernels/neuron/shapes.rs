//! The shapes a manifest's NEFFs were compiled for, as [`FixedShape`]s: the MoE layer each
//! entry's calls come from and the kernel parameters it was compiled with, so a tool can feed
//! every NEFF a call it runs (what `moekit check` does on the `neuron` backend).
//!
//! Entries must name every size: `t`, `h`, `e`, `k` (`router_topk`), `t`, `h`, `e`, `i`,
//! `block_size`, `num_blocks` (the blockwise kernels; K is the smallest top-k whose static block
//! count is `num_blocks`), `t`, `h`, `e`, `k`, `i` (`moe_tkg`, whose checks hold every expert:
//! `e_local`, where given, must be `e`), `t`, `h`, `e`, `top_k` (`rmsnorm_router_topk_tkg`) or
//! `t`, `h`, `e`, `i`, `top_k` (`moe_block_tkg`, likewise with every expert held).

use super::limits::broken_limits;
use super::manifest::{Entry, Manifest, Value};
use crate::backend::{FixedShape, FixedShapes, LayerSizes};
use crate::contracts::{
    ActFnType, ExpertAffinityScaleMode, MoeBlockTkgParams, RmsNormRouterParams, RouterActFnType,
    XHbmLayout, static_block_count,
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
