"""watch: follows a log while another process writes it, alerts once per trouble with its onset,
stops with exit 1 on a --fail-on alert and 0 when the log goes idle, is quiet on a healthy run,
and refuses bad input with exit 2."""

import json
import subprocess
import sys
import textwrap
import time

from mcore_proxy.cli import main
from mcore_proxy.diagnose.watch import Watcher

# A "training run": writes one verl-style JSONL record per step, flushing each, with a fault that
# switches on at step ONSET (the log-prob difference steps up from exactly zero, as in the
# demonstration's rollout-precision fault) unless ONSET < 0.
WRITER = textwrap.dedent("""
    import json, sys, time
    import numpy as np
    path, steps, onset, delay = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
    rng = np.random.default_rng(0)
    with open(path, "w") as f:
        for step in range(steps):
            faulty = 0 <= onset <= step
            data = {"critic/score/mean": 0.2 + 0.003 * step + rng.normal(0, 0.03),
                    "training/rollout_logprob_diff_mean": abs(rng.normal(0.0013, 0.0002)) if faulty else 0.0,
                    "actor/entropy": 0.9 + rng.normal(0, 0.02),
                    "actor/grad_norm": 0.7 + abs(rng.normal(0, 0.2))}
            f.write(json.dumps({"step": step, "data": data}) + "\\n")
            f.flush()
            time.sleep(delay)
""")


def writer(tmp_path, steps, onset, delay=0.03):
    log = tmp_path / "metrics.jsonl"
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(log), str(steps), str(onset), str(delay)])
    return log, proc


def watch(log, *extra):
    return subprocess.run(
        [sys.executable, "-m", "mcore_proxy.cli", "watch", str(log), "--every", "0.2", *extra],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_live_follow_alerts_soon_after_a_mid_run_fault_and_fails_on_it(tmp_path):
    log, proc = writer(tmp_path, steps=150, onset=60, delay=0.1)
    try:
        # started before the log exists: it waits for it
        done = watch(log, "--fail-on", "rising", "--idle", "30")
    finally:
        proc.kill()
        proc.wait()
    assert done.returncode == 1, done.stderr
    assert "check failed: rising alert on logprob_diff" in done.stderr
    alerts = [json.loads(line) for line in done.stdout.splitlines()]
    rising = [a for a in alerts if a["detector"] == "rising"]
    assert len(rising) == 1 and rising[0]["metric"] == "logprob_diff"
    assert rising[0]["raw_name"] == "training/rollout_logprob_diff_mean"
    assert rising[0]["format"] == "mcore-proxy-alert/1"
    assert 58 <= rising[0]["onset"] <= 61
    # noticed while the run was still going (the latency in steps is measured in bench/, not here:
    # it depends on how loaded the machine is), and not before the shift covered 3 steps
    assert rising[0]["onset"] + 2 <= rising[0]["step"] < 149


def test_quiet_on_a_healthy_run_and_stops_when_the_log_is_idle(tmp_path):
    log, proc = writer(tmp_path, steps=80, onset=-1, delay=0.01)
    proc.wait()
    t0 = time.time()
    done = watch(log, "--idle", "1", "--fail-on", "any")
    assert done.returncode == 0, done.stderr
    assert done.stdout == ""
    assert time.time() - t0 < 60
    assert "last step 79" in done.stderr and "0 alert(s)" in done.stderr


def test_watcher_reports_each_alert_once_as_the_log_grows(tmp_path, synthetic):
    data = synthetic.curves("precision", onset=50)
    log = tmp_path / "run.jsonl"
    w = Watcher(log)
    assert w.check() == [] and "no such file" in w.waiting
    seen = []
    for upto in range(10, 121, 10):
        synthetic.write_jsonl(log, {k: v[:upto] for k, v in data.items()})
        seen += [(a.finding.detector, a.finding.metric, a.finding.onset, a.step) for a in w.check()]
    assert [s[:2] for s in seen] == [("rising", "logprob_diff")]
    assert 48 <= seen[0][2] <= 52 and seen[0][3] == 59  # first check with the shift in the log
    w.check()
    assert len(w.alerts) == 1


def test_with_a_baseline_and_alerts_to_a_file(tmp_path, synthetic, capsys):
    base = synthetic.write_jsonl(tmp_path / "base.jsonl", synthetic.curves(seed=0))
    run = synthetic.write_jsonl(tmp_path / "run.jsonl", synthetic.curves("omission", seed=0, onset=30))
    alerts = tmp_path / "alerts.jsonl"
    assert main(["watch", run, "--baseline", base, "--once", "--alerts", str(alerts)]) == 0
    lines = [json.loads(line) for line in alerts.read_text().splitlines()]
    assert ("diverge", "reward") in {(a["detector"], a["metric"]) for a in lines}
    captured = capsys.readouterr()
    assert captured.out == ""
    # the one-screen view (printed once at the end when stderr is not a terminal)
    reward_row = next(line for line in captured.err.splitlines() if line.startswith("reward "))
    assert "ALERT diverge since" in reward_row and any(c in reward_row for c in "▁▂▃▄▅▆▇█")
    assert main(["watch", run, "--baseline", base, "--once", "--fail-on", "diverge"]) == 1


def test_json_document_at_the_end(tmp_path, synthetic, capsys):
    base = synthetic.write_jsonl(tmp_path / "base.jsonl", synthetic.curves(seed=0))
    run = synthetic.write_jsonl(tmp_path / "run.jsonl", synthetic.curves("omission", seed=0, onset=30))
    assert main(["watch", run, "--baseline", base, "--once", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)  # one document, no alert lines before it
    assert doc["format"] == "mcore-proxy-watch/1" and doc["ok"] and doc["last_step"] == 119
    assert ("diverge", "reward") in {(a["detector"], a["metric"]) for a in doc["alerts"]}
    assert main(["watch", run, "--baseline", base, "--once", "--json", "--fail-on", "diverge"]) == 1
    captured = capsys.readouterr()
    assert json.loads(captured.out)["ok"] is False and "check failed: diverge alert" in captured.err


def test_bad_input_exits_2(tmp_path, synthetic, capsys):
    assert main(["watch", str(tmp_path / "missing.jsonl"), "--once"]) == 2
    assert "missing.jsonl: nothing readable" in capsys.readouterr().err
    log = synthetic.write_jsonl(tmp_path / "run.jsonl", synthetic.curves())
    assert main(["watch", log, "--once", "--fail-on", "nonsense"]) == 2
    assert "unknown detector(s) ['nonsense']" in capsys.readouterr().err
    assert main(["watch", log, "--every", "soon"]) == 2
    assert main(["watch", log, "--once", "--collapse", "2"]) == 2
    assert main(["watch", log, "--once", "--baseline", str(tmp_path / "nope")]) == 2
