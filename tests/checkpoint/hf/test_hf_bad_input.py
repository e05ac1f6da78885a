"""Bad Hugging Face input: one sentence naming the file and the fix, exit code 2, nothing
written. Each case is a real copy of the transformers-built Qwen3-MoE with one thing wrong."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

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
    # an architecture no declaration covers and discovery cannot read as this checkpoint's: a dense
    # model class under a MoE config; the sentence says what it lacks and where the full list lives
    "architecture": (
        edit_config(architectures=["LlamaForCausalLM"]),
        ["LlamaForCausalLM", "could not be built small by transformers", "docs/families.md"],
    ),
    # another family's architecture: its descriptor accounts for none of Qwen3-MoE's expert names
    "family": (
        edit_config(architectures=["MixtralForCausalLM"]),
        ["model.layers.0.mlp.down_proj.weight", "not a part of Mixtral"],
    ),
    "missing shard": (drop_shard, ["model-00002-of-", "is missing"]),
    # config.json disagrees with the tensors: more experts, more layers, another hidden size
    "expert count": (edit_config(num_experts=32, num_local_experts=32), ["config.json", "32"]),
    "layer count": (edit_config(num_hidden_layers=6), ["config.json", "num_hidden_layers=6"]),
    "hidden size": (edit_config(hidden_size=48), ["config.json", "hidden_size=48"]),
    # top-k beyond the experts (fuzz: refused by ModelSpec in a sentence naming no file)
    "top-k": (edit_config(num_experts_per_tok=17), ["config.json", "is 17, expected 1..16"]),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_hf_input_is_one_sentence_and_exit_2(hf_model, tmp_path, capsys, case):
    edit, words = CASES[case]
    folder = broken(hf_model, tmp_path, edit)
    before = sorted((p.name, p.stat().st_size) for p in folder.iterdir())
    capsys.readouterr()  # building the fixture (first use) prints transformers' progress
    out = tmp_path / "out"
    for argv in (["inspect", str(folder)], ["convert", str(folder), "-o", str(out), "--format", "legacy"]):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and str(folder) in err, err
        for word in words:
            assert word in err, (word, err)
    assert not out.exists()
    assert sorted((p.name, p.stat().st_size) for p in folder.iterdir()) == before  # the input untouched


def edit_tensor(key, change):
    """Rewrite the shard holding `key` with `change(tensor)` in its place (a valid safetensors file)."""

    def edit(folder):
        from safetensors.torch import load_file, save_file

        index = json.loads((folder / "model.safetensors.index.json").read_text())
        shard = folder / index["weight_map"][key]
        tensors = load_file(str(shard))
        tensors[key] = change(tensors[key]).contiguous()
        save_file(tensors, str(shard), metadata={"format": "pt"})

    return edit


# found by the fuzz campaign (bench/fuzz.py --hf): each converted with exit 0 into a proxy that
# transformers cannot load, or loads with other routing
TENSOR_CASES = {
    # DeepSeek-V4's tid2eid is [vocab_size, top-k]: one row short
    "hash table rows": (
        "deepseek_v4",
        edit_tensor("model.layers.0.ffn.gate.tid2eid", lambda t: t[:-1]),
        ["config.json", "vocab_size=128, top-k 2", "tid2eid", "[127, 2]"],
    ),
    # expert ids as floats
    "hash table dtype": (
        "deepseek_v4",
        edit_tensor("model.layers.0.ffn.gate.tid2eid", lambda t: t.float()),
        ["tid2eid", "torch.float32", "not integer expert ids"],
    ),
    # one expert of a layer unlike the others
    "expert shape": (
        "qwen2_moe",
        edit_tensor("model.layers.1.mlp.experts.3.down_proj.weight", lambda t: t[:-1]),
        ["experts.3.down_proj.weight is [31, 16]", "other experts of layer 1 are [32, 16]"],
    ),
    "expert dtype": (
        "qwen2_moe",
        edit_tensor("model.layers.2.mlp.experts.5.up_proj.weight", lambda t: t.half()),
        ["experts.5.up_proj.weight is [16, 32] torch.float16", "are [16, 32] torch.float32"],
    ),
}


@pytest.mark.parametrize("case", sorted(TENSOR_CASES))
def test_inconsistent_tensors_are_one_sentence_and_exit_2(hf_model, tmp_path, capsys, case):
    model, edit, words = TENSOR_CASES[case]
    folder = tmp_path / "model"
    shutil.copytree(hf_model(model), folder)
    edit(folder)
    capsys.readouterr()
    out = tmp_path / "out"
    for argv in (["inspect", str(folder)], ["convert", str(folder), "-o", str(out)]):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and str(folder) in err, err
        for word in words:
            assert word in err, (word, err)
    assert not out.exists()


def synthetic_plan(folder, path):
    """A plan for the checkpoint in `folder` made by the real selection on planted statistics."""
    from mcore_proxy.checkpoint import open_checkpoint
    from mcore_proxy.select import select_experts
    from mcore_proxy.select.synthetic import stats_like

    view = open_checkpoint(folder)
    select_experts(view, stats_like(view.spec, 4, tokens=300, seed=1), view.spec.num_experts // 2).save(path)
    return path


def test_a_plan_for_another_top_k_is_refused_naming_the_plan(hf_model, tmp_path, capsys):
    """config.json's top-k changed after the plan was made: convert and verify refuse, naming the
    plan and the checkpoint (fuzz: convert gave exit 0 and a proxy with the plan's top-k; verify's
    plan errors named no file)."""
    folder = tmp_path / "model"
    shutil.copytree(hf_model("qwen2_moe"), folder)
    plan = synthetic_plan(folder, tmp_path / "plan.json")
    edit_config(num_experts_per_tok=3)(folder)
    capsys.readouterr()
    out = tmp_path / "out"
    for argv in (
        ["convert", str(folder), "--plan", str(plan), "-o", str(out)],
        ["verify", "--orig", str(folder), "--proxy", str(folder), "--plan", str(plan)],
    ):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err.strip()
        assert (
            len(err.splitlines()) == 1
            and f"{plan}: the plan is for a router choosing the top 2 experts but the "
            f"checkpoint's chooses the top 3; select again for this checkpoint (checkpoint {folder})"
            in err
        ), err
    assert not out.exists()


def test_hash_table_ids_beyond_the_experts_name_the_checkpoint(hf_model, tmp_path, capsys):
    """tid2eid values are read when the proxy's table is written: an id past the experts is one
    sentence naming the checkpoint (fuzz: it named only the canonical tensor)."""
    folder = tmp_path / "model"
    shutil.copytree(hf_model("deepseek_v4"), folder)
    plan = synthetic_plan(folder, tmp_path / "plan.json")

    def past(t):
        t = t.clone()
        t[5, 1] = 8
        return t

    edit_tensor("model.layers.0.ffn.gate.tid2eid", past)(folder)
    capsys.readouterr()
    out = tmp_path / "out"
    assert main(["convert", str(folder), "--plan", str(plan), "-o", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert (
        f"{folder}: decoder.layers.0.mlp.router.hash_table: holds expert ids 0..8, but the layer has 8 experts"
        in err.splitlines()[-1]
    ), err
    assert not out.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".out")]


@pytest.mark.parametrize("block", [[0, 0], ["8", "8"], [8.5, 8], [None, 8], [8, 8, 8]])
def test_a_malformed_fp8_block_size_is_refused_before_dequantizing(hf_model, tmp_path, capsys, block):
    """`--dequantize` of an FP8 copy whose quantization_config.weight_block_size is not two positive
    integers (fuzz: ZeroDivisionError / TypeError, exit 3, after the first shards were written)."""
    from mcore_proxy.testing.quantized import fp8_copy

    folder = fp8_copy(hf_model("qwen2_moe"), tmp_path / "fp8")
    plan = synthetic_plan(folder, tmp_path / "plan.json")
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"]["weight_block_size"] = block
    (folder / "config.json").write_text(json.dumps(config))
    capsys.readouterr()
    out = tmp_path / "out"
    assert main(["convert", str(folder), "--plan", str(plan), "-o", str(out), "--dequantize"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert (
        f"{folder / 'config.json'}: quantization_config.weight_block_size is {block!r}, expected two positive "
        "integers" in err
    ), err
    assert not out.exists()


def test_block_scales_that_do_not_fit_name_their_shard(hf_model, tmp_path, capsys):
    """A block-scale grid that does not fit its weight, under --dequantize: the sentence names the
    shard (fuzz: it named only the tensor)."""
    from mcore_proxy.testing.quantized import fp8_copy

    folder = fp8_copy(hf_model("qwen2_moe"), tmp_path / "fp8")
    plan = synthetic_plan(folder, tmp_path / "plan.json")
    key = "model.layers.0.self_attn.q_proj.weight_scale_inv"
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    edit_tensor(key, lambda s: s[:-1])(folder)
    capsys.readouterr()
    out = tmp_path / "out"
    assert main(["convert", str(folder), "--plan", str(plan), "-o", str(out), "--dequantize"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert (
        f"{folder / index['weight_map'][key]}: model.layers.0.self_attn.q_proj.weight: block scales of shape" in err
    ), err
    assert not out.exists()


def test_a_packed_weight_without_its_scale_is_no_quantized_pair(hf_model, tmp_path, capsys):
    """A stray compressed-tensors `X.weight_packed` without `X.weight_scale` beside an FP8 weight:
    not a quantized pair, copied as it is (fuzz: --dequantize looked the absent scale up, KeyError,
    exit 3)."""
    import torch

    from mcore_proxy.checkpoint.hf.quant import INT4_PACKED, find_quantized
    from mcore_proxy.testing.quantized import fp8_copy

    assert find_quantized(["a.weight_packed"]) == []
    assert [q.scheme for q in find_quantized(["a.weight_packed", "a.weight_scale"])] == [INT4_PACKED]
    folder = fp8_copy(hf_model("qwen2_moe"), tmp_path / "fp8")
    plan = synthetic_plan(folder, tmp_path / "plan.json")
    key = "model.layers.0.self_attn.o_proj.weight"

    def add_packed(folder):
        from safetensors.torch import load_file, save_file

        index = json.loads((folder / "model.safetensors.index.json").read_text())
        shard = folder / index["weight_map"][key]
        tensors = load_file(str(shard))
        tensors[key + "_packed"] = torch.zeros((4, 1), dtype=torch.int32)
        save_file(tensors, str(shard), metadata={"format": "pt"})
        index["weight_map"][key + "_packed"] = shard.name
        (folder / "model.safetensors.index.json").write_text(json.dumps(index))

    add_packed(folder)
    assert main(["convert", str(folder), "--plan", str(plan), "-o", str(tmp_path / "out"), "--dequantize"]) == 0
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert key + "_packed" in index["weight_map"] and key + "_scale_inv" not in index["weight_map"]


def add_tensors(tensors_of):
    """Add `tensors_of(folder)` ({key: tensor}) to the shard of the first key's neighbour and the index."""

    def edit(folder):
        from safetensors.torch import load_file, save_file

        index = json.loads((folder / "model.safetensors.index.json").read_text())
        new = tensors_of(folder)
        shard = folder / index["weight_map"][next(iter(new)).rsplit("_", 1)[0] + ".weight"]
        tensors = load_file(str(shard))
        tensors.update(new)
        save_file(tensors, str(shard), metadata={"format": "pt"})
        index["weight_map"].update({k: shard.name for k in new})
        (folder / "model.safetensors.index.json").write_text(json.dumps(index))

    return edit


def _stray_mxfp4(folder):
    stem = "model.layers.2.self_attn.q_proj"
    return {
        stem + "_blocks": torch.zeros((0, 1, 16), dtype=torch.uint8),
        stem + "_scales": torch.zeros((0, 1), dtype=torch.uint8),
    }


# name -> (model, its quantized copy (testing/quantized.py), edit, the shard's key, words)
QUANT_CASES = {
    # fuzz: RuntimeError (cannot reshape a tensor of 0 elements), exit 3
    "stray mxfp4 pair": (
        "qwen2_moe",
        "fp8_copy",
        add_tensors(_stray_mxfp4),
        "model.layers.2.self_attn.q_proj.weight",
        ["q_proj_blocks: torch.uint8 [0, 1, 16] with", "expected MXFP4 blocks [.., out, in/32, 16]"],
    ),
    # fused MXFP4 experts whose scales lack a column (a broadcast RuntimeError, exit 3)
    "mxfp4 scales": (
        "gpt_oss",
        "mxfp4_copy",
        edit_tensor("model.layers.1.mlp.experts.down_proj_scales", lambda s: s[..., :-1]),
        "model.layers.1.mlp.experts.down_proj_scales",
        ["down_proj_blocks: torch.uint8", "expected MXFP4"],
    ),
    # E8M0 scales stored as float16: read as twice the exponents (a RuntimeError mid-write, exit 3)
    "mxfp4 scales dtype": (
        "gpt_oss",
        "mxfp4_copy",
        edit_tensor("model.layers.0.mlp.experts.gate_up_proj_scales", lambda s: s.to(torch.float16)),
        "model.layers.0.mlp.experts.gate_up_proj_blocks",
        ["gate_up_proj_scales: E8M0 scales of dtype torch.float16", "expected one byte each"],
    ),
    # MXFP4 blocks read as float32: unpacked to 4 times the columns (a RuntimeError mid-write, exit 3)
    "mxfp4 blocks dtype": (
        "gpt_oss",
        "mxfp4_copy",
        edit_tensor("model.layers.1.mlp.experts.gate_up_proj_blocks", lambda b: b.float()),
        "model.layers.1.mlp.experts.gate_up_proj_blocks",
        ["gate_up_proj_blocks: torch.float32", "MXFP4 blocks [.., out, in/32, 16] of bytes"],
    ),
    # FP8 block scales flattened (IndexError, exit 3)
    "fp8 scales 1-D": (
        "qwen2_moe",
        "fp8_copy",
        edit_tensor("model.layers.0.self_attn.o_proj.weight_scale_inv", lambda s: s.reshape(-1)),
        "model.layers.0.self_attn.o_proj.weight",
        ["o_proj.weight: block scales of shape [16]", "expected both 2-D and not empty"],
    ),
}


@pytest.mark.parametrize("case", sorted(QUANT_CASES))
def test_inconsistent_quantized_pairs_are_refused_before_dequantizing(hf_model, tmp_path, capsys, case):
    """Shapes of a weight and its scales that its scheme cannot dequantize: refused from the shard
    headers, one sentence naming the shard, nothing written."""
    from mcore_proxy.testing import quantized

    model, maker, edit, key, words = QUANT_CASES[case]
    folder = getattr(quantized, maker)(hf_model(model), tmp_path / "q")
    plan = synthetic_plan(folder, tmp_path / "plan.json")
    edit(folder)
    shard = folder / json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"][key]
    capsys.readouterr()
    out = tmp_path / "out"
    assert main(["convert", str(folder), "--plan", str(plan), "-o", str(out), "--dequantize"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"{shard}: " in err, err
    for word in words:
        assert word in err, (word, err)
    assert not out.exists()
