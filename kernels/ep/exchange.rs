//! `dispatch` and `combine` in nki-library's `permute_a2av` / `unpermute_a2av` conventions:
//! token rows travel to the ranks that own their experts and the expert outputs travel back,
//! forward and backward.
//!
//! Experts are sharded contiguously: rank r owns experts `[r·E/R, (r+1)·E/R)` (E must be a
//! multiple of R). A token goes once to each rank that owns at least one of its K experts,
//! with its local expert ids (`SKIP` for slots owned elsewhere) and affinities (0 there).
//!
//! ```text
//! send_indices [T, R]  i32  column d: the ids of the tokens sent to rank d, ascending, then T
//! send_counts  [1, R]  i32  rows sent to each rank
//! recv_counts  [1, R]  i32  rows received from each rank
//! ```
//! (`send_indices` and `send_counts` are what the `a2av_routing` kernel makes of `expert_index`.)
//! Received rows lie at a fixed stride S per source, as `permute_a2av` writes them:
//! `hidden_states [R·S, H]` holds source s's rows, in its token order, at rows
//! `[s·S, s·S + recv_counts[s])` and zeros after them (expert ids `SKIP`, affinities 0), where
//! S is the largest T of any rank: T itself when every rank has the same T, as nki-library's
//! kernels require. `combine` (`unpermute_a2av`) takes the expert outputs in that layout and
//! adds each token's rows in ascending rank order, so results do not depend on timing. Rows
//! travel as f32 (bf16 inputs are widened exactly), packed on the wire.
//!
//! Every function validates its inputs, and every rank's verdict travels in the status words
//! that open its chunks of the first exchange (see [`read_status`]): invalid input on one rank
//! is the same error on every rank, never a hang, and no exchange is spent on agreeing alone
//! where a payload can carry it. Ranks started with different E, K, H or hidden-state dtypes
//! are detected the same way. Rows travel through [`Communicator::all_to_all_v_rows`]: sent
//! from where they lie and received straight into the result, while each rank copies its
//! rows to itself. Finiteness of the rows is checked in a pass made over them anyway (that
//! copy, or combine's sum) and agreed in a last exchange of a few words:
//!
//! - `dispatch`: the status (with T, for the stride), local ids and affinities; then the rows
//!   into the `[R·S, H]` result (each side already knows every count); then the verdict on
//!   `hidden_states`' finiteness.
//! - `combine`: the status (with the route's stride and counts, checked to match between
//!   ranks); then the rows, added into `[T, H]` where they arrived; then the first non-finite
//!   value any rank met, if any.
//! - `combine_bwd`: the status (with the route, checked as in `combine`); then the rows,
//!   straight into `[R·S, H]`.
//! - `dispatch_bwd`: the status (with the route, checked before the payload is read), the
//!   rows and the affinity gradients, added where they lie.

use std::mem::MaybeUninit;
use std::ops::Range;

use super::comm::{Communicator, Received, RowChunks, RowsToSend, read_status, status_words};
use crate::backend::Backend;
use crate::contracts::{
    A2avRouting, A2avRoutingInputs, A2avRoutingOutputs, A2avRoutingParams, SKIP, validate,
};
use crate::cpu::CpuBackend;
use crate::error::{Error, Result};
use crate::tensor::{DType, Tensor, try_filled};
use crate::uninit::{assume_init, try_uninit, uninit, write_copy};

/// Parameters of [`dispatch`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DispatchParams {
    /// E, experts of the whole model (over all ranks).
    pub num_experts: usize,
}

/// How rows travel between the ranks, in nki-library's convention: made by [`dispatch`], used
/// by [`combine`] and both backward passes.
#[derive(Clone, Debug, PartialEq)]
pub struct Route {
    /// `[T, R]` i32: column d the tokens sent to rank d, ascending, then T.
    pub send_indices: Tensor,
    /// `[1, R]` i32 (`[R]` is accepted too).
    pub send_counts: Tensor,
    /// `[1, R]` i32 (`[R]` is accepted too).
    pub recv_counts: Tensor,
    /// S, the rows per source in the received layout `[R·S, H]`: the largest T of any rank.
    pub stride: usize,
}

/// What [`dispatch`] delivers to this rank: `permute_a2av`'s layout, source s's rows at
/// `[s·S, s·S + recv_counts[s])`.
#[derive(Clone, Debug, PartialEq)]
pub struct Dispatched {
    pub route: Route,
    /// `[R·S, H]` f32: the received token rows, zero past each source's.
    pub hidden_states: Tensor,
    /// `[R·S, K]` i32: local expert ids in `[0, E/R)`, or `SKIP` (every slot of the rows past
    /// each source's).
    pub expert_index: Tensor,
    /// `[R·S, K]` f32: 0 where `SKIP`.
    pub topk_affinities: Tensor,
}

impl Route {
    /// M, the rows received from all sources (`Σ recv_counts`).
    pub fn received_rows(&self) -> usize {
        let counts = self.recv_counts.as_i32().unwrap_or_default();
        counts.iter().map(|&rows| rows.max(0) as usize).sum()
    }
}

/// E experts must split evenly over R ranks.
pub(super) fn check_sharding(e: usize, r: usize) -> Result<()> {
    if e == 0 || !e.is_multiple_of(r) {
        return Err(Error::param(
            "num_experts",
            format!("E = {e} experts cannot be sharded evenly over R = {r} ranks"),
        ));
    }
    Ok(())
}

/// The first rank whose sizes differ from rank 0's, as every rank reports it (`all[src]` are
/// the sizes `names` of rank src).
fn check_same_sizes(names: &[&str], all: &[Vec<u32>]) -> Result<()> {
    let first = &all[0];
    for (rank, theirs) in all.iter().enumerate().skip(1) {
        if let Some((name, (a, b))) = names
            .iter()
            .zip(first.iter().zip(theirs))
            .find(|(_, (a, b))| a != b)
        {
            return Err(Error::Collective {
                rank,
                message: format!("runs with {name} = {b}, but rank 0 runs with {name} = {a}"),
            });
        }
    }
    Ok(())
}

/// A size as a status word (sizes beyond `u32` saturate; no such tensor fits in memory).
fn size_word(value: usize) -> u32 {
    u32::try_from(value).unwrap_or(u32::MAX)
}

/// Every source's sizes (its status words' integers) and payload (the words after them).
type Agreed<'a> = (Vec<Vec<u32>>, Vec<&'a [f32]>);

/// Reads the status words of every source and checks the sizes named by `names` agree (the
/// first `names.len()` of each source's sizes): each source's sizes and payload (the words
/// after its status), or the same error on every rank.
fn agreed_payloads<'a>(received: &'a Received, names: &[&str]) -> Result<Agreed<'a>> {
    let statuses = read_status(received)?;
    let sizes: Vec<Vec<u32>> = statuses.iter().map(|(sizes, _)| sizes.clone()).collect();
    check_same_sizes(names, &sizes)?;
    let payloads = statuses
        .iter()
        .enumerate()
        .map(|(src, &(_, start))| &received.chunk(src)[start..])
        .collect();
    Ok((sizes, payloads))
}

/// A route's counts as status words: `send_counts`, then `recv_counts` (R each).
fn route_words<'a>(
    send_counts: &'a [usize],
    recv_counts: &'a [usize],
) -> impl Iterator<Item = u32> + 'a {
    send_counts.iter().chain(recv_counts).map(|&c| size_word(c))
}

/// Every rank's route must match every other's: the rows src sends dst (src's
/// `send_counts[dst]`) are the rows dst expects from src (dst's `recv_counts[src]`).
/// `sizes[rank]` holds that rank's [`route_words`] from `offset` on; the same error on every
/// rank when they do not match, before any row travels.
fn check_routes_agree(sizes: &[Vec<u32>], offset: usize) -> Result<()> {
    let r = sizes.len();
    for (src, from) in sizes.iter().enumerate() {
        for (dst, to) in sizes.iter().enumerate() {
            let (sent, expected) = (from[offset + dst], to[offset + r + src]);
            if sent != expected {
                return Err(Error::Collective {
                    rank: dst,
                    message: format!(
                        "its route expects {expected} rows from rank {src}, whose route sends \
                         it {sent}"
                    ),
                });
            }
        }
    }
    Ok(())
}

/// Every rank's verdict and its sizes (`sizes` of a valid rank), in one exchange of
/// fixed-size status words when every rank is valid: `0, n, sizes…`, or `1, L, 0…` for a rank
/// that failed, whose L-byte message then travels in a second exchange. Every rank passes the
/// same n; a valid rank's `sizes` hold n values. Returns every rank's sizes, or the first
/// failing rank's error on every rank alike.
fn agree_on_sizes(
    comm: &dyn Communicator,
    local: std::result::Result<&[u32], &Error>,
    n: usize,
) -> Result<Vec<Vec<u32>>> {
    let r = comm.size();
    let width = 2 + n;
    let mut words = status_words(local);
    words.resize(width, 0.0);
    let send: Vec<f32> = (0..r).flat_map(|_| words.iter().copied()).collect();
    let received = comm.all_to_all_v_words(send.into(), &vec![width; r], Some(&vec![width; r]))?;
    let failed: Vec<usize> = (0..r)
        .filter(|&src| received.chunk(src)[0].to_bits() != 0)
        .collect();
    if failed.is_empty() {
        return read_status(&received)
            .map(|statuses| statuses.into_iter().map(|(sizes, _)| sizes).collect());
    }
    // Some rank failed: every rank sends its whole status (a failed rank's with its message),
    // each length known from the fixed-size exchange.
    let status = status_words(local);
    let lengths: Vec<usize> = (0..r)
        .map(|src| {
            let len = received.chunk(src)[1].to_bits() as usize;
            if failed.contains(&src) {
                2 + len.div_ceil(4)
            } else {
                2 + len
            }
        })
        .collect();
    let send: Vec<f32> = (0..r).flat_map(|_| status.iter().copied()).collect();
    let messages = comm.all_to_all_v_words(send.into(), &vec![status.len(); r], Some(&lengths))?;
    read_status(&messages).map(|statuses| statuses.into_iter().map(|(sizes, _)| sizes).collect())
}

/// The agreement that opens [`combine`] and [`combine_bwd`]: every rank's verdict, H and
/// route (`route(&parts)` of a valid rank: H, the stride S, `send_counts`, `recv_counts`), with
/// H, S and the routes checked to match. Every rank's sizes `[H, S, send_counts…,
/// recv_counts…]`, or the same error on every rank.
fn agree_on_route<P>(
    comm: &dyn Communicator,
    local: &Result<P>,
    route: impl Fn(&P) -> (usize, usize, &[usize], &[usize]),
) -> Result<Vec<Vec<u32>>> {
    let sizes: Vec<u32> = match local {
        Ok(parts) => {
            let (h, stride, send_counts, recv_counts) = route(parts);
            [size_word(h), size_word(stride)]
                .into_iter()
                .chain(route_words(send_counts, recv_counts))
                .collect()
        }
        Err(_) => Vec::new(),
    };
    let all = agree_on_sizes(
        comm,
        local.as_ref().map(|_| &sizes[..]),
        2 + 2 * comm.size(),
    )?;
    let leading: Vec<Vec<u32>> = all.iter().map(|sizes| sizes[..2].to_vec()).collect();
    check_same_sizes(&["H (hidden size)", "the route's stride S"], &leading)?;
    check_routes_agree(&all, 2)?;
    Ok(all)
}

/// A source's payload must be `rows` rows of `width` words.
fn check_payload(src: usize, payload: &[f32], rows: usize, width: usize) -> Result<()> {
    if payload.len() != rows * width {
        return Err(Error::Collective {
            rank: src,
            message: format!(
                "sent {} words where this rank's route expects {rows} rows of {width}",
                payload.len()
            ),
        });
    }
    Ok(())
}

/// A route's counts, `[1, R]` i32.
fn counts_tensor(counts: &[usize]) -> Result<Tensor> {
    let values = counts
        .iter()
        .map(|&c| i32::try_from(c).map_err(|_| Error::param("rows", "more than i32::MAX rows")))
        .collect::<Result<Vec<i32>>>()?;
    Tensor::from_i32([1, counts.len()], values)
}

/// The route's table for `expert_index` (validated): the `a2av_routing` kernel's
/// `send_indices [T, R]` and `send_counts [1, R]`, with the tokens each rank is sent (column
/// by column, ascending).
fn routing_table(
    expert_index: &Tensor,
    num_experts: usize,
    r: usize,
) -> Result<(A2avRoutingOutputs, Vec<Vec<usize>>)> {
    let call = A2avRouting::new(
        A2avRoutingInputs { expert_index },
        A2avRoutingParams {
            num_experts,
            expert_parallel_degree: r,
        },
    )?;
    let table = CpuBackend.a2av_routing(&call)?;
    let (indices, counts) = (
        table.send_indices.as_i32().unwrap_or_default(),
        table.send_counts.as_i32().unwrap_or_default(),
    );
    let tokens = (0..r)
        .map(|dst| {
            (0..counts[dst] as usize)
                .map(|row| indices[row * r + dst] as usize)
                .collect()
        })
        .collect();
    Ok((table, tokens))
}

/// Sends each token row to the ranks that own its experts (see the module documentation).
///
/// Inputs: `hidden_states [T, H]` (f32 or bf16), `expert_index [T, K]` (global ids in
/// `[0, E)`, distinct per row), `topk_affinities [T, K]`. T may differ between ranks, and be 0
/// on some.
pub fn dispatch(
    comm: &dyn Communicator,
    hidden_states: &Tensor,
    expert_index: &Tensor,
    topk_affinities: &Tensor,
    params: DispatchParams,
) -> Result<Dispatched> {
    let r = comm.size();
    let e = params.num_experts;
    let local = (|| {
        check_sharding(e, r)?;
        let shape =
            validate::float_tensor_shape("hidden_states", hidden_states, "[T, H]", &[None, None])?;
        let (t, h) = (shape[0], shape[1]);
        validate::non_empty("hidden_states", "H (hidden size)", h)?;
        // Finiteness is checked while the rows are copied, and agreed after the exchange.
        let (index_shape, ids) =
            validate::index_tensor("expert_index", expert_index, "[T, K]", &[Some(t), None])?;
        let k = index_shape[1];
        validate::non_empty("expert_index", "K (top_k)", k)?;
        validate::expert_ids("expert_index", ids, &index_shape, e)?;
        validate::float_tensor(
            "topk_affinities",
            topk_affinities,
            "[T, K]",
            &[Some(t), Some(k)],
        )?;
        let (table, tokens) = routing_table(expert_index, e, r)?;
        Ok((t, h, k, table, tokens))
    })();
    let dtype_bits = match hidden_states.dtype() {
        DType::BF16 => 16,
        _ => 32,
    };
    let local_experts = e / r.max(1);
    let (t, h, k) = local.as_ref().map_or((0, 0, 0), |&(t, h, k, ..)| (t, h, k));
    let ids = expert_index.as_i32().unwrap_or_default();
    let no_rows = vec![Vec::new(); r];
    let tokens = local.as_ref().map_or(&no_rows, |(.., tokens)| tokens);

    // First exchange: the status (T last: the ranks' T may differ, and give the stride), then
    // per destination its rows' K local ids (`SKIP` for slots owned elsewhere) and K
    // affinities (0 there), in token order.
    let sizes = [e, k, h, dtype_bits, t].map(size_word);
    let status = status_words(local.as_ref().map(|_| &sizes[..]));
    let affinities = topk_affinities.f32_values();
    let mut meta =
        Vec::with_capacity(r * status.len() + 2 * k * tokens.iter().map(Vec::len).sum::<usize>());
    let mut meta_counts = Vec::with_capacity(r);
    for (dst, sent) in tokens.iter().enumerate() {
        let start = meta.len();
        meta.extend_from_slice(&status);
        let owned = dst * local_experts..(dst + 1) * local_experts;
        for &token in sent {
            meta.extend(ids[token * k..(token + 1) * k].iter().map(|&id| {
                let id = id as usize;
                let local = if owned.contains(&id) {
                    (id - owned.start) as i32
                } else {
                    SKIP
                };
                f32::from_bits(local as u32)
            }));
        }
        for &token in sent {
            meta.extend((token * k..(token + 1) * k).map(|slot| {
                if owned.contains(&(ids[slot] as usize)) {
                    affinities[slot]
                } else {
                    0.0
                }
            }));
        }
        meta_counts.push(meta.len() - start);
    }
    let received = comm.all_to_all_v_words(meta.into(), &meta_counts, None)?;
    let (all, payloads) = agreed_payloads(
        &received,
        &[
            "num_experts",
            "K (top_k)",
            "H (hidden size)",
            "hidden_states bits (dtype)",
        ],
    )?;
    let stride = all.iter().map(|sizes| sizes[4] as usize).max().unwrap_or(0);
    let recv_counts: Vec<usize> = payloads.iter().map(|p| p.len() / (2 * k)).collect();
    for (src, (payload, &rows)) in payloads.iter().zip(&recv_counts).enumerate() {
        check_payload(src, payload, rows, 2 * k)?;
        // A source sends each of its T tokens at most once, and no rank has more than S.
        if rows > stride {
            return Err(Error::Collective {
                rank: src,
                message: format!("sent {rows} rows, more than the largest T of any rank, {stride}"),
            });
        }
    }
    let chunks = RowChunks::Strided {
        counts: &recv_counts,
        stride,
    };
    let rows = chunks.rows();
    let mut recv_ids = try_filled("the received `expert_index`", &[rows, k], SKIP)?;
    let mut recv_affinities = try_filled("the received `topk_affinities`", &[rows, k], 0f32)?;
    for (src, (payload, &count)) in payloads.iter().zip(&recv_counts).enumerate() {
        let (row_ids, row_affinities) = payload.split_at(count * k);
        let at = chunks.range(src);
        let slots = at.start * k..at.end * k;
        for (id, word) in recv_ids[slots.clone()].iter_mut().zip(row_ids) {
            *id = word.to_bits() as i32;
        }
        recv_affinities[slots].copy_from_slice(row_affinities);
    }
    drop(received);

    // Second exchange: the rows, from where they lie in `hidden_states`, straight into the
    // `[R·S, H]` result; every rank knows every count. This rank's own rows are copied in here,
    // and finiteness is checked while they are (then on the rows sent only elsewhere).
    let rank = comm.rank();
    let x = hidden_states.f32_values();
    let (hidden, own_non_finite) = exchange_gathered(comm, &x, h, tokens, chunks)?;
    let sent_only_elsewhere = {
        let mut own = tokens[rank].iter().peekable();
        (0..t).filter(move |&token| own.next_if_eq(&&token).is_none())
    };
    let non_finite = own_non_finite
        || sent_only_elsewhere
            .into_iter()
            .any(|token| has_non_finite(&x[token * h..(token + 1) * h]));
    let verdict = match non_finite {
        true => validate::finite("hidden_states", hidden_states),
        false => Ok(()),
    };
    agree_on_sizes(comm, verdict.as_ref().map(|()| &[][..]), 0)?;
    let (_, _, _, table, _) = local?;
    Ok(Dispatched {
        route: Route {
            send_indices: table.send_indices,
            send_counts: table.send_counts,
            recv_counts: counts_tensor(&recv_counts)?,
            stride,
        },
        hidden_states: Tensor::from_f32([rows, h], hidden)?,
        expert_index: Tensor::from_i32([rows, k], recv_ids)?,
        topk_affinities: Tensor::from_f32([rows, k], recv_affinities)?,
    })
}

/// A validated [`Route`].
struct RouteParts {
    /// T, this rank's tokens.
    t: usize,
    /// `tokens[dst]`: the tokens sent to rank dst, ascending (column dst of `send_indices`).
    tokens: Vec<Vec<usize>>,
    send_counts: Vec<usize>,
    recv_counts: Vec<usize>,
    stride: usize,
}

impl RouteParts {
    /// Where the rows received from each source lie: `[R·S, _]`, strided.
    fn received(&self) -> RowChunks<'_> {
        RowChunks::Strided {
            counts: &self.recv_counts,
            stride: self.stride,
        }
    }
}

/// Checks a route in nki-library's convention (see the module documentation) for R ranks.
fn check_route(route: &Route, r: usize) -> Result<RouteParts> {
    let counts = |name: &str, tensor: &Tensor| -> Result<Vec<usize>> {
        let dims: &[Option<usize>] = match tensor.shape().len() {
            1 => &[Some(r)],
            _ => &[Some(1), Some(r)],
        };
        let (_, values) = validate::index_tensor(name, tensor, "[1, R]", dims)?;
        values
            .iter()
            .map(|&c| {
                usize::try_from(c)
                    .map_err(|_| Error::invalid(name, format!("negative row count {c}")))
            })
            .collect()
    };
    let send_counts = counts("send_counts", &route.send_counts)?;
    let recv_counts = counts("recv_counts", &route.recv_counts)?;
    let (shape, indices) = validate::index_tensor(
        "send_indices",
        &route.send_indices,
        "[T, R]",
        &[None, Some(r)],
    )?;
    let (t, stride) = (shape[0], route.stride);
    if let Some(src) = recv_counts.iter().position(|&rows| rows > stride) {
        return Err(Error::invalid(
            "recv_counts",
            format!(
                "receives {} rows from rank {src}, more than the route's stride S = {stride}",
                recv_counts[src]
            ),
        ));
    }
    if t > stride {
        return Err(Error::invalid(
            "send_indices",
            format!("T = {t} tokens exceed the route's stride S = {stride} (the largest T)"),
        ));
    }
    let mut tokens = Vec::with_capacity(r);
    for (dst, &count) in send_counts.iter().enumerate() {
        let column: Vec<i32> = (0..t).map(|row| indices[row * r + dst]).collect();
        let (sent, empty) = column.split_at(count.min(t));
        let ascending_ids = sent.iter().all(|&id| (0..t as i32).contains(&id))
            && sent.windows(2).all(|pair| pair[0] < pair[1]);
        if count > t || !ascending_ids || empty.iter().any(|&id| id != t as i32) {
            return Err(Error::invalid(
                "send_indices",
                format!(
                    "column {dst} must list send_counts[{dst}] = {count} token ids in [0, {t}), \
                     ascending, then T = {t}"
                ),
            ));
        }
        tokens.push(sent.iter().map(|&id| id as usize).collect());
    }
    Ok(RouteParts {
        t,
        tokens,
        send_counts,
        recv_counts,
        stride,
    })
}

/// Lanes of the row loops below: independent flags, so the loops vectorise.
const LANES: usize = 16;

/// Bits of an f32's exponent: all set in an infinity or a NaN.
const EXPONENT: u32 = 0x7f80_0000;

/// Whether `values` holds an infinity or a NaN.
fn has_non_finite(values: &[f32]) -> bool {
    let mut flags = [0u32; LANES];
    let chunks = values.chunks_exact(LANES);
    let tail = chunks.remainder();
    for chunk in chunks {
        for (flag, v) in flags.iter_mut().zip(chunk) {
            *flag |= u32::from(v.to_bits() & EXPONENT == EXPONENT);
        }
    }
    flags.iter().any(|&flag| flag != 0) || tail.iter().any(|v| !v.is_finite())
}

/// Writes the sum of `rows` (each `out.len()` words, added in order: `(r0 + r1) + r2 …`), or
/// zeros when there are none, into `out`; returns whether any row holds an infinity or a NaN.
fn sum_rows<'a>(
    out: &mut [MaybeUninit<f32>],
    rows: &mut (impl Iterator<Item = &'a [f32]> + Clone),
) -> bool {
    let mut flags = [0u32; LANES];
    let mut outs = out.chunks_exact_mut(LANES);
    let mut start = 0;
    for o in &mut outs {
        let mut sum = [0f32; LANES];
        for (n, row) in rows.clone().enumerate() {
            let chunk = &row[start..start + LANES];
            for ((s, flag), &v) in sum.iter_mut().zip(&mut flags).zip(chunk) {
                *s = if n == 0 { v } else { *s + v };
                *flag |= u32::from(v.to_bits() & EXPONENT == EXPONENT);
            }
        }
        write_copy(o, &sum);
        start += LANES;
    }
    for (i, slot) in outs.into_remainder().iter_mut().enumerate() {
        let mut sum = 0f32;
        for (n, row) in rows.clone().enumerate() {
            let v = row[start + i];
            sum = if n == 0 { v } else { sum + v };
            flags[0] |= u32::from(!v.is_finite());
        }
        slot.write(sum);
    }
    flags.iter().any(|&flag| flag != 0)
}

/// Sends each rank r the rows `rows[r]` of `source` (`[_, h]`) and receives each source's rows
/// into its chunk of one `[recv.rows(), h]` buffer, zero outside the chunks; this rank's rows
/// to itself are copied in here. Also returns whether those own rows hold an infinity or a NaN
/// (the copy reads them anyway).
fn exchange_gathered(
    comm: &dyn Communicator,
    source: &[f32],
    h: usize,
    rows: &[Vec<usize>],
    recv: RowChunks<'_>,
) -> Result<(Vec<f32>, bool)> {
    let rank = comm.rank();
    let total = recv.rows();
    let mut received = try_uninit("the received rows", &[total, h])?;
    if recv.counts()[rank] != rows[rank].len() {
        return Err(Error::invalid(
            "recv_counts",
            format!(
                "rank {rank} sends itself {} rows but recv_counts[{rank}] = {}",
                rows[rank].len(),
                recv.counts()[rank]
            ),
        ));
    }
    // The rows past each chunk (a strided layout's padding) are zero.
    let mut next = 0;
    for src in 0..recv.len() {
        let chunk = recv.range(src);
        write_zeros(&mut received[next * h..chunk.start * h]);
        next = chunk.end;
    }
    write_zeros(&mut received[next * h..]);
    let own = recv.range(rank);
    let non_finite = gather_rows(
        source,
        h,
        &rows[rank],
        &mut received[own.start * h..own.end * h],
    );
    comm.all_to_all_v_rows(source, h, RowsToSend::Gathered(rows), recv, &mut received)?;
    // SAFETY: the exchange wrote every other source's chunk, `gather_rows` this rank's and
    // `write_zeros` the rows between the chunks.
    Ok((unsafe { assume_init(received) }, non_finite))
}

/// Writes zeros into `out`.
fn write_zeros(out: &mut [MaybeUninit<f32>]) {
    for slot in out {
        slot.write(0.0);
    }
}

/// Copies the rows `rows` of `source` (`[_, h]`) into `out` back to back; returns whether
/// any of them holds an infinity or a NaN.
fn gather_rows(source: &[f32], h: usize, rows: &[usize], out: &mut [MaybeUninit<f32>]) -> bool {
    let mut flags = [0u32; LANES];
    for (&row, out) in rows.iter().zip(out.chunks_exact_mut(h)) {
        let mut outs = out.chunks_exact_mut(LANES);
        let mut chunks = source[row * h..(row + 1) * h].chunks_exact(LANES);
        for (o, chunk) in (&mut outs).zip(&mut chunks) {
            for ((flag, slot), &v) in flags.iter_mut().zip(o).zip(chunk) {
                slot.write(v);
                *flag |= u32::from(v.to_bits() & EXPONENT == EXPONENT);
            }
        }
        for (slot, &v) in outs.into_remainder().iter_mut().zip(chunks.remainder()) {
            slot.write(v);
            flags[0] |= u32::from(!v.is_finite());
        }
    }
    flags.iter().any(|&flag| flag != 0)
}

/// Returns the expert outputs of the received rows, `expert_output [R·S, H]` in the layout
/// [`dispatch`] delivered (`unpermute_a2av`'s input), to their source ranks and adds each
/// token's rows in ascending rank order: `[T, H]` f32. The rows past each source's are not
/// read.
pub fn combine(comm: &dyn Communicator, route: &Route, expert_output: &Tensor) -> Result<Tensor> {
    let (rank, r) = (comm.rank(), comm.size());
    let local = (|| {
        let parts = check_route(route, r)?;
        // Finiteness is checked while the rows are added, by the rank that adds them.
        let shape = validate::float_tensor_shape(
            "expert_output",
            expert_output,
            "[R·S, H]",
            &[Some(r * parts.stride), None],
        )?;
        validate::non_empty("expert_output", "H (hidden size)", shape[1])?;
        Ok((parts, shape[1]))
    })();
    agree_on_route(comm, &local, |(parts, h)| {
        (*h, parts.stride, &parts.send_counts, &parts.recv_counts)
    })?;
    let (parts, h) = local?;
    let (t, stride) = (parts.t, parts.stride);
    // The rows go back from where they lie (each source's chunk of `expert_output`), received
    // into one buffer packed by source; this rank's own rows never leave `expert_output`.
    let rows = expert_output.f32_values();
    let mut back = parts.send_counts.clone();
    back[rank] = 0;
    let back = RowChunks::Packed(&back);
    let mut received = uninit(back.rows() * h);
    comm.all_to_all_v_rows(
        &rows,
        h,
        RowsToSend::Chunks(parts.received()),
        back,
        &mut received,
    )?;
    // SAFETY: the exchange wrote every other source's chunk; this rank's has no rows.
    let received = unsafe { assume_init(received) };
    let own = parts.received().range(rank);
    let chunk_of = |src: usize| match src == rank {
        true => &rows[own.start * h..own.end * h],
        false => &received[back.range(src).start * h..back.range(src).end * h],
    };
    // `row_of[token·R + src]`: the token's row in what src returned, or T: not sent there.
    let mut row_of = vec![t; t * r];
    for (dst, tokens) in parts.tokens.iter().enumerate() {
        for (row, &token) in tokens.iter().enumerate() {
            row_of[token * r + dst] = row;
        }
    }
    // Token by token, each output row written once, in one pass: the sum of its rows in
    // ascending rank order (a token sent nowhere gets 0). The first non-finite value seen is
    // kept as `(source rank, its row there, column, value)`.
    let mut bad: Option<(usize, usize, usize, f32)> = None;
    let mut output = uninit(t * h);
    let mut rows_of_token: Vec<(usize, usize, &[f32])> = Vec::with_capacity(r);
    for (sent, out) in row_of.chunks_exact(r).zip(output.chunks_exact_mut(h)) {
        rows_of_token.clear();
        for (src, &row) in sent.iter().enumerate().filter(|&(_, &row)| row != t) {
            rows_of_token.push((src, row, &chunk_of(src)[row * h..(row + 1) * h]));
        }
        let mut values = rows_of_token.iter().map(|&(_, _, values)| values);
        if sum_rows(out, &mut values) {
            for &(src, row, values) in &rows_of_token {
                if let Some(col) = values.iter().position(|v| !v.is_finite()) {
                    // The row in src's `expert_output`: this rank's chunk there, then the row.
                    let found = (src, rank * stride + row, col, values[col]);
                    let key = |(src, row, col, _): (usize, usize, usize, f32)| (src, row, col);
                    if bad.is_none_or(|first| key(found) < key(first)) {
                        bad = Some(found);
                    }
                }
            }
        }
    }
    // SAFETY: `sum_rows` wrote every row of the output.
    let output = unsafe { assume_init(output) };
    // Every rank learns of the first bad value (by source rank, row, column) any rank found.
    let report = match bad {
        Some((src, row, col, value)) => {
            vec![
                1,
                size_word(src),
                size_word(row),
                size_word(col),
                value.to_bits(),
            ]
        }
        None => vec![0; 5],
    };
    let reports = agree_on_sizes(comm, Ok(&report), report.len())?;
    let first = reports
        .iter()
        .filter(|report| report[0] == 1)
        .min_by_key(|report| (report[1], report[2], report[3]));
    if let Some(report) = first {
        let value = f32::from_bits(report[4]);
        let err = Error::NonFinite {
            tensor: "expert_output".to_owned(),
            position: format!("[{}, {}]", report[2], report[3]),
            value,
        };
        return Err(Error::Collective {
            rank: report[1] as usize,
            message: err.to_string(),
        });
    }
    Tensor::from_f32([t, h], output)
}

/// Backward of [`combine`]: the gradient of each received row is its token's output gradient,
/// `d_output [T, H]` → `d_expert_output [R·S, H]` f32 in [`dispatch`]'s layout (zero past each
/// source's rows).
pub fn combine_bwd(comm: &dyn Communicator, route: &Route, d_output: &Tensor) -> Result<Tensor> {
    let r = comm.size();
    let local = (|| {
        let parts = check_route(route, r)?;
        let shape = validate::float_tensor("d_output", d_output, "[T, H]", &[Some(parts.t), None])?;
        validate::non_empty("d_output", "H (hidden size)", shape[1])?;
        Ok((parts, shape[1]))
    })();
    agree_on_route(comm, &local, |(parts, h)| {
        (*h, parts.stride, &parts.send_counts, &parts.recv_counts)
    })?;
    let (parts, h) = local?;
    // Each token's gradient row goes to every rank it was sent to, straight into its chunk of
    // the `[R·S, H]` result there; this rank's own rows are copied in here.
    let (received, _) = exchange_gathered(
        comm,
        &d_output.f32_values(),
        h,
        &parts.tokens,
        parts.received(),
    )?;
    Tensor::from_f32([parts.received().rows(), h], received)
}

/// Backward of [`dispatch`]: the received rows' gradients `d_hidden_states [R·S, H]` and
/// `d_topk_affinities [R·S, K]` (in [`dispatch`]'s layout; the rows past each source's are not
/// read) go back to their sources; a token's hidden-state gradient is the sum of its rows'
/// (ascending rank order) and each affinity gradient comes from the rank that owns that slot's
/// expert. Returns `(d_hidden_states [T, H], d_topk_affinities [T, K])` f32; `expert_index
/// [T, K]` is the forward's (global ids).
pub fn dispatch_bwd(
    comm: &dyn Communicator,
    route: &Route,
    expert_index: &Tensor,
    params: DispatchParams,
    d_hidden_states: &Tensor,
    d_topk_affinities: &Tensor,
) -> Result<(Tensor, Tensor)> {
    let r = comm.size();
    let e = params.num_experts;
    let local = (|| {
        check_sharding(e, r)?;
        let parts = check_route(route, r)?;
        let (index_shape, ids) = validate::index_tensor(
            "expert_index",
            expert_index,
            "[T, K]",
            &[Some(parts.t), None],
        )?;
        validate::expert_ids("expert_index", ids, &index_shape, e)?;
        let k = index_shape[1];
        let rows = parts.received().rows();
        let shape = validate::float_tensor(
            "d_hidden_states",
            d_hidden_states,
            "[R·S, H]",
            &[Some(rows), None],
        )?;
        validate::float_tensor(
            "d_topk_affinities",
            d_topk_affinities,
            "[R·S, K]",
            &[Some(rows), Some(k)],
        )?;
        Ok((parts, ids, shape[1], k))
    })();
    let (h, k) = local.as_ref().map_or((0, 0), |&(_, _, h, k)| (h, k));
    let sizes: Vec<u32> = match &local {
        Ok((parts, ..)) => [size_word(h), size_word(k), size_word(parts.stride)]
            .into_iter()
            .chain(route_words(&parts.send_counts, &parts.recv_counts))
            .collect(),
        Err(_) => Vec::new(),
    };
    let status = status_words(local.as_ref().map(|_| &sizes[..]));
    // Each source's row gradients go back with the status in front: its rows' H values, then
    // their K affinity gradients.
    let d_rows = d_hidden_states.f32_values();
    let d_row_affinities = d_topk_affinities.f32_values();
    let sources: Vec<Range<usize>> = match &local {
        Ok((parts, ..)) => (0..r).map(|src| parts.received().range(src)).collect(),
        Err(_) => vec![0..0; r],
    };
    let mut send = Vec::with_capacity(r * status.len() + d_rows.len() + d_row_affinities.len());
    let mut counts = Vec::with_capacity(r);
    for rows in sources {
        send.extend_from_slice(&status);
        send.extend_from_slice(&d_rows[rows.start * h..rows.end * h]);
        send.extend_from_slice(&d_row_affinities[rows.start * k..rows.end * k]);
        counts.push(status.len() + rows.len() * (h + k));
    }
    let received = comm.all_to_all_v_words(send.into(), &counts, None)?;
    let (all, payloads) = agreed_payloads(
        &received,
        &["H (hidden size)", "K (top_k)", "the route's stride S"],
    )?;
    check_routes_agree(&all, 3)?;
    let (parts, ids, h, k) = local?;
    let (t, local_experts) = (parts.t, e / r);
    let mut d_x = vec![0f32; t * h];
    let mut d_affinities = vec![0f32; t * k];
    for (dst, (tokens, payload)) in parts.tokens.iter().zip(&payloads).enumerate() {
        let rows = parts.send_counts[dst];
        check_payload(dst, payload, rows, h + k)?;
        let (row_values, row_affinities) = payload.split_at(rows * h);
        for (row, &token) in tokens.iter().enumerate() {
            for (d, v) in d_x[token * h..(token + 1) * h]
                .iter_mut()
                .zip(&row_values[row * h..(row + 1) * h])
            {
                *d += v;
            }
            for slot in 0..k {
                if ids[token * k + slot] as usize / local_experts == dst {
                    d_affinities[token * k + slot] = row_affinities[row * k + slot];
                }
            }
        }
    }
    Ok((
        Tensor::from_f32([t, h], d_x)?,
        Tensor::from_f32([t, k], d_affinities)?,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Rows of every width up to three lane groups and a tail, with signed zeros.
    fn rows(count: usize, width: usize) -> Vec<Vec<f32>> {
        (0..count)
            .map(|r| {
                (0..width)
                    .map(|i| match (r + i) % 5 {
                        0 => -0.0,
                        _ => (r * 31 + i) as f32 * 0.37 - 9.0,
                    })
                    .collect()
            })
            .collect()
    }

    #[test]
    fn row_sums_add_in_order_and_flag_non_finite_values() {
        for width in [1, 15, 16, 17, 40, 48] {
            for count in 0..4 {
                let rows = rows(count, width);
                let mut out = uninit(width);
                let flagged = sum_rows(&mut out, &mut rows.iter().map(Vec::as_slice));
                // SAFETY: `sum_rows` writes every element.
                let out = unsafe { assume_init(out) };
                let expected: Vec<f32> = (0..width)
                    .map(|i| {
                        let mut column = rows.iter().map(|row| row[i]);
                        let first = column.next().unwrap_or(0.0);
                        column.fold(first, |sum, v| sum + v)
                    })
                    .collect();
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&out), bits(&expected), "width {width}, {count} rows");
                assert!(!flagged);
                for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
                    for at in [0, width - 1] {
                        let mut rows = rows.clone();
                        if let Some(row) = rows.last_mut() {
                            row[at] = bad;
                            let mut out = uninit(width);
                            assert!(sum_rows(&mut out, &mut rows.iter().map(Vec::as_slice)));
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn gathered_rows_are_copied_and_flagged() {
        for width in [1, 16, 19, 35] {
            let source = rows(5, width).concat();
            let picked = [4, 0, 4, 2];
            let mut out = uninit(picked.len() * width);
            assert!(!gather_rows(&source, width, &picked, &mut out));
            // SAFETY: `gather_rows` wrote every picked row.
            let out = unsafe { assume_init(out) };
            let expected: Vec<f32> = picked
                .iter()
                .flat_map(|&row| source[row * width..(row + 1) * width].to_vec())
                .collect();
            assert_eq!(out, expected);
            for at in [2 * width, 3 * width - 1] {
                let mut source = source.clone();
                source[at] = f32::NAN;
                let mut out = uninit(picked.len() * width);
                assert!(gather_rows(&source, width, &picked, &mut out));
                let mut out = uninit(width);
                assert!(!gather_rows(&source, width, &[1], &mut out));
            }
            assert!(has_non_finite(&[&source[..], &[f32::INFINITY]].concat()));
            assert!(!has_non_finite(&source));
        }
    }
}
