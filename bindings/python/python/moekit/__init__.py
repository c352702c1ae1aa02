"""moekit: Mixture-of-Experts kernels whose tensor contracts are the AWS Neuron nki-library
kernels', on NumPy arrays, PyTorch CPU tensors and anything exporting DLPack.

- `run(kernel, backend="cpu", **tensors_and_params)`: any kernel by its contract names,
  returning a dict of outputs by name.
- One function per kernel (`router_topk`, `permute`, `blockwise_mm`, `blockwise_mm_bwd`, ...),
  its signature and docstring built from the kernel's contract (`kernels()`).
- `compare(kernel, inputs, outputs)`: outputs computed elsewhere (an NKI kernel on the simulator
  or on Trainium) against the reference, the report `moekit check` prints.

Inputs are read in place where they are contiguous (the GIL is released while a kernel runs);
outputs come back as PyTorch tensors if any input was one, else as NumPy arrays (bfloat16 as
`ml_dtypes.bfloat16`). Bad input raises `ContractError` (a `ValueError`) naming the tensor or
parameter.
"""

from . import _arrays
from ._contracts import Kernel, Report, kernel_function, kernels
from ._moekit import BUILD, backends
from ._moekit import compare as _compare
from ._moekit import neuron_tolerance as _neuron_tolerance
from ._moekit import run as _run
from .errors import AllocationError, ContractError, Error

__version__ = BUILD.split(" ")[0]


def run(kernel, *, backend="cpu", **tensors_and_params):
    """Runs `kernel` on `backend` ("reference", "cpu" or "neuron") with its input tensors and
    parameters given by their contract names; returns every output by name.

    A name that is neither an input nor a parameter of the kernel is a `ContractError`; a
    parameter given as None takes its default.
    """
    spec = Kernel.named(kernel)
    tensors, params = spec.split(tensors_and_params)
    exported, as_torch = _arrays.export_all(tensors)
    outputs = _run(spec.name, backend, exported, params)
    return {name: _arrays.imported(output, as_torch) for name, output in outputs}


def compare(kernel, inputs, outputs, *, rtol=None, atol=None, **params):
    """Compares `outputs` (name → array, e.g. an NKI kernel's results) with the reference's on
    `inputs` (name → array, what that kernel was given), computed in float32.

    An element passes when |got − want| ≤ atol · max(1, max |want|) + rtol · |want| (indices
    only when equal); the default tolerance is the `neuron` backend's documented one. Returns a
    `Report`: one row per given output (max abs and rel error, failing elements), `passed`, and
    `str(report)` the table `moekit check` prints.
    """
    spec = Kernel.named(kernel)
    tensors, params = spec.split({**inputs, **params})
    unknown = [name for name in outputs if name not in spec.output_names]
    if unknown:
        raise ContractError(
            f"tensor `{unknown[0]}`: is not an output of `{spec.name}`; its outputs: "
            + ", ".join(spec.output_names)
        )
    default_rtol, default_atol = _neuron_tolerance()
    rtol = default_rtol if rtol is None else float(rtol)
    atol = default_atol if atol is None else float(atol)
    exported_inputs, _ = _arrays.export_all(tensors)
    exported_outputs, _ = _arrays.export_all(outputs)
    rows, table = _compare(spec.name, exported_inputs, exported_outputs, params, rtol, atol)
    return Report(spec.name, rows, table, rtol, atol)


for _spec in kernels():
    globals()[_spec.name] = kernel_function(_spec, run)
del _spec

__all__ = [
    "AllocationError",
    "ContractError",
    "Error",
    "Kernel",
    "Report",
    "backends",
    "compare",
    "kernels",
    "run",
    *(spec.name for spec in kernels()),
]
