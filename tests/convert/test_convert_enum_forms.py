"""A Megatron checkpoint whose args enums were pickled by name (as Debian 12's Python 3.11.2 saves
them) or by value (3.11.7+), explicitly, whatever this interpreter does: inspect, select, convert
and verify --functional pass on both, and the proxy keeps every enum as the same member, written
by value so that Megatron's own loader (torch.load with its default weights_only=True and the
safe globals megatron-core registers) reads it. A getattr chain to os.system in place of
`attention_backend` runs nothing anywhere, and is dropped from the proxy with a note."""

from __future__ import annotations

import json
import shutil
import signal

import pytest
import torch

from mcore_proxy.cli import main
from mcore_proxy.testing.enum_forms import BY_NAME, BY_VALUE, FORMS, enum_form_of, rewrite_enums, torch_files
from mcore_proxy.testing.hostile import os_system_through_enum

NAME = "qwen3_moe"
KEEP = 8


@pytest.fixture(scope="session")
def enum_form_ckpt(family_ckpt, tmp_path_factory):
    """`enum_form_ckpt(form)` -> folder with `legacy/` and `torch_dist/` copies of the Qwen3-MoE
    fixture (saved by megatron-core) whose torch files hold their enums in `form`."""
    made = {}

    def get(form: str):
        if form not in made:
            base = tmp_path_factory.mktemp(f"enums-{form}")
            for fmt in ("legacy", "torch_dist"):
                shutil.copytree(getattr(family_ckpt[NAME], fmt), base / fmt)
                rewrite_enums(base / fmt, form)
            made[form] = base
        return made[form]

    return get


@pytest.fixture(scope="session")
def enum_stats(family_ckpt, tmp_path_factory):
    """Routing statistics planted on the fixture's MoE layers (what select reads)."""
    from mcore_proxy.checkpoint import open_checkpoint
    from mcore_proxy.select.synthetic import stats_like
    from mcore_proxy.core.stats import save_stats

    spec = open_checkpoint(family_ckpt[NAME].legacy).spec
    stats = stats_like(spec, KEEP, tokens=1000, seed=5)
    return save_stats(stats, tmp_path_factory.mktemp("enum-stats") / "stats.safetensors")


def megatron_loads(path):
    """A rank file as Megatron-LM's checkpoint loader reads it: torch.load with torch's default
    (weights_only=True since torch 2.6) and the safe globals `import megatron.core` registers."""
    import megatron.core  # noqa: F401  (registers its safe globals)

    return torch.load(path, map_location="cpu")


def select_and_convert(ckpt, stats, tmp_path, target_ep: int = 1):
    """`select` K experts, then `convert` to TP 1 / PP 1 / EP `target_ep` -> (plan, proxy)."""
    plan, out = tmp_path / "plan.json", tmp_path / "proxy"
    assert (
        main(["select", "--ckpt", str(ckpt), "--stats", str(stats), "--num-experts", str(KEEP), "-o", str(plan)]) == 0
    )
    assert (
        main(
            [
                "convert",
                ckpt,
                "--plan",
                plan,
                "-o",
                out,
                "--target-tp",
                "1",
                "--target-pp",
                "1",
                "--target-ep",
                target_ep,
            ]
        )
        == 0
    )
    return plan, out


@pytest.mark.parametrize("fmt", ["legacy", "torch_dist"])
@pytest.mark.parametrize("form", FORMS)
def test_inspect_select_convert_verify_functional(enum_form_ckpt, enum_stats, tmp_path, capsys, digest, form, fmt):
    from megatron.core.transformer.enums import AttnBackend

    ckpt = enum_form_ckpt(form) / fmt
    assert {enum_form_of(f) for f in torch_files(ckpt)} == {form}
    before = digest(ckpt)
    assert main(["inspect", str(ckpt)]) == 0
    capsys.readouterr()
    plan, out = select_and_convert(ckpt, enum_stats, tmp_path, target_ep=2)
    assert "dropped" not in capsys.readouterr().out  # no args field is lost
    assert json.loads((out / "manifest.json").read_text())["dropped_args"] == {}
    for f in torch_files(out):
        assert enum_form_of(f) == BY_VALUE
        args = megatron_loads(f)["args"]
        assert args.attention_backend is AttnBackend.auto and args.exit_signal is signal.SIGTERM
    assert main(["verify", "--orig", str(ckpt), "--proxy", str(out), "--plan", str(plan), "--functional"]) == 0
    text = capsys.readouterr().out
    assert "verify: OK" in text and "functional: max |logit difference|" in text
    assert digest(ckpt) == before


def test_verify_compares_args_enum_for_enum(enum_form_ckpt, enum_stats, tmp_path, capsys):
    """A proxy whose args hold another member, or lack an enum field without the manifest saying
    so, fails verify (exit 1) naming the field."""
    from megatron.core.transformer.enums import AttnBackend

    ckpt = enum_form_ckpt(BY_NAME) / "legacy"
    plan, out = select_and_convert(ckpt, enum_stats, tmp_path)
    (rank_file,) = torch_files(out)
    manifest = json.loads((out / "manifest.json").read_text())

    def edit_and_verify(edit) -> str:
        state = torch.load(rank_file, weights_only=False)
        edit(state["args"])
        torch.save(state, rank_file)
        (out / "manifest.json").write_text(json.dumps(manifest))  # hashes stale: that is reported too
        capsys.readouterr()
        assert main(["verify", "--orig", str(ckpt), "--proxy", str(out), "--plan", str(plan)]) == 1
        return capsys.readouterr().out

    text = edit_and_verify(lambda a: setattr(a, "attention_backend", AttnBackend.flash))
    assert (
        "args attention_backend is <megatron.core.transformer.enums.AttnBackend.flash>, expected the source's "
        "<megatron.core.transformer.enums.AttnBackend.auto>" in text
    )
    text = edit_and_verify(lambda a: delattr(a, "exit_signal"))
    assert "args exit_signal: missing from the proxy and not recorded as dropped in its manifest" in text


def test_a_getattr_chain_to_os_system_runs_nothing_and_is_dropped(family_ckpt, enum_stats, tmp_path, capsys, digest):
    ckpt, marker = tmp_path / "ckpt", tmp_path / "ran"
    shutil.copytree(family_ckpt[NAME].legacy, ckpt)
    for f in torch_files(ckpt):
        state = torch.load(f, weights_only=False)  # trusted: this session built it
        state["args"].attention_backend = os_system_through_enum(marker)
        torch.save(state, f)
    before = digest(ckpt)
    assert main(["inspect", str(ckpt)]) == 0
    capsys.readouterr()
    plan, out = select_and_convert(ckpt, enum_stats, tmp_path)
    text = capsys.readouterr().out
    assert (
        "args attention_backend was dropped: it holds getattr(megatron.core.transformer.enums.AttnBackend, "
        "'__init__').__globals__.get(...).modules.get(...).system(...), read from"
    ) in text
    assert "which the reader refused" in text
    (rank_file,) = torch_files(out)
    raw = rank_file.read_bytes()
    assert b"getattr" not in raw and b"system" not in raw and b"__globals__" not in raw
    assert not hasattr(megatron_loads(rank_file)["args"], "attention_backend")
    assert "attention_backend" in json.loads((out / "manifest.json").read_text())["dropped_args"]
    # the source's refused record against the proxy's field recorded as dropped: verify passes
    assert main(["verify", "--orig", str(ckpt), "--proxy", str(out), "--plan", str(plan), "--functional"]) == 0
    assert not marker.exists() and digest(ckpt) == before
