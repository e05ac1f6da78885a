"""Triage: a library of synthetic fault signatures (three faults x two strengths against one
baseline) ranks a held-out run of each fault (another seed, a strength between the two, its own
baseline) first; the library
round-trips through JSON; bad input is one sentence with exit 2."""

import json

import pytest

from mcore_proxy.cli import main
from mcore_proxy.diagnose.compare import pair_signature
from mcore_proxy.diagnose.library import Library, LibraryEntry, LibraryError, earliest_warning, load_library
from mcore_proxy.diagnose.readers import read_log
from mcore_proxy.diagnose.signature import MetricSignature
from mcore_proxy.diagnose.triage import rank_faults, size_agreement

FAULTS = ("omission", "precision", "noise")


@pytest.fixture
def library(tmp_path, synthetic):
    base = synthetic.write_jsonl(tmp_path / "base.jsonl", synthetic.curves(seed=0))
    entries = []
    for fault in FAULTS:
        for strength in (0.6, 1.5):
            name = f"{fault}@{strength}"
            log = synthetic.write_jsonl(
                tmp_path / f"{name}.jsonl", synthetic.curves(fault, seed=0, onset=30, strength=strength)
            )
            sig, _ = pair_signature(read_log(base), read_log(log), label=name)
            entries.append(LibraryEntry(name, fault, str(strength), f"{fault}:strength={strength}", log, sig))
    return Library("baseline", base, tuple(entries), "synthetic").save(tmp_path / "library.json")


def held_out(tmp_path, synthetic, fault, seed=7):
    base = synthetic.write_jsonl(tmp_path / f"ho-base-{seed}.jsonl", synthetic.curves(seed=seed))
    run = synthetic.write_jsonl(tmp_path / f"ho-{fault}.jsonl", synthetic.curves(fault, seed=seed, onset=30))
    return base, run


@pytest.mark.parametrize("fault", FAULTS)
def test_held_out_run_of_each_fault_is_ranked_first(tmp_path, synthetic, library, fault):
    base, run = held_out(tmp_path, synthetic, fault)
    sig, _ = pair_signature(read_log(base), read_log(run))
    ranks = rank_faults(sig, load_library(library))
    assert [r.fault for r in ranks][0] == fault
    assert ranks[0].score > ranks[1].score
    assert set(r.fault for r in ranks) == set(FAULTS)


def test_cli_triage_table_and_json(tmp_path, synthetic, library, capsys):
    base, run = held_out(tmp_path, synthetic, "precision")
    assert main(["compare", "--run", run, "--baseline", base, "--library", str(library)]) == 0
    out = capsys.readouterr().out
    assert "   1  precision" in out and "logprob_diff: library +1" in out
    assert main(["compare", "--run", run, "--baseline", base, "--library", str(library), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["format"] == "mcore-proxy-compare/1" and data["mode"] == "triage"
    assert data["ranking"][0]["fault"] == "precision"
    assert data["ranking"][0]["evidence"]["logprob_diff"]["run"]["direction"] == 1
    assert "logprob_diff" in data["shifted"]


def test_library_round_trip_and_earliest_warning(library):
    lib = load_library(library)
    assert Library.from_dict(json.loads(json.dumps(lib.to_dict()))) == lib
    first = {e.name: earliest_warning(e.signature) for e in lib.entries}
    assert first["precision@1.5"].metric in ("logprob_diff", "kl_loss")
    assert 25 <= first["precision@1.5"].onset <= 35


def test_bad_input(tmp_path, synthetic, library, capsys):
    base, run = held_out(tmp_path, synthetic, "noise")
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"format": "something-else/1"}))
    with pytest.raises(LibraryError, match="is not 'mcore-proxy-library/1'"):
        load_library(bad)
    assert main(["compare", "--run", run, "--baseline", base, "--library", str(bad)]) == 2
    assert "bad.json: format 'something-else/1'" in capsys.readouterr().err
    assert main(["compare", "--run", run, "--baseline", base, "--library", str(tmp_path / "none.json")]) == 2
    assert main(["compare", "--run", run, "--library", str(library)]) == 2
    assert "needs --run, --baseline and --library together" in capsys.readouterr().err
    assert main(["compare", "--run", run, "--baseline", base, "--library", str(library), "--orig-base", base]) == 2
    assert "two modes" in capsys.readouterr().err
    assert main(["compare", "--orig-base", base]) == 2


def _shifted_by(shift: float) -> MetricSignature:
    return MetricSignature("rollout_kl", 30, 0, 29, 1 if shift else 0, shift, None, None, 0.0, 0, 0.0, 1.0, 0.0, 1)


@pytest.mark.parametrize(
    "a, b, expected",
    [(0.05, 0.05, 1.0), (0.05, 0.5, 2 / 3), (5e-6, 0.043, 0.0), (0.0, 0.1, 0.0), (0.0, 0.0, 1.0)],
)
def test_size_gate_counts_decades_apart(a, b, expected):
    """The rollout KL of a bf16 rollout (+5e-6) and of router noise (+0.043) agree in direction,
    trend and onset; the size gate is what tells them apart."""
    assert size_agreement(_shifted_by(a), _shifted_by(b)) == pytest.approx(expected)
