"""Hostile checkpoints: nothing read from a checkpoint ever runs, nothing callable is written.

Each payload, if it ever ran, would create a marker file; every test asserts it does not exist.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil

import pytest
import torch

from mcore_proxy.cli import main
from mcore_proxy.testing.hostile import Call, eval_escape

FIXTURE = "seq_tp2_pp2_ep2"


def system_call(marker) -> Call:
    """Pickles as a call of os.system: what a hostile `args` entry looks like on disk."""
    return Call(os.system, f"touch {marker}")


def rank_files(ckpt):
    return sorted(ckpt.rglob("model_optim_rng.pt"))


def edit_rank_files(ckpt, edit) -> None:
    """Rewrite every rank file of a private copy (trusted test code may use torch.load here)."""
    for f in rank_files(ckpt):
        state = torch.load(f, weights_only=False)
        edit(state)
        torch.save(state, f)


@pytest.fixture
def copy_of(megatron_ckpt, tmp_path):
    def make(name=FIXTURE):
        ckpt, _ = megatron_ckpt(name)
        dst = tmp_path / "ckpt"
        shutil.copytree(ckpt, dst)
        return dst

    return make


def run(capsys, *argv) -> tuple[int, str, str]:
    capsys.readouterr()
    code = main([str(a) for a in argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_layer_pattern_string_is_never_evaluated(copy_of, proxy_plan, tmp_path, capsys, digest):
    ckpt = copy_of()
    marker = tmp_path / "ran"
    assert eval(eval_escape(marker), {"__builtins__": {}}, {}) == [1] * 4  # noqa: S307 - the old code's eval runs it
    assert marker.exists()
    marker.unlink()
    edit_rank_files(ckpt, lambda s: setattr(s["args"], "moe_layer_freq", eval_escape(marker)))
    plan_path, _ = proxy_plan(FIXTURE)
    before = digest(ckpt)
    for argv in (
        ["inspect", ckpt],
        ["convert", ckpt, "--plan", plan_path, "-o", tmp_path / "out"],
        ["verify", "--orig", ckpt, "--proxy", ckpt, "--plan", plan_path],
    ):
        code, _, err = run(capsys, *argv)
        assert code == 2, err
        assert "is not a layer pattern" in err and "moe_layer_freq" in err and len(err.strip().splitlines()) == 1
    assert not marker.exists() and not (tmp_path / "out").exists()
    assert digest(ckpt) == before


def test_pickled_call_in_args_is_dropped_and_the_proxy_runs_nothing(copy_of, proxy_plan, tmp_path, capsys):
    ckpt = copy_of()
    marker = tmp_path / "ran"
    edit_rank_files(ckpt, lambda s: setattr(s["args"], "post_load_hook", system_call(marker)))
    plan_path, _ = proxy_plan(FIXTURE)
    code, _, err = run(capsys, "inspect", ckpt)
    assert code == 0, err
    out = tmp_path / "proxy"
    code, text, err = run(capsys, "convert", ckpt, "--plan", plan_path, "-o", out, "--target-ep", "2")
    assert code == 0, err
    assert "args post_load_hook was dropped: it holds posix.system" in text
    manifest = json.loads((out / "manifest.json").read_text())
    assert "posix.system" in manifest["dropped_args"]["post_load_hook"]
    for f in rank_files(out):
        raw = f.read_bytes()
        assert b"system" not in raw and b"posix" not in raw
        state = torch.load(f, weights_only=False)  # as Megatron loads it
        assert not hasattr(state["args"], "post_load_hook")
    code, text, err = run(capsys, "verify", "--orig", ckpt, "--proxy", out, "--plan", plan_path)
    assert code == 0, err
    assert not marker.exists()


def test_a_needed_args_field_holding_a_call_is_refused(copy_of, tmp_path, capsys):
    ckpt = copy_of()
    marker = tmp_path / "ran"
    edit_rank_files(ckpt, lambda s: setattr(s["args"], "transformer_impl", system_call(marker)))
    out = tmp_path / "out"
    code, _, err = run(capsys, "convert", ckpt, "-o", out)
    assert code == 2
    assert "args transformer_impl holds posix.system" in err and "the model needs that field" in err
    assert not out.exists() and not marker.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out")]


def test_a_model_entry_holding_a_call_is_refused(copy_of, tmp_path, capsys):
    ckpt = copy_of()
    marker = tmp_path / "ran"
    key = "decoder.layers.0.self_attention.linear_proj._extra_state"
    edit_rank_files(ckpt, lambda s: s["model"].__setitem__(key, system_call(marker)))
    out = tmp_path / "out"
    code, _, err = run(capsys, "convert", ckpt, "-o", out, "--format", "torch_dist")
    assert code == 2 and "holds posix.system" in err and "linear_proj._extra_state" in err, err
    assert not out.exists() and not marker.exists()


@pytest.mark.parametrize("name", ["../../escaped.distcp", "/etc/passwd", "sub/../../x.distcp", ""])
def test_torch_dist_data_files_stay_inside_the_folder(megatron_ckpt, tmp_path, capsys, name):
    ckpt, _ = megatron_ckpt(FIXTURE)
    dist = tmp_path / "dist"
    assert main(["convert", str(ckpt), "-o", str(dist), "--format", "torch_dist"]) == 0
    md_path = next(dist.rglob(".metadata"))
    with open(md_path, "rb") as fh:
        md = pickle.load(fh)  # trusted: written by this test's own conversion
    first = next(iter(md.storage_data))
    md.storage_data[first].relative_path = name
    with open(md_path, "wb") as fh:
        pickle.dump(md, fh)
    code, _, err = run(capsys, "inspect", dist)
    assert code == 2
    assert "not a file of this folder" in err and len(err.strip().splitlines()) == 1


def test_huge_declared_sizes_are_refused_before_allocating(copy_of, capsys):
    """A rank file whose pickle declares a tensor of 2**50 elements over a 16-byte storage member."""
    import time

    from mcore_proxy.checkpoint.torchfile import TorchFileWriter, TensorRecord

    ckpt = copy_of()
    f = rank_files(ckpt)[0]
    state = torch.load(f, weights_only=False)
    writer = TorchFileWriter(f)
    record = writer.add(torch.zeros(4))
    key = next(k for k, v in state["model"].items() if isinstance(v, torch.Tensor))
    state["model"] = {key: TensorRecord(record.key, torch.float32, torch.Size([1 << 25, 1 << 25]))}
    writer.close({"args": state["args"], "model": state["model"], "checkpoint_version": 3.0})
    start = time.perf_counter()
    code, _, err = run(capsys, "inspect", ckpt)
    assert code == 2 and str(f) in err and "declares 1125899906842624 elements" in err, err
    assert time.perf_counter() - start < 10
