"""MindSpeed `--noop-layers` in legacy checkpoints (issue 10): read with their gaps, shown by
inspect; args that contradict the files, and torch_dist, refused with one sentence (exit 2).

The checkpoints are derived: MindSpeed cannot be installed. `testing/noop_layers.py` inserts noop
layers into a megatron-core-saved legacy checkpoint as MindSpeed saves them (args num_layers counts
them, args noop_layers holds their ids, rank files have gaps in `decoder.layers.{local}`). Before
this, the all-MoE derivation failed as "MoE layer 1 holds 0 experts ... incomplete" and the one
whose noop ids sit on dense positions was read as if they were dense layers without tensors.
tests/convert/test_convert_noop_layers.py converts them and runs the proxies."""

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
    return torch.load(f, map_location="cpu", weights_only=False)  # this package's own fixtures


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
        real_local = {0: [0, 2], 1: [0, 1]}[stage]  # local indices that carry tensors
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


@pytest.mark.parametrize(
    "case,line",
    [
        ("all_moe", "6 decoder: dense -, MoE 0,2-4, noop 1,5 (no tensors)"),
        ("dense_gaps", "6 decoder: dense 0, MoE 3-5, noop 1-2 (no tensors)"),
    ],
)
def test_inspect_shows_noop_layers(case, line, request, capsys):
    _, derived = request.getfixturevalue(case)
    assert main(["inspect", str(derived)]) == 0
    assert line in capsys.readouterr().out


def _with_args(ckpt, tmp_path, name, **changes):
    import shutil

    copy = tmp_path / name
    shutil.copytree(ckpt, copy)
    for f in _rank_files(copy).values():
        obj = _load(f)
        obj["args"] = argparse.Namespace(**{**vars(obj["args"]), **changes})
        torch.save(obj, f)
    return copy


def _one_sentence(capsys, *fragments):
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    for fragment in fragments:
        assert fragment in err, err


def test_raw_string_reads_the_same(all_moe, tmp_path, capsys):
    """args may hold the raw "1,5" string (before MindSpeed's validation)."""
    _, derived = all_moe
    copy = _with_args(derived, tmp_path, "raw", noop_layers="1,5")
    assert main(["inspect", str(copy)]) == 0
    assert "noop 1,5 (no tensors)" in capsys.readouterr().out


def test_args_that_contradict_the_files(megatron_ckpt, all_moe, tmp_path, capsys):
    source, derived = all_moe
    # a noop id beyond num_layers
    bad = _with_args(derived, tmp_path, "bad-id", noop_layers="1,9")
    assert main(["inspect", str(bad)]) == 2
    _one_sentence(capsys, "noop_layers '1,9'", "every id must be in 0..5")
    # args name a layer noop that has tensors
    holds = _with_args(source, tmp_path, "holds", noop_layers={1})
    assert main(["inspect", str(holds)]) == 2
    _one_sentence(capsys, "decoder.layers.1.", "layer 1, which args noop_layers [1] say has none")
    # the gaps without noop_layers in args: a layer without tensors
    gaps = _with_args(derived, tmp_path, "gaps", noop_layers=None)
    assert main(["inspect", str(gaps)]) == 2
    _one_sentence(capsys, str(iteration_dir(gaps)), "no rank file holds a tensor of decoder layer 1")


def test_torch_dist_with_noop_layers_refused(family_ckpt, tmp_path, capsys):
    """Not read from torch_dist (untested there): one sentence naming the checkpoint and the ids."""
    import shutil

    from mcore_proxy.checkpoint.torch_dist.reader import COMMON_FILE, resolve_dist_dir

    copy = tmp_path / "dist"
    shutil.copytree(family_ckpt["qwen3_moe"].torch_dist, copy)
    folder, _ = resolve_dist_dir(copy)
    common = _load(folder / COMMON_FILE)
    common["args"] = argparse.Namespace(**{**vars(common["args"]), "noop_layers": {0}})
    torch.save(common, folder / COMMON_FILE)
    assert main(["inspect", str(copy)]) == 2
    _one_sentence(capsys, str(folder), "noop_layers [0]", "legacy checkpoints only", "--ckpt-format torch")


def test_empty_noop_layers_is_none(megatron_ckpt, tmp_path, capsys):
    """An empty set (MindSpeed without --noop-layers after validation) is no noop layer at all."""
    source, _ = megatron_ckpt("seq_tp2_pp2_ep2")
    copy = _with_args(source, tmp_path, "empty", noop_layers=set())
    assert main(["inspect", str(copy)]) == 0
    out = capsys.readouterr().out
    assert "4 decoder: dense -, MoE 0-3\n" in out and "(no tensors)" not in out
