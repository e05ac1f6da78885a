"""Exit codes mean one thing each, `--dry-run` runs every check, older args verify functionally."""

from __future__ import annotations

import shutil

import pytest
import torch

from mcore_proxy.cli import main

FIXTURE = "seq_tp2_pp2_ep2"
# fields older Megatron versions did not save (issue 16): Megatron's defaults stand in for them
OLDER_MEGATRON_LACKS = (
    "moe_layer_freq",
    "moe_shared_expert_intermediate_size",
    "moe_router_enable_expert_bias",
    "moe_router_num_groups",
    "moe_router_group_topk",
)


def edited_copy(ckpt, dst, edit):
    shutil.copytree(ckpt, dst)
    for f in sorted(dst.rglob("model_optim_rng.pt")):
        state = torch.load(f, weights_only=False)  # trusted: the test's own fixture
        edit(state["args"])
        torch.save(state, f)
    return dst


def run(capsys, *argv) -> tuple[int, str, str]:
    capsys.readouterr()
    code = main([str(a) for a in argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_older_args_take_megatron_defaults_in_verify_functional(megatron_ckpt, proxy_plan, tmp_path, capsys):
    ckpt, _ = megatron_ckpt(FIXTURE)
    plan_path, _ = proxy_plan(FIXTURE)

    def drop(args):
        for name in OLDER_MEGATRON_LACKS:
            delattr(args, name)

    older = edited_copy(ckpt, tmp_path / "older", drop)
    out = tmp_path / "proxy"
    assert run(capsys, "convert", older, "--plan", plan_path, "-o", out, "--target-ep", "1")[0] == 0
    code, text, err = run(capsys, "verify", "--orig", older, "--proxy", out, "--plan", plan_path, "--functional")
    assert code == 0, err
    assert "functional: max |logit difference| 0 " in text and "verify: OK" in text


def test_an_absent_field_without_a_default_is_one_sentence(megatron_ckpt, proxy_plan, tmp_path, capsys):
    ckpt, _ = megatron_ckpt(FIXTURE)
    plan_path, _ = proxy_plan(FIXTURE)
    out = tmp_path / "proxy"
    assert run(capsys, "convert", ckpt, "--plan", plan_path, "-o", out, "--target-ep", "1")[0] == 0
    no_heads = edited_copy(ckpt, tmp_path / "no_heads", lambda a: delattr(a, "num_attention_heads"))
    code, _, err = run(capsys, "verify", "--orig", no_heads, "--proxy", out, "--plan", plan_path, "--functional")
    assert code == 2
    lines = [line for line in err.splitlines() if line.startswith("mcore-proxy ")]  # tqdm drew bars before
    assert len(lines) == 1 and "Traceback" not in err
    assert (
        "lack num_attention_heads, which building the model in megatron-core needs" in lines[0]
        and "no_heads" in lines[0]
    )


def test_a_crash_inside_verify_functional_is_an_internal_error(megatron_ckpt, proxy_plan, tmp_path, capsys):
    """megatron-core itself refuses the model (3 heads of 8 channels, weights made for 4 heads): the
    check could not run, exit 3. Without kv_channels the same args are bad input (exit 2): Megatron
    derives kv_channels as hidden 32 / 3 heads, which does not exist (issue 40 item 4)."""
    ckpt, _ = megatron_ckpt(FIXTURE)
    plan_path, _ = proxy_plan(FIXTURE)
    underived = edited_copy(ckpt, tmp_path / "underived", lambda a: setattr(a, "num_attention_heads", 3))
    odd = edited_copy(underived, tmp_path / "odd", lambda a: setattr(a, "kv_channels", 8))
    out = tmp_path / "proxy"
    assert run(capsys, "convert", odd, "--plan", plan_path, "-o", out, "--target-tp", "1", "--target-ep", "1")[0] == 0
    code, _, err = run(capsys, "verify", "--orig", underived, "--proxy", out, "--plan", plan_path, "--functional")
    assert code == 2 and "lack kv_channels and hidden_size 32 is not a multiple of num_attention_heads 3" in err, err
    argv = ["verify", "--orig", odd, "--proxy", out, "--plan", plan_path, "--functional"]
    code, _, err = run(capsys, *argv)
    lines = [line for line in err.splitlines() if line.startswith("mcore-proxy ")]
    assert code == 3 and len(lines) == 1 and "Traceback" not in err, err
    assert "internal error" in lines[0] and "megatron-core could not run the models" in lines[0]
    code, _, err = run(capsys, "--debug", *argv)
    assert code == 3 and "Traceback (most recent call last)" in err


@pytest.mark.parametrize("case", ["exists", "inside_input", "staging_name", "target", "no_parent"])
def test_dry_run_runs_every_check(megatron_ckpt, proxy_plan, tmp_path, capsys, case):
    ckpt, _ = megatron_ckpt(FIXTURE)
    plan_path, _ = proxy_plan(FIXTURE)
    copy = tmp_path / "ckpt"
    shutil.copytree(ckpt, copy)
    out, extra, expected = tmp_path / "out", [], ""
    if case == "exists":
        out.mkdir()
        expected = "already exists"
    elif case == "inside_input":
        out, expected = copy / "proxy", "must not be inside the input"
    elif case == "staging_name":
        out, expected = tmp_path / ".out.mcore-proxy-staging-123" / "x", "staging folder"
    elif case == "target":
        extra, expected = ["--target-ep", "3"], "do not divide over target EP=3"
    else:
        out, expected = tmp_path / "nowhere" / "out", "does not exist"
    code, text, err = run(capsys, "convert", copy, "--plan", plan_path, "-o", out, "--dry-run", *extra)
    assert code == 2 and expected in err and "would write" not in text, (err, text)
    code, _, err = run(capsys, "convert", copy, "--plan", plan_path, "-o", out, *extra)
    assert code == 2 and expected in err
