//! `moekit::experts::LocalExperts`, the one composition of the experts' kernels.
//!
//! - Oracle: the same layer composed by hand in nki-library's padded layout (`hidden_states
//!   [T+1, H]` with a zero row T, `permute` → `blockwise_mm` with checkpoints →
//!   `blockwise_mm_bwd` validated in full) on the reference backend. `LocalExperts` (the
//!   `skip_token` layout, the backward on the forward's validated call) agrees on both backends
//!   for random sizes, routings and skipped slots: within 1e-6 relative to the largest entry on
//!   the reference (both in f64, summed in other orders), 1e-4 on cpu (f32 accumulation).
//! - `BlockwiseMmBwd::of_forward` gives bit-identical gradients to `BlockwiseMmBwd::new` and
//!   still refuses what the backward adds when it is wrong (shapes, non-finite values, pairs
//!   the plan lacks); the backward refuses inputs other than its forward's.
//! - The gate and up weights apart (`up_proj_weight`, linear layout) give the stacked weights'
//!   results (exactly on the reference, within 1e-5 relative on cpu) and their stacked weight
//!   gradient; the backward refuses another up tensor; nki's layout refuses them.

mod common;

use common::*;
use moekit::contracts::*;
use std::sync::Arc;

use moekit::experts::{Experts, ExpertsGrads, ExpertsInputs, LocalExperts};
use moekit::{Backend, BackendKind, Error, Tensor};
use proptest::prelude::*;

/// One random layer.
#[derive(Debug)]
struct Case {
    t: usize,
    h: usize,
    e: usize,
    k: usize,
    i: usize,
    b: usize,
    x: Vec<f64>,
    index: Vec<i32>,
    affinities: Vec<f64>,
    gate_up: Vec<f64>,
    down: Vec<f64>,
    d_output: Vec<f64>,
}

fn case() -> impl Strategy<Value = Case> {
    (
        1usize..24,
        1usize..12,
        1usize..7,
        1usize..5,
        routing(),
        any::<bool>(),
        any::<u64>(),
    )
        .prop_map(|(t, h, e, b, routing, skip, seed)| {
            let mut rng = SeededRng::new(seed);
            let k = 1 + rng.below(e.min(3));
            let i = 1 + rng.below(6);
            let mut index = expert_index(&mut rng, routing, t, e, k);
            let mut affinities = rng.values(t * k, 1.0);
            if skip {
                skip_slots(&mut rng, &mut index, &mut affinities);
            }
            Case {
                t,
                h,
                e,
                k,
                i,
                b,
                x: rng.values(t * h, 1.0),
                index,
                affinities,
                gate_up: rng.values(e * h * 2 * i, 0.5),
                down: rng.values(e * i * h, 0.5),
                d_output: rng.values(t * h, 1.0),
            }
        })
}

struct Tensors {
    x: Tensor,
    index: Tensor,
    affinities: Tensor,
    gate_up: Tensor,
    down: Tensor,
    d_output: Tensor,
}

impl Case {
    fn tensors(&self) -> Tensors {
        let (t, h, e, k, i) = (self.t, self.h, self.e, self.k, self.i);
        Tensors {
            x: f32_tensor(&[t, h], &self.x),
            index: i32_tensor(&[t, k], &self.index),
            affinities: f32_tensor(&[t, k], &self.affinities),
            gate_up: f32_tensor(&[e, h, 2, i], &self.gate_up),
            down: f32_tensor(&[e, i, h], &self.down),
            d_output: f32_tensor(&[t, h], &self.d_output),
        }
    }
}

/// `rows [T, H]` with a zero row appended: `[T+1, H]`.
fn padded(rows: &Tensor) -> Tensor {
    let mut values = rows.f32_values().into_owned();
    values.extend(vec![0.0; rows.shape()[1]]);
    Tensor::from_f32([rows.shape()[0] + 1, rows.shape()[1]], values).unwrap()
}

/// The plan and the padded `[T+1, H]` tokens and output gradient of nki-library's layout.
struct Padded {
    plan: PermuteOutputs,
    hidden_states: Tensor,
    d_output: Tensor,
}

impl Padded {
    fn new(backend: &dyn Backend, x: &Tensors, e: usize, b: usize) -> Self {
        let plan = backend
            .permute(
                &Permute::new(
                    PermuteInputs {
                        expert_index: &x.index,
                        topk_affinities: &x.affinities,
                    },
                    PermuteParams::new(e, b),
                )
                .unwrap(),
            )
            .unwrap();
        Self {
            plan,
            hidden_states: padded(&x.x),
            d_output: padded(&x.d_output),
        }
    }

    /// `blockwise_mm`'s inputs with `x`'s weights.
    fn inputs<'a>(&'a self, x: &'a Tensors) -> BlockwiseMmInputs<'a> {
        BlockwiseMmInputs {
            hidden_states: &self.hidden_states,
            expert_affinities_masked: &self.plan.expert_affinities_masked,
            gate_up_proj_weight: &x.gate_up,
            down_proj_weight: &x.down,
            token_position_to_id: &self.plan.token_position_to_id,
            block_to_expert: &self.plan.block_to_expert,
            gate_and_up_proj_bias: None,
            down_proj_bias: None,
            up_proj_weight: None,
        }
    }
}

/// The oracle: the layer composed by hand in the padded layout, every call validated in full.
fn composed(backend: &dyn Backend, case: &Case) -> (Tensor, ExpertsGrads) {
    let x = case.tensors();
    let layer = Padded::new(backend, &x, case.e, case.b);
    let forward = layer.inputs(&x);
    let out = backend
        .blockwise_mm(
            &BlockwiseMm::new(
                forward,
                BlockwiseMmParams {
                    checkpoint_activation: true,
                    ..BlockwiseMmParams::default()
                },
            )
            .unwrap(),
        )
        .unwrap();
    let grads = backend
        .blockwise_mm_bwd(
            &BlockwiseMmBwd::new(
                BlockwiseMmBwdInputs {
                    forward,
                    gate_up_proj_act_checkpoint_t: out.gate_up_activations_t.as_ref().unwrap(),
                    down_proj_act_checkpoint: out.down_activations.as_ref().unwrap(),
                    output_hidden_states_grad: &layer.d_output,
                    expert_index: Some(&x.index),
                },
                BlockwiseMmBwdParams::default(),
            )
            .unwrap(),
        )
        .unwrap();
    (
        out.output.into_leading_rows("output", case.t).unwrap(),
        ExpertsGrads {
            d_hidden_states: grads
                .hidden_states_grad
                .into_leading_rows("hidden_states_grad", case.t)
                .unwrap(),
            d_topk_affinities: grads.d_topk_affinities.unwrap(),
            d_gate_up_proj_weight: grads.gate_up_proj_weight_grad,
            d_down_proj_weight: grads.down_proj_weight_grad,
        },
    )
}

impl Tensors {
    fn experts_inputs(&self) -> ExpertsInputs<'_> {
        ExpertsInputs {
            hidden_states: &self.x,
            expert_index: &self.index,
            topk_affinities: &self.affinities,
            gate_up_proj_weight: &self.gate_up,
            down_proj_weight: &self.down,
            up_proj_weight: None,
        }
    }
}

fn local_experts(backend: BackendKind, block_size: usize) -> LocalExperts {
    LocalExperts {
        backend: Arc::from(backend.create()),
        block_size,
        output_dtype: OutputDType::Input,
        weight_layout: WeightLayout::Nki,
    }
}

fn through_local_experts(backend: BackendKind, case: &Case) -> (Tensor, ExpertsGrads) {
    let x = case.tensors();
    let experts = local_experts(backend, case.b);
    let (output, saved) = experts.forward(x.experts_inputs(), true).unwrap();
    let grads = experts
        .backward(x.experts_inputs(), &saved.unwrap(), &x.d_output)
        .unwrap();
    (output, grads)
}

fn assert_layers_agree(got: &(Tensor, ExpertsGrads), want: &(Tensor, ExpertsGrads), tol: f64) {
    let pairs = [
        ("output", &got.0, &want.0),
        (
            "d_hidden_states",
            &got.1.d_hidden_states,
            &want.1.d_hidden_states,
        ),
        (
            "d_topk_affinities",
            &got.1.d_topk_affinities,
            &want.1.d_topk_affinities,
        ),
        (
            "d_gate_up_proj_weight",
            &got.1.d_gate_up_proj_weight,
            &want.1.d_gate_up_proj_weight,
        ),
        (
            "d_down_proj_weight",
            &got.1.d_down_proj_weight,
            &want.1.d_down_proj_weight,
        ),
    ];
    for (name, got, want) in pairs {
        assert_eq!(got.shape(), want.shape(), "{name}");
        let want = f32s(want);
        assert_close(name, &f32s(got), &want, 0.0, tol * scale(&want)).unwrap();
    }
}

proptest! {
    #![proptest_config(config(48))]

    #[test]
    fn local_experts_equal_the_padded_composition(case in case()) {
        let reference = BackendKind::Reference.create();
        let want = composed(reference.as_ref(), &case);
        assert_layers_agree(&through_local_experts(BackendKind::Reference, &case), &want, 1e-6);
        assert_layers_agree(&through_local_experts(BackendKind::Cpu, &case), &want, 1e-4);
    }

    #[test]
    fn the_backward_of_a_validated_forward_equals_the_fully_validated_backward(case in case()) {
        let cpu = BackendKind::Cpu.create();
        let x = case.tensors();
        let layer = Padded::new(cpu.as_ref(), &x, case.e, case.b);
        let inputs = layer.inputs(&x);
        let forward = BlockwiseMm::new(
            inputs,
            BlockwiseMmParams { checkpoint_activation: true, ..BlockwiseMmParams::default() },
        )
        .unwrap();
        let out = cpu.blockwise_mm(&forward).unwrap();
        let added = BlockwiseMmBwdAdded {
            gate_up_proj_act_checkpoint_t: out.gate_up_activations_t.as_ref().unwrap(),
            down_proj_act_checkpoint: out.down_activations.as_ref().unwrap(),
            output_hidden_states_grad: &layer.d_output,
            expert_index: Some(&x.index),
        };
        let full = BlockwiseMmBwd::new(
            BlockwiseMmBwdInputs {
                forward: inputs,
                gate_up_proj_act_checkpoint_t: added.gate_up_proj_act_checkpoint_t,
                down_proj_act_checkpoint: added.down_proj_act_checkpoint,
                output_hidden_states_grad: added.output_hidden_states_grad,
                expert_index: added.expert_index,
            },
            BlockwiseMmBwdParams::default(),
        )
        .unwrap();
        let trusted = BlockwiseMmBwd::of_forward(&forward, added, false).unwrap();
        prop_assert_eq!(
            cpu.blockwise_mm_bwd(&trusted).unwrap(),
            cpu.blockwise_mm_bwd(&full).unwrap()
        );
    }
}

#[test]
fn the_backward_still_checks_what_it_adds_and_refuses_other_inputs() {
    let mut rng = SeededRng::new(5);
    let (t, h, e, k, i, b) = (3, 4, 4, 1, 2, 2);
    let case = Case {
        t,
        h,
        e,
        k,
        i,
        b,
        x: rng.values(t * h, 1.0),
        index: vec![0, 1, 2],
        affinities: vec![0.5, 0.25, 1.0],
        gate_up: rng.values(e * h * 2 * i, 0.5),
        down: rng.values(e * i * h, 0.5),
        d_output: rng.values(t * h, 1.0),
    };
    let cpu = BackendKind::Cpu.create();
    let x = case.tensors();
    let experts = local_experts(BackendKind::Cpu, b);
    let inputs = x.experts_inputs();
    let (output, saved) = experts.forward(inputs, true).unwrap();
    let saved = saved.unwrap();
    let message = |result: Result<ExpertsGrads, Error>| result.unwrap_err().to_string();

    // The output gradient: its shape and its values are checked.
    let wide = f32_tensor(&[t, h + 1], &vec![0.5; t * (h + 1)]);
    let err = message(experts.backward(inputs, &saved, &wide));
    assert!(err.contains("output_hidden_states_grad"), "{err}");
    let mut values = vec![0.5; t * h];
    values[t * h - 1] = f64::NAN;
    let err = message(experts.backward(inputs, &saved, &f32_tensor(&[t, h], &values)));
    assert!(
        err.contains("output_hidden_states_grad") && err.contains("non-finite"),
        "{err}"
    );

    // Inputs other than the forward's, even equal in value: weights and tokens.
    let copy = x.gate_up.clone();
    let other = ExpertsInputs {
        gate_up_proj_weight: &copy,
        ..inputs
    };
    let err = message(experts.backward(other, &saved, &x.d_output));
    assert!(err.contains("gate_up_proj_weight"), "{err}");
    let copy = x.index.clone();
    let other = ExpertsInputs {
        expert_index: &copy,
        ..inputs
    };
    let err = message(experts.backward(other, &saved, &x.d_output));
    assert!(err.contains("expert_index"), "{err}");

    // Without a record the forward keeps nothing; its output is the recorded one's.
    let (unrecorded, none) = experts.forward(inputs, false).unwrap();
    assert!(none.is_none());
    assert_eq!(unrecorded, output);

    // The trusted backward checks expert_index against the forward's plan: token 0 did not
    // choose expert 3.
    let layer = Padded::new(cpu.as_ref(), &x, e, b);
    let forward = BlockwiseMm::new(
        layer.inputs(&x),
        BlockwiseMmParams {
            checkpoint_activation: true,
            ..BlockwiseMmParams::default()
        },
    )
    .unwrap();
    let out = cpu.blockwise_mm(&forward).unwrap();
    let wrong_index = i32_tensor(&[t, k], &[3, 1, 2]);
    let err = BlockwiseMmBwd::of_forward(
        &forward,
        BlockwiseMmBwdAdded {
            gate_up_proj_act_checkpoint_t: out.gate_up_activations_t.as_ref().unwrap(),
            down_proj_act_checkpoint: out.down_activations.as_ref().unwrap(),
            output_hidden_states_grad: &layer.d_output,
            expert_index: Some(&wrong_index),
        },
        false,
    )
    .unwrap_err()
    .to_string();
    assert!(
        err.contains("token 0 chose expert 3, but the block plan has no slot"),
        "{err}"
    );
}

#[test]
fn the_forward_names_the_tensor_whose_shape_disagrees_with_the_others() {
    let mut rng = SeededRng::new(6);
    let (t, h, e, k, i) = (3, 4, 4, 2, 2);
    let x = Case {
        t,
        h,
        e,
        k,
        i,
        b: 2,
        x: rng.values(t * h, 1.0),
        index: vec![0, 1, 2, 3, 1, 0],
        affinities: vec![0.5; t * k],
        gate_up: rng.values(e * h * 2 * i, 0.5),
        down: rng.values(e * i * h, 0.5),
        d_output: rng.values(t * h, 1.0),
    }
    .tensors();
    let inputs = x.experts_inputs();
    assert_eq!(
        inputs.sizes(WeightLayout::Nki).unwrap(),
        moekit::experts::ExpertsSizes { t, h, e, k, i }
    );
    let experts = local_experts(BackendKind::Cpu, 2);
    let fewer_rows = f32_tensor(&[t - 1, h], &rng.values((t - 1) * h, 1.0));
    let wrong_i = f32_tensor(&[e, i + 1, h], &rng.values(e * (i + 1) * h, 1.0));
    let narrow_k = f32_tensor(&[t, 1], &[0.5; 3]);
    let flat = f32_tensor(&[t * h], &rng.values(t * h, 1.0));
    let cases = [
        (
            ExpertsInputs {
                hidden_states: &fewer_rows,
                ..inputs
            },
            "tensor `expert_index`: expected shape [T, K] = [2, _], got [3, 2]",
        ),
        (
            ExpertsInputs {
                down_proj_weight: &wrong_i,
                ..inputs
            },
            "tensor `down_proj_weight`: expected shape [E, I, H] = [4, 2, 4], got [4, 3, 4]",
        ),
        (
            ExpertsInputs {
                topk_affinities: &narrow_k,
                ..inputs
            },
            "tensor `topk_affinities`: expected shape [T, K] = [3, 2], got [3, 1]",
        ),
        (
            ExpertsInputs {
                hidden_states: &flat,
                ..inputs
            },
            "tensor `hidden_states`: expected shape [T, H], got [12]",
        ),
    ];
    for (inputs, want) in cases {
        let err = experts.forward(inputs, false).unwrap_err().to_string();
        assert_eq!(err, want);
    }
}

#[test]
fn gate_and_up_weights_apart_give_the_stacked_weights_results() {
    let mut rng = SeededRng::new(7);
    let (t, h, e, k, i, b) = (9, 6, 4, 2, 5, 4);
    let case = Case {
        t,
        h,
        e,
        k,
        i,
        b,
        x: rng.values(t * h, 1.0),
        index: (0..t * k)
            .map(|slot| ((slot * 3 + slot / k) % e) as i32)
            .collect(),
        affinities: rng.values(t * k, 1.0),
        gate_up: rng.values(e * h * 2 * i, 0.5),
        down: rng.values(e * i * h, 0.5),
        d_output: rng.values(t * h, 1.0),
    };
    let x = case.tensors();
    let sizes = (e, h, i);
    let (nki, linear) = (WeightLayout::Nki, WeightLayout::Linear);
    let gate_up = relayout_gate_up(&x.gate_up, sizes, nki, linear);
    let down = relayout_down(&x.down, sizes, nki, linear);
    let (gate, up) = split_gate_up(&gate_up);
    let stacked = ExpertsInputs {
        gate_up_proj_weight: &gate_up,
        down_proj_weight: &down,
        ..x.experts_inputs()
    };
    let apart = ExpertsInputs {
        gate_up_proj_weight: &gate,
        up_proj_weight: Some(&up),
        ..stacked
    };
    for (backend, tol) in [(BackendKind::Reference, 0.0), (BackendKind::Cpu, 1e-5)] {
        let experts = LocalExperts {
            weight_layout: linear,
            ..local_experts(backend, b)
        };
        let run = |inputs: ExpertsInputs<'_>| {
            let (output, saved) = experts.forward(inputs, true).unwrap();
            let grads = experts
                .backward(inputs, &saved.unwrap(), &x.d_output)
                .unwrap();
            (output, grads)
        };
        // The weight gradient comes back stacked, `[E, 2, I, H]`, either way.
        assert_layers_agree(&run(apart), &run(stacked), tol);
        // The backward refuses another up projection than its forward's, even equal in value.
        let (_, saved) = experts.forward(apart, true).unwrap();
        let copy = up.clone();
        let other = ExpertsInputs {
            up_proj_weight: Some(&copy),
            ..apart
        };
        let err = experts
            .backward(other, &saved.unwrap(), &x.d_output)
            .unwrap_err()
            .to_string();
        assert!(err.contains("up_proj_weight"), "{err}");
    }
    // Apart, the weights are the linear layout's: nki's is refused, naming the tensor.
    let err = local_experts(BackendKind::Cpu, b)
        .forward(apart, false)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("up_proj_weight") && err.contains("linear"),
        "{err}"
    );
}
