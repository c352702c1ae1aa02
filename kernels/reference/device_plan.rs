//! `find_nonzero_indices` and `indexed_flatten` by their definitions: each column searched
//! row by row; each row's blocks written in ascending row order over the padding.

use crate::contracts::{FindNonzeroIndices, FindNonzeroIndicesDims, IndexedFlatten};
use crate::error::Result;

/// Each searched column's nonzero rows, ascending.
pub fn nonzero_rows(call: &FindNonzeroIndices<'_>) -> Vec<Vec<i32>> {
    let FindNonzeroIndicesDims {
        t,
        c_full,
        first,
        c,
    } = call.dims();
    let nonzero = call.nonzero();
    (0..c)
        .map(|col| {
            (0..t)
                .filter(|&row| nonzero(row * c_full + first + col))
                .map(|row| row as i32)
                .collect()
        })
        .collect()
}

/// `flattened_array`: `padding` everywhere, then row e's block p at output block
/// `offsets[e] + p` where that lies in the output, rows in ascending order.
pub fn flattened<T: Copy>(call: &IndexedFlatten<'_>, input: &[T], padding: T) -> Result<Vec<T>> {
    let dims = call.dims();
    let mut out = call.padded(padding)?;
    let (blocks_per_row, blocks) = (dims.t / dims.f_len, dims.output_len / dims.f_len);
    for (row, &offset) in call.offsets().iter().enumerate() {
        for p in 0..blocks_per_row {
            let block = offset + p as i64;
            if (0..blocks as i64).contains(&block) {
                let (to, from) = (block as usize * dims.f_len, (row * dims.t) + p * dims.f_len);
                out[to..to + dims.f_len].copy_from_slice(&input[from..from + dims.f_len]);
            }
        }
    }
    Ok(out)
}
