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

use std::ffi::{CStr, c_void};

use anyhow::{Result, bail};
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

/// [`propagate`] for gradients a kernel computed, read in place: a leaf whose `.grad` already
/// exists (every parameter after its first step) gets its gradient added into it; the others'
/// gradients are copied into libtorch's memory first, since autograd may keep a gradient it
/// is given (as a leaf's `.grad`, or a view of it).
fn propagate_kernel_gradients(pairs: &[(Tensor, moekit::Tensor)]) -> Result<()> {
    let mut owned = Vec::new();
    for (input, grad) in pairs.iter().filter(|(input, _)| input.requires_grad()) {
        // SAFETY: the borrowed gradient is read only, by the sum into a `.grad` or by a copy,
        // and dropped at the end of this iteration, while `pairs` still owns its memory; no
        // libtorch tensor shares its storage afterwards (`to_kind`/`to_device` give new
        // tensors or the borrowed one, which `copy` replaces).
        let borrowed = unsafe { borrow_as_tch(grad) };
        let grad = borrowed.to_kind(input.kind()).to_device(input.device());
        let accumulated = input
            .is_leaf()
            .then(|| input.grad())
            .filter(Tensor::defined);
        match accumulated {
            Some(mut accumulated) => drop(tch::no_grad(|| accumulated.f_add_(&grad))?),
            None if grad.data_ptr() == borrowed.data_ptr() => {
                owned.push((input.shallow_clone(), grad.copy()));
            }
            None => owned.push((input.shallow_clone(), grad)),
        }
    }
    propagate(&owned)
}

/// Sends each gradient into its tensor's graph, in one backward pass: `autograd::backward` from
/// the given gradients, which accumulates into the `.grad` of the leaves the graphs reach
/// (a gradient autograd keeps, as a `.grad`, stays valid: it is a libtorch tensor).
fn propagate(pairs: &[(Tensor, Tensor)]) -> Result<()> {
    let (tensors, grads): (Vec<_>, Vec<_>) = pairs
        .iter()
        .filter(|(tensor, _)| tensor.requires_grad())
        .map(|(tensor, grad)| {
            (
                tensor.as_ptr().cast::<c_void>(),
                grad.as_ptr().cast::<c_void>(),
            )
        })
        .unzip();
    if tensors.is_empty() {
        return Ok(());
    }
    let count = libc::c_int::try_from(tensors.len())?;
    // SAFETY: both arrays hold `count` pointers to live `tch` tensors (`at::Tensor *`), borrowed
    // from `pairs` for the call, which only reads them.
    let error = unsafe { moekit_autograd_backward(tensors.as_ptr(), grads.as_ptr(), count) };
    if error.is_null() {
        return Ok(());
    }
    // SAFETY: a non-null result is a NUL-terminated message from `strdup`, ours to free.
    let message = unsafe { CStr::from_ptr(error) }
        .to_string_lossy()
        .into_owned();
    // SAFETY: `error` came from `strdup` and is freed once.
    unsafe { libc::free(error.cast()) };
    bail!("backpropagating from given gradients: {message}")
}

unsafe extern "C" {
    /// `csrc/autograd.cpp`: `torch::autograd::backward(tensors[..n], grads[..n])` for `tch`
    /// tensors (`at::Tensor *`); null, or libtorch's error message (freed with `free`).
    fn moekit_autograd_backward(
        tensors: *const *const c_void,
        grads: *const *const c_void,
        n: libc::c_int,
    ) -> *mut libc::c_char;
}

#[cfg(test)]
mod tests {
    use tch::{Device, Kind};

    use super::*;

    fn leaf(values: &[f32]) -> Tensor {
        Tensor::from_slice(values).set_requires_grad(true)
    }

    fn values(tensor: &Tensor) -> Vec<f32> {
        Vec::<f32>::try_from(tensor).expect("an f32 tensor")
    }

    #[test]
    fn given_gradients_reach_the_leaves_as_autograd_sends_them() {
        // y = x², z = 3·x: d/dx (g·y + h·z) = 2x·g + 3h, by hand.
        let x = leaf(&[1.0, -2.0, 0.5]);
        let (g, h) = ([0.25f32, 1.0, -4.0], [2.0f32, 0.0, 1.0]);
        let y = &x * &x;
        let z = &x * 3.0;
        propagate(&[(y, Tensor::from_slice(&g)), (z, Tensor::from_slice(&h))]).unwrap();
        let want: Vec<f32> = [1.0f32, -2.0, 0.5]
            .iter()
            .zip(g.iter().zip(&h))
            .map(|(x, (g, h))| 2.0 * x * g + 3.0 * h)
            .collect();
        assert_eq!(values(&x.grad()), want);
    }

    #[test]
    fn a_gradient_of_the_wrong_shape_is_an_error_naming_the_shapes() {
        let x = leaf(&[1.0, 2.0]);
        let y = &x * 2.0;
        let error = propagate(&[(y, Tensor::ones([3], (Kind::Float, Device::Cpu)))])
            .expect_err("a [3] gradient for a [2] tensor")
            .to_string();
        assert!(
            error.contains("backpropagating from given gradients"),
            "{error}"
        );
        assert!(error.contains('3') && error.contains('2'), "{error}");
    }

    #[test]
    fn kernel_gradients_are_added_into_existing_grads_and_copied_into_new_ones() {
        let (with_grad, without_grad) = (leaf(&[1.0, 2.0]), leaf(&[3.0, 4.0]));
        // A `.grad` that exists already, as a parameter's after its first step.
        (&with_grad * 1.0).sum(Kind::Float).backward();
        // A non-leaf: its gradient flows through `·2` into `without_grad`.
        let doubled = &without_grad * 2.0;
        {
            let gradients = [
                moekit::Tensor::from_f32([2], vec![0.5, -1.0]).unwrap(),
                moekit::Tensor::from_f32([2], vec![10.0, 20.0]).unwrap(),
            ];
            let pairs = [
                (with_grad.shallow_clone(), gradients[0].clone()),
                (doubled, gradients[1].clone()),
            ];
            propagate_kernel_gradients(&pairs).unwrap();
        }
        // The kernel's gradients are dropped; the grads hold their values.
        assert_eq!(values(&with_grad.grad()), [1.5, 0.0]);
        assert_eq!(values(&without_grad.grad()), [20.0, 40.0]);
        let leaf_without_grad = leaf(&[5.0]);
        {
            let gradient = moekit::Tensor::from_f32([1], vec![7.0]).unwrap();
            propagate_kernel_gradients(&[(leaf_without_grad.shallow_clone(), gradient)]).unwrap();
        }
        assert_eq!(values(&leaf_without_grad.grad()), [7.0]);
    }
}
