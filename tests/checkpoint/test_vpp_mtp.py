"""The legacy reader on real megatron-core checkpoints with virtual pipeline stages and MTP layers.

Every model is built with layout-independent global weights (`testing/global_weights.py`), so a
checkpoint's canonical tensors must equal those global tensors bit for bit, whatever the layout
it was saved at. One set of spawned ranks saves all sources (cached with
MCORE_PROXY_FIXTURE_CACHE); one more loads everything written from them.
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
from pathlib import Path

import pytest
import torch

from mcore_proxy.checkpoint import write_checkpoint
from mcore_proxy.checkpoint.legacy import LegacyCheckpoint
from mcore_proxy.checkpoint.target import resolve_target
from mcore_proxy.checkpoint.torchfile import TorchFile
from mcore_proxy.cli import main
from mcore_proxy.select.synthetic import planted_plan
from mcore_proxy.testing import build, global_weights, trace_runs, vpp_mtp
from mcore_proxy.functional.model import Layout, ToyMoE
from mcore_proxy.testing.cache import build_lock
from mcore_proxy.testing.trace_runs import TraceRun
from mcore_proxy.testing.vpp_mtp import Job, run_jobs

pytestmark = pytest.mark.megatron

SEED, K = 11, 4
MODEL = ToyMoE()  # 4 MoE layers, top-2 of 8
SOURCES = {
    "vpp": TraceRun(MODEL, Layout(pp=2), vpp=2, seed=SEED),  # rank 0: layers 0, 2; rank 1: 1, 3
    "pp1": TraceRun(MODEL, Layout(), seed=SEED),
    "mtp": TraceRun(MODEL, Layout(pp=2, ep=2), mtp_layers=1, seed=SEED),  # MTP (MoE) on stage 1
}


def _source_key() -> str:
    code = b"".join(Path(m.__file__).read_bytes() for m in (vpp_mtp, build, trace_runs, global_weights))
    return hashlib.sha256(repr(SOURCES).encode() + code).hexdigest()[:12]


@pytest.fixture(scope="module")
def saved(fixture_root) -> dict[str, tuple[Path, Path]]:
    """name -> (legacy checkpoint, logits [1 + mtp, b, s, V]) as megatron-core saved them."""
    key = f"vpp_mtp-{_source_key()}"
    base = Path(fixture_root) / key
    out = {name: (base / name, base / f"{name}.logits.pt") for name in SOURCES}
    with build_lock(fixture_root, key):
        if not (base / "done").is_file():
            base.mkdir(parents=True, exist_ok=True)
            run_jobs([Job(run, save=str(out[n][0]), logits=str(out[n][1])) for n, run in SOURCES.items()])
            (base / "done").write_text("ok")
    return out


def expected(name: str, view) -> torch.Tensor:
    """The global tensor `name` was filled with when the model was built."""
    kind = global_weights.kind_of(name)
    return global_weights.global_tensor(name, view.shape(name), kind, SEED, MODEL.router_std)


def assert_global_weights(view) -> None:
    for name in view.names():
        assert torch.equal(view.get(name), expected(name, view)), name


# -- virtual pipeline stages -----------------------------------------------------------------


def test_vpp_files_are_shaped_like_megatron_training(saved):
    ckpt, _ = saved["vpp"]
    state = TorchFile(ckpt / "iter_0000010" / "mp_rank_00_001" / "model_optim_rng.pt").obj
    assert {"model0", "model1"} <= set(state) and "model" not in state
    layers = [
        sorted({int(m.group(1)) for k in state[c] if (m := re.match(r"decoder\.layers\.(\d+)\.", k))})
        for c in ("model0", "model1")
    ]
    assert layers == [[0], [0]]  # local numbering in each chunk: global layers 1 and 3
    args = state["args"]
    assert (
        args.virtual_pipeline_model_parallel_size,
        args.num_layers_per_virtual_pipeline_stage,
        args.num_virtual_stages_per_pipeline_rank,
    ) == (2, 1, None)


def test_vpp_reads_like_the_same_model_at_pp1(saved):
    vpp, flat = LegacyCheckpoint(saved["vpp"][0]), LegacyCheckpoint(saved["pp1"][0])
    assert (vpp.layout.pp, vpp.layout.vpp, vpp.layout.stage_layers) == (2, 2, (2, 2))
    assert vpp.names() == flat.names()
    assert {n.split(".")[2] for n in vpp.names() if n.startswith("decoder.layers.")} == {"0", "1", "2", "3"}
    for name in vpp.names():
        assert torch.equal(vpp.get(name), flat.get(name)), name
    assert_global_weights(vpp)  # layers land at their global numbers, not just consistently
    torch.testing.assert_close(torch.load(saved["vpp"][1]), torch.load(saved["pp1"][1]), rtol=0, atol=0)


def test_inspect_reports_vpp(saved, capsys):
    assert main(["inspect", str(saved["vpp"][0])]) == 0
    assert "TP=1 PP=2 EP=1 ETP=1 VPP=2" in capsys.readouterr().out


# -- MTP ---------------------------------------------------------------------------------------

MTP_NAMES = [
    "mtp.layers.0.enorm.weight",
    "mtp.layers.0.hnorm.weight",
    "mtp.layers.0.eh_proj.weight",
    "mtp.layers.0.final_layernorm.weight",
    "mtp.layers.0.transformer_layer.mlp.router.weight",
    "mtp.layers.0.transformer_layer.self_attention.linear_qkv.weight",
]


def test_mtp_reader_exposes_the_mtp_layer(saved):
    view = LegacyCheckpoint(saved["mtp"][0])
    assert view.spec.mtp_layers == 1 and view.spec.moe_layer_ids == ["0", "1", "2", "3", "mtp.0"]
    names = view.names()
    assert set(MTP_NAMES) <= set(names)
    experts = {
        int(m.group(1))
        for n in names
        if (m := re.match(r"mtp\.layers\.0\.transformer_layer\.mlp\.experts\.(\d+)\.linear_fc[12]\.weight$", n))
    }
    assert experts == set(range(MODEL.num_experts))
    assert view.shape("mtp.layers.0.transformer_layer.mlp.router.weight") == (8, 32)
    assert view.shape("mtp.layers.0.eh_proj.weight") == (32, 64)
    # the last stage's copy of the word embeddings is the same tensor, read once
    last = TorchFile(saved["mtp"][0] / "iter_0000010" / "mp_rank_00_001_001" / "model_optim_rng.pt").obj
    assert "embedding.word_embeddings.weight" in last["model"]
    assert names.count("embedding.word_embeddings.weight") == 1
    assert_global_weights(view)  # experts 4..7 come from EP rank 1, renumbered


@pytest.fixture(scope="module")
def converted(saved, tmp_path_factory):
    """Checkpoints written from the sources, and the logits megatron-core computes from them."""
    tmp = tmp_path_factory.mktemp("vpp_mtp")
    mtp = LegacyCheckpoint(saved["mtp"][0])
    ep1 = write_checkpoint(mtp, tmp / "mtp_ep1", resolve_target(mtp, tp=1, pp=1, ep=1), progress=False)
    vpp = LegacyCheckpoint(saved["vpp"][0])
    pp2 = write_checkpoint(vpp, tmp / "vpp_pp2", resolve_target(vpp, pp=2), progress=False)

    plan = planted_plan(mtp, K, target_ep=1)
    plan_path = plan.save(tmp / "plan.json")
    proxy = tmp / "proxy"
    assert main(["convert", str(saved["mtp"][0]), "--plan", str(plan_path), "-o", str(proxy), "--target-ep", "1"]) == 0

    # virtual stages written: the PP 1 model split PP 2 x VPP 2, and the MTP proxy at VPP 2
    pp1_vpp, proxy_vpp = tmp / "pp1_vpp", tmp / "proxy_vpp"
    assert main(["convert", str(saved["pp1"][0]), "-o", str(pp1_vpp), "--target-pp", "2", "--target-vpp", "2"]) == 0
    assert (
        main(
            ["convert", saved["mtp"][0], "--plan", plan_path, "-o", proxy_vpp, "--target-ep", "1", "--target-vpp", "2"]
        )
        == 0
    )

    keep = {lid: plan.kept(lid) for lid in plan.layer_ids}
    mtp_run = TraceRun(MODEL, Layout(), mtp_layers=1, seed=SEED)
    proxy_model = dataclasses.replace(MODEL, num_experts=K)
    proxy_run = TraceRun(proxy_model, Layout(pp=2), mtp_layers=1, seed=SEED)
    logits = {n: tmp / f"{n}.pt" for n in ("mtp_ep1", "restricted", "proxy", "vpp_pp2", "pp1_vpp", "proxy_vpp")}
    run_jobs(
        [
            Job(mtp_run, load=str(ep1), logits=str(logits["mtp_ep1"])),
            Job(mtp_run, load=str(ep1), logits=str(logits["restricted"]), keep=keep),
            Job(proxy_run, load=str(proxy), logits=str(logits["proxy"])),
            Job(TraceRun(MODEL, Layout(pp=2), seed=SEED), load=str(pp2), logits=str(logits["vpp_pp2"])),
            Job(TraceRun(MODEL, Layout(pp=2), vpp=2, seed=SEED), load=str(pp1_vpp), logits=str(logits["pp1_vpp"])),
            Job(
                TraceRun(proxy_model, Layout(pp=2), vpp=2, mtp_layers=1, seed=SEED),
                load=str(proxy_vpp),
                logits=str(logits["proxy_vpp"]),
            ),
        ]
    )
    return dict(
        ep1=ep1,
        pp2=pp2,
        proxy=proxy,
        plan=plan,
        pp1_vpp=pp1_vpp,
        proxy_vpp=proxy_vpp,
        logits={n: torch.load(p) for n, p in logits.items()},
    )


def test_vpp_source_converts_and_runs(saved, converted):
    """Written at PP=2 without virtual stages (resolve_target defaults to none), megatron loads it strictly."""
    again = LegacyCheckpoint(converted["pp2"])
    assert (again.layout.pp, again.layout.vpp) == (2, 1)
    torch.testing.assert_close(converted["logits"]["vpp_pp2"], torch.load(saved["vpp"][1]), rtol=1e-5, atol=1e-5)


def test_mtp_rewrite_is_bit_identical_and_runs_like_the_original(saved, converted):
    source, again = LegacyCheckpoint(saved["mtp"][0]), LegacyCheckpoint(converted["ep1"])
    assert (again.layout.pp, again.layout.ep) == (1, 1) and again.spec.mtp_layers == 1
    assert again.names() == source.names()
    for name in source.names():
        assert torch.equal(again.get(name), source.get(name)), name
    # loaded strictly into a megatron-core MTP model at EP=1: main and MTP heads as saved at PP=2 EP=2
    original = torch.load(saved["mtp"][1])
    assert original.shape[0] == 2 and (original[1] - original[0]).abs().max() > 1e-2
    torch.testing.assert_close(converted["logits"]["mtp_ep1"], original, rtol=1e-5, atol=1e-5)


def test_mtp_proxy_loads_and_equals_the_restricted_original(saved, converted):
    plan, proxy = converted["plan"], LegacyCheckpoint(converted["proxy"])
    assert plan.layer_ids == ["0", "1", "2", "3", "mtp.0"]
    assert (proxy.layout.pp, proxy.layout.ep) == (2, 1)
    assert proxy.spec.num_experts == K and proxy.spec.moe_layer_ids[-1] == "mtp.0"
    source = LegacyCheckpoint(saved["mtp"][0])
    prefix = "mtp.layers.0.transformer_layer.mlp"
    for j, e in enumerate(plan.kept("mtp.0")):
        for fc in ("linear_fc1", "linear_fc2"):
            assert torch.equal(
                proxy.get(f"{prefix}.experts.{j}.{fc}.weight"), source.get(f"{prefix}.experts.{e}.{fc}.weight")
            )
    assert torch.equal(proxy.get(f"{prefix}.router.weight"), source.get(f"{prefix}.router.weight")[plan.kept("mtp.0")])
    # the proxy's last stage carries the MTP layer and megatron's copy of the word embeddings
    last = TorchFile(converted["proxy"] / "iter_0000010" / "mp_rank_00_001" / "model_optim_rng.pt").obj
    assert "embedding.word_embeddings.weight" in last["model"]
    # loaded strictly at PP=2 with K experts, both heads equal the original's restricted to the kept experts
    torch.testing.assert_close(converted["logits"]["proxy"], converted["logits"]["restricted"], rtol=1e-5, atol=1e-5)
    full = torch.load(saved["mtp"][1])
    for head in (0, 1):  # the restriction matters, for both heads
        assert (full[head] - converted["logits"]["restricted"][head]).abs().max() > 1e-3


# -- virtual stages written (--target-vpp) ----------------------------------------------------------


def _model_chunks(path: Path) -> dict[str, dict]:
    from mcore_proxy.checkpoint.torchfile import load_weights_only

    state = load_weights_only(path)
    return {k: v for k, v in state.items() if re.fullmatch(r"model\d*", k)}


def test_a_vpp_source_is_rewritten_as_megatron_saved_it(saved, tmp_path):
    """PP kept, no stage option: the virtual stages are kept, and every rank file holds the chunks
    megatron-core saved, key for key and bit for bit, with Megatron-LM's args for them."""
    out = tmp_path / "vpp_again"
    assert main(["convert", str(saved["vpp"][0]), "-o", str(out)]) == 0
    for rank in ("mp_rank_00_000", "mp_rank_00_001"):
        want = _model_chunks(saved["vpp"][0] / "iter_0000010" / rank / "model_optim_rng.pt")
        got = _model_chunks(out / "iter_0000010" / rank / "model_optim_rng.pt")
        assert sorted(got) == sorted(want) == ["model0", "model1"]
        for key in want:
            assert sorted(got[key]) == sorted(want[key]), (rank, key)
            for name, value in want[key].items():
                assert (value is None and got[key][name] is None) or torch.equal(got[key][name], value), name
    args = TorchFile(out / "iter_0000010" / "mp_rank_00_000" / "model_optim_rng.pt").obj["args"]
    assert (
        args.virtual_pipeline_model_parallel_size,
        args.num_layers_per_virtual_pipeline_stage,
        args.pipeline_model_parallel_layout,
    ) == (2, 1, None)


def test_target_vpp_loads_in_megatron_core_with_virtual_stages(saved, converted, capsys):
    """--target-vpp 2 on models without a layout string: chunk (pp, vp) holds layer vp*PP + pp;
    megatron-core builds PP 2 x VPP 2 chunks, loads them strictly and computes the same logits (the
    PP 1 model), and the MTP proxy equals the original restricted to the kept experts."""
    view = LegacyCheckpoint(converted["pp1_vpp"])
    assert (view.layout.pp, view.layout.vpp, view.layout.stage_layers) == (2, 2, (2, 2))
    assert_global_weights(view)
    rank1 = _model_chunks(converted["pp1_vpp"] / "iter_0000010" / "mp_rank_00_001" / "model_optim_rng.pt")
    # global layers 1 and 3, numbered 0 in their chunks; the output layer on the last chunk only
    assert {k: sorted({n.split(".")[2] for n in v if n.startswith("decoder.layers.")}) for k, v in rank1.items()} == {
        "model0": ["0"],
        "model1": ["0"],
    }
    assert "output_layer.weight" in rank1["model1"] and "output_layer.weight" not in rank1["model0"]
    torch.testing.assert_close(converted["logits"]["pp1_vpp"], torch.load(saved["pp1"][1]), rtol=1e-5, atol=1e-5)
    # MTP on the last chunk of the last rank, with its own embedding copy
    last = _model_chunks(converted["proxy_vpp"] / "iter_0000010" / "mp_rank_00_001" / "model_optim_rng.pt")
    assert (
        any(n.startswith("mtp.layers.0.") for n in last["model1"])
        and "embedding.word_embeddings.weight" in last["model1"]
    )
    torch.testing.assert_close(
        converted["logits"]["proxy_vpp"], converted["logits"]["restricted"], rtol=1e-5, atol=1e-5
    )
    assert main(["inspect", str(converted["proxy_vpp"])]) == 0
    assert "TP=1 PP=2 EP=1 ETP=1 VPP=2" in capsys.readouterr().out
    assert (
        main(
            [
                "verify",
                "--orig",
                saved["mtp"][0],
                "--proxy",
                converted["proxy_vpp"],
                "--plan",
                converted["proxy"].parent / "plan.json",
            ]
        )
        == 0
    )
    assert "verify: OK" in capsys.readouterr().out
