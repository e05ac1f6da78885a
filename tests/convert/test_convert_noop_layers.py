"""MindSpeed `--noop-layers` through select and convert (issue 10): the proxy keeps the source's noop
layers (same args; gaps at the local numbers the target's stage split gives, noop layers counted as
layers), so MindSpeed loads it with the same `--noop-layers`.

Derived: MindSpeed cannot be installed. The source is the megatron-core `seq_tp2_pp2_ep2` fixture
(4 MoE layers, TP 2, PP 2, EP 2) with noop layers 2 and 5 of 6 inserted as MindSpeed saves them
(`mcore_proxy/testing/noop_layers.py`). megatron-core has no noop layer, so each proxy is mapped back
by removing its noop layers and renumbering (`remove_noop_layers`); a noop layer is the identity, so
the model without it computes the same. megatron-core loads the mapped-back proxy strictly and its
logits equal the original fixture's with routers restricted to the kept experts."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

from mcore_proxy.checkpoint import open_checkpoint
from mcore_proxy.cli import main
from mcore_proxy.functional.model import Layout
from mcore_proxy.functional.run import load_and_run
from mcore_proxy.testing.dist_ckpt import iteration_dir
from mcore_proxy.testing.fixtures import FIXTURES
from mcore_proxy.testing.noop_layers import derive_noop_checkpoint, remove_noop_layers

pytestmark = [pytest.mark.megatron, pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")]

NOOP = {2, 5}
REAL = [0, 1, 3, 4]  # global ids of the original layers 0..3 in the derived checkpoint
KEEP = 4  # of 8 experts
LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")

# (convert options, local layer indices each target stage's files hold, layout megatron-core runs
# the mapped-back proxy at)
CASES = [
    # PP 1: local = global, gaps at 2 and 5
    (["--target-tp", "1", "--target-pp", "1", "--target-ep", "2"], {0: {0, 1, 3, 4}}, Layout(ep=2)),
    # PP 3 over 6 layers (noop counted): stages 0-1 | 2-3 | 4-5; stage 1 has a gap at local 0,
    # stage 2 at local 1, so the real layers split 2 + 1 + 1
    (
        ["--target-tp", "1", "--target-pp", "3", "--target-ep", "1"],
        {0: {0, 1}, 1: {1}, 2: {0}},
        Layout(pp=3, first_stage_layers=2),
    ),
]


@pytest.fixture(scope="module")
def noop_source(megatron_ckpt, planted_plan, tmp_path_factory):
    source, full_logits = megatron_ckpt("seq_tp2_pp2_ep2")
    tmp = tmp_path_factory.mktemp("noop-convert")
    derived = derive_noop_checkpoint(source, tmp / "ckpt", NOOP)
    plan = planted_plan(derived, KEEP, tmp / "plan.json")
    return source, derived, tmp / "plan.json", plan, full_logits


@pytest.fixture(scope="module")
def restricted_original(noop_source, tmp_path_factory):
    """The megatron-core original at its own layout, routers restricted to the kept experts (the
    plan's layer ids are the derived checkpoint's: layer REAL[i] is the original's layer i)."""
    source, _, _, plan, _ = noop_source
    assert plan.layer_ids == [str(g) for g in REAL]
    keep = {str(i): plan.kept(str(g)) for i, g in enumerate(REAL)}
    model, layout = FIXTURES["seq_tp2_pp2_ep2"]
    return load_and_run(model, layout, source, tmp_path_factory.mktemp("noop-ref") / "logits.pt", keep=keep)


def test_reader_sees_the_noop_layers(noop_source, capsys):
    source, derived, _, _, _ = noop_source
    view, original = open_checkpoint(derived), open_checkpoint(source)
    assert view.spec.num_layers == 6 and view.spec.noop_layers == (2, 5)
    assert view.spec.moe_layer_ids == ["0", "1", "3", "4"]
    # the canonical view holds the original's tensors under the derived global ids
    rename = {f"decoder.layers.{i}.": f"decoder.layers.{g}." for i, g in enumerate(REAL)}
    expected = {}
    for name in original.names():
        m = LAYER.match(name)
        expected[name.replace(m.group(0), rename[m.group(0)], 1) if m else name] = name
    assert sorted(view.names()) == sorted(expected)
    for name, old in expected.items():
        assert torch.equal(view.get(name), original.get(old)), name
    assert main(["inspect", str(derived)]) == 0
    assert "MoE 0-1,3-4, noop 2,5 (no tensors)" in capsys.readouterr().out


@pytest.mark.parametrize("options,stage_locals,run_layout", CASES, ids=["pp1-ep2", "pp3"])
def test_proxy_keeps_noop_layers_and_equals_restricted_original(
    noop_source, restricted_original, tmp_path, capsys, digest, options, stage_locals, run_layout
):
    _, derived, plan_path, plan, full_logits = noop_source
    before = digest(derived)
    proxy = tmp_path / "proxy"
    assert main(["convert", str(derived), "--plan", str(plan_path), "-o", str(proxy), *options]) == 0
    assert digest(derived) == before, "the input checkpoint was modified"

    # what MindSpeed loads: its args, and the gaps where the target stage split puts the noop layers
    seen: dict[int, set[int]] = {}
    for f in sorted(iteration_dir(proxy).glob("mp_rank_*/model_optim_rng.pt")):
        obj = torch.load(f, map_location="cpu", weights_only=False)  # our own output
        assert obj["args"].num_layers == 6 and obj["args"].noop_layers == NOOP
        parts = f.parent.name.split("_")
        stage = int(parts[3]) if len(stage_locals) > 1 else 0
        seen.setdefault(stage, set()).update(int(m.group(1)) for k in obj["model"] if (m := LAYER.match(k)))
    assert seen == stage_locals
    assert open_checkpoint(proxy).spec.noop_layers == (2, 5)
    # verify compares bit for bit; --functional (megatron-core has no noop layer) is refused
    verify = ["verify", "--orig", str(derived), "--proxy", str(proxy), "--plan", str(plan_path)]
    assert main(verify) == 0
    capsys.readouterr()
    assert main([*verify, "--functional"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]  # after the bit-for-bit progress bar
    assert err.startswith("mcore-proxy verify: error:") and "noop layers [2, 5]" in err, err
    assert "leave out --functional" in err, err

    back, counts = remove_noop_layers(proxy, tmp_path / "back")
    assert counts[0] == (run_layout.first_stage_layers or 4)
    model, _ = FIXTURES["seq_tp2_pp2_ep2"]
    got = load_and_run(dataclasses.replace(model, num_experts=KEEP), run_layout, back, tmp_path / "proxy.pt")
    torch.testing.assert_close(got, restricted_original, rtol=1e-4, atol=1e-4)
    # the restriction matters: the unrestricted original computes something else
    assert (torch.load(full_logits) - restricted_original).abs().max() > 1e-3


@pytest.mark.parametrize(
    "target,named",
    [
        (["--format", "torch_dist", "--target-pp", "1"], "--format legacy"),
        (["--target-pp", "3", "--target-vpp", "2"], "--target-vpp"),
    ],
    ids=["other-format", "virtual-stages"],
)
def test_noop_layers_refused_where_not_written(noop_source, tmp_path, capsys, target, named):
    _, derived, plan_path, _, _ = noop_source
    out = tmp_path / "proxy"
    assert (
        main(["convert", derived, "--plan", plan_path, "-o", out, *target, "--target-tp", "1", "--target-ep", "1"]) == 2
    )
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "noop layers [2, 5]" in err and named in err, err
    assert not out.exists()
