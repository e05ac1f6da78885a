"""Faults reproduced inside a real RL framework (issue 22 item 1): TRL's GRPOTrainer on CPU, the
original tiny Qwen3-MoE vs its proxy made by this project's Hugging Face pipeline, every fault
switched on by the launch environment only (`PYTHONPATH=patches MCORE_PROXY_FAULTS=...`), every
run launched the way TRL runs are launched (`accelerate launch --num_processes 1 --cpu ...`).

1. models: examples/rl_faults_trl/make_models.py (SFT of the original, collect -> select -> convert);
2. pairs: original and proxy x {baseline, rollout log-prob precision, update omission}, and router
   noise on the original; each fault's `MCORE_PROXY_FAULTS_REPORT` checked (it acted, on the steps
   it should); `mcore-proxy compare` on TRL's own `trainer_state.json` for precision, omission and
   a deliberately different pair (router noise on the original vs omission on the proxy);
3. campaign: `mcore-proxy campaign examples/rl_faults_trl/campaign.json --png` (library: baseline
   + 3 faults x 2 strengths on the proxy), then `heldout.json` (seed 1) with `mcore-proxy watch`
   following the mid-run and baseline runs live; triage of each held-out run against the library;
4. results.json in the work folder, and with --record bench/RESULTS.md's section and the pictures
   under bench/rl_faults_trl/.

    nice -n 10 python bench/rl_trl.py [--work out/rl_faults_trl] [--steps 40] [--record]

Finished runs are kept (delete a run's folder to redo it); the campaign resumes by its own markers.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "rl_faults_trl"
PATCHES = REPO / "patches"
FAULTS = {
    "precision": "logprob_precision:dtype=bf16,when=no_grad",
    "omission": "update_omission:start=5",
    "router_noise": "router_noise:std=1.0",
}
RUNS = [
    ("original", None),
    ("original", "precision"),
    ("original", "omission"),
    ("original", "router_noise"),
    ("proxy", None),
    ("proxy", "precision"),
    ("proxy", "omission"),
]
# name: (original's fault, proxy's fault, expected consistent, the metrics of the verdict)
PAIRS = {
    "precision": ("precision", "precision", True, ("logprob_diff", "rollout_kl")),
    "omission": ("omission", "omission", True, ("reward",)),
    "different": ("router_noise", "omission", False, ("reward", "logprob_diff", "rollout_kl")),
}
ALL_METRICS = ("reward", "kl_loss", "entropy", "grad_norm", "logprob_diff", "rollout_kl", "response_length")
LAUNCH = ["-m", "accelerate.commands.launch", "--num_processes", "1", "--cpu"]


def env(fault: str | None = None, report: Path | None = None) -> dict:
    e = {k: v for k, v in os.environ.items() if not k.startswith("MCORE_PROXY_FAULTS")}
    e.update(
        PYTHONPATH=os.pathsep.join(filter(None, [str(PATCHES), str(REPO), os.environ.get("PYTHONPATH")])),
        OMP_NUM_THREADS="1",
        PYTHONWARNINGS="ignore",
    )
    if fault:
        e["MCORE_PROXY_FAULTS"] = FAULTS[fault]
        e["MCORE_PROXY_FAULTS_REPORT"] = str(report)
    return e


def cli(*args) -> list[str]:
    return [sys.executable, "-m", "mcore_proxy.cli", *map(str, args)]


def grpo_run(model: Path, folder: Path, fault: str | None, steps: int) -> dict:
    done = folder / "done.json"
    if done.is_file():
        return json.loads(done.read_text())
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    cmd = [
        sys.executable,
        *LAUNCH,
        str(EXAMPLE / "train_grpo.py"),
        "--model",
        str(model),
        "--out",
        str(folder),
        "--steps",
        str(steps),
    ]
    print(f"== {folder.name}: {FAULTS.get(fault, 'no fault')}", flush=True)
    t0 = time.time()
    with open(folder / "stdout.log", "w") as log:
        proc = subprocess.run(cmd, env=env(fault, folder / "faults.json"), stdout=log, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        raise SystemExit(f"{folder.name} failed, see {folder / 'stdout.log'}")
    row = {"seconds": time.time() - t0, "fault": FAULTS.get(fault), "command": " ".join(cmd[1:])}
    done.write_text(json.dumps(row))
    return row


def history(folder: Path) -> list[dict]:
    state = json.loads((folder / "trainer_state.json").read_text())
    return [h for h in state["log_history"] if "loss" in h]


def per_step(folder: Path) -> dict:
    import numpy as np

    rows = history(folder)
    return {
        "median_step_seconds": float(np.median([r["step_time"] for r in rows])),
        "peak_rss_mib": max(r["perf/max_rss_mib"] for r in rows),
        "reward_first5": float(np.mean([r["reward"] for r in rows[:5]])),
        "reward_last5": float(np.mean([r["reward"] for r in rows[-5:]])),
    }


def fault_check(folder: Path, fault: str | None, steps: int) -> dict | None:
    """What the injector report says it did, and whether that is where it should have acted."""
    if fault is None:
        return None
    report = json.loads((folder / "faults.json").read_text())["report"][0]
    active = report["active_steps"]
    expected = list(range(5, steps)) if fault == "omission" else list(range(steps))
    check = {
        "fault": report["fault"],
        "calls": report["calls"],
        "active_calls": report["active_calls"],
        "active_steps": f"{active[0]}..{active[-1]} ({len(active)})" if active else "none",
        "as_expected": active == expected,
    }
    if fault == "omission":  # one call per optimizer step: the AdamW behind AcceleratedOptimizer
        check["as_expected"] &= report["calls"] == steps
    return check


def compare(work: Path, pair: str, metrics, key: str) -> dict:
    orig_fault, proxy_fault, _, _ = PAIRS[pair]
    runs = work / "runs"
    report = work / "compare" / f"{pair}-{key}"
    shutil.rmtree(report, ignore_errors=True)
    report.parent.mkdir(exist_ok=True)
    args = (
        "compare",
        "--orig-base",
        runs / "original-baseline/trainer_state.json",
        "--orig-fault",
        runs / f"original-{orig_fault}/trainer_state.json",
        "--proxy-base",
        runs / "proxy-baseline/trainer_state.json",
        "--proxy-fault",
        runs / f"proxy-{proxy_fault}/trainer_state.json",
        "--metrics",
        *metrics,
        "-o",
        report,
    )
    proc = subprocess.run(cli(*args), env=env(), capture_output=True, text=True)
    print(proc.stdout, proc.stderr[-1500:], flush=True)
    return {
        "exit": proc.returncode,
        "metrics": list(metrics),
        "table": proc.stdout.strip().split("\nreport:")[0],
        "command": "mcore-proxy " + " ".join(str(a).replace(str(work) + "/", "WORK/") for a in args),
    }


# -- campaign, watch, triage ----------------------------------------------------------------------
MIDRUN_ONSET = 15
WATCHES = [
    ("midrun_precision", "midrun_precision", None),
    ("midrun_router_noise", "midrun_router_noise", None),
    ("midrun_precision+baseline", "midrun_precision", "baseline"),
    ("baseline", "baseline", None),
]
HELD_OUT = ("precision", "omission", "router_noise")


def library_campaign(work: Path) -> dict:
    """The library campaign; its wall time is the one of the invocation that ran its runs (a later
    invocation, which runs nothing, keeps that time)."""
    t0 = time.time()
    proc = subprocess.run(
        cli("campaign", EXAMPLE / "campaign.json", "--png"), env=env(), capture_output=True, text=True
    )
    print(proc.stdout, proc.stderr[-2000:], flush=True)
    timing = work / "campaign" / "library_seconds.json"
    if any(line.split()[1:2] == ["done"] for line in proc.stdout.splitlines()) or not timing.is_file():
        timing.write_text(json.dumps(time.time() - t0))
    return {"returncode": proc.returncode, "stdout": proc.stdout, "seconds": json.loads(timing.read_text())}


def watched_campaign(work: Path) -> dict:
    """heldout.json with `mcore-proxy watch` on the growing trainer_state.json of the mid-run and
    baseline runs, each watch started as soon as its run folder appears."""
    out = work / "campaign"
    heldout = out / "heldout"
    record = out / "watch.json"
    if record.is_file():
        return json.loads(record.read_text())
    # watch must follow live runs: a run folder left by an earlier attempt would be removed under a
    # watch already started on it when the campaign runs that entry again
    shutil.rmtree(heldout, ignore_errors=True)
    (out / "watch").mkdir(parents=True, exist_ok=True)
    log_out, log_err = open(out / "heldout.stdout", "w+"), open(out / "heldout.stderr", "w+")
    t0 = time.time()
    campaign = subprocess.Popen(
        cli("campaign", EXAMPLE / "heldout.json"), env=env(), stdout=log_out, stderr=log_err, text=True
    )
    watches: dict = {}
    while campaign.poll() is None or any(p.poll() is None for p, _ in watches.values()):
        for name, run, base in WATCHES:
            if name in watches or not (heldout / "runs" / run).is_dir():
                continue
            if base and not (heldout / "runs" / "baseline" / "run.json").is_file():
                continue  # compare against a finished baseline, not one still being written
            extra = ["--baseline", heldout / "runs" / "baseline" / "trainer_state.json"] if base else []
            alerts = out / "watch" / f"{name}.jsonl"
            alerts.unlink(missing_ok=True)
            proc = subprocess.Popen(
                cli(
                    "watch",
                    heldout / "runs" / run / "trainer_state.json",
                    *extra,
                    "--every",
                    "2s",
                    "--idle",
                    "60s",
                    "--no-view",
                    "--alerts",
                    alerts,
                ),
                env=env(),
                stdout=subprocess.DEVNULL,
                stderr=open(out / "watch" / f"{name}.stderr", "w"),
            )
            watches[name] = (proc, time.time() - t0)
        time.sleep(1)
    result = {
        "campaign": {
            "returncode": campaign.returncode,
            "stdout": (out / "heldout.stdout").read_text(),
            "seconds": time.time() - t0,
        },
        "watches": {},
    }
    for name, run, base in WATCHES:
        proc, started = watches[name]
        path = out / "watch" / f"{name}.jsonl"
        alerts = [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []
        entry = {
            "run": run,
            "baseline": base,
            "returncode": proc.returncode,
            "alerts": [{k: a[k] for k in ("detector", "metric", "onset", "step")} for a in alerts],
        }
        if run.startswith("midrun") and alerts:
            first = min(alerts, key=lambda a: a["step"])
            entry["first_alert"] = {
                "detector": first["detector"],
                "metric": first["metric"],
                "noticed_at_step": first["step"],
                "steps_after_fault_onset": first["step"] - MIDRUN_ONSET,
            }
        result["watches"][name] = entry
    record.write_text(json.dumps(result, indent=1))
    return result


def triage(work: Path) -> dict:
    heldout, library = work / "campaign" / "heldout" / "runs", work / "campaign" / "library" / "library.json"
    out = {}
    for name in (*HELD_OUT, "midrun_precision", "midrun_router_noise"):
        args = (
            "compare",
            "--run",
            heldout / name / "trainer_state.json",
            "--baseline",
            heldout / "baseline" / "trainer_state.json",
            "--library",
            library,
        )
        proc = subprocess.run(cli(*args, "--json"), env=env(), capture_output=True, text=True)
        if proc.returncode != 0 or not proc.stdout.strip():
            out[name] = {"returncode": proc.returncode, "stderr": proc.stderr[-1500:]}
            continue
        data = json.loads(proc.stdout)
        ranking = [(r["fault"], round(r["score"], 3), r["best_entry"]) for r in data["ranking"]]
        truth = name.replace("midrun_", "")
        names = [r[0] for r in ranking]
        out[name] = {
            "ranking": ranking,
            "truth": truth,
            "ranked_first": bool(ranking) and ranking[0][0] == truth,
            "rank_of_truth": names.index(truth) + 1 if truth in names else None,
        }
    return out


# -- pictures and the record ----------------------------------------------------------------------
PICTURES = [("precision", "logprob_diff"), ("precision", "rollout_kl"), ("omission", "reward"), ("different", "reward")]
# canonical metric -> the name TRL's log_history (and the example's trainer) logs it under
TRL_NAMES = {
    "reward": "reward",
    "kl_loss": "kl",
    "logprob_diff": "sampling/sampling_logp_difference/mean",
    "rollout_kl": "rollout_corr/k3_kl",
    "entropy": "entropy",
}
LOG_SCALE = ("logprob_diff", "rollout_kl")  # near 0 in a baseline: orders of magnitude apart


def curves_figure(work: Path, path: Path) -> None:
    """Original | proxy side by side: baseline and each fault, per metric of its verdict."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [
        ("precision", "logprob_diff"),
        ("precision", "rollout_kl"),
        ("precision", "kl_loss"),
        ("omission", "reward"),
        ("router_noise", "reward"),
    ]
    fig, axes = plt.subplots(len(rows), 2, figsize=(11, 13), sharex=True)
    for (fault, metric), row in zip(rows, axes):
        for ax, model in zip(row, ("original", "proxy")):
            for f, color in ((None, "tab:blue"), (fault, "tab:red")):
                folder = work / "runs" / f"{model}-{f or 'baseline'}"
                if not folder.is_dir():
                    continue
                h = history(folder)
                values = [r[TRL_NAMES[metric]] for r in h]
                ax.plot([r["step"] for r in h], values, color=color, label=FAULTS.get(f, "baseline"))
            ax.set_title(f"{model}: {metric}", fontsize=9)
            ax.legend(fontsize=7)
            if metric in LOG_SCALE:
                ax.set_yscale("log")
    for ax in axes[-1]:
        ax.set_xlabel("GRPO step (TRL global_step)")
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def watch_figure(work: Path, results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = work / "campaign" / "heldout" / "runs"
    base = history(runs / "baseline")
    metrics = ("reward", "kl_loss", "logprob_diff", "rollout_kl", "entropy")
    names = ("midrun_precision", "midrun_router_noise")
    fig, axes = plt.subplots(len(names), len(metrics), figsize=(18, 6))
    for row, name in zip(axes, names):
        h = history(runs / name)
        noticed = results["campaign"]["watch"]["watches"][name].get("first_alert", {}).get("noticed_at_step")
        for ax, metric in zip(row, metrics):
            key = TRL_NAMES[metric]
            ax.plot([r["step"] for r in base], [r[key] for r in base], color="tab:blue", label="baseline")
            ax.plot([r["step"] for r in h], [r[key] for r in h], color="tab:red", label=name)
            ax.axvline(MIDRUN_ONSET + 1, color="gray", ls="--", lw=1, label="fault on")
            if noticed is not None:
                ax.axvline(noticed, color="black", lw=1, label=f"first alert ({noticed})")
            if metric in LOG_SCALE:
                ax.set_yscale("log")
            ax.set_title(f"{name}: {metric}", fontsize=9)
        row[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


BEGIN, END = "<!-- rl_trl:begin (bench/rl_trl.py --record) -->", "<!-- rl_trl:end -->"


def _alerts(alerts: list) -> str:
    return "; ".join(f"{a['detector']} {a['metric']} (onset {a['onset']}, at {a['step']})" for a in alerts) or "none"


def results_section(r: dict) -> str:
    m = r["models"]
    lines = [
        BEGIN,
        "",
        "## Faults inside a real RL framework: TRL's GRPOTrainer, original vs proxy (issue 22)",
        "",
        f"`{r['command']}` on 2 shared CPU cores (1-minute load average {r['load_average'][0]:.1f} at the end). "
        f"Framework: TRL {r['versions']['trl']} `GRPOTrainer` (transformers {r['versions']['transformers']} "
        f"generation, accelerate {r['versions']['accelerate']}, torch {r['versions']['torch']}), every run "
        f"launched as `accelerate launch --num_processes 1 --cpu examples/rl_faults_trl/train_grpo.py`, "
        "faults through `PYTHONPATH=patches MCORE_PROXY_FAULTS=...` only. verl (0.9.1) was not used: its "
        "trainer's rollout registry has only vLLM, SGLang and TensorRT-LLM servers (the HF rollout class is "
        "not wired into it), it needs Ray, and installing it would downgrade transformers 5.24 to 5.10.",
        "",
        f"Original: a Qwen3-MoE (4 layers, H 128, top-2 of 16 experts) trained here by SFT on bench/quality's "
        f"word problems for {m['original']['steps']} steps ({m['original']['train_seconds'] / 60:.0f} min), "
        f"greedy exact match {m['original']['greedy_exact_match_500']['test']:.3f} (500 test problems); "
        f"proxy: 8 of 16 experts by `collect --hf` (2000 training lines) -> `select` -> `convert` (HF -> HF), "
        f"greedy exact match {m['proxy_greedy_exact_match_test_500']:.3f}. GRPO: {r['steps']} steps, 16 "
        "problems x 4 samples per step from a 64-problem RL set, answers up to 5 tokens, temperature 1, "
        "lr 2e-4, beta 0.05 (TRL's `kl`), one generation and one optimizer step per step. The rollout-vs-training "
        "log-prob difference is TRL's `sampling/sampling_logp_difference/mean`, which TRL logs only with "
        "vLLM: the script keeps the log-probs of `generate`'s own logits and compares them with TRL's "
        "training pass (a measurement only; the loss is TRL's). The same tokens give the KL between the "
        "rollout and the training policy, logged under verl's rollout-correction name `rollout_corr/k3_kl` "
        "(compare's `rollout_kl`): the KL a rollout precision fault raises. TRL's `kl` (`kl_loss`, to the "
        "reference model) is shown for information: the fault moves it only at second order, under the "
        "policy's own drift.",
        "",
        "| run | fault | run s | median s/step | peak RSS MiB | reward steps 1-5 | reward last 5 | injector report |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, row in r["per_step"].items():
        check = r["fault_checks"].get(name)
        report = (
            "-"
            if not check
            else (
                f"{check['active_calls']}/{check['calls']} calls active, steps "
                f"{check['active_steps']}: {'as expected' if check['as_expected'] else 'NOT as expected'}"
            )
        )
        lines.append(
            f"| {name} | {r['runs'][name]['fault'] or '-'} | {r['runs'][name]['seconds']:.0f} | "
            f"{row['median_step_seconds']:.2f} | {row['peak_rss_mib']:.0f} | {row['reward_first5']:.3f} | "
            f"{row['reward_last5']:.3f} | {report} |"
        )
    o, q = r["per_step"]["original-baseline"], r["per_step"]["proxy-baseline"]
    lines += [
        "",
        f"Proxy / original baseline: wall time per step {q['median_step_seconds'] / o['median_step_seconds']:.2f}x, "
        f"peak RSS {q['peak_rss_mib'] / o['peak_rss_mib']:.2f}x (two runs at a time on a shared machine; the "
        "process, not these small models' experts, dominates both).",
        "",
    ]
    for pair, v in r["verdicts"].items():
        lines += [
            f"### {pair}: original `{FAULTS[PAIRS[pair][0]]}`, proxy `{FAULTS[PAIRS[pair][1]]}` "
            f"(expected {'consistent' if PAIRS[pair][2] else 'inconsistent'}: exit {v['chosen']['exit']}, "
            f"{'as expected' if v['as_expected'] else 'NOT as expected'})",
            "",
            f"`{v['chosen']['command']}`",
            "",
            "```",
            v["chosen"]["table"],
            "```",
            "",
            f"All {len(ALL_METRICS)} metrics (exit {v['all']['exit']}, for information):",
            "",
            "```",
            v["all"]["table"],
            "```",
            "",
        ]
    lines += ["![original vs proxy](rl_faults_trl/curves.png)", ""]
    lines += [
        "### Campaign, triage and watch (the proxy, TRL runs)",
        "",
        f"`mcore-proxy campaign examples/rl_faults_trl/campaign.json --png` (baseline + 3 faults x 2 strengths, "
        f"30 steps each, 2 at a time: {r['campaign']['library']['seconds'] / 60:.1f} min) and "
        f"`heldout.json` (seed 1: its own baseline, held-out runs at other strengths or variants, two faults "
        f"switched on at step 15 by `start=15`; {r['campaign']['watch']['campaign']['seconds'] / 60:.1f} min). "
        "Logs: TRL's `trainer_state.json`, which the script rewrites after every step.",
        "",
        "```",
        r["campaign"]["library"]["stdout"].strip(),
        "```",
        "",
        "| held-out run (seed 1) | ranked first | score | second | score | rank of the true fault |",
        "|---|---|---|---|---|---|",
    ]
    for name, t in r["campaign"]["triage"].items():
        if "ranking" not in t or len(t["ranking"]) < 2:
            lines.append(f"| {name} | {t.get('ranking') or t.get('stderr', '').strip()[-200:]} | | | | |")
            continue
        a, b = t["ranking"][0], t["ranking"][1]
        lines.append(
            f"| {name} | {a[0]} ({a[2]}) | {a[1]:.2f} | {b[0]} | {b[1]:.2f} | {t['rank_of_truth']}"
            f"{'' if t['ranked_first'] else ' (NOT first)'} |"
        )
    lines += [
        "",
        "`mcore-proxy watch RUN/trainer_state.json [--baseline B] --every 2s --idle 60s` started when each "
        "run's folder appeared, following the file while TRL wrote it (the fault comes on at optimizer step "
        "15, TRL's logged step 16):",
        "",
        "| watch | alerts (onset, noticed at step) | first alert, steps after the fault came on |",
        "|---|---|---|",
    ]
    for name, w in r["campaign"]["watch"]["watches"].items():
        first = w.get("first_alert", {}).get("steps_after_fault_onset", "-")
        if isinstance(first, int):
            first -= 1  # the onset in TRL's logged steps is 16
        lines.append(f"| {name} | {_alerts(w['alerts'])} | {first} |")
    lines += ["", "![watch](rl_faults_trl/watch.png) ![library](rl_faults_trl/library.png)", ""]
    lines += ["### Not reproduced, or not as asked", ""] + [f"- {n}" for n in r.get("notes", [])]
    return "\n".join(lines + ["", END])


def record(work: Path, results: dict) -> None:
    sys.path.insert(0, str(REPO))
    from bench.quality.ablate import replace_section

    pictures = REPO / "bench" / "rl_faults_trl"
    pictures.mkdir(exist_ok=True)
    curves_figure(work, pictures / "curves.png")
    watch_figure(work, results, pictures / "watch.png")
    library_png = work / "campaign" / "library" / "library.png"
    if library_png.is_file():
        shutil.copy(library_png, pictures / "library.png")
    for pair, metric in PICTURES:
        png = work / "compare" / f"{pair}-chosen" / f"{metric}.png"
        if png.is_file():
            shutil.copy(png, pictures / f"compare-{pair}-{metric}.png")
    (pictures / "results.json").write_text(json.dumps(results, indent=1))
    replace_section(REPO / "bench" / "RESULTS.md", BEGIN, END, results_section(results))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--work", default="out/rl_faults_trl")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--skip-campaign", action="store_true")
    p.add_argument("--record", action="store_true")
    p.add_argument("--notes", default=None, help="JSON list of sentences for the 'not reproduced' list")
    args = p.parse_args(argv)
    work = Path(args.work).absolute()
    work.mkdir(parents=True, exist_ok=True)
    t_all = time.time()
    proc = subprocess.run([sys.executable, str(EXAMPLE / "make_models.py"), "--work", str(work)], env=env())
    if proc.returncode != 0:
        return proc.returncode
    models = {"original": work / "original", "proxy": work / "proxy"}
    with ThreadPoolExecutor(args.jobs) as pool:  # each run is its own process
        futures = {
            f"{m}-{f or 'baseline'}": (
                f,
                pool.submit(grpo_run, models[m], work / "runs" / f"{m}-{f or 'baseline'}", f, args.steps),
            )
            for m, f in RUNS
        }
        runs = {name: fut.result() for name, (_, fut) in futures.items()}
    checks = {name: fault_check(work / "runs" / name, f, args.steps) for name, (f, _) in futures.items()}
    print(json.dumps(checks, indent=1), flush=True)
    verdicts = {}
    for pair, (_, _, expected, metrics) in PAIRS.items():
        verdicts[pair] = {
            "chosen": compare(work, pair, metrics, "chosen"),
            "all": compare(work, pair, ALL_METRICS, "all"),
        }
        verdicts[pair]["as_expected"] = (verdicts[pair]["chosen"]["exit"] == 0) == expected
    campaign = None
    if not args.skip_campaign:
        campaign = {"library": library_campaign(work)}
        campaign["watch"] = watched_campaign(work)
        campaign["triage"] = triage(work)
        print(json.dumps(campaign["triage"], indent=1), json.dumps(campaign["watch"]["watches"], indent=1), flush=True)
    import accelerate
    import torch
    import transformers
    import trl

    results = {
        "models": json.loads((work / "models.json").read_text()),
        "steps": args.steps,
        "runs": runs,
        "per_step": {name: per_step(work / "runs" / name) for name in runs},
        "fault_checks": checks,
        "verdicts": verdicts,
        "campaign": campaign,
        "total_seconds": time.time() - t_all,
        "load_average": os.getloadavg(),
        "versions": {
            "trl": trl.__version__,
            "transformers": transformers.__version__,
            "accelerate": accelerate.__version__,
            "torch": torch.__version__,
        },
        "notes": json.loads(args.notes) if args.notes else [],
        "command": "nice -n 10 python bench/rl_trl.py --work "
        + args.work
        + f" --steps {args.steps}"
        + " --record" * args.record
        + " --notes NOTES" * bool(args.notes),
    }
    (work / "results.json").write_text(json.dumps(results, indent=1))
    if args.record:
        record(work, results)
    ok = all(v["as_expected"] for v in verdicts.values()) and all(
        c is None or c["as_expected"] for c in checks.values()
    )
    print(
        "TRL demonstration",
        "as expected" if ok else "NOT as expected",
        {k: v["chosen"]["exit"] for k, v in verdicts.items()},
        flush=True,
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
