"""Checkpoints whose enums are pickled in one chosen form, whatever Python runs the tests.

Which form `torch.save` writes depends on the interpreter: early Python 3.11 releases (Debian 12's
3.11.2) pickle an enum member by name, `getattr(AttnBackend, 'auto')`, and a member of an
`enum.global_enum` class (`signal.Signals`) as its module's global, `signal.SIGTERM`; 3.11.7 and
3.12 pickle both by value, `AttnBackend(5)`. `rewrite_enums` re-saves every torch file of a
checkpoint built here (legacy rank files, torch_dist `common.pt`) with its enums in the form asked
for, so each form is tested under either interpreter.
"""

from __future__ import annotations

import enum
import pickle
import pickletools
import sys
import types
import zipfile
from pathlib import Path

import torch

BY_VALUE, BY_NAME = "by_value", "by_name"
FORMS = (BY_VALUE, BY_NAME)


def _pickler_of(form: str) -> type:
    if form not in FORMS:
        raise ValueError(f"enum form {form!r}, expected one of {FORMS}")

    class EnumFormPickler(pickle.Pickler):
        def reducer_override(self, obj):
            if not isinstance(obj, enum.Enum):
                return NotImplemented
            if form == BY_VALUE:
                return type(obj), (obj.value,)
            if getattr(sys.modules.get(type(obj).__module__), obj.name, None) is obj:
                return obj.name  # a global_enum member: `signal.SIGTERM`, a GLOBAL of its module
            return getattr, (type(obj), obj.name)

    return EnumFormPickler


def save_with_enums(obj, path: str | Path, form: str) -> None:
    """`torch.save(obj, path)` with every enum member pickled in `form`."""
    module = types.ModuleType(f"pickle_enums_{form}")  # torch.save asks a pickle module for its Pickler
    module.Pickler = _pickler_of(form)
    torch.save(obj, path, pickle_module=module)


def torch_files(folder: str | Path) -> list[Path]:
    """The files of a checkpoint folder that hold Megatron's args: rank files and common.pt."""
    folder = Path(folder)
    return sorted([*folder.rglob("model_optim_rng.pt"), *folder.rglob("common.pt")])


def rewrite_enums(folder: str | Path, form: str) -> list[Path]:
    """Re-save every torch file of `folder` (a checkpoint this test session built: trusted, so
    torch.load may unpickle it) with its enums in `form`; returns the files rewritten."""
    files = torch_files(folder)
    for path in files:
        save_with_enums(torch.load(path, map_location="cpu", weights_only=False), path, form)
    return files


def enum_form_of(path: str | Path) -> str | None:
    """The form the enums of one torch file are pickled in, read from its opcodes (nothing is
    unpickled): BY_NAME if any is by name, else BY_VALUE if it names an enum class, else None."""
    with zipfile.ZipFile(path) as zf:
        data = zf.read(next(n for n in zf.namelist() if n.endswith("data.pkl")))
    globals_ = {arg for op, arg, _ in pickletools.genops(data) if op.name == "GLOBAL"}
    if {"builtins getattr", "__builtin__ getattr"} & globals_ or any(g.startswith("signal SIG") for g in globals_):
        return BY_NAME
    enum_modules = ("megatron.core.transformer.enums ", "megatron.core.enums ", "signal Signals")
    return BY_VALUE if any(g.startswith(enum_modules) for g in globals_) else None
