"""Enums in args, in the three forms Pythons pickle them: by value (`AttnBackend(5)`), by name
(`getattr(AttnBackend, 'auto')`) and as a module global (`signal.SIGTERM`). The files are written
in each form explicitly (testing/enum_forms.py), whatever this interpreter would write.

`getattr` is honoured only as an allowed enum class's member; every other shape a hostile file
may build (another class, a dunder, a chain through `__init__.__globals__` to `os.system`, a call
of the result) reads as an inert `Refused` record that is never written back."""

from __future__ import annotations

import argparse
import importlib
import pickle
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

from mcore_proxy.checkpoint.safe_globals import (
    ENUM_MEMBERS,
    WRITE_ALLOWED,
    Refused,
    check_writable,
    enum_member_name,
    unresolved_class,
    unsafe_args,
)
from mcore_proxy.checkpoint.torchfile import TorchFile, load_weights_only, save_object
from mcore_proxy.core.errors import CheckpointError
from mcore_proxy.testing.enum_forms import BY_NAME, BY_VALUE, FORMS, enum_form_of, save_with_enums
from mcore_proxy.testing.hostile import hostile_getattrs, os_system_through_enum

ATTN = ("megatron.core.transformer.enums", "AttnBackend")


def megatron_enum_args():
    from megatron.core.enums import Fp8Recipe
    from megatron.core.transformer.enums import AttnBackend, CudaGraphScope

    return argparse.Namespace(
        attention_backend=AttnBackend.auto,
        exit_signal=signal.SIGTERM,
        fp8_recipe=Fp8Recipe.blockwise,
        cuda_graph_scope=[CudaGraphScope.attn],
        num_layers=4,
    )


def test_the_member_table_is_megatron_cores_and_linuxs():
    for (module, name), members in ENUM_MEMBERS.items():
        assert (module, name) in WRITE_ALLOWED
        cls = getattr(importlib.import_module(module), name)
        assert members == {k: v.value for k, v in cls.__members__.items() if v.name == k}, (module, name)


@pytest.mark.parametrize("form", FORMS)
def test_each_form_reads_as_the_same_members_and_writes_by_value(tmp_path, form):
    src, out = tmp_path / "src.pt", tmp_path / "out.pt"
    save_with_enums({"args": megatron_enum_args(), "w": torch.arange(3.0)}, src, form)
    assert enum_form_of(src) == form
    args = TorchFile(src).obj["args"]
    assert args.attention_backend == unresolved_class(*ATTN)(5)
    assert enum_member_name(args.attention_backend) == "auto" and enum_member_name(args.exit_signal) == "SIGTERM"
    assert enum_member_name(args.fp8_recipe) == "blockwise" and enum_member_name(args.cuda_graph_scope[0]) == "attn"
    assert not unsafe_args(args)  # nothing to drop: every enum is written
    save_object(TorchFile(src).obj, out)
    assert enum_form_of(out) == BY_VALUE
    for loaded in (load_weights_only(src), load_weights_only(out), torch.load(out, weights_only=False)):
        assert vars(loaded["args"]) == vars(megatron_enum_args())


def test_enum_members_built_here_are_written_by_value(tmp_path):
    """The writer's own form, whatever this interpreter's pickle would choose."""
    path = tmp_path / "built.pt"
    save_object({"args": megatron_enum_args()}, path)
    assert enum_form_of(path) == BY_VALUE
    assert vars(load_weights_only(path)["args"]) == vars(megatron_enum_args())


def test_this_interpreters_own_form_reads_too(tmp_path):
    path = tmp_path / "native.pt"
    torch.save({"args": megatron_enum_args()}, path)
    assert enum_form_of(path) in FORMS
    assert TorchFile(path).obj["args"].attention_backend == unresolved_class(*ATTN)(5)


# -- hostile getattr shapes --------------------------------------------------------------------


def test_the_chain_is_real(tmp_path):
    """Unpickled by Python's own pickle, the chain runs the command: the payload is not a toy."""
    marker = tmp_path / "ran"
    data = pickle.dumps(os_system_through_enum(marker), protocol=2)
    code = "import pickle, sys; pickle.loads(sys.stdin.buffer.read())"
    subprocess.run([sys.executable, "-c", code], input=data, check=True, timeout=120)
    assert marker.exists()


@pytest.mark.parametrize(
    "shape",
    [
        "chain to os.system",
        "a dunder of an allowed enum",
        "not a member",
        "another class",
        "a getattr of a getattr",
        "getattr of a member",
    ],
)
def test_hostile_getattr_reads_as_refused_and_is_never_written(tmp_path, shape):
    marker = tmp_path / "ran"
    path = tmp_path / "evil.pt"
    args = argparse.Namespace(num_layers=4, attention_backend=hostile_getattrs(marker)[shape])
    torch.save({"args": args, "w": torch.ones(2)}, path)
    read = TorchFile(path).obj
    refused = read["args"].attention_backend
    assert isinstance(refused, Refused) and refused.where == str(path)
    assert not marker.exists()
    why = unsafe_args(read["args"])["attention_backend"]
    assert str(path) in why and "refused" in why
    with pytest.raises(CheckpointError, match="attention_backend holds .*refused.*needs that field"):
        unsafe_args(read["args"], needed=("attention_backend",))
    with pytest.raises(CheckpointError, match="model entry x holds"):
        check_writable(refused, "model entry x")
    with pytest.raises(CheckpointError, match="refusing to write"):
        save_object({"x": refused}, tmp_path / "out.pt")
    # torch's own weights_only loader refuses the file too (nothing runs there either)
    with pytest.raises(pickle.UnpicklingError):
        load_weights_only(path)
    assert not marker.exists()


def test_the_chain_is_described_as_the_file_spells_it(tmp_path):
    path = tmp_path / "evil.pt"
    torch.save({"args": argparse.Namespace(x=os_system_through_enum(tmp_path / "ran"))}, path)
    refused = TorchFile(path).obj["args"].x
    assert refused.what == (
        "getattr(megatron.core.transformer.enums.AttnBackend, '__init__')"
        ".__globals__.get(...).modules.get(...).system(...)"
    )


def test_a_called_member_is_an_unreadable_file_not_a_call(tmp_path):
    path = tmp_path / "evil.pt"
    torch.save({"args": argparse.Namespace(x=hostile_getattrs(tmp_path / "ran")["a called member"])}, path)
    with pytest.raises(CheckpointError, match=f"{path}: not a readable torch checkpoint .*not callable"):
        TorchFile(path)


def test_the_reader_never_imports_what_it_reads_by_name(tmp_path):
    """Reading by name needs only the member table: megatron is never imported."""
    src = tmp_path / "by_name.pt"
    save_with_enums({"args": megatron_enum_args()}, src, BY_NAME)
    script = textwrap.dedent(f"""
        import sys
        from mcore_proxy.checkpoint.torchfile import TorchFile
        args = TorchFile({str(src)!r}).obj["args"]
        print(repr(args.attention_backend), repr(args.exit_signal))
        assert not [m for m in sys.modules if m.startswith("megatron")]
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "<megatron.core.transformer.enums.AttnBackend.auto> <signal.Signals.SIGTERM>" in done.stdout


def test_the_torch_load_context_leaves_what_was_registered_before():
    """megatron-core registers its safe globals at import; leaving the context must keep them
    (torch's own context removes everything it was given)."""
    import megatron.core  # noqa: F401
    from megatron.core.transformer.enums import AttnBackend

    from mcore_proxy.checkpoint.safe_globals import torch_load_allowing

    assert AttnBackend in torch.serialization.get_safe_globals()
    with torch_load_allowing():
        assert "builtins.getattr" in repr(torch.serialization.get_safe_globals())
    assert AttnBackend in torch.serialization.get_safe_globals()
    assert "builtins.getattr" not in repr(torch.serialization.get_safe_globals())
