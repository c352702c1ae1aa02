//! AdamW's update against the closed form in f64, at step counts a resumed state can hold.

use moekit_trainer::config::Optimizer;
use moekit_trainer::optim::AdamW;
use tch::{Kind, Tensor};

/// One AdamW step from zero moments at step `t` (1-based), in f64: the formula of
/// `torch.optim.AdamW`.
fn expected(p: &[f64], g: &[f64], config: &Optimizer, t: u64) -> Vec<f64> {
    let [b1, b2] = config.betas;
    let (bc1, bc2) = (1.0 - b1.powf(t as f64), 1.0 - b2.powf(t as f64));
    p.iter()
        .zip(g)
        .map(|(&p, &g)| {
            let (m, v) = ((1.0 - b1) * g, (1.0 - b2) * g * g);
            p * (1.0 - config.lr * config.weight_decay)
                - config.lr / bc1 * m / (v.sqrt() / bc2.sqrt() + config.eps)
        })
        .collect()
}

#[test]
fn steps_past_i32_follow_the_closed_form() {
    // β₂ close enough to 1 that β₂ᵗ is far from 0 at t ≈ 2³¹: the bias correction matters.
    let config = Optimizer {
        name: "AdamW".to_owned(),
        lr: 1e-2,
        betas: [0.9, 1.0 - 1e-10],
        eps: 1e-8,
        weight_decay: 0.1,
    };
    let (p0, g) = ([0.5, -1.25, 2.0], [0.3, -0.7, 1e-3]);
    for steps_taken in [4, (1u64 << 31) + 4, 1 << 40] {
        let p = Tensor::from_slice(&p0.map(|v| v as f32)).set_requires_grad(true);
        (&p * Tensor::from_slice(&g.map(|v| v as f32)))
            .sum(Kind::Float)
            .backward();
        let mut adamw = AdamW::new(vec![("p".to_owned(), p.shallow_clone())], &config);
        let state = adamw.state();
        adamw.load_state(&state, steps_taken).unwrap();
        adamw.step(config.lr).unwrap();
        let got: Vec<f32> = Vec::try_from(&p.detach()).unwrap();
        let want = expected(&p0, &g, &config, steps_taken + 1);
        for (got, want) in got.iter().zip(&want) {
            assert!(
                (f64::from(*got) - want).abs() <= 1e-6 * want.abs().max(1.0),
                "step {}: {got} against {want}",
                steps_taken + 1
            );
        }
    }
}

#[test]
fn bf16_parameters_follow_their_f32_master_and_those_without_a_gradient_stay() {
    let config = Optimizer {
        name: "AdamW".to_owned(),
        lr: 1e-2,
        betas: [0.9, 0.95],
        eps: 1e-8,
        weight_decay: 0.1,
    };
    let (p0, g) = ([0.5, -1.25, 2.0], [0.3, -0.7, 1e-3]);
    let p = Tensor::from_slice(&p0.map(|v| v as f32))
        .to_kind(Kind::BFloat16)
        .set_requires_grad(true);
    let idle = Tensor::from_slice(&[3.0f32, 4.0]).set_requires_grad(true);
    (&p * Tensor::from_slice(&g.map(|v| v as f32)).to_kind(Kind::BFloat16))
        .sum(Kind::Float)
        .backward();
    let mut adamw = AdamW::new(
        vec![
            ("idle".to_owned(), idle.shallow_clone()),
            ("p".to_owned(), p.shallow_clone()),
        ],
        &config,
    );
    adamw.step(config.lr).unwrap();
    let master = adamw.state()["master.p"].shallow_clone();
    // bf16 holds 0.5, -1.25 and 2.0 exactly, so the master starts from the same values; a first
    // step moves by lr·g/|g|, which bf16's rounding of g leaves alone.
    for (got, want) in Vec::<f32>::try_from(&master)
        .unwrap()
        .iter()
        .zip(expected(&p0, &g, &config, 1))
    {
        assert!(
            (f64::from(*got) - want).abs() <= 1e-6,
            "{got} against {want}"
        );
    }
    let rounded = |t: &Tensor| Vec::<f32>::try_from(&t.to_kind(Kind::Float)).unwrap();
    assert_eq!(
        rounded(&p.detach()),
        rounded(&master.to_kind(Kind::BFloat16)),
        "the parameter is its master, rounded"
    );
    assert_eq!(Vec::<f32>::try_from(&idle.detach()).unwrap(), [3.0, 4.0]);
}
