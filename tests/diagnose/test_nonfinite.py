"""NaN and infinite metric values (issue 40, item 6): every reader keeps them apart from the curve,
`watch` alerts on them with the step of the first (and fails by default), `compare` counts them per
run and requires the proxy to turn non-finite under the fault where the original does, and a log
of nothing else is described as such. The logs read are never modified."""

import json

import numpy as np
import pytest

from mcore_proxy.cli import main
from mcore_proxy.diagnose.compare import ROLES
from mcore_proxy.diagnose.readers import read_log

DIFF, REWARD = "training/rollout_probs_diff_mean", "critic/score/mean"


def _one_error_line(err: str, command: str) -> str:
    """The one line a refusal prints (no traceback), without its prefix."""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith(f"mcore-proxy {command}: error: "), err
    return lines[0]


def _blow_up(data: dict, start: int = 60) -> dict:
    """The curves with the log-prob difference +inf on every third step from `start` on and the
    reward NaN at step `start` + 10, as an overflowing rollout would log them."""
    diff, reward = data[DIFF].copy(), data[REWARD].copy()
    diff[start::3] = np.inf
    reward[start + 10] = np.nan
    return {**data, DIFF: diff, REWARD: reward}


def test_json_tokens_nan_and_infinity_are_kept_and_counted(tmp_path):
    log = tmp_path / "run.jsonl"
    log.write_text(
        '{"step": 0, "data": {"a": 1.0, "b": NaN}}\n'
        '{"step": 1, "data": {"a": Infinity, "b": NaN}}\n'
        '{"step": 2, "data": {"a": -Infinity, "b": 2.0}}\n'
        '{"step": 3, "data": {"a": 1e999, "b": 3.0}}\n'  # overflows to +inf in Python's parser
        '{"step": 4, "data": {"a": -' + "9" * 400 + ', "b": 4.0}}\n'  # an int beyond any float: -inf
    )
    a, b = read_log(log).metrics["a"], read_log(log).metrics["b"]
    assert a.steps.tolist() == [0] and a.nonfinite_steps.tolist() == [1, 2, 3, 4]
    assert a.nonfinite_kinds() == {"+inf": 2, "-inf": 2}
    assert b.describe_nonfinite() == "2 NaN of 5 logged values, the first at step 0"
    # a step logged twice keeps its last value, finite or not (a restarted run)
    with log.open("a") as f:
        f.write('{"step": 0, "data": {"a": 5.0, "b": 7.0}}\n{"step": 3, "data": {"a": NaN, "b": 3.0}}\n')
    a = read_log(log).metrics["a"]
    assert a.values.tolist() == [5.0] and a.nonfinite_kinds() == {"NaN": 1, "+inf": 1, "-inf": 2}


def test_watch_draws_the_largest_finite_values(tmp_path, capsys):
    # the span of +-1.8e308 overflows a float: the view must still draw it
    log = tmp_path / "run.jsonl"
    log.write_text("".join(f'{{"step": {s}, "data": {{"actor/grad_norm": {(-1) ** s}e308}}}}\n' for s in range(8)))
    assert main(["watch", str(log), "--once", "--detectors", "nonfinite"]) == 0
    row = next(line for line in capsys.readouterr().err.splitlines() if line.startswith("grad_norm "))
    assert "1e+308" in row and "▁█▁█" in row


def test_csv_and_console_logs_keep_nan_and_inf(tmp_path):
    csv = tmp_path / "metrics.csv"
    csv.write_text("step,critic/score/mean,actor/kl_loss\n0,0.5,nan\n1,inf,0.1\n2,-inf,0.2\n,9,9\n")
    run = read_log(csv)
    assert run.metrics["critic/score/mean"].nonfinite_kinds() == {"+inf": 1, "-inf": 1}
    assert run.metrics["actor/kl_loss"].nonfinite_steps.tolist() == [0]
    verl = tmp_path / "verl.log"
    verl.write_text(
        "step:1 - actor/kl_loss:nan - critic/score/mean:np.float64(0.5)\n"
        "step:2 - actor/kl_loss:np.float64(inf) - critic/score/mean:0.6\n"
    )
    assert read_log(verl).metrics["actor/kl_loss"].nonfinite_kinds() == {"NaN": 1, "+inf": 1}
    megatron = tmp_path / "megatron.log"
    megatron.write_text(" [x] iteration        1/     100 | lm loss: nan | grad norm: 0.5 |\n")
    assert read_log(megatron).metrics["lm loss"].nonfinite_steps.tolist() == [1]


def test_tensorboard_keeps_nan_and_inf(tmp_path):
    pytest.importorskip("tensorboard")
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(tmp_path / "tb"))
    for step, value in enumerate([0.1, float("nan"), 0.3, float("inf")]):
        writer.add_scalar("actor/grad_norm", value, step)
    writer.close()
    s = read_log(tmp_path / "tb").metrics["actor/grad_norm"]
    assert s.steps.tolist() == [0, 2] and s.nonfinite_steps.tolist() == [1, 3]


def test_watch_alerts_on_nan_and_inf_with_the_first_step_and_fails_by_default(tmp_path, synthetic, digest, capsys):
    # the report's case: log-prob difference inf and reward NaN on one step in three
    data = synthetic.curves(steps=60)
    data[DIFF][2::3] = np.inf
    data[REWARD][2::3] = np.nan
    (tmp_path / "in").mkdir()
    log = synthetic.write_jsonl(tmp_path / "in" / "run.jsonl", data)
    before = digest(tmp_path / "in")
    assert main(["watch", log, "--once"]) == 1
    captured = capsys.readouterr()
    alerts = {a["metric"]: a for a in map(json.loads, captured.out.splitlines()) if a["detector"] == "nonfinite"}
    assert set(alerts) == {"reward", "logprob_diff"}
    assert alerts["logprob_diff"]["onset"] == 2 and alerts["logprob_diff"]["raw_name"] == DIFF
    assert alerts["logprob_diff"]["value"] == 20 and alerts["logprob_diff"]["step"] == 59
    assert alerts["reward"]["message"] == "20 NaN of 60 logged values, the first at step 2"
    rows = {line.split()[0]: line for line in captured.err.splitlines() if line[:1].isalpha()}
    assert "ALERT nonfinite since 2" in rows["logprob_diff"] and rows["logprob_diff"].split()[1] == "inf"
    assert "check failed: nonfinite alert on" in captured.err
    # --fail-on none watches without failing; --nonfinite restricts the metrics watched
    assert main(["watch", log, "--once", "--fail-on", "none"]) == 0
    assert "ALERT nonfinite since 2" in capsys.readouterr().err
    assert main(["watch", log, "--once", "--nonfinite", "entropy", "--fail-on", "nonfinite"]) == 0
    assert "nonfinite" not in capsys.readouterr().out
    assert digest(tmp_path / "in") == before


def test_watch_describes_a_log_of_nothing_but_nan(tmp_path, digest, capsys):
    (tmp_path / "in").mkdir()
    log = tmp_path / "in" / "run.jsonl"
    log.write_text(
        "".join(f'{{"step": {s}, "data": {{"{REWARD}": NaN, "actor/kl_loss": Infinity}}}}\n' for s in range(5))
    )
    before = digest(tmp_path / "in")
    assert main(["watch", str(log), "--once", "--json"]) == 1
    captured = capsys.readouterr()
    doc = json.loads(captured.out)
    assert {(a["metric"], a["onset"]) for a in doc["alerts"]} == {("reward", 0), ("kl_loss", 0)}
    assert "only NaN/inf (5 values)" in captured.err
    assert digest(tmp_path / "in") == before


def _four(tmp_path, synthetic, proxy_blows_up: bool) -> dict:
    runs = {
        "orig_base": synthetic.curves(seed=0),
        "orig_fault": _blow_up(synthetic.curves("precision", seed=0, onset=30)),
        "proxy_base": synthetic.curves(seed=5, scale=0.8),
        "proxy_fault": synthetic.curves("precision", seed=5, scale=0.8, onset=30),
    }
    if proxy_blows_up:
        runs["proxy_fault"] = _blow_up(runs["proxy_fault"])
    (tmp_path / "in").mkdir(exist_ok=True)
    return {role: synthetic.write_jsonl(tmp_path / "in" / f"{role}.jsonl", data) for role, data in runs.items()}


def _argv(paths, *extra):
    return [a for role in ROLES for a in (f"--{role.replace('_', '-')}", paths[role])] + list(extra)


def test_compare_counts_nan_and_inf_and_matches_the_blow_up(tmp_path, synthetic, digest, capsys):
    paths = _four(tmp_path, synthetic, proxy_blows_up=True)
    before = digest(tmp_path / "in")
    assert main(["compare", *_argv(paths)]) == 0
    out = capsys.readouterr().out
    assert "non-finite: logprob_diff: NaN/inf in orig-fault 20 from step 60, proxy-fault 20 from step 60" in out
    assert "non-finite: reward: NaN/inf in orig-fault 1 from step 70, proxy-fault 1 from step 70" in out
    # the reward's curve does not shift; its one NaN under the fault is what departs
    assert "(shifted in the original: reward (NaN/inf), kl_loss, logprob_diff)" in out
    assert main(["compare", *_argv(paths), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    diff = doc["metrics"]["logprob_diff"]
    assert diff["nonfinite"] is True
    assert diff["nonfinite_counts"] == {"orig-base": 0, "orig-fault": 20, "proxy-base": 0, "proxy-fault": 20}
    assert doc["signatures"]["original"]["metrics"]["logprob_diff"]["nonfinite_onset"] == 60
    assert digest(tmp_path / "in") == before


def test_compare_a_proxy_that_does_not_blow_up_where_the_original_does_is_not_consistent(
    tmp_path, synthetic, digest, capsys
):
    paths = _four(tmp_path, synthetic, proxy_blows_up=False)
    before = digest(tmp_path / "in")
    assert main(["compare", *_argv(paths)]) == 1
    captured = capsys.readouterr()
    # the finite curves agree; the blow-up alone makes the difference
    diff_row = next(line for line in captured.out.splitlines() if line.startswith("logprob_diff "))
    assert "NO: NaN/inf under the fault in the original from step 60, not in the proxy" in diff_row
    assert "check failed: NOT CONSISTENT" in captured.err
    assert digest(tmp_path / "in") == before


def test_compare_refuses_a_log_of_nothing_but_nan_in_one_sentence(tmp_path, synthetic, digest, capsys):
    paths = _four(tmp_path, synthetic, proxy_blows_up=True)
    nan_log = tmp_path / "in" / "proxy_fault.jsonl"
    nan_log.write_text(
        "".join(f'{{"step": {s}, "data": {{"{DIFF}": NaN, "{REWARD}": -Infinity}}}}\n' for s in range(120))
    )
    before = digest(tmp_path / "in")
    assert main(["compare", *_argv(paths)]) == 2
    line = _one_error_line(capsys.readouterr().err, "compare")
    assert line.endswith(
        f"{nan_log}: every metric holds only NaN or infinite values (2 metrics, from step 0), so there is no "
        "curve to compare; `mcore-proxy watch` shows where the run broke"
    )
    assert digest(tmp_path / "in") == before


def test_triage_refuses_a_log_of_nothing_but_nan(tmp_path, capsys):
    log = tmp_path / "run.jsonl"
    log.write_text('{"step": 0, "data": {"a": NaN}}\n{"step": 1, "data": {"a": NaN}}\n')
    library = tmp_path / "library.json"
    library.write_text(
        json.dumps({"format": "mcore-proxy-library/1", "baseline": {"name": "b", "log": "b"}, "entries": []})
    )
    assert main(["compare", "--run", str(log), "--baseline", str(log), "--library", str(library)]) == 2
    assert "every metric holds only NaN or infinite values" in _one_error_line(capsys.readouterr().err, "compare")
