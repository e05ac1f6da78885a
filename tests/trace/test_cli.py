"""`mcore-proxy stats merge|show` through the real entry point: sums, refusals, exit codes."""
import numpy as np
import pytest

from mcore_proxy.cli import main
from mcore_proxy.stats import load_stats


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
    assert run_cli(capsys, "merge", str(folder), "-o", str(tmp_path / "n.safetensors"),
                   "--allow-missing-layers")[0] == 0


def one_sentence(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_empty_folder(tmp_path, capsys):
    code, _, err = run_cli(capsys, "merge", str(tmp_path))
    assert code == 2
    assert f"{tmp_path}: holds no rank*.safetensors" in one_sentence(err)


@pytest.mark.parametrize("change, message", [
    (dict(e=6), "num_experts is 6 but"),
    (dict(h=5), "hidden_size is 5 but"),
    (dict(topk=3), "topk is 3 but"),
    (dict(world_size=8), "world_size is 8 but"),
    (dict(model_layers=("0", "1", "2"), layers=("0", "1", "2")), "declares MoE layers"),
    (dict(model_layers=None, layers=("0",)), "declares MoE layers None"),
])
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
    from mcore_proxy.stats import LayerStats, RoutingStats, save_stats

    freq = np.array([3, 0, 1, 0])
    coact = np.diag(freq)
    coact[0, 2] = coact[2, 0] = 1
    stats = RoutingStats({"5": LayerStats(2, freq, freq * 0.5, coact, np.zeros((4, 3)))}, 2)
    save_stats(stats, tmp_path / "s.safetensors")
    code, out, _ = run_cli(capsys, "show", str(tmp_path / "s.safetensors"))
    assert code == 0
    assert "dead experts: [1, 3]" in out and "top pair 0+2: 1 tokens" in out
