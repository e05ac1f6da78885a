"""Bad input: one sentence naming the file and the fix, exit code 2, no output left behind."""

from __future__ import annotations

import shutil

import pytest
import torch

from mcore_proxy.checkpoint import open_checkpoint
from mcore_proxy.checkpoint import write_checkpoint
from mcore_proxy.checkpoint.target import resolve_target
from mcore_proxy.cli import main
from mcore_proxy.core.errors import CheckpointError, OutputError

FIXTURE = "seq_tp2_pp2_ep2"


@pytest.fixture
def broken_copy(megatron_ckpt, tmp_path):
    """A private copy of a real checkpoint to damage (the session fixture stays intact)."""
    ckpt, _ = megatron_ckpt(FIXTURE)
    copy = tmp_path / "ckpt"
    shutil.copytree(ckpt, copy)
    return copy


def run_inspect(path, capsys) -> tuple[int, str]:
    code = main(["inspect", str(path)])
    err = capsys.readouterr().err.strip()
    return code, err


def assert_one_sentence(err: str, *fragments: str) -> None:
    assert len(err.splitlines()) == 1, err
    assert "Traceback" not in err
    for f in fragments:
        assert f in err, (f, err)


def test_missing_rank_folder(broken_copy, capsys):
    shutil.rmtree(broken_copy / "iter_0000010" / "mp_rank_01_001_000")
    code, err = run_inspect(broken_copy, capsys)
    assert code == 2
    assert_one_sentence(err, "mp_rank_01_001_000", "missing", "copy it from the source")


@pytest.mark.parametrize("workers", ["0", "2"])  # parsed here, or by forked worker processes
@pytest.mark.parametrize("folder", ["mp_rank_00_000_000", "mp_rank_01_001_001"])  # a stage's first, another
def test_missing_rank_file(broken_copy, capsys, monkeypatch, workers, folder):
    monkeypatch.setenv("MCORE_PROXY_INDEX_WORKERS", workers)
    f = broken_copy / "iter_0000010" / folder / "model_optim_rng.pt"
    f.unlink()
    code, err = run_inspect(broken_copy, capsys)
    assert code == 2
    assert_one_sentence(err, str(f), "missing", "copy it from the source")


def test_truncated_rank_file(broken_copy, capsys):
    f = broken_copy / "iter_0000010" / "mp_rank_00_000_001" / "model_optim_rng.pt"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    code, err = run_inspect(broken_copy, capsys)
    assert code == 2
    assert_one_sentence(err, str(f), "truncated")


def test_truncated_tensor_bytes_found_when_read(broken_copy):
    """A member cut short inside an intact zip directory is caught when its bytes are read."""
    import zipfile

    f = broken_copy / "iter_0000010" / "mp_rank_00_000_000" / "model_optim_rng.pt"
    with zipfile.ZipFile(f) as z:
        infos = {i.filename: i for i in z.infolist()}
    view = open_checkpoint(broken_copy)
    with open(f, "r+b") as fh:  # zero the zip's record of one tensor member's data header
        member = next(i for n, i in infos.items() if n.endswith("/data/3"))
        fh.seek(member.header_offset)
        fh.write(b"\0" * 30)
    with pytest.raises(CheckpointError, match="truncated or damaged"):
        for name in view.names():
            view.get(name)


def test_shapes_disagree_between_ranks(broken_copy, capsys):
    f = broken_copy / "iter_0000010" / "mp_rank_01_000_001" / "model_optim_rng.pt"
    state = torch.load(f, weights_only=False)
    key = "decoder.layers.0.self_attention.linear_qkv.weight"
    state["model"][key] = state["model"][key][:-8].clone()
    torch.save(state, f)
    code, err = run_inspect(broken_copy, capsys)
    assert code == 2
    assert_one_sentence(err, "mp_rank_01_000_001", key, "different runs")


def test_empty_folder(tmp_path, capsys):
    code, err = run_inspect(tmp_path, capsys)
    assert code == 2
    assert_one_sentence(err, str(tmp_path), "empty")


def test_iteration_folders_without_tracker(broken_copy, capsys):
    (broken_copy / "latest_checkpointed_iteration.txt").unlink()
    code, err = run_inspect(broken_copy, capsys)
    assert code == 2
    assert_one_sentence(err, "iter_0000010", "no latest_checkpointed_iteration.txt", "directly")
    # the iteration folder itself is accepted
    assert main(["inspect", str(broken_copy / "iter_0000010")]) == 0


def test_output_folder_exists(megatron_ckpt, tmp_path, digest):
    ckpt, _ = megatron_ckpt(FIXTURE)
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    view = open_checkpoint(ckpt)
    with pytest.raises(OutputError, match="already exists"):
        write_checkpoint(view, out, resolve_target(view, ep=4), progress=False)
    assert [p.name for p in out.iterdir()] == ["keep.txt"]


def test_output_inside_input_is_refused(broken_copy):
    view = open_checkpoint(broken_copy)
    with pytest.raises(OutputError, match="inside the input"):
        write_checkpoint(view, broken_copy / "proxy", resolve_target(view), inputs=(broken_copy,), progress=False)


def test_target_that_does_not_divide(megatron_ckpt):
    ckpt, _ = megatron_ckpt(FIXTURE)
    view = open_checkpoint(ckpt)
    with pytest.raises(CheckpointError, match="expert-parallel size that divides"):
        resolve_target(view, ep=3)
    with pytest.raises(CheckpointError, match="does not divide over target TP=3"):
        resolve_target(view, tp=3)
