//! AdamW, global-norm gradient clipping and the learning-rate schedule.

use std::collections::BTreeMap;

use anyhow::{Context, Result, ensure};
use tch::{Kind, Tensor};

use crate::config::{DecayType, LrScheduler, Optimizer};
use crate::shim;

/// AdamW with decoupled weight decay, the update rule of PyTorch's `torch.optim.AdamW`
/// (`amsgrad=False`): `p ← p·(1 − lr·wd)`, `m ← β₁m + (1−β₁)g`, `v ← β₂v + (1−β₂)g²`,
/// `p ← p − lr/(1−β₁ᵗ) · m / (√v/√(1−β₂ᵗ) + ε)`, in f32 (on an f32 master copy for bf16
/// parameters). The state is held here (not in libtorch's optimizer) so it can be
/// checkpointed.
pub struct AdamW {
    /// Parameters sorted by name, so every run updates them in the same order.
    params: Vec<(String, Tensor)>,
    /// f32 master copies of the parameters that are not f32 (updated, then rounded into the
    /// parameter).
    master: Vec<Option<Tensor>>,
    exp_avg: Vec<Tensor>,
    exp_avg_sq: Vec<Tensor>,
    step: u64,
    betas: [f64; 2],
    eps: f64,
    weight_decay: f64,
}

impl AdamW {
    /// Zero state for `params` (name, trainable leaf).
    pub fn new(mut params: Vec<(String, Tensor)>, config: &Optimizer) -> Self {
        params.sort_by(|a, b| a.0.cmp(&b.0));
        let zeros = |params: &[(String, Tensor)]| {
            params
                .iter()
                .map(|(_, p)| p.zeros_like().to_kind(Kind::Float))
                .collect()
        };
        Self {
            master: params
                .iter()
                .map(|(_, p)| (p.kind() != Kind::Float).then(|| p.detach().to_kind(Kind::Float)))
                .collect(),
            exp_avg: zeros(&params),
            exp_avg_sq: zeros(&params),
            params,
            step: 0,
            betas: config.betas,
            eps: config.eps,
            weight_decay: config.weight_decay,
        }
    }

    /// The parameters, sorted by name.
    pub fn params(&self) -> &[(String, Tensor)] {
        &self.params
    }

    /// Steps taken.
    pub fn steps_taken(&self) -> u64 {
        self.step
    }

    /// The state by name: `exp_avg.{param}`, `exp_avg_sq.{param}` and, for parameters that
    /// are not f32, `master.{param}`; each `[param's shape]` f32.
    pub fn state(&self) -> BTreeMap<String, Tensor> {
        let mut state = BTreeMap::new();
        for ((((name, _), m), v), master) in self
            .params
            .iter()
            .zip(&self.exp_avg)
            .zip(&self.exp_avg_sq)
            .zip(&self.master)
        {
            state.insert(format!("exp_avg.{name}"), m.shallow_clone());
            state.insert(format!("exp_avg_sq.{name}"), v.shallow_clone());
            if let Some(master) = master {
                state.insert(format!("master.{name}"), master.shallow_clone());
            }
        }
        state
    }

    /// Restores the moments written by [`Self::state`] and the step count.
    pub fn load_state(&mut self, state: &BTreeMap<String, Tensor>, steps_taken: u64) -> Result<()> {
        for ((((name, p), m), v), master) in self
            .params
            .iter()
            .zip(&mut self.exp_avg)
            .zip(&mut self.exp_avg_sq)
            .zip(&mut self.master)
        {
            let slots = [
                ("exp_avg", Some(m)),
                ("exp_avg_sq", Some(v)),
                ("master", master.as_mut()),
            ];
            for (prefix, moment) in slots.into_iter().filter_map(|(p, m)| Some(p).zip(m)) {
                let key = format!("{prefix}.{name}");
                let value = state
                    .get(&key)
                    .with_context(|| format!("optimizer state has no `{key}`"))?;
                ensure!(
                    value.size() == p.size(),
                    "optimizer state `{key}` has shape {:?}, the parameter {:?}",
                    value.size(),
                    p.size()
                );
                ensure!(
                    value.kind() == Kind::Float,
                    "optimizer state `{key}` holds {:?} values; it is written in f32",
                    value.kind()
                );
                *moment = value
                    .to_kind(Kind::Float)
                    .to_device(p.device())
                    .contiguous()
                    .copy();
            }
        }
        self.step = steps_taken;
        Ok(())
    }

    /// Re-reads the master copies from the parameters, after the parameters were loaded.
    pub fn reset_master_weights(&mut self) {
        tch::no_grad(|| {
            for ((_, p), master) in self.params.iter().zip(&mut self.master) {
                if let Some(master) = master {
                    master.copy_(&p.to_kind(Kind::Float));
                }
            }
        });
    }

    /// Clears every parameter's gradient by releasing it, as PyTorch's `zero_grad` does by
    /// default (`set_to_none=True`): the next backward's first gradient of a parameter becomes
    /// its `.grad` (a kernel's result without a copy) instead of being added into zeros, and a
    /// parameter that gets none is left alone by [`Self::step`].
    ///
    /// # Errors
    /// If libtorch refuses to release a gradient.
    pub fn zero_grad(&mut self) -> Result<()> {
        for (name, p) in &self.params {
            shim::release_grad(p).with_context(|| format!("zero_grad of {name}"))?;
        }
        Ok(())
    }

    /// The global L2 norm of all gradients; when `max_norm > 0` and the norm exceeds it, every
    /// gradient is scaled by `max_norm / (norm + 1e-6)` (PyTorch's `clip_grad_norm_`).
    pub fn clip_grad_norm(&mut self, max_norm: f64) -> f64 {
        let (squares, _) = self.grad_squares(|_| false);
        let norm = squares.sqrt();
        self.clip_to(norm, max_norm);
        norm
    }

    /// The sums of squared gradient entries of the parameters for which `sharded(name)` is
    /// false and true: `(replicated, sharded)`. With sharded parameters the global norm is
    /// `√(replicated + Σ_ranks sharded)`.
    pub fn grad_squares(&self, sharded: impl Fn(&str) -> bool) -> (f64, f64) {
        let mut squares = (0.0, 0.0);
        for (name, p) in &self.params {
            let grad = p.grad();
            if !grad.defined() {
                continue;
            }
            // One read of the gradient (no squared copy), accumulated in f32 by libtorch's
            // cascade sum; the squares of the norms add in f64.
            let square = grad
                .norm_scalaropt_dtype(2.0, Kind::Float)
                .double_value(&[])
                .powi(2);
            if sharded(name) {
                squares.1 += square;
            } else {
                squares.0 += square;
            }
        }
        squares
    }

    /// Scales every gradient by `max_norm / (norm + 1e-6)` when `max_norm > 0` and `norm`
    /// (the global gradient norm) exceeds it.
    pub fn clip_to(&mut self, norm: f64, max_norm: f64) {
        if max_norm > 0.0 && norm > max_norm {
            let scale = max_norm / (norm + 1e-6);
            tch::no_grad(|| {
                for (_, p) in &self.params {
                    let mut grad = p.grad();
                    if grad.defined() {
                        let _ = grad.g_mul_scalar_(scale);
                    }
                }
            });
        }
    }

    /// One update at learning rate `lr`, in one pass over each parameter and its moments
    /// (libtorch's fused AdamW); parameters without a gradient are left alone.
    ///
    /// # Errors
    /// If libtorch refuses the update (it checks the tensors' devices and dtypes).
    pub fn step(&mut self, lr: f64) -> Result<()> {
        self.step += 1;
        let Some((_, first)) = self.params.first() else {
            return Ok(());
        };
        // libtorch reads the count from an f32 scalar, as `torch.optim.AdamW(fused=True)`
        // holds it: exact up to 2²⁴ steps, and β^step barely moves between neighbours beyond.
        let step = Tensor::from(self.step as f32).to_device(first.device());
        // Each parameter with a gradient: the parameter, its f32 master copy (if it is not
        // f32), its gradient in f32, and its moments.
        let updated: Vec<_> = self
            .params
            .iter()
            .zip(&self.exp_avg)
            .zip(&self.exp_avg_sq)
            .zip(&self.master)
            .filter_map(|((((_, p), m), v), master)| {
                let grad = p.grad();
                grad.defined().then(|| {
                    (
                        p,
                        master.as_ref(),
                        grad.to_kind(Kind::Float).contiguous(),
                        m,
                        v,
                    )
                })
            })
            .collect();
        // f32 parameters are updated in place; others through their master copy.
        let updates: Vec<[&Tensor; 4]> = updated
            .iter()
            .map(|(p, master, grad, m, v)| [master.unwrap_or(p), grad, m, v])
            .collect();
        tch::no_grad(|| {
            shim::fused_adamw(&updates, &step, lr, self.betas, self.weight_decay, self.eps)?;
            for (p, master, ..) in &updated {
                if let Some(master) = master {
                    p.shallow_clone().copy_(master);
                }
            }
            Ok(())
        })
    }
}

/// The learning rate at `step` (1-based) of `total`: linear warmup from `peak/warmup` to
/// `peak` over `warmup_steps`, then decay to `min_lr_factor · peak` at the last step.
pub fn learning_rate(step: usize, total: usize, peak: f64, schedule: &LrScheduler) -> f64 {
    let warmup = schedule.warmup_steps;
    if step <= warmup {
        return peak * step as f64 / warmup as f64;
    }
    let progress = (step - warmup) as f64 / (total - warmup) as f64;
    let floor = schedule.min_lr_factor;
    let factor = match schedule.decay_type {
        DecayType::Constant => 1.0,
        DecayType::Linear => 1.0 - (1.0 - floor) * progress,
        DecayType::Cosine => {
            floor + (1.0 - floor) * 0.5 * (1.0 + (std::f64::consts::PI * progress).cos())
        }
    };
    peak * factor
}
