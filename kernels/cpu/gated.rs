//! The gated activation `act = f(gate) · up` on rows of gate and up values, for every
//! [`ActFnType`], forward and backward. SiLU runs on the AVX-512 SwiGLU of [`super::swiglu`];
//! the other functions run as scalar loops of their textbook formulas in f32. Either way every
//! element goes through the same instructions, so results depend only on the values.

use super::swiglu;
use crate::contracts::ActFnType;

pub use super::swiglu::Backward;

/// `act[c] = f(gate[c]) · up[c]` for equal-length slices.
///
/// # Panics
/// If the lengths differ.
pub fn forward(act_fn: ActFnType, gate: &[f32], up: &[f32], act: &mut [f32]) {
    if act_fn == ActFnType::Silu {
        swiglu::forward(gate, up, act);
        return;
    }
    assert!(
        gate.len() == up.len() && up.len() == act.len(),
        "gated::forward: slices of different lengths"
    );
    for ((a, &g), &u) in act.iter_mut().zip(gate).zip(up) {
        *a = value_and_derivative(act_fn, g).0 * u;
    }
}

/// Runs [`Backward`] for `act_fn`: writes `act = f(g) · u`, `d_gate = d_act · u · f'(g)` and
/// `d_up = d_act · f(g)`.
///
/// # Panics
/// If the lengths differ.
pub fn backward(act_fn: ActFnType, row: Backward<'_>) {
    if act_fn == ActFnType::Silu {
        swiglu::backward(row);
        return;
    }
    row.assert_equal_lengths();
    for c in 0..row.gate.len() {
        let (g, u, da) = (row.gate[c], row.up[c], row.d_act[c]);
        let (f, f_grad) = value_and_derivative(act_fn, g);
        row.act[c] = f * u;
        row.d_gate[c] = da * u * f_grad;
        row.d_up[c] = da * f;
    }
}

fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// `(f(g), f'(g))` in f32.
fn value_and_derivative(act_fn: ActFnType, g: f32) -> (f32, f32) {
    match act_fn {
        ActFnType::Silu => {
            let s = sigmoid(g);
            (g * s, s * (1.0 + g * (1.0 - s)))
        }
        ActFnType::Gelu => {
            let cdf = 0.5 * (1.0 + libm::erff(g * std::f32::consts::FRAC_1_SQRT_2));
            let pdf = (-0.5 * g * g).exp()
                * (0.5 * std::f32::consts::FRAC_2_SQRT_PI)
                * std::f32::consts::FRAC_1_SQRT_2;
            (g * cdf, cdf + g * pdf)
        }
        ActFnType::GeluTanhApprox => {
            let c = std::f32::consts::FRAC_2_SQRT_PI * std::f32::consts::FRAC_1_SQRT_2;
            let t = (c * (g + 0.044715 * g * g * g)).tanh();
            let dt = (1.0 - t * t) * c * (1.0 + 3.0 * 0.044715 * g * g);
            (0.5 * g * (1.0 + t), 0.5 * (1.0 + t) + 0.5 * g * dt)
        }
        ActFnType::Swish => {
            let s = sigmoid(1.702 * g);
            (g * s, s + 1.702 * g * s * (1.0 - s))
        }
        ActFnType::Relu => {
            if g > 0.0 {
                (g, 1.0)
            } else {
                (0.0, 0.0)
            }
        }
        ActFnType::SquaredRelu => {
            let r = g.max(0.0);
            (r * r, 2.0 * r)
        }
    }
}
