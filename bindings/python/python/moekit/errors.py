"""moekit's exceptions. Every message is the library's own, naming the tensor, parameter or file
at fault and what was expected."""


class Error(Exception):
    """Anything moekit cannot do: a file, the Neuron runtime, a backend that does not run a
    kernel. The base of moekit's other exceptions."""


class ContractError(Error, ValueError):
    """Input that breaks a kernel's contract: a wrong shape, dtype or value, a missing tensor,
    an unknown or invalid parameter, an unknown kernel or backend."""


class AllocationError(Error, MemoryError):
    """An output the inputs or parameters ask for is too large to allocate."""
