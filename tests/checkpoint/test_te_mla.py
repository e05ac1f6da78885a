"""Multi-latent attention as the Transformer Engine spec saves it, DERIVED from the megatron-core-saved
local-spec DeepSeek-V3 fixture by the documented key mapping (docs/families.md 2; megatron-core cannot
build the TE spec without Transformer Engine): in every rank file `q_layernorm.weight` /
`kv_layernorm.weight` become `linear_q_up_proj.layer_norm_weight` / `linear_kv_up_proj.layer_norm_weight`,
the down projections become the full tensor on every TP rank (duplicated), and args.transformer_impl
says "transformer_engine". Extra states stay None (the mapping covers names and splits only).

Proven: the reader infers the TE spec and yields the same tensors as from the local original; a
conversion of the TE copy, mapped back by the inverse mapping, equals the same conversion of the
original tensor for tensor; args contradicting the files are refused in one sentence."""

from __future__ import annotations

import re
import shutil

import pytest
import torch

from mcore_proxy.checkpoint import open_checkpoint
from mcore_proxy.cli import main
from mcore_proxy.testing.families import iteration_dir

NORMS = {
    "q_layernorm.weight": "linear_q_up_proj.layer_norm_weight",
    "kv_layernorm.weight": "linear_kv_up_proj.layer_norm_weight",
}
_DOWN = re.compile(r"\.self_attention\.linear_(q|kv)_down_proj\.weight$")
_FOLDER = re.compile(r"mp_rank_(\d+)(?:_(\d+))?(?:_(\d+))?$")


def _files(root):
    return sorted(iteration_dir(root).glob("mp_rank_*/model_optim_rng.pt"))


def _coords(path, layout_pp: int) -> tuple[int, int]:
    m = _FOLDER.match(path.parent.name)
    return int(m.group(1)), int(m.group(2) or 0) if layout_pp > 1 else 0


def _chunks(state: dict) -> list[str]:
    return [k for k in state if re.fullmatch(r"model\d*", k)]


def to_te(state: dict, full_down: dict) -> dict:
    """One rank file's model chunks in the TE spec's names and splits."""
    for key in _chunks(state):
        chunk = {}
        for name, value in state[key].items():
            for local, te in NORMS.items():
                if name.endswith(".self_attention." + local):
                    name = name[: -len(local)] + te
            chunk[name] = full_down.get((key, name), value)
        state[key] = chunk
    return state


def from_te(state: dict, tp_rank: int, tp: int) -> dict:
    """The inverse mapping: fused norm names back, down projections sliced to this TP rank's rows."""
    for key in _chunks(state):
        chunk = {}
        for name, value in state[key].items():
            for local, te in NORMS.items():
                if name.endswith(".self_attention." + te):
                    name = name[: -len(te)] + local
            chunk[name] = value.chunk(tp)[tp_rank] if _DOWN.search(name) else value
        state[key] = chunk
    return state


def derive_te_checkpoint(src, dst, pp: int) -> None:
    shutil.copytree(src, dst)
    files = _files(dst)
    states = {f: torch.load(f, map_location="cpu", weights_only=False) for f in files}
    shards: dict = {}
    for f, state in states.items():
        tp_rank, pp_rank = _coords(f, pp)
        for key in _chunks(state):
            for name, value in state[key].items():
                if _DOWN.search(name):
                    shards.setdefault((pp_rank, key, name), {})[tp_rank] = value
    for f, state in states.items():
        _, pp_rank = _coords(f, pp)
        full = {
            (key, name): torch.cat([parts[t] for t in sorted(parts)])
            for (p, key, name), parts in shards.items()
            if p == pp_rank
        }
        state = to_te(state, full)
        state["args"].transformer_impl = "transformer_engine"
        torch.save(state, f)


@pytest.fixture(scope="module")
def te_copy(family_ckpt, tmp_path_factory):
    ckpt = family_ckpt["deepseek_v3_mla"]
    dst = tmp_path_factory.mktemp("te-mla") / "legacy"
    derive_te_checkpoint(ckpt.legacy, dst, ckpt.layout.pp)
    return ckpt, dst


def _te_name(name: str) -> str:
    for local, te in NORMS.items():
        if name.endswith(".self_attention." + local):
            return name[: -len(local)] + te
    return name


def test_the_reader_infers_the_te_spec_and_reads_the_same_tensors(te_copy):
    ckpt, te = te_copy
    local_view, te_view = open_checkpoint(ckpt.legacy), open_checkpoint(te)
    assert (local_view.layer_spec, te_view.layer_spec) == ("local", "transformer_engine")
    assert sorted(te_view.names()) == sorted(_te_name(n) for n in local_view.names())
    shard = torch.load(_files(te)[0], map_location="cpu", weights_only=False)["model0"]
    assert tuple(shard["decoder.layers.0.self_attention.linear_q_down_proj.weight"].shape) == (20, 32)  # duplicated
    for name in local_view.names():
        a, b = local_view.get(name), te_view.get(_te_name(name))
        assert (a is None and b is None) or torch.equal(a, b), name


def test_a_conversion_of_the_te_copy_maps_back_to_the_same_conversion_of_the_original(te_copy, tmp_path):
    ckpt, te = te_copy
    options = ["--target-tp", "2", "--target-pp", "2", "--target-ep", "1"]
    assert main(["convert", str(ckpt.legacy), "-o", str(tmp_path / "local"), *options]) == 0
    assert main(["convert", str(te), "-o", str(tmp_path / "te"), *options]) == 0
    local_files, te_files = _files(tmp_path / "local"), _files(tmp_path / "te")
    assert [f.parent.name for f in local_files] == [f.parent.name for f in te_files]
    for lf, tf in zip(local_files, te_files):
        want = torch.load(lf, map_location="cpu", weights_only=False)
        got = torch.load(tf, map_location="cpu", weights_only=False)
        assert got["args"].transformer_impl == "transformer_engine"
        tp_rank, _ = _coords(tf, 2)
        got = from_te(got, tp_rank, 2)
        # PP kept: both keep the source's layout string, so model0 / model1 chunks
        assert _chunks(got) == _chunks(want) == ["model0", "model1"], tf
        for key in _chunks(want):
            assert set(got[key]) == set(want[key]), (tf, key)
            for name, value in want[key].items():
                other = got[key][name]
                assert (value is None and other is None) or torch.equal(value, other), (tf, key, name)


def test_args_contradicting_the_files_are_refused(te_copy, tmp_path, capsys):
    _, te = te_copy
    bad = tmp_path / "bad"
    shutil.copytree(te, bad)
    for f in _files(bad):
        state = torch.load(f, map_location="cpu", weights_only=False)
        state["args"].transformer_impl = "local"
        torch.save(state, f)
    assert main(["inspect", str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "transformer_impl says 'local'" in err and "model_optim_rng.pt" in err
