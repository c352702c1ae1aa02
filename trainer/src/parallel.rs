//! Expert and data parallelism across MPI ranks (`parallelism.expert_parallel_degree = R`,
//! `data_parallel_degree = D`, launched as `mpirun -n R·D moekit-train ...`): MPI's
//! initialisation, the rank group, the checks that every rank runs the same job, and the
//! gradient reduction.
//!
//! The R·D ranks form D replicas of R ranks (world rank `d·R + r` is rank r of replica d, as
//! torchtitan lays expert parallelism inside data parallelism). Within a replica each rank
//! holds E/R experts of every MoE layer and a copy of everything else; rank r of every replica
//! holds the same experts. Every rank trains on its own slice of every global batch. The
//! objective is the mean of the R·D ranks' losses, so after the backward every gradient is
//! divided by R·D, after the replicated parameters' gradients are summed over all ranks and
//! each expert shard's over its D copies (each rank's expert gradients already hold its
//! replica's tokens, which dispatch and combine brought to it). Every sum runs in rank order,
//! so every copy holds the same bits.
//!
//! A run without MPI is a group of one rank ([`RankGroup::one_process`]), so the trainer has one
//! code path for any R and D; the group's collectives are then the identity.

use std::borrow::Cow;
use std::cell::Cell;
use std::collections::{BTreeMap, BTreeSet};
use std::mem::MaybeUninit;
use std::rc::Rc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use moekit::ep::{
    Communicator, LocalComm, MpiComm, Received, RowChunks, RowsToSend, agree, agree_with_values,
};
use tch::{Kind, Tensor};

use crate::config::JobConfig;
use crate::model::ExpertShard;

/// The ranks of a run, as seen from one of them: the MPI ranks of a parallel run, or the one
/// process of a run without (the same code path, its collectives trivial).
pub struct RankGroup {
    /// Every rank.
    comm: Rc<dyn Communicator>,
    /// This rank's replica: the R ranks its experts are sharded over.
    replica: Rc<dyn Communicator>,
    /// The D ranks that hold this rank's experts, one per replica.
    copies: Rc<dyn Communicator>,
}

impl RankGroup {
    /// The group of a run without MPI: this process alone.
    pub fn one_process(config: &JobConfig) -> Result<RankGroup> {
        let comm: Rc<dyn Communicator> = Rc::new(
            LocalComm::group(1)?
                .pop()
                .context("a group of one rank has one communicator")?,
        );
        let group = RankGroup {
            replica: Rc::clone(&comm),
            copies: Rc::clone(&comm),
            comm,
        };
        group.check_layout(config)?;
        Ok(group)
    }

    /// The group of `world`'s ranks for `config`; checks, on every rank alike, that all loaded
    /// the same job config and that there are R·D of them, so a mismatch is the same error on
    /// every rank; then splits them into replicas and copies.
    pub fn new(world: Rc<MpiComm>, config: &JobConfig) -> Result<RankGroup> {
        let comm: Rc<dyn Communicator> = world.clone();
        let whole = RankGroup {
            replica: Rc::clone(&comm),
            copies: Rc::clone(&comm),
            comm,
        };
        whole.check_same_job(config)?;
        whole.check_layout(config)?;
        // Every rank has checked the same config and count: all of them split.
        let r = config.parallelism.expert_parallel_degree;
        let rank = world.rank();
        let replica = world.split(rank / r, rank)?;
        let copies = world.split(rank % r, rank)?;
        Ok(RankGroup {
            replica: Rc::new(replica),
            copies: Rc::new(copies),
            ..whole
        })
    }

    /// The ranks started are the R·D the config asks for.
    fn check_layout(&self, config: &JobConfig) -> Result<()> {
        let parallelism = &config.parallelism;
        let ranks = parallelism.ranks()?;
        if self.ranks() != ranks {
            let (r, d) = (
                parallelism.expert_parallel_degree,
                parallelism.data_parallel_degree,
            );
            bail!(
                "parallelism.expert_parallel_degree = {r} and data_parallel_degree = {d} need \
                 {ranks} rank(s), but mpirun started {} (launch with `mpirun -n {ranks} \
                 moekit-train ...`)",
                self.ranks()
            );
        }
        Ok(())
    }

    /// Every rank sends every other its whole validated config ([`JobConfig::entries`]), and
    /// each compares every rank's with rank 0's: on any difference all fail alike, naming the
    /// keys and their values.
    fn check_same_job(&self, config: &JobConfig) -> Result<()> {
        let local = serde_json::to_vec(&config.entries()?)?;
        let size = self.ranks();
        let send = local.repeat(size);
        let (received, counts) = self.comm.all_to_all_v(&send, &vec![local.len(); size])?;
        let mut configs = Vec::with_capacity(size);
        let mut offset = 0;
        for (rank, count) in counts.into_iter().enumerate() {
            let entries: Vec<(String, String)> =
                serde_json::from_slice(&received[offset..offset + count])
                    .with_context(|| format!("rank {rank} sent a malformed job config"))?;
            configs.push(entries.into_iter().collect::<BTreeMap<_, _>>());
            offset += count;
        }
        let differences = config_differences(&configs);
        if !differences.is_empty() {
            bail!(
                "the ranks were given different job configs (every rank must get the same \
                 --config file and overrides): {}",
                differences.join("; ")
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

    /// This rank's replica: the ranks its experts are sharded over, which exchange tokens.
    pub fn replica(&self) -> Rc<dyn Communicator> {
        Rc::clone(&self.replica)
    }

    /// Whether this rank is in the first replica (whose ranks write the checkpoints' shards).
    pub fn in_first_replica(&self) -> bool {
        self.copies.rank() == 0
    }

    /// D, the replicas.
    pub fn replicas(&self) -> usize {
        self.copies.size()
    }

    /// The experts this rank holds: its replica's shard.
    pub fn shard(&self) -> ExpertShard {
        ExpertShard {
            rank: self.replica.rank(),
            ranks: self.replica.size(),
        }
    }

    /// `result` where every rank succeeded; otherwise the first failing rank's error, on every
    /// rank (so no rank goes on to a collective the others have left).
    pub fn all_ok<T>(&self, result: Result<T>) -> Result<T> {
        if self.ranks() == 1 {
            return result;
        }
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

    /// `values` summed over this rank's replica, in rank order: a sum over the expert shards.
    pub fn sum_over_replica(&self, values: &mut [f32]) -> Result<()> {
        self.replica.all_reduce_sum(values)?;
        Ok(())
    }

    /// Divides every gradient by R·D after summing the replicated parameters' gradients over
    /// all ranks and the expert parameters' over the copies of their shard (see the module
    /// docs), each in one collective. `params` are in the same order on every rank, and a
    /// parameter must have a gradient on all the ranks it is summed over or on none (else the
    /// copies would drift apart): anything else is an error on every rank.
    pub fn reduce_gradients(&self, params: &[(String, Tensor)]) -> Result<()> {
        let ranks = self.ranks();
        if ranks == 1 {
            // Summed over one rank and divided by one: the gradients as they are.
            return Ok(());
        }
        let scale = 1.0 / ranks as f32;
        let (experts, replicated): (Vec<_>, Vec<_>) = params
            .iter()
            .partition(|(name, _)| is_expert_parameter(name));
        let experts = match self.copies.size() {
            // One copy of each shard: nothing to sum.
            1 => {
                scale_gradients(&experts, scale);
                Ok(())
            }
            _ => mean_gradients(self.copies.as_ref(), &experts, scale),
        };
        // A check that failed in one shard's copies stops every rank before the next sum.
        self.all_ok(experts)?;
        mean_gradients(self.comm.as_ref(), &replicated, scale)
    }
}

/// Every gradient of `params` multiplied by `scale`, in place.
fn scale_gradients(params: &[&(String, Tensor)], scale: f32) {
    for (_, p) in params {
        let mut grad = p.grad();
        if grad.defined() {
            tch::no_grad(|| {
                let _ = grad.g_mul_scalar_(f64::from(scale));
            });
        }
    }
}

/// Every gradient of `params` summed over `comm`'s ranks, in one collective, and multiplied by
/// `scale`. The gradients travel back to back (zeros for a rank without one, so all ranks send
/// the same sizes), then one count per parameter of the ranks that have one, which must be
/// all or none.
fn mean_gradients(comm: &dyn Communicator, params: &[&(String, Tensor)], scale: f32) -> Result<()> {
    let ranks = comm.size();
    let grads: Vec<Tensor> = params.iter().map(|(_, p)| p.grad()).collect();
    let mut values = Vec::new();
    for (grad, (_, p)) in grads.iter().zip(params) {
        if grad.defined() {
            values.extend(Vec::<f32>::try_from(
                grad.to_kind(Kind::Float).flatten(0, -1),
            )?);
        } else {
            values.resize(values.len() + p.numel(), 0.0);
        }
    }
    values.extend(grads.iter().map(|g| if g.defined() { 1.0f32 } else { 0.0 }));
    comm.all_reduce_sum(&mut values)?;
    let with_gradient = values.split_off(values.len() - grads.len());
    for ((name, _), &count) in params.iter().zip(&with_gradient) {
        let count = count as usize;
        if count != 0 && count != ranks {
            bail!(
                "`{name}` has a gradient on {count} of the {ranks} ranks that hold it: its \
                 copies would drift apart"
            );
        }
    }
    let mut offset = 0;
    for (grad, (_, p)) in grads.iter().zip(params) {
        let numel = p.numel();
        let mean: Vec<f32> = values[offset..offset + numel]
            .iter()
            .map(|&v| v * scale)
            .collect();
        offset += numel;
        if grad.defined() {
            let mean = Tensor::from_slice(&mean).view(grad.size().as_slice());
            tch::no_grad(|| grad.shallow_clone().copy_(&mean));
        }
    }
    Ok(())
}

/// The keys where some rank's config (`configs[rank]`: key → value) differs from rank 0's, as
/// "`key` is `v0` on rank 0, `v` on rank(s) …", the first [`DIFFERENCES_SHOWN`] of them.
fn config_differences(configs: &[BTreeMap<String, String>]) -> Vec<String> {
    let keys: BTreeSet<&String> = configs.iter().flat_map(BTreeMap::keys).collect();
    let value = |rank: usize, key: &String| {
        configs[rank]
            .get(key)
            .map_or("unset", String::as_str)
            .to_owned()
    };
    let mut differences: Vec<String> = keys
        .into_iter()
        .filter_map(|key| {
            let reference = value(0, key);
            let mut others: BTreeMap<String, Vec<String>> = BTreeMap::new();
            for rank in 1..configs.len() {
                let theirs = value(rank, key);
                if theirs != reference {
                    others.entry(theirs).or_default().push(rank.to_string());
                }
            }
            (!others.is_empty()).then(|| {
                let others: Vec<String> = others
                    .into_iter()
                    .map(|(theirs, ranks)| format!("{theirs} on rank(s) {}", ranks.join(", ")))
                    .collect();
                format!("{key} is {reference} on rank 0, {}", others.join(", "))
            })
        })
        .collect();
    let hidden = differences.len().saturating_sub(DIFFERENCES_SHOWN);
    if hidden > 0 {
        differences.truncate(DIFFERENCES_SHOWN);
        differences.push(format!("and {hidden} more"));
    }
    differences
}

/// How many differing keys a config mismatch names.
const DIFFERENCES_SHOWN: usize = 8;

/// MPI's world when this process has peers: `config` asks for several ranks, or an MPI
/// launcher started it (`None` otherwise, and for `mpirun -n 1` of a one-rank job). Under a
/// launcher MPI starts whatever the degree, so that a rank given a config unlike its peers'
/// (degree 1 among ranks of degree 2, say) stops with them instead of training alone.
/// Initialised once per process by its `main`, finalised when the last handle is dropped.
pub fn init_mpi(config: &JobConfig) -> Result<Option<Rc<MpiComm>>> {
    let ranks = config.parallelism.ranks()?;
    if ranks == 1 && !MpiComm::launched() {
        return Ok(None);
    }
    let timeout = Duration::from_secs(config.parallelism.collective_timeout_s);
    let comm = MpiComm::init()
        .context("cannot initialise MPI")?
        .with_timeout(timeout);
    if ranks == 1 && comm.size() == 1 {
        return Ok(None);
    }
    Ok(Some(Rc::new(comm)))
}

/// Whether `name` is a sharded expert weight (`...mlp.experts.gate_up_proj`, `down_proj`).
pub fn is_expert_parameter(name: &str) -> bool {
    name.contains(".mlp.experts.")
}

/// A rank group's communicator that adds up the wall time its operations take: the sharded
/// experts' exchange time, which each step reports. Every operation counts, the verdicts the
/// ranks exchange before each payload included, and so does waiting in one for the other
/// ranks (a slower rank's experts, say).
pub struct TimedComm {
    comm: Rc<dyn Communicator>,
    /// Time spent since [`Self::take_time`] last read it.
    time: Cell<Duration>,
}

impl TimedComm {
    pub fn new(comm: Rc<dyn Communicator>) -> Self {
        Self {
            comm,
            time: Cell::new(Duration::ZERO),
        }
    }

    /// The time spent in operations since the last call.
    pub fn take_time(&self) -> Duration {
        self.time.replace(Duration::ZERO)
    }

    fn timed<T>(&self, operation: impl FnOnce(&dyn Communicator) -> T) -> T {
        let start = Instant::now();
        let result = operation(self.comm.as_ref());
        self.time.set(self.time.get() + start.elapsed());
        result
    }
}

impl Communicator for TimedComm {
    fn rank(&self) -> usize {
        self.comm.rank()
    }

    fn size(&self) -> usize {
        self.comm.size()
    }

    fn all_to_all_v(
        &self,
        send: &[u8],
        send_counts: &[usize],
    ) -> moekit::Result<(Vec<u8>, Vec<usize>)> {
        self.timed(|comm| comm.all_to_all_v(send, send_counts))
    }

    fn all_to_all_v_words(
        &self,
        send: Cow<'_, [f32]>,
        send_counts: &[usize],
        recv_counts: Option<&[usize]>,
    ) -> moekit::Result<Received> {
        self.timed(|comm| comm.all_to_all_v_words(send, send_counts, recv_counts))
    }

    fn all_to_all_v_rows(
        &self,
        source: &[f32],
        width: usize,
        rows: RowsToSend<'_>,
        recv: RowChunks<'_>,
        out: &mut [MaybeUninit<f32>],
    ) -> moekit::Result<()> {
        self.timed(|comm| comm.all_to_all_v_rows(source, width, rows, recv, out))
    }

    fn all_reduce_sum(&self, buffer: &mut [f32]) -> moekit::Result<()> {
        self.timed(|comm| comm.all_reduce_sum(buffer))
    }

    fn barrier(&self) -> moekit::Result<()> {
        self.timed(|comm| comm.barrier())
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;

    /// The debug job config with `overrides`, as the map of its entries.
    fn entries(overrides: &[(&str, &str)]) -> BTreeMap<String, String> {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs/qwen3_moe_debug.toml");
        let overrides: Vec<(String, String)> = overrides
            .iter()
            .map(|&(key, value)| (key.to_owned(), value.to_owned()))
            .collect();
        let config = JobConfig::load(&path, &overrides).expect("the debug config loads");
        config
            .entries()
            .expect("the config serialises")
            .into_iter()
            .collect()
    }

    #[test]
    fn entries_hold_every_setting_with_its_default() {
        let entries = entries(&[("job.dump_folder", "\"out\"")]);
        assert_eq!(entries["parallelism.expert_parallel_degree"], "1");
        assert_eq!(
            entries["parallelism.collective_timeout_s"],
            MpiComm::DEFAULT_TIMEOUT.as_secs().to_string()
        );
        assert_eq!(entries["job.dump_folder"], "\"out\"");
        assert_eq!(entries["optimizer.lr"], "0.003");
        assert!(entries.contains_key("model.num_experts"));
    }

    #[test]
    fn differences_name_each_key_its_values_and_ranks() {
        let base = entries(&[]);
        assert!(config_differences(&[base.clone(), base.clone()]).is_empty());
        let seed = entries(&[("job.seed", "1")]);
        let seed_and_lr = entries(&[("job.seed", "1"), ("optimizer.lr", "1e-3")]);
        assert_eq!(
            config_differences(&[base, seed, seed_and_lr]),
            [
                "job.seed is 0 on rank 0, 1 on rank(s) 1, 2",
                "optimizer.lr is 0.003 on rank 0, 0.001 on rank(s) 2",
            ]
        );
    }

    #[test]
    fn a_key_only_one_rank_has_is_unset_on_the_others() {
        let base = entries(&[]);
        let mut extra = base.clone();
        extra.insert("job.extra".to_owned(), "7".to_owned());
        assert_eq!(
            config_differences(&[base, extra]),
            ["job.extra is unset on rank 0, 7 on rank(s) 1"]
        );
    }

    #[test]
    fn many_differences_are_cut_short_with_a_count() {
        let base = entries(&[]);
        let other: BTreeMap<String, String> = base
            .iter()
            .map(|(key, value)| (key.clone(), format!("{value}0")))
            .collect();
        let differences = config_differences(&[base.clone(), other]);
        assert_eq!(differences.len(), DIFFERENCES_SHOWN + 1);
        assert_eq!(
            differences[DIFFERENCES_SHOWN],
            format!("and {} more", base.len() - DIFFERENCES_SHOWN)
        );
    }
}
