//! The expert-parallel routing table on the CPU: one pass over the tokens, each token appended
//! once to the column of every rank holding one of its experts. O(T·K + T·EP).

use crate::contracts::spec::output;
use crate::contracts::tensors::a2av_routing as a2;
use crate::contracts::{A2avRouting, A2avRoutingOutputs, SKIP};
use crate::error::Result;
use crate::tensor::{Tensor, try_filled};

pub(super) fn forward(call: &A2avRouting<'_>) -> Result<A2avRoutingOutputs> {
    let dims = call.dims();
    let (t, k, ranks) = (dims.t, dims.k, dims.ranks);
    let ids = call.expert_ids();
    let mut send_indices = try_filled(&output(&a2::SEND_INDICES), &[t, ranks], t as i32)?;
    let mut counts = vec![0usize; ranks];
    // The last token each rank received, so a token goes to a rank once however many of its
    // experts live there.
    let mut last_token = vec![usize::MAX; ranks];
    for (token, row) in ids.chunks_exact(k).enumerate() {
        for &id in row.iter().filter(|&&id| id != SKIP) {
            let rank = dims.rank_of(id as usize);
            if last_token[rank] != token {
                last_token[rank] = token;
                send_indices[counts[rank] * ranks + rank] = token as i32;
                counts[rank] += 1;
            }
        }
    }
    Ok(A2avRoutingOutputs {
        send_indices: Tensor::from_i32([t, ranks], send_indices)?,
        // Counts are at most T, which validation keeps within i32.
        send_counts: Tensor::from_i32([1, ranks], counts.iter().map(|&c| c as i32).collect())?,
    })
}
