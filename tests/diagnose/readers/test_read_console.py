"""Console logs as they come (mcore_proxy/diagnose/readers/console.py).

- verl: tests/data/verl_console.log is a documented sample (verl itself does not install here: it
  pulls ray, vllm-era pins and an older transformers). Its metric lines were printed by verl 0.9.1's
  own `LocalLogger.log` / `concat_dict_to_str` (loaded from the verl wheel's source, numpy 2, so
  values print as `np.float64(x)`), then put among what a Ray run prints: coloured `(TaskRunner
  pid=N)` prefixes, the config pprint, warnings with `[repeated 3x across cluster]`, tqdm bars with
  `\\r` updates, a bar glued to a record by `\\r` (step 4), step 7's record cut by a log collector
  into three lines (inside a number and inside a key), and step 13's record half-written at the end.
- TRL / transformers: the console of a real transformers Trainer run (conftest.trl_run).
"""

import numpy as np
import pytest

from mcore_proxy.diagnose.aliases import canonical_metrics
from mcore_proxy.diagnose.readers import read_log
from mcore_proxy.diagnose.readers.console import parse_verl, verl_value

VERL_STEP7 = {"actor/kl_loss": 0.007, "actor/kl_coef": 0.001, "critic/score/mean": 0.45, "prompt_length/mean": 104.5}


def test_verl_console_sample(synthetic):
    run = read_log(synthetic.DATA / "verl_console.log")
    assert run.format == "verl-console"
    names = canonical_metrics(run.metrics)
    assert names == {
        "reward": "critic/score/mean",
        "kl_loss": "actor/kl_loss",
        "ppo_kl": "actor/ppo_kl",
        "entropy": "actor/entropy",
        "grad_norm": "actor/grad_norm",
        "pg_loss": "actor/pg_loss",
        "logprob_diff": "training/rollout_probs_diff_mean",
        "clipfrac": "actor/pg_clipfrac",
        "response_length": "response_length/mean",
    }
    # every training metric at steps 1..12: the glued step 4, the wrapped step 7; step 13 is cut off
    training = {k: s for k, s in run.metrics.items() if not k.startswith("val-")}
    assert len(training) == 25
    for name, series in training.items():
        assert series.steps.tolist() == list(range(1, 13)), name
    np.testing.assert_allclose(run.metrics["critic/score/mean"].values, 0.1 + 0.05 * np.arange(1, 13))
    for name, value in VERL_STEP7.items():
        assert run.metrics[name].values[6] == pytest.approx(value), name
    assert run.metrics["actor/lr"].values[0] == 1e-06 and run.metrics["timing_s/gen"].values[0] == pytest.approx(12.4)
    val = run.metrics["val-core/openai/gsm8k/acc/mean@1"]  # the validation record at step 0
    assert val.steps.tolist() == [0] and val.values.tolist() == [0.25]


def test_verl_value_forms():
    assert [
        verl_value(t)
        for t in ("0.25", "1e-06", "np.float64(0.5)", "np.float32(-2.0)", "np.int64(7)", "True", "np.True_", "inf")
    ] == [0.25, 1e-06, 0.5, -2.0, 7.0, 1.0, 1.0, float("inf")]
    assert np.isnan(verl_value("nan")) and np.isnan(verl_value("np.float64(nan)"))
    assert verl_value("tensor(0.5)") is None and verl_value("np.float64(0.5") is None


@pytest.mark.parametrize(
    "lines",
    [
        ["step:3 - a:1 - b:np.float64(0.2", "5) - c:3"],  # cut inside a number
        ["step:3 - a:1 - b:np.float64(0.25) - c", ":3"],  # cut before the colon
        ["step:3 - a:1 - b:np.float64(0.25) -", "c:3"],  # separator's space dropped
        ["step:3 - a:1 - b:np.float64(0.25)", " - c:3"],  # cut before the separator
        ["step:3 - a:1 - b:np.float64(0.25)", "c:3"],  # separator lost entirely
        ["(TaskRunner pid=1) step:3 - a:1 - b:np.fl", "(TaskRunner pid=1) oat64(0.25) - c:3"],  # prefix re-added
    ],
)
def test_verl_wrapped_records(lines):
    points, records, _ = parse_verl(lines)
    assert records == 1
    assert {k: v for k, [(_, v)] in points.items()} == {"a": 1.0, "b": 0.25, "c": 3.0}
    assert {s for p in points.values() for s, _ in p} == {3}


def test_verl_lines_that_are_not_continuations():
    points, records, _ = parse_verl(
        [
            "step:1 - a:0.5",
            "Done.",
            "step:2 - a:0.6",
            "Training Progress: 50%|##  | 1/2",
            "step:3 - a:0.7",
            "(WorkerDict pid=9) saving checkpoint to /ckpt",
        ]
    )
    assert records == 3 and points["a"] == [(1, 0.5), (2, 0.6), (3, 0.7)]


def test_verl_growing_log_skips_the_half_written_line(tmp_path):
    log = tmp_path / "verl.log"
    log.write_text("step:1 - actor/kl_loss:0.001 - critic/score/mean:0.5\nstep:2 - actor/kl_loss:0.00")
    run = read_log(log)
    assert run.metrics["actor/kl_loss"].steps.tolist() == [1]  # not 0.00 at step 2
    with log.open("a") as f:
        f.write("2 - critic/score/mean:0.6\n")
    assert read_log(log).metrics["actor/kl_loss"].values.tolist() == [0.001, 0.002]


def test_trl_console_of_a_real_trainer(trl_run):
    console, _ = trl_run
    run = read_log(console)
    assert run.format == "trl-console"
    assert canonical_metrics(run.metrics) == {
        "reward": "reward",
        "kl_loss": "kl",
        "entropy": "entropy",
        "grad_norm": "grad_norm",
        "response_length": "completions/mean_length",
        "clipfrac": "clip_ratio/region_mean",
    }
    # steps are the ordinals of the training lines; evaluation lines take the last training step
    assert run.metrics["reward"].steps.tolist() == list(range(1, 7))
    np.testing.assert_allclose(run.metrics["reward"].values, 0.1 * np.arange(1, 7), rtol=1e-3)
    assert run.metrics["eval_loss"].steps.tolist() == [3, 6]
    assert "train_loss" not in run.metrics and "train_runtime" not in run.metrics  # the summary line


def test_trl_console_dict_forms(tmp_path):
    log = tmp_path / "trl.log"
    log.write_text(
        "{'loss': 0.5, 'grad_norm': nan, 'reward': 0.25, 'epoch': 0.1}\n"  # transformers 4
        "\r 10%|#  | 1/10\r{'loss': '0.4', 'reward': '0.3', 'epoch': '0.2'}\n"  # transformers 5
        "{'eval_loss': 0.9, 'epoch': 0.2}\n"
        "{'loss': 0.3, 'reward': 0.35, 'step': 10}\n"
        "{'train_runtime': 10.0, 'train_loss': 0.4, 'epoch': 1.0}\n"
    )
    run = read_log(log)
    assert run.metrics["reward"].steps.tolist() == [1, 2, 10]
    assert run.metrics["eval_loss"].steps.tolist() == [2]
    assert run.metrics["loss"].values.tolist() == [0.5, 0.4, 0.3]  # the line with a bare nan was read
    # a NaN is no point of the curve, but kept and counted
    assert len(run.metrics["grad_norm"]) == 0 and run.metrics["grad_norm"].nonfinite_steps.tolist() == [1]
