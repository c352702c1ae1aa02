//! The kernel catalog as `moekit list` prints it: a text table, and the Markdown table of the
//! README.

use std::fmt::Write as _;

use moekit::contracts::TensorSpec;
use moekit::kernel::{Kernel, ParamUse, SCHEDULE_ONLY_PARAMS};

/// The catalog as the text table `moekit list` prints.
pub fn catalog_table() -> String {
    let mut out = String::new();
    for kernel in Kernel::ALL {
        let spec = kernel.spec();
        let _ = writeln!(out, "{}\n  {}", spec.name, spec.summary);
        for (heading, tensors) in [("inputs", spec.inputs), ("outputs", spec.outputs)] {
            let _ = writeln!(out, "  {heading}:");
            for t in tensors {
                let note = if t.required { "" } else { "  (optional)" };
                let _ = writeln!(out, "    {:<31} {:<16} {}{note}", t.name, t.shape, t.dtype);
            }
        }
        if !spec.params.is_empty() {
            let _ = writeln!(out, "  params:");
            for &(param, usage) in spec.params {
                let default = match usage {
                    ParamUse::Required => "required".to_owned(),
                    ParamUse::Defaulted => format!("default {}", param.default_value(*kernel)),
                };
                let _ = writeln!(
                    out,
                    "    {:<31} {:<16} {default}",
                    param.name(),
                    param.values()
                );
            }
        }
        out.push('\n');
    }
    let _ = writeln!(
        out,
        "nki-library parameters accepted without effect on the results: {}.",
        SCHEDULE_ONLY_PARAMS.join(", ")
    );
    out.push_str(
        "[(T+1)·E, 1] tensors are also accepted as [(T+1)·E], and block_to_expert [N, 1] as [N].\n\
         token_position_to_id holds T (the zero row of hidden_states) in padding slots.\n\
         Float outputs `like x` take input x's dtype (nki-library's), or f32 with \
         output_dtype=float32 (moekit's own).\n\
         Reference error bound: every value is computed in f64 and rounded once to f32, then to \
         bf16 for a bf16 output (indices and counts are exact).\n",
    );
    out
}

/// Where the README's kernel table ([`catalog_markdown`]) starts and ends.
pub const README_TABLE_MARKERS: (&str, &str) = (
    "<!-- kernel table: moekit list --markdown -->\n",
    "<!-- end of kernel table -->\n",
);

/// The catalog as the Markdown table of the README (`moekit list --markdown`): each kernel's
/// tensors with their layouts (`?` marks optional ones) and its parameters with their defaults.
pub fn catalog_markdown() -> String {
    let tensors = |list: &[TensorSpec]| {
        list.iter()
            .map(|t| {
                let optional = if t.required { "" } else { "?" };
                // A `|` in a layout would end the table cell.
                format!("`{} {}`{optional}", t.name, t.shape.replace('|', "\\|"))
            })
            .collect::<Vec<_>>()
            .join(", ")
    };
    let mut out =
        String::from("| kernel | inputs | outputs | params (default) |\n|---|---|---|---|\n");
    for kernel in Kernel::ALL {
        let spec = kernel.spec();
        let params: Vec<String> = spec
            .params
            .iter()
            .map(|&(param, usage)| match usage {
                ParamUse::Defaulted => {
                    format!("`{}` ({})", param.name(), param.default_value(*kernel))
                }
                ParamUse::Required => format!("`{}`", param.name()),
            })
            .collect();
        let _ = writeln!(
            out,
            "| `{}` | {} | {} | {} |",
            spec.name,
            tensors(spec.inputs),
            tensors(spec.outputs),
            params.join(", ")
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_readme_kernel_table_is_the_catalog() {
        let readme = include_str!(concat!(env!("CARGO_MANIFEST_DIR"), "/../../README.md"));
        let (begin, end) = README_TABLE_MARKERS;
        let start = readme
            .find(begin)
            .expect("README.md has the table's start marker")
            + begin.len();
        let len = readme[start..]
            .find(end)
            .expect("README.md has the table's end marker");
        assert_eq!(
            &readme[start..start + len],
            catalog_markdown(),
            "README.md's kernel table differs from the catalog: paste `moekit list --markdown`"
        );
    }
}
