//! Stitching kernels that run outside autograd into libtorch's backward pass.
//!
//! A kernel's output enters the graph as a fresh leaf; its backward, run by [`Tape::backward`]
//! once that leaf's gradient is complete, returns `(tensor, gradient)` pairs through which
//! autograd continues (the kernel's inputs and weights). To keep every graph node traversed
//! exactly once, the model [cuts](Tape::cut) the residual stream before each such kernel:
//! the graph between two cuts is backpropagated by one call, in reverse order of recording.
//!
//! A tensor that feeds both a kernel and another consumer must be cut too (the MoE block cuts
//! its input and its router logits), since no graph node may be reached from two backward calls.
//!
//! Why the order is right: a tensor recorded at position p is consumed only by operations after
//! p, and those operations' graphs end at later cuts, later kernels or the loss, all of which
//! are backpropagated before p.

use anyhow::Result;
use tch::Tensor;

use crate::shim;

/// Whether a kernel run outside autograd on `inputs` must record its backward: libtorch
/// records gradients here (not inside `tch::no_grad`) and one of `inputs` requires grad.
pub fn needs_backward(inputs: &[&Tensor]) -> bool {
    grad_enabled() && inputs.iter().any(|t| t.requires_grad())
}

/// Whether libtorch records gradients here. `tch` exposes no query of the grad mode; an
/// operation's result requires grad exactly when the mode is on and one of its inputs requires
/// grad, so one scalar operation tells.
fn grad_enabled() -> bool {
    let probe = Tensor::zeros([], (tch::Kind::Float, tch::Device::Cpu)).set_requires_grad(true);
    (&probe + 0.0).requires_grad()
}

/// The backward of a kernel run outside autograd.
pub trait ExternalBackward {
    /// The leaf that stands for the kernel's output in the graph.
    fn output(&self) -> &Tensor;
    /// Given the gradient of [`Self::output`], the gradients of the kernel's differentiable
    /// inputs, as `(input, gradient)` pairs with matching shapes. libtorch reads the gradients
    /// where the kernel wrote them (converted only when the input's dtype differs).
    fn backward(&self, output_grad: &Tensor) -> Result<Vec<(Tensor, moekit::Tensor)>>;
}

enum Entry {
    /// `leaf` is a detached copy of `source` that requires grad.
    Cut {
        source: Tensor,
        leaf: Tensor,
    },
    Kernel(Box<dyn ExternalBackward>),
}

/// The kernels and graph cuts of one forward pass, in order of recording.
pub struct Tape {
    cuts: bool,
    entries: Vec<Entry>,
}

impl Tape {
    /// A tape that cuts the graph where asked when `cuts` is true; with `false`, [`Self::cut`]
    /// is the identity (for forward passes that are all autograd).
    pub fn new(cuts: bool) -> Self {
        Self {
            cuts,
            entries: Vec::new(),
        }
    }

    /// Cuts the graph at `tensor`: returns a leaf with its value whose gradient is sent into
    /// `tensor`'s graph during [`Self::backward`]. The identity on a tape without cuts.
    pub fn cut(&mut self, tensor: Tensor) -> Tensor {
        if !self.cuts || !tensor.requires_grad() {
            return tensor;
        }
        let leaf = tensor.detach().set_requires_grad(true);
        self.entries.push(Entry::Cut {
            source: tensor,
            leaf: leaf.shallow_clone(),
        });
        leaf
    }

    /// Records a kernel whose output leaf is already in the graph.
    pub fn record(&mut self, kernel: Box<dyn ExternalBackward>) {
        self.entries.push(Entry::Kernel(kernel));
    }

    /// Backpropagates `loss` (a scalar) through the autograd graph and every recorded kernel,
    /// accumulating into the `.grad` of the leaves, as `loss.backward()` does for a graph that
    /// is all autograd.
    pub fn backward(self, loss: &Tensor) -> Result<()> {
        loss.f_backward()?;
        for entry in self.entries.into_iter().rev() {
            match entry {
                Entry::Cut { source, leaf } => {
                    let grad = leaf.grad();
                    if grad.defined() {
                        shim::backward(vec![(source, grad)])?;
                    }
                }
                Entry::Kernel(kernel) => {
                    let grad = kernel.output().grad();
                    if grad.defined() {
                        propagate_kernel_gradients(kernel.backward(&grad)?)?;
                    }
                }
            }
        }
        Ok(())
    }
}

/// Sends the gradients a kernel computed into the graph, taking them without a copy where
/// libtorch can own their memory: a leaf whose `.grad` exists (a parameter whose gradient has
/// another contribution already) gets its gradient added into it; a leaf without one gets the
/// kernel's memory as its `.grad` (every parameter fed by a kernel, after `zero_grad` releases
/// the gradients); any other tensor's gradient goes through autograd from there.
fn propagate_kernel_gradients(pairs: Vec<(Tensor, moekit::Tensor)>) -> Result<()> {
    let mut through_graph = Vec::new();
    for (input, grad) in pairs {
        if !input.requires_grad() {
            continue;
        }
        let grad = shim::into_tch(grad)?
            .to_kind(input.kind())
            .to_device(input.device());
        if !input.is_leaf() {
            through_graph.push((input, grad));
            continue;
        }
        let mut accumulated = input.grad();
        if accumulated.defined() {
            drop(tch::no_grad(|| accumulated.f_add_(&grad))?);
        } else {
            shim::set_grad(&input, grad)?;
        }
    }
    shim::backward(through_graph)
}

#[cfg(test)]
mod tests {
    use tch::Kind;

    use super::*;
    use crate::shim::tests::{leaf, values};

    #[test]
    fn kernel_gradients_are_added_into_existing_grads_handed_to_new_ones_and_sent_on() {
        let (with_grad, without_grad) = (leaf(&[1.0, 2.0]), leaf(&[3.0, 4.0]));
        // A `.grad` that exists already, as a parameter's after another contribution.
        (&with_grad * 1.0).sum(Kind::Float).backward();
        // A non-leaf: its gradient flows through `·2` into `without_grad`.
        let doubled = &without_grad * 2.0;
        let fresh = leaf(&[5.0]);
        let handed = vec![7.0f32];
        let handed_at = handed.as_ptr();
        let pairs = vec![
            (
                with_grad.shallow_clone(),
                moekit::Tensor::from_f32([2], vec![0.5, -1.0]).unwrap(),
            ),
            (
                doubled,
                moekit::Tensor::from_f32([2], vec![10.0, 20.0]).unwrap(),
            ),
            (
                fresh.shallow_clone(),
                moekit::Tensor::from_f32([1], handed).unwrap(),
            ),
        ];
        propagate_kernel_gradients(pairs).unwrap();
        assert_eq!(values(&with_grad.grad()), [1.5, 0.0]);
        assert_eq!(values(&without_grad.grad()), [20.0, 40.0]);
        // The leaf without a gradient holds the kernel's memory itself.
        assert_eq!(values(&fresh.grad()), [7.0]);
        assert_eq!(
            fresh.grad().data_ptr().cast_const().cast::<f32>(),
            handed_at
        );
    }
}
