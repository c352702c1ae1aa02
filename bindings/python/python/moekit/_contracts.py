"""The kernel contracts as Python objects, read from the extension (the declarations `moekit list`
prints), and the typed function of each kernel built from them: its signature (inputs first,
required before optional, then its parameters, keyword-only) and its docstring (shapes, dtypes,
defaults)."""

import functools
import inspect
from dataclasses import dataclass

from . import _moekit
from .errors import ContractError


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of a contract: `shape` in contract units (`[T+1, H]`), `dtype` (`f32|bf16`,
    `i32`, `like x`, `f32`), `required` (inputs: must be given; outputs: always produced)."""

    name: str
    shape: str
    dtype: str
    required: bool


@dataclass(frozen=True)
class ParamSpec:
    """One parameter: required, or else `default` (as `moekit list` prints it); `values` the
    accepted ones."""

    name: str
    required: bool
    default: str
    values: str


@dataclass(frozen=True)
class Kernel:
    """A kernel's contract."""

    name: str
    summary: str
    inputs: tuple
    outputs: tuple
    params: tuple

    @staticmethod
    def named(name):
        """The contract of the kernel called `name`."""
        for spec in kernels():
            if spec.name == name:
                return spec
        raise ContractError(
            f"unknown kernel `{name}`; known kernels: " + ", ".join(k.name for k in kernels())
        )

    @property
    def input_names(self):
        return tuple(t.name for t in self.inputs)

    @property
    def output_names(self):
        return tuple(t.name for t in self.outputs)

    def split(self, named):
        """`named` (name → value) as `(tensors, params)`: the kernel's inputs, and its parameters
        (or nki-library's schedule-only ones) as `moekit run --param` strings. None means "not
        given"; any other name is a `ContractError`."""
        params_known = {p.name for p in self.params} | set(_moekit.SCHEDULE_ONLY_PARAMS)
        tensors, params = {}, []
        for name, value in named.items():
            if value is None:
                continue
            if name in self.input_names:
                tensors[name] = value
            elif name in params_known:
                params.append((name, _param_text(name, value)))
            else:
                raise ContractError(
                    f"`{name}` is neither an input nor a parameter of `{self.name}`; inputs: "
                    + ", ".join(self.input_names)
                    + "; parameters: "
                    + ", ".join(p.name for p in self.params)
                )
        return tensors, params

    def docstring(self):
        lines = [self.summary, "", "Inputs:"]
        for t in self.inputs:
            optional = "" if t.required else ", optional"
            lines.append(f"    {t.name}: {t.shape} {t.dtype}{optional}")
        lines += ["", "Parameters (keyword-only):"]
        for p in self.params:
            default = "required" if p.required else f"default {p.default}"
            lines.append(f"    {p.name}: {p.values}, {default}")
        lines += [
            "    backend: reference, cpu or neuron, default cpu",
            "",
            "Returns a dict of the outputs by name:",
        ]
        for t in self.outputs:
            sometimes = "" if t.required else " (only for some calls)"
            lines.append(f"    {t.name}: {t.shape} {t.dtype}{sometimes}")
        return "\n".join(lines)

    def signature(self):
        P = inspect.Parameter
        inputs = sorted(self.inputs, key=lambda t: not t.required)
        parameters = [
            P(t.name, P.POSITIONAL_OR_KEYWORD, default=P.empty if t.required else None)
            for t in inputs
        ]
        parameters += [
            P(p.name, P.KEYWORD_ONLY, default=P.empty if p.required else None) for p in self.params
        ]
        parameters.append(P("backend", P.KEYWORD_ONLY, default="cpu"))
        return inspect.Signature(parameters)


def _param_text(name, value):
    """A parameter value as `moekit run --param` reads it."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float, str)):
        return str(value)
    raise ContractError(
        f"param `{name}`: a {type(value).__name__} is not a parameter value (bool, int, float "
        "or str)"
    )


@functools.cache
def _catalog():
    return tuple(
        Kernel(
            name=k["name"],
            summary=k["summary"],
            inputs=tuple(TensorSpec(**t) for t in k["inputs"]),
            outputs=tuple(TensorSpec(**t) for t in k["outputs"]),
            params=tuple(ParamSpec(**p) for p in k["params"]),
        )
        for k in _moekit.kernels()
    )


def kernels():
    """Every kernel's contract, forward and backward, in catalog order."""
    return list(_catalog())


def kernel_function(spec, run):
    """The typed function of the kernel `spec`, calling `run`."""
    signature = spec.signature()

    def kernel(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        named = dict(bound.arguments)
        backend = named.pop("backend", "cpu")
        return run(spec.name, backend=backend, **named)

    kernel.__name__ = kernel.__qualname__ = spec.name
    kernel.__module__ = "moekit"
    kernel.__signature__ = signature
    kernel.__doc__ = spec.docstring()
    return kernel


@dataclass(frozen=True)
class Report:
    """`moekit.compare`'s result: `rows`, one dict per compared output (`tensor`, `elements`,
    `max_abs`, `max_rel`, `failures`, `passed`), and the tolerance used; `str(report)` is the
    table `moekit check` prints."""

    kernel: str
    rows: list
    table: str
    rtol: float
    atol: float

    @property
    def passed(self):
        return all(row["passed"] for row in self.rows)

    def __bool__(self):
        return self.passed

    def __str__(self):
        return self.table
