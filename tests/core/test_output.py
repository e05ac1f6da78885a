"""Where outputs may go (core/output.py): never an empty path, never into a checkpoint, one folder
made at most, and locks that leave nothing behind."""

from __future__ import annotations

import json
import os

import pytest

from mcore_proxy.core.errors import OutputError
from mcore_proxy.core.output import (
    check_folder,
    check_not_in_checkpoint,
    check_output_path,
    held_lock,
    looks_like_checkpoint,
    staged_files,
)


def test_an_empty_path_is_refused_not_taken_as_the_current_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(OutputError, match="the output path is empty"):
        check_output_path("")
    with pytest.raises(OutputError, match="the output path is empty"):
        with staged_files("", "plan.json", ("plan.json",)):
            pass
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "files",
    [
        {"latest_checkpointed_iteration.txt": "10"},  # a Megatron checkpoint's root
        {"mp_rank_00/model_optim_rng.pt": ""},  # an iteration folder
        {".metadata": "", "metadata.json": "{}"},  # torch_dist
        {"config.json": "{}", "model-00001-of-00002.safetensors": ""},  # Hugging Face
        {"manifest.json": json.dumps({"format": "mcore-proxy-manifest/1"})},  # a convert output
    ],
)
def test_no_output_goes_into_a_checkpoint_or_below_one(tmp_path, files):
    ckpt = tmp_path / "ckpt"
    for name, text in files.items():
        (ckpt / name).parent.mkdir(parents=True, exist_ok=True)
        (ckpt / name).write_text(text)
    assert looks_like_checkpoint(ckpt)
    deep = ckpt / "a" / "b"
    deep.mkdir(parents=True)
    for folder, says in ((ckpt, "is a checkpoint folder"), (deep, f"lies in {ckpt}, which is a checkpoint")):
        with pytest.raises(OutputError, match=says):
            check_not_in_checkpoint(folder)
    check_not_in_checkpoint(tmp_path)  # beside it is fine
    with pytest.raises(OutputError, match="is a checkpoint folder"):
        check_output_path(ckpt / "proxy")


def test_folders_that_cannot_hold_an_output(tmp_path):
    (tmp_path / "plan.json").write_text("{}")
    with pytest.raises(OutputError, match="plan.json: is not a folder"):
        check_folder(tmp_path / "plan.json", create=True)
    with pytest.raises(OutputError, match="nope: folder of the output does not exist"):
        check_folder(tmp_path / "nope" / "deeper", create=True)  # one level is made, never a chain
    check_folder(tmp_path / "new", create=True)
    with pytest.raises(OutputError, match="new: folder of the output does not exist"):
        check_folder(tmp_path / "new")


def test_a_held_lock_refuses_a_second_holder_and_leaves_no_file(tmp_path):
    path = tmp_path / ".lock"
    read_end, write_end = os.pipe()
    with held_lock(path, "busy"):
        pid = os.fork()
        if pid == 0:  # another process: flock is per open file, so a second holder in this one would pass
            try:
                with held_lock(path, "busy"):
                    os._exit(0)
            except OutputError as err:
                os.write(write_end, str(err).encode())
                os._exit(1)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 1
        assert os.read(read_end, 4096).decode() == f"busy, pid {os.getpid()}; wait for it to finish or stop it first"
    assert not path.exists()
