"""Train the two quality-bench MoE models on CPU, cached outside the repository.

    from bench.quality.train import trained_checkpoint
    ckpt = trained_checkpoint("fine")     # Path of a Megatron legacy checkpoint (TP=PP=EP=1)

    python -m bench.quality.train --shape coarse    # train now (or reuse the cache) and report

Checkpoints live under $MCORE_PROXY_QUALITY_CACHE (default ~/.cache/mcore-proxy/quality), in a
folder keyed by a hash of task.py, the shape's architecture and settings and TRAINING_VERSION,
so a change to any of them trains anew; a missing or incomplete folder is rebuilt. Training runs in a
spawned one-rank gloo world with megatron-core's own GPTModel (local spec), AdamW, loss on the
answer characters, Switch load balancing (aux loss), fixed seeds.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import math
import os
import random
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from bench.quality import model as qmodel
from bench.quality import task

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrainSettings:
    steps: int = 2500
    batch: int = 64
    lr: float = 2e-3
    min_lr: float = 1e-4
    warmup: int = 100
    weight_decay: float = 0.01
    aux_loss: float = 1e-2
    seed: int = 0
    threads: int = 1  # 2 threads on 2 shared cores ran 4x slower than 1 under load


# steps chosen so each trains in well under 30 minutes on 2 shared cores (train.json has the time)
SETTINGS = {"coarse": TrainSettings(steps=2500), "fine": TrainSettings(steps=2000)}


def cache_root() -> Path:
    return Path(os.environ.get("MCORE_PROXY_QUALITY_CACHE", Path.home() / ".cache" / "mcore-proxy" / "quality"))


# bump when the training procedure changes in a way the settings do not show
TRAINING_VERSION = 2


def checkpoint_key(shape: str) -> str:
    """Cache folder name: the shape, and a hash of the task generator's source, the shape's
    architecture and training settings, and TRAINING_VERSION."""
    h = hashlib.sha256((Path(__file__).parent / "task.py").read_bytes())
    h.update(repr((qmodel.SHAPES[shape], SETTINGS[shape], TRAINING_VERSION)).encode())
    return f"{shape}-{h.hexdigest()[:12]}"


def lr_at(step: int, s: TrainSettings) -> float:
    if step < s.warmup:
        return s.lr * (step + 1) / s.warmup
    t = (step - s.warmup) / max(1, s.steps - s.warmup)
    return s.min_lr + 0.5 * (s.lr - s.min_lr) * (1 + math.cos(math.pi * t))


def _train_worker(rank: int, shape: str, out: str, report: str) -> None:
    from mcore_proxy.functional.cpu import destroy_distributed, free_port, init_distributed
    from mcore_proxy.runtime.interrupts import die_with_parent

    die_with_parent()  # a killed ablation must not leave a training orphan writing into the cache
    s = SETTINGS[shape]
    torch.set_num_threads(s.threads)
    init_distributed(0, 1, free_port(), seed=s.seed)
    try:
        model = qmodel.SHAPES[shape]
        gpt = qmodel.build(model, qmodel.config(model, s.aux_loss)).train()
        opt = torch.optim.AdamW(gpt.parameters(), lr=s.lr, weight_decay=s.weight_decay, betas=(0.9, 0.98))
        train = task.split("train")
        order = list(range(len(train)))
        rng = random.Random(s.seed)
        rng.shuffle(order)
        t0, pos, history = time.time(), 0, []
        for step in range(s.steps):
            if pos + s.batch > len(order):
                rng.shuffle(order)
                pos = 0
            tokens, mask = task.trim(*task.batch([train[i] for i in order[pos : pos + s.batch]]))
            pos += s.batch
            for g in opt.param_groups:
                g["lr"] = lr_at(step, s)
            out_logits = qmodel.logits(gpt, tokens)
            targets = torch.roll(tokens, -1, dims=1)
            loss = torch.nn.functional.cross_entropy(out_logits[mask], targets[mask])
            opt.zero_grad(set_to_none=True)
            loss.backward()  # the routers' aux losses join here (MoEAuxLossAutoScaler)
            torch.nn.utils.clip_grad_norm_(gpt.parameters(), 1.0)
            opt.step()
            if step % 100 == 0 or step == s.steps - 1:
                history.append({"step": step, "loss": float(loss), "seconds": time.time() - t0})
                log.warning(
                    "train %s: step %d/%d loss %.4f (%.0f s)", shape, step, s.steps, float(loss), time.time() - t0
                )
        seconds = time.time() - t0
        gpt.eval()
        acc = {name: qmodel.accuracy(gpt, task.split(name)) for name in ("val", "test")}
        qmodel.save(gpt, model, out, s.steps)
        Path(report).write_text(
            json.dumps(
                {
                    "shape": shape,
                    "model": asdict(model),
                    "settings": asdict(s),
                    "train_seconds": seconds,
                    "load_average_after": os.getloadavg(),
                    "accuracy": acc,
                    "history": history,
                },
                indent=1,
            )
        )
    finally:
        destroy_distributed()


def trained_checkpoint(shape: str, *, retrain: bool = False) -> Path:
    """Path of the trained checkpoint of `shape` ("coarse" | "fine"); trains (about 10-25 min on
    2 shared CPU cores) when the cache holds no complete one. Its `train.json` beside it
    records accuracy, duration and loss history."""
    if shape not in qmodel.SHAPES:
        raise ValueError(f"shape {shape!r} is not one of {tuple(qmodel.SHAPES)}")
    base = cache_root() / checkpoint_key(shape)
    ckpt, report = base / "ckpt", base / "train.json"
    if report.is_file() and (ckpt / "latest_checkpointed_iteration.txt").is_file() and not retrain:
        return ckpt
    shutil.rmtree(base, ignore_errors=True)
    staging = base.with_name(base.name + f".tmp{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    torch.multiprocessing.spawn(
        _train_worker, args=(shape, str(staging / "ckpt"), str(staging / "train.json")), nprocs=1, join=True
    )
    os.replace(staging, base)  # complete or absent, never half-written
    return ckpt


def training_report(shape: str) -> dict:
    return json.loads((trained_checkpoint(shape).parent / "train.json").read_text())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=tuple(qmodel.SHAPES), action="append")
    p.add_argument("--retrain", action="store_true")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    for shape in args.shape or tuple(qmodel.SHAPES):
        ckpt = trained_checkpoint(shape, retrain=args.retrain)
        r = training_report(shape)
        print(
            f"{shape}: {ckpt}  test exact match {r['accuracy']['test']:.3f}, "
            f"val {r['accuracy']['val']:.3f}, trained {r['train_seconds'] / 60:.1f} min"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
