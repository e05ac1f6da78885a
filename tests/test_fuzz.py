"""A fixed sample of the fuzz campaign (bench/fuzz.py) in the test suite: ~100 damaged and hostile
Megatron inputs and 30 Hugging Face ones (one per input and damage kind), each through the real CLI
in a forked child. The campaigns themselves (>= 2000 Megatron cases, >= 500 HF cases with `--hf`)
are run by hand; their tables are in bench/RESULTS.md."""

from __future__ import annotations

import collections
import importlib.util
import sys
import time
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench" / "fuzz.py"
SAMPLE, SEED = 100, 20261201
HF_SAMPLE = 30


@pytest.fixture(scope="module")
def fuzz():
    spec = importlib.util.spec_from_file_location("mcore_proxy_fuzz", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
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
    failed = [
        (r["case"], r["target"], r["kind"], r["command"], r["problems"], r.get("stderr", "")[-600:])
        for r in records
        if r["problems"]
    ]
    assert not failed, failed
    outcomes = collections.Counter(r["outcome"] for r in records)
    assert set(outcomes) <= {"exit 0", "exit 1", "exit 2"}, outcomes
    assert outcomes["exit 2"] > SAMPLE // 3  # most damage is found and refused
    assert {r["target"] for r in records} == set(fuzz.WEIGHTS)
    print(f"fuzz sample: {dict(outcomes)} in {seconds:.0f} s")


def test_fuzz_hf_sample(fuzz, fixture_root, tmp_path_factory):
    """The first case of 30 of the 31 (input, damage kind) of the HF campaign: tiny transformers-built
    checkpoints of three families and an FP8 copy (built once, in a forked child), their statistics,
    plans and proxies, damaged and run through inspect, convert, verify, stats show and select."""
    work = tmp_path_factory.mktemp("fuzz-hf")
    corpus = fuzz.build_corpus(work, None, hf_cache=fixture_root)
    fuzz.preload(corpus)
    cases, seen = [], set()
    for case in fuzz.make_hf_cases(400, SEED):  # damaged quantization under --dequantize
        if (
            (case.target, case.kind) not in seen
            and len(cases) < HF_SAMPLE
            and (case.kind != "quant" or case.command == "convert_deq")
        ):
            seen.add((case.target, case.kind))
            cases.append(case)
    start = time.perf_counter()
    records = fuzz.campaign(cases, corpus, work / "cases", jobs=2, progress=False)
    seconds = time.perf_counter() - start
    failed = [
        (
            r["case"],
            r["target"],
            r.get("model"),
            r["kind"],
            r["command"],
            r["problems"],
            r.get("what"),
            r.get("stderr", "")[-600:],
        )
        for r in records
        if r["problems"]
    ]
    assert not failed, failed
    outcomes = collections.Counter(r["outcome"] for r in records)
    assert set(outcomes) <= {"exit 0", "exit 1", "exit 2"}, outcomes
    assert outcomes["exit 2"] > len(records) // 2  # most damage is found and refused
    assert {r["target"] for r in records} == set(fuzz.HF_TARGETS) and len(records) == HF_SAMPLE
    print(f"fuzz HF sample: {dict(outcomes)} in {seconds:.0f} s")
