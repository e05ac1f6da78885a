"""Routing consistency between the rollout engine (vLLM) and the trainer (transformers), and the
rollout-training log-prob gap, on the same token sequences.

Each sequence runs whole (one prefill in vLLM, one forward pass in transformers); every token's
top-k expert set is recorded per MoE layer in both engines. Per layer:
- `decision_disagreement`: the share of router decisions (token x top-k slot) that differ,
  1 - |A & B| / k averaged over tokens (what R3, arXiv 2510.11370, counts);
- `token_disagreement`: the share of tokens whose top-k set differs in this layer;
- with a plan, on the original: `kept_share`, the share of the differing experts (A ^ B) that the
  plan keeps: how much of the disagreement a proxy can show at all.
Over all layers: the share of tokens with a differing set in at least one layer. On the outputs:
the mean and largest |rollout - training| log-prob of the next token, and the mean of
rollout - training (the sign of a drift).

Expert ids are each model's own: a proxy's are its kept experts renumbered, and its rates are
compared with the original's layer by layer (`pattern`: Spearman's rank correlation of the
per-layer decision disagreement, and the ratio of the means).
"""

from __future__ import annotations

from pathlib import Path

import torch

from mcore_proxy.core.errors import ProxyError


def decision_disagreement(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Top-k ids a, b [T, k] -> [T] the share of each token's k choices not in the other's set."""
    same = (a.unsqueeze(-1) == b.unsqueeze(-2)).any(-1).sum(-1)
    return 1.0 - same.double() / a.shape[-1]


def differing_experts(a: torch.Tensor, b: torch.Tensor, num_experts: int) -> torch.Tensor:
    """[E] how often each expert is in one engine's set and not the other's (summed over tokens)."""
    one_hot_a = torch.zeros(a.shape[0], num_experts, dtype=torch.bool).scatter_(1, a, True)
    one_hot_b = torch.zeros(b.shape[0], num_experts, dtype=torch.bool).scatter_(1, b, True)
    return (one_hot_a ^ one_hot_b).sum(0)


def average_ranks(values: list[float]) -> torch.Tensor:
    """1-based ranks, ties sharing their mean rank: [3, 1, 3] -> [2.5, 1, 2.5]."""
    v = torch.tensor(values, dtype=torch.float64)
    below = (v[None, :] < v[:, None]).sum(1)
    tied = (v[None, :] == v[:, None]).sum(1)
    return below + (tied + 1) / 2


def spearman(x: list[float], y: list[float]) -> float | None:
    """Rank correlation (average ranks for ties); None when either side is constant."""
    if len(x) < 2:
        return None
    rx, ry = average_ranks(x), average_ranks(y)
    if rx.std() == 0 or ry.std() == 0:
        return None
    return float(torch.corrcoef(torch.stack([rx, ry]))[0, 1])


def trainer_pass(model_dir: Path, sequences: list[list[int]], dtype: str) -> tuple[list[torch.Tensor], dict]:
    """transformers on each sequence: (log-probs per sequence [len - 1], layer -> top-k ids [T, k]).
    dtype: fp32, bf16, or fp64 (a reference the fp32 passes of both engines can be held to)."""
    from mcore_proxy.hf.models import load_model, routed_run

    model = load_model(model_dir)
    if dtype in ("bf16", "fp64"):
        model = model.to(torch.bfloat16 if dtype == "bf16" else torch.float64)
    if dtype == "fp64" and hasattr(model, "set_experts_implementation"):
        model.set_experts_implementation("eager")  # the grouped-matmul kernel refuses float64
    chosen: dict[str, list[torch.Tensor]] = {}
    logprobs = []
    for ids in sequences:
        tokens = torch.tensor([ids])
        logits, seen = routed_run(model, tokens)
        logprobs.append(torch.log_softmax(logits[0, :-1].double(), -1).gather(-1, tokens[0, 1:, None])[:, 0].float())
        for layer, experts in seen.items():
            chosen.setdefault(layer, []).append(experts)
    return logprobs, {layer: torch.cat(parts).long() for layer, parts in chosen.items()}


def disagreement_by_layer(rollout_topk: dict, training_topk: dict) -> dict[str, torch.Tensor]:
    """layer -> [T] `decision_disagreement` of each token, from both engines' top-k ids [T, k] of
    the same tokens (the rollout engine's layers, in its order); refuses layers the two disagree on
    in shape, which means the engines built different models."""
    out = {}
    for layer, rollout_ids in rollout_topk.items():
        train_ids = training_topk.get(layer)
        if train_ids is None or train_ids.shape != rollout_ids.shape:
            raise ProxyError(
                f"layer {layer}: the rollout engine routed {tuple(rollout_ids.shape)} choices, the trainer "
                f"{None if train_ids is None else tuple(train_ids.shape)}; the two engines built different models"
            )
        out[layer] = decision_disagreement(rollout_ids.long(), train_ids.long())
    return out


def tokens_any_layer(shares: dict[str, torch.Tensor]) -> float:
    """The share of tokens whose top-k set differs in at least one layer (0 without layers)."""
    if not shares:
        return 0.0
    return float(torch.stack([share > 0 for share in shares.values()]).any(0).double().mean())


def measure_model(rollout, training_logprobs, training_topk, kept: dict[str, torch.Tensor] | None) -> dict:
    """The report of one model from the rollout engine's result and the trainer's."""
    shares = disagreement_by_layer(rollout.topk, training_topk)
    layers = []
    for layer, share in shares.items():
        row = {
            "layer": layer,
            "decision_disagreement": float(share.mean()),
            "token_disagreement": float((share > 0).double().mean()),
        }
        if kept is not None and layer in kept:
            counts = differing_experts(rollout.topk[layer], training_topk[layer], kept[layer].numel())
            total = int(counts.sum())
            row["kept_share"] = float(counts[kept[layer]].sum()) / total if total else None
        layers.append(row)
    gap = torch.cat([r - t for r, t in zip(rollout.logprobs, training_logprobs)]).double()
    return {
        "tokens": int(rollout.topk[next(iter(rollout.topk))].shape[0]) if rollout.topk else 0,
        "layers": layers,
        "decision_disagreement": sum(r["decision_disagreement"] for r in layers) / max(len(layers), 1),
        "tokens_any_layer": tokens_any_layer(shares),
        "logprob_gap_mean": float(gap.mean()),
        "logprob_gap_abs_mean": float(gap.abs().mean()),
        "logprob_gap_abs_max": float(gap.abs().max()),
        "engine": rollout.facts,
    }


def pattern(orig: dict, proxy: dict) -> dict:
    """How the proxy's per-layer disagreement follows the original's."""
    common = [r["layer"] for r in orig["layers"] if r["layer"] in {p["layer"] for p in proxy["layers"]}]
    by_o = {r["layer"]: r["decision_disagreement"] for r in orig["layers"]}
    by_p = {r["layer"]: r["decision_disagreement"] for r in proxy["layers"]}
    mean_o = sum(by_o[layer] for layer in common) / max(len(common), 1)
    mean_p = sum(by_p[layer] for layer in common) / max(len(common), 1)
    return {
        "layers": common,
        "spearman": spearman([by_o[layer] for layer in common], [by_p[layer] for layer in common]),
        "rate_ratio": mean_p / mean_o if mean_o > 0 else None,
    }


def kept_experts(plan, num_experts: int) -> dict[str, torch.Tensor]:
    """layer id -> [E] bool of the experts the plan keeps."""
    out = {}
    for layer, layer_plan in plan.layers.items():
        mask = torch.zeros(num_experts, dtype=torch.bool)
        mask[list(layer_plan.kept)] = True
        out[str(layer)] = mask
    return out


def read_sequences(data: Path, model_dir: Path, max_sequences: int, max_length: int) -> list[list[int]]:
    """Up to `max_sequences` windows of at most `max_length` tokens of the JSONL `data` (as
    `collect` reads it, with the model's tokenizer); windows of one token have no log-prob."""
    from mcore_proxy.checkpoint.formats import open_checkpoint
    from mcore_proxy.hf.calibration import load_tokenizer, token_ids, windows
    from mcore_proxy.hf.models import vocab_size

    vocab = vocab_size(open_checkpoint(model_dir))
    out: list[list[int]] = []
    for ids in token_ids(Path(data), lambda: load_tokenizer(model_dir), vocab):
        out += [w for w in windows(ids, max_length) if len(w) >= 2]
        if len(out) >= max_sequences:
            break
    if not out:
        raise ProxyError(f"{data}: holds no sequence of two tokens or more; give longer records")
    return out[:max_sequences]


def measure(
    orig: Path,
    data: Path,
    *,
    proxy: Path | None = None,
    plan: Path | None = None,
    dtype: str = "fp32",
    faults: str | None = None,
    python=None,
    max_sequences: int = 32,
    max_length: int = 128,
) -> dict:
    """The report of `mcore-proxy consistency` (see the module docstring)."""
    from mcore_proxy.rollout.run import run_engine
    from mcore_proxy.select.plan import load_plan

    sequences = read_sequences(data, orig, max_sequences, max_length)
    models = {"original": Path(orig), **({"proxy": Path(proxy)} if proxy is not None else {})}
    rollout = run_engine(models, sequences, dtype=dtype, faults=faults, python=python)
    loaded_plan = load_plan(plan) if plan is not None else None
    report: dict = {
        "dtype": dtype,
        "rollout_faults": faults or "",
        "sequences": len(sequences),
        "models": {},
    }
    for name, path in models.items():
        logprobs, topk = trainer_pass(path, sequences, dtype)
        result = rollout[name]
        kept = None
        if loaded_plan is not None and name == "original":
            kept = kept_experts(loaded_plan, max(result.facts["experts"].values()))
        report["models"][name] = {"path": str(path), **measure_model(result, logprobs, topk, kept)}
    if proxy is not None:
        report["pattern"] = pattern(report["models"]["original"], report["models"]["proxy"])
    return report
