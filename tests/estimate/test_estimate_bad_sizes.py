"""`estimate --hf-config` with sizes no model has (issue 40, item 7): 1e308 (an OverflowError
before), 1.5 (blamed on `kv_channels is 0` when head_dim is absent, else silently cut to 1), a
string, a boolean, NaN, 10^30, a negative count, and JSON nested 100,000 deep. Each is one sentence
naming the file and the key, exit 2, and the config is left byte-identical."""

from __future__ import annotations

import json

import pytest

from mcore_proxy.cli import main
from mcore_proxy.estimate.presets import DEEPSEEK_V3, DEEPSEEK_V4_FLASH, QWEN3_5_35B_A3B, QWEN3_30B_A3B

NOT_INT = "not an integer; a size or count in a config.json is a whole number such as 4096"
OUT_OF_RANGE = "outside 0..2147483647, which no model's size is; fix the config"


def _config(base: dict, **changes) -> str:
    cfg = {k: v for k, v in base.items() if k != "name"}
    for key, value in changes.items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    return json.dumps(cfg)


# name -> (config.json text, what the sentence says after "<path>: ")
CASES = {
    "hidden_size 1e308": (_config(QWEN3_30B_A3B, hidden_size=1e308), f"hidden_size is 1e+308, {NOT_INT}"),
    "hidden_size 1.5 without head_dim": (
        _config(QWEN3_30B_A3B, hidden_size=1.5, head_dim=None),
        f"hidden_size is 1.5, {NOT_INT}",
    ),
    "hidden_size 1.5 with head_dim": (_config(QWEN3_30B_A3B, hidden_size=1.5), f"hidden_size is 1.5, {NOT_INT}"),
    "hidden_size 4096.0": (_config(QWEN3_30B_A3B, hidden_size=4096.0), f"hidden_size is 4096.0, {NOT_INT}"),
    "hidden_size as text": (_config(QWEN3_30B_A3B, hidden_size="2048"), f'hidden_size is "2048", {NOT_INT}'),
    "num_experts true": (_config(QWEN3_30B_A3B, num_experts=True), f"num_experts is true, {NOT_INT}"),
    "num_experts NaN": (_config(QWEN3_30B_A3B, num_experts=float("nan")), f"num_experts is NaN, {NOT_INT}"),
    "vocab_size 10^30": (_config(QWEN3_30B_A3B, vocab_size=10**30), f"vocab_size is a 31-digit number, {OUT_OF_RANGE}"),
    "num_hidden_layers -2": (_config(QWEN3_30B_A3B, num_hidden_layers=-2), f"num_hidden_layers is -2, {OUT_OF_RANGE}"),
    "intermediate size 2^40": (
        _config(QWEN3_30B_A3B, moe_intermediate_size=2**40),
        f"moe_intermediate_size is 1099511627776, {OUT_OF_RANGE}",
    ),
    "deepseek kv_lora_rank 0.5": (_config(DEEPSEEK_V3, kv_lora_rank=0.5), f"kv_lora_rank is 0.5, {NOT_INT}"),
    "deepseek n_group 8.5": (_config(DEEPSEEK_V3, n_group=8.5), f"n_group is 8.5, {NOT_INT}"),
    "qwen3.5 linear heads 1e308": (
        _config(QWEN3_5_35B_A3B, linear_num_value_heads=1e308),
        f"linear_num_value_heads is 1e+308, {NOT_INT}",
    ),
    "deepseek-v4 compress ratio 4.5": (
        _config(DEEPSEEK_V4_FLASH, compress_ratios=[4.5] * 50),
        f"compress_ratios is 4.5, {NOT_INT}",
    ),
    "nested 100000 deep": (
        '{"hidden_size": ' + "[" * 100_000 + "]" * 100_000 + "}",
        "model config is not valid JSON",
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_a_size_no_model_has_is_one_sentence_and_exit_2(tmp_path, digest, capsys, name):
    text, said = CASES[name]
    (tmp_path / "model").mkdir()
    config = tmp_path / "model" / "config.json"
    config.write_text(text)
    before = digest(tmp_path)
    assert main(["estimate", "--hf-config", str(config), "-k", "8"]) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err and "internal error" not in err, err
    assert lines[0].startswith(f"mcore-proxy estimate: error: {config}: {said}"), err
    assert digest(tmp_path) == before


def test_the_presets_sizes_pass_the_same_check(tmp_path, capsys):
    # the presets are the configs of released models: every size in them is an integer in range
    config = tmp_path / "config.json"
    config.write_text(_config(QWEN3_30B_A3B))
    assert main(["estimate", "--hf-config", str(config), "-k", "8", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["original"]["num_experts"] == QWEN3_30B_A3B["num_experts"]
