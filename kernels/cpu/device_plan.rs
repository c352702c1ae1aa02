//! `find_nonzero_indices` and `indexed_flatten` on the cpu backend.
//!
//! The search reads `input_tensor [T, C_full]` row by row in chunks of [`ROWS_PER_TASK`] rows,
//! one task each listing its nonzero rows per column, and joins the lists in chunk order. The
//! flatten finds each output block's last writer (a pass over the rows' block offsets), then
//! fills the blocks in parallel.

use rayon::prelude::*;

use crate::contracts::{FindNonzeroIndices, FindNonzeroIndicesDims, IndexedFlatten};
use crate::error::Result;
use crate::tensor::try_filled;

/// Rows of `input_tensor` per search task.
const ROWS_PER_TASK: usize = 2048;

/// Each searched column's nonzero rows, ascending.
pub(super) fn nonzero_rows(call: &FindNonzeroIndices<'_>) -> Vec<Vec<i32>> {
    let FindNonzeroIndicesDims {
        t,
        c_full,
        first,
        c,
    } = call.dims();
    let nonzero = call.nonzero();
    let chunks: Vec<Vec<Vec<i32>>> = (0..t.div_ceil(ROWS_PER_TASK))
        .into_par_iter()
        .map(|chunk| {
            let mut columns = vec![Vec::new(); c];
            for row in chunk * ROWS_PER_TASK..t.min((chunk + 1) * ROWS_PER_TASK) {
                for (col, rows) in columns.iter_mut().enumerate() {
                    if nonzero(row * c_full + first + col) {
                        rows.push(row as i32);
                    }
                }
            }
            columns
        })
        .collect();
    (0..c)
        .map(|col| {
            chunks
                .iter()
                .flat_map(|columns| columns[col].iter().copied())
                .collect()
        })
        .collect()
}

/// `flattened_array`: each output block copied from its last writer, or `padding`.
pub(super) fn flattened<T: Copy + Send + Sync>(
    call: &IndexedFlatten<'_>,
    input: &[T],
    padding: T,
) -> Result<Vec<T>> {
    let dims = call.dims();
    let (blocks_per_row, blocks) = (dims.t / dims.f_len, dims.output_len / dims.f_len);
    let mut out = call.padded(padding)?;
    // owner[b]: the input block (row·blocks_per_row + p) written last to output block b.
    let mut owner = try_filled("indexed_flatten's block sources", &[blocks], usize::MAX)?;
    for (row, &offset) in call.offsets().iter().enumerate() {
        // The blocks of this row that land in the output.
        let first = offset.clamp(0, blocks as i64);
        let last = (offset + blocks_per_row as i64).clamp(0, blocks as i64);
        for block in first..last {
            owner[block as usize] = row * blocks_per_row + (block - offset) as usize;
        }
    }
    out.par_chunks_mut(dims.f_len)
        .zip(owner.par_iter())
        .for_each(|(block, &source)| {
            if source != usize::MAX {
                let from = source * dims.f_len;
                block.copy_from_slice(&input[from..from + dims.f_len]);
            }
        });
    Ok(out)
}
