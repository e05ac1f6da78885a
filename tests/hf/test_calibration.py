"""mcore_proxy/hf/calibration.py: a bad line of calibration data is one sentence naming the file and line."""

import pytest

from mcore_proxy.hf.calibration import records
from mcore_proxy.core.errors import ProxyError


@pytest.mark.parametrize(
    "line",
    [
        b"{not json",
        b"\xff\xfe{}",
        b"[" * 100_000 + b"]" * 100_000,
        # past Python's int parsing limit json raises a bare ValueError (exit 3 before)
        b'{"input_ids": [' + b"9" * 5000 + b"]}",
    ],
)
def test_a_bad_line_names_the_file_and_line(tmp_path, line):
    path = tmp_path / "data.jsonl"
    path.write_bytes(b'{"input_ids": [3, 4]}\n' + line + b"\n")
    with pytest.raises(ProxyError, match=r"data\.jsonl:2: not a JSON object"):
        list(records(path))
