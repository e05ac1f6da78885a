"""Which globals a checkpoint may name: what the reader constructs, what writers re-emit.

Reading: the restricted unpickler (torchfile) constructs only `READ_GLOBALS` (data types whose
construction runs no foreign code); every other class path becomes an inert `Unresolved`.

Writing: a proxy is loaded by Megatron with `torch.load(weights_only=False)`, so every global
written into it runs there. A class path is re-emitted only if it is on `WRITE_ALLOWED`: the
types megatron-core itself registers as safe globals (`megatron/core/safe_globals.py`), argparse
`Namespace`, pathlib paths, the megatron-core enums `args` carry, torch dtypes and sizes, numpy
scalars and dtypes. Anything else (a function such as `os.system`, any other callable) is never
written: `unsafe_args` finds such `args` entries so the writer drops them (and the manifest
records them), and `check_writable` refuses model entries and needed args fields that hold one.
The pickler's own guard (`is_emittable`) refuses any other global as a last line.
"""
from __future__ import annotations

import argparse
import collections
import collections.abc
import importlib
import logging
import numbers

import torch

from mcore_proxy.errors import CheckpointError

log = logging.getLogger(__name__)


class Unresolved:
    """An object of a class this process does not (or may not) import, kept as data.

    It remembers the constructor arguments and pickled state, and pickles back to the same
    class path, so e.g. `args.attention_backend` (a megatron enum) survives a round trip.
    Fields of a pickled dict state (dataclasses, plain objects) read as attributes.
    """

    _module = "?"
    _name = "?"

    def __new__(cls, *args, **kwargs):
        obj = object.__new__(cls)
        obj._args, obj._state = args, None
        return obj

    def __init__(self, *args, **kwargs):
        pass

    def __setstate__(self, state):
        self._state = state

    def __getattr__(self, attr):
        state = self.__dict__.get("_state")
        if isinstance(state, tuple) and len(state) == 2 and isinstance(state[1], dict):
            state = {**(state[0] or {}), **state[1]}  # (dict, slots) state
        if isinstance(state, dict) and attr in state:
            return state[attr]
        raise AttributeError(f"{self._module}.{self._name} has no field {attr!r}")

    def __reduce__(self):
        return (type(self), self._args, self._state) if self._state is not None else (type(self), self._args)

    def __eq__(self, other):
        return type(self) is type(other) and (_freeze(self._args), _freeze(self._state)) == \
            (_freeze(other._args), _freeze(other._state))

    def __hash__(self):
        return hash((self._module, self._name, _freeze(self._args), _freeze(self._state)))

    def __repr__(self):
        args = ", ".join(map(repr, self._args))
        return f"<{self._module}.{self._name}({args})>"


def _freeze(obj):
    """A hashable stand-in of nested data (unhashable leaves such as arrays compare by identity)."""
    if isinstance(obj, dict):
        return tuple(sorted((k, _freeze(v)) for k, v in obj.items()))
    if isinstance(obj, (list, tuple)):
        return tuple(_freeze(v) for v in obj)
    return obj if isinstance(obj, collections.abc.Hashable) else id(obj)


_UNRESOLVED_CLASSES: dict[tuple[str, str], type] = {}


def unresolved_class(module: str, name: str) -> type:
    """One stand-in class per original class path (classes compare by identity in pickles)."""
    key = (module, name)
    if key not in _UNRESOLVED_CLASSES:
        _UNRESOLVED_CLASSES[key] = type(name, (Unresolved,), {
            "_module": module, "_name": name, "__module__": module, "__qualname__": name})
    return _UNRESOLVED_CLASSES[key]


# Data-only types the restricted reader constructs for real.
READ_GLOBALS = {
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("argparse", "Namespace"): argparse.Namespace,
    ("torch", "Size"): torch.Size,
    ("builtins", "set"): set, ("builtins", "frozenset"): frozenset, ("builtins", "slice"): slice,
    ("builtins", "complex"): complex, ("builtins", "bytearray"): bytearray,
    ("builtins", "range"): range,
}

# megatron-core 0.16.1 `SAFE_GLOBALS`, by class path
_MEGATRON_SAFE = {
    ("types", "SimpleNamespace"), ("pathlib", "PosixPath"), ("numpy.core.multiarray", "_reconstruct"),
    ("numpy", "ndarray"), ("numpy", "dtype"), ("numpy.dtypes", "UInt32DType"), ("argparse", "Namespace"),
    ("megatron.core.transformer.enums", "AttnBackend"), ("megatron.core.transformer.enums", "CudaGraphScope"),
    ("megatron.core.enums", "ModelType"), ("megatron.core.optimizer", "OptimizerConfig"),
    ("megatron.core.optimizer.optimizer_config", "OptimizerConfig"),
    ("megatron.core.rerun_state_machine", "RerunDiagnostic"), ("megatron.core.rerun_state_machine", "RerunMode"),
    ("megatron.core.rerun_state_machine", "RerunState"), ("io", "BytesIO"), ("signal", "Signals"),
}
# the other enums megatron-core defines for configuration (plain values, no behaviour on construction)
_MEGATRON_ENUMS = {
    ("megatron.core.enums", n) for n in ("Fp8Recipe", "Fp4Recipe")
} | {
    ("megatron.core.transformer.enums", n) for n in ("ModelType", "LayerType", "AttnType", "AttnMaskType")
} | {("megatron.core.rerun_state_machine", "RerunValidationStatus")}
# stdlib, numpy and torch data types
_DATA_TYPES = {
    ("pathlib", "Path"), ("pathlib", "PurePosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PureWindowsPath"),
    ("numpy.core.multiarray", "scalar"), ("numpy._core.multiarray", "scalar"),
    ("numpy._core.multiarray", "_reconstruct"),
} | {("numpy.dtypes", f"{t}DType") for t in (
    "Bool", "Int8", "UInt8", "Int16", "UInt16", "Int32", "Int64", "UInt64", "Float16", "Float32", "Float64",
    "Complex64", "Complex128", "Str", "Bytes", "Long", "ULong", "LongLong", "ULongLong")}

WRITE_ALLOWED: frozenset[tuple[str, str]] = frozenset(_MEGATRON_SAFE | _MEGATRON_ENUMS | _DATA_TYPES)

# what torchfile's pickler itself emits for the structure of a torch.save file
_STRUCTURE = frozenset(set(READ_GLOBALS) | {("torch._utils", "_rebuild_tensor_v2"), ("_codecs", "encode")})

MAX_DEPTH = 64


def is_emittable(module: str, name: str) -> bool:
    """Whether a writer may put a GLOBAL of this path into a file Megatron will unpickle."""
    if (module, name) in WRITE_ALLOWED or (module, name) in _STRUCTURE:
        return True
    value = getattr(torch, name, None) if module == "torch" else None
    return isinstance(value, torch.dtype) or (module == "torch" and name.endswith("Storage")
                                              and isinstance(value, type))


def _unsafe(value, depth: int = 0) -> str | None:
    """Why `value` may not be written (the first offending global), or None if it is plain data."""
    if depth > MAX_DEPTH:
        return f"data nested deeper than {MAX_DEPTH} levels"
    if value is None or isinstance(value, (bool, numbers.Number, str, bytes, bytearray, range, slice,
                                           torch.dtype)):
        return None
    if isinstance(value, Unresolved):
        if (value._module, value._name) not in WRITE_ALLOWED:
            return f"{value._module}.{value._name}, a global that is not on the allow-list of data types"
        return _unsafe((value._args, value._state), depth + 1)
    if isinstance(value, torch.Tensor) or isinstance(getattr(value, "dtype", None), torch.dtype):
        # a tensor, read or not (torchfile's LazyTensor has a torch dtype too)
        return "a tensor, which Megatron args never hold"
    if isinstance(value, dict):
        return next((r for kv in value.items() for r in (_unsafe(kv[0], depth + 1), _unsafe(kv[1], depth + 1))
                     if r), None)
    if isinstance(value, (list, tuple, set, frozenset)):
        return next((r for v in value if (r := _unsafe(v, depth + 1))), None)
    if isinstance(value, argparse.Namespace):
        return _unsafe(vars(value), depth + 1)
    return f"an object of type {type(value).__module__}.{type(value).__qualname__}"


def check_writable(value, what: str) -> None:
    """CheckpointError unless `value` is plain data or allowed classes (`what` names the entry)."""
    why = _unsafe(value)
    if why:
        raise CheckpointError(f"{what} holds {why}; mcore-proxy never writes a callable or unknown global "
                              "into a proxy, remove it from the source checkpoint")


def unsafe_args(args, needed=()) -> dict[str, str]:
    """`args` fields that may not be written -> why. CheckpointError if one of them is in `needed`
    (a field the model is described by: it cannot be dropped)."""
    fields = vars(args) if isinstance(args, argparse.Namespace) else {}
    found = {k: why for k, v in fields.items() if (why := _unsafe(v))}
    for name in sorted(set(found) & set(needed)):
        raise CheckpointError(f"args {name} holds {found[name]}, and the model needs that field; mcore-proxy "
                              "never writes a callable into a proxy, fix the source checkpoint's args")
    return found


def writable_args(args, needed=()):
    """A copy of `args` without the fields `unsafe_args` finds, each dropped with a warning."""
    import copy

    if not isinstance(args, argparse.Namespace):
        raise CheckpointError(f"the source args are {type(args).__name__}, not Megatron's argparse namespace; "
                              "re-save the checkpoint with Megatron")
    dropped = unsafe_args(args, needed)
    out = copy.copy(args)
    for name, why in dropped.items():
        log.debug("args %s dropped from the proxy: it holds %s", name, why)
        delattr(out, name)
    return out


def torch_load_globals() -> list:
    """The allowed classes that are importable here, for `torch.serialization.safe_globals`."""
    out = []
    for module, name in sorted(WRITE_ALLOWED):
        try:
            obj = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError):
            continue
        out.append(obj)
    return out
