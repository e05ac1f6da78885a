"""Backbone: Megatron checkpoint -> reader -> writer at another layout -> megatron-core loads and runs it."""

from __future__ import annotations

import pytest
import torch

from mcore_proxy.checkpoint import open_checkpoint, write_checkpoint
from mcore_proxy.checkpoint.legacy import LegacyCheckpoint
from mcore_proxy.checkpoint.target import resolve_target
from mcore_proxy.functional.model import Layout
from mcore_proxy.functional.run import load_and_run
from mcore_proxy.testing.fixtures import FIXTURES

ROUND_TRIPS = [
    ("seq_tp2_pp2_ep2", dict(tp=1, pp=1, ep=4)),
    ("seq_tp2_pp2_ep2", dict(tp=2, pp=1, ep=1)),
    ("grouped_ep4", dict(tp=2, pp=1, ep=2)),
    ("grouped_ep4", dict(tp=1, pp=2, ep=1, expert_layout="sequential")),
    ("seq_tp2_etp1_ep2", dict(tp=1, pp=1, ep=1)),
    ("seq_tp2_etp1_ep2", dict(tp=2, pp=1, ep=2, etp=1, expert_layout="grouped")),
    ("deepseek_like_pp2_uneven", dict(tp=1, pp=1, ep=1)),
    ("deepseek_like_pp2_uneven", dict(tp=2, pp=2, ep=2, etp=1, stage_layers=(3, 1))),
]


def as_run_layout(target) -> Layout:
    first = target.stage_layers[0] if target.uneven else None
    return Layout(
        tp=target.tp,
        pp=target.pp,
        ep=target.ep,
        etp=target.etp,
        grouped=target.expert_layout == "grouped",
        first_stage_layers=first,
    )


@pytest.mark.parametrize(
    "fixture,target", ROUND_TRIPS, ids=lambda x: x if isinstance(x, str) else "-".join(f"{k}{v}" for k, v in x.items())
)
def test_written_checkpoint_runs_like_the_original(megatron_ckpt, digest, tmp_path, fixture, target):
    ckpt, ref_logits = megatron_ckpt(fixture)
    before = digest(ckpt)
    source = open_checkpoint(ckpt)
    layout = resolve_target(source, **target)
    out = write_checkpoint(source, tmp_path / "out", layout, inputs=(ckpt,), progress=False)

    # re-reading gives bit-identical canonical tensors
    again = LegacyCheckpoint(out)
    assert again.names() == source.names()
    for name in source.names():
        assert torch.equal(again.get(name), source.get(name)), name
    assert again.layout.tp == layout.tp and again.layout.ep == layout.ep and again.layout.pp == layout.pp

    # megatron-core builds the target layout, loads strictly, and reproduces the original logits
    model, _ = FIXTURES[fixture]
    logits = load_and_run(model, as_run_layout(layout), out, tmp_path / "logits.pt")
    torch.testing.assert_close(logits, torch.load(ref_logits), rtol=1e-5, atol=1e-5)
    assert digest(ckpt) == before, "the input checkpoint was modified"


def test_written_checkpoint_keeps_iteration_and_drops_training_state(megatron_ckpt, tmp_path):
    from mcore_proxy.checkpoint.torchfile import TorchFile

    ckpt, _ = megatron_ckpt("seq_tp2_etp1_ep2")
    out = write_checkpoint(
        open_checkpoint(ckpt), tmp_path / "out", resolve_target(open_checkpoint(ckpt), ep=2), progress=False
    )
    assert (out / "latest_checkpointed_iteration.txt").read_text() == "10"
    state = TorchFile(out / "iter_0000010" / "mp_rank_00_001" / "model_optim_rng.pt").obj
    assert set(state) == {"args", "checkpoint_version", "iteration", "model"}
    assert state["iteration"] == 10
    args = state["args"]
    assert (
        args.tensor_model_parallel_size,
        args.expert_model_parallel_size,
        args.expert_tensor_parallel_size,
        args.pipeline_model_parallel_size,
    ) == (1, 2, 1, 1)
    # a megatron enum in args survives as the same class path even without megatron imported here
    assert type(args.attention_backend).__module__ == "megatron.core.transformer.enums"
    assert sorted(p.name for p in out.iterdir()) == ["iter_0000010", "latest_checkpointed_iteration.txt"]


def test_the_index_keeps_only_the_shards_it_reads(megatron_ckpt):
    """Each rank file's structure is forgotten once indexed: at EP 2 every non-expert tensor is saved on
    both EP ranks, beside the optimizer state, yet only one record per shard the view reads stays alive
    (the reader's memory grows with the canonical tensors, not with the rank files: bench/RESULTS.md)."""
    import gc

    from mcore_proxy.checkpoint.torchfile import LazyTensor

    def live_records() -> int:
        gc.collect()
        return sum(isinstance(o, LazyTensor) for o in gc.get_objects())

    ckpt, _ = megatron_ckpt("seq_tp2_pp2_ep2")
    before = live_records()
    view = open_checkpoint(ckpt)
    kept = live_records() - before
    assert kept == sum(len(view.byte_ranges(n)) for n in view.names()) > 0
