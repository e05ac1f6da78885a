"""GQA with Transformer Engine names and TEGroupedMLP experts, DERIVED from the megatron-core-saved
local-spec `qwen3_moe_hf` fixture (GQA with q/k norms, a dense first layer, GroupedMLP; TP 2, PP 2,
EP 2, ETP 1) by the documented key mapping (docs/families.md 2; TE cannot be installed here, so
megatron-core cannot save the TE spec), in every rank file:
  - `input_layernorm.weight` -> `self_attention.linear_qkv.layer_norm_weight` (fused input norm);
  - a dense layer's `pre_mlp_layernorm.weight` -> `mlp.linear_fc1.layer_norm_weight`; MoE layers
    keep `pre_mlp_layernorm.weight`;
  - GroupedMLP `weight1` [H, El*2F] / `weight2` [El*F, H] -> TEGroupedMLP `linear_fc1.weight{j}`
    [2F, H] / `linear_fc2.weight{j}` [H, F] (expert j of the rank's El);
  - extra states as TE >= 2.0 stores them with FP8 (`get_extra_state`): a uint8 tensor of
    `pickle.dumps({"recipe", "scale_fwd", "amax_history_fwd", "scale_bwd", "amax_history_bwd",
    "extra_fp8_variables"})` for every TE linear, and for each grouped linear one state over all
    local experts (per-GEMM columns); the output layer stays a local linear (None);
  - args.transformer_impl = "transformer_engine".
The "recipe" in those bytes is a tripwire whose unpickling creates a file: no test may see it.

Proven: the reader infers the TE spec and yields the original's tensors; conversions with a plan to
other TP/PP/EP in legacy and torch_dist write TE's keys, reset grouped extra states to TE's empty
state (legacy: one per grouped linear; torch_dist: one object per kept expert, renumbered to K),
copy other extra states byte for byte, carry torch_dist per-expert states renumbered; and each
proxy, mapped back by the inverse mapping, loads strictly into megatron-core and computes the
original's logits with its routers restricted to the kept experts."""

from __future__ import annotations

import dataclasses
import pathlib
import pickle
import re
import shutil

import pytest
import torch

from mcore_proxy.checkpoint import open_checkpoint
from mcore_proxy.checkpoint.formats import write_checkpoint
from mcore_proxy.checkpoint.view import ModelView
from mcore_proxy.cli import main
from mcore_proxy.testing.families import StagedLayout, iteration_dir, load_and_run

pytestmark = [pytest.mark.megatron, pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")]

NAME, KEEP = "qwen3_moe_hf", 16
CLOSE = dict(rtol=1e-4, atol=1e-4)
_LAYER = re.compile(r"^(decoder\.layers\.\d+)\.(.*)$")
_TE_W = re.compile(r"^(.*\.mlp\.experts)\.linear_fc([12])\.weight(\d+)$")


class Tripwire:
    """Stands in for TE's recipe object: unpickling it touches `path` (a side effect a test sees)."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return pathlib.Path.touch, (pathlib.Path(self.path),)


def fp8_state(marker, gemms: int, tag: str) -> torch.Tensor:
    """An extra state as TE's `get_extra_state` stores FP8 delayed scaling for `gemms` GEMMs."""
    state = {
        "recipe": Tripwire(str(marker)),
        "scale_fwd": torch.ones(3 * gemms),
        "amax_history_fwd": torch.zeros(4, 3 * gemms),
        "scale_bwd": torch.ones(2 * gemms),
        "amax_history_bwd": torch.zeros(4, 2 * gemms),
        "extra_fp8_variables": {"num_gemms": gemms, "fp8_checkpoint": True, "tag": tag},
    }
    return torch.frombuffer(bytearray(pickle.dumps(state)), dtype=torch.uint8)


def to_te(model: dict, local: int, marker) -> dict:
    """One rank file's model chunk in TE names (see the module docstring); `local` experts per rank."""
    out, grouped = {}, {}
    for key, value in model.items():
        m = _LAYER.match(key)
        rest = m.group(2) if m else None
        if rest == "input_layernorm.weight":
            key = f"{m.group(1)}.self_attention.linear_qkv.layer_norm_weight"
        elif rest == "pre_mlp_layernorm.weight" and f"{m.group(1)}.mlp.linear_fc1.weight" in model:
            key = f"{m.group(1)}.mlp.linear_fc1.layer_norm_weight"
        elif rest in ("mlp.experts.weight1", "mlp.experts.weight2"):
            grouped[(m.group(1), rest[-1])] = value
            continue
        elif key.endswith("._extra_state") and not key.startswith("output_layer"):
            value = fp8_state(marker, 1, key)
        out[key] = value
    for (prefix, fc), w in sorted(grouped.items()):
        hidden = w.shape[0] if fc == "1" else w.shape[1]
        per = w.view(local, hidden, -1) if fc == "1" else w.view(local, -1, hidden)  # megatron's views
        for j in range(local):
            out[f"{prefix}.mlp.experts.linear_fc{fc}.weight{j}"] = per[j].t().contiguous()
        out[f"{prefix}.mlp.experts.linear_fc{fc}._extra_state"] = fp8_state(marker, local, f"{prefix} fc{fc}")
    return out


def from_te(model: dict) -> dict:
    """The inverse mapping, to the local spec megatron-core builds here: norm names back, TE grouped
    weights to GroupedMLP weight1/weight2, TE extra states to the local linears' None."""
    out, experts = {}, {}
    for key, value in model.items():
        if m := _TE_W.match(key):
            experts.setdefault((m.group(1), m.group(2)), {})[int(m.group(3))] = value
            continue
        if re.search(r"\.mlp\.experts\.linear_fc[12]\._extra_state$", key):
            continue
        key = key.replace(".self_attention.linear_qkv.layer_norm_weight", ".input_layernorm.weight")
        key = key.replace(".mlp.linear_fc1.layer_norm_weight", ".pre_mlp_layernorm.weight")
        out[key] = None if key.endswith("._extra_state") else value
    for (prefix, fc), per in experts.items():
        stacked = torch.stack([per[j].t() for j in range(len(per))])  # [El, H, 2F] / [El, F, H]
        # weight1 [H, El*2F] holds memory [El][H][2F], weight2 [El*F, H] memory [El][F][H]
        out[f"{prefix}.weight{fc}"] = (
            stacked.reshape(stacked.shape[1], -1) if fc == "1" else stacked.reshape(-1, stacked.shape[2])
        )
    return out


def _rank_files(root):
    return sorted(iteration_dir(root).glob("mp_rank_*/model_optim_rng.pt"))


def derive_te(src, dst, marker) -> None:
    shutil.copytree(src, dst)
    for f in _rank_files(dst):
        state = torch.load(f, map_location="cpu", weights_only=False)
        local = state["args"].num_experts // state["args"].expert_model_parallel_size
        state["model"] = to_te(state["model"], local, marker)
        state["args"].transformer_impl = "transformer_engine"
        torch.save(state, f)


def map_back(root) -> None:
    for f in _rank_files(root):
        state = torch.load(f, map_location="cpu", weights_only=False)
        state["model"] = from_te(state["model"])
        state["args"].transformer_impl = "local"
        torch.save(state, f)


@pytest.fixture(scope="module")
def te_copy(family_ckpt, tmp_path_factory):
    ckpt = family_ckpt[NAME]
    base = tmp_path_factory.mktemp("te-gqa")
    marker = base / "UNPICKLED"
    derive_te(ckpt.legacy, base / "legacy", marker)
    yield ckpt, base / "legacy", marker
    assert not marker.exists(), "bytes of an extra state were unpickled"


def _te_name(name: str, dense: set[str]) -> str:
    m = _LAYER.match(name)
    if m and m.group(2) == "input_layernorm.weight":
        return f"{m.group(1)}.self_attention.linear_qkv.layer_norm_weight"
    if m and m.group(2) == "pre_mlp_layernorm.weight" and m.group(1) in dense:
        return f"{m.group(1)}.mlp.linear_fc1.layer_norm_weight"
    return name


def test_the_reader_infers_te_and_reads_the_original_tensors(te_copy):
    ckpt, te, marker = te_copy
    local_view, te_view = open_checkpoint(ckpt.legacy), open_checkpoint(te)
    assert te_view.layer_spec == "transformer_engine" and te_view.layout.expert_layout == "te_grouped"
    dense = {"decoder.layers.0"}
    names = set(te_view.names())
    assert "decoder.layers.0.mlp.linear_fc1.layer_norm_weight" in names
    assert "decoder.layers.1.pre_mlp_layernorm.weight" in names
    for name in local_view.names():
        torch.testing.assert_close(te_view.get(_te_name(name, dense)), local_view.get(name), rtol=0, atol=0)
    extra = sorted(n for n in names if n.endswith("._extra_state"))
    experts = [n for n in extra if ".mlp.experts." in n]
    assert len(experts) == 3 * 32 * 2  # 3 MoE layers x 32 experts x (fc1, fc2): one per expert
    assert all(te_view.get(n).dtype == torch.uint8 and te_view.get(n).numel() == 0 for n in experts)  # reset
    qkv = te_view.get("decoder.layers.2.self_attention.linear_qkv._extra_state")
    # opaque bytes, as TP rank 0 stored them (pickles of equal states differ in torch's serialization id)
    stored = torch.load(
        iteration_dir(te) / "mp_rank_00_001_000" / "model_optim_rng.pt", map_location="cpu", weights_only=False
    )["model"]
    assert torch.equal(qkv, stored["decoder.layers.0.self_attention.linear_qkv._extra_state"])
    assert not marker.exists()


# (case, source, convert options, format megatron-core loads, layout it loads at)
CASES = [
    (
        "legacy-tp1-pp1-ep2",
        "legacy",
        ["--target-tp", "1", "--target-pp", "1", "--target-ep", "2"],
        StagedLayout(ep=2, grouped=True),
    ),
    (
        "torch_dist-tp2-pp2",
        "legacy",
        ["--target-tp", "2", "--target-pp", "2", "--target-ep", "1", "--format", "torch_dist"],
        StagedLayout(tp=2, pp=2, grouped=True),
    ),
    # the legacy GroupedMLP (weight1/weight2) from TE: args say moe_use_legacy_grouped_gemm
    (
        "legacy-grouped-pp2",
        "legacy",
        ["--target-tp", "2", "--target-pp", "2", "--target-ep", "1", "--expert-layout", "grouped"],
        StagedLayout(tp=2, pp=2, grouped=True),
    ),
]


@pytest.fixture(scope="module")
def converted(te_copy, tmp_path_factory, planted_plan):
    """The plan, the TE proxies of CASES (torch_dist also converted back to legacy TE at TP 1 / PP 2
    by mcore-proxy, which is what the inverse mapping can map) and the logits of one set of ranks."""
    ckpt, te, marker = te_copy
    tmp = tmp_path_factory.mktemp("te-convert")
    plan = planted_plan(te, KEEP, tmp / "plan.json", target_ep=1)
    keep = {lid: plan.kept(lid) for lid in plan.layer_ids}
    out, jobs = {}, [(ckpt.model, ckpt.layout, "torch_dist", ckpt.torch_dist, tmp / "restricted.pt")]
    proxy_model = dataclasses.replace(ckpt.model, num_experts=KEEP)
    for case, _, options, layout in CASES:
        assert main(["convert", str(te), "--plan", str(tmp / "plan.json"), "-o", str(tmp / case), *options]) == 0
        out[case] = tmp / case
        loadable = tmp / case
        if "torch_dist" in options:
            loadable = tmp / f"{case}-legacy"
            assert (
                main(
                    [
                        "convert",
                        tmp / case,
                        "-o",
                        loadable,
                        "--format",
                        "legacy",
                        "--target-tp",
                        "1",
                        "--target-pp",
                        "2",
                        "--target-ep",
                        "1",
                    ]
                )
                == 0
            )
            layout = StagedLayout(pp=2, grouped=True)
        mapped = tmp / f"{case}-mapped"
        shutil.copytree(loadable, mapped)
        map_back(mapped)
        jobs.append((proxy_model, layout, "legacy", mapped, tmp / f"{case}.pt"))
    logits = load_and_run(jobs, keeps=[keep] + [None] * len(CASES))
    return plan, tmp / "plan.json", out, dict(zip([c[0] for c in CASES], logits[1:])), logits[0]


@pytest.mark.parametrize("case", [c[0] for c in CASES])
def test_te_proxies_map_back_load_and_equal_the_restricted_original(family_ckpt, converted, case):
    _, _, _, got, want = converted
    torch.testing.assert_close(got[case], want, **CLOSE)
    assert (torch.load(family_ckpt[NAME].logits) - want).abs().max() > 1e-3  # the restriction matters


def test_legacy_te_proxy_keys_and_extra_states(te_copy, converted):
    _, te, _ = te_copy
    _, _, out, _, _ = converted
    source = torch.load(
        iteration_dir(te) / "mp_rank_00_000_000" / "model_optim_rng.pt", map_location="cpu", weights_only=False
    )["model"]
    for f in _rank_files(out["legacy-tp1-pp1-ep2"]):
        model = torch.load(f, map_location="cpu", weights_only=False)["model"]
        assert "decoder.layers.0.mlp.linear_fc1.layer_norm_weight" in model
        assert "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight" in model
        assert "decoder.layers.1.pre_mlp_layernorm.weight" in model and not any("input_layernorm" in k for k in model)
        for layer in (1, 2, 3):
            prefix = f"decoder.layers.{layer}.mlp.experts"
            assert sorted(k for k in model if k.startswith(prefix + ".linear_fc1.weight")) == sorted(
                f"{prefix}.linear_fc1.weight{j}" for j in range(KEEP // 2)
            )
            for fc in (1, 2):
                state = model[f"{prefix}.linear_fc{fc}._extra_state"]
                assert state.dtype == torch.uint8 and state.numel() == 0  # reset: TE's "no FP8 state"
        # non-expert TE states: byte for byte the source's (pp 0's local layer 0 is global layer 0)
        assert torch.equal(
            model["decoder.layers.0.self_attention.linear_qkv._extra_state"],
            source["decoder.layers.0.self_attention.linear_qkv._extra_state"],
        )
        assert model["output_layer._extra_state"] is None


def test_torch_dist_te_proxy_has_one_object_per_kept_expert(converted):
    from mcore_proxy.checkpoint.torch_dist.reader import read_dcp_metadata

    _, _, out, _, _ = converted
    keys, _ = read_dcp_metadata(iteration_dir(out["torch_dist-tp2-pp2"]) / ".metadata")
    for layer in (1, 2, 3):
        for fc in (1, 2):
            key = f"decoder.layers.{layer}.mlp.experts.experts.linear_fc{fc}._extra_state"
            objects = sorted(k for k in keys if k.startswith(key + "/"))
            assert objects == sorted(f"{key}/shard_{e}_{KEEP}" for e in range(KEEP))
            assert all(type(keys[k]).__name__ == "BytesStorageMetadata" for k in objects)
            assert key not in keys  # never a ShardedTensor
    assert "decoder.layers.0.mlp.linear_fc1.layer_norm_weight" in keys
    assert "decoder.layers.0.self_attention.linear_qkv._extra_state/shard_0_1" in keys
    view = open_checkpoint(out["torch_dist-tp2-pp2"])
    assert view.layer_spec == "transformer_engine" and view.layout.expert_layout == "te_grouped"


class PerExpertStates(ModelView):
    """The TE copy's view with each expert's `_extra_state` a distinct FP8 state for one GEMM, as
    megatron-core's `_split_extra_state` saves a TEGroupedMLP to torch_dist with FP8 on."""

    def __init__(self, base: ModelView, marker):
        super().__init__(base.info)
        self.base, self.marker = base, marker

    def names(self):
        return self.base.names()

    def shape(self, name):
        return self.base.shape(name)

    def dtype(self, name):
        return self.base.dtype(name)

    def get(self, name):
        if ".mlp.experts." in name and name.endswith("._extra_state"):
            return fp8_state(self.marker, 1, name)
        return self.base.get(name)


def test_torch_dist_per_expert_states_follow_their_expert(te_copy, converted, tmp_path):
    _, te, marker = te_copy
    plan, plan_path, _, _, _ = converted
    src = write_checkpoint(
        PerExpertStates(open_checkpoint(te), marker), tmp_path / "src", fmt="torch_dist", progress=False
    )
    assert main(["convert", str(src), "--plan", str(plan_path), "-o", str(tmp_path / "out")]) == 0
    view, source = open_checkpoint(tmp_path / "out"), open_checkpoint(src)
    for layer in (1, 2, 3):
        for j, e in enumerate(plan.kept(str(layer))):
            got = view.get(f"decoder.layers.{layer}.mlp.experts.{j}.linear_fc1._extra_state")
            want = source.get(f"decoder.layers.{layer}.mlp.experts.{e}.linear_fc1._extra_state")
            assert got.dtype == torch.uint8 and got.numel() > 0 and torch.equal(got, want), (layer, j, e)
    assert not marker.exists()


def test_te_to_legacy_grouped_mlp_says_so_in_args(converted):
    _, _, out, _, _ = converted
    for f in _rank_files(out["legacy-grouped-pp2"]):
        state = torch.load(f, map_location="cpu", weights_only=False)
        assert state["args"].moe_use_legacy_grouped_gemm is True and state["args"].moe_grouped_gemm is True
        model = state["model"]
        assert not any(".mlp.experts.linear_fc" in k for k in model)  # no TE keys, no grouped extra state
        assert any(k.endswith(".mlp.experts.weight1") for k in model)
    for f in _rank_files(out["legacy-tp1-pp1-ep2"]):
        assert torch.load(f, map_location="cpu", weights_only=False)["args"].moe_use_legacy_grouped_gemm is False
