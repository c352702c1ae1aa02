//! The training loop: micro-batches with gradient accumulation, clipping, AdamW, the learning
//! rate schedule, progress lines and JSONL metrics.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::rc::Rc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use moekit::ep::MpiComm;
use moekit_tools::golden::write_atomically;
use serde::Serialize;
use tch::{Device, Kind, Tensor, nn};

use crate::checkpoint::{
    Selection, TrainingCheckpoint, TrainingState, abandon_training, assign_params, begin_training,
    finish_training, load_training_shard, remove_stale_staging, save_training, select_checkpoint,
    set_aside_damaged, staging_folder, step_folder, write_training_shard,
};
use crate::config::JobConfig;
use crate::data::{Batches, Source, TextTokenizer, hold_out_tail, validation_batches};
use crate::footprint::{StepFootprint, ensure_fits_in_host_memory, held_parameters};
use crate::hf::load_hf;
use crate::model::{ModelName, Qwen3Model, causal_lm_loss, load_balancing_loss};
use crate::moe::{Experts, MoeImpl, prepare};
use crate::optim::{AdamW, learning_rate};
use crate::parallel::{RankGroup, is_expert_parameter};
use crate::plots;
use crate::tape::Tape;

/// Size of the built-in corpus used when `[data] files` is empty.
const BUILTIN_CORPUS_BYTES: usize = 1 << 20;

/// The metrics of one optimizer step (one JSONL line of `metrics.jsonl`).
#[derive(Clone, Debug, Serialize)]
pub struct StepMetrics {
    pub step: usize,
    /// Mean next-token cross-entropy over the step's micro-batches.
    pub loss: f64,
    /// Mean auxiliary load-balancing loss (before `router_aux_loss_coef`).
    pub aux_loss: f64,
    pub lr: f64,
    /// Global gradient norm before clipping.
    pub grad_norm: f64,
    pub tokens_per_second: f64,
    /// The validation loss after this step, where `[metrics]` evaluates it
    /// ([`Trainer::validation_loss`]).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub val_loss: Option<f64>,
    /// With expert parallelism: the share of the step's wall time this rank spent in
    /// dispatch and combine (forward and backward, waiting for other ranks included).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub exchange_share: Option<f64>,
    /// With several ranks: the share of the step's wall time this rank spent reducing the
    /// gradients and their norm over the ranks (waiting for other ranks included).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reduction_share: Option<f64>,
    /// Token-to-expert assignments of each MoE layer over the step.
    pub expert_load: Vec<LayerLoad>,
    /// The assignments themselves, `[MoE layers][E]` (not written to metrics.jsonl).
    #[serde(skip)]
    pub expert_counts: Vec<Vec<f64>>,
    /// Where the step's wall time went (not written to metrics.jsonl; `moekit-train bench`
    /// reports it).
    #[serde(skip)]
    pub phases: StepPhases,
}

/// The wall time of one optimizer step's phases, summed over its micro-batches.
#[derive(Clone, Copy, Debug, Default)]
pub struct StepPhases {
    /// The model's forward, the losses and the ranks' mean of them.
    pub forward: Duration,
    /// The tape's backward (libtorch's autograd with the kernels' backward passes).
    pub backward: Duration,
    /// The gradients' reduction over the ranks, their norm and clipping.
    pub clip: Duration,
    /// AdamW's update.
    pub optimizer: Duration,
}

/// Load statistics of one MoE layer: assignments per expert.
#[derive(Clone, Debug, Serialize)]
pub struct LayerLoad {
    /// Decoder layer index.
    pub layer: usize,
    /// Assignments over all experts (tokens × K over the step's batch).
    pub total: f64,
    pub min: f64,
    pub max: f64,
    /// Coefficient of variation (population standard deviation / mean).
    pub cv: f64,
}

impl LayerLoad {
    fn new(layer: usize, counts: &[f64]) -> Self {
        let n = counts.len() as f64;
        let total = counts.iter().sum::<f64>();
        let mean = total / n;
        let variance = counts.iter().map(|c| (c - mean).powi(2)).sum::<f64>() / n;
        Self {
            layer,
            total,
            min: counts.iter().copied().fold(f64::INFINITY, f64::min),
            max: counts.iter().copied().fold(f64::NEG_INFINITY, f64::max),
            cv: if mean > 0.0 {
                variance.sqrt() / mean
            } else {
                0.0
            },
        }
    }
}

/// Refuses a config whose training step would not fit in the memory this process may take
/// ([`crate::footprint::host_memory_limit`]): the parameters it holds with their gradients and
/// AdamW state, and a micro-batch's activations and logits ([`StepFootprint`]), before
/// anything is allocated.
fn check_memory(config: &JobConfig, ranks: usize) -> Result<()> {
    let footprint = StepFootprint::of(config, ranks);
    ensure_fits_in_host_memory(footprint.total(), || {
        format!(
            "a training step of {} × {} tokens ({}; this process holds {} of the model's {} \
             parameters) needs",
            config.training.batch_size,
            config.training.seq_len,
            footprint.describe(),
            held_parameters(config, ranks),
            config.model.parameter_count(),
        )
    })
}

/// The training data.
struct Data {
    /// Global micro-batches of `ranks × training.batch_size` sequences, shuffled.
    batches: Batches,
    /// The validation split's fixed global batches of the same shape; empty without one.
    validation: Vec<Tensor>,
    /// The `tokenizer.json` the data was tokenized with; none at byte level.
    tokenizer_json: Option<Vec<u8>>,
}

/// The tokenized training data and, when configured, its validation split.
fn load_data(config: &JobConfig, ranks: usize) -> Result<Data> {
    let data = &config.data;
    let source = if data.files.is_empty() {
        Source::Builtin(BUILTIN_CORPUS_BYTES)
    } else {
        Source::Files(data.files.clone())
    };
    let tokenizer = TextTokenizer::load(&data.tokenizer)?;
    ensure!(
        tokenizer.vocab_size() <= config.model.vocab_size,
        "data.tokenizer {} has {} tokens, more than model.vocab_size {}",
        data.tokenizer,
        tokenizer.vocab_size(),
        config.model.vocab_size
    );
    let tokenize = |source: &Source| -> Result<Vec<i64>> {
        let tokens = source.tokens(&tokenizer)?;
        if let Some(&max) = tokens.iter().max() {
            ensure!(
                (max as usize) < config.model.vocab_size,
                "data.tokenizer {} produced token id {max}, outside model.vocab_size {}",
                data.tokenizer,
                config.model.vocab_size
            );
        }
        Ok(tokens)
    };
    let (seq_len, batch_size) = (config.training.seq_len, config.training.batch_size * ranks);
    let mut tokens = tokenize(&source)?;
    let validation = if !data.validation_files.is_empty() {
        tokenize(&Source::Files(data.validation_files.clone()))?
    } else if data.validation_fraction > 0.0 {
        let (training, held_out) = hold_out_tail(tokens, seq_len, data.validation_fraction);
        tokens = training;
        held_out
    } else {
        Vec::new()
    };
    let validation = match data.has_validation() {
        true => validation_batches(
            &validation,
            seq_len,
            batch_size,
            config.metrics.eval_batches,
        )?,
        false => Vec::new(),
    };
    Ok(Data {
        batches: Batches::new(tokens, seq_len, batch_size, config.job.seed)?,
        validation,
        tokenizer_json: tokenizer.json().map(<[u8]>::to_vec),
    })
}

/// A model, its optimizer, its data and its MoE implementation, ready to take steps.
pub struct Trainer {
    config: JobConfig,
    /// Where the parameters, optimizer state and batches live.
    device: Device,
    /// The ranks of the run (this process alone without MPI).
    group: RankGroup,
    // Owns the parameters the model and optimizer hold handles to.
    _vars: nn::VarStore,
    model: Qwen3Model,
    experts: Box<dyn Experts>,
    optimizer: AdamW,
    batches: Batches,
    /// The validation split's fixed global batches (see [`Data`]).
    validation: Vec<Tensor>,
    /// Saved into every checkpoint, for generation and export (see [`Data`]).
    tokenizer_json: Option<Vec<u8>>,
    step: usize,
}

impl Trainer {
    /// Seeds libtorch with `job.seed`, initialises the model and loads the data. With R·D > 1
    /// ranks (`parallelism`), `comm` must hold them (see [`crate::parallel::init_mpi`]).
    pub fn new(config: &JobConfig, comm: Option<Rc<MpiComm>>) -> Result<Self> {
        if config.training.threads > 0 {
            tch::set_num_threads(config.training.threads as i32);
        }
        let group = match (config.parallelism.ranks()?, comm) {
            (_, Some(comm)) => RankGroup::new(comm, config)?,
            (1, None) => RankGroup::one_process(config)?,
            (ranks, None) => bail!(
                "parallelism asks for {ranks} ranks, which need MPI: launch with \
                 `mpirun -n {ranks} moekit-train ...`"
            ),
        };
        let device = config.training.device.resolve()?;
        if device == Device::Cpu {
            // On CUDA the GPU's memory is libtorch's to report.
            let ranks = config.parallelism.expert_parallel_degree;
            group.all_ok(check_memory(config, ranks))?;
        }
        tch::manual_seed(config.job.seed as i64);
        let shard = group.shard();
        // One rank holds every expert: no exchange.
        // A rank whose kernels cannot be made or readied (a neuron manifest or runtime missing
        // on its host, say) stops every rank, with its message.
        let experts = group.all_ok(match shard.ranks {
            1 => MoeImpl::create_for(&config.kernels),
            _ => config.kernels.moe.create_expert_parallel(
                &config.kernels,
                group.replica(),
                config.model.num_experts,
            ),
        })?;
        group.all_ok(prepare(experts.as_ref(), config))?;
        let mut vars = nn::VarStore::new(device);
        let model = Qwen3Model::new_sharded(&vars.root(), &config.model, shard);
        // Initialised in f32 (the same values whatever the dtype), then cast.
        vars.set_kind(config.training.dtype.kind());
        let optimizer = AdamW::new(vars.variables().into_iter().collect(), &config.optimizer);
        // Every rank draws the same global batches of R·D × batch_size sequences and trains on
        // its own slice of each. A rank that cannot read the data stops every rank.
        let data = load_data(config, group.ranks());
        let Data {
            batches,
            validation,
            tokenizer_json,
        } = group.all_ok(data)?;
        let mut trainer = Self {
            config: config.clone(),
            device,
            group,
            _vars: vars,
            model,
            experts,
            optimizer,
            batches,
            validation,
            tokenizer_json,
            step: 0,
        };
        let selection = match config.checkpoint.enable {
            true => select_checkpoint(&trainer.checkpoint_folder()),
            false => Ok(Selection::default()),
        };
        let selection = trainer.group.all_ok(selection)?;
        let newest = selection
            .newest
            .as_ref()
            .map_or(-1, |(step, _)| *step as i64);
        (trainer.group).same_everywhere("the newest verified checkpoint's step", newest)?;
        // Every rank has chosen (reading only); one process sets the damaged ones aside and
        // removes the staging folders of interrupted saves.
        let set_aside = if trainer.group.rank() != 0 || !config.checkpoint.enable {
            Ok(())
        } else {
            set_aside_damaged(&selection)
                .and_then(|()| remove_stale_staging(&trainer.checkpoint_folder()))
        };
        trainer.group.all_ok(set_aside)?;
        let latest = selection.newest;
        let loaded = if let Some((_, dir)) = latest {
            trainer
                .resume(&dir)
                .with_context(|| format!("cannot resume from {}", dir.display()))
        } else if let Some(path) = &config.checkpoint.initial_load_path {
            load_hf(path, &config.model, trainer.params(), shard).map(|()| {
                trainer.optimizer.reset_master_weights();
            })
        } else {
            Ok(())
        };
        trainer.group.all_ok(loaded)?;
        Ok(trainer)
    }

    /// Aux-loss-free balancing: moves each MoE layer's selection bias towards its
    /// under-loaded experts by `load_balance_coeff · sign(mean − count)`, mean-centred.
    fn update_expert_biases(&self, counts: &[Vec<f64>]) {
        let coeff = self.config.training.load_balance_coeff;
        tch::no_grad(|| {
            for ((_, mut bias), counts) in self.model.expert_biases().into_iter().zip(counts) {
                let counts = Tensor::from_slice(counts)
                    .to_kind(Kind::Float)
                    .to_device(bias.device());
                let delta = (counts.mean(Kind::Float) - counts).sign() * coeff;
                let _ = bias.g_add_(&(&delta - delta.mean(Kind::Float)));
            }
        });
    }

    /// Steps taken (including those of a resumed checkpoint).
    pub fn steps_taken(&self) -> usize {
        self.step
    }

    /// Whether this process reports progress and writes metrics and plots: the single
    /// process, or rank 0 of a parallel run.
    pub fn is_main_rank(&self) -> bool {
        self.group.rank() == 0
    }

    /// This rank's sequences of the next global micro-batch `[batch_size, seq_len]`.
    fn next_batch(&mut self) -> Tensor {
        let batch = self.batches.next_batch();
        self.rank_slice(&batch)
    }

    /// This rank's `[batch_size, seq_len]` sequences of a global batch, on the device.
    fn rank_slice(&self, batch: &Tensor) -> Tensor {
        let rows = self.config.training.batch_size as i64;
        let batch = batch.narrow(0, self.group.rank() as i64 * rows, rows);
        batch.to_device(self.device)
    }

    /// The mean next-token cross-entropy over the validation split's fixed batches (every
    /// rank's slice, averaged over the ranks), without gradients; `None` without a split.
    pub fn validation_loss(&self) -> Result<Option<f64>> {
        if self.validation.is_empty() {
            return Ok(None);
        }
        let mut sum = 0.0;
        for batch in &self.validation {
            let input_ids = self.rank_slice(batch);
            sum += tch::no_grad(|| -> Result<f64> {
                let mut tape = Tape::new(false);
                let out = self
                    .model
                    .forward(&input_ids, self.experts.as_ref(), &mut tape)?;
                Ok(causal_lm_loss(&out.logits, &input_ids).double_value(&[]))
            })?;
        }
        // The exchanges of these forwards are not the next step's.
        self.experts.take_exchange_time();
        let mean = self.mean_over_ranks(&[sum / self.validation.len() as f64])?[0];
        ensure!(
            mean.is_finite(),
            "the validation loss is not finite ({mean})"
        );
        Ok(Some(mean))
    }

    /// `values` averaged over the ranks (the values themselves on a single process).
    fn mean_over_ranks(&self, values: &[f64]) -> Result<Vec<f64>> {
        let group = &self.group;
        if group.ranks() == 1 {
            return Ok(values.to_vec());
        }
        let mut sums: Vec<f32> = values.iter().map(|&v| v as f32).collect();
        group.sum(&mut sums)?;
        Ok(sums
            .iter()
            .map(|&v| f64::from(v) / group.ranks() as f64)
            .collect())
    }

    /// The global gradient norm after the ranks' gradients are reduced, clipped to
    /// `training.max_norm`, and the time the reductions took (`None` on one process).
    fn reduce_and_clip_gradients(&mut self) -> Result<(f64, Option<Duration>)> {
        let max_norm = self.config.training.max_norm;
        let group = &self.group;
        if group.ranks() == 1 {
            return Ok((self.optimizer.clip_grad_norm(max_norm), None));
        }
        let start = Instant::now();
        group.reduce_gradients(self.optimizer.params())?;
        let (replicated, sharded) = self.optimizer.grad_squares(is_expert_parameter);
        let mut sharded = [sharded as f32];
        group.sum_over_replica(&mut sharded)?;
        let reduction = start.elapsed();
        let norm = (replicated + f64::from(sharded[0])).sqrt();
        self.optimizer.clip_to(norm, max_norm);
        Ok((norm, Some(reduction)))
    }

    /// `<dump_folder>/<checkpoint.folder>`.
    pub fn checkpoint_folder(&self) -> PathBuf {
        self.config
            .job
            .dump_folder
            .join(&self.config.checkpoint.folder)
    }

    /// Continues from a training checkpoint of the same model, seed and batch shape.
    fn resume(&mut self, dir: &Path) -> Result<()> {
        let shard = self.group.shard();
        let checkpoint = load_training_shard(dir, shard.rank, shard.ranks, self.group.replicas())?;
        let state = &checkpoint.state;
        let training = &self.config.training;
        ensure!(
            state.model == self.config.model,
            "the checkpoint was trained with a different [model] config"
        );
        ensure!(
            state.dtype == training.dtype,
            "the checkpoint was trained with training.dtype = {:?}, the config says {:?}",
            state.dtype,
            training.dtype
        );
        for (what, saved, now) in [
            ("job.seed", state.data_seed, self.config.job.seed),
            (
                "training.batch_size",
                state.batch_size as u64,
                training.batch_size as u64,
            ),
            (
                "training.seq_len",
                state.seq_len as u64,
                training.seq_len as u64,
            ),
            (
                "training.gradient_accumulation_steps",
                state.gradient_accumulation_steps as u64,
                training.gradient_accumulation_steps as u64,
            ),
        ] {
            ensure!(
                saved == now,
                "the checkpoint was trained with {what} = {saved}, the config says {now}"
            );
        }
        // After the shapes: the held-out split is cut in seq_len windows.
        let (tokens, hash) = self.batches.fingerprint();
        ensure!(
            (state.data_tokens, state.data_hash) == (tokens, hash),
            "the checkpoint was trained on other data ({} tokens, hash {:016x}; now {tokens} \
             tokens, hash {hash:016x}): check data.files, data.tokenizer and the validation \
             split (data.validation_fraction, data.validation_files)",
            state.data_tokens,
            state.data_hash
        );
        assign_params(self.params(), &checkpoint.params, dir)?;
        assign_params(&self.model.expert_biases(), &checkpoint.params, dir)?;
        self.optimizer
            .load_state(&checkpoint.optimizer, state.step as u64)
            .with_context(|| format!("in {}", dir.display()))?;
        self.batches.seek(state.data_epoch, state.data_cursor)?;
        self.step = state.step;
        Ok(())
    }

    /// Writes a training checkpoint of the current step into the checkpoint folder, keeping
    /// the newest `checkpoint.keep_latest_k`.
    pub fn save(&self) -> Result<PathBuf> {
        let (data_epoch, data_cursor) = self.batches.position();
        let (data_tokens, data_hash) = self.batches.fingerprint();
        let checkpoint = TrainingCheckpoint {
            state: TrainingState {
                step: self.step,
                model: self.config.model.clone(),
                data_seed: self.config.job.seed,
                data_epoch,
                data_cursor,
                data_tokens,
                data_hash,
                batch_size: self.config.training.batch_size,
                seq_len: self.config.training.seq_len,
                gradient_accumulation_steps: self.config.training.gradient_accumulation_steps,
                dtype: self.config.training.dtype,
                expert_parallel_degree: self.config.parallelism.expert_parallel_degree,
                data_parallel_degree: self.config.parallelism.data_parallel_degree,
            },
            params: self
                .params()
                .iter()
                .map(|(name, p)| (name.clone(), p.detach()))
                .chain(self.model.expert_biases())
                .collect(),
            optimizer: self.optimizer.state(),
        };
        let folder = self.checkpoint_folder();
        let keep = self.config.checkpoint.keep_latest_k;
        let group = &self.group;
        if group.ranks() == 1 {
            return save_training(&folder, keep, &checkpoint, self.tokenizer_json.as_deref());
        }
        // Rank 0 stages the folder, every rank of the first replica writes its shard (every
        // replica holds the same), rank 0 completes it; each stage's outcome reaches every
        // rank before the next.
        let (rank, shard, step) = (group.rank(), group.shard(), self.step);
        let staged = if rank == 0 {
            begin_training(&folder, step).map(drop)
        } else {
            Ok(())
        };
        group.all_ok(staged)?;
        let tmp = staging_folder(&folder, step);
        let shard_written = match group.in_first_replica() {
            true => write_training_shard(&tmp, shard.rank, shard.ranks, &checkpoint),
            false => Ok(()),
        };
        let written = group.all_ok(shard_written);
        let finished = written.and_then(|()| {
            let finished = if rank == 0 {
                let tokenizer = self.tokenizer_json.as_deref();
                finish_training(&tmp, &folder, keep, &checkpoint.state, tokenizer).map(drop)
            } else {
                Ok(())
            };
            group.all_ok(finished)
        });
        if finished.is_err() && rank == 0 {
            abandon_training(&tmp);
        }
        finished.map(|()| folder.join(step_folder(step)))
    }

    /// The parameters by name (sorted), as the optimizer updates them.
    pub fn params(&self) -> &[(String, Tensor)] {
        self.optimizer.params()
    }

    /// One optimizer step over `gradient_accumulation_steps` micro-batches, then the validation
    /// loss where `[metrics]` asks for it. A non-finite loss, activation or gradient is an error
    /// and leaves the parameters untouched.
    pub fn step(&mut self) -> Result<StepMetrics> {
        self.step += 1;
        let step = self.step;
        let mut metrics = self.try_step().with_context(|| format!("step {step}"))?;
        // Every rank evaluates at the same steps: the forward's exchanges are collectives.
        if self
            .config
            .metrics
            .evaluates_at(step, self.config.training.steps)
        {
            metrics.val_loss = self
                .validation_loss()
                .with_context(|| format!("validation after step {step}"))?;
        }
        Ok(metrics)
    }

    fn try_step(&mut self) -> Result<StepMetrics> {
        let start = Instant::now();
        let training = self.config.training.clone();
        let accumulation = training.gradient_accumulation_steps;
        let coef = self.config.model.router_aux_loss_coef;
        let top_k = self.config.model.num_experts_per_tok as i64;
        let experts = self.config.model.num_experts as i64;
        let moe_layers = self.config.model.moe_layers();
        let mut counts = vec![vec![0.0; experts as usize]; moe_layers.len()];
        let (mut loss_sum, mut aux_sum) = (0.0, 0.0);
        let mut phases = StepPhases::default();

        self.optimizer.zero_grad()?;
        for _ in 0..accumulation {
            let forward = Instant::now();
            let input_ids = self.next_batch();
            let mut tape = Tape::new(self.experts.needs_graph_cuts());
            let out = self
                .model
                .forward(&input_ids, self.experts.as_ref(), &mut tape)?;
            let loss = causal_lm_loss(&out.logits, &input_ids);
            let aux = load_balancing_loss(&out.router_logits, top_k);
            // Averaged over the ranks first, so that all of them stop together.
            let means = self.mean_over_ranks(&[loss.double_value(&[]), aux.double_value(&[])])?;
            let (loss_value, aux_value) = (means[0], means[1]);
            if !loss_value.is_finite() || !aux_value.is_finite() {
                bail!(
                    "the loss is not finite (loss {loss_value}, aux_loss {aux_value}); \
                     stopping before the update"
                );
            }
            phases.forward += forward.elapsed();
            let backward = Instant::now();
            tape.backward(&((loss + aux * coef) / accumulation as f64))?;
            phases.backward += backward.elapsed();
            loss_sum += loss_value;
            aux_sum += aux_value;
            for (layer_counts, index) in counts.iter_mut().zip(&out.expert_index) {
                let bins = Vec::<f64>::try_from(
                    index
                        .flatten(0, 1)
                        .bincount(None::<Tensor>, experts)
                        .to_kind(Kind::Double)
                        .to_device(Device::Cpu),
                )?;
                for (count, bin) in layer_counts.iter_mut().zip(bins) {
                    *count += bin;
                }
            }
        }
        if self.group.ranks() > 1 {
            // Every layer's counts in one collective.
            let mut sums: Vec<f32> = counts.iter().flatten().map(|&c| c as f32).collect();
            self.group.sum(&mut sums)?;
            for (layer_counts, sums) in counts.iter_mut().zip(sums.chunks(experts as usize)) {
                *layer_counts = sums.iter().map(|&c| f64::from(c)).collect();
            }
        }
        let clip = Instant::now();
        let (grad_norm, reduction) = self.reduce_and_clip_gradients()?;
        phases.clip = clip.elapsed();
        if !grad_norm.is_finite() {
            bail!("the gradient norm is not finite ({grad_norm}); stopping before the update");
        }
        let lr = learning_rate(
            self.step,
            training.steps,
            self.config.optimizer.lr,
            &self.config.lr_scheduler,
        );
        let update = Instant::now();
        self.optimizer.step(lr)?;
        phases.optimizer = update.elapsed();
        if training.load_balance_coeff > 0.0 {
            self.update_expert_biases(&counts);
        }

        let elapsed = start.elapsed().as_secs_f64();
        let ranks = self.group.ranks();
        let tokens = (accumulation * training.batch_size * training.seq_len * ranks) as f64;
        Ok(StepMetrics {
            step: self.step,
            loss: loss_sum / accumulation as f64,
            aux_loss: aux_sum / accumulation as f64,
            lr,
            grad_norm,
            tokens_per_second: tokens / elapsed,
            val_loss: None,
            exchange_share: self
                .experts
                .take_exchange_time()
                .map(|time| time.as_secs_f64() / elapsed),
            reduction_share: reduction.map(|time| time.as_secs_f64() / elapsed),
            expert_load: moe_layers
                .iter()
                .zip(&counts)
                .map(|(&layer, counts)| LayerLoad::new(layer, counts))
                .collect(),
            expert_counts: counts,
            phases,
        })
    }
}

/// Trains until `training.steps` steps are taken, printing a progress line every
/// `metrics.log_freq` steps and writing every step's metrics to `<dump_folder>/metrics.jsonl`
/// (appended to when a checkpoint is resumed, replaced otherwise), with a checkpoint every
/// `checkpoint.interval` steps when enabled. Returns the number of steps this call took
/// (fewer than `training.steps` after a resume). Memory does not grow with the steps: the
/// expert load plotted at the end is summed as the run goes.
///
/// With several ranks every rank calls this with the same config and `comm`; rank 0 reports
/// and writes. Losses, gradient norms and expert counts are the ranks' means or sums (the same
/// on every rank); timings (`tokens_per_second`, `exchange_share`, `reduction_share`) are each
/// rank's own.
pub fn train(config: &JobConfig, comm: Option<Rc<MpiComm>>) -> Result<usize> {
    let folder = &config.job.dump_folder;
    std::fs::create_dir_all(folder)
        .with_context(|| format!("cannot create dump folder {}", folder.display()))?;
    let mut trainer = Trainer::new(config, comm)?;
    let resumed = trainer.steps_taken();
    let total = config.training.steps;
    // Every rank takes the same steps and writes its checkpoint shards at the same steps;
    // rank 0 reports.
    let mut report = match trainer.is_main_rank() {
        true => Some(Report::open(config, &trainer)?),
        false => None,
    };
    for step in resumed + 1..=total {
        let metrics = trainer.step()?;
        if let Some(report) = &mut report {
            report.step(step, &metrics)?;
        }
        let checkpoint = &config.checkpoint;
        if checkpoint.enable && (step.is_multiple_of(checkpoint.interval) || step == total) {
            if let Some(report) = &mut report {
                report.flush()?;
            }
            let dir = trainer.save()?;
            if report.is_some() {
                println!("checkpoint: {}", dir.display());
            }
        }
    }
    if let Some(report) = report {
        report.finish(resumed < total)?;
    }
    Ok(total.saturating_sub(resumed))
}

/// What rank 0 reports: the progress line every `metrics.log_freq` steps, every step's
/// metrics in `<dump_folder>/metrics.jsonl`, and the plots at the end.
struct Report<'c> {
    config: &'c JobConfig,
    metrics_path: PathBuf,
    metrics_file: BufWriter<File>,
    resumed: usize,
    start: Instant,
    /// Each MoE layer's assignments per expert, summed over the steps this process takes.
    load: Vec<Vec<f64>>,
}

impl<'c> Report<'c> {
    /// Opens metrics.jsonl (kept through the resumed step, else replaced) and prints what is
    /// trained.
    fn open(config: &'c JobConfig, trainer: &Trainer) -> Result<Self> {
        let resumed = trainer.steps_taken();
        let metrics_path = config.job.dump_folder.join("metrics.jsonl");
        if resumed > 0 {
            keep_metrics_through(&metrics_path, resumed)?;
        }
        let metrics_file = BufWriter::new(
            File::options()
                .create(true)
                .write(true)
                .append(resumed > 0)
                .truncate(resumed == 0)
                .open(&metrics_path)
                .with_context(|| format!("cannot open {}", metrics_path.display()))?,
        );
        if resumed > 0 {
            println!(
                "resumed after step {resumed} from {}",
                trainer.checkpoint_folder().display()
            );
        }
        let (ranks, replicas) = (
            config.parallelism.expert_parallel_degree,
            config.parallelism.data_parallel_degree,
        );
        let model = &config.model;
        let architecture = match model.name {
            ModelName::Qwen3 => "dense Qwen3".to_owned(),
            ModelName::Qwen3Moe => format!(
                "{} MoE layers of {} experts, top-{}, with kernels.moe = {}",
                model.moe_layer_count(),
                model.num_experts,
                model.num_experts_per_tok,
                config.kernels.moe.name()
            ),
        };
        println!(
            "training {} parameters ({architecture}) for {} steps{}",
            model.parameter_count(),
            config.training.steps,
            match (ranks, replicas) {
                (1, 1) => String::new(),
                (_, 1) => format!(", experts sharded over {ranks} ranks"),
                _ =>
                    format!(", {replicas} replicas of {ranks} rank(s) (experts sharded over them)"),
            },
        );
        Ok(Self {
            config,
            metrics_path,
            metrics_file,
            resumed,
            start: Instant::now(),
            load: vec![vec![0.0; model.num_experts]; model.moe_layer_count()],
        })
    }

    /// Records step `step`'s metrics, printing the progress line when it is due.
    fn step(&mut self, step: usize, metrics: &StepMetrics) -> Result<()> {
        let (config, total, resumed) = (self.config, self.config.training.steps, self.resumed);
        serde_json::to_writer(&mut self.metrics_file, metrics)?;
        writeln!(self.metrics_file)?;
        if step.is_multiple_of(config.metrics.log_freq) || step == total {
            self.metrics_file.flush()?;
            let elapsed = self.start.elapsed().as_secs_f64();
            let eta = elapsed / (step - resumed) as f64 * (total - step) as f64;
            let share = |name: &str, share: Option<f64>| {
                share.map_or_else(String::new, |share| {
                    format!("  {name} {:.0}%", 100.0 * share)
                })
            };
            let exchange = share("exchange", metrics.exchange_share)
                + &share("reduce", metrics.reduction_share);
            // A dense model has no router, so no aux loss.
            let aux = match config.model.name {
                ModelName::Qwen3Moe => format!("  aux {:.4}", metrics.aux_loss),
                ModelName::Qwen3 => String::new(),
            };
            let val = metrics
                .val_loss
                .map_or_else(String::new, |loss| format!("  val {loss:.4}"));
            println!(
                "[{bar:<20}] step {step:>5}/{total}  loss {:.4}{val}{aux}  lr {:.2e}  {:.0} tok/s{exchange}  eta {eta:.0}s",
                metrics.loss,
                metrics.lr,
                metrics.tokens_per_second,
                bar = "=".repeat(20 * step / total),
            );
        }
        for (total, counts) in self.load.iter_mut().zip(&metrics.expert_counts) {
            for (t, c) in total.iter_mut().zip(counts) {
                *t += c;
            }
        }
        Ok(())
    }

    fn flush(&mut self) -> Result<()> {
        Ok(self.metrics_file.flush()?)
    }

    /// Flushes the metrics and draws the plots (the expert load only when `took_steps`).
    fn finish(mut self, took_steps: bool) -> Result<()> {
        self.flush()?;
        println!("metrics: {}", self.metrics_path.display());
        let load = took_steps.then_some(&self.load[..]);
        if let Err(err) = plot(self.config, &self.metrics_path, load) {
            eprintln!("warning: plots skipped: {err:#}");
        }
        Ok(())
    }
}

/// Rewrites metrics.jsonl (atomically) with only its well-formed lines of steps up to `step`:
/// a run that crashed after its last checkpoint logged steps that the resumed run repeats.
fn keep_metrics_through(path: &Path, step: usize) -> Result<()> {
    let text = match std::fs::read_to_string(path) {
        Ok(text) => text,
        Err(err) if err.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(err) => return Err(err).with_context(|| format!("cannot read {}", path.display())),
    };
    let kept: String = text
        .lines()
        .filter(|line| {
            serde_json::from_str::<serde_json::Value>(line)
                .ok()
                .and_then(|m| m["step"].as_u64())
                .is_some_and(|s| s as usize <= step)
        })
        .map(|line| format!("{line}\n"))
        .collect();
    write_atomically(path, kept.as_bytes())?;
    Ok(())
}

/// `loss.png` from every step in metrics.jsonl (a resumed run's earlier steps included) and
/// `expert_load.png` from `load`, each MoE layer's assignments per expert summed over the
/// steps this process took (`None` when it took none).
fn plot(config: &JobConfig, metrics_path: &Path, load: Option<&[Vec<f64>]>) -> Result<()> {
    let text = std::fs::read_to_string(metrics_path)
        .with_context(|| format!("cannot read {}", metrics_path.display()))?;
    let points = text
        .lines()
        .map(|line| {
            let m: serde_json::Value = serde_json::from_str(line)?;
            let field = |k: &str| m[k].as_f64().with_context(|| format!("no `{k}` in {line}"));
            Ok(plots::LossPoint {
                step: field("step")? as usize,
                loss: field("loss")?,
                aux_loss: field("aux_loss")?,
                val_loss: m["val_loss"].as_f64(),
            })
        })
        .collect::<Result<Vec<_>>>()?;
    let folder = &config.job.dump_folder;
    let loss_png = folder.join("loss.png");
    plots::loss_curve(&loss_png, &points, config.model.moe_layer_count() > 0)?;
    let layers = config.model.moe_layers();
    let load_png = folder.join("expert_load.png");
    if let Some(load) = load.filter(|_| !layers.is_empty()) {
        plots::expert_load_heatmap(&load_png, &layers, load)?;
        println!("plots: {} {}", loss_png.display(), load_png.display());
    } else {
        println!("plots: {}", loss_png.display());
    }
    Ok(())
}
