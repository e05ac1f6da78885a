"""Readers on logs written by torch.utils.tensorboard, and on samples of each documented console
and file format (tests/data/); bad input gets one sentence naming the file."""

import json
import os

import numpy as np
import pytest

from mcore_proxy.diagnose.aliases import canonical_metrics, resolve
from mcore_proxy.diagnose.readers import parse_console_line, read_log
from mcore_proxy.core.errors import LogError


def test_tensorboard_written_by_torch(tmp_path):
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(tmp_path / "tb"))
    for step in range(20):
        writer.add_scalar("actor/kl_loss", 0.01 * step, step)
        writer.add_scalar("critic/score/mean", 0.5, step)
        writer.add_histogram("weights", np.arange(5.0), step)  # not a scalar: ignored
        writer.add_text("note", "hello", step)
    writer.close()
    writer = SummaryWriter(str(tmp_path / "tb"))  # a restart writes a 2nd file
    writer.add_scalar("actor/kl_loss", 9.0, 19)
    writer.close()
    run = read_log(tmp_path / "tb")
    assert run.format == "tensorboard" and set(run.metrics) == {"actor/kl_loss", "critic/score/mean"}
    kl = run.metrics["actor/kl_loss"]
    assert kl.steps.tolist() == list(range(20))
    np.testing.assert_allclose(kl.values[:19], 0.01 * np.arange(19), rtol=1e-6)
    assert kl.values[19] == 9.0  # the later file wins
    assert canonical_metrics(run.metrics) == {"kl_loss": "actor/kl_loss", "reward": "critic/score/mean"}


def test_megatron_console_sample():
    run = read_log(pytest.importorskip("pathlib").Path(__file__).parents[1] / "data" / "megatron_console.log")
    assert run.format == "console"
    assert run.metrics["lm loss"].steps.tolist() == list(range(1, 13))
    assert {"grad norm", "learning rate", "load_balancing_loss", "memory(GiB)"} <= set(run.metrics)
    assert "elapsed time" not in run.metrics  # 0:01:00 is not a number
    assert resolve("grad_norm", run.metrics) == "grad norm"


def test_mindspeed_rl_console_sample(synthetic):
    run = read_log(synthetic.DATA / "mindspeed_rl_console.log")
    assert run.metrics["grpo/score/mean"].steps.tolist() == list(range(1, 11))
    assert canonical_metrics(run.metrics) == {
        "reward": "grpo/score/mean",
        "response_length": "response_length/mean",
        "pg_loss": "actor/pg_loss",
        "kl_loss": "actor/kl_loss",
        "entropy": "actor/entropy",
        "grad_norm": "actor/grad_norm",
    }
    assert run.metrics["actor/kl_loss"].values[-1] == pytest.approx(0.005)


def test_verl_jsonl_sample(synthetic):
    run = read_log(synthetic.DATA / "verl_metrics.jsonl")
    names = canonical_metrics(run.metrics)
    assert names["reward"] == "critic/score/mean"  # the score beats critic/rewards
    assert names["logprob_diff"] == "training/rollout_probs_diff_mean"
    assert names["ppo_kl"] == "actor/ppo_kl" and "val/test_score" not in run.metrics
    assert run.metrics["critic/score/mean"].values[0] == pytest.approx(0.15)


def test_flat_jsonl_csv_and_a_line_cut_off(tmp_path, synthetic):
    path = tmp_path / "flat.jsonl"
    path.write_text('{"global_step": 1, "reward": 0.5}\n{"global_step": 2, "reward": 0.6}\n{"global_st')
    assert read_log(path).metrics["reward"].values.tolist() == [0.5, 0.6]
    run = read_log(synthetic.DATA / "metrics.csv")
    assert run.metrics["reward"].steps.tolist() == list(range(10))  # the empty cell is skipped
    assert run.metrics["kl"].steps.tolist() == list(range(11)) and "note" not in run.metrics


def test_console_line_forms():
    assert parse_console_line(" [x] iteration        3/      10 | lm loss: 2.5E+00 | grad norm: 0.5 |") == (
        3,
        {"lm loss": 2.5, "grad norm": 0.5},
    )
    assert parse_console_line("[x] iteration: 7 / 9 | actor/kl_loss : 0.0010 ") == (7, {"actor/kl_loss": 0.001})
    assert parse_console_line("loading checkpoint from iteration 5") is None


@pytest.mark.parametrize(
    "content, name, message",
    [
        (None, "absent.jsonl", "no such file or folder"),
        ("not json\n{}\n", "bad.jsonl", r"line 1 is not JSON"),
        ('{"reward": 1}\n{"reward": 2}\n', "nostep.jsonl", "line 1 has no step"),
        ("a,b\n1,2\n", "nostep.csv", r"no step column in the header \['a', 'b'\]"),
        ("some text\nmore text\n", "train.log", "no numeric metric found .*iteration i / N"),
        (os.urandom(200), "events.out.tfevents.123", "no numeric metric found"),
        ("", "empty_tb_dir", "holds no TensorBoard event file"),
    ],
)
def test_bad_logs_are_one_sentence_naming_the_file(tmp_path, content, name, message):
    path = tmp_path / name
    if name == "empty_tb_dir":
        path.mkdir()
    elif content is not None:
        path.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(LogError, match=message) as err:
        read_log(path)
    assert str(path) in str(err.value)


def test_verl_rollout_correction_kl_is_rollout_kl_k3_first():
    # verl logs both estimators; k3 (non-negative per token) is the one compare reads
    names = ["rollout_corr/kl", "rollout_corr/k3_kl", "rollout_corr/log_ppl_abs_diff", "actor/kl_loss"]
    assert canonical_metrics(names) == {
        "rollout_kl": "rollout_corr/k3_kl",
        "kl_loss": "actor/kl_loss",
        "logprob_diff": "rollout_corr/log_ppl_abs_diff",
    }
    assert canonical_metrics(["train/rollout_corr/kl"]) == {"rollout_kl": "train/rollout_corr/kl"}


def test_routing_consistency_rates_are_metrics(tmp_path):
    """The rates examples/rl_vllm logs are canonical metrics that compare and watch read."""
    path = tmp_path / "metrics.jsonl"
    rows = [
        {"step": i, "data": {"routing/decision_disagreement": 0.01 * i, "routing/tokens_any_layer": 0.1}}
        for i in range(3)
    ]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    run = read_log(path)
    assert canonical_metrics(run.metrics) == {
        "routing_disagreement": "routing/decision_disagreement",
        "routing_token_disagreement": "routing/tokens_any_layer",
    }
    assert run.metrics["routing/decision_disagreement"].values.tolist() == pytest.approx([0, 0.01, 0.02])
