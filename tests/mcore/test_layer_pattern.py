"""The layer-pattern parser: Megatron's pattern language, nothing else, never eval."""

from __future__ import annotations

import pytest

from mcore_proxy.core.errors import CheckpointError
from mcore_proxy.mcore.layer_pattern import MAX_LAYERS, parse_layer_pattern
from mcore_proxy.mcore.spec import moe_layer_pattern


@pytest.mark.parametrize(
    "text,expected",
    [
        ("[0]*3+[1]*5", [0, 0, 0, 1, 1, 1, 1, 1]),
        ("([1]*3+[0])*2", [1, 1, 1, 0, 1, 1, 1, 0]),
        ("([0]+[1]*3)", [0, 1, 1, 1]),
        (" [1, 0,1,] ", [1, 0, 1]),
        ("2*[1]+[0]", [1, 1, 0]),
        ("((([1])))*2", [1, 1]),
        ("3", 3),
        (4, 4),
        ([1, 0], [1, 0]),
        ((1, 0, 1), [1, 0, 1]),
        (None, None),
    ],
)
def test_megatron_forms(text, expected):
    assert parse_layer_pattern(text) == expected


def test_same_results_as_python_on_valid_patterns():
    # the language is a subset of Python's list arithmetic: same value wherever both accept it
    for text in ("[0]*3+[1]*58", "([1]*3+[0]*1)*3", "[1]+[0]*2+([1,0]*2)*2", "[0]*0+[1]"):
        assert parse_layer_pattern(text) == eval(text)  # noqa: S307 - trusted test literals


@pytest.mark.parametrize(
    "text,why",
    [
        ("__import__('os').system('touch /tmp/x')", "character '_' is not allowed"),
        ("[1]*3 if 1 else 0", "character 'i' is not allowed"),
        ("[0]*10**9", "expected a number"),
        ("[0]*100001", f"more than {MAX_LAYERS} entries"),
        ("([0]*1000)*1000", f"more than {MAX_LAYERS} entries"),
        ("(" * 40 + "[1]" + ")" * 40, "nested deeper than"),
        ("", "it is empty"),
        ("[1]+", "found the end"),
        ("[1]]", "unexpected ']'"),
        ("[1.5]", "character '.' is not allowed"),
        ("[-1]", "character '-' is not allowed"),
        ("{1: 2}", "character '{' is not allowed"),
    ],
)
def test_everything_else_is_refused_in_one_sentence(text, why):
    with pytest.raises(CheckpointError, match="is not a layer pattern") as info:
        parse_layer_pattern(text, "args moe_layer_freq in ckpt/common.pt")
    message = str(info.value)
    assert why in message and "args moe_layer_freq in ckpt/common.pt" in message and "\n" not in message


@pytest.mark.parametrize("value", [1.5, True, {"a": 1}, [1, "0"], [True, False], b"[1]"])
def test_other_types_are_refused(value):
    with pytest.raises(CheckpointError, match="fix the args"):
        parse_layer_pattern(value)


def test_moe_layer_pattern_checks_length_and_frequency():
    assert moe_layer_pattern(4, "[0]+[1]*3") == [False, True, True, True]
    assert moe_layer_pattern(4, 2) == [True, False, True, False]
    with pytest.raises(CheckpointError, match="has 3 entries, expected num_layers=4"):
        moe_layer_pattern(4, "[1]*3")
    with pytest.raises(CheckpointError, match="expected a frequency >= 1"):
        moe_layer_pattern(4, 0)
