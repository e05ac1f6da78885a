"""The CLI campaign (bench/fuzz_cli.py) in the test suite, every case: outputs placed where they must
not go, non-finite statistics and metrics, out-of-range sizes and steps, a stdout without a reader,
each through the real CLI in a forked child, judged by the rules of docs/reliability.md."""

from __future__ import annotations

import collections
import importlib.util
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[1] / "bench" / "fuzz_cli.py"


@pytest.fixture(scope="module")
def fuzz_cli():
    spec = importlib.util.spec_from_file_location("mcore_proxy_fuzz_cli", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_every_cli_case_keeps_the_rules(fuzz_cli, megatron_ckpt, tmp_path_factory):
    legacy, _ = megatron_ckpt(fuzz_cli.FIXTURE)
    work = tmp_path_factory.mktemp("fuzz-cli")
    corpus = fuzz_cli.build_corpus(work, legacy)
    cases = [c for c in fuzz_cli.make_cases() if c.needs != "hf" or (corpus / "hf_unrunnable").is_dir()]
    # the parent's OpenMP pool running, as in a pytest worker that ran other tests: children forked
    # from it hung in their first parallel region until they stopped entering it
    torch.randn(512, 512) @ torch.randn(512, 512)
    records = fuzz_cli.campaign(cases, corpus, work, progress=False)
    failed = [(r["case"], r["outcome"], r["problems"], r["stderr"][-400:]) for r in records if r["problems"]]
    assert not failed, failed
    by_rule = collections.Counter(r["rule"] for r in records)
    assert set(by_rule) == {"outside", "inputs", "finite", "no-3", "pipe"}, by_rule
    outcomes = collections.Counter(r["outcome"] for r in records)
    assert "exit 3" not in outcomes and "hang" not in outcomes, outcomes


def test_a_broken_rule_is_caught(fuzz_cli, tmp_path):
    """The judge is not a rubber stamp: a write beside the output, an exit 3, a traceback, a second
    error line and a missing sentence each count as a problem."""
    case = fuzz_cli.CliCase("x", "outside", ("inspect",), frozenset({2}), outputs=("out",), says="needle")
    before = {"a": "1", "out": "dir"}
    after = {"a": "2", "out": "dir", "out/f": "3", ".lock": "4"}
    outside = fuzz_cli.changed_outside(before, after, case.outputs)
    assert outside == [".lock", "a"]
    stderr = "Traceback (most recent call last)\nx: error: one\nx: error: two\n"
    problems = fuzz_cli.judge(case, 3, "", stderr, outside)
    assert len(problems) == 4, problems  # exit 3, traceback, missing 'needle', changed outside
    assert fuzz_cli.judge(case, 2, "", stderr, []) == [
        "a traceback on stderr",
        "exit 2 with 2 error lines",
        "does not say 'needle'",
    ]
