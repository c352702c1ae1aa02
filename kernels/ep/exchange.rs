//! `dispatch` and `combine` (the NKI library's `permute_a2av` / `unpermute_a2av`): token rows
//! travel to the ranks that own their experts and the expert outputs travel back, forward and
//! backward.
//!
//! Experts are sharded contiguously: rank r owns experts `[r·E/R, (r+1)·E/R)` (E must be a
//! multiple of R). A token goes once to each rank that owns at least one of its K experts,
//! with its local expert ids (`SKIP` for slots owned elsewhere) and affinities (0 there).
//!
//! ```text
//! send_indices [T, R]  i32  row of token t in the chunk sent to rank r, or T: not sent
//! send_counts  [R]     i32  rows sent to each rank
//! recv_counts  [R]     i32  rows received from each rank (M = Σ recv_counts)
//! ```
//! Received rows are packed by source rank, each source's rows in its token order; combine
//! returns them the same way and adds each token's rows in ascending rank order, so results do
//! not depend on timing. Rows travel as f32 (bf16 inputs are widened exactly).
//!
//! Every function validates its inputs and then [`agree`]s with the other ranks before
//! exchanging anything: invalid input on one rank is the same error on every rank, never a
//! hang. Ranks started with different E, K, H or hidden-state dtypes are detected the same way.

use super::comm::{Communicator, agree, agree_with_values, all_to_all_v_values, extend_from_bytes};
use crate::contracts::SKIP;
use crate::contracts::validate;
use crate::error::{Error, Result};
use crate::tensor::{DType, Tensor};

/// Parameters of [`dispatch`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DispatchParams {
    /// E, experts of the whole model (over all ranks).
    pub num_experts: usize,
}

/// How rows travel between the ranks: made by [`dispatch`], used by [`combine`] and both
/// backward passes.
#[derive(Clone, Debug, PartialEq)]
pub struct Route {
    /// `[T, R]` i32.
    pub send_indices: Tensor,
    /// `[R]` i32.
    pub send_counts: Tensor,
    /// `[R]` i32.
    pub recv_counts: Tensor,
}

/// What [`dispatch`] delivers to this rank.
#[derive(Clone, Debug, PartialEq)]
pub struct Dispatched {
    pub route: Route,
    /// `[M, H]` f32: the received token rows.
    pub hidden_states: Tensor,
    /// `[M, K]` i32: local expert ids in `[0, E/R)`, or `SKIP`.
    pub expert_index: Tensor,
    /// `[M, K]` f32: 0 where `SKIP`.
    pub topk_affinities: Tensor,
}

/// E experts must split evenly over R ranks.
fn check_sharding(e: usize, r: usize) -> Result<()> {
    if e == 0 || !e.is_multiple_of(r) {
        return Err(Error::param(
            "num_experts",
            format!("E = {e} experts cannot be sharded evenly over R = {r} ranks"),
        ));
    }
    Ok(())
}

/// The first rank whose `(name, value)` sizes differ from rank 0's, as every rank reports it.
fn check_same_sizes(names: &[&str], all: &[Vec<i64>]) -> Result<()> {
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

fn counts_tensor(counts: &[usize]) -> Result<Tensor> {
    let values = counts
        .iter()
        .map(|&c| i32::try_from(c).map_err(|_| Error::param("rows", "more than i32::MAX rows")))
        .collect::<Result<Vec<i32>>>()?;
    Tensor::from_i32([counts.len()], values)
}

/// Sends each token row to the ranks that own its experts (see the module documentation).
///
/// Inputs: `hidden_states [T, H]` (f32 or bf16), `expert_index [T, K]` (global ids in
/// `[0, E)`, distinct per row), `topk_affinities [T, K]`. T may be 0 on some ranks.
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
            validate::float_tensor("hidden_states", hidden_states, "[T, H]", &[None, None])?;
        let (t, h) = (shape[0], shape[1]);
        validate::non_empty("hidden_states", "H (hidden size)", h)?;
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
        Ok((t, h, k))
    })();
    let dtype = match hidden_states.dtype() {
        DType::BF16 => 16,
        _ => 32,
    };
    let sizes = local.map(|(t, h, k)| ((t, h, k), vec![e as i64, k as i64, h as i64, dtype]));
    let ((t, h, k), all) = agree_with_values(comm, sizes)?;
    check_same_sizes(
        &[
            "num_experts",
            "K (top_k)",
            "H (hidden size)",
            "hidden_states bits (dtype)",
        ],
        &all,
    )?;

    // One chunk per destination: its rows' H values, then their K local ids, then their K
    // affinities, in token order; handed over in one exchange.
    let local_experts = e / r;
    let ids = expert_index.as_i32().expect("validated as i32");
    let x = hidden_states.f32_values();
    let affinities = topk_affinities.f32_values();
    let mut send_indices = vec![t as i32; t * r];
    let mut send_counts = vec![0usize; r];
    let mut chunks = Vec::with_capacity(r);
    for (dst, count) in send_counts.iter_mut().enumerate() {
        let owned = dst * local_experts..(dst + 1) * local_experts;
        let tokens: Vec<usize> = (0..t)
            .filter(|&token| {
                ids[token * k..(token + 1) * k]
                    .iter()
                    .any(|&id| owned.contains(&(id as usize)))
            })
            .collect();
        *count = tokens.len();
        let mut chunk = Vec::with_capacity(tokens.len() * (h + 2 * k) * 4);
        let (mut row_ids, mut row_affinities) = (Vec::new(), Vec::new());
        for (row, &token) in tokens.iter().enumerate() {
            send_indices[token * r + dst] = row as i32;
            chunk.extend_from_slice(bytemuck::cast_slice(&x[token * h..(token + 1) * h]));
            for slot in token * k..(token + 1) * k {
                let mine = owned.contains(&(ids[slot] as usize));
                row_ids.push(if mine {
                    (ids[slot] as usize - owned.start) as i32
                } else {
                    SKIP
                });
                row_affinities.push(if mine { affinities[slot] } else { 0.0 });
            }
        }
        chunk.extend_from_slice(bytemuck::cast_slice(&row_ids));
        chunk.extend_from_slice(bytemuck::cast_slice(&row_affinities));
        chunks.push(chunk);
    }
    let incoming = comm.all_to_all_v_chunks(chunks)?;
    let row_bytes = (h + 2 * k) * 4;
    let recv_counts: Vec<usize> = incoming.iter().map(|c| c.len() / row_bytes).collect();
    let m: usize = recv_counts.iter().sum();
    let (mut hidden, mut recv_ids, mut recv_affinities) = (
        Vec::with_capacity(m * h),
        Vec::with_capacity(m * k),
        Vec::with_capacity(m * k),
    );
    for (chunk, &rows) in incoming.iter().zip(&recv_counts) {
        let (values, meta) = chunk.split_at(rows * h * 4);
        let (row_ids, row_affinities) = meta.split_at(rows * k * 4);
        extend_from_bytes(&mut hidden, values);
        extend_from_bytes(&mut recv_ids, row_ids);
        extend_from_bytes(&mut recv_affinities, row_affinities);
    }
    Ok(Dispatched {
        route: Route {
            send_indices: Tensor::from_i32([t, r], send_indices)?,
            send_counts: counts_tensor(&send_counts)?,
            recv_counts: counts_tensor(&recv_counts)?,
        },
        hidden_states: Tensor::from_f32([m, h], hidden)?,
        expert_index: Tensor::from_i32([m, k], recv_ids)?,
        topk_affinities: Tensor::from_f32([m, k], recv_affinities)?,
    })
}

/// A validated route: `(T, send_indices, send_counts, recv_counts)`.
type RouteParts<'a> = (usize, &'a [i32], Vec<usize>, Vec<usize>);

fn check_route<'a>(route: &'a Route, r: usize) -> Result<RouteParts<'a>> {
    let counts = |name: &str, tensor: &Tensor| -> Result<Vec<usize>> {
        let (_, values) = validate::index_tensor(name, tensor, "[R]", &[Some(r)])?;
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
    let t = shape[0];
    for (dst, &count) in send_counts.iter().enumerate() {
        let mut rows: Vec<i32> = (0..t)
            .map(|token| indices[token * r + dst])
            .filter(|&row| row != t as i32)
            .collect();
        rows.sort_unstable();
        if rows.iter().enumerate().any(|(i, &row)| row != i as i32) || rows.len() != count {
            return Err(Error::invalid(
                "send_indices",
                format!(
                    "column {dst} must number its sent rows 0..{count} (send_counts[{dst}]) \
                     once each and mark the rest with T = {t}"
                ),
            ));
        }
    }
    Ok((t, indices, send_counts, recv_counts))
}

/// Rows per destination, in send order: `rows[dst]` lists `(token, row)` for the tokens sent
/// to `dst`, ascending.
fn sent_rows(t: usize, r: usize, indices: &[i32]) -> Vec<Vec<usize>> {
    (0..r)
        .map(|dst| {
            let mut tokens: Vec<(i32, usize)> = (0..t)
                .filter(|&token| indices[token * r + dst] != t as i32)
                .map(|token| (indices[token * r + dst], token))
                .collect();
            tokens.sort_unstable();
            tokens.into_iter().map(|(_, token)| token).collect()
        })
        .collect()
}

/// Returns the expert outputs of the received rows, `expert_output [M, H]`, to their source
/// ranks and adds each token's rows in ascending rank order: `[T, H]` f32.
pub fn combine(comm: &dyn Communicator, route: &Route, expert_output: &Tensor) -> Result<Tensor> {
    let r = comm.size();
    let local = (|| {
        let (t, indices, send_counts, recv_counts) = check_route(route, r)?;
        let m: usize = recv_counts.iter().sum();
        let shape =
            validate::float_tensor("expert_output", expert_output, "[M, H]", &[Some(m), None])?;
        Ok((t, indices, send_counts, recv_counts, shape[1]))
    })();
    let (t, indices, _, recv_counts, h) = agree(comm, local)?;
    let values = expert_output.f32_values();
    let mut offset = 0;
    let chunks: Vec<Vec<u8>> = recv_counts
        .iter()
        .map(|&rows| {
            offset += rows;
            bytemuck::cast_slice(&values[(offset - rows) * h..offset * h]).to_vec()
        })
        .collect();
    let returned = comm.all_to_all_v_chunks(chunks)?;
    let mut output = vec![0f32; t * h];
    let mut row_values = vec![0f32; h];
    for (tokens, chunk) in sent_rows(t, comm.size(), indices).iter().zip(&returned) {
        for (row, &token) in tokens.iter().enumerate() {
            bytemuck::cast_slice_mut::<f32, u8>(&mut row_values)
                .copy_from_slice(&chunk[row * h * 4..(row + 1) * h * 4]);
            for (o, v) in output[token * h..(token + 1) * h]
                .iter_mut()
                .zip(&row_values)
            {
                *o += v;
            }
        }
    }
    Tensor::from_f32([t, h], output)
}

/// Backward of [`combine`]: the gradient of each received row is its token's output gradient,
/// `d_output [T, H]` → `d_expert_output [M, H]` f32.
pub fn combine_bwd(comm: &dyn Communicator, route: &Route, d_output: &Tensor) -> Result<Tensor> {
    let r = comm.size();
    let local = (|| {
        let (t, indices, send_counts, recv_counts) = check_route(route, r)?;
        let shape = validate::float_tensor("d_output", d_output, "[T, H]", &[Some(t), None])?;
        Ok((t, indices, send_counts, recv_counts, shape[1]))
    })();
    let (t, indices, send_counts, recv_counts, h) = agree(comm, local)?;
    let d = d_output.f32_values();
    let mut rows = Vec::with_capacity(send_counts.iter().sum::<usize>() * h);
    for tokens in sent_rows(t, r, indices) {
        for token in tokens {
            rows.extend_from_slice(&d[token * h..(token + 1) * h]);
        }
    }
    let counts: Vec<usize> = send_counts.iter().map(|c| c * h).collect();
    let (received, _) = all_to_all_v_values(comm, &rows, &counts)?;
    let m: usize = recv_counts.iter().sum();
    Tensor::from_f32([m, h], received)
}

/// Backward of [`dispatch`]: the received rows' gradients `d_hidden_states [M, H]` and
/// `d_topk_affinities [M, K]` go back to their sources; a token's hidden-state gradient is the
/// sum of its rows' (ascending rank order) and each affinity gradient comes from the rank that
/// owns that slot's expert. Returns `(d_hidden_states [T, H], d_topk_affinities [T, K])` f32;
/// `expert_index [T, K]` is the forward's (global ids).
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
        let (t, indices, send_counts, recv_counts) = check_route(route, r)?;
        let (index_shape, ids) =
            validate::index_tensor("expert_index", expert_index, "[T, K]", &[Some(t), None])?;
        validate::expert_ids("expert_index", ids, &index_shape, e)?;
        let k = index_shape[1];
        let m: usize = recv_counts.iter().sum();
        let shape = validate::float_tensor(
            "d_hidden_states",
            d_hidden_states,
            "[M, H]",
            &[Some(m), None],
        )?;
        validate::float_tensor(
            "d_topk_affinities",
            d_topk_affinities,
            "[M, K]",
            &[Some(m), Some(k)],
        )?;
        Ok((t, indices, ids, send_counts, recv_counts, shape[1], k))
    })();
    let (t, indices, ids, send_counts, recv_counts, h, k) = agree(comm, local)?;
    let scaled =
        |counts: &[usize], width: usize| counts.iter().map(|c| c * width).collect::<Vec<_>>();
    let (rows, _) = all_to_all_v_values(
        comm,
        &d_hidden_states.f32_values(),
        &scaled(&recv_counts, h),
    )?;
    let (row_affinities, _) = all_to_all_v_values(
        comm,
        &d_topk_affinities.f32_values(),
        &scaled(&recv_counts, k),
    )?;
    let local_experts = e / r;
    let mut d_x = vec![0f32; t * h];
    let mut d_affinities = vec![0f32; t * k];
    let mut offset = 0;
    for (dst, tokens) in sent_rows(t, r, indices).iter().enumerate() {
        for (row, &token) in tokens.iter().enumerate() {
            let at = offset + row;
            for (d, v) in d_x[token * h..(token + 1) * h]
                .iter_mut()
                .zip(&rows[at * h..(at + 1) * h])
            {
                *d += v;
            }
            for slot in 0..k {
                if ids[token * k + slot] as usize / local_experts == dst {
                    d_affinities[token * k + slot] = row_affinities[at * k + slot];
                }
            }
        }
        offset += send_counts[dst];
    }
    Ok((
        Tensor::from_f32([t, h], d_x)?,
        Tensor::from_f32([t, k], d_affinities)?,
    ))
}
