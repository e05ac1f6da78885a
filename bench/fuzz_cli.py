"""CLI campaign: the promises of docs/reliability.md, case by case, through the real command line.

bench/fuzz.py damages inputs at random; this campaign puts a careless or hostile *user* in front of
the commands: outputs placed where they must not go, statistics and metric logs holding NaN or
infinities, sizes and steps out of range, a stdout whose reader has gone. Every case copies one
small corpus into its own sandbox (the quickstart's Megatron checkpoint, a second checkpoint, a
proxy, a plan, per-rank and merged statistics, metric logs, an HF config, optionally a tiny HF model
that transformers cannot run), runs one command through `mcore_proxy.cli.main` in a forked child
(cwd = the sandbox, a 60 s limit), and judges it by rules that cover a class, not an instance:

  outside   no command writes outside its output: after the run, every path of the sandbox other
            than the case's declared output is as before (bytes, and no file added or removed);
            a refused command changes nothing at all (no folder made, no lock left);
  inputs    no output path is, or lies in, or holds an input, a checkpoint folder, or a folder
            that is not one (a file as the parent, a missing chain of parents, an empty path):
            such a command exits 2;
  finite    no NaN or inf passes silently: non-finite statistics exit 2 naming file, layer and
            field; a non-finite metric is a watch alert (exit 1) and a count in compare; a log of
            nothing but NaN exits 2;
  no-3      no bad input exits 3: every case ends 0, 1 or 2 (as the case expects), stderr holds no
            traceback, and an exit 2 says one error sentence;
  pipe      a stdout without a reader is not an error: the command's exit code is its verdict.

    python bench/fuzz_cli.py --workdir /tmp/fuzz-cli            # every case (about 150)
    python bench/fuzz_cli.py --workdir /tmp/fuzz-cli --only place/convert

`tests/test_fuzz_cli.py` runs every case in the suite.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import hashlib
import json
import os
import shutil
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

LIMIT_S = 60.0
FIXTURE = "deepseek_like_pp2_uneven"
KEEP = 8
CHECKPOINTS = ("original", "other", "proxy")
MERGED = "stats.safetensors"
# compare over the four metric logs every case's sandbox holds (logs/)
COMPARE_LOGS = (
    "compare",
    "--orig-base",
    "logs/ob.jsonl",
    "--orig-fault",
    "logs/of.jsonl",
    "--proxy-base",
    "logs/pb.jsonl",
    "--proxy-fault",
    "logs/pf.jsonl",
)


@dataclass(frozen=True)
class CliCase:
    """One command against one sandbox.

    argv: the command line, paths relative to the sandbox (its cwd); expect: the exit codes the
    rules allow; outputs: sandbox-relative paths the command may create or change (a folder: all
    under it); says: text that stderr or stdout must hold; setup: a SETUPS entry run on the sandbox
    first; stdout: "file", or "closed" (a pipe whose reader has gone)."""

    name: str
    rule: str
    argv: tuple[str, ...]
    expect: frozenset
    outputs: tuple[str, ...] = ()
    says: str = ""
    setup: str = ""
    stdout: str = "file"
    needs: str = ""  # "hf": the corpus's HF model (transformers installed)


# -- the corpus -----------------------------------------------------------------------------------


def build_corpus(work: Path, legacy_ckpt: Path) -> Path:
    """Every input of the cases, once: checkpoints, plan, proxy, statistics, logs, configs."""
    from mcore_proxy.checkpoint import open_checkpoint
    from mcore_proxy.cli import main
    from mcore_proxy.core.stats import RoutingStats, save_stats
    from mcore_proxy.select.synthetic import stats_like

    corpus = work / "corpus"
    if (corpus / "done").is_file():
        return corpus
    shutil.rmtree(corpus, ignore_errors=True)
    corpus.mkdir(parents=True)
    shutil.copytree(legacy_ckpt, corpus / "original")
    shutil.copytree(legacy_ckpt, corpus / "other")
    spec = open_checkpoint(corpus / "original").spec
    stats = stats_like(spec, KEEP, seed=5)
    (corpus / "trace").mkdir()
    for rank in (0, 1):
        meta = {"rank": rank, "world_size": 2, "model_layers": list(spec.moe_layer_ids), "source": "planted"}
        save_stats(RoutingStats(stats.layers, stats.topk, meta), corpus / "trace" / f"rank{rank:05d}.safetensors")
    quiet = open(os.devnull, "w")
    with _redirected(quiet):
        assert main(["stats", "merge", str(corpus / "trace"), "-o", str(corpus / MERGED)]) == 0
        select = ["select", "--ckpt", str(corpus / "original"), "--stats", str(corpus / MERGED)]
        assert main([*select, "--num-experts", str(KEEP), "-o", str(corpus / "plan.json")]) == 0
        convert = ["convert", str(corpus / "original"), "--plan", str(corpus / "plan.json")]
        assert main([*convert, "-o", str(corpus / "proxy"), "--target-ep", "1"]) == 0
    _write_logs(corpus / "logs")
    (corpus / "hf_config.json").write_text(json.dumps(HF_CONFIG))
    _build_hf(corpus)
    (corpus / "done").write_text("")
    return corpus


# an HF config `estimate --hf-config` reads (Qwen3-MoE-shaped, small)
HF_CONFIG = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "hidden_size": 256,
    "intermediate_size": 512,
    "moe_intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "num_experts": 16,
    "num_experts_per_tok": 4,
    "vocab_size": 1024,
    "max_position_embeddings": 512,
}


def _log(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps({"step": i, "data": d}) + "\n" for i, d in enumerate(rows)))


def _write_logs(folder: Path) -> None:
    """verl-shaped JSONL: baselines, and faulted runs whose log-prob gap grows after step 10."""
    folder.mkdir()
    for who, scale in (("o", 1.0), ("p", 1.2)):
        base = [{"reward": 0.1 + 0.01 * i, "logprob_diff": 0.001} for i in range(30)]
        fault = [
            {"reward": 0.1 + 0.01 * i, "logprob_diff": 0.001 + (0.002 * scale * (i - 10) if i > 10 else 0)}
            for i in range(30)
        ]
        _log(folder / f"{who}b.jsonl", base)
        _log(folder / f"{who}f.jsonl", fault)


def _build_hf(corpus: Path) -> None:
    """A tiny DeepSeek-V3 that transformers accepts but cannot run (MLA with one KV head), and its
    calibration data; left out where transformers is not installed."""
    try:
        from mcore_proxy.testing.hf_fixtures import build, calibration_jsonl
    except ImportError:
        return
    try:
        import transformers  # noqa: F401
    except ImportError:
        return
    folder = build("deepseek_v3", corpus / "hf_unrunnable")
    config = json.loads((folder / "config.json").read_text())
    config["num_key_value_heads"] = 1
    (folder / "config.json").write_text(json.dumps(config))
    calibration_jsonl(corpus / "calib.jsonl")


# -- damage done to a sandbox before its command ------------------------------------------------


def _stats_value(sandbox: Path, file: str, key: str, value) -> None:
    from safetensors.numpy import load_file, save_file

    path = sandbox / file
    tensors = load_file(str(path))
    array = tensors[key].copy()
    array.reshape(-1)[1 % array.size] = value
    tensors[key] = array
    save_file(tensors, str(path), metadata={"format": "mcore-proxy-stats/1"})


EMIT = "import json, sys\nopen(sys.argv[1], 'w').write(json.dumps({'step': 0, 'data': {'reward': 1.0}}) + '\\n')\n"


def _campaign(work: str):
    """A campaign file whose `work` is the case's output place; its runs write one log line."""

    def setup(sandbox: Path) -> None:
        (sandbox / "emit.py").write_text(EMIT)
        config = {
            "format": "mcore-proxy-campaign-config/1",
            "command": ["{python}", "{config_dir}/emit.py", "{run_dir}/m.jsonl"],
            "log": "{run_dir}/m.jsonl",
            "work": work,
            "patches": False,
            "faults": [{"name": "noise", "spec": "router_noise:std=0.1"}],
        }
        (sandbox / "campaign.json").write_text(json.dumps(config))

    return setup


def _logs_nonfinite(sandbox: Path) -> None:
    rows = [
        {"reward": float("nan") if i % 3 == 2 else 0.1, "logprob_diff": float("inf") if i % 3 == 2 else 0.001}
        for i in range(30)
    ]
    _log(sandbox / "logs" / "of.jsonl", rows)
    _log(sandbox / "logs" / "pf.jsonl", rows)


def _logs_all_nan(sandbox: Path) -> None:
    _log(sandbox / "logs" / "of.jsonl", [{"reward": float("nan"), "logprob_diff": float("nan")}] * 30)


def _log_line(line: str):
    def setup(sandbox: Path) -> None:
        with open(sandbox / "logs" / "of.jsonl", "a") as f:
            f.write(line + "\n")

    return setup


def _hf_config(**changes):
    def setup(sandbox: Path) -> None:
        (sandbox / "hf_config.json").write_text(json.dumps({**HF_CONFIG, **changes}).replace('"__raw__"', "1e308"))

    return setup


def _old_torch_format(sandbox: Path) -> None:
    import torch

    for f in sorted((sandbox / "original").rglob("model_optim_rng.pt")):
        state = torch.load(f, weights_only=False)  # trusted: the corpus's own file
        torch.save(state, f, _use_new_zipfile_serialization=False)


def _tamper_proxy(sandbox: Path) -> None:
    f = sorted((sandbox / "proxy").rglob("model_optim_rng.pt"))[-1]
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0xFF  # inside a tensor's bytes: the manifest's hash no longer holds
    f.write_bytes(bytes(data))


# (field, value) written into layer 2 of the merged statistics: setup "stats:FIELD/WHAT"
STATS_DAMAGE = {
    "gate_mass/nan": float("nan"),
    "gate_mass/inf": float("inf"),
    "gate_mass/negative": -1.0,
    "proto_sum/nan": float("nan"),
    "proto_sum/-inf": -float("inf"),
    "freq/negative": -4,
    "freq/2**62": 1 << 62,
    "coact/negative": -1,
}

SETUPS = {
    "rank_nan": lambda s: _stats_value(s, "trace/rank00001.safetensors", "layer.1.gate_mass", float("nan")),
    "logs_nonfinite": _logs_nonfinite,
    "logs_all_nan": _logs_all_nan,
    "log_step_huge": _log_line('{"step": 1e30, "data": {"reward": 0.5}}'),
    "log_nested": _log_line('{"step": 31, "data": ' + "[" * 100_000 + "]" * 100_000 + "}"),
    "cfg_huge": _hf_config(hidden_size="__raw__"),
    "cfg_fraction": _hf_config(hidden_size=1.5),
    "old_torch_format": _old_torch_format,
    "tamper_proxy": _tamper_proxy,
}


# -- the cases ------------------------------------------------------------------------------------

# where a careless or hostile user puts an output; `{in_file}`, `{in_dir}`, `{ext}` come from the command
PLACES = {
    "empty": "",
    "input-file": "{in_file}",
    "input-folder": "{in_dir}",
    "inside-input": "{in_dir}/new{ext}",
    "checkpoint": "other",
    "inside-checkpoint": "other/iter_0000010/new{ext}",
    "inside-proxy": "proxy/new{ext}",
    "file-as-parent": "plan.json/new{ext}",
    "missing-parents": "nope/deeper/new{ext}",
    "fresh": "new{ext}",
}


@dataclass(frozen=True)
class Writer:
    """A command that writes: `argv` with `{out}` where the output goes."""

    name: str
    argv: tuple[str, ...]
    in_file: str
    in_dir: str | None  # an input folder (None: the command reads files only)
    ext: str = ""
    sidecar: str = ""  # a second file written beside the output (the statistics' .json)
    force: bool = True
    setup: str = ""
    fresh_expect: frozenset = frozenset({0})  # compare's verdict may be either


WRITERS = (
    Writer(
        "convert",
        ("convert", "original", "--plan", "plan.json", "-o", "{out}", "--target-ep", "1"),
        "plan.json",
        "original",
    ),
    Writer(
        "select",
        ("select", "--ckpt", "original", "--stats", MERGED, "--num-experts", str(KEEP), "-o", "{out}"),
        MERGED,
        "original",
        ext=".json",
    ),
    Writer(
        "select-report",
        (
            "select",
            "--ckpt",
            "original",
            "--stats",
            MERGED,
            "--num-experts",
            str(KEEP),
            "-o",
            "fresh_plan.json",
            "--report",
            "{out}",
        ),
        MERGED,
        "original",
    ),
    Writer(
        "stats-merge",
        ("stats", "merge", "trace", "-o", "{out}"),
        "trace/rank00000.safetensors",
        "trace",
        ext=".safetensors",
        sidecar=".json",
    ),
    Writer("stats-show", ("stats", "show", "trace", "--png", "{out}"), "trace/rank00000.safetensors", "trace"),
    Writer(
        "compare",
        (
            "compare",
            "--orig-base",
            "logs/ob.jsonl",
            "--orig-fault",
            "logs/of.jsonl",
            "--proxy-base",
            "logs/pb.jsonl",
            "--proxy-fault",
            "logs/pf.jsonl",
            "-o",
            "{out}",
        ),
        "logs/of.jsonl",
        None,
        fresh_expect=frozenset({0, 1}),
    ),
    Writer(
        "watch-alerts",
        ("watch", "logs/of.jsonl", "--once", "--alerts", "{out}"),
        "logs/of.jsonl",
        None,
        ext=".txt",
        force=False,
    ),
    Writer("campaign", ("campaign", "campaign.json"), "campaign.json", None, force=False, setup="campaign"),
)


def _place_cases() -> list[CliCase]:
    cases = []
    for w in WRITERS:
        for place, pattern in PLACES.items():
            if "{in_dir}" in pattern and w.in_dir is None:
                continue
            out = pattern.format(in_file=w.in_file, in_dir=w.in_dir, ext=w.ext)
            if w.name == "stats-merge" and place == "inside-input":
                continue  # the one name allowed inside the folder is tested below, as a fresh place
            for force in (False, True) if w.force else (False,):
                fresh = place == "fresh"
                outputs = (out, *([out[: -len(w.ext)] + w.sidecar] if w.sidecar else ()))
                if w.name == "select-report":
                    outputs += ("fresh_plan.json",)
                argv = tuple(a.replace("{out}", out) for a in w.argv) + (("--force",) if force else ())
                setup = w.setup
                if w.name == "campaign":
                    setup = f"campaign:{out}"
                cases.append(
                    CliCase(
                        f"place/{w.name}/{place}{'/force' if force else ''}",
                        "inputs" if not fresh else "outside",
                        argv,
                        w.fresh_expect if fresh else frozenset({2}),
                        outputs if fresh else (),
                        setup=setup,
                    )
                )
    # the merged file's default place, inside the folder it reads, is allowed (no merge reads it)
    cases.append(
        CliCase(
            "place/stats-merge/default",
            "outside",
            ("stats", "merge", "trace"),
            frozenset({0}),
            ("trace/routing_stats.safetensors", "trace/routing_stats.json"),
        )
    )
    return cases


def _finite_cases() -> list[CliCase]:
    cases = []
    select = ("select", "--ckpt", "original", "--stats", MERGED, "--num-experts", str(KEEP), "-o", "p.json")
    for damage in STATS_DAMAGE:
        says = f"{MERGED}: layer 2 field {damage.split('/')[0]}"
        for method in ("multiview", "frequency", "gate-mass"):
            argv = (*select, "--method", method)
            cases.append(
                CliCase(f"finite/{damage}/{method}", "finite", argv, frozenset({2}), says=says, setup=f"stats:{damage}")
            )
        argv = ("stats", "show", MERGED)
        cases.append(
            CliCase(f"finite/{damage}/show", "finite", argv, frozenset({2}), says=says, setup=f"stats:{damage}")
        )
    cases.append(
        CliCase(
            "finite/rank_nan/merge",
            "finite",
            ("stats", "merge", "trace", "-o", "m.safetensors"),
            frozenset({2}),
            says="rank00001.safetensors: layer 1 field gate_mass holds nan",
            setup="rank_nan",
        )
    )
    cases.append(
        CliCase(
            "finite/logs/watch",
            "finite",
            ("watch", "logs/of.jsonl", "--once"),
            frozenset({1}),
            says="nonfinite",
            setup="logs_nonfinite",
        )
    )
    cases.append(
        CliCase(
            "finite/logs/compare", "finite", COMPARE_LOGS, frozenset({0, 1}), says="non-finite", setup="logs_nonfinite"
        )
    )
    cases.append(
        CliCase("finite/all-nan/compare", "finite", COMPARE_LOGS, frozenset({2}), says="only NaN", setup="logs_all_nan")
    )
    cases.append(
        CliCase(
            "finite/all-nan/watch",
            "finite",
            ("watch", "logs/of.jsonl", "--once"),
            frozenset({1}),
            says="nonfinite",
            setup="logs_all_nan",
        )
    )
    return cases


def _bad_input_cases() -> list[CliCase]:
    estimate = ("estimate", "--hf-config", "hf_config.json", "--num-experts", "8")
    cases = [
        CliCase("no-3/step-huge/compare", "no-3", COMPARE_LOGS, frozenset({2}), says="step", setup="log_step_huge"),
        CliCase(
            "no-3/step-huge/watch",
            "no-3",
            ("watch", "logs/of.jsonl", "--once"),
            frozenset({2}),
            says="step",
            setup="log_step_huge",
        ),
        CliCase("no-3/nested/compare", "no-3", COMPARE_LOGS, frozenset({2}), setup="log_nested"),
        CliCase("no-3/nested/watch", "no-3", ("watch", "logs/of.jsonl", "--once"), frozenset({2}), setup="log_nested"),
        CliCase("no-3/estimate/huge", "no-3", estimate, frozenset({2}), says="not an integer", setup="cfg_huge"),
        CliCase(
            "no-3/estimate/fraction", "no-3", estimate, frozenset({2}), says="not an integer", setup="cfg_fraction"
        ),
        CliCase(
            "no-3/old-torch-format",
            "no-3",
            ("inspect", "original"),
            frozenset({2}),
            says="before torch 1.6",
            setup="old_torch_format",
        ),
        CliCase(
            "no-3/plan-is-a-folder",
            "no-3",
            ("convert", "original", "--plan", "other", "-o", "x"),
            frozenset({2}),
            says="pass the plan file itself",
        ),
        CliCase(
            "no-3/collect-unrunnable",
            "no-3",
            ("collect", "--hf", "hf_unrunnable", "--data", "calib.jsonl", "-o", "st"),
            frozenset({2}),
            says="could not run this model",
            needs="hf",
        ),
    ]
    for flag in ("--target-tp", "--target-pp", "--target-ep", "--target-etp", "--target-vpp", "--workers"):
        cases.append(
            CliCase(
                f"no-3/zero{flag}",
                "no-3",
                ("convert", "original", "-o", "x", flag, "0", "--dry-run"),
                frozenset({2}),
                says="not a size",
            )
        )
    return cases


def _pipe_cases() -> list[CliCase]:
    verify = ("verify", "--orig", "original", "--proxy", "proxy", "--plan", "plan.json")
    return [
        CliCase("pipe/inspect", "pipe", ("inspect", "original"), frozenset({0}), stdout="closed"),
        CliCase("pipe/stats-show", "pipe", ("stats", "show", MERGED), frozenset({0}), stdout="closed"),
        CliCase("pipe/verify-ok", "pipe", verify, frozenset({0}), stdout="closed"),
        CliCase("pipe/verify-differs", "pipe", verify, frozenset({1}), stdout="closed", setup="tamper_proxy"),
        CliCase(
            "pipe/watch-follows", "pipe", ("watch", "logs/ob.jsonl", "--every", "0.2"), frozenset({0}), stdout="closed"
        ),
    ]


def make_cases() -> list[CliCase]:
    cases = _place_cases() + _finite_cases() + _bad_input_cases() + _pipe_cases()
    names = [c.name for c in cases]
    assert len(names) == len(set(names)), "case names must be unique"
    return cases


# -- running and judging --------------------------------------------------------------------------


def snapshot(root: Path) -> dict[str, str]:
    """{relative path: sha256 of the file, or "dir"} of everything under `root`, hidden files too."""
    seen = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for d in dirnames:
            seen[os.path.relpath(os.path.join(dirpath, d), root)] = "dir"
        for f in filenames:
            p = os.path.join(dirpath, f)
            seen[os.path.relpath(p, root)] = (
                "link" if os.path.islink(p) else hashlib.sha256(Path(p).read_bytes()).hexdigest()
            )
    return seen


def changed_outside(before: dict, after: dict, outputs: tuple[str, ...]) -> list[str]:
    """Paths added, removed or changed that are neither an output nor under one."""
    allowed = [os.path.normpath(o) for o in outputs if o]

    def mine(path: str) -> bool:
        return any(path == a or path.startswith(a + os.sep) for a in allowed)

    diff = {p for p in before.keys() | after.keys() if before.get(p) != after.get(p)}
    return sorted(p for p in diff if not mine(p))


def apply_setup(name: str, sandbox: Path) -> None:
    if name.startswith("campaign:"):
        _campaign(name.split(":", 1)[1])(sandbox)
    elif name.startswith("stats:"):
        damage = name.split(":", 1)[1]
        _stats_value(sandbox, MERGED, f"layer.2.{damage.split('/')[0]}", STATS_DAMAGE[damage])
    elif name:
        SETUPS[name](sandbox)


@contextlib.contextmanager
def _redirected(stream):
    """sys.stdout and sys.stderr to `stream` for the block (the corpus's own commands)."""
    old = sys.stdout, sys.stderr
    sys.stdout = sys.stderr = stream
    try:
        yield
    finally:
        sys.stdout, sys.stderr = old


def _child(case: CliCase, sandbox: Path, out_path: Path, err_path: Path) -> None:
    """In the forked child: the case's command with cwd = sandbox; exits with its code."""
    code = 99
    try:
        os.chdir(sandbox)
        err = os.open(err_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        if case.stdout == "closed":
            read_end, out = os.pipe()
            os.close(read_end)  # a reader that has gone: `| head -1` after its line
        else:
            out = os.open(out_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(out, 1)
        os.dup2(err, 2)
        sys.stdout = open(1, "w", closefd=False)
        sys.stderr = open(2, "w", closefd=False)
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, signal.SIG_DFL)
        if "torch" in sys.modules:
            # one intra-op thread: a forked child that enters the OpenMP pool its parent started
            # hangs (GNU OpenMP is not fork-safe; every collect case hung after a parent matmul)
            sys.modules["torch"].set_num_threads(1)
        from mcore_proxy.cli import main

        try:
            code = main(list(case.argv))
        except SystemExit as stop:  # argparse's usage errors exit 2 this way, as on the command line
            code = stop.code if isinstance(stop.code, int) else 1
        try:
            sys.stdout.flush()
        except BrokenPipeError:
            pass
        sys.stderr.flush()
    except BaseException:  # noqa: BLE001 - reported as the case's failure, never silently
        import traceback

        traceback.print_exc()
        sys.stderr.flush()
    finally:
        os._exit(code)


@dataclass
class Running:
    """A case whose child runs: its sandbox, the sandbox's snapshot before, and when it started."""

    case: CliCase
    pid: int
    sandbox: Path
    before: dict
    start: float


def _streams(sandbox: Path) -> tuple[Path, Path]:
    return sandbox.with_name(sandbox.name + ".stdout"), sandbox.with_name(sandbox.name + ".stderr")


def start_case(case: CliCase, corpus: Path, work: Path) -> Running:
    """Copy the corpus into a sandbox, damage it, and fork the child that runs the command (the
    parent has one thread: a fork never copies a lock held by another thread)."""
    sandbox = work / "cases" / case.name.replace("/", "__")
    shutil.rmtree(sandbox, ignore_errors=True)
    shutil.copytree(corpus, sandbox, symlinks=True)
    (sandbox / "done").unlink()
    apply_setup(case.setup, sandbox)
    before = snapshot(sandbox)
    start = time.monotonic()
    pid = os.fork()
    if pid == 0:
        _child(case, sandbox, *_streams(sandbox))
    return Running(case, pid, sandbox, before, start)


def finish_case(run: Running, status: int | None) -> dict:
    """Judge a case whose child has exited (status None: it was killed at the limit)."""
    out_path, err_path = _streams(run.sandbox)
    stderr = err_path.read_text(errors="replace") if err_path.exists() else ""
    stdout = out_path.read_text(errors="replace") if out_path.exists() else ""
    code = None if status is None else os.waitstatus_to_exitcode(status)
    outside = changed_outside(run.before, snapshot(run.sandbox), run.case.outputs)
    return {
        "case": run.case.name,
        "rule": run.case.rule,
        "outcome": "hang" if code is None else f"exit {code}",
        "seconds": round(time.monotonic() - run.start, 2),
        "problems": judge(run.case, code, stdout, stderr, outside),
        "stderr": stderr[-800:],
    }


def judge(case: CliCase, code: int | None, stdout: str, stderr: str, outside: list[str]) -> list[str]:
    """Every rule the case can break (module docstring)."""
    problems = []
    if code is None:
        problems.append(f"no exit within {LIMIT_S:.0f} s")
    elif code not in case.expect:
        problems.append(f"exit {code}, expected {sorted(case.expect)}")
    if "Traceback (most recent call last)" in stderr:
        problems.append("a traceback on stderr")
    if code == 2:
        errors = [line for line in stderr.splitlines() if ": error:" in line]
        if len(errors) != 1:
            problems.append(f"exit 2 with {len(errors)} error lines")
    if case.says and case.says not in stderr + stdout:
        problems.append(f"does not say {case.says!r}")
    if case.stdout == "closed" and stderr.strip() and "error" in stderr:
        problems.append("a closed stdout reported as an error")
    if outside:
        problems.append(f"changed outside its output: {outside[:5]}")
    return problems


def campaign(cases: list[CliCase], corpus: Path, work: Path, *, jobs: int = 2, progress: bool = True) -> list[dict]:
    """Run `cases`, `jobs` children at a time, from this one thread; records in case order."""
    from tqdm import tqdm

    preload()
    queue, running, records = list(cases), [], {}
    with tqdm(total=len(cases), desc="fuzz-cli", unit="case", disable=not progress) as bar:
        while queue or running:
            while queue and len(running) < jobs:
                running.append(start_case(queue.pop(0), corpus, work))
            time.sleep(0.02)
            for run in list(running):
                done, status = os.waitpid(run.pid, os.WNOHANG)
                if not done and time.monotonic() - run.start < LIMIT_S:
                    continue
                if not done:
                    os.kill(run.pid, signal.SIGKILL)
                    os.waitpid(run.pid, 0)
                    status = None
                running.remove(run)
                records[run.case.name] = finish_case(run, status)
                bar.update()
    return [records[c.name] for c in cases]


def preload() -> None:
    """Import what the commands import, once in the parent, so that every forked child has it."""
    import mcore_proxy.checkpoint.formats  # noqa: F401
    import mcore_proxy.cli  # noqa: F401
    import mcore_proxy.convert.pipeline  # noqa: F401
    import mcore_proxy.select.selector  # noqa: F401


def table(records: list[dict]) -> str:
    rows = collections.defaultdict(collections.Counter)
    for r in records:
        rows[r["rule"]][r["outcome"]] += 1
        rows[r["rule"]]["failed"] += bool(r["problems"])
    outcomes = sorted({o for c in rows.values() for o in c if o != "failed"})
    head = f"{'rule':<10}{'cases':>6}" + "".join(f"{o:>9}" for o in outcomes) + f"{'failed':>8}"
    lines = [head]
    for rule, c in sorted(rows.items()):
        total = sum(v for o, v in c.items() if o != "failed")
        lines.append(f"{rule:<10}{total:>6}" + "".join(f"{c[o]:>9}" for o in outcomes) + f"{c['failed']:>8}")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", type=Path, required=True)
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--only", default="", help="run the cases whose name starts with this")
    args = parser.parse_args(argv)
    from mcore_proxy.testing.fixtures import build_fixture

    legacy, _ = build_fixture(FIXTURE, args.workdir / "fixtures")
    corpus = build_corpus(args.workdir, legacy)
    cases = [
        c
        for c in make_cases()
        if c.name.startswith(args.only) and (c.needs != "hf" or (corpus / "hf_unrunnable").is_dir())
    ]
    start = time.perf_counter()
    records = campaign(cases, corpus, args.workdir)
    print(table(records))
    print(f"{len(records)} cases in {time.perf_counter() - start:.0f} s")
    for r in records:
        if r["problems"]:
            print(f"FAILED {r['case']}: {r['outcome']}: {'; '.join(r['problems'])}\n    {r['stderr'][-300:]!r}")
    return 1 if any(r["problems"] for r in records) else 0


if __name__ == "__main__":
    sys.exit(main())
