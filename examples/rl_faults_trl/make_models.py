"""The original and its proxy for the TRL demonstration, both Hugging Face folders.

1. original: a tiny Qwen3-MoE (task_hf.SHAPE: 4 layers, top-2 of 16 experts) trained here by
   supervised fine-tuning on bench/quality's word problems (loss on the answer characters, the
   routers' load-balancing loss on), a few minutes on one CPU thread; saved with its tokenizer
   by `save_pretrained`, with `train.json` (settings, seconds, greedy exact match);
2. proxy: this project's Hugging Face pipeline, as a user runs it:
       mcore-proxy collect --hf ORIG --data calibration.jsonl -o stats
       mcore-proxy select --ckpt ORIG --stats stats/routing_stats.safetensors --num-experts K -o plan.json
       mcore-proxy convert ORIG --plan plan.json -o proxy

    python examples/rl_faults_trl/make_models.py [--work out/rl_faults_trl] [--num-experts 8]

Both are cached in the work folder: a finished original (`original/train.json`) is not trained
again, a finished proxy (`proxy/manifest.json`) not rebuilt.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import task_hf  # noqa: E402
from task_hf import REPO, task  # noqa: E402

STEPS, BATCH, LR, MIN_LR, WARMUP = 1800, 64, 2e-3, 1e-4, 100


def lr_at(step: int, steps: int) -> float:
    if step < WARMUP:
        return LR * (step + 1) / WARMUP
    t = (step - WARMUP) / max(1, steps - WARMUP)
    return MIN_LR + 0.5 * (LR - MIN_LR) * (1 + math.cos(math.pi * t))


def greedy_accuracy(model, problems, batch: int = 250) -> float:
    """Exact match of greedy answers (transformers' generate, the tokenizer's end of sequence)."""
    import torch

    tok = task_hf.tokenizer()
    right = 0
    model.eval()
    for start in range(0, len(problems), batch):
        chunk = problems[start : start + batch]
        enc = tok([task_hf.prompt(p) for p in chunk], return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.no_grad():
            out = model.generate(
                **enc,
                max_new_tokens=task.MAX_ANSWER,
                do_sample=False,
                pad_token_id=tok.pad_token_id,
                eos_token_id=tok.eos_token_id,
            )
        for p, ids in zip(chunk, out[:, enc["input_ids"].shape[1] :].tolist()):
            right += task_hf.answer_text(ids) == p.answer + task_hf.EOS
    return right / len(problems)


def train_original(folder: Path, steps: int = STEPS, seed: int = 0, max_minutes: float = 14.0) -> Path:
    import torch

    if (folder / "train.json").is_file():
        return folder
    torch.set_num_threads(1)
    model = task_hf.build(seed, output_router_logits=True).train()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01, betas=(0.9, 0.98))
    train = task.split("train")
    order = list(range(len(train)))
    rng = random.Random(seed)
    rng.shuffle(order)
    t0, pos, history, done = time.time(), 0, [], steps
    for step in range(steps):
        if pos + BATCH > len(order):
            rng.shuffle(order)
            pos = 0
        tokens, mask = task.trim(*task.batch([train[i] for i in order[pos : pos + BATCH]]))
        pos += BATCH
        for g in opt.param_groups:
            g["lr"] = lr_at(step, steps)
        out = model(tokens, attention_mask=(tokens != task.PAD).long())
        targets = torch.roll(tokens, -1, dims=1)
        loss = torch.nn.functional.cross_entropy(out.logits[mask], targets[mask])
        total = loss + model.config.router_aux_loss_coef * out.aux_loss
        opt.zero_grad(set_to_none=True)
        total.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 100 == 0 or step == steps - 1:
            history.append({"step": step, "loss": float(loss), "seconds": time.time() - t0})
            print(f"sft step {step}/{steps} loss {float(loss):.4f} ({time.time() - t0:.0f} s)", flush=True)
        if time.time() - t0 > max_minutes * 60:
            done = step + 1
            print(f"sft stopped at step {done}: {max_minutes} min reached", flush=True)
            break
    seconds = time.time() - t0
    model.config.output_router_logits = False
    acc = {name: greedy_accuracy(model, task.split(name)[:500]) for name in ("val", "test")}
    model.save_pretrained(folder)
    task_hf.tokenizer().save_pretrained(folder)
    (folder / "train.json").write_text(
        json.dumps(
            {
                "steps": done,
                "planned_steps": steps,
                "batch": BATCH,
                "lr": LR,
                "seed": seed,
                "train_seconds": seconds,
                "greedy_exact_match_500": acc,
                "history": history,
                "load_average_after": os.getloadavg(),
            },
            indent=1,
        )
    )
    return folder


def calibration(path: Path, count: int = 2000) -> Path:
    """Training-split problem lines as JSONL text (the checkpoint's tokenizer encodes them)."""
    if not path.is_file():
        path.write_text("".join(json.dumps({"text": p.text}) + "\n" for p in task.split("train")[-count:]))
    return path


def cli(*args) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    print("$ mcore-proxy", " ".join(map(str, args)), flush=True)
    proc = subprocess.run(
        [sys.executable, "-m", "mcore_proxy.cli", *map(str, args)], env=env, text=True, capture_output=True
    )
    print(proc.stdout[-2000:], proc.stderr[-2000:], flush=True)
    if proc.returncode != 0:
        raise SystemExit(f"mcore-proxy {args[0]} failed ({proc.returncode})")


def build_proxy(original: Path, work: Path, num_experts: int) -> Path:
    proxy = work / "proxy"
    if (proxy / "manifest.json").is_file():
        return proxy
    data = calibration(work / "calibration.jsonl")
    cli("collect", "--hf", original, "--data", data, "-o", work / "stats", "--batch-size", 100)
    plan = work / "plan.json"
    plan.unlink(missing_ok=True)
    cli(
        "select",
        "--ckpt",
        original,
        "--stats",
        work / "stats" / "routing_stats.safetensors",
        "--num-experts",
        num_experts,
        "-o",
        plan,
    )
    cli("convert", original, "--plan", plan, "-o", proxy)
    return proxy


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--work", default="out/rl_faults_trl")
    p.add_argument("--num-experts", type=int, default=8)
    p.add_argument("--steps", type=int, default=STEPS)
    args = p.parse_args(argv)
    work = Path(args.work).absolute()
    work.mkdir(parents=True, exist_ok=True)
    original = train_original(work / "original", args.steps)
    proxy = build_proxy(original, work, args.num_experts)
    report = work / "models.json"
    if not report.is_file():
        from transformers import AutoModelForCausalLM

        acc = greedy_accuracy(AutoModelForCausalLM.from_pretrained(proxy), task.split("test")[:500])
        report.write_text(
            json.dumps(
                {
                    "original": json.loads((original / "train.json").read_text()),
                    "proxy_greedy_exact_match_test_500": acc,
                    "num_experts": [task_hf.SHAPE["num_experts"], args.num_experts],
                },
                indent=1,
            )
        )
    print(report.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
