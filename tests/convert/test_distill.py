"""`mcore-proxy distill` (issue 24 item 3): a proxy trained briefly against its original, both built by
megatron-core on CPU from checkpoints megatron-core wrote; the result loads strictly and runs, is closer
to the original on held-out rows, and says it is no longer bit for bit."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch

from mcore_proxy.cli import main
from mcore_proxy.functional.model import Layout
from mcore_proxy.functional.run import load_and_run
from mcore_proxy.testing.fixtures import FIXTURES

FIXTURE = "seq_tp2_pp2_ep2"
ONE_RANK = ["--target-tp", "1", "--target-pp", "1", "--target-ep", "1"]


@pytest.fixture(scope="module")
def one_rank(megatron_ckpt, proxy_plan, tmp_path_factory):
    """(original at one rank, its proxy at one rank, token file, plan, folder)."""
    ckpt, _ = megatron_ckpt(FIXTURE)
    plan_path, plan = proxy_plan(FIXTURE)
    base = tmp_path_factory.mktemp("distill")
    assert main(["convert", str(ckpt), "-o", str(base / "orig"), *ONE_RANK]) == 0  # re-shard only
    assert main(["convert", str(ckpt), "--plan", str(plan_path), "-o", str(base / "proxy"), *ONE_RANK]) == 0
    model, _ = FIXTURES[FIXTURE]
    np.save(base / "tokens.npy", np.random.default_rng(0).integers(0, model.vocab_size, size=(96, 16)))
    return base / "orig", base / "proxy", base / "tokens.npy", plan_path, base


def test_distill_brings_the_proxy_closer_and_says_so(one_rank, tmp_path, capsys, digest):
    orig, proxy, tokens, plan_path, _ = one_rank
    before = digest(proxy)
    out = tmp_path / "distilled"
    argv = ["distill", "--orig", str(orig), "--proxy", str(proxy), "--tokens", str(tokens), "-o", str(out)]
    assert main([*argv, "--steps", "40", "--batch", "16", "--lr", "3e-3", "--held-out", "16", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["rows_trained"] == 80 and doc["held_out_rows"] == 16
    assert doc["kl_after"] < 0.7 * doc["kl_before"], doc
    assert digest(proxy) == before, "the input proxy was modified"
    record = json.loads((out / "distill.json").read_text())
    assert "not the original's bit for bit" in record["what"] and record["kl_held_out"]["after"] == doc["kl_after"]

    # megatron-core loads the result strictly and it computes something else than the proxy did
    model, _ = FIXTURES[FIXTURE]
    proxy_model = dataclasses.replace(model, num_experts=4)
    got = load_and_run(proxy_model, Layout(), out, tmp_path / "distilled.pt")
    undistilled = load_and_run(proxy_model, Layout(), proxy, tmp_path / "proxy.pt")
    assert torch.isfinite(got).all() and (got - undistilled).abs().max() > 1e-3
    # and it is no longer a bit-for-bit proxy of the source
    assert main(["verify", "--orig", str(orig), "--proxy", str(out), "--plan", str(plan_path)]) == 1


def test_distill_refuses_what_it_cannot_run(one_rank, megatron_ckpt, tmp_path, capsys):
    orig, proxy, tokens, _, base = one_rank
    ckpt, _ = megatron_ckpt(FIXTURE)  # TP 2, PP 2, EP 2
    np.save(base / "floats.npy", np.zeros((4, 8), dtype=np.float32))
    cases = [
        (["--orig", str(ckpt), "--proxy", str(proxy), "--tokens", str(tokens)], "--target-tp 1 --target-pp 1"),
        (["--orig", str(orig), "--proxy", str(proxy), "--tokens", str(base / "floats.npy")], "expected integer token"),
        (["--orig", str(orig), "--proxy", str(proxy), "--tokens", str(base / "none.npy")], "token file not found"),
    ]
    for argv, match in cases:
        out = tmp_path / "out"
        assert main(["distill", *argv, "-o", str(out)]) == 2
        err = capsys.readouterr().err
        assert match in err and len(err.strip().splitlines()) == 1, err
        assert not out.exists()
