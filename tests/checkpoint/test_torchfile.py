"""The restricted reader: args load without megatron importable and pickle back to the same
class paths; no foreign code runs while reading."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import zipfile

import torch

from mcore_proxy.checkpoint.safe_globals import Unresolved, unresolved_class
from mcore_proxy.checkpoint.torchfile import TorchFile, save_object

BLOCK_MEGATRON = textwrap.dedent("""
    import sys
    class Block:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in ("megatron", "mindspeed", "torch_npu"):
                raise ImportError(f"{name} is blocked in this test")
    sys.meta_path.insert(0, Block())
""")


def test_reads_and_rewrites_args_without_megatron(megatron_ckpt, tmp_path):
    ckpt, _ = megatron_ckpt("seq_tp2_etp1_ep2")
    out = tmp_path / "out"
    script = BLOCK_MEGATRON + textwrap.dedent(f"""
        from mcore_proxy.checkpoint import open_checkpoint
        from mcore_proxy.checkpoint import write_checkpoint
        from mcore_proxy.checkpoint.target import resolve_target
        view = open_checkpoint({str(ckpt)!r})
        print(repr(view.args.attention_backend))
        write_checkpoint(view, {str(out)!r}, resolve_target(view, tp=1, ep=2), progress=False)
        assert "megatron" not in sys.modules
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "megatron.core.transformer.enums.AttnBackend" in done.stdout
    # here megatron is importable: the rewritten args hold the real enum again
    from megatron.core.transformer.enums import AttnBackend

    state = torch.load(out / "iter_0000010" / "mp_rank_00_001" / "model_optim_rng.pt", weights_only=False)
    assert state["args"].attention_backend is AttnBackend.auto


class Boom:
    """An object whose unpickling would run code: the reader must never call it."""

    def __reduce__(self):
        return (print, ("foreign code ran",))


def test_foreign_callables_are_never_called(tmp_path, capsys):
    path = tmp_path / "evil.pt"
    torch.save({"model": {"w": torch.ones(2)}, "payload": Boom()}, path)
    obj = TorchFile(path).obj
    assert "foreign code ran" not in capsys.readouterr().out
    assert isinstance(obj["payload"], Unresolved) and obj["payload"]._name == "print"
    assert torch.equal(obj["model"]["w"].load(), torch.ones(2))


def test_unresolved_objects_pickle_back_under_their_class_path(tmp_path):
    path = tmp_path / "args.pt"
    thing = unresolved_class("megatron.core.transformer.enums", "AttnBackend")
    save_object({"x": thing(3)}, path)
    with zipfile.ZipFile(path) as z:
        data = z.read(next(n for n in z.namelist() if n.endswith("data.pkl")))
    assert b"cmegatron.core.transformer.enums\nAttnBackend\n" in data  # a GLOBAL opcode naming the class
    again = TorchFile(path).obj["x"]
    assert type(again) is thing and again._args == (3,)


def test_globals_off_the_allow_list_are_never_written(tmp_path):
    import pytest

    from mcore_proxy.core.errors import CheckpointError

    for module, name in (("os", "system"), ("some.module", "Thing"), ("megatron.training.utils", "print_rank_0")):
        with pytest.raises(CheckpointError, match=f"refusing to write the global {module}.{name}"):
            save_object({"x": unresolved_class(module, name)("touch x")}, tmp_path / "x.pt")


def test_a_one_element_tensor_after_a_stride_of_one_reads_back(tmp_path):
    # shapes and strides are interned to keep a deep index small: a stride (1,) seen first must
    # not come back as the shape of a 1-element tensor (it did, and `load` failed on `numel`)
    path = tmp_path / "one.pt"
    tensors = {"vector": torch.arange(3.0), "scalar_like": torch.tensor([7.0])}
    torch.save({"model": tensors}, path)
    model = TorchFile(path).obj["model"]
    for name, want in tensors.items():
        assert torch.equal(model[name].load(), want)


def test_metadata_span_covers_what_a_parse_reads(tmp_path):
    """`metadata_span` (how much `open_many` reads ahead of files like this one): from the start
    through data.pkl's last byte, and the whole zip directory at the end."""
    import struct

    from mcore_proxy.checkpoint.torchfile import read_ahead_sizes

    path = tmp_path / "model_optim_rng.pt"
    torch.save({"args": {"n": list(range(2000))}, "w": torch.randn(1 << 16)}, path)
    with zipfile.ZipFile(path) as z:
        pkl = next(i for i in z.infolist() if i.filename.endswith("data.pkl"))
        directory = path.stat().st_size - z.start_dir
    with open(path, "rb") as fh:
        fh.seek(pkl.header_offset + 26)
        name_len, extra_len = struct.unpack("<HH", fh.read(4))
    pkl_end = pkl.header_offset + 30 + name_len + extra_len + pkl.file_size
    head, tail = TorchFile(path).metadata_span
    assert pkl_end <= head <= pkl_end + 64 and tail == directory
    ahead = read_ahead_sizes([TorchFile(path)])  # a quarter more, in whole pages
    assert all(n % 4096 == 0 and 1.25 * m <= n < 1.25 * m + 4096 for n, m in zip(ahead, (head, tail)))
    assert read_ahead_sizes([]) == ()
