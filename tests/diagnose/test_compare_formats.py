"""compare and watch end to end on logs of the new formats: two pairs of verl console logs (the
original's and the proxy's baseline and faulted runs, written as verl prints them, see
conftest.write_verl_console) give exit 0 when the proxy reproduces the fault and 1 when it does not,
never 2 (unreadable) or 3 (internal error); watch reads such a log too."""

import json

from mcore_proxy.cli import main
from mcore_proxy.diagnose.compare import ROLES


def four_verl(tmp_path, synthetic, orig_fault, proxy_fault):
    runs = {
        "orig_base": synthetic.curves(seed=0),
        "orig_fault": synthetic.curves(orig_fault, seed=0, onset=30),
        "proxy_base": synthetic.curves(seed=5, scale=0.8),
        "proxy_fault": synthetic.curves(proxy_fault, seed=5, scale=0.8, onset=30),
    }
    return [
        a
        for role in ROLES
        for a in (f"--{role.replace('_', '-')}", synthetic.write_verl_console(tmp_path / f"{role}.log", runs[role]))
    ]


def test_compare_on_verl_console_logs(tmp_path, synthetic, capsys):
    assert main(["compare", *four_verl(tmp_path, synthetic, "omission", "omission")]) == 0
    assert "CONSISTENT: the proxy reproduces" in capsys.readouterr().out
    assert main(["compare", *four_verl(tmp_path, synthetic, "omission", "precision")]) == 1
    assert "NOT CONSISTENT" in capsys.readouterr().err


def test_watch_reads_a_verl_console_log(synthetic, capsys):
    assert main(["watch", str(synthetic.DATA / "verl_console.log"), "--once", "--no-view", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["last_step"] == 12
