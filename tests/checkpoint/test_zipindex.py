"""The zip directory read without zipfile's objects (`checkpoint/zipindex.py`): on files torch and the
library's writer make, and on zip64 archives zipfile itself writes, it reads exactly what zipfile
reads; on any other layout it says None, and `TorchFile` lets zipfile read the file as before."""

from __future__ import annotations

import struct
import zipfile

import pytest
import torch

from mcore_proxy.checkpoint.torchfile import TorchFile, save_object
from mcore_proxy.checkpoint.zipindex import read_directory, read_stored

FIELDS = (
    "filename",
    "header_offset",
    "file_size",
    "compress_size",
    "compress_type",
    "CRC",
    "flag_bits",
    "orig_filename",
)


def assert_reads_like_zipfile(path) -> None:
    with open(path, "rb") as fh, zipfile.ZipFile(path) as zf:
        directory = read_directory(fh)
        assert directory is not None
        ours = [tuple(getattr(m, f) for f in FIELDS) for m in directory.members]
        theirs = [tuple(getattr(i, f) for f in FIELDS) for i in zf.infolist()]
        assert ours == theirs and directory.start_dir == zf.start_dir and directory.end == path.stat().st_size
        for member, info in zip(directory.members, zf.infolist()):
            assert read_stored(fh, member) == zf.read(info)


@pytest.mark.parametrize("members", [1, 300])
def test_torch_save_files(tmp_path, members):
    path = tmp_path / "model_optim_rng.pt"
    torch.save({"args": {"n": list(range(5000))}, **{f"w{i}": torch.randn(i + 1) for i in range(members)}}, path)
    assert_reads_like_zipfile(path)


def test_the_library_writers_files_and_a_megatron_rank_file(tmp_path, megatron_ckpt):
    path = tmp_path / "written.pt"
    save_object({"model": {"a": torch.zeros(4, 3, dtype=torch.bfloat16), "b": None}}, path)
    assert_reads_like_zipfile(path)
    ckpt, _ = megatron_ckpt("seq_tp2_pp2_ep2")
    assert_reads_like_zipfile(next(ckpt.rglob("model_optim_rng.pt")))


def test_zip64_fields_written_by_zipfile(tmp_path, monkeypatch):
    """Members past 4 GiB carry their sizes and offsets in the zip64 extra field; zipfile writes that
    form for any member beyond its limit, so a lowered limit makes a small file of that form."""
    monkeypatch.setattr(zipfile, "ZIP64_LIMIT", 100)
    path = tmp_path / "zip64.pt"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as zf:
        for i in range(3):
            zf.writestr(f"archive/data/{i}", bytes(range(256)) * (i + 1))
    monkeypatch.undo()
    with open(path, "rb") as fh:
        data = fh.read()
    assert b"PK\x06\x06" in data  # the zip64 end record
    assert_reads_like_zipfile(path)


def _torch_file(tmp_path, name="f.pt"):
    path = tmp_path / name
    torch.save({"w": torch.arange(6.0)}, path)
    return path


def test_other_layouts_are_left_to_zipfile(tmp_path):
    with_comment = _torch_file(tmp_path, "comment.pt")
    with zipfile.ZipFile(with_comment, "a") as zf:
        zf.comment = b"copied by a tool"
    prefixed = tmp_path / "prefixed.pt"
    prefixed.write_bytes(b"#!junk\n" + _torch_file(tmp_path).read_bytes())
    encrypted = tmp_path / "encrypted.pt"
    data = bytearray(_torch_file(tmp_path).read_bytes())
    entry = data.rindex(b"PK\x01\x02")
    data[entry + 8] |= 0x1  # the general-purpose flag's "encrypted" bit
    encrypted.write_bytes(bytes(data))
    for path in (with_comment, prefixed, encrypted):
        with open(path, "rb") as fh:
            assert read_directory(fh) is None, path
    # zipfile still reads what it always read
    for path in (with_comment, prefixed):
        assert TorchFile(path).obj["w"].load().tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]


def test_damaged_member_bytes_are_refused(tmp_path):
    path = _torch_file(tmp_path)
    with open(path, "rb") as fh:
        directory = read_directory(fh)
    pkl = next(m for m in directory.members if m.filename.endswith("data.pkl"))
    data = bytearray(path.read_bytes())
    name_len, extra_len = struct.unpack_from("<HH", data, pkl.header_offset + 26)
    data[pkl.header_offset + 30 + name_len + extra_len + 10] ^= 0xFF  # a byte of the pickle
    path.write_bytes(bytes(data))
    with open(path, "rb") as fh, pytest.raises(zipfile.BadZipFile, match="CRC"):
        read_stored(fh, pkl)
    data[pkl.header_offset + 31] ^= 0xFF  # the local header's name
    path.write_bytes(bytes(data))
    with open(path, "rb") as fh, pytest.raises(zipfile.BadZipFile, match="differ"):
        read_stored(fh, pkl)
