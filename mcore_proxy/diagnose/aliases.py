"""One table of metric names across RL frameworks: canonical name -> the names logs use for it.

Names are matched after `normalise` (lower case, spaces and dashes as underscores), in table
order: the first name a run has wins (verl logs both `critic/score/mean` and
`critic/rewards/mean`; the score, before KL or length penalties, is the reward of a verifiable task).

Sources (docs/logs.md has the table):
- verl (0.9 source: `compute_data_metrics`, the actor's `append_to_dict`, `rollout_corr_helper`):
  `critic/score/mean`, `critic/rewards/mean`, `actor/kl_loss`, `actor/ppo_kl`, `actor/entropy`,
  `actor/grad_norm`, `actor/pg_loss`, `actor/pg_clipfrac`, `training/rollout_probs_diff_mean`,
  `rollout_corr/log_ppl_abs_diff`, `rollout_corr/k3_kl`, `rollout_corr/kl`, `response_length/mean`;
- MindSpeed-RL (docs/zh/features/log_metrics.md and its trainers): `grpo/score/mean`,
  `grpo/rewards/mean`, `critic/score/mean`, `actor/kl_loss`, `actor/ppo_kl`, `actor/entropy`,
  `actor/pg_loss`, `actor/pg_clipfrac`, `grad_norm` (its docs) / `actor/grad_norm` (its code),
  `response_length/mean`; its `timing/*`, `*_tps`, `actor/lr` are read but not aliased;
- TRL's GRPOTrainer (1.x `_metrics`): `reward`, `kl`, `entropy`, `completions/mean_length`,
  `clip_ratio/region_mean`, `policy_loss`, `sampling/sampling_logp_difference/mean`, and the
  Trainer's `grad_norm`; written to TensorBoard under `train/`;
- Megatron's console and TensorBoard (`grad norm`, `grad-norm`);
- this project's routing consistency (`routing/decision_disagreement`, `routing/tokens_any_layer`).
"""

from __future__ import annotations

ALIASES: dict[str, tuple[str, ...]] = {
    "reward": (
        "critic/score/mean",
        "grpo/score/mean",
        "critic/rewards/mean",
        "grpo/rewards/mean",
        "rewards/mean",
        "reward/mean",
        "reward",
        "train/reward",
        "score/mean",
        "score",
    ),
    "kl_loss": ("actor/kl_loss", "kl_loss", "train/kl_loss", "kl", "train/kl"),
    "ppo_kl": ("actor/ppo_kl", "ppo_kl", "actor/approx_kl", "approx_kl"),
    "entropy": ("actor/entropy", "actor/entropy_loss", "entropy", "train/entropy"),
    "grad_norm": ("actor/grad_norm", "grad_norm", "train/grad_norm"),
    "logprob_diff": (
        "training/rollout_probs_diff_mean",
        "training/rollout_logprob_diff_mean",
        "rollout/logprob_diff",
        "logprob_diff",
        "rollout_logprob_diff",
        "sampling/sampling_logp_difference/mean",
        "train/sampling/sampling_logp_difference/mean",
        "rollout_corr/log_ppl_abs_diff",
    ),
    # k3 first: non-negative per token, so its mean is a low-noise KL estimate (k1 can go negative)
    "rollout_kl": (
        "rollout_corr/k3_kl",
        "train/rollout_corr/k3_kl",
        "rollout_corr/kl",
        "train/rollout_corr/kl",
        "rollout_kl",
    ),
    "response_length": (
        "response_length/mean",
        "completions/mean_length",
        "train/completions/mean_length",
        "response_length",
    ),
    "clipfrac": (
        "actor/pg_clipfrac",
        "pg_clipfrac",
        "clipfrac",
        "clip_ratio/region_mean",
        "train/clip_ratio/region_mean",
    ),
    "pg_loss": ("actor/pg_loss", "pg_loss", "policy_loss", "train/policy_loss"),
    # routing consistency between the rollout engine and the trainer, as `mcore-proxy consistency`
    # measures it and examples/rl_vllm logs it (no framework logs it under a common name yet)
    "routing_disagreement": ("routing/decision_disagreement", "routing_disagreement"),
    "routing_token_disagreement": ("routing/tokens_any_layer", "routing_token_disagreement"),
}

DESCRIPTIONS = {
    "reward": "mean reward (score) of the rollouts",
    "kl_loss": "KL loss to the reference policy",
    "ppo_kl": "approximate KL between the rollout and the updated policy (PPO KL)",
    "entropy": "policy entropy",
    "grad_norm": "gradient norm of the actor",
    "logprob_diff": "rollout-vs-training log-probability difference",
    "rollout_kl": "KL between the rollout and the training policy on the rollout's tokens",
    "response_length": "mean response length (tokens)",
    "clipfrac": "fraction of clipped PPO ratios",
    "pg_loss": "policy-gradient loss",
    "routing_disagreement": "share of router decisions (token x top-k slot) the two engines make differently",
    "routing_token_disagreement": "share of tokens routed differently in at least one MoE layer by the two engines",
}


def normalise(name: str) -> str:
    return name.strip().lower().replace(" ", "_").replace("-", "_")


_LOOKUP = {
    normalise(alias): (canonical, rank) for canonical, names in ALIASES.items() for rank, alias in enumerate(names)
}


def canonical_metrics(raw_names) -> dict[str, str]:
    """canonical name -> the raw name of this run that provides it (best-ranked alias)."""
    best: dict[str, tuple[int, str]] = {}
    for raw in raw_names:
        hit = _LOOKUP.get(normalise(raw))
        if hit is not None and (hit[0] not in best or hit[1] < best[hit[0]][0]):
            best[hit[0]] = (hit[1], raw)
    return {canonical: raw for canonical, (_, raw) in best.items()}


def resolve(name: str, raw_names) -> str | None:
    """A requested metric (canonical or raw) -> the raw name this run logs it under."""
    raw_names = list(raw_names)
    if name in ALIASES:
        return canonical_metrics(raw_names).get(name)
    wanted = normalise(name)
    return next((raw for raw in raw_names if normalise(raw) == wanted), None)
