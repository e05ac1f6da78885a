"""Logs written by the real libraries, once per session, each in a subprocess (their global state,
services and environment variables stay there): a transformers Trainer run with TRL's GRPO metrics,
MLflow file and SQLite stores, a W&B offline run and a SwanLab offline run. A library that is not
installed skips the tests that need it."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest


def _run(script: str, *args, env=None, timeout=300):
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script), *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def _need(module: str):
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{module} is not installed")


# A transformers Trainer on a tiny model, 6 steps on CPU, logging every step, evaluating every 3,
# saving every 2; its log() adds what TRL's GRPOTrainer.log adds (the means of its _metrics), so
# trainer_state.json and the console dict lines are the Trainer's own. stdout and stderr (tqdm's
# bars) go to one file, as `python train.py > train.log 2>&1` would.
TRAINER = """
    import sys, torch
    from torch import nn
    from transformers import Trainer, TrainingArguments

    class Tiny(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 1)

        def forward(self, x, labels=None):
            out = self.lin(x).squeeze(-1)
            return {"loss": ((out - labels) ** 2).mean(), "logits": out}

    class Rows(torch.utils.data.Dataset):
        def __init__(self, n):
            self.x = torch.randn(n, 4, generator=torch.Generator().manual_seed(0))
            self.y = self.x.sum(-1)

        def __len__(self):
            return len(self.x)

        def __getitem__(self, i):
            return {"x": self.x[i], "labels": self.y[i]}

    class GRPOLike(Trainer):
        def log(self, logs, start_time=None):
            if "loss" in logs:
                s = self.state.global_step
                logs.update({"reward": 0.1 * s, "reward_std": 0.05, "kl": 0.001 * s, "entropy": 1.0 - 0.01 * s,
                             "completions/mean_length": 100.0 + s, "clip_ratio/region_mean": 0.0,
                             "rewards/accuracy_reward/mean": 0.1 * s})
            super().log(logs, start_time)

    args = TrainingArguments(output_dir=sys.argv[1], max_steps=6, logging_steps=1, save_steps=2,
                             eval_strategy="steps", eval_steps=3, per_device_train_batch_size=2, report_to=[],
                             use_cpu=True, learning_rate=1e-3, disable_tqdm=False)
    GRPOLike(model=Tiny(), args=args, train_dataset=Rows(16), eval_dataset=Rows(4)).train()
"""


@pytest.fixture(scope="session")
def trl_run(tmp_path_factory):
    """(console log, output folder) of the Trainer run."""
    _need("transformers")
    root = tmp_path_factory.mktemp("trl")
    console = root / "train.log"
    with console.open("w") as out:
        done = subprocess.run(
            [sys.executable, "-c", textwrap.dedent(TRAINER), str(root / "out")],
            stdout=out,
            stderr=subprocess.STDOUT,
            timeout=300,
        )
    assert done.returncode == 0, console.read_text()[-3000:]
    return console, root / "out"


# MLflow: two experiments in one file store (base: two runs, fault: one), and one run in a SQLite
# database, written by mlflow's own client. MLflow >= 3.7 keeps the file store only on request.
MLFLOW = """
    import sys, mlflow
    store, db = sys.argv[1], sys.argv[2]
    mlflow.set_tracking_uri("file:" + store)
    for experiment, runs in (("base", ("seed0", "seed1")), ("fault", ("lr_x10",))):
        mlflow.set_experiment(experiment)
        for i, name in enumerate(runs):
            with mlflow.start_run(run_name=name):
                for step in range(1, 11):
                    mlflow.log_metrics({"actor/kl_loss": 0.001 * step * (i + 1), "critic/score/mean": 0.05 * step,
                                        "timing_s/gen": 12.5}, step=step)
    if db != "-":
        mlflow.set_tracking_uri("sqlite:///" + db)
        mlflow.set_experiment("verl")
        with mlflow.start_run(run_name="qwen"):
            for step in range(1, 6):
                mlflow.log_metrics({"actor/kl_loss": 0.002 * step, "critic/score/mean": 0.1 * step}, step=step)
            mlflow.log_metric("actor/entropy", float("nan"), step=3)
            mlflow.log_metric("actor/grad_norm", float("inf"), step=4)  # stored as the largest float
            mlflow.log_metric("actor/grad_norm", -float("inf"), step=5)
"""


@pytest.fixture(scope="session")
def mlflow_stores(tmp_path_factory):
    """(file store folder, SQLite database or None when sqlalchemy is missing)."""
    _need("mlflow")
    root = tmp_path_factory.mktemp("mlflow")
    sql = importlib.util.find_spec("sqlalchemy") is not None and importlib.util.find_spec("alembic") is not None
    db = root / "mlflow.db" if sql else None
    _run(MLFLOW, root / "mlruns", db or "-", env={"MLFLOW_ALLOW_FILE_STORE": "true", "MLFLOW_TRACKING_URI": ""})
    return root / "mlruns", db


WANDB = """
    import sys, wandb
    for name in ("base", "fault"):
        run = wandb.init(project="proxy", name=name, mode="offline", dir=sys.argv[1])
        for step in range(10):
            grad = {3: float("nan"), 5: float("inf"), 7: -float("inf")}.get(step, 0.5)  # wandb writes "NaN", ...
            run.log({"actor/kl_loss": 0.001 * step, "critic/score/mean": 0.05 * step, "note": "text",
                     "perf": {"throughput": 100.0 + step}, "perf/loss_scale": grad}, step=step)
        run.finish()
"""


@pytest.fixture(scope="session")
def wandb_dir(tmp_path_factory):
    """A wandb/ folder with two offline runs (base, then fault)."""
    _need("wandb")
    root = tmp_path_factory.mktemp("wandb")
    _run(WANDB, root, env={"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_API_KEY": ""})
    return root / "wandb"


SWANLAB = """
    import sys, swanlab
    for name in ("base", "fault"):
        swanlab.init(project="proxy", experiment_name=name, mode="offline", logdir=sys.argv[1])
        for step in range(10):
            scale = {3: float("nan"), 5: float("inf"), 7: -float("inf")}.get(step, 0.5)
            swanlab.log({"actor/kl_loss": 0.001 * step, "critic/score/mean": 0.05 * step, "perf/loss_scale": scale},
                        step=step)
        swanlab.finish()
"""


@pytest.fixture(scope="session")
def swanlog(tmp_path_factory):
    """A swanlog/ folder with two offline runs."""
    _need("swanlab")
    root = tmp_path_factory.mktemp("swanlab")
    _run(SWANLAB, root / "swanlog")
    return root / "swanlog"
