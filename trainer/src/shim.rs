//! What the trainer needs from libtorch that `tch` does not expose, through the small C++ shim
//! `csrc/shim.cpp` built against the same libtorch: backpropagation from given gradients,
//! kernel results handed to libtorch without a copy, a leaf's `.grad` set or released
//! without autograd, and AdamW's fused update.

use std::ffi::{CStr, c_char, c_int, c_void};

use anyhow::{Context, Result, bail, ensure};
use moekit::tensor::Storage;
use tch::Tensor;

/// Backpropagates each gradient into its tensor's graph, in one backward pass:
/// `torch::autograd::backward(tensors, gradients)`, which accumulates into the `.grad` of the
/// leaves the graphs reach. The gradients are taken (autograd may keep one as a leaf's `.grad`
/// without a copy when it holds the only reference).
pub fn backward(pairs: Vec<(Tensor, Tensor)>) -> Result<()> {
    let (tensors, grads): (Vec<_>, Vec<_>) = pairs
        .into_iter()
        .filter(|(tensor, _)| tensor.requires_grad())
        .unzip();
    if tensors.is_empty() {
        return Ok(());
    }
    let count = c_int::try_from(tensors.len())?;
    let roots: Vec<*const c_void> = tensors.iter().map(|t| t.as_ptr().cast()).collect();
    let seeds: Vec<*mut c_void> = grads.iter().map(|g| g.as_ptr().cast_mut().cast()).collect();
    // SAFETY: both arrays hold `count` pointers to live `tch` tensors (`at::Tensor *`); the shim
    // reads the roots and moves out of the seeds, whose wrappers (in `grads`) then hold
    // undefined tensors, which are dropped below without further use.
    let error = unsafe { moekit_autograd_backward(roots.as_ptr(), seeds.as_ptr(), count) };
    drop(grads);
    checked(error).context("backpropagating from given gradients")
}

/// `tensor` as a libtorch tensor over the same memory, which libtorch owns from here (and
/// frees through moekit's allocator when its storage dies): a kernel's result enters the graph
/// without a copy. Lent memory (a buffer moekit reads from libtorch) is copied first.
pub fn into_tch(tensor: moekit::Tensor) -> Result<Tensor> {
    let sizes = tensor
        .shape()
        .iter()
        .map(|&extent| i64::try_from(extent))
        .collect::<std::result::Result<Vec<i64>, _>>()?;
    match tensor.into_storage() {
        Storage::F32(values) => hand_over(values.into_vec(), &sizes, 0),
        Storage::BF16(values) => hand_over(values.into_vec(), &sizes, 1),
        Storage::I32(values) => hand_over(values.into_vec(), &sizes, 2),
    }
}

/// A libtorch tensor of `sizes` that owns `values` (`dtype` as the shim numbers them).
fn hand_over<T: Send + 'static>(values: Vec<T>, sizes: &[i64], dtype: c_int) -> Result<Tensor> {
    let numel = sizes.iter().map(|&d| d as usize).product::<usize>();
    ensure!(
        numel == values.len(),
        "{} elements for a tensor of shape {sizes:?}",
        values.len()
    );
    let mut values = Box::new(values);
    let data = values.as_mut_ptr().cast::<c_void>();
    let context = Box::into_raw(values).cast::<c_void>();
    let mut tensor: *mut c_void = std::ptr::null_mut();
    // SAFETY: `data` points at the `numel` elements of the vector that `context` owns, which
    // `release::<T>` frees once, when libtorch drops the storage; `sizes` holds `ndim` extents
    // whose product is that length (checked above).
    let error = unsafe {
        moekit_tensor_from_owned(
            data,
            sizes.as_ptr(),
            c_int::try_from(sizes.len())?,
            dtype,
            release::<T>,
            context,
            &mut tensor,
        )
    };
    // On an error the vector is leaked rather than risk freeing it twice (the shim's contract);
    // the shapes checked above leave libtorch nothing to refuse.
    checked(error).context("handing a kernel's result to libtorch")?;
    // SAFETY: the shim returned a new `at::Tensor *` that nothing else owns.
    Ok(unsafe { Tensor::from_ptr(tensor.cast()) })
}

/// Frees the vector that [`hand_over`] gave libtorch.
extern "C" fn release<T>(context: *mut c_void) {
    // SAFETY: `context` came from `Box::into_raw` of a `Box<Vec<T>>` in `hand_over`, and
    // libtorch calls the deleter once.
    drop(unsafe { Box::from_raw(context.cast::<Vec<T>>()) });
}

/// Sets the `.grad` of the leaf `leaf` (which has none) to `grad`, taken as it is: what
/// autograd does on reaching such a leaf with the only reference to its gradient.
pub fn set_grad(leaf: &Tensor, grad: Tensor) -> Result<()> {
    ensure!(
        leaf.is_leaf() && !leaf.grad().defined(),
        "set_grad: a leaf without a gradient"
    );
    ensure!(
        leaf.size() == grad.size() && leaf.kind() == grad.kind() && leaf.device() == grad.device(),
        "a gradient of shape {:?} ({:?} on {:?}) for a tensor of shape {:?} ({:?} on {:?})",
        grad.size(),
        grad.kind(),
        grad.device(),
        leaf.size(),
        leaf.kind(),
        leaf.device()
    );
    // SAFETY: both are live `tch` tensors; the shim moves out of `grad`, whose wrapper is then
    // dropped holding an undefined tensor.
    let error = unsafe {
        moekit_set_grad(
            leaf.as_ptr().cast_mut().cast(),
            grad.as_ptr().cast_mut().cast(),
        )
    };
    drop(grad);
    checked(error).context("setting a leaf's gradient")
}

/// Drops the `.grad` of `tensor` (PyTorch's `zero_grad(set_to_none=True)`).
pub fn release_grad(tensor: &Tensor) -> Result<()> {
    // SAFETY: a live `tch` tensor, whose gradient the shim resets.
    let error = unsafe { moekit_release_grad(tensor.as_ptr().cast_mut().cast()) };
    checked(error).context("releasing a gradient")
}

/// One AdamW update (`torch.optim.AdamW(fused=True)`, `amsgrad=False`) of every
/// `[param, grad, exp_avg, exp_avg_sq]` in `updates`, at the 1-based step count held by the f32
/// scalar `step` (libtorch's `_fused_adamw_`, which reads it as an integer), learning rate
/// `lr` and `torch.optim.AdamW`'s `betas`, `weight_decay` and `eps`: each parameter and its
/// moments in one pass, instead of one pass per elementwise op. The four tensors of an update
/// share shape, dtype and device, and are contiguous.
pub fn fused_adamw(
    updates: &[[&Tensor; 4]],
    step: &Tensor,
    lr: f64,
    [beta1, beta2]: [f64; 2],
    weight_decay: f64,
    eps: f64,
) -> Result<()> {
    const ROLES: [&str; 4] = ["parameter", "gradient", "exp_avg", "exp_avg_sq"];
    ensure!(
        step.dim() == 0 && step.kind() == tch::Kind::Float,
        "the step count is an f32 scalar, not {:?} of shape {:?}",
        step.kind(),
        step.size()
    );
    for (index, update) in updates.iter().enumerate() {
        let [param, ..] = update;
        for (role, tensor) in ROLES.iter().zip(update) {
            ensure!(
                tensor.size() == param.size()
                    && tensor.kind() == param.kind()
                    && tensor.device() == param.device()
                    && tensor.is_contiguous(),
                "AdamW update {index}: the {role} is {:?} {:?} on {:?} (contiguous: {}), \
                 the parameter {:?} {:?} on {:?}",
                tensor.kind(),
                tensor.size(),
                tensor.device(),
                tensor.is_contiguous(),
                param.kind(),
                param.size(),
                param.device()
            );
        }
        ensure!(
            step.device() == param.device(),
            "AdamW update {index}: the step count is on {:?}, the parameter on {:?}",
            step.device(),
            param.device()
        );
    }
    if updates.is_empty() {
        return Ok(());
    }
    let role = |role: usize| -> Vec<*mut c_void> {
        updates
            .iter()
            .map(|update| update[role].as_ptr().cast_mut().cast())
            .collect()
    };
    let [params, grads, exp_avgs, exp_avg_sqs] = [0, 1, 2, 3].map(role);
    // SAFETY: each array holds `updates.len()` pointers to live `tch` tensors, checked above to
    // match as the shim requires; the shim updates them in place and keeps no reference.
    let error = unsafe {
        moekit_fused_adamw(
            params.as_ptr(),
            grads.as_ptr(),
            exp_avgs.as_ptr(),
            exp_avg_sqs.as_ptr(),
            step.as_ptr().cast(),
            c_int::try_from(updates.len())?,
            lr,
            beta1,
            beta2,
            weight_decay,
            eps,
        )
    };
    checked(error).context("AdamW's fused update")
}

/// `Ok` for a null result of the shim, else its message (which this frees) as the error.
fn checked(error: *mut c_char) -> Result<()> {
    if error.is_null() {
        return Ok(());
    }
    // SAFETY: a non-null result is a NUL-terminated message from `strdup`, ours to free.
    let message = unsafe { CStr::from_ptr(error) }
        .to_string_lossy()
        .into_owned();
    // SAFETY: `error` came from `strdup` and is freed once.
    unsafe { libc::free(error.cast()) };
    bail!("{message}")
}

unsafe extern "C" {
    /// `torch::autograd::backward(tensors[..n], grads[..n])`, moving out of each `*grads[i]`.
    fn moekit_autograd_backward(
        tensors: *const *const c_void,
        grads: *const *mut c_void,
        n: c_int,
    ) -> *mut c_char;
    /// A new CPU `at::Tensor *` in `*out` that owns `data` and calls `release(context)` when
    /// its storage dies.
    fn moekit_tensor_from_owned(
        data: *mut c_void,
        sizes: *const i64,
        ndim: c_int,
        dtype: c_int,
        release: extern "C" fn(*mut c_void),
        context: *mut c_void,
        out: *mut *mut c_void,
    ) -> *mut c_char;
    /// `tensor->mutable_grad() = std::move(*grad)`.
    fn moekit_set_grad(tensor: *mut c_void, grad: *mut c_void) -> *mut c_char;
    /// `tensor->mutable_grad().reset()`.
    fn moekit_release_grad(tensor: *mut c_void) -> *mut c_char;
    /// `at::_fused_adamw_` over `n` parameters, gradients and moments, at step `*step`.
    #[allow(clippy::too_many_arguments)]
    fn moekit_fused_adamw(
        params: *const *mut c_void,
        grads: *const *mut c_void,
        exp_avgs: *const *mut c_void,
        exp_avg_sqs: *const *mut c_void,
        step: *const c_void,
        n: c_int,
        lr: f64,
        beta1: f64,
        beta2: f64,
        weight_decay: f64,
        eps: f64,
    ) -> *mut c_char;
}

#[cfg(test)]
pub(crate) mod tests {
    use tch::{Device, Kind};

    use super::*;

    /// A leaf of `values` that requires grad.
    pub(crate) fn leaf(values: &[f32]) -> Tensor {
        Tensor::from_slice(values).set_requires_grad(true)
    }

    /// An f32 tensor's elements.
    pub(crate) fn values(tensor: &Tensor) -> Vec<f32> {
        Vec::<f32>::try_from(tensor).expect("an f32 tensor")
    }

    #[test]
    fn given_gradients_reach_the_leaves_as_autograd_sends_them() {
        // y = x², z = 3·x: d/dx (g·y + h·z) = 2x·g + 3h, by hand.
        let x = leaf(&[1.0, -2.0, 0.5]);
        let (g, h) = ([0.25f32, 1.0, -4.0], [2.0f32, 0.0, 1.0]);
        let y = &x * &x;
        let z = &x * 3.0;
        backward(vec![
            (y, Tensor::from_slice(&g)),
            (z, Tensor::from_slice(&h)),
        ])
        .unwrap();
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
        let error = backward(vec![(y, Tensor::ones([3], (Kind::Float, Device::Cpu)))])
            .expect_err("a [3] gradient for a [2] tensor");
        let error = format!("{error:#}");
        assert!(
            error.contains("backpropagating from given gradients"),
            "{error}"
        );
        assert!(error.contains('3') && error.contains('2'), "{error}");
    }

    #[test]
    fn a_handed_over_result_is_the_kernels_memory_and_outlives_the_kernels_tensor() {
        let written: Vec<f32> = (0..6).map(|i| i as f32 * 0.5).collect();
        let start = written.as_ptr();
        let kernel = moekit::Tensor::from_f32([2, 3], written).unwrap();
        let mut handed = into_tch(kernel).unwrap();
        assert_eq!(handed.size(), [2, 3]);
        assert_eq!(
            handed.data_ptr().cast_const().cast::<f32>(),
            start,
            "no copy"
        );
        // libtorch owns the memory now: it writes it, views keep it alive past the tensor.
        let _ = handed.g_mul_scalar_(2.0);
        let row = handed.select(0, 1);
        drop(handed);
        assert_eq!(values(&row), [3.0, 4.0, 5.0]);
        let ids = into_tch(moekit::Tensor::from_i32([2], vec![7, -1]).unwrap()).unwrap();
        assert_eq!(Vec::<i32>::try_from(&ids).unwrap(), [7, -1]);
    }

    #[test]
    fn libtorch_frees_handed_over_memory_once_when_the_last_view_dies() {
        use std::sync::atomic::{AtomicUsize, Ordering};
        static DROPPED: AtomicUsize = AtomicUsize::new(0);
        /// An f32 that counts its drops: laid out as f32, so libtorch reads it as one.
        #[repr(transparent)]
        struct Counted(#[allow(dead_code)] f32);
        impl Drop for Counted {
            fn drop(&mut self) {
                DROPPED.fetch_add(1, Ordering::SeqCst);
            }
        }
        let handed = hand_over((0..4).map(|i| Counted(i as f32)).collect(), &[4], 0).unwrap();
        let view = handed.narrow(0, 1, 2);
        drop(handed);
        assert_eq!(
            DROPPED.load(Ordering::SeqCst),
            0,
            "a view still holds the storage"
        );
        assert_eq!(values(&view), [1.0, 2.0]);
        drop(view);
        assert_eq!(
            DROPPED.load(Ordering::SeqCst),
            4,
            "every element dropped once"
        );
        let refused = hand_over(vec![Counted(0.0)], &[2], 0).unwrap_err();
        assert!(refused.to_string().contains("[2]"), "{refused}");
    }

    #[test]
    fn a_set_gradient_is_the_given_tensor_and_a_released_one_is_gone() {
        let x = leaf(&[1.0, 2.0]);
        let grad = Tensor::from_slice(&[0.5f32, -1.0]);
        let start = grad.data_ptr();
        set_grad(&x, grad).unwrap();
        assert_eq!(x.grad().data_ptr(), start, "taken, not copied");
        assert_eq!(values(&x.grad()), [0.5, -1.0]);
        // A second gradient would have to be added: refused.
        let again = set_grad(&x, Tensor::from_slice(&[1.0f32, 1.0]));
        assert!(again.is_err());
        release_grad(&x).unwrap();
        assert!(!x.grad().defined());
        let wrong = set_grad(&x, Tensor::from_slice(&[1.0f32, 2.0, 3.0])).unwrap_err();
        assert!(wrong.to_string().contains("[3]"), "{wrong}");
    }

    #[test]
    fn the_fused_adamw_update_follows_torch_adamw_from_given_moments() {
        let (lr, [b1, b2], wd, eps, t) = (1e-2, [0.9, 0.95], 0.1, 1e-8, 3);
        let (p0, g) = ([0.5f32, -1.25, 2.0], [0.3f32, -0.7, 1e-3]);
        let (m0, v0) = ([0.1f32, 0.0, -0.2], [0.04f32, 0.5, 1e-6]);
        let [p, grad, m, v] = [p0, g, m0, v0].map(|x| Tensor::from_slice(&x));
        let step = Tensor::from(t as f32);
        fused_adamw(&[[&p, &grad, &m, &v]], &step, lr, [b1, b2], wd, eps).unwrap();
        // `torch.optim.AdamW`'s update, in f64.
        let (bc1, bc2) = (1.0 - b1.powi(t), 1.0 - b2.powi(t));
        for i in 0..3 {
            let (p0, g, m0, v0) = (p0[i] as f64, g[i] as f64, m0[i] as f64, v0[i] as f64);
            let m1 = b1 * m0 + (1.0 - b1) * g;
            let v1 = b2 * v0 + (1.0 - b2) * g * g;
            let p1 = p0 * (1.0 - lr * wd) - lr / bc1 * m1 / (v1.sqrt() / bc2.sqrt() + eps);
            for (name, got, want) in [("p", &p, p1), ("exp_avg", &m, m1), ("exp_avg_sq", &v, v1)] {
                let got = f64::from(values(got)[i]);
                assert!(
                    (got - want).abs() <= 1e-6 * want.abs().max(1e-3),
                    "{name}[{i}]: {got} against {want}"
                );
            }
        }
    }

    #[test]
    fn a_fused_adamw_update_of_mismatched_tensors_is_an_error_naming_them() {
        let p = Tensor::zeros([2, 3], (Kind::Float, Device::Cpu));
        let step = Tensor::from(1f32);
        let short = Tensor::zeros([2, 2], (Kind::Float, Device::Cpu));
        let error = fused_adamw(&[[&p, &p, &short, &p]], &step, 1e-3, [0.9, 0.99], 0.0, 1e-8)
            .unwrap_err()
            .to_string();
        assert!(
            error.contains("exp_avg") && error.contains("[2, 2]"),
            "{error}"
        );
        let transposed = Tensor::zeros([3, 2], (Kind::Float, Device::Cpu)).tr();
        let error = fused_adamw(
            &[[&p, &transposed, &p, &p]],
            &step,
            1e-3,
            [0.9, 0.99],
            0.0,
            1e-8,
        )
        .unwrap_err()
        .to_string();
        assert!(
            error.contains("gradient") && error.contains("contiguous: false"),
            "{error}"
        );
        let counted = Tensor::from(1f64);
        let error = fused_adamw(&[[&p, &p, &p, &p]], &counted, 1e-3, [0.9, 0.99], 0.0, 1e-8)
            .unwrap_err()
            .to_string();
        assert!(error.contains("f32 scalar"), "{error}");
    }
}
