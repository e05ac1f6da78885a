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
import importlib
import logging
import numbers

import torch

from mcore_proxy.errors import CheckpointError

log = logging.getLogger(__name__)

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
    from mcore_proxy.checkpoint.torchfile import LazyTensor, Unresolved

    if depth > MAX_DEPTH:
        return f"data nested deeper than {MAX_DEPTH} levels"
    if value is None or isinstance(value, (bool, numbers.Number, str, bytes, bytearray, range, slice,
                                           torch.dtype)):
        return None
    if isinstance(value, Unresolved):
        if (value._module, value._name) not in WRITE_ALLOWED:
            return f"{value._module}.{value._name}, a global that is not on the allow-list of data types"
        return _unsafe((value._args, value._state), depth + 1)
    if isinstance(value, (LazyTensor, torch.Tensor)):
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


def load_weights_only(path):
    """`torch.load(path, weights_only=True)` with the allowed classes as its safe globals (torch
    >= 2.4; earlier torch has no way to add them, so the restricted reader stands in)."""
    serialization = torch.serialization
    if hasattr(serialization, "safe_globals"):
        with serialization.safe_globals(torch_load_globals()):
            return torch.load(path, map_location="cpu", weights_only=True)
    from mcore_proxy.checkpoint.torchfile import TorchFile, materialize

    return materialize(TorchFile(path).obj)
