"""GRPO with TRL's `GRPOTrainer` on CPU: a Hugging Face MoE learns bench/quality's word problems from
its own sampled answers, rewarded by exact match (the verifiable reward).

It knows nothing about fault injection: faults reach it only through the launch environment
(`PYTHONPATH=<repo>/patches MCORE_PROXY_FAULTS=...`), whose injectors attach to what TRL builds:
the policy's and the reference model's MoE routers and experts and their `lm_head`s
(transformers' `PreTrainedModel.post_init`), the AdamW behind accelerate's `AcceleratedOptimizer`
(torch's global optimizer step hooks; the fault clock is the optimizer step, which is TRL's
`global_step` - 1 while it is taken), and TRL's rollout (`model.generate`, a rollout pass for
`logprob_precision:when=rollout`; every pass under `torch.no_grad()`, which in TRL is generation
and the reference model's log-probs, for `when=no_grad`).

One thing is added to TRL, and only as measurement (the loss is TRL's): the rollout's own
log-probabilities. TRL's transformers generation path keeps none (only its vLLM path does), so
`RolloutLogprobGRPOTrainer` asks `generate` for the logits of the tokens it sampled
(`output_logits=True`; the raw logits divided by the sampling temperature, as TRL's loss scales
them), hands them to TRL as the rollout log-probs (`sampling_per_token_logps`, which TRL carries
through its batch), and when TRL computes the training log-probs (with autograd, in
`_compute_loss`) logs per step the mean and max absolute difference of the two over the
completion tokens, under TRL's own names for it, `sampling/sampling_logp_difference/mean|max`
(`mcore-proxy compare` reads the mean as `logprob_diff`), and the KL between the rollout and the
training policy on the rollout's tokens under verl's names (its rollout-correction metrics):
`rollout_corr/kl` = mean(log pi_rollout - log pi_train) and `rollout_corr/k3_kl` = mean(e^r - r - 1),
r = log pi_train - log pi_rollout (`rollout_kl` in compare; the training-inference mismatch a
rollout precision fault raises, unlike TRL's `kl` to the reference model, which it moves only at
second order under the policy's own drift).

Logging, every optimizer step (one generation and one optimizer step per GRPO step):
TRL's `log_history` in `OUT/trainer_state.json` (rewritten after every log, atomically, so
`mcore-proxy watch` can follow it; TRL itself writes it with checkpoints only), TensorBoard in
`OUT/tb` (`--report-to tensorboard`), and `OUT/metrics.jsonl` (`{"step": N, "data": {...}}`),
with `perf/step_seconds` and `perf/max_rss_mib` (peak resident memory of the process so far).

    python examples/rl_faults_trl/train_grpo.py --model MODEL_DIR --out RUN_DIR [--steps 40]
    accelerate launch --num_processes 1 --cpu examples/rl_faults_trl/train_grpo.py ...
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import task_hf  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="Hugging Face folder of the policy (and reference)")
    p.add_argument("--out", required=True, help="the run's output folder")
    p.add_argument("--steps", type=int, default=40, help="GRPO steps (= optimizer steps)")
    p.add_argument("--dataset", type=int, default=64, help="RL training set: the first N training problems")
    p.add_argument("--prompts", type=int, default=16, help="problems per step")
    p.add_argument("--samples", type=int, default=4, help="completions per problem (the group)")
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--beta", type=float, default=0.05, help="KL coefficient (> 0: TRL logs `kl`)")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--report-to", default="tensorboard", help="tensorboard | none")
    p.add_argument("--save-model", action="store_true", help="save the trained policy to OUT/final")
    return p.parse_args(argv)


def trainer_class():
    import torch
    from trl import GRPOTrainer

    class RolloutLogprobGRPOTrainer(GRPOTrainer):
        """TRL's GRPOTrainer that also keeps the rollout's log-probs and logs how far the training
        forward pass is from them (see the module docstring). Nothing of the loss changes: TRL uses
        `sampling_per_token_logps` only on its vLLM path or with `off_policy_mask_threshold`."""

        _batch = None
        _step_started = None

        def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
            if self.use_vllm or self.use_transformers_continuous_batching:
                return super()._generate_single_turn(
                    prompt_ids, images, multimodal_fields, num_generations, has_tool_images
                )
            model = self.accelerator.unwrap_model(self.model_wrapped)  # what TRL generates with
            seen = {}
            generate = model.generate

            def generate_with_logits(*args, **kwargs):
                out = generate(*args, **kwargs, output_logits=True, return_dict_in_generate=True)
                seen["sequences"], seen["logits"] = out.sequences, out.logits
                return out.sequences

            model.generate = generate_with_logits
            try:
                completion_ids, logprobs = super()._generate_single_turn(
                    prompt_ids, images, multimodal_fields, num_generations, has_tool_images
                )
            finally:
                del model.generate
            if logprobs is None and seen:
                logits = torch.stack(seen["logits"], 1).float() / self.temperature
                new = seen["sequences"][:, -logits.shape[1] :].to(logits.device)
                picked = torch.log_softmax(logits, -1).gather(-1, new[..., None]).squeeze(-1)
                logprobs = [picked[i, : len(ids)].tolist() for i, ids in enumerate(completion_ids)]
            return completion_ids, logprobs

        def _compute_loss(self, model, inputs):
            self._batch = inputs
            try:
                return super()._compute_loss(model, inputs)
            finally:
                self._batch = None

        def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, *args, **kwargs):
            out = super()._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, logits_to_keep, *args, **kwargs
            )
            batch = self._batch
            if batch is not None and torch.is_grad_enabled() and batch.get("sampling_per_token_logps") is not None:
                mask = batch["completion_mask"].bool()
                # log pi_train - log pi_rollout; float64: e^r - r - 1 ~ r^2/2 cancels to noise in float32
                r = (out[0].detach() - batch["sampling_per_token_logps"])[mask].double()
                gathered = {
                    "sampling/sampling_logp_difference/mean": r.abs().mean(),
                    "rollout_corr/kl": (-r).mean(),
                    "rollout_corr/k3_kl": (torch.expm1(r) - r).mean(),
                }
                for name, value in gathered.items():
                    self._metrics["train"][name].append(self.accelerator.gather(value).mean().item())
                self._metrics["train"]["sampling/sampling_logp_difference/max"].append(
                    self.accelerator.gather(r.abs().max()).max().item()
                )
            return out

        def log(self, logs, start_time=None):
            if self.model.training and "loss" in logs:
                now = time.perf_counter()
                if self._step_started is not None:
                    logs["perf/step_seconds"] = now - self._step_started
                self._step_started = now
                logs["perf/max_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
            return super().log(logs, start_time)

    return RolloutLogprobGRPOTrainer


def log_writer(out: Path):
    """A TrainerCallback writing each log as a JSONL line and `trainer_state.json` (atomically)."""
    from transformers import TrainerCallback

    class LogFiles(TrainerCallback):
        def __init__(self):
            self.jsonl = open(out / "metrics.jsonl", "a")

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                self.jsonl.write(json.dumps({"step": state.global_step, "data": logs}) + "\n")
                self.jsonl.flush()
            tmp = out / "trainer_state.json.tmp"
            state.save_to_json(str(tmp))
            os.replace(tmp, out / "trainer_state.json")

        def on_train_end(self, args, state, control, **kwargs):
            self.jsonl.close()

    return LogFiles()


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    from trl import GRPOConfig

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "metrics.jsonl").unlink(missing_ok=True)
    os.environ["TENSORBOARD_LOGGING_DIR"] = str(out / "tb")
    config = GRPOConfig(
        output_dir=str(out),
        max_steps=args.steps,
        seed=args.seed,
        use_cpu=True,
        per_device_train_batch_size=args.prompts * args.samples,
        num_generations=args.samples,
        gradient_accumulation_steps=1,
        steps_per_generation=1,
        num_iterations=1,
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        beta=args.beta,
        temperature=args.temperature,
        max_completion_length=task_hf.task.MAX_ANSWER,
        logging_steps=1,
        save_strategy="no",
        report_to=[] if args.report_to == "none" else [args.report_to],
        disable_tqdm=True,
        dataloader_num_workers=0,
        bf16=False,
        fp16=False,
        log_completions=False,
        model_init_kwargs={"dtype": torch.float32},
    )
    trainer = trainer_class()(
        model=args.model,
        reward_funcs=task_hf.exact_match_reward,
        args=config,
        train_dataset=task_hf.dataset(task_hf.rl_problems(args.dataset)),
        processing_class=task_hf.tokenizer(),
        callbacks=[log_writer(out)],
    )
    trainer.train()
    trainer.save_state()
    if args.save_model:
        trainer.save_model(str(out / "final"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
