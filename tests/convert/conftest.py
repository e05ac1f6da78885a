"""Plans made by the real selection code on planted statistics shaped like each fixture."""

from __future__ import annotations

import pytest

from mcore_proxy.checkpoint import open_checkpoint
from mcore_proxy.select import synthetic

KEEP = {"seq_tp2_pp2_ep2": 4, "grouped_ep4": 4, "deepseek_like_pp2_uneven": 8}


def make_plan(ckpt, num_experts: int, path, target_ep: int = 1, method: str = "multiview"):
    return synthetic.planted_plan(open_checkpoint(ckpt), num_experts, path, target_ep=target_ep, method=method)


@pytest.fixture(scope="session")
def proxy_plan(megatron_ckpt, tmp_path_factory):
    """`proxy_plan(fixture)` -> (plan path, plan): K experts chosen by multiview selection."""
    made = {}

    def get(fixture: str):
        if fixture not in made:
            ckpt, _ = megatron_ckpt(fixture)
            path = tmp_path_factory.mktemp("plans") / f"{fixture}.json"
            made[fixture] = (path, make_plan(ckpt, KEEP[fixture], path))
        return made[fixture]

    return get


@pytest.fixture(scope="session")
def planted_plan():
    """`make_plan` for modules with checkpoints of their own: `planted_plan(ckpt, K, path, target_ep)`."""
    return make_plan
