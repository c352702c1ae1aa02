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
use moekit_tools::torch::borrow_as_tch;
use tch::Tensor;

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
                        propagate(&[(source, grad)])?;
                    }
                }
                Entry::Kernel(kernel) => {
                    let grad = kernel.output().grad();
                    if grad.defined() {
                        propagate_kernel_gradients(&kernel.backward(&grad)?)?;
                    }
                }
            }
        }
        Ok(())
    }
}

/// [`propagate`] for gradients a kernel computed, read in place.
fn propagate_kernel_gradients(pairs: &[(Tensor, moekit::Tensor)]) -> Result<()> {
    let borrowed: Vec<(Tensor, Tensor)> = pairs
        .iter()
        .map(|(input, grad)| {
            // SAFETY: `propagate` only reads the gradients into new tensors: the sum into a
            // `.grad`, or the product `input · gradient`, whose graph autograd frees when its
            // backward returns and which is dropped with `propagate`'s locals. So no libtorch
            // tensor holds this memory once `borrowed` is dropped, at the end of this function,
            // while `pairs` still owns it.
            let grad = unsafe { borrow_as_tch(grad) };
            let grad = grad.to_kind(input.kind()).to_device(input.device());
            (input.shallow_clone(), grad)
        })
        .collect();
    propagate(&borrowed)
}

/// Sends each gradient into its tensor's graph. A leaf whose `.grad` already exists (every
/// parameter after its first step) gets the gradient added in place; the others receive it
/// through the backward of `Σ (tensor · gradient).sum()`, whose gradient with respect to each
/// tensor is exactly its given gradient.
fn propagate(pairs: &[(Tensor, Tensor)]) -> Result<()> {
    let mut terms = Vec::new();
    for (tensor, grad) in pairs.iter().filter(|(tensor, _)| tensor.requires_grad()) {
        let mut accumulated = match tensor.is_leaf() {
            true => Some(tensor.grad()).filter(Tensor::defined),
            false => None,
        };
        match &mut accumulated {
            Some(accumulated) => drop(tch::no_grad(|| accumulated.f_add_(grad))?),
            None => terms.push((tensor * grad).sum(tch::Kind::Float)),
        }
    }
    if let Some(surrogate) = terms.into_iter().reduce(|a, b| a + b) {
        surrogate.f_backward()?;
    }
    Ok(())
}
