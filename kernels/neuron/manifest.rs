//! The `neuron` backend's kernel manifest: which NEFF runs which kernel call.
//!
//! A NEFF is compiled for fixed shapes, so the manifest (`kernels.toml`) registers each NEFF
//! under its kernel name and the shape parameters it was compiled for:
//!
//! ```toml
//! [[kernel]]
//! name = "router_topk"
//! neff = "neff/router_topk_t512.neff"   # relative to the manifest's folder
//! t = 512
//! h = 2048
//! e = 128
//! k = 8
//! act_fn = "SOFTMAX"
//! norm_topk_prob = true
//! ```
//!
//! A call runs the first entry of its kernel whose every key equals the call's value (a key an
//! entry leaves out matches any value, except those whose absence means nki-library's default:
//! an entry without a clamp limit was compiled without that clamp, one without `skip_token`,
//! `is_tensor_update_accumulating` or `mask_unselected_experts` with false, true and false,
//! and so on for each kernel's defaults, and each matches only calls with that default). Keys
//! per kernel are listed by [`keys`]; an unknown key, kernel or value type is an error when the
//! manifest is read.

use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};

use serde::Deserialize;

use crate::contracts::tensors::{
    blockwise_mm, find_nonzero_indices, indexed_flatten, moe_block_tkg, moe_tkg,
    rmsnorm_router_topk_tkg, router_topk,
};
use crate::contracts::{
    IndexedFlattenParams, MoeBlockTkgParams, RmsNormRouterParams, TopkParams, TopkReduceParams,
};
use crate::error::{Error, Result};
use crate::kernel::{Kernel, Param};

/// A parameter value in a manifest entry or a call's key.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Value {
    Int(usize),
    /// A parameter that may be negative (`padding_val`, `token_base_index`).
    Signed(i32),
    Bool(bool),
    Str(String),
}

impl fmt::Display for Value {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Value::Int(v) => write!(f, "{v}"),
            Value::Signed(v) => write!(f, "{v}"),
            Value::Bool(v) => write!(f, "{v}"),
            Value::Str(v) => write!(f, "{v}"),
        }
    }
}

/// The kind of value a manifest key takes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ValueKind {
    /// A positive integer (a size).
    Int,
    /// A non-negative integer (an enum value such as `x_hbm_layout`).
    Index,
    /// An i32, negative ones included (a value such as `padding_val`).
    Signed,
    Bool,
    Str,
    /// A clamp limit: a number, or `"none"` (also what an entry that leaves the key out means).
    Limit,
    /// A finite number (a compile-time constant such as `eps`).
    Number,
}

impl Value {
    /// A clamp limit's key value: the number as f32 prints it (shortest round trip), or `none`.
    pub fn limit(limit: Option<f32>) -> Value {
        Value::Str(limit.map_or_else(|| NO_LIMIT.to_owned(), |v| v.to_string()))
    }

    /// A number's key value: as f32 prints it (shortest round trip).
    pub fn number(value: f32) -> Value {
        Value::Str(value.to_string())
    }
}

/// A clamp limit that is not set.
const NO_LIMIT: &str = "none";

/// `router_topk`'s keys.
const ROUTER_TOPK_KEYS: &[(&str, ValueKind)] = &[
    ("t", ValueKind::Int),
    ("h", ValueKind::Int),
    ("e", ValueKind::Int),
    (Param::K.name(), ValueKind::Int),
    // SOFTMAX or SIGMOID, as `RouterActFnType` spells them.
    (Param::ActFn.name(), ValueKind::Str),
    (Param::RouterPreNorm.name(), ValueKind::Bool),
    (Param::NormTopkProb.name(), ValueKind::Bool),
    // 0 = x [H, T], 1 = x [T, H].
    (Param::XHbmLayout.name(), ValueKind::Index),
    // Whether the NEFF takes a `w_bias` / `selection_bias` input.
    (router_topk::W_BIAS.name, ValueKind::Bool),
    (router_topk::SELECTION_BIAS.name, ValueKind::Bool),
];

/// `blockwise_mm`'s keys.
const BLOCKWISE_MM_KEYS: &[(&str, ValueKind)] = &[
    ("t", ValueKind::Int),
    ("h", ValueKind::Int),
    ("e", ValueKind::Int),
    ("i", ValueKind::Int),
    (Param::BlockSize.name(), ValueKind::Int),
    ("num_blocks", ValueKind::Int),
    // An `ActFnType` member: SiLU, GELU, GELU_Tanh_Approx, Swish, ReLU or SquaredReLU.
    (Param::ActivationFunction.name(), ValueKind::Str),
    // An `ExpertAffinityScaleMode` member: NO_SCALE, POST_SCALE, PRE_SCALE, PRE_SCALE_DELAYED.
    (Param::ExpertAffinitiesScalingMode.name(), ValueKind::Str),
    (Param::CheckpointActivation.name(), ValueKind::Bool),
    // Whether the NEFF takes the `gate_and_up_proj_bias` / `down_proj_bias` inputs.
    (blockwise_mm::GATE_AND_UP_PROJ_BIAS.name, ValueKind::Bool),
    (blockwise_mm::DOWN_PROJ_BIAS.name, ValueKind::Bool),
    (Param::GateClampLowerLimit.name(), ValueKind::Limit),
    (Param::GateClampUpperLimit.name(), ValueKind::Limit),
    (Param::UpClampLowerLimit.name(), ValueKind::Limit),
    (Param::UpClampUpperLimit.name(), ValueKind::Limit),
    // `SkipMode.skip_token`: `hidden_states [T, H]` and −1 padding.
    (Param::SkipToken.name(), ValueKind::Bool),
    (Param::IsTensorUpdateAccumulating.name(), ValueKind::Bool),
];

/// `blockwise_mm_bwd`'s keys.
const BLOCKWISE_MM_BWD_KEYS: &[(&str, ValueKind)] = &[
    ("t", ValueKind::Int),
    ("h", ValueKind::Int),
    ("e", ValueKind::Int),
    ("i", ValueKind::Int),
    (Param::BlockSize.name(), ValueKind::Int),
    ("num_blocks", ValueKind::Int),
    (Param::ActivationType.name(), ValueKind::Str),
    (Param::ExpertAffinitiesScalingMode.name(), ValueKind::Str),
    // Whether the NEFF returns `gate_and_up_proj_bias_grad` and `down_proj_bias_grad`.
    (Param::Bias.name(), ValueKind::Bool),
    (Param::NonLinearClampLowerLimit.name(), ValueKind::Limit),
    (Param::NonLinearClampUpperLimit.name(), ValueKind::Limit),
    (Param::LinearClampLowerLimit.name(), ValueKind::Limit),
    (Param::LinearClampUpperLimit.name(), ValueKind::Limit),
    (Param::SkipToken.name(), ValueKind::Bool),
    (Param::IsTensorUpdateAccumulating.name(), ValueKind::Bool),
];

/// `moe_tkg`'s keys.
const MOE_TKG_KEYS: &[(&str, ValueKind)] = &[
    ("t", ValueKind::Int),
    ("h", ValueKind::Int),
    // E, the experts over all ranks (`expert_affinities`' columns), and E_L, those held here.
    ("e", ValueKind::Int),
    ("e_local", ValueKind::Int),
    (Param::K.name(), ValueKind::Int),
    ("i", ValueKind::Int),
    (Param::IsAllExpert.name(), ValueKind::Bool),
    // NO_SCALE or POST_SCALE.
    (Param::ExpertAffinitiesScalingMode.name(), ValueKind::Str),
    (Param::ActivationFn.name(), ValueKind::Str),
    (Param::MaskUnselectedExperts.name(), ValueKind::Bool),
    // Whether the NEFF takes the optional inputs (`rank_id` goes to all-expert POST_SCALE
    // NEFFs, which require it, and to no other).
    (moe_tkg::EXPERT_GATE_UP_BIAS.name, ValueKind::Bool),
    (moe_tkg::EXPERT_DOWN_BIAS.name, ValueKind::Bool),
    (moe_tkg::EXPERT_AFFINITIES_EAGER.name, ValueKind::Bool),
    (Param::GateClampLowerLimit.name(), ValueKind::Limit),
    (Param::GateClampUpperLimit.name(), ValueKind::Limit),
    (Param::UpClampLowerLimit.name(), ValueKind::Limit),
    (Param::UpClampUpperLimit.name(), ValueKind::Limit),
];

/// `rmsnorm_router_topk_tkg`'s keys.
const RMSNORM_ROUTER_TOPK_TKG_KEYS: &[(&str, ValueKind)] = &[
    ("t", ValueKind::Int),
    ("h", ValueKind::Int),
    ("e", ValueKind::Int),
    (Param::TopK.name(), ValueKind::Int),
    (Param::Eps.name(), ValueKind::Number),
    (Param::HiddenActual.name(), ValueKind::Int),
    // bfloat16 or float32: `router_weights`' dtype and `norm_output`'s.
    (Param::RouterMmDType.name(), ValueKind::Str),
    // SIGMOID or SOFTMAX.
    (Param::RouterActFn.name(), ValueKind::Str),
    (Param::StoreEagerAffiOnly.name(), ValueKind::Bool),
    // Whether the NEFF takes a `router_bias` input.
    (rmsnorm_router_topk_tkg::ROUTER_BIAS.name, ValueKind::Bool),
];

/// `moe_block_tkg`'s keys.
const MOE_BLOCK_TKG_KEYS: &[(&str, ValueKind)] = &[
    ("t", ValueKind::Int),
    ("h", ValueKind::Int),
    // E, the router's experts, and E_L, those held here (E unless is_all_expert).
    ("e", ValueKind::Int),
    ("e_local", ValueKind::Int),
    ("i", ValueKind::Int),
    (Param::TopK.name(), ValueKind::Int),
    (Param::Eps.name(), ValueKind::Number),
    (Param::HiddenActual.name(), ValueKind::Int),
    // bfloat16 or float32: `router_weights`' dtype.
    (Param::RouterMmDType.name(), ValueKind::Str),
    (Param::RouterActFn.name(), ValueKind::Str),
    (Param::RouterPreNorm.name(), ValueKind::Bool),
    (Param::NormTopkProb.name(), ValueKind::Bool),
    // NO_SCALE or POST_SCALE.
    (Param::ExpertAffinitiesScalingMode.name(), ValueKind::Str),
    (Param::HiddenActFn.name(), ValueKind::Str),
    (Param::IsAllExpert.name(), ValueKind::Bool),
    // Whether the NEFF returns `router_logits`.
    (Param::SkipRouterLogits.name(), ValueKind::Bool),
    // Whether the NEFF takes the optional inputs (`rank_id` goes to all-expert NEFFs, which
    // require it, and to no other).
    (moe_block_tkg::ROUTER_BIAS.name, ValueKind::Bool),
    (moe_block_tkg::EXPERT_GATE_UP_BIAS.name, ValueKind::Bool),
    (moe_block_tkg::EXPERT_DOWN_BIAS.name, ValueKind::Bool),
    (Param::GateClampLowerLimit.name(), ValueKind::Limit),
    (Param::GateClampUpperLimit.name(), ValueKind::Limit),
    (Param::UpClampLowerLimit.name(), ValueKind::Limit),
    (Param::UpClampUpperLimit.name(), ValueKind::Limit),
];

/// `topk`'s keys.
const TOPK_KEYS: &[(&str, ValueKind)] = &[
    // The rows (the product of `inp`'s leading axes) and V, its last axis.
    ("rows", ValueKind::Int),
    ("v", ValueKind::Int),
    (Param::K.name(), ValueKind::Int),
    (Param::SortedFlag.name(), ValueKind::Bool),
    // ROTATIONAL or SCANNING, as `SupportedTopkMethods` spells them.
    (Param::Method.name(), ValueKind::Str),
];

/// `topk_reduce`'s keys.
const TOPK_REDUCE_KEYS: &[(&str, ValueKind)] = &[
    // T and K (nki-library's parameters `T` and `K`), H, and TK_padded, `input`'s rows.
    ("t", ValueKind::Int),
    ("h", ValueKind::Int),
    ("k", ValueKind::Int),
    ("tk_padded", ValueKind::Int),
    (Param::TokenBaseIndex.name(), ValueKind::Signed),
];

/// `find_nonzero_indices`' keys.
const FIND_NONZERO_INDICES_KEYS: &[(&str, ValueKind)] = &[
    ("t", ValueKind::Int),
    ("c_full", ValueKind::Int),
    // C, the columns searched: C_full, or n_cols from `col_start_id`.
    (Param::NCols.name(), ValueKind::Int),
    // Whether the NEFF takes a `col_start_id` input.
    (find_nonzero_indices::COL_START_ID.name, ValueKind::Bool),
];

/// `indexed_flatten`'s keys.
const INDEXED_FLATTEN_KEYS: &[(&str, ValueKind)] = &[
    ("e", ValueKind::Int),
    ("t", ValueKind::Int),
    // N, `row_offsets`' length.
    ("n", ValueKind::Int),
    (Param::FLen.name(), ValueKind::Int),
    (Param::OutputLen.name(), ValueKind::Int),
    (Param::PaddingVal.name(), ValueKind::Signed),
    // Whether the NEFF takes a `row_offsets_start` input.
    (indexed_flatten::ROW_OFFSETS_START.name, ValueKind::Bool),
];

/// What a call (whose key is `key`) must have for a key an entry leaves out where leaving it
/// out means the NEFF was compiled with nki-library's default: no clamp limit, `skip_token`
/// false, `is_tensor_update_accumulating` true, `mask_unselected_experts` false, and
/// `rmsnorm_router_topk_tkg`'s `eps` 1e-6, `hidden_actual` H, `router_mm_dtype` bfloat16,
/// `router_act_fn` SIGMOID and `store_eager_affi_only` false, `moe_block_tkg`'s every other
/// default (`router_pre_norm` true, `norm_topk_prob` false, NO_SCALE, SiLU, selective, the
/// router logits returned), `topk`'s `sorted_flag` true and `method` ROTATIONAL,
/// `topk_reduce`'s `token_base_index` 1, `find_nonzero_indices`' `n_cols` C_full without
/// `col_start_id`, and `indexed_flatten`'s `padding_val` −1 without `row_offsets_start`. Other
/// keys an entry leaves out match any value.
pub(super) fn implied_default(
    kernel: Kernel,
    name: &str,
    kind: ValueKind,
    key: &[(&str, Value)],
) -> Option<Value> {
    let fused = RmsNormRouterParams::default();
    let param = |param: Param| name == param.name();
    // The value the call gives another key (a size).
    let call_value = |other: &str| {
        key.iter()
            .find(|(call_name, _)| *call_name == other)
            .map(|(_, value)| value.clone())
    };
    let kernel_defaults: Vec<(&str, Value)> = match kernel {
        Kernel::MoeBlockTkg => {
            let block = MoeBlockTkgParams::default();
            vec![
                (
                    Param::RouterPreNorm.name(),
                    Value::Bool(block.router_pre_norm),
                ),
                (
                    Param::NormTopkProb.name(),
                    Value::Bool(block.norm_topk_prob),
                ),
                (Param::IsAllExpert.name(), Value::Bool(block.is_all_expert)),
                (
                    Param::SkipRouterLogits.name(),
                    Value::Bool(block.skip_router_logits),
                ),
                (
                    Param::ExpertAffinitiesScalingMode.name(),
                    Value::Str(block.expert_affinities_scaling_mode.to_string()),
                ),
                (
                    Param::HiddenActFn.name(),
                    Value::Str(block.hidden_act_fn.to_string()),
                ),
            ]
        }
        Kernel::Topk => {
            let topk = TopkParams::new(1);
            vec![
                (Param::SortedFlag.name(), Value::Bool(topk.sorted_flag)),
                (Param::Method.name(), Value::Str(topk.method.to_string())),
            ]
        }
        Kernel::TopkReduce => vec![(
            Param::TokenBaseIndex.name(),
            Value::Signed(TopkReduceParams::DEFAULT_TOKEN_BASE_INDEX),
        )],
        // Every column, and no `col_start_id`.
        Kernel::FindNonzeroIndices => call_value("c_full")
            .map(|c_full| (Param::NCols.name(), c_full))
            .into_iter()
            .chain([(find_nonzero_indices::COL_START_ID.name, Value::Bool(false))])
            .collect(),
        Kernel::IndexedFlatten => vec![
            (
                Param::PaddingVal.name(),
                Value::Signed(IndexedFlattenParams::DEFAULT_PADDING_VAL),
            ),
            (indexed_flatten::ROW_OFFSETS_START.name, Value::Bool(false)),
        ],
        _ => Vec::new(),
    };
    if let Some((_, value)) = kernel_defaults.into_iter().find(|(key, _)| *key == name) {
        return Some(value);
    }
    match kind {
        ValueKind::Limit => Some(Value::limit(None)),
        _ if param(Param::SkipToken)
            || param(Param::MaskUnselectedExperts)
            || param(Param::StoreEagerAffiOnly) =>
        {
            Some(Value::Bool(false))
        }
        _ if param(Param::IsTensorUpdateAccumulating) => Some(Value::Bool(true)),
        _ if param(Param::Eps) => Some(Value::number(fused.eps)),
        _ if param(Param::RouterMmDType) => Some(Value::Str(fused.router_mm_dtype.to_string())),
        _ if param(Param::RouterActFn) => Some(Value::Str(fused.router_act_fn.to_string())),
        // The whole of H.
        _ if param(Param::HiddenActual) => call_value("h"),
        _ => None,
    }
}

/// The keys an entry of `kernel` may set, with their kinds; `None` if the `neuron` backend does
/// not run that kernel.
pub fn keys(kernel: Kernel) -> Option<&'static [(&'static str, ValueKind)]> {
    match kernel {
        Kernel::RouterTopk => Some(ROUTER_TOPK_KEYS),
        Kernel::BlockwiseMm => Some(BLOCKWISE_MM_KEYS),
        Kernel::BlockwiseMmBwd => Some(BLOCKWISE_MM_BWD_KEYS),
        Kernel::MoeTkg => Some(MOE_TKG_KEYS),
        Kernel::RmsNormRouterTopkTkg => Some(RMSNORM_ROUTER_TOPK_TKG_KEYS),
        Kernel::MoeBlockTkg => Some(MOE_BLOCK_TKG_KEYS),
        Kernel::Topk => Some(TOPK_KEYS),
        Kernel::TopkReduce => Some(TOPK_REDUCE_KEYS),
        Kernel::FindNonzeroIndices => Some(FIND_NONZERO_INDICES_KEYS),
        Kernel::IndexedFlatten => Some(INDEXED_FLATTEN_KEYS),
        _ => None,
    }
}

/// The kernels the `neuron` backend runs.
pub fn supported_kernels() -> Vec<&'static str> {
    Kernel::ALL
        .iter()
        .filter(|k| keys(**k).is_some())
        .map(|k| k.name())
        .collect()
}

/// The `[[kernel]]` table registering `neff` for calls of `kernel` with `key` (as
/// [`Manifest::read`] reads it back). A clamp limit that is not set is left out, which means
/// the same.
pub fn entry_toml(kernel: Kernel, neff: &Path, key: &[(&str, Value)]) -> String {
    let quoted = |text: &str| toml::Value::String(text.to_owned()).to_string();
    let mut table = format!(
        "[[kernel]]\nname = {}\nneff = {}\n",
        quoted(kernel.name()),
        quoted(&neff.to_string_lossy())
    );
    let kinds = keys(kernel).unwrap_or_default();
    for (name, value) in key {
        let kind = kinds
            .iter()
            .find(|(key, _)| key == name)
            .map(|(_, kind)| *kind);
        let written = match (kind, value) {
            (Some(ValueKind::Limit), Value::Str(limit)) if limit == NO_LIMIT => continue,
            // A TOML float (`7.0`, not `7`, which could overflow TOML's integers).
            (Some(ValueKind::Limit), Value::Str(limit)) if limit.contains(['.', 'e']) => {
                limit.clone()
            }
            (Some(ValueKind::Limit), Value::Str(limit)) => format!("{limit}.0"),
            (Some(ValueKind::Number), Value::Str(number)) if number.contains(['.', 'e']) => {
                number.clone()
            }
            (Some(ValueKind::Number), Value::Str(number)) => format!("{number}.0"),
            (_, Value::Str(text)) => quoted(text),
            (_, value) => value.to_string(),
        };
        table += &format!("{name} = {written}\n");
    }
    table
}

/// One registered NEFF.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Entry {
    pub kernel: Kernel,
    /// Absolute, or relative to the working directory (resolved against the manifest's folder).
    pub neff: PathBuf,
    pub params: BTreeMap<String, Value>,
}

impl Entry {
    fn matches(&self, key: &[(&str, Value)]) -> bool {
        let set_keys_match = self.params.iter().all(|(name, value)| {
            key.iter()
                .any(|(call_name, call_value)| call_name == name && call_value == value)
        });
        // A key the entry leaves out that implies a default: compiled with it.
        let mut defaults = keys(self.kernel)
            .unwrap_or_default()
            .iter()
            .filter(|(name, _)| !self.params.contains_key(*name))
            .filter_map(|&(name, kind)| {
                Some((name, implied_default(self.kernel, name, kind, key)?))
            });
        set_keys_match
            && defaults.all(|(name, default)| {
                key.iter()
                    .all(|(call_name, value)| *call_name != name || *value == default)
            })
    }
}

/// A parsed `kernels.toml`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Manifest {
    pub path: PathBuf,
    pub entries: Vec<Entry>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct FileForm {
    #[serde(default)]
    kernel: Vec<EntryForm>,
}

#[derive(Deserialize)]
struct EntryForm {
    name: String,
    neff: PathBuf,
    #[serde(flatten)]
    params: BTreeMap<String, toml::Value>,
}

impl Manifest {
    /// Reads and checks the manifest at `path`.
    pub fn read(path: &Path) -> Result<Manifest> {
        let text = std::fs::read_to_string(path).map_err(|error| Error::Io {
            path: path.to_path_buf(),
            error,
        })?;
        let format = |message: String| Error::Format {
            path: path.to_path_buf(),
            message,
        };
        let file: FileForm = toml::from_str(&text).map_err(|err| format(err.to_string()))?;
        let folder = path.parent().unwrap_or(Path::new(""));
        let entries = file
            .kernel
            .into_iter()
            .enumerate()
            .map(|(index, entry)| {
                let at = format!("kernel entry {} (`{}`)", index + 1, entry.name);
                let kernel: Kernel = entry
                    .name
                    .parse()
                    .map_err(|err| format(format!("{at}: {err}")))?;
                let keys = keys(kernel).ok_or_else(|| {
                    format(format!(
                        "{at}: the neuron backend does not run this kernel; it runs {}",
                        supported_kernels().join(", ")
                    ))
                })?;
                let params = entry
                    .params
                    .into_iter()
                    .map(|(name, value)| {
                        let (_, kind) =
                            keys.iter().find(|(key, _)| *key == name).ok_or_else(|| {
                                let known: Vec<&str> = keys.iter().map(|(key, _)| *key).collect();
                                format(format!(
                                    "{at}: unknown key `{name}`; known keys: {}",
                                    known.join(", ")
                                ))
                            })?;
                        let value = match (*kind, &value) {
                            (ValueKind::Int, toml::Value::Integer(v)) if *v > 0 => {
                                Value::Int(*v as usize)
                            }
                            (ValueKind::Index, toml::Value::Integer(v)) if *v >= 0 => {
                                Value::Int(*v as usize)
                            }
                            (ValueKind::Signed, toml::Value::Integer(v))
                                if i32::try_from(*v).is_ok() =>
                            {
                                Value::Signed(*v as i32)
                            }
                            (ValueKind::Bool, toml::Value::Boolean(v)) => Value::Bool(*v),
                            (ValueKind::Str, toml::Value::String(v)) => Value::Str(v.clone()),
                            (ValueKind::Limit, toml::Value::String(v)) if v == NO_LIMIT => {
                                Value::limit(None)
                            }
                            (ValueKind::Limit, toml::Value::Float(v)) if v.is_finite() => {
                                Value::limit(Some(*v as f32))
                            }
                            (ValueKind::Limit, toml::Value::Integer(v)) => {
                                Value::limit(Some(*v as f32))
                            }
                            (ValueKind::Number, toml::Value::Float(v)) if v.is_finite() => {
                                Value::number(*v as f32)
                            }
                            (ValueKind::Number, toml::Value::Integer(v)) => {
                                Value::number(*v as f32)
                            }
                            (kind, _) => {
                                let expected = match kind {
                                    ValueKind::Int => "a positive integer",
                                    ValueKind::Index => "a non-negative integer",
                                    ValueKind::Signed => "an integer (an i32)",
                                    ValueKind::Bool => "true or false",
                                    ValueKind::Str => "a string",
                                    ValueKind::Limit => "a number or \"none\"",
                                    ValueKind::Number => "a number",
                                };
                                return Err(format(format!(
                                    "{at}: `{name}` must be {expected}, got {value}"
                                )));
                            }
                        };
                        Ok((name, value))
                    })
                    .collect::<Result<_>>()?;
                Ok(Entry {
                    kernel,
                    neff: folder.join(entry.neff),
                    params,
                })
            })
            .collect::<Result<_>>()?;
        Ok(Manifest {
            path: path.to_path_buf(),
            entries,
        })
    }

    /// The first entry of `kernel` matching every key of the call, or an error that shows the
    /// call's key and what the manifest registers for that kernel.
    pub fn find(&self, kernel: Kernel, key: &[(&str, Value)]) -> Result<&Entry> {
        let mut registered = self
            .entries
            .iter()
            .filter(|entry| entry.kernel == kernel)
            .peekable();
        if let Some(entry) = registered.clone().find(|entry| entry.matches(key)) {
            return Ok(entry);
        }
        let call: Vec<String> = key
            .iter()
            .map(|(name, value)| format!("{name}={value}"))
            .collect();
        let known = if registered.peek().is_none() {
            format!("it registers no {} NEFF", kernel.name())
        } else {
            let listed: Vec<String> = registered
                .map(|entry| {
                    let params: Vec<String> = entry
                        .params
                        .iter()
                        .map(|(name, value)| format!("{name}={value}"))
                        .collect();
                    format!("{} ({})", entry.neff.display(), params.join(" "))
                })
                .collect();
            format!("it registers: {}", listed.join("; "))
        };
        Err(Error::Neff {
            neff: self.path.clone(),
            message: format!(
                "no NEFF for {} with {}; {known}",
                kernel.name(),
                call.join(" ")
            ),
        })
    }
}
