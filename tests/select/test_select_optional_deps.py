"""Issue 16 item 3: without matplotlib, `select --report` and `stats show --png` say so in one
sentence and exit 2 before anything is written (no plan, no empty report folder).

The commands run in a fresh interpreter in which importing matplotlib fails as it does when the
package is absent: Python's import system raises ModuleNotFoundError for a module whose
`sys.modules` entry is None, so the real `import matplotlib` of the command fails for real."""

import subprocess
import sys

import pytest

pytestmark = pytest.mark.megatron

WITHOUT_MATPLOTLIB = (
    "import sys; sys.modules['matplotlib'] = None; from mcore_proxy.cli import main; sys.exit(main(sys.argv[1:]))"
)


def run_without_matplotlib(*argv):
    return subprocess.run(
        [sys.executable, "-c", WITHOUT_MATPLOTLIB, *map(str, argv)], capture_output=True, text=True, timeout=300
    )


def test_select_report_without_matplotlib_writes_nothing(sparse_traced, tmp_path):
    ckpt, stats = sparse_traced("seq_tp2_pp2_ep2")
    plan, report = tmp_path / "plan.json", tmp_path / "report"
    r = run_without_matplotlib("select", "--ckpt", ckpt, "--stats", stats, "-k", "4", "--report", report, "-o", plan)
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert "--report draws PNGs with matplotlib, which is not installed" in r.stderr
    assert "pip install 'mcore-proxy[report]'" in r.stderr
    assert not plan.exists() and not report.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_stats_show_png_without_matplotlib_writes_nothing(sparse_traced, tmp_path):
    _, stats = sparse_traced("seq_tp2_pp2_ep2")
    r = run_without_matplotlib("stats", "show", stats, "--png", tmp_path / "png")
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr and "--png draws PNGs with matplotlib" in r.stderr
    assert r.stdout == "" and not (tmp_path / "png").exists()


def test_with_matplotlib_both_commands_draw(sparse_traced, tmp_path):
    pytest.importorskip("matplotlib")
    ckpt, stats = sparse_traced("seq_tp2_pp2_ep2")
    from mcore_proxy.cli import main

    assert (
        main(
            [
                "select",
                "--ckpt",
                ckpt,
                "--stats",
                stats,
                "-k",
                "4",
                "--report",
                tmp_path / "report",
                "-o",
                tmp_path / "plan.json",
            ]
        )
        == 0
    )
    assert main(["stats", "show", str(stats), "--png", str(tmp_path / "png")]) == 0
    assert (tmp_path / "plan.json").is_file()
    for png in [*(tmp_path / "report").glob("*.png"), *(tmp_path / "png").glob("*.png")]:
        assert png.read_bytes()[:4] == b"\x89PNG"
    assert len(list((tmp_path / "png").glob("*.png"))) == 2
