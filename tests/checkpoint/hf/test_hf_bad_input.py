"""Bad Hugging Face input: one sentence naming the file and the fix, exit code 2, nothing
written. Each case is a real copy of the transformers-built Qwen3-MoE with one thing wrong."""
from __future__ import annotations

import json
import shutil

import pytest

from mcore_proxy.cli import main


def broken(hf_model, tmp_path, edit):
    folder = tmp_path / "model"
    shutil.copytree(hf_model("qwen3_moe"), folder)
    edit(folder)
    return folder


def edit_config(**changes):
    def edit(folder):
        config = json.loads((folder / "config.json").read_text())
        config.update(changes)
        (folder / "config.json").write_text(json.dumps(config))
    return edit


def drop_shard(folder):
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    (folder / sorted(set(index["weight_map"].values()))[1]).unlink()


CASES = {
    # an architecture that is no MoE family mcore-proxy knows: the sentence lists the ones it knows
    "architecture": (edit_config(architectures=["LlamaForCausalLM"]),
                     ["LlamaForCausalLM", "Qwen3MoeForCausalLM", "MixtralForCausalLM", "DeepseekV4ForCausalLM",
                      "GptOssForCausalLM"]),
    # another family's architecture: its descriptor accounts for none of Qwen3-MoE's expert names
    "family": (edit_config(architectures=["MixtralForCausalLM"]), ["model.layers.0.mlp.down_proj.weight", "not a part of Mixtral"]),
    "missing shard": (drop_shard, ["model-00002-of-", "is missing"]),
    # config.json disagrees with the tensors: more experts, more layers, another hidden size
    "expert count": (edit_config(num_experts=32, num_local_experts=32), ["config.json", "32"]),
    "layer count": (edit_config(num_hidden_layers=6), ["config.json", "num_hidden_layers=6"]),
    "hidden size": (edit_config(hidden_size=48), ["config.json", "hidden_size=48"]),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_hf_input_is_one_sentence_and_exit_2(hf_model, tmp_path, capsys, case):
    edit, words = CASES[case]
    folder = broken(hf_model, tmp_path, edit)
    before = sorted((p.name, p.stat().st_size) for p in folder.iterdir())
    capsys.readouterr()     # building the fixture (first use) prints transformers' progress
    out = tmp_path / "out"
    for argv in (["inspect", str(folder)], ["convert", str(folder), "-o", str(out), "--format", "legacy"]):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and str(folder) in err, err
        for word in words:
            assert word in err, (word, err)
    assert not out.exists()
    assert sorted((p.name, p.stat().st_size) for p in folder.iterdir()) == before    # the input untouched
