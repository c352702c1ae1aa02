//! Expert parallelism across MPI ranks (`parallelism.expert_parallel_degree = R`, launched as
//! `mpirun -n R moekit-train ...`): MPI's initialisation, the rank group, the checks that every
//! rank runs the same job, and the gradient reduction.
//!
//! Each rank holds E/R experts of every MoE layer and a replica of everything else, and trains
//! on its own slice of every batch. The objective is the mean of the ranks' losses, so after
//! the backward every gradient is divided by R, and the replicated parameters' gradients are
//! first summed over the ranks (each rank's expert gradients already hold every rank's tokens,
//! which dispatch and combine brought to it).

use std::hash::{DefaultHasher, Hash, Hasher};
use std::rc::Rc;

use anyhow::{Context, Result, bail};
use moekit::ep::{Communicator, MpiComm, agree, agree_with_values};
use tch::{Kind, Tensor};

use crate::config::JobConfig;
use crate::model::ExpertShard;

/// The ranks of an expert-parallel run, as seen from one of them.
pub struct RankGroup {
    comm: Rc<dyn Communicator>,
}

impl RankGroup {
    /// The group of `comm`'s ranks for `config`; checks, on every rank alike, that there are
    /// `expert_parallel_degree` of them and that all loaded the same job config, so a mismatch
    /// is the same error on every rank.
    pub fn new(comm: Rc<dyn Communicator>, config: &JobConfig) -> Result<RankGroup> {
        let ranks = config.parallelism.expert_parallel_degree;
        let group = RankGroup { comm };
        group.check_same_job(config)?;
        if group.ranks() != ranks {
            bail!(
                "parallelism.expert_parallel_degree = {ranks}, but mpirun started {} ranks \
                 (launch with `mpirun -n {ranks} moekit-train ...`)",
                group.ranks()
            );
        }
        Ok(group)
    }

    /// Every rank shares a fingerprint of its validated config; all fail alike on a mismatch.
    fn check_same_job(&self, config: &JobConfig) -> Result<()> {
        let mut hasher = DefaultHasher::new();
        format!("{config:?}").hash(&mut hasher);
        let fingerprint = hasher.finish() as i64;
        let ((), values) = agree_with_values(self.comm.as_ref(), Ok(((), vec![fingerprint])))?;
        let differing: Vec<String> = values
            .iter()
            .enumerate()
            .filter(|(_, v)| v.first() != values[0].first())
            .map(|(rank, _)| rank.to_string())
            .collect();
        if !differing.is_empty() {
            bail!(
                "rank(s) {} loaded a different job config than rank 0 (every rank must get the \
                 same --config file and overrides)",
                differing.join(", ")
            );
        }
        Ok(())
    }

    pub fn rank(&self) -> usize {
        self.comm.rank()
    }

    pub fn ranks(&self) -> usize {
        self.comm.size()
    }

    pub fn comm(&self) -> Rc<dyn Communicator> {
        Rc::clone(&self.comm)
    }

    /// The experts this rank holds.
    pub fn shard(&self) -> ExpertShard {
        ExpertShard {
            rank: self.rank(),
            ranks: self.ranks(),
        }
    }

    /// `result` where every rank succeeded; otherwise the first failing rank's error, on every
    /// rank (so no rank goes on to a collective the others have left).
    pub fn all_ok<T>(&self, result: Result<T>) -> Result<T> {
        let rank = self.rank();
        let local = result.map_err(|err| moekit::Error::Collective {
            rank,
            message: format!("{err:#}"),
        });
        Ok(agree(self.comm.as_ref(), local)?)
    }

    /// Checks that `value` (what `what` names) is the same on every rank.
    pub fn same_everywhere(&self, what: &str, value: i64) -> Result<()> {
        let ((), values) = agree_with_values(self.comm.as_ref(), Ok(((), vec![value])))?;
        if let Some(rank) = values.iter().position(|v| v.first() != Some(&value)) {
            bail!(
                "{what} differs between the ranks (rank {rank} sees {:?}, rank {} sees {value}): \
                 every rank must see the same dump folder",
                values[rank].first(),
                self.rank()
            );
        }
        Ok(())
    }

    /// `values` summed over the ranks, in rank order (bit-identical on every rank).
    pub fn sum(&self, values: &mut [f32]) -> Result<()> {
        self.comm.all_reduce_sum(values)?;
        Ok(())
    }

    /// Divides every gradient by R after summing the replicated parameters' gradients over
    /// the ranks (see the module docs), all of them in one collective. `params` are in the same
    /// order on every rank, and a replicated parameter must have a gradient on all ranks or on
    /// none (else the replicas would drift apart): anything else is an error on every rank.
    pub fn reduce_gradients(&self, params: &[(String, Tensor)]) -> Result<()> {
        let ranks = self.ranks();
        let scale = 1.0 / ranks as f64;
        let (experts, replicated): (Vec<_>, Vec<_>) = params
            .iter()
            .partition(|(name, _)| is_expert_parameter(name));
        for (_, p) in experts {
            let mut grad = p.grad();
            if grad.defined() {
                tch::no_grad(|| {
                    let _ = grad.g_mul_scalar_(scale);
                });
            }
        }
        // Every replicated gradient back to back (zeros for a rank without one, so all ranks
        // send the same sizes), then one count per parameter of the ranks that have one.
        let grads: Vec<Tensor> = replicated.iter().map(|(_, p)| p.grad()).collect();
        let mut values = Vec::new();
        for (grad, (_, p)) in grads.iter().zip(&replicated) {
            if grad.defined() {
                values.extend(Vec::<f32>::try_from(
                    grad.to_kind(Kind::Float).flatten(0, -1),
                )?);
            } else {
                values.resize(values.len() + p.numel(), 0.0);
            }
        }
        values.extend(grads.iter().map(|g| if g.defined() { 1.0f32 } else { 0.0 }));
        self.sum(&mut values)?;
        let with_gradient = values.split_off(values.len() - grads.len());
        for ((name, _), &count) in replicated.iter().zip(&with_gradient) {
            let count = count as usize;
            if count != 0 && count != ranks {
                bail!(
                    "`{name}` has a gradient on {count} of {ranks} ranks: the replicas would \
                     drift apart"
                );
            }
        }
        let mut offset = 0;
        for (grad, (_, p)) in grads.iter().zip(&replicated) {
            let numel = p.numel();
            let mean: Vec<f32> = values[offset..offset + numel]
                .iter()
                .map(|&v| v * scale as f32)
                .collect();
            offset += numel;
            if grad.defined() {
                let mean = Tensor::from_slice(&mean).view(grad.size().as_slice());
                tch::no_grad(|| grad.shallow_clone().copy_(&mean));
            }
        }
        Ok(())
    }
}

/// MPI's world when `config` asks for expert parallelism (`None` otherwise): initialised once
/// per process by its `main`, and finalised when the last handle is dropped.
pub fn init_mpi(config: &JobConfig) -> Result<Option<Rc<MpiComm>>> {
    if config.parallelism.expert_parallel_degree == 1 {
        return Ok(None);
    }
    let comm = MpiComm::init().context("cannot initialise MPI")?;
    Ok(Some(Rc::new(comm)))
}

/// Whether `name` is a sharded expert weight (`...mlp.experts.gate_up_proj`, `down_proj`).
pub fn is_expert_parameter(name: &str) -> bool {
    name.contains(".mlp.experts.")
}
