//! f64 RMSNorm forward and backward, the norm of `rmsnorm_router_topk_tkg` (see
//! [`crate::contracts::rmsnorm_router_topk_tkg`]): per row of `x [T, H]`,
//! `y = x · r ⊙ gamma` with `r = 1 / sqrt(Σ_h x² / divisor + eps)`.

use crate::contracts::RmsNormSpec;
use crate::contracts::spec::output_named;
use crate::error::Result;
use crate::tensor::try_filled;

/// `r` of one row.
fn inverse_rms(row: &[f64], spec: RmsNormSpec) -> f64 {
    let squares: f64 = row.iter().map(|x| x * x).sum();
    1.0 / (squares / spec.divisor as f64 + f64::from(spec.eps)).sqrt()
}

/// `y [T, H]` from `x [T, H]` and `gamma [H]`.
pub fn rmsnorm_forward(x: &[f64], gamma: &[f64], spec: RmsNormSpec) -> Result<Vec<f64>> {
    let mut y = try_filled(&output_named("norm_output"), &[spec.t, spec.h], 0.0)?;
    for (y, x) in y.chunks_mut(spec.h).zip(x.chunks(spec.h)) {
        let r = inverse_rms(x, spec);
        for ((y, x), g) in y.iter_mut().zip(x).zip(gamma) {
            *y = x * r * g;
        }
    }
    Ok(y)
}

/// `(d_x [T, H], d_gamma [H])` from `d_y [T, H]`: with `g = d_y ⊙ gamma`,
/// `d_x = r·g − x·r³·(g · x) / divisor` and `d_gamma = Σ_t d_y ⊙ x·r`.
pub fn rmsnorm_backward(
    x: &[f64],
    gamma: &[f64],
    d_y: &[f64],
    spec: RmsNormSpec,
) -> Result<(Vec<f64>, Vec<f64>)> {
    let mut d_x = try_filled(&output_named("d_hidden_states"), &[spec.t, spec.h], 0.0)?;
    let mut d_gamma = vec![0.0; spec.h];
    for ((d_x, x), d_y) in d_x
        .chunks_mut(spec.h)
        .zip(x.chunks(spec.h))
        .zip(d_y.chunks(spec.h))
    {
        let r = inverse_rms(x, spec);
        let g_dot_x: f64 = (0..spec.h).map(|j| d_y[j] * gamma[j] * x[j]).sum();
        let along_x = r * r * r * g_dot_x / spec.divisor as f64;
        for j in 0..spec.h {
            d_x[j] = r * d_y[j] * gamma[j] - x[j] * along_x;
            d_gamma[j] += d_y[j] * x[j] * r;
        }
    }
    Ok((d_x, d_gamma))
}
