"""Tied embeddings (Megatron's default, no --untie-embeddings-and-output-weights) with PP > 1, on the
`qwen3_moe_tied` fixture saved by megatron-core itself (TP 2, PP 2, EP 2, ETP 1, legacy and torch_dist
from the same ranks): the last stage's legacy rank files hold `output_layer.weight`, their copy of
the word embeddings; torch_dist holds only `embedding.word_embeddings.weight` (the copy is a replica).

Proven: both readers yield one embedding tensor and no output layer; writing puts the copy on the
last stage at PP > 1 and leaves it out at PP 1; converted proxies (legacy and torch_dist, other
TP/PP/EP) load strictly into tied megatron-core models and compute the original's logits with its
routers restricted to the kept experts; args without the field keep an output layer (never dropped
on a guess); verify --functional passes."""

from __future__ import annotations

import argparse
import dataclasses
import shutil

import pytest
import torch

from mcore_proxy.checkpoint import open_checkpoint
from mcore_proxy.cli import main
from mcore_proxy.testing.families import StagedLayout, iteration_dir, load_and_run

pytestmark = [pytest.mark.megatron, pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")]

NAME, KEEP = "qwen3_moe_tied", 16
CLOSE = dict(rtol=1e-4, atol=1e-4)
EMB, OUT = "embedding.word_embeddings.weight", "output_layer.weight"
# (source format, convert options, layout megatron-core loads the proxy at)
CASES = [
    ("legacy", ["--target-tp", "1", "--target-pp", "1", "--target-ep", "1"], StagedLayout()),
    ("legacy", ["--target-tp", "1", "--target-pp", "2", "--target-ep", "2"], StagedLayout(pp=2, ep=2)),
    ("torch_dist", ["--target-tp", "2", "--target-pp", "2", "--target-ep", "1"], StagedLayout(tp=2, pp=2)),
    ("torch_dist", ["--target-pp", "1", "--target-ep", "1", "--format", "legacy"], StagedLayout(tp=2, etp=1)),
]
IDS = [f"{fmt}-{'-'.join(o[1] for o in zip(opts[::2], opts[1::2]))}" for fmt, opts, _ in CASES]


def _rank_files(root):
    return {
        f.parent.name: torch.load(f, map_location="cpu", weights_only=False)
        for f in sorted(iteration_dir(root).glob("mp_rank_*/model_optim_rng.pt"))
    }


def test_megatron_saves_the_copy_on_the_last_stage_only_in_legacy(family_ckpt):
    ckpt = family_ckpt[NAME]
    files = _rank_files(ckpt.legacy)
    assert files["mp_rank_00_000_000"]["args"].untie_embeddings_and_output_weights is False
    for folder, state in files.items():
        tp, pp = int(folder[8:10]), int(folder[11:14])
        model = state["model"]
        assert (EMB in model, OUT in model) == (pp == 0, pp == 1), folder
        if pp == 1:
            first = files[f"mp_rank_{tp:02d}_000_{folder[-3:]}"]["model"][EMB]
            assert torch.equal(model[OUT], first)  # megatron-core all-reduced the copy from stage 0
    from mcore_proxy.checkpoint.torch_dist.reader import read_dcp_metadata

    keys, _ = read_dcp_metadata(iteration_dir(ckpt.torch_dist) / ".metadata")
    assert EMB in keys and OUT not in keys


@pytest.mark.parametrize("fmt", ["legacy", "torch_dist"])
def test_readers_yield_one_embedding_and_no_output_layer(family_ckpt, fmt):
    ckpt = family_ckpt[NAME]
    view, other = (
        open_checkpoint(getattr(ckpt, fmt)),
        open_checkpoint(ckpt.torch_dist if fmt == "legacy" else ckpt.legacy),
    )
    assert EMB in view.names() and OUT not in view.names()
    assert view.names() == other.names()
    torch.testing.assert_close(view.get(EMB), other.get(EMB), rtol=0, atol=0)


@pytest.mark.parametrize("pp", [1, 2, 4])
def test_writing_places_the_copy_where_megatron_expects_it(family_ckpt, tmp_path, pp):
    ckpt = family_ckpt[NAME]
    assert main(["convert", str(ckpt.legacy), "-o", str(tmp_path / "out"), "--target-pp", str(pp)]) == 0
    files = _rank_files(tmp_path / "out")
    emb = open_checkpoint(ckpt.legacy).get(EMB)
    for folder, state in files.items():
        tp = int(folder[8:10])
        stage = int(folder[11:14]) if pp > 1 else 0
        model = state["model"]
        assert (EMB in model) == (stage == 0) and (OUT in model) == (pp > 1 and stage == pp - 1), folder
        if OUT in model:
            assert torch.equal(model[OUT], emb.chunk(2)[tp]) and model["output_layer._extra_state"] is None
        assert state["args"].untie_embeddings_and_output_weights is False
    # read back: the same canonical tensors as the source
    assert open_checkpoint(tmp_path / "out").names() == open_checkpoint(ckpt.legacy).names()


@pytest.fixture(scope="module")
def proxies(family_ckpt, tmp_path_factory, digest, planted_plan):
    """Plan, the proxies of CASES and one set of ranks loading them all: ({case: logits}, restricted
    original logits, {case: proxy folder}, plan path)."""
    ckpt, tmp = family_ckpt[NAME], tmp_path_factory.mktemp("tied")
    plan = planted_plan(ckpt.legacy, KEEP, tmp / "plan.json", target_ep=1)
    keep = {lid: plan.kept(lid) for lid in plan.layer_ids}
    jobs = [(ckpt.model, ckpt.layout, "torch_dist", ckpt.torch_dist, tmp / "restricted.pt")]
    out = {}
    for case_id, (fmt, options, layout) in zip(IDS, CASES):
        src = getattr(ckpt, fmt)
        before = digest(src)
        assert main(["convert", str(src), "--plan", str(tmp / "plan.json"), "-o", str(tmp / case_id), *options]) == 0
        assert digest(src) == before, "the input checkpoint was modified"
        written = "torch_dist" if fmt == "torch_dist" and "--format" not in options else "legacy"
        jobs.append(
            (dataclasses.replace(ckpt.model, num_experts=KEEP), layout, written, tmp / case_id, tmp / f"{case_id}.pt")
        )
        out[case_id] = tmp / case_id
    logits = load_and_run(jobs, keeps=[keep] + [None] * len(CASES))
    return dict(zip(IDS, logits[1:])), logits[0], out, tmp / "plan.json"


@pytest.mark.parametrize("case_id", IDS)
def test_tied_proxies_load_and_equal_the_restricted_original(family_ckpt, proxies, case_id):
    got, want, _, _ = proxies
    torch.testing.assert_close(got[case_id], want, **CLOSE)
    assert (torch.load(family_ckpt[NAME].logits) - want).abs().max() > 1e-3  # the restriction matters


def test_verify_functional_on_a_tied_proxy(family_ckpt, proxies, capsys):
    _, _, out, plan = proxies
    case = IDS[1]  # legacy, PP 2: the copy is in the proxy's last stage
    assert (
        main(["verify", "--orig", family_ckpt[NAME].legacy, "--proxy", out[case], "--plan", plan, "--functional"]) == 0
    ), capsys.readouterr()


def test_args_without_the_field_keep_the_output_layer(family_ckpt, tmp_path):
    """Megatron always saves untie_embeddings_and_output_weights; without it a PP 2 checkpoint's
    output layer could be a tied copy or its own weights: it is kept, never dropped on a guess."""
    src = tmp_path / "noflag"
    shutil.copytree(family_ckpt[NAME].legacy, src)
    for f in iteration_dir(src).glob("mp_rank_*/model_optim_rng.pt"):
        state = torch.load(f, map_location="cpu", weights_only=False)
        args = vars(state["args"]).copy()
        del args["untie_embeddings_and_output_weights"]
        state["args"] = argparse.Namespace(**args)
        torch.save(state, f)
    view = open_checkpoint(src)
    assert OUT in view.names()
    torch.testing.assert_close(view.get(OUT), view.get(EMB), rtol=0, atol=0)


@pytest.mark.parametrize("fmt", ["legacy", "torch_dist"])
def test_tied_megatron_to_hf_computes_megatrons_logits(family_ckpt, tmp_path, fmt):
    """The HF side of tied embeddings: `tie_word_embeddings`, no `lm_head.weight` stored, and
    transformers computes megatron-core's logits."""
    import json

    from mcore_proxy.functional.run import fixed_tokens
    from mcore_proxy.hf.models import load_model, run

    ckpt = family_ckpt[NAME]
    out = tmp_path / "hf"
    assert main(["convert", str(getattr(ckpt, fmt)), "-o", str(out), "--format", "hf"]) == 0
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is True
    stored = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert "lm_head.weight" not in stored and "model.embed_tokens.weight" in stored
    got = run(load_model(out), fixed_tokens(ckpt.model))
    torch.testing.assert_close(got, torch.load(ckpt.logits)[0], **CLOSE)


def test_a_copy_that_does_not_match_the_embeddings_is_refused(family_ckpt, tmp_path, capsys):
    src = tmp_path / "bad"
    shutil.copytree(family_ckpt[NAME].legacy, src)
    for f in iteration_dir(src).glob("mp_rank_*_001_*/model_optim_rng.pt"):  # both TP ranks of the last stage
        state = torch.load(f, map_location="cpu", weights_only=False)
        state["model"][OUT] = state["model"][OUT][:-1].clone()
        torch.save(state, f)
    assert main(["inspect", str(src)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "tied copy of embedding.word_embeddings.weight" in err
