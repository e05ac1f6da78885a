"""Rank files parsed in worker processes (`torchfile.open_many`) index a checkpoint exactly as
parsing them in one process does; a damaged file still gets its one sentence, and a file whose
model state holds more than tensors and plain values is parsed by the parent."""

from __future__ import annotations

import io
import shutil

import pytest
import torch

from mcore_proxy.checkpoint import open_checkpoint
from mcore_proxy.checkpoint.safe_globals import Unresolved
from mcore_proxy.checkpoint.torchfile import model_payload, open_many
from mcore_proxy.cli import main

FIXTURES = ["seq_tp2_pp2_ep2", "grouped_ep4", "deepseek_like_pp2_uneven"]


def _index(view) -> dict:
    return {
        n: (view.shape(n), view.dtype_name(n), view.byte_ranges(n) if view.shape(n) is not None else None)
        for n in view.names()
    }


@pytest.mark.parametrize("fixture", FIXTURES)
def test_workers_index_as_one_process_does(megatron_ckpt, fixture, monkeypatch):
    ckpt, _ = megatron_ckpt(fixture)
    monkeypatch.setenv("MCORE_PROXY_INDEX_WORKERS", "0")
    serial = open_checkpoint(ckpt)
    monkeypatch.setenv("MCORE_PROXY_INDEX_WORKERS", "2")
    parallel = open_checkpoint(ckpt)
    assert serial.names() == parallel.names() and _index(serial) == _index(parallel)
    assert serial.info == parallel.info
    for name in [n for n in serial.names() if ".experts." in n][:4] + [serial.names()[0]]:
        assert torch.equal(serial.get(name), parallel.get(name)), name


def test_a_truncated_rank_file_read_by_a_worker_is_named(megatron_ckpt, tmp_path, monkeypatch, capsys):
    ckpt, _ = megatron_ckpt("seq_tp2_pp2_ep2")
    copy = tmp_path / "ckpt"
    shutil.copytree(ckpt, copy)
    # stage representatives are parsed by the parent; this file (EP rank 1) by a worker
    f = copy / "iter_0000010" / "mp_rank_01_001_001" / "model_optim_rng.pt"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    monkeypatch.setenv("MCORE_PROXY_INDEX_WORKERS", "2")
    assert main(["inspect", str(copy)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and str(f) in err and "truncated" in err, err


def test_objects_other_than_tensors_never_cross_back_from_a_worker(tmp_path):
    """An `_extra_state` of older TransformerEngine (an io.BytesIO) is read as an inert object by
    the parent's own parse: a worker sends only tensors' places and plain values."""
    plain, other = tmp_path / "plain.pt", tmp_path / "other.pt"
    torch.save({"model": {"w": torch.arange(6.0).view(2, 3), "x._extra_state": None}}, plain)
    torch.save({"model": {"w": torch.ones(2), "x._extra_state": io.BytesIO(b"fp8 meta")}}, other)
    assert model_payload(str(other)) is None and model_payload(str(plain)) is not None
    first, second = open_many([plain, other], workers=2)
    assert first.obj["model"]["x._extra_state"] is None
    assert torch.equal(first.obj["model"]["w"].load(), torch.arange(6.0).view(2, 3))
    assert isinstance(second.obj["model"]["x._extra_state"], Unresolved)
    assert torch.equal(second.obj["model"]["w"].load(), torch.ones(2))
