//! Decode-time experts on the CPU (`moe_tkg`): each expert's weights are read once per call,
//! for all the tokens routed to it.
//!
//! The routes ([`TkgRouting`]: each token's K experts, or every expert held here) are grouped
//! by expert, ascending, routes of a zero weight left out; an expert with more than
//! [`TASK_ROWS`] routes is cut into pieces of that many. Each piece is one task: its token
//! rows gathered, `[m, H] · [H, 2I]`, biases, clamps and `act(gate) ⊙ up` on the result, then
//! `[m, I] · [I, H]` and the down bias, into its rows of a buffer of expert outputs. The tasks
//! run in parallel, in waves whose outputs fit [`WAVE_BYTES`]; after each wave the outputs are
//! added into `output`, weighted, in task order. So each token's sum runs over its experts in
//! ascending order whatever the number of threads, and results are bit-identical across thread
//! counts.

use rayon::prelude::*;

use super::element::finite_output;
use super::expert_matrix::{ExpertMatrix, Panels};
use super::gated;
use super::rows::{add_bias_rows, add_scaled, bias_row, clamp_rows, gather_rows, resized};
use super::scratch::PerThread;
use super::skinny;
use crate::contracts::spec::output;
use crate::contracts::tensors::moe_tkg as tkg;
use crate::contracts::{MoeTkg, MoeTkgDims, MoeTkgOutputs, WeightLayout};
use crate::error::Result;
use crate::tensor::{Floats, try_filled};

/// Most routes of one expert that one task computes.
const TASK_ROWS: usize = 64;

/// Bytes of expert outputs `[routes, H]` (f32) computed before they are added into `output`:
/// bounds the buffer on all-expert calls with many tokens, where every token has E_L routes.
const WAVE_BYTES: usize = 16 << 20;

/// One task: routes of one expert.
struct Piece {
    expert: usize,
    /// The routes' tokens.
    tokens: Vec<usize>,
    /// The routes' weights.
    weights: Vec<f32>,
}

/// The routes of `call` grouped into [`Piece`]s, by expert ascending, each expert's routes in
/// token order.
fn pieces(call: &MoeTkg<'_>) -> Vec<Piece> {
    let routing = call.routing();
    let mut by_expert: Vec<(Vec<usize>, Vec<f32>)> =
        vec![(Vec::new(), Vec::new()); call.dims().e_local];
    for (route, (&expert, &weight)) in routing.experts.iter().zip(&routing.weights).enumerate() {
        if weight != 0.0 {
            let (tokens, weights) = &mut by_expert[expert];
            tokens.push(route / routing.per_token);
            weights.push(weight as f32);
        }
    }
    let mut pieces = Vec::new();
    for (expert, (tokens, weights)) in by_expert.into_iter().enumerate() {
        for (tokens, weights) in tokens.chunks(TASK_ROWS).zip(weights.chunks(TASK_ROWS)) {
            pieces.push(Piece {
                expert,
                tokens: tokens.to_vec(),
                weights: weights.to_vec(),
            });
        }
    }
    pieces
}

/// Per-task buffers, reused from one task to the next on a thread.
#[derive(Default)]
struct Scratch {
    x: Vec<f32>,
    gate_up: Vec<f32>,
    act: Vec<f32>,
    panel: Vec<f32>,
    tile: Vec<f32>,
}

/// The piece's expert outputs `y [m, H]` (before the route weights) into `y`.
fn expert_outputs(call: &MoeTkg<'_>, piece: &Piece, y: &mut [f32], scratch: &mut Scratch) {
    let (floats, params) = (call.floats(), call.params());
    let MoeTkgDims { h, i, .. } = call.dims();
    let m = piece.tokens.len();
    let Scratch {
        x,
        gate_up,
        act,
        panel,
        tile,
    } = scratch;
    let x = resized(x, m * h);
    gather_rows(floats.hidden_input, &piece.tokens, h, x);
    let gate_up = resized(gate_up, m * 2 * i);
    let expert = piece.expert;
    expert_product(
        gate_up,
        x,
        floats.expert_gate_up_weights,
        (expert, h, 2 * i),
        (panel, tile),
    );
    if let Some(bias) = floats.expert_gate_up_bias {
        add_bias_rows(gate_up, &bias_row(bias, piece.expert, 2 * i));
    }
    clamp_rows(gate_up, i, params.clamp);
    let act = resized(act, m * i);
    for (row, act) in gate_up.chunks_exact(2 * i).zip(act.chunks_exact_mut(i)) {
        let (gate, up) = row.split_at(i);
        gated::forward(params.activation_fn, gate, up, act);
    }
    expert_product(
        y,
        act,
        floats.expert_down_weights,
        (expert, i, h),
        (panel, tile),
    );
    if let Some(bias) = floats.expert_down_bias {
        add_bias_rows(y, &bias_row(bias, piece.expert, h));
    }
}

/// `dst [m, n] = a [m, k] · W` for expert `expert`'s `W [k, n]` of `weights` (`[E_L, k, n]`):
/// few rows stream the matrix once ([`skinny`]), more run on packed panels.
fn expert_product(
    dst: &mut [f32],
    a: &[f32],
    weights: Floats<'_>,
    (expert, k, n): (usize, usize, usize),
    panels: Panels<'_>,
) {
    let m = dst.len() / n.max(1);
    if m <= skinny::MAX_ROWS {
        let matrix = weights.slice(expert * k * n..(expert + 1) * k * n);
        skinny::product(dst, a, matrix, (m, k, n));
    } else {
        ExpertMatrix::of(weights, WeightLayout::Nki, expert, (k, n)).product(dst, a, panels);
    }
}

/// The next wave of `pieces`: as many as fit [`WAVE_BYTES`] of outputs `[routes, h]`, at least
/// one.
fn wave(pieces: &[Piece], h: usize) -> usize {
    let budget = WAVE_BYTES / (h * size_of::<f32>()).max(1);
    let mut rows = 0;
    let mut count = 0;
    for piece in pieces {
        rows += piece.tokens.len();
        if count > 0 && rows > budget {
            break;
        }
        count += 1;
    }
    count
}

pub(super) fn forward(call: &MoeTkg<'_>) -> Result<MoeTkgOutputs> {
    let MoeTkgDims { t, h, .. } = call.dims();
    let pieces = pieces(call);
    let mut combined = try_filled(&output(&tkg::OUTPUT), &[t, h], 0.0_f32)?;
    let mut outputs: Vec<f32> = Vec::new();
    let mut rest = &pieces[..];
    let scratch = PerThread::<Scratch>::new();
    while !rest.is_empty() {
        let (now, later) = rest.split_at(wave(rest, h));
        rest = later;
        let rows: usize = now.iter().map(|piece| piece.tokens.len()).sum();
        let outputs = resized(&mut outputs, rows * h);
        let mut parts = Vec::with_capacity(now.len());
        let mut remaining = &mut outputs[..];
        for piece in now {
            let (part, tail) = remaining.split_at_mut(piece.tokens.len() * h);
            parts.push(part);
            remaining = tail;
        }
        now.par_iter().zip(parts).for_each(|(piece, y)| {
            scratch.with(|scratch| expert_outputs(call, piece, y, scratch));
        });
        let mut ys = outputs.chunks_exact(h);
        for piece in now {
            for (&token, &weight) in piece.tokens.iter().zip(&piece.weights) {
                let y = ys.next().expect("one row per route");
                add_scaled(&mut combined[token * h..(token + 1) * h], weight, y);
            }
        }
    }
    Ok(MoeTkgOutputs {
        output: finite_output(tkg::OUTPUT.name, &[t, h], combined)?,
    })
}
