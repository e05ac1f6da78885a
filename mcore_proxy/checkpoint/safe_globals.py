"""Which globals a checkpoint may name: what the reader constructs, what writers re-emit.

Reading: the restricted unpickler (torchfile) constructs only `READ_GLOBALS` (data types whose
construction runs no foreign code); every other class path becomes an inert `Unresolved`.

Writing: older Megatron-LM loads a proxy with `torch.load(weights_only=False)`, so every global
written into it runs there (current Megatron-LM uses torch's default, `weights_only=True` with
megatron-core's safe globals, which refuses anything else). A class path is re-emitted only if
it is on `WRITE_ALLOWED`: the types megatron-core itself registers as safe globals
(`megatron/core/safe_globals.py`), argparse `Namespace`, pathlib paths, the megatron-core enums
`args` carry, torch dtypes and sizes, numpy scalars and dtypes. Anything else (a function such
as `os.system`, any other callable) is never written: `unsafe_args` finds such `args` entries so
the writer drops them (and the manifest records them), and `check_writable` refuses model
entries and needed args fields that hold one.
The pickler's own guard (`is_emittable`) refuses any other global as a last line.

Enums come in three pickled forms, depending on the Python that saved the file: by value
`AttnBackend(5)` (3.11.7 and later, 3.12), by name `getattr(AttnBackend, 'auto')` (early 3.11
releases such as Debian 12's 3.11.2), and, for enums Python 3.11 marks `global_enum`, as a
module global `signal.SIGTERM`. The reader turns all three into the same member (`enum_by_name`,
`global_enum_member`), and writers emit it by value: the form `torch.load(weights_only=True)`
accepts with megatron-core's safe globals, and Megatron's own loader too. `getattr` is honoured
in that one shape only; anything else it is asked for becomes an inert `Refused` record.
"""

from __future__ import annotations

import argparse
import collections
import collections.abc
import contextlib
import enum
import importlib
import logging
import numbers
import pickle
import sys

from mcore_proxy.core.dtypes import ITEMSIZE, STORAGE_DTYPES
from mcore_proxy.core.errors import CheckpointError

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
        return type(self) is type(other) and (_freeze(self._args), _freeze(self._state)) == (
            _freeze(other._args),
            _freeze(other._state),
        )

    def __hash__(self):
        return hash((self._module, self._name, _freeze(self._args), _freeze(self._state)))

    def __repr__(self):
        member = enum_member_name(self)
        if member is not None:
            return f"<{self._module}.{self._name}.{member}>"
        args = ", ".join(map(repr, self._args))
        return f"<{self._module}.{self._name}({args})>"


class Refused:
    """What the restricted reader builds instead of an operation it will not perform: a `getattr`
    other than an allowed enum member read by name, or a call of what such a getattr returned.

    Inert data: getattr on it, calling it, or setting its state gives another `Refused` (or
    nothing), so a chain such as `AttnBackend.__init__.__globals__['sys'].modules['os'].system`
    runs nothing. `what` says what the file asked for, `where` which file; writers never emit it
    (`_unsafe` names the field holding it, and its `__reduce__` refuses as a last line).
    """

    __slots__ = ("what", "where")

    def __init__(self, what: str, where: str):
        self.what, self.where = what[:200], where  # bounded: a hostile chain may nest thousands deep

    def __call__(self, *args, **kwargs):
        return Refused(f"{self.what}(...)", self.where)

    def __setstate__(self, state):
        pass

    def __reduce__(self):
        raise CheckpointError(
            f"refusing to write {self.what}, read from {self.where}: only enum members may "
            "be read by name, and mcore-proxy never writes what it refused to read"
        )

    def __repr__(self):
        return f"<refused {self.what}>"


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
        _UNRESOLVED_CLASSES[key] = type(
            name, (Unresolved,), {"_module": module, "_name": name, "__module__": module, "__qualname__": name}
        )
    return _UNRESOLVED_CLASSES[key]


def _size(dims=()) -> tuple:
    """`torch.Size` read as the tuple it is (reading imports no torch)."""
    return tuple(dims)


# Data-only types the restricted reader constructs for real.
READ_GLOBALS = {
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("argparse", "Namespace"): argparse.Namespace,
    ("torch", "Size"): _size,
    ("builtins", "set"): set,
    ("builtins", "frozenset"): frozenset,
    ("builtins", "slice"): slice,
    ("builtins", "complex"): complex,
    ("builtins", "bytearray"): bytearray,
    ("builtins", "range"): range,
}

# megatron-core 0.16.1 `SAFE_GLOBALS`, by class path
_MEGATRON_SAFE = {
    ("types", "SimpleNamespace"),
    ("pathlib", "PosixPath"),
    ("numpy.core.multiarray", "_reconstruct"),
    ("numpy", "ndarray"),
    ("numpy", "dtype"),
    ("numpy.dtypes", "UInt32DType"),
    ("argparse", "Namespace"),
    ("megatron.core.transformer.enums", "AttnBackend"),
    ("megatron.core.transformer.enums", "CudaGraphScope"),
    ("megatron.core.enums", "ModelType"),
    ("megatron.core.optimizer", "OptimizerConfig"),
    ("megatron.core.optimizer.optimizer_config", "OptimizerConfig"),
    ("megatron.core.rerun_state_machine", "RerunDiagnostic"),
    ("megatron.core.rerun_state_machine", "RerunMode"),
    ("megatron.core.rerun_state_machine", "RerunState"),
    ("io", "BytesIO"),
    ("signal", "Signals"),
}
# the other enums megatron-core defines for configuration (plain values, no behaviour on construction)
_MEGATRON_ENUMS = (
    {("megatron.core.enums", n) for n in ("Fp8Recipe", "Fp4Recipe")}
    | {("megatron.core.transformer.enums", n) for n in ("ModelType", "LayerType", "AttnType", "AttnMaskType")}
    | {("megatron.core.rerun_state_machine", "RerunValidationStatus")}
)
# stdlib, numpy and torch data types
_DATA_TYPES = {
    ("pathlib", "Path"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
    ("numpy.core.multiarray", "scalar"),
    ("numpy._core.multiarray", "scalar"),
    ("numpy._core.multiarray", "_reconstruct"),
} | {
    ("numpy.dtypes", f"{t}DType")
    for t in (
        "Bool",
        "Int8",
        "UInt8",
        "Int16",
        "UInt16",
        "Int32",
        "Int64",
        "UInt64",
        "Float16",
        "Float32",
        "Float64",
        "Complex64",
        "Complex128",
        "Str",
        "Bytes",
        "Long",
        "ULong",
        "LongLong",
        "ULongLong",
    )
}

WRITE_ALLOWED: frozenset[tuple[str, str]] = frozenset(_MEGATRON_SAFE | _MEGATRON_ENUMS | _DATA_TYPES)


def _numbered(names: str, start: int = 1) -> dict[str, int]:
    return {name: value for value, name in enumerate(names.split(), start)}


def _lowercase(names: str) -> dict[str, str]:
    return {name: name.lower() for name in names.split()}


_CORE, _TRANSFORMER = "megatron.core.enums", "megatron.core.transformer.enums"
_RERUN = "megatron.core.rerun_state_machine"
# name -> value of every member (aliases left out: pickles name the canonical member) of the enum
# classes on the allow-list, as megatron-core 0.16.1 and Linux (where Megatron trains) define them:
# a table, so reading by name needs neither megatron nor the saving platform's signal numbers.
# tests/checkpoint/test_enum_forms.py checks it against the installed megatron-core.
ENUM_MEMBERS: dict[tuple[str, str], dict[str, object]] = {
    (_TRANSFORMER, "AttnBackend"): _numbered("flash fused unfused local auto"),
    (_TRANSFORMER, "CudaGraphScope"): _numbered("full_iteration attn mlp moe moe_router moe_preprocess mamba"),
    (_TRANSFORMER, "ModelType"): _numbered("encoder_or_decoder"),
    (_TRANSFORMER, "LayerType"): _numbered("embedding loss encoder decoder mtp"),
    (_TRANSFORMER, "AttnType"): _numbered("self_attn cross_attn"),
    (_TRANSFORMER, "AttnMaskType"): _numbered("padding causal no_mask padding_causal arbitrary causal_bottom_right"),
    (_CORE, "ModelType"): _numbered("encoder_or_decoder"),
    (_CORE, "Fp8Recipe"): _lowercase("delayed tensorwise mxfp8 blockwise custom"),
    (_CORE, "Fp4Recipe"): _lowercase("nvfp4 custom"),
    (_RERUN, "RerunDiagnostic"): _lowercase("CORRECT_RESULT TRANSIENT_ERROR PERSISTENT_ERROR"),
    (_RERUN, "RerunMode"): _lowercase("DISABLED VALIDATE_RESULTS REPORT_DETERMINISM_STATS"),
    (_RERUN, "RerunState"): _numbered(
        "NOT_RUNNING_YET INITIAL_RUN RERUNNING_IN_PLACE WILL_RERUN_FROM_CHECKPOINT "
        "RERUNNING_FROM_CHECKPOINT RERUNNING_AGAIN_FROM_CHECKPOINT",
        start=0,
    ),
    (_RERUN, "RerunValidationStatus"): _lowercase(
        "RERUN_DISABLED INITIAL_RUN FIRST_RERUN_NOT_REPRODUCIBLE FIRST_RERUN_REPRODUCIBLE "
        "SECOND_RERUN_NOT_REPRODUCIBLE SECOND_RERUN_REPRODUCIBLE"
    ),
    ("signal", "Signals"): {
        **_numbered(
            "SIGHUP SIGINT SIGQUIT SIGILL SIGTRAP SIGABRT SIGBUS SIGFPE SIGKILL SIGUSR1 SIGSEGV "
            "SIGUSR2 SIGPIPE SIGALRM "
            "SIGTERM SIGSTKFLT SIGCHLD SIGCONT SIGSTOP SIGTSTP SIGTTIN SIGTTOU SIGURG SIGXCPU "
            "SIGXFSZ SIGVTALRM SIGPROF "
            "SIGWINCH SIGIO SIGPWR SIGSYS"
        ),
        "SIGRTMIN": 34,
        "SIGRTMAX": 64,
    },
}
# enums that Python 3.11's `enum.global_enum` pickles as a global of their module (`signal.SIGTERM`)
GLOBAL_ENUMS = {"signal": "Signals"}


def enum_by_name(cls, name, where: str):
    """`getattr(cls, name)` as the restricted reader performs it: the member `name` of an allowed
    enum class (as `cls(value)`, the by-value form), else a `Refused` record of the request."""
    shown = repr(name)[:60] if isinstance(name, str) else f"<a {type(name).__name__}>"
    if isinstance(cls, Refused):  # a chain: say it as the file spells it
        return Refused(f"{cls.what}.{name if isinstance(name, str) else shown}", where)
    members = ENUM_MEMBERS.get((cls._module, cls._name)) if _is_stand_in(cls) else None
    if members is not None and isinstance(name, str) and name in members:
        return cls(members[name])
    return Refused(f"getattr({_describe(cls)}, {shown})", where)


def _is_stand_in(obj) -> bool:
    return isinstance(obj, type) and issubclass(obj, Unresolved)


def _describe(obj) -> str:
    """A short, fixed-size description of an object the reader built (never its repr: it may be huge)."""
    if _is_stand_in(obj):
        return f"{obj._module}.{obj._name}"
    if isinstance(obj, Unresolved):
        return f"<an object of {obj._module}.{obj._name}>"
    if isinstance(obj, type):
        return f"{obj.__module__}.{obj.__qualname__}"
    return f"<a {type(obj).__name__}>"


def global_enum_member(module: str, name: str):
    """The member a by-global-name pickle (`signal.SIGTERM`) names, or None if it names none."""
    cls = GLOBAL_ENUMS.get(module)
    members = ENUM_MEMBERS.get((module, cls), {})
    return unresolved_class(module, cls)(members[name]) if name in members else None


def enum_member_name(value) -> str | None:
    """`member` if `value` is an allowed enum member read from a file (an `Unresolved`), else None."""
    members = ENUM_MEMBERS.get((value._module, value._name)) if isinstance(value, Unresolved) else None
    if not members or len(value._args) != 1 or value._state is not None:
        return None
    return next((name for name, v in members.items() if v == value._args[0]), None)


# what torchfile's pickler itself emits for the structure of a torch.save file
_STRUCTURE = frozenset(set(READ_GLOBALS) | {("torch._utils", "_rebuild_tensor_v2"), ("_codecs", "encode")})

MAX_DEPTH = 64


def is_emittable(module: str, name: str) -> bool:
    """Whether a writer may put a GLOBAL of this path into a file Megatron will unpickle."""
    if (module, name) in WRITE_ALLOWED or (module, name) in _STRUCTURE:
        return True
    if module != "torch":
        return False
    if name in ITEMSIZE or name in STORAGE_DTYPES:  # known without importing torch
        return True
    import torch

    value = getattr(torch, name, None)
    return isinstance(value, torch.dtype) or (name.endswith("Storage") and isinstance(value, type))


def _unsafe(value, depth: int = 0) -> str | None:
    """Why `value` may not be written (the first offending global), or None if it is plain data."""
    if depth > MAX_DEPTH:
        return f"data nested deeper than {MAX_DEPTH} levels"
    torch = sys.modules.get("torch")  # a torch object exists only where torch was imported
    if value is None or isinstance(value, (bool, numbers.Number, str, bytes, bytearray, range, slice)):
        return None
    if torch is not None and isinstance(value, torch.dtype):
        return None
    if isinstance(value, Refused):
        return (
            f"{value.what}, read from {value.where}, which the reader refused (only members of "
            "allow-listed enum classes are read by name)"
        )
    if isinstance(value, Unresolved):
        if (value._module, value._name) not in WRITE_ALLOWED:
            return f"{value._module}.{value._name}, a global that is not on the allow-list of data types"
        return _unsafe((value._args, value._state), depth + 1)
    if (torch is not None and isinstance(value, torch.Tensor)) or hasattr(value, "dtype_name"):
        # a tensor, read or not (torchfile's LazyTensor)
        return "a tensor, which Megatron args never hold"
    if isinstance(value, dict):
        return next(
            (r for kv in value.items() for r in (_unsafe(kv[0], depth + 1), _unsafe(kv[1], depth + 1)) if r), None
        )
    if isinstance(value, (list, tuple, set, frozenset)):
        return next((r for v in value if (r := _unsafe(v, depth + 1))), None)
    if isinstance(value, argparse.Namespace):
        return _unsafe(vars(value), depth + 1)
    return f"an object of type {type(value).__module__}.{type(value).__qualname__}"


def check_writable(value, what: str) -> None:
    """CheckpointError unless `value` is plain data or allowed classes (`what` names the entry)."""
    why = _unsafe(value)
    if why:
        raise CheckpointError(
            f"{what} holds {why}; mcore-proxy never writes a callable or unknown global "
            "into a proxy, remove it from the source checkpoint"
        )


def unsafe_args(args, needed=()) -> dict[str, str]:
    """`args` fields that may not be written -> why. CheckpointError if one of them is in `needed`
    (a field the model is described by: it cannot be dropped)."""
    fields = vars(args) if isinstance(args, argparse.Namespace) else {}
    found = {k: why for k, v in fields.items() if (why := _unsafe(v))}
    for name in sorted(set(found) & set(needed)):
        raise CheckpointError(
            f"args {name} holds {found[name]}, and the model needs that field; mcore-proxy "
            "never writes a callable into a proxy, fix the source checkpoint's args"
        )
    return found


def writable_args(args, needed=()):
    """A copy of `args` without the fields `unsafe_args` finds, each dropped with a warning."""
    import copy

    if not isinstance(args, argparse.Namespace):
        raise CheckpointError(
            f"the source args are {type(args).__name__}, not Megatron's argparse namespace; "
            "re-save the checkpoint with Megatron"
        )
    dropped = unsafe_args(args, needed)
    out = copy.copy(args)
    for name, why in dropped.items():
        log.debug("args %s dropped from the proxy: it holds %s", name, why)
        delattr(out, name)
    return out


def torch_load_globals() -> list:
    """The allowed classes that are importable here, for `torch.serialization.safe_globals`; with
    torch >= 2.6, which also takes `(object, "module.name")` pairs, the two by-name enum forms too:
    a `builtins.getattr` that only reads members of those enum classes (`_enum_getattr`), and the
    `signal.SIG*` globals."""
    import torch

    out = []
    for module, name in sorted(WRITE_ALLOWED):
        try:
            obj = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError):
            continue
        out.append(obj)
    if tuple(int(p) for p in torch.__version__.split(".")[:2] if p.isdigit()) >= (2, 6):
        out.append((_enum_getattr, "builtins.getattr"))
        for module, name in GLOBAL_ENUMS.items():
            members = getattr(importlib.import_module(module), name).__members__
            out += [(member, f"{module}.{member_name}") for member_name, member in members.items()]
    return out


@contextlib.contextmanager
def torch_load_allowing():
    """A context in which `torch.load(weights_only=True)` (and so megatron-core's loaders) also
    accepts the allowed classes and enums pickled by name (`torch_load_globals`); torch < 2.4
    cannot be told, and gets a context that changes nothing.

    Only what is not registered already is added, and removed at the end: torch's own context
    removes everything it was given, megatron-core's registrations (made at import) included."""
    import torch

    serialization = torch.serialization
    if not hasattr(serialization, "safe_globals"):
        yield
        return
    registered = serialization.get_safe_globals() if hasattr(serialization, "get_safe_globals") else []
    with serialization.safe_globals([g for g in torch_load_globals() if g not in registered]):
        yield


def _enum_getattr(cls, name):
    """`getattr(cls, name)` for torch's weights_only unpickler: a member of an allowed enum class
    (the real class, which torch resolved), else UnpicklingError."""
    if (
        isinstance(cls, enum.EnumMeta)
        and (cls.__module__, cls.__qualname__) in ENUM_MEMBERS
        and isinstance(name, str)
        and name in cls.__members__
    ):
        return cls.__members__[name]
    raise pickle.UnpicklingError(
        f"getattr({_describe(cls)}, {str(name)[:60]!r}) refused: only members of "
        "allow-listed enum classes are read by name"
    )
