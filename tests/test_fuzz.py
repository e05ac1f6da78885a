"""A fixed sample of the fuzz campaign (bench/fuzz.py) in the test suite: ~100 damaged and hostile
inputs, each through the real CLI in a forked child. The campaign itself (>= 2000 cases) is run by
hand; its table is in bench/RESULTS.md."""
from __future__ import annotations

import collections
import importlib.util
import sys
import time
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench" / "fuzz.py"
SAMPLE, SEED = 100, 20261201


@pytest.fixture(scope="module")
def fuzz():
    spec = importlib.util.spec_from_file_location("mcore_proxy_fuzz", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module   # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_fuzz_sample(fuzz, megatron_ckpt, tmp_path_factory):
    legacy, _ = megatron_ckpt(fuzz.FIXTURE)
    work = tmp_path_factory.mktemp("fuzz")
    corpus = fuzz.build_corpus(work, legacy)
    fuzz.preload(corpus)
    cases = fuzz.make_cases(SAMPLE, SEED)
    start = time.perf_counter()
    records = fuzz.campaign(cases, corpus, work / "cases", jobs=2, progress=False)
    seconds = time.perf_counter() - start
    failed = [(r["case"], r["target"], r["kind"], r["command"], r["problems"], r.get("stderr", "")[-600:])
              for r in records if r["problems"]]
    assert not failed, failed
    outcomes = collections.Counter(r["outcome"] for r in records)
    assert set(outcomes) <= {"exit 0", "exit 1", "exit 2"}, outcomes
    assert outcomes["exit 2"] > SAMPLE // 3        # most damage is found and refused
    assert {r["target"] for r in records} == set(fuzz.WEIGHTS)
    print(f"fuzz sample: {dict(outcomes)} in {seconds:.0f} s")
