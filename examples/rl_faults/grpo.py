"""A GRPO-style RL trainer in miniature, on CPU: a megatron-core MoE GPT learns the word problems of
bench/quality (exactly verifiable answers) from its own sampled answers.

It knows nothing about fault injection: faults come from the launch environment only
(`PYTHONPATH=<repo>/patches MCORE_PROXY_FAULTS=...`, see run.py). Like a real RL framework it marks
its rollout phase (`mcore_proxy.faults.rollout()`, a no-op without faults) so that a rollout-precision
fault acts on generation only, and it takes one optimizer step per RL step, so the faults' step
clock is the RL step.

Per step: 32 problems of a 64-problem RL training set (the first training-split problems; the same
draw in every run, from --seed and the step), 4 sampled answers each (temperature 1, sampling noise drawn from its own
seeded generator, so two
runs differ only by what a fault changes); reward 1 for an exact answer; group-normalised
advantages; one PPO-clip update (eps 0.2) on the rollout's log-probabilities with a k3 KL penalty
to the frozen initial model. Logs verl's metric names to TensorBoard (`--out/tb`) and to JSONL
(`--out/metrics.jsonl`, verl's `{"step": N, "data": {...}}`), with the wall time and peak RSS of
every step.

    python examples/rl_faults/grpo.py --ckpt CKPT --out DIR [--steps 60]
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import time
from pathlib import Path

import torch


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ckpt", required=True, help="Megatron legacy checkpoint (TP=PP=EP=1) of the policy")
    p.add_argument("--out", required=True, help="folder for tb/ and metrics.jsonl")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument(
        "--dataset",
        type=int,
        default=64,
        help="size of the RL training set: the first N training-split problems, seen again every "
        "N / --prompts steps (0: the whole split)",
    )
    p.add_argument("--prompts", type=int, default=32, help="problems per step")
    p.add_argument("--samples", type=int, default=4, help="answers sampled per problem (group)")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--kl-coef", type=float, default=0.05)
    p.add_argument("--clip", type=float, default=0.2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    return p.parse_args(argv)


@torch.no_grad()
def rollout(gpt, problems, samples: int, generator: torch.Generator):
    """Sample answers. Returns (tokens [n, s], prompt lengths [n], response mask [n, s] marking the
    response tokens' positions, rollout log-probs [n, s] at those positions, rewards [n], lengths [n])."""
    from bench.quality import model as qmodel
    from bench.quality import task

    from mcore_proxy.faults import rollout as rollout_phase

    group = [p for p in problems for _ in range(samples)]
    tokens, lengths = task.prompts(group)
    n = len(group)
    rows = torch.arange(n)
    start = lengths.clone()
    response = torch.zeros_like(tokens, dtype=torch.bool)
    logp = torch.zeros(tokens.shape)
    done = torch.zeros(n, dtype=torch.bool)
    width = int(lengths.max()) + task.MAX_ANSWER
    with rollout_phase():
        for _ in range(task.MAX_ANSWER):
            logits = qmodel.logits(gpt, tokens[:, :width])[rows, lengths - 1].float()
            log_probs = torch.log_softmax(logits, dim=-1)
            nxt = torch.multinomial(log_probs.exp(), 1, generator=generator).squeeze(1)
            live = ~done
            tokens[rows[live], lengths[live]] = nxt[live]
            response[rows[live], lengths[live]] = True
            logp[rows[live], lengths[live]] = log_probs[rows[live], nxt[live]]
            lengths = torch.where(live, lengths + 1, lengths)
            done |= nxt == task.VOCAB["."]
            if done.all():
                break
    answers = [task.decode(tokens[i, start[i] : lengths[i]]) for i in range(n)]
    rewards = torch.tensor([float(a == p.answer + ".") for a, p in zip(answers, group)])
    return tokens[:, :width], response[:, :width], logp[:, :width], rewards, (lengths - start).float()


def token_logprobs(gpt, tokens, response):
    """Log-probs [n, s] of each token given the ones before it (0 where not a response token),
    and the entropy [n, s] of the distribution it was drawn from."""
    from bench.quality import model as qmodel

    logits = qmodel.logits(gpt, tokens).float()
    # the token at position t is predicted at position t - 1
    log_probs = torch.log_softmax(logits[:, :-1], dim=-1)
    picked = log_probs.gather(2, tokens[:, 1:, None]).squeeze(2)
    entropy = -(log_probs.exp() * log_probs).sum(-1)
    pad = torch.zeros(tokens.shape[0], 1)
    return torch.cat([pad, picked], 1) * response, torch.cat([pad, entropy], 1) * response


def grpo_step(gpt, ref, optimizer, batch, args) -> dict:
    tokens, response, old_logp, rewards, lengths = batch
    g = rewards.view(-1, args.samples)
    adv = ((g - g.mean(1, keepdim=True)) / (g.std(1, keepdim=True) + 1e-6)).view(-1, 1)
    mask = response.float()
    count = mask.sum()
    logp, entropy = token_logprobs(gpt, tokens, response)
    with torch.no_grad():
        ref_logp, _ = token_logprobs(ref, tokens, response)
    ratio = torch.exp((logp - old_logp) * mask)
    clipped = torch.clamp(ratio, 1 - args.clip, 1 + args.clip)
    pg = -torch.minimum(ratio * adv, clipped * adv)
    log_ratio_ref = (ref_logp - logp) * mask
    kl = torch.exp(log_ratio_ref) - log_ratio_ref - 1  # k3 (verl's low_var_kl)
    loss = ((pg + args.kl_coef * kl) * mask).sum() / count
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(gpt.parameters(), 1.0)
    optimizer.step()
    masked = lambda x: float((x * mask).sum() / count)  # noqa: E731
    return {
        "critic/score/mean": float(rewards.mean()),
        "actor/pg_loss": float((pg * mask).sum() / count),
        "actor/kl_loss": masked(kl.detach()),
        "actor/ppo_kl": masked((old_logp - logp).detach()),
        "actor/entropy": masked(entropy.detach()),
        "actor/grad_norm": float(grad_norm),
        "actor/pg_clipfrac": masked(((ratio - clipped).abs() > 0).float()),
        "training/rollout_logprob_diff_mean": masked((old_logp - logp).detach().abs()),
        "response_length/mean": float(lengths.mean()),
    }


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    from bench.quality import model as qmodel
    from bench.quality import task
    from torch.utils.tensorboard import SummaryWriter

    from mcore_proxy.functional.cpu import destroy_distributed, free_port, init_distributed

    init_distributed(0, 1, free_port(), seed=args.seed)
    try:
        _, gpt = qmodel.load(args.ckpt)
        _, ref = qmodel.load(args.ckpt)
        gpt.train()
        optimizer = torch.optim.AdamW(gpt.parameters(), lr=args.lr, weight_decay=0.0)
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        writer = SummaryWriter(str(out / "tb"))
        # prompts that leave room for the longest answer within the model's sequence length
        train = [p for p in task.split("train") if len(p.prompt) + 1 + task.MAX_ANSWER <= task.SEQ_LENGTH]
        train = train[: args.dataset] if args.dataset else train
        with open(out / "metrics.jsonl", "w") as jsonl:
            for step in range(args.steps):
                t0 = time.perf_counter()
                problems = random.Random(args.seed * 100_003 + step).sample(train, args.prompts)
                generator = torch.Generator().manual_seed(args.seed * 100_003 + step)
                batch = rollout(gpt, problems, args.samples, generator)
                metrics = grpo_step(gpt, ref, optimizer, batch, args)
                metrics["perf/step_seconds"] = time.perf_counter() - t0
                metrics["perf/max_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
                jsonl.write(json.dumps({"step": step, "data": metrics}) + "\n")
                jsonl.flush()
                for key, value in metrics.items():
                    writer.add_scalar(key, value, step)
                print(
                    f"step {step} reward {metrics['critic/score/mean']:.3f} "
                    f"kl {metrics['actor/kl_loss']:.5f} diff "
                    f"{metrics['training/rollout_logprob_diff_mean']:.5f} "
                    f"({metrics['perf/step_seconds']:.2f} s)",
                    flush=True,
                )
        writer.close()
    finally:
        destroy_distributed()


if __name__ == "__main__":
    main()
