"""`mcore-proxy stats merge|show` through the real entry point: sums, refusals, exit codes, --json,
--force."""

import json
import os
import re
import resource
import subprocess
import sys

import numpy as np
import pytest

from mcore_proxy.cli import main
from mcore_proxy.core.stats import load_stats


def run_cli(capsys, *argv):
    code = main(["stats", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_merge_sums_rank_files(rank_files, make_layer, capsys):
    code, out, err = run_cli(capsys, "merge", str(rank_files))
    assert code == 0, err
    merged = load_stats(rank_files / "routing_stats.safetensors")
    a, b = make_layer(seed=0), make_layer(seed=1)
    np.testing.assert_array_equal(merged.layers["1"].coact, a.coact + b.coact)
    np.testing.assert_allclose(merged.layers["0"].proto_sum, a.proto_sum + b.proto_sum)
    assert merged.layers["0"].tokens == 20
    assert merged.meta["ranks_merged"] == 2 and merged.meta["ranks"] == [0, 1]
    assert "merged 2 rank file(s)" in out
    # the merged file is not picked up again, and is not overwritten without --force
    code, _, err = run_cli(capsys, "merge", str(rank_files))
    assert code == 2 and "exists; pass --force" in err
    assert run_cli(capsys, "merge", str(rank_files), "--force")[0] == 0
    assert load_stats(rank_files / "routing_stats.safetensors").layers["0"].tokens == 20


def test_merge_unions_pipeline_stages_and_refuses_a_missing_stage(tmp_path, make_rank_file, capsys):
    folder = tmp_path / "pp"
    make_rank_file(folder, 0, layers=("0",), model_layers=("0", "1", "mtp.0"))
    make_rank_file(folder, 1, layers=("1", "mtp.0"), model_layers=("0", "1", "mtp.0"))
    code, _, err = run_cli(capsys, "merge", str(folder), "-o", str(tmp_path / "m.safetensors"))
    assert code == 0, err
    assert load_stats(tmp_path / "m.safetensors").layer_ids == ["0", "1", "mtp.0"]
    (folder / "rank00001.safetensors").unlink()
    code, _, err = run_cli(capsys, "merge", str(folder), "-o", str(tmp_path / "n.safetensors"))
    assert code == 2
    assert "no file holds statistics for MoE layers ['1', 'mtp.0']" in err
    assert not (tmp_path / "n.safetensors").exists()
    assert (
        run_cli(capsys, "merge", str(folder), "-o", str(tmp_path / "n.safetensors"), "--allow-missing-layers")[0] == 0
    )


def one_sentence(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_empty_folder(tmp_path, capsys):
    code, _, err = run_cli(capsys, "merge", str(tmp_path))
    assert code == 2
    assert f"{tmp_path}: holds no rank*.safetensors" in one_sentence(err)


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(e=6), "num_experts is 6 but"),
        (dict(h=5), "hidden_size is 5 but"),
        (dict(topk=3), "topk is 3 but"),
        (dict(world_size=8), "world_size is 8 but"),
        (dict(model_layers=("0", "1", "2"), layers=("0", "1", "2")), "declares MoE layers"),
        (dict(model_layers=None, layers=("0",)), "declares MoE layers None"),
    ],
)
def test_mixed_models_are_refused_naming_the_file(rank_files, make_rank_file, capsys, change, message):
    make_rank_file(rank_files, 7, **change)
    code, _, err = run_cli(capsys, "merge", str(rank_files))
    assert code == 2
    line = one_sentence(err)
    assert "rank00007.safetensors" in line and message in line
    assert not (rank_files / "routing_stats.safetensors").exists()


def test_legacy_files_without_declared_layers_must_hold_the_same_layers(tmp_path, make_rank_file, capsys):
    make_rank_file(tmp_path, 0, model_layers=None)
    make_rank_file(tmp_path, 1, model_layers=None, layers=("0",))
    code, _, err = run_cli(capsys, "merge", str(tmp_path))
    assert code == 2 and "rank00001.safetensors: layers ['0'] differ" in one_sentence(err)


def test_truncated_file(rank_files, capsys):
    path = rank_files / "rank00001.safetensors"
    path.write_bytes(path.read_bytes()[:100])
    code, _, err = run_cli(capsys, "merge", str(rank_files))
    assert code == 2
    line = one_sentence(err)
    assert str(path) in line and "truncated" in line


def test_missing_sidecar(rank_files, capsys):
    (rank_files / "rank00001.json").unlink()
    code, _, err = run_cli(capsys, "merge", str(rank_files))
    assert code == 2 and "rank00001.json: sidecar missing" in one_sentence(err)


def test_the_sidecar_given_as_statistics_names_the_statistics(rank_files, capsys):
    run_cli(capsys, "merge", str(rank_files))
    code, _, err = run_cli(capsys, "show", str(rank_files / "routing_stats.json"))
    assert code == 2
    assert f"is the statistics' JSON sidecar; pass {rank_files / 'routing_stats.safetensors'}" in one_sentence(err)


def test_show_table_and_png(rank_files, tmp_path, capsys):
    code, out, err = run_cli(capsys, "show", str(rank_files), "--png", str(tmp_path / "png"))
    assert code == 0, err
    assert "2 MoE layers, E=4, top-2, H=3, 2 rank file(s)" in out
    assert "entropy" in out and "pairs seen" in out
    assert (tmp_path / "png" / "load.png").stat().st_size > 1000
    assert (tmp_path / "png" / "coact.png").stat().st_size > 1000
    run_cli(capsys, "merge", str(rank_files))
    code, out, _ = run_cli(capsys, "show", str(rank_files / "routing_stats.safetensors"), "--top", "1")
    assert code == 0 and out.count("\n") >= 3


def test_show_lists_dead_experts(tmp_path, capsys):
    from mcore_proxy.core.stats import LayerStats, RoutingStats, save_stats

    freq = np.array([3, 0, 1, 0])
    coact = np.diag(freq)
    coact[0, 2] = coact[2, 0] = 1
    stats = RoutingStats({"5": LayerStats(2, freq, freq * 0.5, coact, np.zeros((4, 3)))}, 2)
    save_stats(stats, tmp_path / "s.safetensors")
    code, out, _ = run_cli(capsys, "show", str(tmp_path / "s.safetensors"))
    assert code == 0
    assert "dead experts: [1, 3]" in out and "top pair 0+2: 1 tokens" in out


# -- --json, and outputs replaced only by --force ------------------------------------------------


def test_json_carries_the_numbers_of_the_text(rank_files, capsys):
    code, text, _ = run_cli(capsys, "merge", str(rank_files), "--json")
    merge = json.loads(text)
    assert code == 0 and merge["format"] == "mcore-proxy-stats-merge/1"
    assert (merge["ranks_merged"], merge["moe_layers"], merge["total_tokens"]) == (2, 2, 40)
    stats = rank_files / "routing_stats.safetensors"
    _, text, _ = run_cli(capsys, "show", str(stats))
    _, raw, _ = run_cli(capsys, "show", str(stats), "--json")
    d = json.loads(raw)
    assert d["format"] == "mcore-proxy-stats-show/1" and set(d["layers"]) == {"0", "1"}
    assert (
        f"{len(d['layers'])} MoE layers, E={d['num_experts']}, top-{d['topk']}, H={d['hidden_size']}, "
        f"{d['ranks_merged']} rank file(s)" in text
    )
    for lid, layer in d["layers"].items():
        top = " ".join(f"{t['expert']}:{100 * t['share']:.1f}%" for t in layer["top"])
        i, j, tokens, lift = (layer["top_pair"][k] for k in ("i", "j", "tokens", "lift"))
        assert re.search(
            rf"^\s+{lid}\s+{layer['tokens']}\s+{re.escape(top)}\s.*\s{len(layer['dead'])}\s+"
            rf"{layer['entropy']:.3f}\s+pairs seen {layer['pairs_seen']}/{layer['pairs_total']}, "
            rf"top pair {i}\+{j}: {tokens} tokens \(lift {lift:.2f}\)$",
            text,
            re.M,
        )


def test_show_refuses_existing_pngs_unless_force(rank_files, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    png = tmp_path / "png"
    png.mkdir()
    (png / "load.png").write_bytes(b"old")
    (png / "mine.txt").write_text("other data")
    code, _, err = run_cli(capsys, "show", str(rank_files), "--png", str(png))
    assert code == 2 and f"{png / 'load.png'}: exists; pass --force" in one_sentence(err)
    assert (png / "load.png").read_bytes() == b"old" and not (png / "coact.png").exists()
    code, out, _ = run_cli(capsys, "show", str(rank_files), "--png", str(png), "--force", "--json")
    assert code == 0 and json.loads(out)["png"] == [str(png / "load.png"), str(png / "coact.png")]
    assert (png / "load.png").read_bytes()[:4] == b"\x89PNG" and (png / "coact.png").stat().st_size > 1000
    assert sorted(p.name for p in png.iterdir()) == ["coact.png", "load.png", "mine.txt"]


def test_a_forced_merge_that_fails_to_write_leaves_the_old_file(rank_files, make_rank_file, capsys):
    """A real file-size limit (RLIMIT_FSIZE: EFBIG) stops the new merge; the old pair stays whole."""
    assert run_cli(capsys, "merge", str(rank_files))[0] == 0
    merged, side = rank_files / "routing_stats.safetensors", rank_files / "routing_stats.json"
    before = merged.read_bytes(), side.read_bytes()
    make_rank_file(rank_files, 2)  # the new merge would sum three ranks
    limit = min(map(len, before)) // 2

    def apply():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    done = subprocess.run(
        [sys.executable, "-m", "mcore_proxy.cli", "stats", "merge", str(rank_files), "--force"],
        capture_output=True,
        text=True,
        timeout=120,
        preexec_fn=apply,
        env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"},
    )
    assert done.returncode == 2 and "file-size limit" in one_sentence(done.stderr), done.stderr
    assert (merged.read_bytes(), side.read_bytes()) == before
    assert not [p for p in rank_files.iterdir() if p.name.startswith(".")]
    assert run_cli(capsys, "merge", str(rank_files), "--force")[0] == 0
    assert load_stats(merged).meta["ranks_merged"] == 3
