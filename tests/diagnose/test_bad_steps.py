"""Bad input in metric logs (issue 40, item 7): a step that is not a whole number from 0 to 10^15
(10^30, NaN, 2.5, -1, 5000 digits), a JSON line nested 100,000 deep, an integer of thousands of
digits. Each is one sentence naming the file and the line, exit 2, from `compare` and `watch` (which
stops at once instead of waiting for the log to mend), in every format that can hold it; the logs
are left byte-identical."""

import json
import time

import pytest

from mcore_proxy.cli import main

STEP_FIX = "a step must be a whole number from 0 to 10^15 (the training step)"
DEEP = "[" * 100_000 + "]" * 100_000


def _jsonl(lines: list[str]) -> str:
    good = [json.dumps({"step": s, "data": {"critic/score/mean": 0.5 + 0.01 * s}}) for s in range(3)]
    return "\n".join(good + lines + [json.dumps({"step": 9, "data": {"critic/score/mean": 0.6}})]) + "\n"


# name -> (file name, its text, what the sentence says after "<path>: ")
CASES = {
    "jsonl step 10^30": (
        "run.jsonl",
        _jsonl(['{"step": 1000000000000000000000000000000, "data": {"a": 1}}']),
        f"line 4: step 1.00e+30 is outside 0..10^15; {STEP_FIX}",
    ),
    "jsonl step 1e30": (
        "run.jsonl",
        _jsonl(['{"step": 1e30, "data": {"a": 1}}']),
        f"line 4: step 1e+30 is outside 0..10^15; {STEP_FIX}",
    ),
    "jsonl step NaN": (
        "run.jsonl",
        _jsonl(['{"step": NaN, "data": {"a": 1}}']),
        f"line 4: step nan is not finite; {STEP_FIX}",
    ),
    "jsonl step Infinity": (
        "run.jsonl",
        _jsonl(['{"step": Infinity, "data": {"a": 1}}']),
        f"line 4: step inf is not finite; {STEP_FIX}",
    ),
    "jsonl step 2.5": (
        "run.jsonl",
        _jsonl(['{"step": 2.5, "data": {"a": 1}}']),
        f"line 4: step 2.5 is not a whole number; {STEP_FIX}",
    ),
    "jsonl step -1": (
        "run.jsonl",
        _jsonl(['{"step": -1, "data": {"a": 1}}']),
        f"line 4: step -1 is outside 0..10^15; {STEP_FIX}",
    ),
    "jsonl nested 100000 deep": ("run.jsonl", _jsonl([DEEP]), "line 4 is JSON nested too deep to read"),
    "jsonl 5000-digit value": (
        "run.jsonl",
        _jsonl(['{"step": 3, "data": {"a": ' + "7" * 5000 + "}}"]),
        "line 4 holds a number of thousands of digits, which no metric log has",
    ),
    "csv step 1e30": (
        "run.csv",
        "step,critic/score/mean\n0,0.5\n1e30,0.6\n2,0.7\n",
        f"line 3: step 1e+30 is outside 0..10^15; {STEP_FIX}",
    ),
    "csv step nan": (
        "run.csv",
        "step,critic/score/mean\n0,0.5\nnan,0.6\n2,0.7\n",
        f"line 3: step nan is not finite; {STEP_FIX}",
    ),
    "megatron iteration 10^30": (
        "train.log",
        " [x] iteration        1/     100 | lm loss: 2.0 |\n"
        " [x] iteration 1000000000000000000000000000000/ 100 | lm loss: 1.9 |\n",
        f"line 2: step 1.00e+30 is outside 0..10^15; {STEP_FIX}",
    ),
    "verl step of 5000 digits": (
        "train.log",
        "step:1 - critic/score/mean:0.5\nstep:" + "9" * 5000 + " - critic/score/mean:0.6\n",
        f"line 2: step 9.99e+4999 is outside 0..10^15; {STEP_FIX}",
    ),
    "trl step 2.5": (
        "train.log",
        "{'loss': 0.5, 'reward': 0.1}\n{'loss': 0.4, 'reward': 0.2, 'step': 2.5}\n",
        f"line 2: step 2.5 is not a whole number; {STEP_FIX}",
    ),
    "trainer state step 1e30": (
        "trainer_state.json",
        json.dumps({"global_step": 2, "log_history": [{"step": 1, "reward": 0.1}, {"step": 1e30, "reward": 0.2}]}),
        f"log_history entry 1: step 1e+30 is outside 0..10^15; {STEP_FIX}",
    ),
    "trainer state nested 100000 deep": (
        "trainer_state.json",
        '{"log_history": [], "x": ' + DEEP + "}",
        "JSON nested too deep to read",
    ),
}


def _one_error_line(err: str, command: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith(f"mcore-proxy {command}: error: "), err
    return lines[0]


def _good(tmp_path, synthetic) -> str:
    (tmp_path / "good").mkdir()
    return synthetic.write_jsonl(tmp_path / "good" / "run.jsonl", synthetic.curves(steps=20))


def _bad(tmp_path, name) -> tuple:
    file, text, said = CASES[name]
    (tmp_path / "bad").mkdir()
    path = tmp_path / "bad" / file
    path.write_text(text)
    return path, said


@pytest.mark.parametrize("name", list(CASES))
def test_compare_refuses_it_in_one_sentence(tmp_path, synthetic, digest, capsys, name):
    good, (bad, said) = _good(tmp_path, synthetic), _bad(tmp_path, name)
    before = digest(tmp_path)
    argv = ["--orig-base", good, "--orig-fault", good, "--proxy-base", good, "--proxy-fault", str(bad)]
    assert main(["compare", *argv]) == 2
    line = _one_error_line(capsys.readouterr().err, "compare")
    assert f"error: {bad}: {said}" in line
    assert digest(tmp_path) == before


@pytest.mark.parametrize("name", list(CASES))
def test_watch_stops_on_it_in_one_sentence(tmp_path, digest, capsys, name):
    bad, said = _bad(tmp_path, name)
    before = digest(tmp_path)
    t0 = time.time()
    # without --once: a record that is wrong for good is not waited for
    assert main(["watch", str(bad), "--every", "0.2", "--idle", "60"]) == 2
    assert time.time() - t0 < 30
    assert f"error: {bad}: {said}" in _one_error_line(capsys.readouterr().err, "watch")
    assert digest(tmp_path) == before


def test_tensorboard_step_beyond_the_range(tmp_path, digest, capsys):
    pytest.importorskip("tensorboard")
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(tmp_path / "tb"))
    writer.add_scalar("actor/grad_norm", 0.5, 1)
    writer.add_scalar("actor/grad_norm", 0.6, 10**16)
    writer.close()
    before = digest(tmp_path)
    assert main(["watch", str(tmp_path / "tb"), "--once"]) == 2
    line = _one_error_line(capsys.readouterr().err, "watch")
    assert f": event 2: step 1.00e+16 is outside 0..10^15; {STEP_FIX}" in line
    assert digest(tmp_path) == before


def test_mlflow_file_store_step_beyond_the_range(tmp_path, digest, capsys):
    run = tmp_path / "mlruns" / "0" / "abc"
    (run / "metrics" / "actor").mkdir(parents=True)
    (run / "meta.yaml").write_text("run_id: abc\nrun_name: r\nlifecycle_stage: active\n")
    (run / "metrics" / "actor" / "kl_loss").write_text("1700000000000 0.1 1\n1700000000001 0.2 1e30\n")
    before = digest(tmp_path)
    assert main(["watch", str(run), "--once"]) == 2
    line = _one_error_line(capsys.readouterr().err, "watch")
    assert f"kl_loss: line 2: step 1e+30 is outside 0..10^15; {STEP_FIX}" in line
    assert digest(tmp_path) == before


def test_steps_at_the_edges_of_the_range_are_read(tmp_path):
    from mcore_proxy.diagnose.readers import read_log

    log = tmp_path / "run.jsonl"
    log.write_text(
        '{"step": 0, "data": {"a": 1}}\n{"step": 3.0, "data": {"a": 2}}\n{"step": 1000000000000000, "data": {"a": 3}}\n'
    )
    assert read_log(log).metrics["a"].steps.tolist() == [0, 3, 10**15]
