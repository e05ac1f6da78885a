"""The pipeline on the DeepSeek-V3- and Qwen3-MoE-shaped fixtures (issue 10), as a user runs it:
inspect, trace (DeepSeek: megatron-core's forward at the saved layout and at TP 1 / PP 1 / EP 4,
`stats merge`; the two traces agree exactly) and select on the trace (Qwen3: on planted
statistics), convert from either format to a smaller EP and a plain
stage split (the source's layout string is not written: docs/families.md), verify --functional,
and megatron-core loads every proxy at its target layout and computes the original's logits
(main head and MTP head) restricted to the kept experts. All loads share one set of ranks."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from mcore_proxy.checkpoint import open_checkpoint
from mcore_proxy.cli import main
from mcore_proxy.select.plan import load_plan
from mcore_proxy.select.synthetic import planted_plan
from mcore_proxy.testing.families import StagedLayout, load_and_run


pytestmark = [pytest.mark.megatron, pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")]

KEEP = 16  # of 32 experts; >= top-8 and two experts per group of the 8 DeepSeek groups
CLOSE = dict(rtol=1e-4, atol=1e-4)  # fp32 logits of size ~1; another TP/EP reorders sums

# (case id, source format, convert options, layout megatron-core loads the proxy at); the fixture
# is the id's first part
CASES = [
    # layout "Ettt|tt|m|L" (VPP 2, standalone MTP) -> a plain PP 2 split (--target-vpp 1) with 3 + 2
    # layers, MTP on the last stage
    (
        "deepseek_v3_mla-legacy",
        "legacy",
        ["--target-tp", "2", "--target-pp", "2", "--target-ep", "1", "--target-vpp", "1"],
        StagedLayout(tp=2, pp=2, ep=1, first_stage_layers=3),
    ),
    # -> another layout string: VPP 2, the MTP layer beside the loss on (pp 1, vp 1), so the final
    # norm sits on (pp 0, vp 1) with the last decoder layer and pp 1 holds an embedding copy
    (
        "deepseek_v3_mla-legacy-layout",
        "legacy",
        ["--target-tp", "1", "--target-pp", "2", "--target-ep", "1", "--target-pipeline-layout", "Et|tt|tt|mL"],
        StagedLayout(tp=1, pp=2, ep=1, pipeline_layout="Et|tt|tt|mL"),
    ),
    (
        "deepseek_v3_mla-torch_dist",
        "torch_dist",
        ["--target-tp", "1", "--target-pp", "1", "--target-ep", "2"],
        StagedLayout(tp=1, pp=1, ep=2),
    ),
    # -> a layout string with a stage of the embedding alone (no decoder layer on pp 0, vp 0)
    (
        "deepseek_v3_mla-torch_dist-layout",
        "torch_dist",
        ["--target-tp", "2", "--target-pp", "2", "--target-ep", "2", "--target-pipeline-layout", "E|ttttt|m|L"],
        StagedLayout(tp=2, pp=2, ep=2, etp=1, pipeline_layout="E|ttttt|m|L"),
    ),
    (
        "qwen3_moe-legacy",
        "legacy",
        ["--target-tp", "1", "--target-pp", "2", "--target-ep", "1"],
        StagedLayout(tp=1, pp=2, ep=1, grouped=True),
    ),
    (
        "qwen3_moe-torch_dist",
        "torch_dist",
        ["--target-tp", "2", "--target-pp", "1", "--target-ep", "1"],
        StagedLayout(tp=2, pp=1, ep=1, grouped=True),
    ),
]
IDS = [c[0] for c in CASES]


@pytest.fixture(scope="module")
def pipeline(family_ckpt, tmp_path_factory, digest):
    """Plans, proxies and every load: {case id: (proxy folder, plan, proxy logits)} and the restricted
    originals {fixture: logits}, run in one set of ranks."""
    tmp = tmp_path_factory.mktemp("family-pipeline")
    deepseek = family_ckpt["deepseek_v3_mla"]
    traces = [tmp / "trace-saved", tmp / "trace-tp1"]
    load_and_run(
        [
            (deepseek.model, deepseek.layout, "legacy", deepseek.legacy, tmp / "t0.pt"),
            (deepseek.model, StagedLayout(ep=4), "torch_dist", deepseek.torch_dist, tmp / "t1.pt"),
        ],
        trace_dirs=traces,
    )
    for trace in traces:
        assert main(["stats", "merge", str(trace)]) == 0
    assert (
        main(
            [
                "select",
                "--ckpt",
                deepseek.legacy,
                "--stats",
                traces[0] / "routing_stats.safetensors",
                "-k",
                KEEP,
                "-o",
                tmp / "deepseek_v3_mla.json",
            ]
        )
        == 0
    )
    plans, proxies, jobs, keeps = {"deepseek_v3_mla": load_plan(tmp / "deepseek_v3_mla.json")}, {}, [], []
    qwen3 = open_checkpoint(family_ckpt["qwen3_moe"].legacy)
    plans["qwen3_moe"] = planted_plan(qwen3, KEEP, tmp / "qwen3_moe.json", target_ep=1)
    for name in ("deepseek_v3_mla", "qwen3_moe"):
        ckpt = family_ckpt[name]
        keep = {lid: plans[name].kept(lid) for lid in plans[name].layer_ids}
        jobs.append((ckpt.model, ckpt.layout, "torch_dist", ckpt.torch_dist, tmp / f"{name}-restricted.pt"))
        keeps.append(keep)
    for case_id, fmt, options, run_layout in CASES:
        name = case_id.split("-")[0]
        src = getattr(family_ckpt[name], fmt)
        before, out = digest(src), tmp / case_id
        assert main(["convert", str(src), "--plan", str(tmp / f"{name}.json"), "-o", str(out), *options]) == 0
        assert digest(src) == before, "the input checkpoint was modified"
        proxy_model = dataclasses.replace(family_ckpt[name].model, num_experts=KEEP)
        jobs.append((proxy_model, run_layout, fmt, out, tmp / f"{case_id}.pt"))
        keeps.append(None)
        proxies[case_id] = out
    logits = load_and_run(jobs, keeps=keeps)
    restricted = dict(zip(("deepseek_v3_mla", "qwen3_moe"), logits[:2]))
    return proxies, plans, dict(zip(IDS, logits[2:])), restricted, traces


@pytest.mark.parametrize("case_id", IDS)
def test_proxy_equals_the_restricted_original(family_ckpt, pipeline, case_id):
    proxies, plans, got, restricted, _ = pipeline
    name = case_id.split("-")[0]
    want = restricted[name]
    assert got[case_id].shape == want.shape == (1 + family_ckpt[name].model.mtp_layers, 2, 16, 128)
    torch.testing.assert_close(got[case_id], want, **CLOSE)
    # the restriction matters: the unrestricted original computes something else
    assert (torch.load(family_ckpt[name].logits) - want).abs().max() > 1e-3


def test_the_written_args_describe_a_plain_stage_split(family_ckpt, pipeline):
    """No layout string nor virtual stages in the proxy's args (megatron-core builds it from
    first/last stage sizes), and the launch flags say so."""
    from mcore_proxy.checkpoint.formats import writer_of
    from mcore_proxy.convert.pipeline import launch_flags

    proxies, plans, _, _, _ = pipeline
    view = open_checkpoint(proxies["deepseek_v3_mla-legacy"])
    args = view.args
    assert args.pipeline_model_parallel_layout is None and args.virtual_pipeline_model_parallel_size is None
    assert (args.decoder_first_pipeline_num_layers, args.num_experts) == (3, KEEP)
    assert view.layout.stage_layers == (3, 2) and view.layout.vpp == 1
    source = open_checkpoint(family_ckpt["deepseek_v3_mla"].legacy)
    flags = launch_flags(source, view.layout, plans["deepseek_v3_mla"], writer_of("legacy"))
    assert "--decoder-first-pipeline-num-layers 3" in flags and "(no --pipeline-model-parallel-layout)" in flags


def _chunk_keys(state: dict) -> dict[str, list[str]]:
    """model chunk key -> its tensor names without `_extra_state` (first three name parts)."""
    return {
        k: sorted({".".join(n.split(".")[:3]) for n in v if not n.endswith("_extra_state")})
        for k, v in state.items()
        if k.startswith("model")
    }


def test_the_written_layout_string_is_what_megatron_core_builds(family_ckpt, pipeline, capsys):
    """ "Et|tt|tt|mL" at PP 2: each rank file holds model0 and model1 with local layer numbers, the
    embedding on the first chunk and again beside the MTP layer, the final norm with the last
    decoder layer (MTP is on), the output layer on the last chunk; the args are Megatron-LM's for
    that flag (raw string, VPP 2, no stage sizes) and so are the launch flags and inspect."""
    from mcore_proxy.checkpoint.torchfile import TorchFile

    proxies, *_ = pipeline
    out = proxies["deepseek_v3_mla-legacy-layout"]
    files = {d.name: TorchFile(d / "model_optim_rng.pt").obj for d in sorted(out.glob("iter_*/mp_rank_*"))}
    assert sorted(files) == ["mp_rank_00_000", "mp_rank_00_001"]
    assert _chunk_keys(files["mp_rank_00_000"]) == {
        "model0": ["decoder.layers.0", "embedding.word_embeddings.weight"],
        "model1": ["decoder.final_layernorm.weight", "decoder.layers.0", "decoder.layers.1"],
    }
    assert _chunk_keys(files["mp_rank_00_001"]) == {
        "model0": ["decoder.layers.0", "decoder.layers.1"],
        "model1": ["embedding.word_embeddings.weight", "mtp.layers.0", "output_layer.weight"],
    }
    for state in files.values():
        args = state["args"]
        assert (args.pipeline_model_parallel_layout, args.virtual_pipeline_model_parallel_size) == ("Et|tt|tt|mL", 2)
        assert args.decoder_first_pipeline_num_layers is None and args.decoder_last_pipeline_num_layers is None
        assert args.num_layers_per_virtual_pipeline_stage is None and args.overlap_p2p_comm is True
    view = open_checkpoint(out)
    assert (view.layout.vpp, view.layout.stage_layers) == (2, (3, 2))
    # the launch flags set the string (quoted for the shell) and ask to drop nothing about stages
    assert (
        main(
            [
                "convert",
                family_ckpt["deepseek_v3_mla"].legacy,
                "-o",
                out.parent / "dry",
                "--dry-run",
                "--target-pp",
                "2",
                "--target-pipeline-layout",
                "Et|tt|tt|mL",
                "--json",
            ]
        )
        == 0
    )
    doc = json.loads(capsys.readouterr().out)
    assert "--pipeline-model-parallel-layout 'Et|tt|tt|mL'" in doc["launch_flags"]
    assert doc["target"]["vpp"] == 2 and doc["target"]["pipeline_layout"] == "Et|tt|tt|mL"
    assert not [f for f in doc["remove_flags"] if "layout" in f or "virtual" in f]
    assert main(["inspect", str(out)]) == 0
    assert "VPP=2 layout 'Et|tt|tt|mL'" in capsys.readouterr().out
    # torch_dist: layout-independent files, the target's layout in common.pt
    dist = open_checkpoint(proxies["deepseek_v3_mla-torch_dist-layout"])
    assert dist.args.pipeline_model_parallel_layout == "E|ttttt|m|L"
    assert (dist.layout.vpp, dist.layout.stage_layers) == (2, (0, 5))


def test_the_source_layout_is_kept_by_default(family_ckpt, pipeline, capsys):
    """PP kept and no stage option: the proxy keeps "Ettt|tt|m|L", and convert says so in its flags."""
    proxies, *_ = pipeline
    out = proxies["deepseek_v3_mla-legacy"].parent / "kept"
    assert main(["convert", str(family_ckpt["deepseek_v3_mla"].legacy), "-o", str(out), "--target-ep", "1"]) == 0
    text = capsys.readouterr().out
    assert "--pipeline-model-parallel-layout 'Ettt|tt|m|L'" in text and "without: --pipeline" not in text
    assert open_checkpoint(out).layout.pipeline_layout == "Ettt|tt|m|L"


BAD_LAYOUTS = [
    (
        ["--target-pipeline-layout", "Et|tt|m|L"],
        "--target-pipeline-layout: pipeline layout 'Et|tt|m|L': it has 3 "
        "decoder layers (t), the model has 5; fix the layout string",
    ),
    (["--target-pipeline-layout", "Ettt|ttL"], "it has 0 MTP layers (m), the model has 1"),
    (["--target-pipeline-layout", "Ettt|ttm|L"], "has 3 stages, not a multiple of PP=2"),
    (["--target-pipeline-layout", "Ettt|tx|m|L"], "stage 1 ('tx') has 'x'"),
    (["--target-pipeline-layout", "Ettt|ttmL", "--target-stage-layers", "3,2"], "give one of them"),
    (["--target-pp", "1", "--target-pipeline-layout", "Ettt|ttmL"], "needs PP > 1"),
    (["--target-vpp", "3", "--target-pipeline-layout", "Ettt|tt|m|L"], "drop --target-vpp"),
    (["--target-vpp", "2"], "--target-vpp 2: 5 decoder layers do not split evenly into PP x VPP = 4 chunks"),
]


@pytest.mark.parametrize("options,message", BAD_LAYOUTS, ids=[" ".join(o) for o, _ in BAD_LAYOUTS])
def test_a_bad_target_layout_is_one_sentence_and_exit_2(family_ckpt, tmp_path, capsys, options, message):
    out = tmp_path / "out"
    assert main(["convert", str(family_ckpt["deepseek_v3_mla"].legacy), "-o", str(out), *options]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0] and "--target-" in err[0], err
    assert not out.exists()


@pytest.mark.parametrize("name", ["deepseek_v3_mla", "qwen3_moe"])
def test_inspect_and_verify_functional(family_ckpt, pipeline, name, capsys):
    proxies, plans, _, _, _ = pipeline
    ckpt = family_ckpt[name]
    assert main(["inspect", str(ckpt.legacy)]) == 0
    shown = capsys.readouterr().out
    if name == "deepseek_v3_mla":
        assert "multi-latent attention, local layer spec" in shown and "VPP=2 layout 'Ettt|tt|m|L'" in shown
    else:
        assert "grouped-query attention, local layer spec" in shown
    # DeepSeek: the proxy written with another layout string (VPP 2)
    proxy = proxies[f"{name}-legacy-layout" if name == "deepseek_v3_mla" else f"{name}-legacy"]
    assert (
        main(
            [
                "verify",
                "--orig",
                ckpt.legacy,
                "--proxy",
                proxy,
                "--plan",
                Path(proxy).parent / f"{name}.json",
                "--functional",
            ]
        )
        == 0
    )
    text = capsys.readouterr().out
    assert "verify: OK" in text and "functional: max |logit difference|" in text
    assert load_plan(Path(proxies[f"{name}-legacy"]).parent / f"{name}.json").num_experts == KEEP


def test_the_mla_trace_is_exact_at_any_layout(family_ckpt, pipeline):
    """The routing statistics of the MoE layers and the MTP layer do not depend on the layout the
    model ran at (TP 2 / PP 2 with the layout string / EP 2 vs TP 1 / PP 1 / EP 4): counts and
    co-activations equal, gate mass and prototypes to rounding; every token routed top-8. At EP 4
    on 4 ranks each rank is its own data-parallel replica running the same fixed tokens, so that
    trace holds 4 copies of the saved layout's (where TP rank 0 of each stage records once)."""
    import numpy as np

    from mcore_proxy.core.stats import load_stats

    *_, traces = pipeline
    a, b = (load_stats(t / "routing_stats.safetensors") for t in traces)
    assert a.layer_ids == b.layer_ids == ["3", "4", "mtp.0"]
    for lid in a.layer_ids:
        x, y = a.layers[lid], b.layers[lid]
        assert (x.tokens, y.tokens) == (2 * 16, 4 * 2 * 16) and x.freq.sum() == 8 * x.tokens, lid
        assert np.array_equal(4 * x.freq, y.freq) and np.array_equal(4 * x.coact, y.coact), lid
        np.testing.assert_allclose(4 * x.gate_mass, y.gate_mass, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(4 * x.proto_sum, y.proto_sum, rtol=1e-4, atol=1e-4)


def test_a_layout_string_replaces_first_last_stage_sizes(megatron_ckpt, tmp_path, capsys):
    """A source saved with --decoder-first-pipeline-num-layers 1 (no MTP) written with a layout
    string: the flags say to drop the stage sizes, the args clear them, the final norm and the output
    layer go to the last chunk, and the proxy reads back tensor for tensor."""
    from mcore_proxy.checkpoint.torchfile import load_weights_only

    src, _ = megatron_ckpt("deepseek_like_pp2_uneven")
    out = tmp_path / "out"
    assert main(["convert", str(src), "-o", str(out), "--target-pipeline-layout", "Et|t|t|tL", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert "--pipeline-model-parallel-layout 'Et|t|t|tL'" in doc["launch_flags"]
    assert any("--decoder-first-pipeline-num-layers" in f for f in doc["remove_flags"])
    last = load_weights_only(next(out.glob("iter_*/mp_rank_00_001_000/model_optim_rng.pt")))
    assert "decoder.final_layernorm.weight" in last["model1"] and "output_layer.weight" in last["model1"]
    assert not any(k.startswith(("decoder.final_layernorm", "output_layer")) for k in last["model0"])
    assert last["args"].decoder_first_pipeline_num_layers is None
    source, again = open_checkpoint(src), open_checkpoint(out)
    assert (again.layout.vpp, again.layout.stage_layers) == (2, (2, 2))
    assert again.names() == source.names()
    for name in source.names():
        a, b = source.get(name), again.get(name)
        assert (a is None and b is None) or torch.equal(a, b), name
