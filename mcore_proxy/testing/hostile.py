"""Pickles that run code when Python's own unpickler reads them: what a hostile checkpoint holds.

`Call(fn, *args)` pickles as a call of `fn`; `Get(obj, name)` as `getattr(obj, name)`. Chained,
they reach anything: `os_system_through_enum` goes from an allowed enum class to `os.system` by
getattr and calls only (docs/safe-loading.md). `eval_escape` is the string a layer pattern would
hold to run a command under `eval`. Tests and the fuzz campaign plant these in checkpoints and
check that nothing runs.
"""

from __future__ import annotations

import argparse
from pathlib import Path


class Call:
    """Pickles as `fn(*args)`: a call of a function, or of what earlier opcodes built."""

    def __init__(self, fn, *args):
        self.fn, self.args = fn, args

    def __reduce__(self):
        return self.fn, self.args


class Get:
    """Pickles as `getattr(obj, name)`."""

    def __init__(self, obj, name):
        self.obj, self.name = obj, name

    def __reduce__(self):
        return getattr, (self.obj, self.name)

    def __call__(self):  # pickle checks that a reduce's function is callable; it is never called
        raise AssertionError("a pickling placeholder")


def eval_escape(marker: str | Path) -> str:
    """A Megatron layer pattern (`moe_layer_freq`) that runs a shell command under `eval`, even
    with empty `__builtins__`, and evaluates to a valid pattern `[1]*4` afterwards."""
    return (
        "[c for c in ().__class__.__base__.__subclasses__() if c.__name__ == '_wrap_close'][0]"
        f".__init__.__globals__['system']('touch {marker}') or [1]*4"
    )


def os_system_through_enum(marker: str | Path):
    """`AttnBackend.__init__.__globals__.get('sys').modules.get('os').system('touch <marker>')`:
    from an allowed enum class to a shell command, by getattr and calls only."""
    from megatron.core.transformer.enums import AttnBackend

    sys_module = Call(Get(Get(Get(AttnBackend, "__init__"), "__globals__"), "get"), "sys")
    os_module = Call(Get(Get(sys_module, "modules"), "get"), "os")
    return Call(Get(os_module, "system"), f"touch {marker}")


def hostile_getattrs(marker: str | Path) -> dict:
    """name -> an object pickling as one shape of getattr a restricted reader must refuse."""
    from megatron.core.transformer.enums import AttnBackend

    return {
        "chain to os.system": os_system_through_enum(marker),
        "a dunder of an allowed enum": Get(AttnBackend, "__class__"),
        "not a member": Get(AttnBackend, "mro"),
        "another class": Get(argparse.Namespace, "__init__"),
        "a getattr of a getattr": Get(Get(AttnBackend, "__init__"), "__globals__"),
        "getattr of a member": Get(AttnBackend.auto, "_value_"),
        "a called member": Call(Get(AttnBackend, "auto")),
    }
