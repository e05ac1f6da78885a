"""torch_dist checkpoints: read megatron-core's own saves, write ones megatron-core loads.

One module fixture saves a tiny real MoE GPT with megatron-core at TP=2, EP=2 in both formats from
the same ranks (torch_dist via dist_checkpointing, legacy via torch.save), with its reference
logits and those of a router restricted to the experts a pruned proxy keeps.
"""

from __future__ import annotations

import dataclasses
import re
import shutil
from types import SimpleNamespace

import pytest
import torch

from mcore_proxy.checkpoint import DictModelView, detect_format, open_checkpoint, write_checkpoint
from mcore_proxy.checkpoint.layout import ParallelLayout
from mcore_proxy.checkpoint.legacy import LegacyCheckpoint
from mcore_proxy.checkpoint.names import KeyStyle, parse_dist_key
from mcore_proxy.checkpoint.torch_dist import TorchDistCheckpoint
from mcore_proxy.checkpoint.torch_dist.reader import is_torch_dist_checkpoint, read_dcp_metadata
from mcore_proxy.core.errors import CheckpointError, OutputError
from mcore_proxy.mcore.sharding import rule_for
from mcore_proxy.functional.model import Layout, ToyMoE
from mcore_proxy.testing.dist_ckpt import iteration_dir, load_torch_dist_and_run, save_torch_dist

MODEL = ToyMoE()  # 4 MoE layers x 8 experts, top-2, local spec, fp32
KEPT = {0: [0, 3, 5, 6], 1: [1, 2, 4, 7], 2: [0, 1, 6, 7], 3: [2, 3, 4, 5]}
CLOSE = dict(rtol=1e-5, atol=1e-5)  # fp32 logits; TP changes the order of reductions


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    base = tmp_path_factory.mktemp("torch_dist")
    ref = save_torch_dist(
        MODEL,
        Layout(tp=2, ep=2),
        base / "dist",
        legacy_dir=base / "legacy",
        kept=KEPT,
        kept_ref_path=base / "kept.logits.pt",
    )
    return SimpleNamespace(
        base=base,
        dist=base / "dist",
        legacy=base / "legacy",
        ref=torch.load(ref),
        kept_ref=torch.load(base / "kept.logits.pt"),
    )


# -- pure key mapping ---------------------------------------------------------------------------


@pytest.mark.parametrize("stacked", [True, False])
@pytest.mark.parametrize("local_spec", [True, False])
def test_canonical_names_round_trip_through_dist_keys(stacked, local_spec):
    style = KeyStyle(stacked=stacked, local_spec=local_spec, num_layers=4, num_experts=8)
    for name in (
        "decoder.layers.2.mlp.experts.5.linear_fc1.weight",
        "decoder.layers.3.mlp.router.weight",
        "decoder.layers.1.input_layernorm.weight",
        "decoder.layers.0.pre_mlp_layernorm.weight",
        "decoder.layers.1.self_attention.linear_qkv.weight",
        "embedding.word_embeddings.weight",
        "mtp.layers.0.transformer_layer.mlp.experts.7.linear_fc2.weight",
        "mtp.layers.0.enorm.weight",
    ):
        key, index, sizes = style.locate(name)
        dist = parse_dist_key(key, local_spec)
        assert dist.canonical(index) == name
        assert len(index) == len(sizes) == len(dist.axes)
    assert style.locate("decoder.layers.2.mlp.experts.5.linear_fc1.weight") == (
        ("decoder.layers.mlp.experts.experts.linear_fc1.weight", (2, 5), (4, 8))
        if stacked
        else ("decoder.layers.2.mlp.experts.experts.linear_fc1.weight", (5,), (8,))
    )
    norm_key = style.locate("decoder.layers.1.input_layernorm.weight")[0]
    assert norm_key.endswith("self_attention.linear_qkv.layer_norm_weight" if local_spec else "input_layernorm.weight")


def test_expert_ids_beyond_the_view_are_refused():
    style = KeyStyle(stacked=True, local_spec=True, num_layers=4, num_experts=4)
    with pytest.raises(CheckpointError, match="expert 5 but the view has num_experts=4"):
        style.locate("decoder.layers.0.mlp.experts.5.linear_fc2.weight")


def test_chunks_follow_the_target_shards():
    fc1 = rule_for("decoder.layers.0.mlp.experts.0.linear_fc1.weight")
    fc2 = rule_for("decoder.layers.0.mlp.experts.0.linear_fc2.weight")
    router = rule_for("decoder.layers.0.mlp.router.weight")
    # GLU: gate and up halves apart, as megatron's swiglu factory stores them
    assert fc1.chunk_boxes((8, 4), 2) == [((0, 0), (2, 4)), ((2, 0), (2, 4)), ((4, 0), (2, 4)), ((6, 0), (2, 4))]
    assert fc2.chunk_boxes((4, 6), 3) == [((0, 0), (4, 2)), ((0, 2), (4, 2)), ((0, 4), (4, 2))]
    assert router.chunk_boxes((8, 4), 2) == [((0, 0), (8, 4))]
    assert fc2.chunk_boxes((4, 5), 2) == [((0, 0), (4, 5))]  # not divisible: one chunk


# -- reading megatron-core's save -----------------------------------------------------------------


def test_megatron_save_reads_like_the_legacy_save_of_the_same_weights(saved):
    assert is_torch_dist_checkpoint(saved.dist) and is_torch_dist_checkpoint(iteration_dir(saved.dist))
    assert not is_torch_dist_checkpoint(saved.legacy)
    assert detect_format(saved.dist) == "torch_dist" and detect_format(saved.legacy) == "legacy"
    dist, legacy = open_checkpoint(saved.dist), LegacyCheckpoint(saved.legacy)
    assert isinstance(dist, TorchDistCheckpoint) and dist.info.format == "torch_dist"
    assert dist.iteration == 10 and dist.spec == legacy.spec and dist.spec.num_experts == 8
    assert (dist.layout.tp, dist.layout.pp, dist.layout.ep, dist.layout.etp) == (2, 1, 2, 2)
    assert dist.info.linear_extra_state and dist.args.hidden_size == MODEL.hidden_size
    assert dist.names() == legacy.names()
    for name in legacy.names():
        assert dist.shape(name) == legacy.shape(name) and dist.dtype(name) == legacy.dtype(name), name
        torch.testing.assert_close(dist.get(name), legacy.get(name), rtol=0, atol=0, msg=name)


def test_get_reads_only_the_chunks_of_its_tensor(saved, monkeypatch):
    from mcore_proxy.checkpoint.torch_dist import reader as torch_dist

    view = TorchDistCheckpoint(saved.dist)
    reads = []
    original = torch_dist._read_block
    monkeypatch.setattr(torch_dist, "_read_block", lambda c, *a: reads.append(c) or original(c, *a))
    view.get("decoder.layers.2.mlp.experts.5.linear_fc1.weight")
    # TP=2 gate halves and up halves of this one expert, nothing else
    assert len(reads) == 4 and {c.key for c in reads} == {"decoder.layers.mlp.experts.experts.linear_fc1.weight"}
    assert {c.offsets[:2] for c in reads} == {(2, 5)}
    assert sorted(c.offsets[2] for c in reads) == [0, 8, 16, 24]


def test_one_expert_is_read_from_a_chunk_holding_many(tmp_path):
    """GroupedMLP saves all local experts of a layer in one chunk; plain DCP saves one chunk for
    the whole tensor: `get` reads that expert's bytes at their offset inside the blob."""
    import torch.distributed.checkpoint as dcp

    full = torch.randn(4, 8, 2 * MODEL.moe_ffn_hidden_size, MODEL.hidden_size)
    dcp.save({"decoder.layers.mlp.experts.experts.linear_fc1.weight": full}, checkpoint_id=str(tmp_path), no_dist=True)
    torch.save({"args": MODEL.megatron_args(Layout()), "iteration": 3}, tmp_path / "common.pt")
    (tmp_path / "metadata.json").write_text('{"sharded_backend": "torch_dist"}')
    view = TorchDistCheckpoint(tmp_path)
    assert len(view.names()) == 4 * 8 and view.iteration == 3  # from common.pt: the folder is not iter_*
    for layer, expert in [(0, 0), (2, 5), (3, 7)]:
        name = f"decoder.layers.{layer}.mlp.experts.{expert}.linear_fc1.weight"
        assert torch.equal(view.get(name), full[layer, expert])


# -- writing --------------------------------------------------------------------------------------


def test_legacy_to_torch_dist_round_trip_is_bit_exact(saved, tmp_path):
    legacy = LegacyCheckpoint(saved.legacy)
    out = write_checkpoint(legacy, tmp_path / "out", fmt="torch_dist", progress=False, inputs=(saved.legacy,))
    assert (out / "latest_checkpointed_iteration.txt").read_text() == "10"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # nothing staged left behind
    back = TorchDistCheckpoint(out)
    assert back.names() == legacy.names() and back.iteration == 10 and back.spec == legacy.spec
    assert back.args.ckpt_format == "torch_dist" and back.args.no_save_optim
    for name in legacy.names():
        assert torch.equal(back.get(name), legacy.get(name)), name


@pytest.fixture(scope="module")
def rewritten(saved):
    """megatron's TP=2/EP=2 save, read and written again by mcore-proxy for a TP=1/EP=2 run."""
    return write_checkpoint(
        TorchDistCheckpoint(saved.dist),
        saved.base / "rewritten",
        ParallelLayout(tp=1, ep=2),
        "torch_dist",
        progress=False,
    )


@pytest.mark.parametrize("layout", [Layout(), Layout(ep=2)], ids=["tp1-ep1", "tp1-ep2"])
def test_written_checkpoint_loads_in_megatron_at_another_layout(saved, rewritten, layout, tmp_path):
    args = TorchDistCheckpoint(rewritten).args
    assert (args.tensor_model_parallel_size, args.expert_model_parallel_size) == (1, 2)
    logits = load_torch_dist_and_run(MODEL, layout, rewritten, tmp_path / "logits.pt")
    torch.testing.assert_close(logits, saved.ref, **CLOSE)


def _prune(view, kept: dict[int, list[int]]) -> DictModelView:
    """Keep experts kept[L] of every MoE layer: router rows and experts renumbered 0..K-1."""
    tensors = {}
    for name in view.names():
        if m := re.match(r"^(decoder\.layers\.(\d+)\.mlp\.experts\.)(\d+)\.(.*)$", name):
            ids = kept[int(m.group(2))]
            if int(m.group(3)) in ids:
                tensors[f"{m.group(1)}{ids.index(int(m.group(3)))}.{m.group(4)}"] = view.get(name)
            continue
        tensor = view.get(name)
        if m := re.match(r"^decoder\.layers\.(\d+)\.mlp\.router\.weight$", name):
            tensor = tensor[kept[int(m.group(1))]]
        tensors[name] = tensor
    spec = dataclasses.replace(view.spec, num_experts=len(next(iter(kept.values()))))
    return DictModelView(tensors, spec, args=view.args, iteration=view.iteration)


def test_pruned_view_loads_in_megatron_with_k_experts(saved, tmp_path):
    pruned = _prune(TorchDistCheckpoint(saved.dist), KEPT)
    out = write_checkpoint(pruned, tmp_path / "proxy", ParallelLayout(tp=1, pp=2, ep=1), "torch_dist", progress=False)
    tensors, _ = read_dcp_metadata(iteration_dir(out) / ".metadata")
    assert tuple(tensors["decoder.layers.mlp.router.weight"].size) == (4, 4, 32)
    assert tuple(tensors["decoder.layers.mlp.experts.experts.linear_fc1.weight"].size) == (4, 4, 32, 32)
    back = TorchDistCheckpoint(out)
    assert back.spec.num_experts == 4 and back.args.num_experts == 4 and back.args.pipeline_model_parallel_size == 2
    for name in pruned.names():
        assert torch.equal(back.get(name), pruned.get(name)), name
    logits = load_torch_dist_and_run(
        dataclasses.replace(MODEL, num_experts=4), Layout(pp=2), out, tmp_path / "logits.pt"
    )
    torch.testing.assert_close(logits, saved.kept_ref, **CLOSE)


def test_writer_checks_the_plan_before_writing(saved, tmp_path):
    view = TorchDistCheckpoint(saved.dist)
    with pytest.raises(CheckpointError, match="8 experts do not divide over target EP=3"):
        write_checkpoint(view, tmp_path / "a", ParallelLayout(ep=3), "torch_dist", progress=False)
    with pytest.raises(CheckpointError, match="num_attention_heads=4 does not divide over target TP=3"):
        write_checkpoint(view, tmp_path / "b", ParallelLayout(tp=3), "torch_dist", progress=False)
    (tmp_path / "c").mkdir()
    with pytest.raises(OutputError, match="already exists"):
        write_checkpoint(view, tmp_path / "c", fmt="torch_dist", progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c"]


# -- bad input ------------------------------------------------------------------------------------


@pytest.fixture
def damaged(saved, tmp_path):
    """A copy of megatron's save to break, and its iteration folder."""
    root = shutil.copytree(saved.dist, tmp_path / "ckpt")
    return root, iteration_dir(root)


def test_missing_dcp_metadata(damaged):
    root, it_dir = damaged
    (it_dir / ".metadata").unlink()
    with pytest.raises(CheckpointError, match=r"\.metadata: missing; the torch_dist save did not finish"):
        open_checkpoint(root)


def test_truncated_data_file(damaged):
    root, it_dir = damaged
    data = sorted(it_dir.glob("*.distcp"))[0]
    data.write_bytes(data.read_bytes()[:1000])
    with pytest.raises(CheckpointError, match=rf"{data.name}: holds 1000 bytes .* truncated, copy it again"):
        open_checkpoint(root)


def test_missing_data_file(damaged):
    root, it_dir = damaged
    data = sorted(it_dir.glob("*.distcp"))[-1]
    data.unlink()
    with pytest.raises(CheckpointError, match=rf"{data.name}: data file missing"):
        TorchDistCheckpoint(it_dir)


def test_damaged_chunk_is_reported_when_read(damaged):
    root, it_dir = damaged
    _, storage = read_dcp_metadata(it_dir / ".metadata")
    info = next(v for k, v in storage.items() if k.fqn == "embedding.word_embeddings.weight")
    data = it_dir / info.relative_path
    raw = bytearray(data.read_bytes())
    raw[info.offset : info.offset + info.length] = bytes(info.length)
    data.write_bytes(bytes(raw))
    view = TorchDistCheckpoint(root)  # chunks are read only when asked for
    with pytest.raises(
        CheckpointError,
        match=rf"{data.name}: the chunk of embedding.word_embeddings.weight at "
        rf"byte {info.offset} is not a readable torch.save blob",
    ):
        view.get("embedding.word_embeddings.weight")


def test_incomplete_save_without_metadata_json(damaged):
    root, it_dir = damaged
    (it_dir / "metadata.json").unlink()
    assert detect_format(root) == "torch_dist"  # still recognised, so the message is precise
    with pytest.raises(CheckpointError, match=r"metadata.json: missing, so the torch_dist save did not complete"):
        open_checkpoint(root)
