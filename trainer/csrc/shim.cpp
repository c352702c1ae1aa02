// What the trainer needs from libtorch that its C API (and so `tch`) does not expose:
// backpropagation from given gradients (`tch` backpropagates only from a scalar, with an
// implicit gradient of one), tensors over memory handed over with a deleter (`tch`'s
// `from_blob` only borrows), a leaf's `.grad` set or released without autograd, and AdamW's
// fused update (`tch` leaves out libtorch's tensor-list ops).
//
// Every pointer to a tensor is a `tch` tensor (`at::Tensor *`). A function that can fail
// returns null, or libtorch's error message in memory the caller frees with `free`.

#include <ATen/ops/_fused_adamw.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/generated/variable_factories.h>

#include <cstdint>
#include <cstring>
#include <exception>
#include <vector>

// Backpropagates `grads[i]` into the graph of `tensors[i]` for each i < n, in one backward
// pass that frees the graph, accumulating into the `.grad` of the leaves it reaches. The
// gradients are taken: each `*grads[i]` is left undefined, so autograd holds the only
// references to them.
extern "C" char *moekit_autograd_backward(at::Tensor *const *tensors,
                                          at::Tensor *const *grads, int n) {
  try {
    std::vector<at::Tensor> roots;
    std::vector<at::Tensor> seeds;
    roots.reserve(n);
    seeds.reserve(n);
    for (int i = 0; i < n; ++i) {
      roots.push_back(*tensors[i]);
      seeds.push_back(std::move(*grads[i]));
    }
    torch::autograd::backward(roots, seeds);
    return nullptr;
  } catch (const std::exception &error) {
    return strdup(error.what());
  }
}

// A contiguous CPU tensor of `ndim` extents `sizes` over `data`, of f32 (`dtype` 0), bf16 (1) or
// i32 (2) elements, which it owns from here: when its storage dies, libtorch calls
// `release(context)`, from whichever thread drops the last reference. Writes the new tensor to
// `*out`. On an error `*out` stays null and `release` may or may not have run, so the caller
// must neither use nor free `context` afterwards.
extern "C" char *moekit_tensor_from_owned(void *data, const int64_t *sizes, int ndim,
                                          int dtype, void (*release)(void *),
                                          void *context, at::Tensor **out) {
  try {
    const at::ScalarType types[] = {at::kFloat, at::kBFloat16, at::kInt};
    if (dtype < 0 || dtype > 2) {
      return strdup("moekit_tensor_from_owned: dtype is not 0, 1 or 2");
    }
    auto options = at::TensorOptions().dtype(types[dtype]).device(at::kCPU);
    auto deleter = [release, context](void *) { release(context); };
    *out = new at::Tensor(
        torch::from_blob(data, at::IntArrayRef(sizes, ndim), deleter, options));
    return nullptr;
  } catch (const std::exception &error) {
    return strdup(error.what());
  }
}

// Sets the `.grad` of the leaf `tensor` to `*grad`, which is taken (left undefined), as autograd
// does when it reaches a leaf without a gradient and holds the only reference to the incoming
// one. The caller checks the shapes and dtypes match.
extern "C" char *moekit_set_grad(at::Tensor *tensor, at::Tensor *grad) {
  try {
    tensor->mutable_grad() = std::move(*grad);
    return nullptr;
  } catch (const std::exception &error) {
    return strdup(error.what());
  }
}

// Drops the `.grad` of `tensor` (PyTorch's `zero_grad(set_to_none=True)`): the next gradient
// that reaches it becomes its `.grad` instead of being added into zeros.
extern "C" char *moekit_release_grad(at::Tensor *tensor) {
  try {
    tensor->mutable_grad().reset();
    return nullptr;
  } catch (const std::exception &error) {
    return strdup(error.what());
  }
}

// One AdamW step (`torch.optim.AdamW(fused=True)`, `amsgrad=False`) of each `params[i]` from
// `grads[i]`, with the moments `exp_avgs[i]` and `exp_avg_sqs[i]`, at the 1-based step count
// held by the scalar `*step`: libtorch's `_fused_adamw_`, one pass over each parameter. The
// caller checks that the tensors of each i share shape, dtype and device and are contiguous.
extern "C" char *moekit_fused_adamw(at::Tensor *const *params, at::Tensor *const *grads,
                                    at::Tensor *const *exp_avgs,
                                    at::Tensor *const *exp_avg_sqs, const at::Tensor *step,
                                    int n, double lr, double beta1, double beta2,
                                    double weight_decay, double eps) {
  try {
    std::vector<at::Tensor> lists[4];
    for (auto &list : lists) {
      list.reserve(n);
    }
    for (int i = 0; i < n; ++i) {
      lists[0].push_back(*params[i]);
      lists[1].push_back(*grads[i]);
      lists[2].push_back(*exp_avgs[i]);
      lists[3].push_back(*exp_avg_sqs[i]);
    }
    const std::vector<at::Tensor> steps(n, *step);
    at::_fused_adamw_(lists[0], lists[1], lists[2], lists[3], {}, steps, lr, beta1, beta2,
                      weight_decay, eps, /*amsgrad=*/false, /*maximize=*/false);
    return nullptr;
  } catch (const std::exception &error) {
    return strdup(error.what());
  }
}
