"""read_log picks the reader from the path (mcore_proxy/diagnose/readers/__init__.py) and refuses
what it cannot read in one sentence naming the file. Samples: tests/data (verl_console.log, see
test_read_console; verl_file_logger.jsonl: written by verl 0.9.1's own `FileLogger` (loaded from the
verl wheel's tracking.py, orjson with OPT_SERIALIZE_NUMPY) as `$VERL_FILE_LOGGER_ROOT/<project>/
<experiment>.jsonl`; the Megatron and MindSpeed-RL samples of test_readers)."""

import json

import pytest

from mcore_proxy.diagnose.aliases import canonical_metrics
from mcore_proxy.diagnose.readers import detect_format, read_log
from mcore_proxy.core.errors import LogError


@pytest.mark.parametrize(
    "name, fmt",
    [
        ("verl_console.log", "verl-console"),
        ("megatron_console.log", "console"),
        ("mindspeed_rl_console.log", "console"),
        ("verl_file_logger.jsonl", "jsonl"),
        ("verl_metrics.jsonl", "jsonl"),
        ("metrics.csv", "csv"),
    ],
)
def test_samples(synthetic, name, fmt):
    assert read_log(synthetic.DATA / name).format == fmt


def test_verl_file_logger_sample(synthetic):
    run = read_log(synthetic.DATA / "verl_file_logger.jsonl")
    assert canonical_metrics(run.metrics)["reward"] == "critic/score/mean"
    assert run.metrics["actor/kl_loss"].steps.tolist() == [1, 2, 3, 4, 5]
    assert run.metrics["training/global_step"].values.tolist() == [1, 2, 3, 4, 5]


def test_detection_by_content_and_name(tmp_path):
    state = tmp_path / "state.json"  # a Trainer state under another name
    state.write_text(
        json.dumps({"global_step": 2, "log_history": [{"loss": 1.0, "step": 1}, {"loss": 0.5, "step": 2}]}, indent=2)
    )
    assert detect_format(state) == "trl-state" and read_log(state).metrics["loss"].values.tolist() == [1.0, 0.5]
    mixed = tmp_path / "train.out"  # verl records among Megatron-looking text
    mixed.write_text("loading checkpoint from iteration 5\nstep:1 - actor/kl_loss:0.1\nstep:2 - actor/kl_loss:0.2\n")
    assert read_log(mixed).format == "verl-console"
    (tmp_path / "out" / "checkpoint-2").mkdir(parents=True)
    (tmp_path / "out" / "checkpoint-2" / "trainer_state.json").write_text(state.read_text())
    assert detect_format(tmp_path / "out") == "trl-state"
    (tmp_path / "out" / "runs").mkdir()  # TensorBoard events beside it win: written every step
    (tmp_path / "out" / "runs" / "events.out.tfevents.1.h").write_bytes(b"")
    assert detect_format(tmp_path / "out") == "tensorboard"


@pytest.mark.parametrize(
    "content, name, message",
    [
        (b"\x00\x01\x02binary" * 10, "model.bin", "a binary file of no known log format"),
        ("step 3 done\n", "train.log", "no numeric metric found .*verl .*TRL"),
        ("", "empty_dir", r"holds no TensorBoard event file \(.*\) nor another known log"),
    ],
)
def test_refusals_name_the_file(tmp_path, content, name, message):
    path = tmp_path / name
    if name == "empty_dir":
        path.mkdir()
    else:
        path.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(LogError, match=message) as err:
        read_log(path)
    assert str(err.value).startswith(str(path)) and "\n" not in str(err.value)
