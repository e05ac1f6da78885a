"""The smallest fitting layouts: valid, minimal (against brute force), constrained, or refused."""

from __future__ import annotations

import math

import pytest

from mcore_proxy.core.errors import ProxyError
from mcore_proxy.estimate import DEVICE_SIZES_GIB, GIB, Request, estimate
from mcore_proxy.estimate.memory import Layout, Training, device_memory, stage_layers
from mcore_proxy.estimate.model import architecture
from mcore_proxy.estimate.search import Constraints, allowed_devices, check_constraints, fitting_layouts, valid_tps
from mcore_proxy.estimate.sources import from_preset, merge

MID = architecture(
    name="mid",
    num_layers=12,
    hidden_size=1024,
    vocab_size=32768,
    num_attention_heads=16,
    num_query_groups=4,
    kv_channels=64,
    ffn_hidden_size=4096,
    num_experts=32,
    moe_ffn_hidden_size=512,
    topk=4,
    moe_layers=tuple(range(1, 12)),
)


def brute_force_min_devices(a, train, budget, c):
    """Every valid layout up to the device bound, tried one by one."""
    best = None
    for tp in valid_tps(a, c.devices_per_node):
        for pp in range(1, a.num_layers + 1):
            stages = stage_layers(a.num_layers, pp)
            for ep in [d for d in range(1, a.num_experts + 1) if a.num_experts % d == 0]:
                for dp in range(1, c.max_devices // (tp * pp) + 1):
                    n = tp * pp * dp
                    if stages is None or (tp * dp) % ep or not allowed_devices(n, c.devices_per_node):
                        continue
                    if best is not None and n >= best:
                        break
                    if device_memory(a, Layout(tp, pp, ep, 1, dp, stages), train).total <= budget:
                        best = n
    return best


@pytest.mark.parametrize("budget_gib", [3, 6, 12])
def test_the_fewest_devices_agree_with_brute_force(budget_gib):
    train, c = Training(seq_len=2048), Constraints(max_devices=256)
    found = fitting_layouts(MID, train, budget_gib * GIB, c)
    assert found and found[0][0].devices == brute_force_min_devices(MID, train, budget_gib * GIB, c)


def test_every_layout_returned_is_valid_and_fits():
    budget = 6 * GIB
    for lay, mem in fitting_layouts(MID, Training(), budget, Constraints()):
        assert MID.num_experts % lay.ep == 0 and (lay.tp * lay.dp) % (lay.ep * lay.etp) == 0
        assert sum(lay.stages) == MID.num_layers and min(lay.stages) >= 1 and len(lay.stages) == lay.pp
        assert MID.num_attention_heads % lay.tp == 0 and MID.num_query_groups % lay.tp == 0
        assert allowed_devices(lay.devices, 8) and mem.total <= budget
        assert mem == device_memory(MID, lay, Training())


def test_fixed_sizes_are_kept():
    found = fitting_layouts(MID, Training(), 12 * GIB, Constraints(tp=2, ep=8))
    assert found and all(lay.tp == 2 and lay.ep == 8 for lay, _ in found)


def test_sizes_that_cannot_work_name_the_nearest_valid_ones():
    with pytest.raises(
        ProxyError, match=r"--tp 3: TP=3 does not divide the 16 attention heads.*nearest valid: --tp 2 or --tp 4"
    ):
        check_constraints(MID, Constraints(tp=3))
    with pytest.raises(ProxyError, match=r"--pp 13 cannot split 12 decoder layers.*nearest valid: --pp 12$"):
        check_constraints(MID, Constraints(pp=13))
    with pytest.raises(ProxyError, match=r"--ep 3 does not divide the 32 experts.*nearest valid: --ep 2 or --ep 4"):
        check_constraints(MID, Constraints(ep=3))


def test_k_that_cannot_be_selected_or_split_is_refused_with_the_nearest_k():
    qwen = merge(from_preset("qwen3-30b-a3b"))
    with pytest.raises(
        ProxyError,
        match=r"--num-experts 48 is not divisible by --ep 32.*nearest feasible: "
        r"--num-experts 32 or --num-experts 64, or --ep 16",
    ):
        estimate(qwen, Request(num_experts=48, constraints=Constraints(ep=32)))
    ds = merge(from_preset("deepseek-v3"))
    with pytest.raises(
        ProxyError, match=r"not divisible by the 8 routing groups.*nearest feasible: --num-experts 16\)"
    ):
        estimate(ds, Request(num_experts=12))
    with pytest.raises(ProxyError, match=r"smaller than the router top-k 8.*nearest feasible: --num-experts 8\)"):
        estimate(qwen, Request(num_experts=4))


def test_memory_too_small_for_any_layout_names_the_memory_that_would_do():
    qwen = merge(from_preset("qwen3-30b-a3b"))
    with pytest.raises(ProxyError) as err:
        estimate(qwen, Request(num_experts=48, device_memory=4 * GIB))
    text = str(err.value)
    assert "no layout of at most 16384 devices fits Qwen3-30B-A3B with 128 experts in 3.6 GiB" in text
    need = int(text.split("--device-memory ")[1].split("GiB")[0])
    assert fitting_layouts(qwen, Training(), int(need * GIB * 0.9), Constraints())  # it would do
    below = max([s for s in DEVICE_SIZES_GIB if s < need] + [4])  # the next common size down
    assert not fitting_layouts(qwen, Training(), int(below * GIB * 0.9), Constraints())


def test_a_fixed_layout_that_does_not_fit_names_the_smallest_that_does():
    qwen = merge(from_preset("qwen3-30b-a3b"))
    with pytest.raises(
        ProxyError,
        match=r"no layout with TP=1 PP=1 EP=8 DP=8 .* nearest feasible: TP=4 PP=2 EP=8 "
        r"ETP=1 DP=2 on 16 devices",
    ):
        estimate(qwen, Request(num_experts=48, constraints=Constraints(tp=1, pp=1, ep=8, dp=8)))


def test_the_paper_settings():
    """Qwen3-30B-A3B keeping 48 of 128 experts and DeepSeek-V3.2 keeping 16 of 256, on 64 GB
    Ascend devices (bench/RESULTS.md compares these with the method paper's 16 -> 8 and 512 -> 64)."""
    qwen = estimate(merge(from_preset("qwen3-30b-a3b")), Request(num_experts=48))
    assert (qwen.original.devices, qwen.proxy.devices) == (16, 8)
    ds = estimate(merge(from_preset("deepseek-v3.2")), Request(num_experts=16))
    assert (ds.original.devices, ds.proxy.devices) == (336, 32)
    assert math.isclose(ds.device_ratio, 10.5)
