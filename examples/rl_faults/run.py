"""The fault-reproduction demonstration end to end, on CPU (about an hour on 2 shared cores):

1. the original: bench/quality's trained `coarse` MoE (megatron-core GPTModel, 4 layers, top-2 of
   16 experts), trained on its word problems when the cache has none;
2. its proxy, by this project's pipeline: routing statistics traced on 2 000 training problems
   (`mcore_proxy.trace.install`), `mcore-proxy stats merge`, `mcore-proxy select` (8 of 16
   experts, multi-view), `mcore-proxy convert`;
3. GRPO runs (examples/rl_faults/grpo.py) of both models: baseline, rollout log-prob precision
   fault (`logprob_precision:dtype=bf16,when=rollout`), actor update omission fault
   (`update_omission:start=5`), and, for the original only, router noise
   (`router_noise:std=1.0`); faults switched on by the launch environment alone;
4. `mcore-proxy compare` for each fault, and for a deliberately different pair (router noise on
   the original, update omission on the proxy), which must be reported inconsistent;
5. `results.json` in the work folder, and with `--record` the section of bench/RESULTS.md and its
   pictures under bench/rl_faults/.

    nice -n 10 python examples/rl_faults/run.py [--work out/rl_faults] [--steps 60] [--record]

Finished runs are kept and not repeated (delete a run's folder to redo it). Issue 24 asks at which K
the faults still reproduce: `--num-experts K` builds another proxy (K of 16) beside the default 8, and
`--distill-steps N` then distills it against the original (`mcore-proxy distill`, opt-in: it changes
weights), or `--merge-clusters` converts it with each kept expert its cluster's frequency-weighted mean
(`convert --merge-clusters`, opt-in: it changes weights); the original's runs are shared, each proxy's
runs and verdicts are its own (`runs/proxy-k4-...`, `results-proxy-k4.json`); `--summary` prints one row
per proxy run so far.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
GRPO = Path(__file__).with_name("grpo.py")
FAULTS = {
    "precision": "logprob_precision:dtype=bf16,when=rollout",
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
# name: (original's fault, proxy's fault, expected consistent, the paper's metrics of the fault,
# the wider set chosen before the first run). The verdict is on the paper's metrics: the
# log-prob discrepancy and the (rollout-vs-training) PPO KL for the precision fault, the reward
# for update omission; the other two sets are reported beside it.
PAIRS = {
    "precision": ("precision", "precision", True, ("logprob_diff", "ppo_kl"), ("logprob_diff", "kl_loss", "ppo_kl")),
    "omission": ("omission", "omission", True, ("reward",), ("reward", "kl_loss", "entropy")),
    "different": (
        "router_noise",
        "omission",
        False,
        ("reward", "logprob_diff", "ppo_kl"),
        ("reward", "kl_loss", "entropy", "logprob_diff"),
    ),
}
ALL_METRICS = ("reward", "kl_loss", "ppo_kl", "entropy", "logprob_diff", "clipfrac", "response_length")
NUM_EXPERTS = 8  # the recorded demonstration's proxy (`--num-experts`)
TRACE_PROBLEMS = 2000  # training problems traced for the routing statistics; distillation takes the next ones


def env(fault: str | None = None) -> dict:
    e = {k: v for k, v in os.environ.items() if not k.startswith("MCORE_PROXY_FAULTS")}
    paths = [str(REPO / "patches"), str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]
    e.update(PYTHONPATH=os.pathsep.join(paths), OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    if fault:
        e["MCORE_PROXY_FAULTS"] = FAULTS[fault]
    return e


def cli(*args) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "mcore_proxy.cli", *map(str, args)]
    print("$ mcore-proxy", " ".join(map(str, args)), flush=True)
    return subprocess.run(cmd, env=env(), text=True, capture_output=True)


def _trace_worker(rank: int, ckpt: str, out: str, count: int) -> None:
    import torch

    from bench.quality import model as qmodel
    from bench.quality import task
    from mcore_proxy.functional.cpu import destroy_distributed, free_port, init_distributed
    from mcore_proxy.trace import install

    torch.set_num_threads(1)
    init_distributed(0, 1, free_port())
    try:
        _, gpt = qmodel.load(ckpt)
        problems = task.split("train")[:count]
        with install(gpt, out), torch.no_grad():
            for start in range(0, count, 200):
                tokens, _ = task.batch(problems[start : start + 200])
                tokens = task.trim(tokens)[0]
                qmodel.logits(gpt, tokens, padding_mask=tokens == task.PAD)
    finally:
        destroy_distributed()


def proxy_label(num_experts: int, distill_steps: int, merged: bool = False) -> str:
    """The proxy's name in run folders: `proxy` for the recorded 8 of 16, else `proxy-k4[-merged][-distilled]`."""
    if num_experts == NUM_EXPERTS and not (distill_steps or merged):
        return "proxy"
    return f"proxy-k{num_experts}" + ("-merged" if merged else "") + ("-distilled" if distill_steps else "")


def own(name: str, label: str) -> str:
    """A work-folder file or folder of proxy `label`: `results.json` for the recorded proxy,
    `results-proxy-k4.json` for another."""
    if label == "proxy":
        return name
    stem, dot, ext = name.partition(".")
    return f"{stem}-{label}{dot}{ext}"


def _run_cli(*args) -> None:
    proc = cli(*args)
    print(proc.stdout[-1500:], proc.stderr[-1500:], flush=True)
    if proc.returncode != 0:
        raise SystemExit(f"mcore-proxy {args[0]} failed ({proc.returncode})")


def build_proxy(
    original: Path, work: Path, num_experts: int = NUM_EXPERTS, distill_steps: int = 0, merged: bool = False
) -> Path:
    import torch

    label = proxy_label(num_experts, distill_steps, merged)
    proxy = work / label
    if (proxy / "manifest.json").is_file() or (proxy / "distill.json").is_file():
        return proxy
    stats = work / "routing_stats.safetensors"
    if not stats.is_file():
        trace = work / "trace"
        shutil.rmtree(trace, ignore_errors=True)
        torch.multiprocessing.spawn(
            _trace_worker, args=(str(original), str(trace), TRACE_PROBLEMS), nprocs=1, join=True
        )
        _run_cli("stats", "merge", trace, "-o", stats, "--force")
    plan = work / ("plan.json" if label == "proxy" else f"plan-k{num_experts}.json")
    plan.unlink(missing_ok=True)
    _run_cli("select", "--ckpt", original, "--stats", stats, "--num-experts", num_experts, "--target-ep", 1, "-o", plan)
    pruned = proxy.with_name(proxy.name + "-pruned") if distill_steps else proxy
    shutil.rmtree(pruned, ignore_errors=True)
    _run_cli("convert", original, "--plan", plan, "-o", pruned, "--target-ep", 1, *(["--merge-clusters"] * merged))
    if distill_steps:
        from bench.quality import task
        from bench.quality.ablate import distill_tokens

        tokens = distill_tokens(work, distill_steps, first=TRACE_PROBLEMS)  # the problems after the traced ones
        _run_cli(
            "distill", "--orig", original, "--proxy", pruned, "--tokens", tokens,
            "--pad-id", task.PAD, "--steps", distill_steps, "-o", proxy, "--force",
        )  # fmt: skip
    return proxy


def _accuracy_worker(rank: int, ckpts: list, out: str) -> None:
    from bench.quality import model as qmodel
    from bench.quality import task
    from mcore_proxy.functional.cpu import destroy_distributed, free_port, init_distributed

    init_distributed(0, 1, free_port())
    try:
        acc = {name: qmodel.accuracy(qmodel.load(path)[1], task.split("test")) for name, path in ckpts}
        Path(out).write_text(json.dumps(acc))
    finally:
        destroy_distributed()


def run_name(model: str, fault: str | None) -> str:
    return f"{model}-{fault or 'baseline'}"


def grpo_run(ckpt: Path, folder: Path, fault: str | None, steps: int) -> float:
    done = folder / "done.json"
    if done.is_file():
        return json.loads(done.read_text())["seconds"]
    shutil.rmtree(folder, ignore_errors=True)
    t0 = time.time()
    e = env(fault)
    e["MCORE_PROXY_FAULTS_REPORT"] = str(folder / "faults.json") if fault else ""
    cmd = [sys.executable, str(GRPO), "--ckpt", str(ckpt), "--out", str(folder), "--steps", str(steps)]
    print(f"== {folder.name}: {FAULTS.get(fault, 'no fault')}", flush=True)
    proc = subprocess.run(cmd, env=e, text=True, capture_output=True)
    (folder / "stdout.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        raise SystemExit(f"{folder.name} failed:\n{proc.stderr[-3000:]}")
    seconds = time.time() - t0
    done.write_text(json.dumps({"seconds": seconds, "fault": FAULTS.get(fault)}))
    return seconds


def per_step(folder: Path) -> dict:
    """Median wall time per step (s) and the run's peak RSS (MiB), from its JSONL."""
    import numpy as np

    rows = [json.loads(line)["data"] for line in (folder / "metrics.jsonl").read_text().splitlines()]
    return {
        "median_step_seconds": float(np.median([r["perf/step_seconds"] for r in rows])),
        "peak_rss_mib": max(r["perf/max_rss_mib"] for r in rows),
    }


BEGIN, END = "<!-- rl_faults:begin (examples/rl_faults/run.py --record) -->", "<!-- rl_faults:end -->"
PICTURES = [
    ("precision-chosen", "logprob_diff"),
    ("precision-chosen", "kl_loss"),
    ("omission-chosen", "reward"),
    ("omission-chosen", "kl_loss"),
    ("omission-chosen", "entropy"),
    ("different-chosen", "reward"),
    ("different-chosen", "kl_loss"),
]


def results_section(results: dict) -> str:
    steps = results["per_step"]
    lines = [
        BEGIN,
        "",
        "## Fault reproduction: GRPO on CPU, original vs proxy (issue 14)",
        "",
        f"`{results['command']}`; {results['steps']} RL steps per run, 32 problems x 4 samples per "
        f"step (a 64-problem RL set), two runs at a time; 2 shared CPU cores, load average at the end "
        f"{results['load_average'][0]:.1f}; the seven GRPO runs took "
        f"{sum(results['run_seconds'].values()) / 60:.0f} min of process time in all.",
        "",
        f"Original: bench/quality's `coarse` MoE (E=16, top-2; trained "
        f"{results['training']['train_seconds'] / 60:.0f} min, test exact match "
        f"{results['training']['accuracy']['test']:.3f}); proxy: {results['num_experts'][1]} of 16 "
        f"experts by trace -> stats merge -> select (multiview) -> convert. Greedy test exact match: "
        f"original {results['test_accuracy_greedy']['original']:.3f}, proxy "
        f"{results['test_accuracy_greedy']['proxy']:.3f}.",
        "",
        "| run | fault | run min | median s/step | peak RSS MiB |",
        "|---|---|---|---|---|",
    ]
    for name, row in steps.items():
        fault = name.split("-", 1)[1]
        lines.append(
            f"| {name} | {FAULTS.get(fault, '-')} | {results['run_seconds'][name] / 60:.1f} | "
            f"{row['median_step_seconds']:.2f} | {row['peak_rss_mib']:.0f} |"
        )
    o, q = steps["original-baseline"], steps["proxy-baseline"]
    lines += [
        "",
        f"Proxy / original, baseline runs (not side by side: each ran beside its own "
        f"precision run): wall time per step {q['median_step_seconds'] / o['median_step_seconds']:.2f}x, "
        f"peak RSS {q['peak_rss_mib'] / o['peak_rss_mib']:.2f}x. Peak RSS is dominated by the "
        "process (torch, megatron-core, two model copies: policy and reference), not the "
        "experts of these small models.",
        "",
    ]
    for pair, v in results["verdicts"].items():
        lines += [
            f"### {pair}: original `{v['faults'][0]}`, proxy `{v['faults'][1]}` "
            f"(expected {'consistent' if v['expected_consistent'] else 'inconsistent'}: "
            f"{'as expected' if v['as_expected'] else 'NOT as expected'})",
            "",
            f"Verdict on the paper's metrics of the fault, {', '.join(v['paper']['metrics'])} "
            f"(exit {v['paper']['exit']}):",
            "",
            "```",
            v["paper"]["table"],
            "```",
            "",
            f"On the wider set chosen before the first run, {', '.join(v['chosen']['metrics'])} "
            f"(exit {v['chosen']['exit']}):",
            "",
            "```",
            v["chosen"]["table"],
            "```",
            "",
            f"On all {len(ALL_METRICS)} metrics (exit {v['all']['exit']}):",
            "",
            "```",
            v["all"]["table"],
            "```",
            "",
        ]
    lines += [f"![{pair} {metric}](rl_faults/{pair}-{metric}.png)" for pair, metric in PICTURES]
    return "\n".join(lines + ["", END])


def summary(work: Path) -> str:
    """One markdown row per proxy run so far in `work` (results*.json): K, distillation, greedy
    test accuracy, and the exit code of `compare` on the paper's metrics of each pair (0: consistent)."""
    lines = [
        "| proxy | K of 16 | distill steps | clusters merged | test exact match (original) | precision | omission | "
        "different | "
        "both faults reproduced, different pair told apart |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    rows = [json.loads(p.read_text()) for p in sorted(work.glob("results*.json"))]
    for r in sorted(
        rows, key=lambda r: (-r["num_experts"][1], r.get("merged_clusters", False), r.get("distill_steps", 0))
    ):
        merged = r.get("merged_clusters", False)
        label = proxy_label(r["num_experts"][1], r.get("distill_steps", 0), merged)
        acc = r["test_accuracy_greedy"]
        exits = {pair: v["paper"]["exit"] for pair, v in r["verdicts"].items()}
        ok = all(v["as_expected"] for v in r["verdicts"].values())
        lines.append(
            f"| {label} | {r['num_experts'][1]} | {r.get('distill_steps', 0)} | {'yes' if merged else 'no'} "
            f"| {acc[label]:.3f} "
            f"({acc['original']:.3f}) | {exits['precision']} | {exits['omission']} | {exits['different']} | "
            f"{'yes' if ok else 'no'} |"
        )
    return "\n".join(lines)


def record(work: Path, results: dict) -> None:
    pictures = REPO / "bench" / "rl_faults"
    pictures.mkdir(exist_ok=True)
    for pair, metric in PICTURES:
        shutil.copy(work / "compare" / pair / f"{metric}.png", pictures / f"{pair}-{metric}.png")
    (pictures / "results.json").write_text(json.dumps(results, indent=1))
    path = REPO / "bench" / "RESULTS.md"
    text = path.read_text()
    section = results_section(results)
    if BEGIN in text:
        text = text[: text.index(BEGIN)] + section + text[text.index(END) + len(END) :]
    else:
        text = text.rstrip() + "\n\n" + section + "\n"
    path.write_text(text)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--work", default="out/rl_faults")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--jobs", type=int, default=2, help="GRPO runs at once")
    p.add_argument("--record", action="store_true", help="write bench/RESULTS.md's section and pictures")
    p.add_argument("--num-experts", type=int, default=NUM_EXPERTS, help="K of the proxy (of 16)")
    p.add_argument("--distill-steps", type=int, default=0, help="then distill the proxy (changes weights)")
    p.add_argument("--merge-clusters", action="store_true", help="convert with --merge-clusters (changes weights)")
    p.add_argument("--summary", action="store_true", help="print the verdicts of every proxy run in --work, and stop")
    args = p.parse_args(argv)
    if args.summary:
        print(summary(Path(args.work)))
        return 0
    label = proxy_label(args.num_experts, args.distill_steps, args.merge_clusters)
    if args.record and label != "proxy":
        p.error(f"--record writes the recorded demonstration's section (K={NUM_EXPERTS}, weights not changed)")
    work = Path(args.work).absolute()
    work.mkdir(parents=True, exist_ok=True)
    sys.path[:0] = [str(REPO)]
    from bench.quality.train import trained_checkpoint, training_report

    t_all = time.time()
    original = trained_checkpoint("coarse")
    proxy = build_proxy(original, work, args.num_experts, args.distill_steps, args.merge_clusters)
    ckpts = {"original": original, label: proxy}
    accuracy_file = work / own("accuracy.json", label)
    if not accuracy_file.is_file():
        import torch

        torch.multiprocessing.spawn(
            _accuracy_worker, args=(list(map(list, ckpts.items())), str(accuracy_file)), nprocs=1, join=True
        )
    from concurrent.futures import ThreadPoolExecutor

    runs = [(label if model == "proxy" else model, fault) for model, fault in RUNS]
    with ThreadPoolExecutor(args.jobs) as pool:  # each run is its own process
        futures = {
            run_name(m, f): pool.submit(grpo_run, ckpts[m], work / "runs" / run_name(m, f), f, args.steps)
            for m, f in runs
        }
        seconds = {name: future.result() for name, future in futures.items()}
    verdicts: dict = {}
    for pair, (orig_fault, proxy_fault, expected, metrics, wider) in PAIRS.items():
        runs = (
            "--orig-base",
            work / "runs/original-baseline/tb",  # TensorBoard for the original,
            "--orig-fault",
            work / f"runs/original-{orig_fault}/tb",
            "--proxy-base",
            work / f"runs/{label}-baseline/metrics.jsonl",  # JSONL for the proxy
            "--proxy-fault",
            work / f"runs/{label}-{proxy_fault}/metrics.jsonl",
        )
        verdicts[pair] = {
            "faults": [FAULTS[orig_fault], FAULTS[proxy_fault]],
            "metrics": list(metrics),
            "expected_consistent": expected,
        }
        for key, names in (("paper", metrics), ("chosen", wider), ("all", ALL_METRICS)):
            report = work / own("compare", label) / f"{pair}-{key}"
            shutil.rmtree(report, ignore_errors=True)
            report.parent.mkdir(exist_ok=True)
            proc = cli("compare", *runs, "--metrics", *names, "-o", report)
            print(proc.stdout, proc.stderr, flush=True)
            verdicts[pair][key] = {
                "exit": proc.returncode,
                "metrics": list(names),
                "table": proc.stdout.strip().split("\nreport:")[0],
            }
        verdicts[pair]["as_expected"] = (verdicts[pair]["paper"]["exit"] == 0) == expected
    results = {
        "original": str(original),
        "proxy": str(proxy),
        "num_experts": [16, args.num_experts],
        "distill_steps": args.distill_steps,
        "merged_clusters": args.merge_clusters,
        "training": {k: training_report("coarse")[k] for k in ("train_seconds", "accuracy")},
        "test_accuracy_greedy": json.loads(accuracy_file.read_text()),
        "steps": args.steps,
        "run_seconds": seconds,
        "per_step": {name: per_step(work / "runs" / name) for name in seconds},
        "verdicts": verdicts,
        "total_seconds": time.time() - t_all,
        "load_average": os.getloadavg(),
        "command": "nice -n 10 python examples/rl_faults/run.py " + " ".join(argv or sys.argv[1:]),
    }
    (work / own("results.json", label)).write_text(json.dumps(results, indent=1))
    if args.record:
        record(work, results)
    ok = all(v["as_expected"] for v in verdicts.values())
    print(
        "demonstration",
        "as expected" if ok else "NOT as expected",
        {k: v["paper"]["exit"] for k, v in verdicts.items()},
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
