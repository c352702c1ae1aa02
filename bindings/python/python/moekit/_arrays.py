"""Tensors in and out of the extension: NumPy arrays, PyTorch tensors and other DLPack exporters
become DLPack capsules (read in place by the kernels where contiguous), and outputs come back as
the caller's array type without a copy."""

import sys

import numpy as np

from .errors import ContractError


def _torch():
    """PyTorch if the caller has imported it (moekit never imports it for them)."""
    return sys.modules.get("torch")


def _is_torch_tensor(value):
    torch = _torch()
    return torch is not None and isinstance(value, torch.Tensor)


def _capsule(value):
    """The DLPack capsule of `value`, versioned (DLPack 1.0) where the producer offers it."""
    try:
        return value.__dlpack__(max_version=(1, 0))
    except TypeError:
        return value.__dlpack__()


def export(name, value):
    """`(capsule, bf16_bits, is_torch)` for the input called `name`: `bf16_bits` when the capsule
    holds bfloat16 values as their uint16 bits (NumPy has no DLPack bfloat16)."""
    if _is_torch_tensor(value):
        if value.device.type != "cpu":
            raise ContractError(
                f"tensor `{name}`: on {value.device}; moekit reads tensors in CPU memory (.cpu())"
            )
        # Autograd is the caller's business: the kernel reads the values.
        return _capsule(value.detach()), False, True
    if isinstance(value, np.ndarray):
        if value.dtype.name == "bfloat16":
            return _capsule(value.view(np.uint16)), True, False
        return _capsule(value), False, False
    if hasattr(value, "__dlpack__"):
        return _capsule(value), False, False
    raise ContractError(
        f"tensor `{name}`: a {type(value).__name__} is not a tensor; pass a NumPy array, a "
        "PyTorch tensor or an object with __dlpack__"
    )


def export_all(tensors):
    """The extension's input list for `tensors` (name → array), and whether any is a PyTorch
    tensor (the outputs are then PyTorch tensors too)."""
    exported = []
    any_torch = False
    for name, value in tensors.items():
        capsule, bf16_bits, is_torch = export(name, value)
        exported.append((name, capsule, bf16_bits))
        any_torch |= is_torch
    return exported, any_torch


def _bfloat16():
    try:
        import ml_dtypes
    except ImportError as error:  # pragma: no cover - depends on the environment
        raise ContractError(
            "a bfloat16 output as a NumPy array needs the ml_dtypes package "
            "(pip install ml_dtypes), or pass PyTorch tensors"
        ) from error
    return ml_dtypes.bfloat16


def imported(output, as_torch):
    """An extension output as a PyTorch tensor or a NumPy array, sharing its memory."""
    if as_torch:
        return _torch().from_dlpack(output)
    if output.dtype == "bfloat16":
        return np.from_dlpack(output.bf16_as_bits()).view(_bfloat16())
    return np.from_dlpack(output)
