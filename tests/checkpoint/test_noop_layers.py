"""MindSpeed `--noop-layers` checkpoints are refused with one sentence (issue 10, step 1).

The checkpoints are derived: MindSpeed cannot be installed. `testing/noop_layers.py` inserts noop
layers into a megatron-core-saved legacy checkpoint as MindSpeed saves them (args num_layers counts
them, args noop_layers holds their ids, rank files have gaps in `decoder.layers.{local}`). Before
the refusal, the all-MoE derivation failed as "MoE layer 1 holds 0 experts ... incomplete" and the
one whose noop ids sit on dense positions was read silently (inspect listed 6 layers, convert wrote
a proxy nobody checked)."""
from __future__ import annotations

import argparse
import re

import pytest
import torch

from mcore_proxy.cli import main
from mcore_proxy.testing.dist_ckpt import iteration_dir
from mcore_proxy.testing.noop_layers import derive_noop_checkpoint

pytestmark = [pytest.mark.megatron]

LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.*)$")


def _rank_files(ckpt):
    return {f.parent.name: f for f in sorted(iteration_dir(ckpt).glob("mp_rank_*/model_optim_rng.pt"))}


def _load(f):
    return torch.load(f, map_location="cpu", weights_only=False)   # this package's own fixtures


@pytest.fixture(scope="module")
def all_moe(megatron_ckpt, tmp_path_factory):
    """seq_tp2_pp2_ep2 (4 MoE layers, PP 2) with noop layers 1 and 5 of 6: stage 0 holds global
    0, noop, 2; stage 1 holds 3, 4, noop (a gap inside a stage and one at its end)."""
    source, _ = megatron_ckpt("seq_tp2_pp2_ep2")
    return source, derive_noop_checkpoint(source, tmp_path_factory.mktemp("noop") / "ckpt", {1, 5})


@pytest.fixture(scope="module")
def dense_gaps(megatron_ckpt, tmp_path_factory):
    """deepseek_like_pp2_uneven (dense layer 0, then 3 MoE layers; stages 1 + 3) with noop layers
    1 and 2 of 6, so the noop ids fall on dense positions of the MoE pattern."""
    source, _ = megatron_ckpt("deepseek_like_pp2_uneven")
    return source, derive_noop_checkpoint(source, tmp_path_factory.mktemp("noop-dense") / "ckpt", {1, 2})


def test_derivation_renames_only(all_moe):
    """The derived rank files hold the source's tensors, renumbered around the gaps; args say so."""
    source, derived = all_moe
    src, out = _rank_files(source), _rank_files(derived)
    assert src.keys() == out.keys() and len(src) == 8
    for name, f in src.items():
        a, b = _load(f), _load(out[name])
        assert b["args"].num_layers == 6 and b["args"].noop_layers == {1, 5}
        stage = int(name.split("_")[3])
        real_local = {0: [0, 2], 1: [0, 1]}[stage]   # local indices that carry tensors
        locals_seen = {int(m.group(1)) for k in b["model"] if (m := LAYER.match(k))}
        assert locals_seen == set(real_local)
        back = {}
        for k, v in b["model"].items():
            if m := LAYER.match(k):
                k = f"decoder.layers.{real_local.index(int(m.group(1)))}.{m.group(2)}"
            back[k] = v
        assert back.keys() == a["model"].keys()
        for k, v in a["model"].items():
            assert torch.equal(v, back[k]) if isinstance(v, torch.Tensor) else v == back[k]


@pytest.mark.parametrize("case", ["all_moe", "dense_gaps"])
def test_inspect_refuses(case, request, capsys):
    _, derived = request.getfixturevalue(case)
    assert main(["inspect", str(derived)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    ids = {"all_moe": "[1, 5]", "dense_gaps": "[1, 2]"}[case]
    assert str(iteration_dir(derived)) in err and f"noop_layers {ids}" in err, err
    assert "does not read yet" in err and "without --noop-layers" in err, err


def test_convert_refuses_and_writes_nothing(dense_gaps, tmp_path, capsys):
    """The case that used to be converted silently: exit 2, no output folder."""
    _, derived = dense_gaps
    out = tmp_path / "proxy"
    assert main(["convert", str(derived), "-o", str(out), "--target-pp", "1", "--target-ep", "1"]) == 2
    assert "noop_layers [1, 2]" in capsys.readouterr().err
    assert not out.exists()


def test_raw_string_and_bad_ids(all_moe, tmp_path, capsys):
    """args may hold the raw "1,5" string (before MindSpeed's validation); a bad id is named."""
    import shutil

    _, derived = all_moe
    for value, expect in (("1,5", "noop_layers [1, 5]"), ("1,9", "every id must be in 0..5")):
        copy = tmp_path / value.replace(",", "_")
        shutil.copytree(derived, copy)
        for f in _rank_files(copy).values():
            obj = _load(f)
            obj["args"] = argparse.Namespace(**{**vars(obj["args"]), "noop_layers": value})
            torch.save(obj, f)
        assert main(["inspect", str(copy)]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and expect in err and str(iteration_dir(copy)) in err, err


def test_empty_noop_layers_still_read(megatron_ckpt, tmp_path, capsys):
    """An empty set (MindSpeed without --noop-layers after validation) is no noop layer at all."""
    import shutil

    source, _ = megatron_ckpt("seq_tp2_pp2_ep2")
    copy = tmp_path / "ckpt"
    shutil.copytree(source, copy)
    for f in _rank_files(copy).values():
        obj = _load(f)
        obj["args"].noop_layers = set()
        torch.save(obj, f)
    assert main(["inspect", str(copy)]) == 0
    assert "4 decoder" in capsys.readouterr().out
