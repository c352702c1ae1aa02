//! RMSNorm forward and backward on the CPU, the norm of `rmsnorm_router_topk_tkg`: per row of
//! `x [T, H]`, `y = x · r ⊙ gamma` with `r = 1 / sqrt(Σ_h x² / divisor + eps)`, in f32. Rows
//! run in parallel tiles of [`ROW_TILE`]; each row's sums run over interleaved lanes ([`super::rows::dot`])
//! added in order, and `d_gamma` adds the tiles' partial sums in tile order, so results do not
//! depend on the thread count.

use rayon::prelude::*;

use super::ROW_TILE;
use super::element::ensure_finite;
use super::rows::dot;
use crate::composed::RmsNorm;
use crate::contracts::RmsNormSpec;
use crate::contracts::spec::output_named;
use crate::contracts::tensors::{
    rmsnorm_router_topk_tkg as fwd, rmsnorm_router_topk_tkg_bwd as bwd,
};
use crate::error::Result;
use crate::tensor::{Floats, try_filled};

use super::CpuBackend;

/// `r` of one row.
/// `r` of one row, the scalar computed in f64 so that a tiny `eps` over a zero row cannot
/// overflow the backward's `r³`.
fn inverse_rms(row: &[f32], spec: RmsNormSpec) -> f64 {
    1.0 / (f64::from(dot(row, row)) / spec.divisor as f64 + f64::from(spec.eps)).sqrt()
}

impl RmsNorm for CpuBackend {
    fn forward(&self, spec: RmsNormSpec, x: Floats<'_>, gamma: Floats<'_>) -> Result<Vec<f32>> {
        let h = spec.h;
        let gamma = gamma.to_f32();
        let mut y = try_filled(&output_named(fwd::NORM_OUTPUT.name), &[spec.t, h], 0.0f32)?;
        y.par_chunks_mut(ROW_TILE * h)
            .enumerate()
            .for_each(|(tile, y)| {
                let first = tile * ROW_TILE;
                let x = x.slice(first * h..first * h + y.len()).to_f32();
                for (y, x) in y.chunks_mut(h).zip(x.chunks(h)) {
                    let r = inverse_rms(x, spec) as f32;
                    for ((y, x), g) in y.iter_mut().zip(x).zip(gamma.iter()) {
                        *y = x * r * g;
                    }
                }
            });
        ensure_finite(fwd::NORM_OUTPUT.name, &[spec.t, h], &y)?;
        Ok(y)
    }

    fn backward(
        &self,
        spec: RmsNormSpec,
        x: Floats<'_>,
        gamma: Floats<'_>,
        d_y: &[f32],
    ) -> Result<(Vec<f32>, Vec<f32>)> {
        let h = spec.h;
        let gamma = gamma.to_f32();
        let mut d_x = try_filled(
            &output_named(bwd::D_HIDDEN_STATES.name),
            &[spec.t, h],
            0.0f32,
        )?;
        // Each tile's `Σ_t d_y ⊙ x·r`, added in tile order below.
        let partial_d_gamma: Vec<Vec<f32>> = d_x
            .par_chunks_mut(ROW_TILE * h)
            .zip(d_y.par_chunks(ROW_TILE * h))
            .enumerate()
            .map(|(tile, (d_x, d_y))| {
                let first = tile * ROW_TILE;
                let x = x.slice(first * h..first * h + d_x.len()).to_f32();
                let mut d_gamma = vec![0.0f32; h];
                let mut g = vec![0.0f32; h];
                for ((d_x, x), d_y) in d_x.chunks_mut(h).zip(x.chunks(h)).zip(d_y.chunks(h)) {
                    let r = inverse_rms(x, spec);
                    for ((g, d), w) in g.iter_mut().zip(d_y).zip(gamma.iter()) {
                        *g = d * w;
                    }
                    let along_x = (r * r * r * f64::from(dot(&g, x)) / spec.divisor as f64) as f32;
                    let r = r as f32;
                    for j in 0..h {
                        d_x[j] = r * g[j] - x[j] * along_x;
                        d_gamma[j] += d_y[j] * x[j] * r;
                    }
                }
                d_gamma
            })
            .collect();
        let mut d_gamma = vec![0.0f32; h];
        for partial in &partial_d_gamma {
            for (acc, p) in d_gamma.iter_mut().zip(partial) {
                *acc += p;
            }
        }
        ensure_finite(bwd::D_HIDDEN_STATES.name, &[spec.t, h], &d_x)?;
        ensure_finite(bwd::D_GAMMA.name, &[h], &d_gamma)?;
        Ok((d_x, d_gamma))
    }
}
