// Backpropagation from given gradients, `torch::autograd::backward(tensors, grad_tensors)`,
// which libtorch's C API (and so `tch`) does not expose: `tch` backpropagates only from a
// scalar, with an implicit gradient of one.

#include <torch/csrc/autograd/autograd.h>

#include <cstring>
#include <exception>
#include <vector>

// Backpropagates `grads[i]` into the graph of `tensors[i]` for each i < n, in one backward
// pass that frees the graph, accumulating into the `.grad` of the leaves it reaches. The
// pointers are `tch` tensors (`at::Tensor *`). Returns null, or libtorch's error message in
// memory the caller frees with `free`.
extern "C" char *moekit_autograd_backward(at::Tensor *const *tensors,
                                          at::Tensor *const *grads, int n) {
  try {
    std::vector<at::Tensor> roots;
    std::vector<at::Tensor> seeds;
    roots.reserve(n);
    seeds.reserve(n);
    for (int i = 0; i < n; ++i) {
      roots.push_back(*tensors[i]);
      seeds.push_back(*grads[i]);
    }
    torch::autograd::backward(roots, seeds);
    return nullptr;
  } catch (const std::exception &error) {
    return strdup(error.what());
  }
}
