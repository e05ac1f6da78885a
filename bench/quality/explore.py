"""Issue 24's exploration: what may lift a proxy at aggressive K, measured before it is built into the tool.

    nice python -m bench.quality.explore --shape fine --k 16 [--topks 2 4] [--work DIR]

On the trained model of `--shape` (bench/quality/train.py), the paper's selection at K
(`mcore-proxy select` + `convert`, as in ablate.py), then variants of the same proxy, each measured on
the test split by `metrics.compare` (accuracy ± binomial standard error, KL, routing agreement, gate mass
kept):

- `proxy top-k N`: the same experts, N per token (`select --proxy-topk N`, built into the tool);
- `router refit`: the kept experts' router rows refitted (Adam, full batch) on the router inputs of
  calibration problems so that each token's gates approximate the original's gate mass summed per
  cluster (a dropped expert's share goes to its cluster's kept expert); expert weights untouched
  (`--no-refit` leaves it out: it is the slowest);
- `frequency-weighted merge`: each kept expert := its cluster's members' mean weighted by their
  routed-selection counts (the rule of `convert --merge-clusters`, here applied in memory as the
  control of the next two);
- `..., neurons aligned`: each member's F hidden neurons permuted to match the kept expert's first
  (Hungarian matching on the cosine of gate, up and down weights), since averaging experts trained
  apart may blur unaligned neurons;
- `..., router rows merged too`: the kept expert's router row := the same mean of its members' rows.

The distillation explored here first is now `mcore-proxy distill` and the plain merge is `convert
--merge-clusters`, each measured by ablate.py's row of it; the refit, the alignment and the merged router
rows are not in `mcore-proxy`: this script is where they were measured (bench/RESULTS.md). Prints one line
per variant and writes `explore-{shape}-K{k}.json` into the work folder.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import time
from pathlib import Path

import torch

from bench.quality import ablate, metrics, task, train
from bench.quality import model as qmodel


def proxy_of(ckpt: Path, stats: Path, k: int, work: Path, *extra: str):
    """(plan, proxy GPTModel) by `select` (the paper's rule + `extra`) and `convert`."""
    from mcore_proxy.select import load_plan

    plan_path, proxy = work / "plan.json", work / "proxy"
    shutil.rmtree(proxy, ignore_errors=True)
    plan_path.unlink(missing_ok=True)
    ablate.cli("select", "--ckpt", ckpt, "--stats", stats, "-k", k, *ablate.PAPER_ARGV, *extra, "-o", plan_path)
    ablate.cli("convert", ckpt, "--plan", plan_path, "-o", proxy)
    return load_plan(plan_path), qmodel.load(proxy)[1]


@torch.no_grad()
def router_inputs(gpt, problems) -> dict[str, torch.Tensor]:
    """Layer id -> the router's inputs at text positions [n, H] over `problems`."""
    seen: dict[str, list] = {}
    hooks = [
        r.register_forward_pre_hook(lambda m, inp, _l=lid: seen.setdefault(_l, []).append(inp[0].flatten(0, -2)))
        for lid, r in metrics.routers(gpt).items()
    ]
    try:
        for start in range(0, len(problems), 250):
            tokens, _ = task.trim(*task.batch(problems[start : start + 250]))
            text = (tokens != task.PAD).T.reshape(-1)
            qmodel.logits(gpt, tokens)
            for parts in seen.values():
                parts[-1] = parts[-1][text]
    finally:
        for h in hooks:
            h.remove()
    return {lid: torch.cat(parts).float() for lid, parts in seen.items()}


def refit_routers(gpt, proxy, plan, inputs: dict[str, torch.Tensor], topk: int, steps: int = 300) -> None:
    """Refit the proxy's router rows in place: softmax(x W'^T) ~ the original's top-k gates summed per
    cluster (cross-entropy with those soft targets), starting from the kept rows."""
    originals, proxies = metrics.routers(gpt), metrics.routers(proxy)
    for lid in plan.layer_ids:
        w, x, kept = originals[lid].weight.detach().float(), inputs[lid], plan.kept(lid)
        with torch.no_grad():
            top = (x @ w.T).topk(topk, -1)
            gates = torch.zeros(x.shape[0], w.shape[0]).scatter(-1, top.indices, torch.softmax(top.values, -1))
            to_cluster = torch.zeros(w.shape[0], len(kept))
            for c in plan.layers[lid].clusters:
                to_cluster[list(c.members), kept.index(c.representative)] = 1.0
            target = gates @ to_cluster  # [n, K]
        rows = w[kept].clone().requires_grad_(True)
        opt = torch.optim.Adam([rows], lr=1e-2)
        for _ in range(steps):
            loss = -(target * torch.log_softmax(x @ rows.T, -1)).sum(-1).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        with torch.no_grad():
            proxies[lid].weight.copy_(rows.to(proxies[lid].weight.dtype))


def experts_of(gpt) -> dict[str, list]:
    """Layer id -> its SequentialMLP's local experts (linear_fc1 [2F, H] gate;up, linear_fc2 [H, F])."""
    out = {}
    for lid, router in metrics.routers(gpt).items():
        layer = gpt.decoder.layers[int(lid)]
        out[lid] = list(layer.mlp.experts.local_experts)
    return out


def align(rep, member) -> torch.Tensor:
    """The permutation p of `member`'s F hidden neurons that best matches `rep`'s (Hungarian on the
    cosine of each neuron's gate, up and down weights): member neuron p[i] plays rep's neuron i."""
    from scipy.optimize import linear_sum_assignment

    def features(e):
        w1, w2 = e.linear_fc1.weight.detach().float(), e.linear_fc2.weight.detach().float()
        f = w2.shape[1]
        feats = torch.cat([w1[:f], w1[f:], w2.T], 1)  # [F, 3H]
        return torch.nn.functional.normalize(feats, dim=1)

    sim = features(rep) @ features(member).T  # [F, F]
    rows, cols = linear_sum_assignment(-sim.numpy())
    return torch.as_tensor(cols)[torch.as_tensor(rows).argsort()]


@torch.no_grad()
def merge_clusters(gpt, proxy, plan, freq: dict, aligned: bool, router: bool = False) -> None:
    """Each kept expert of `proxy` := the frequency-weighted mean of its cluster's members in `gpt`
    (with `router`, its router row too)."""
    originals, proxies = experts_of(gpt), experts_of(proxy)
    orouters, prouters = metrics.routers(gpt), metrics.routers(proxy)
    for lid in plan.layer_ids:
        kept = plan.kept(lid)
        for c in plan.layers[lid].clusters:
            w = torch.tensor([float(freq[lid][m]) for m in c.members])
            w = w / w.sum() if w.sum() > 0 else torch.full_like(w, 1 / len(w))
            rep = originals[lid][c.representative]
            f = rep.linear_fc2.weight.shape[1]
            fc1 = torch.zeros_like(rep.linear_fc1.weight)
            fc2 = torch.zeros_like(rep.linear_fc2.weight)
            for wm, m in zip(w, c.members):
                e = originals[lid][m]
                p = align(rep, e) if aligned and m != c.representative else torch.arange(f)
                w1 = e.linear_fc1.weight
                fc1 += wm * torch.cat([w1[:f][p], w1[f:][p]])
                fc2 += wm * e.linear_fc2.weight[:, p]
            target = proxies[lid][kept.index(c.representative)]
            target.linear_fc1.weight.copy_(fc1)
            target.linear_fc2.weight.copy_(fc2)
            if router:
                rows = orouters[lid].weight[list(c.members)]
                prouters[lid].weight[kept.index(c.representative)] = (w[:, None] * rows).sum(0)


def summary(r: dict) -> dict:
    """Per-layer measures as their mean over layers (kept per layer under `layers`)."""
    out = {k: v for k, v in r.items() if not isinstance(v, dict)}
    for name in ("routing_agreement", "gate_mass_kept"):
        out[name] = sum(r[name].values()) / len(r[name])
    out["layers"] = {name: r[name] for name in ("routing_agreement", "gate_mass_kept")}
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=tuple(qmodel.SHAPES), default="fine")
    p.add_argument("--k", type=int, required=True)
    p.add_argument("--topks", type=int, nargs="*", default=None, help="proxy top-k values to try (default 2, 4)")
    p.add_argument("--no-refit", action="store_true", help="leave out the router refit (the slowest variant)")
    p.add_argument("--work", type=Path, default=None, help="scratch folder (default: the cache)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    os.environ.setdefault("TQDM_DISABLE", "1")
    from mcore_proxy.functional.cpu import destroy_distributed, free_port, init_distributed

    ckpt = train.trained_checkpoint(args.shape)
    work = args.work or train.cache_root() / "explore" / args.shape
    work.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    init_distributed(0, 1, free_port())
    results = {}
    try:
        model, gpt = qmodel.load(ckpt)
        test, calib = task.split("test"), task.split("train")[: ablate.CALIB_PROBLEMS]
        stats = ablate.trace(gpt, calib, work / "trace_train")
        ref = metrics.reference(gpt, test)
        print(f"{args.shape}: original exact match {ref.accuracy:.3f}; K={args.k} of {model.num_experts}", flush=True)

        def record(name, plan, proxy, t0, **extra):
            results[name] = {**summary(metrics.compare(proxy, test, ref, plan)), **extra, "seconds": time.time() - t0}
            r = results[name]
            print(
                f"| {name} | {r['accuracy']:.3f} ± {r['accuracy_se']:.3f} | {r['kl']:.3f} | "
                f"{r['routing_agreement']:.3f} | {r['gate_mass_kept']:.3f} | {r['seconds']:.0f} |",
                flush=True,
            )
            (work / f"explore-{args.shape}-K{args.k}.json").write_text(json.dumps(results, indent=1))

        print("| variant | acc ± se | KL | agreement | gate mass kept | s |\n|---|---|---|---|---|---|", flush=True)
        t0 = time.time()
        plan, proxy = proxy_of(ckpt, stats, args.k, work)
        record("paper's selection", plan, proxy, t0)
        for n in args.topks if args.topks is not None else (2, 4):
            t0 = time.time()
            plan_n, proxy_n = proxy_of(ckpt, stats, args.k, work, "--proxy-topk", str(n))
            record(f"proxy top-k {n}", plan_n, proxy_n, t0)
        if not args.no_refit:
            t0 = time.time()
            plan, proxy = proxy_of(ckpt, stats, args.k, work)
            refit_routers(gpt, proxy, plan, router_inputs(gpt, calib), model.topk)
            record("router refit (weights of the experts untouched)", plan, proxy, t0)
        from mcore_proxy.core.stats import load_stats

        loaded = load_stats(stats)
        freq = {lid: loaded.layers[lid].freq for lid in loaded.layer_ids}
        for aligned, router in ((False, False), (True, False), (False, True)):
            t0 = time.time()
            plan, proxy = proxy_of(ckpt, stats, args.k, work)
            merge_clusters(gpt, proxy, plan, freq, aligned, router)
            label = ", neurons aligned" if aligned else ", router rows merged too" if router else ""
            record(f"frequency-weighted merge{label}", plan, proxy, t0)
    finally:
        destroy_distributed()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
