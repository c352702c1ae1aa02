// What the trainer needs from libtorch that its C API (and so `tch`) does not expose:
// backpropagation from given gradients (`tch` backpropagates only from a scalar, with an
// implicit gradient of one), tensors over memory handed over with a deleter (`tch`'s
// `from_blob` only borrows), and a leaf's `.grad` set or released without autograd.
//
// Every pointer to a tensor is a `tch` tensor (`at::Tensor *`). A function that can fail
// returns null, or libtorch's error message in memory the caller frees with `free`.

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
