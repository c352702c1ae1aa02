//! The block plan as the blockwise kernels consume it, in nki-library's convention:
//!
//! ```text
//! token_position_to_id [N·B]  i32  the token in each of the N·B block slots: an id in [0, T),
//!                                  or T, the all-zero padding row of hidden_states [T+1, H]
//!                                  (−1 with SkipMode's skip_token, hidden_states [T, H])
//! block_to_expert [N, 1]      i32  the expert in [0, E) whose weights every slot of the block
//!                                  goes through ([N] is accepted too, as nki-library's test
//!                                  generator makes it)
//! ```
//! A block may hold only padding (the unused blocks `permute` appends on expert E−1). Each
//! (token, expert) pair has at most one slot, and every non-zero affinity of a real token has
//! one; blocks need not be ordered by expert.

use super::tensors::blockwise_mm::{BLOCK_TO_EXPERT, TOKEN_POSITION_TO_ID};
use super::{SkipMode, validate};
use crate::error::{Error, Result};
use crate::tensor::Tensor;

/// A validated block plan: borrowed ids, every one checked against T and E.
#[derive(Clone, Copy, Debug)]
pub struct BlockPlan<'a> {
    positions: &'a [i32],
    experts: &'a [i32],
    /// T, real tokens.
    t: usize,
    /// The padding id: T, or −1 with `skip_token`.
    padding: i64,
    /// B, slots per block.
    b: usize,
}

impl<'a> BlockPlan<'a> {
    /// Checks the shapes and ids of `token_position_to_id` and `block_to_expert` for T tokens
    /// and E experts (padding ids as `skip_dma` says), and that no (token, expert) pair has two
    /// slots. Returns the plan and, token-major `[T·E]`, which pairs it covers.
    pub(crate) fn new(
        token_position_to_id: &'a Tensor,
        block_to_expert: &'a Tensor,
        (t, e): (usize, usize),
        skip_dma: SkipMode,
    ) -> Result<(Self, Vec<bool>)> {
        let experts = block_column(block_to_expert)?;
        let n = experts.len();
        let (shape, positions) =
            validate::index_input(&TOKEN_POSITION_TO_ID, token_position_to_id, &[None])?;
        if shape[0] == 0 || shape[0] % n != 0 {
            return Err(Error::shape(
                TOKEN_POSITION_TO_ID.name,
                format!("[N·B] with N = {n} (from block_to_expert) and B ≥ 1"),
                &shape,
            ));
        }
        let plan = Self {
            positions,
            experts,
            t,
            padding: skip_dma.padding_id(t),
            b: shape[0] / n,
        };
        let covered = plan.check(e)?;
        Ok((plan, covered))
    }

    fn check(&self, e: usize) -> Result<Vec<bool>> {
        let t = self.t;
        let mut covered = vec![false; t * e];
        for (block, &expert) in self.experts.iter().enumerate() {
            if expert < 0 || expert as usize >= e {
                return Err(Error::invalid(
                    BLOCK_TO_EXPERT.name,
                    format!("block {block} has expert id {expert}, outside [0, {e})"),
                ));
            }
            let slots = &self.positions[block * self.b..(block + 1) * self.b];
            for (slot, &token) in slots.iter().enumerate() {
                let position = block * self.b + slot;
                if i64::from(token) == self.padding {
                    continue;
                }
                if token < 0 || token as usize >= t {
                    let padding = match self.padding {
                        -1 => "−1 is padding with skip_token".to_owned(),
                        _ => format!("T = {t} is the padding row of hidden_states"),
                    };
                    return Err(Error::invalid(
                        TOKEN_POSITION_TO_ID.name,
                        format!(
                            "position {position} holds token id {token}, outside [0, {t}) and \
                             not the padding id ({padding})"
                        ),
                    ));
                }
                let pair = token as usize * e + expert as usize;
                if std::mem::replace(&mut covered[pair], true) {
                    return Err(Error::invalid(
                        TOKEN_POSITION_TO_ID.name,
                        format!(
                            "token {token} appears twice for expert {expert} (second time at \
                             position {position})"
                        ),
                    ));
                }
            }
        }
        Ok(covered)
    }

    /// The plan of a call [`Self::new`] accepted, rebuilt from its tensors without checking
    /// them again (the caller keeps them unaltered since).
    pub(crate) fn rebuilt(
        token_position_to_id: &'a Tensor,
        block_to_expert: &'a Tensor,
        t: usize,
        skip_dma: SkipMode,
    ) -> Self {
        let positions = token_position_to_id.as_i32().unwrap_or_default();
        let experts = block_to_expert.as_i32().unwrap_or_default();
        Self {
            positions,
            experts,
            t,
            padding: skip_dma.padding_id(t),
            b: positions.len() / experts.len().max(1),
        }
    }

    /// Which (token, expert) pairs have a slot, token-major `[T·E]`, for a plan over E experts.
    pub(crate) fn covered(&self, e: usize) -> Vec<bool> {
        let mut covered = vec![false; self.t * e];
        for (block, &expert) in self.experts.iter().enumerate() {
            for position in block * self.b..(block + 1) * self.b {
                if let Some(token) = self.token(position) {
                    covered[token * e + expert as usize] = true;
                }
            }
        }
        covered
    }

    /// `token_position_to_id [N·B]`: token ids, the padding id (T, or −1) in padding slots.
    pub fn token_position_to_id(&self) -> &'a [i32] {
        self.positions
    }

    /// `block_to_expert [N]`: expert ids in `[0, E)`.
    pub fn block_to_expert(&self) -> &'a [i32] {
        self.experts
    }

    /// N, blocks.
    pub fn blocks(&self) -> usize {
        self.experts.len()
    }

    /// B, slots per block.
    pub fn block_size(&self) -> usize {
        self.b
    }

    /// The expert of `block`, in `[0, E)`.
    pub fn expert(&self, block: usize) -> usize {
        self.experts[block] as usize
    }

    /// The token in slot `position` (`n·B + j`), or `None` for padding.
    pub fn token(&self, position: usize) -> Option<usize> {
        let token = self.positions[position];
        (i64::from(token) != self.padding).then_some(token as usize)
    }

    /// `(position, token)` of every real (non-padding) slot of `block`, in slot order.
    pub fn real_slots(&self, block: usize) -> impl Iterator<Item = (usize, usize)> + '_ {
        (block * self.b..(block + 1) * self.b)
            .filter_map(move |position| self.token(position).map(|token| (position, token)))
    }
}

/// The ids of `block_to_expert`, `[N, 1]` or `[N]` with N ≥ 1.
fn block_column(block_to_expert: &Tensor) -> Result<&[i32]> {
    let Some(ids) = block_to_expert.as_i32() else {
        return Err(Error::DType {
            tensor: BLOCK_TO_EXPERT.name.to_owned(),
            expected: "i32".to_owned(),
            actual: block_to_expert.dtype(),
        });
    };
    match *block_to_expert.shape() {
        [n, 1] | [n] if n > 0 => Ok(ids),
        _ => Err(Error::shape(
            BLOCK_TO_EXPERT.name,
            "[N, 1] (or [N]) with N ≥ 1",
            block_to_expert.shape(),
        )),
    }
}
