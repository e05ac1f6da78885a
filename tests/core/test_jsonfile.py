"""mcore_proxy/core/jsonfile.py: every defect of a stranger's JSON file is one sentence naming the file."""

import pytest

from mcore_proxy.core.errors import PlanError, ProxyError
from mcore_proxy.core.jsonfile import read_json_object

FIX = "regenerate it"


def test_reads_an_object(tmp_path):
    (tmp_path / "a.json").write_text('{"k": [1, 2]}')
    assert read_json_object(tmp_path / "a.json", "plan file", FIX) == {"k": [1, 2]}


@pytest.mark.parametrize(
    "content, expected",
    [
        (b"{not json", r"a\.json: plan file is not valid JSON .*; regenerate it$"),
        (b"\xff\xfe{}", r"a\.json: plan file is not valid JSON .*; regenerate it$"),
        (b"[" * 100_000 + b"]" * 100_000, r"a\.json: plan file is not valid JSON .*; regenerate it$"),
        (b"[1, 2]", r"a\.json: plan file holds a JSON list, expected an object; regenerate it$"),
        # past Python's int parsing limit (4300 digits) json raises a bare ValueError (fuzz: exit 3 before)
        (
            b'{"num_experts": ' + b"9" * 5000 + b"}",
            r"a\.json: plan file holds a number of thousands of digits, which no real one does; regenerate it$",
        ),
    ],
)
def test_defects_raise_the_callers_error_naming_the_file(tmp_path, content, expected):
    (tmp_path / "a.json").write_bytes(content)
    with pytest.raises(PlanError, match=expected):
        read_json_object(tmp_path / "a.json", "plan file", FIX, PlanError)


def test_missing_file_and_folder_give_the_missing_fix(tmp_path):
    with pytest.raises(ProxyError, match=r"b\.json: plan file not found; write one$"):
        read_json_object(tmp_path / "b.json", "plan file", FIX, missing_fix="write one")
    folder = r": is a folder, expected a plan file; pass the plan file itself, not a folder$"
    with pytest.raises(ProxyError, match=folder):
        read_json_object(tmp_path, "plan file", FIX)


def test_oversized_file_is_refused_before_reading(tmp_path):
    (tmp_path / "a.json").write_text('{"k": "' + "x" * 2000 + '"}')
    with pytest.raises(ProxyError, match=r"a\.json: plan file is 2009 bytes, far beyond any real one"):
        read_json_object(tmp_path / "a.json", "plan file", FIX, limit=1000)
