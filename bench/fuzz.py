"""Fuzz campaign: damaged and hostile checkpoints, statistics and plans against the CLI.

Inputs are real: a legacy checkpoint saved by megatron-core (the `seq_tp2_pp2_ep2` fixture), the
same weights as torch_dist (written by `convert --format torch_dist`, and with `--megatron-dist`
also one saved by megatron-core's dist_checkpointing), routing statistics written by
`stats.save_stats`, a plan made by `select`, and a proxy made by `convert`. Each case copies one
input, damages it one way (truncation at an offset, byte flips in zip headers / pickles /
safetensors headers / anywhere, swapped, duplicated or missing files, wrong trackers, hostile
pickles calling os.system, eval, exec, subprocess or builtins.open, getattr shapes other than an
enum member by name (a chain from an allowed enum class to os.system among them), args enums
re-pickled by name or by value (benign: both must read alike), deep nesting, huge declared
sizes, traversal paths in torch_dist metadata, hostile plan and sidecar JSON), then runs one
command (inspect, convert, verify, stats show, select) through the CLI's `main()` in a forked
child with a 30 s limit. A case passes when:
  - it ends within the limit with exit code 0, 1 or 2 (0 where the damage does not matter);
  - stderr holds no traceback;
  - the marker file every payload would create does not exist (for a successful convert, also
    after loading every output file the ways Megatron does: `torch.load(weights_only=False)` of
    older Megatron-LM, and torch's default, weights_only with megatron-core's safe globals);
  - the input is byte-for-byte unchanged;
  - a failed convert left no output and no staging folder.

    python bench/fuzz.py --cases 2000 --jobs 2 --workdir /tmp/fuzz      # the campaign
    python bench/fuzz.py --cases 100 --seed 1                             # a quick sample

`tests/test_fuzz.py` runs a fixed sample of about 100 cases in the test suite.
"""
from __future__ import annotations

import argparse
import collections
import hashlib
import json
import os
import random
import shutil
import signal
import sys
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

LIMIT_S = 30.0
FIXTURE = "seq_tp2_pp2_ep2"
KEEP = 4


# -- the corpus ---------------------------------------------------------------------------------

def build_corpus(work: Path, legacy_ckpt: Path, megatron_dist: Path | None = None) -> Path:
    """Inputs every case copies from (built once): legacy, dist, plan, stats, proxy."""
    from mcore_proxy.checkpoint import open_checkpoint
    from mcore_proxy.cli import main
    from mcore_proxy.select import select_experts
    from mcore_proxy.select.synthetic import planted_stats
    from mcore_proxy.stats import save_stats

    corpus = work / "corpus"
    if (corpus / "done").is_file():
        return corpus
    shutil.rmtree(corpus, ignore_errors=True)
    corpus.mkdir(parents=True)
    shutil.copytree(legacy_ckpt, corpus / "legacy")
    view = open_checkpoint(corpus / "legacy")
    spec = view.spec
    stats, _ = planted_stats(spec.moe_layer_ids, topk=spec.topk, num_experts=spec.num_experts, clusters=KEEP,
                             hidden=spec.hidden_size, tokens=500, seed=3)
    save_stats(stats, corpus / "stats.safetensors")
    select_experts(view, stats, KEEP, target_ep=1).save(corpus / "plan.json")
    quiet = ["--target-tp", "1", "--target-pp", "1", "--target-ep", "1"]
    assert main(["convert", str(corpus / "legacy"), "-o", str(corpus / "dist"), "--format", "torch_dist", *quiet]) == 0
    assert main(["convert", str(corpus / "legacy"), "--plan", str(corpus / "plan.json"), "-o",
                 str(corpus / "proxy"), *quiet]) == 0
    if megatron_dist is not None:
        shutil.copytree(megatron_dist, corpus / "mdist")
    (corpus / "done").write_text("ok")
    return corpus


def megatron_torch_dist(work: Path) -> Path:
    """A torch_dist checkpoint saved by megatron-core's dist_checkpointing (TP=2, EP=2)."""
    from mcore_proxy.functional.model import Layout
    from mcore_proxy.testing.dist_ckpt import save_torch_dist
    from mcore_proxy.testing.fixtures import FIXTURES

    out = work / "megatron-dist"
    if not (out / "latest_checkpointed_iteration.txt").is_file():
        shutil.rmtree(out, ignore_errors=True)
        model, _ = FIXTURES[FIXTURE]
        save_torch_dist(model, Layout(tp=2, ep=2), out)
    return out


# -- mutations ----------------------------------------------------------------------------------

def payloads(marker: Path) -> dict:
    """name -> an object pickling as a call that would create `marker`."""
    import builtins
    import subprocess

    from mcore_proxy.testing.hostile import Call

    m = str(marker)
    return {
        "os.system": Call(os.system, f"touch {m}"),
        "eval": Call(builtins.eval, f"open({m!r}, 'w')"),
        "exec": Call(builtins.exec, f"open({m!r}, 'w').write('x')"),
        "subprocess": Call(subprocess.call, ["touch", m]),
        "open": Call(builtins.open, m, "w"),
    }


def _files(root: Path, pattern: str = "*") -> list[Path]:
    if root.is_file():
        return [root] if root.match(pattern) else []
    return sorted(p for p in root.rglob(pattern) if p.is_file())


def _members(path: Path) -> list[zipfile.ZipInfo]:
    try:
        with zipfile.ZipFile(path) as z:
            return z.infolist()
    except (zipfile.BadZipFile, OSError):
        return []


def _flip(path: Path, rng: random.Random, lo: int, hi: int, count: int) -> str:
    data = bytearray(path.read_bytes())
    hi = min(hi, len(data))
    if hi <= lo:
        return "nothing to flip"
    spots = sorted(rng.randrange(lo, hi) for _ in range(count))
    for i in spots:
        data[i] ^= rng.randrange(1, 256)
    path.write_bytes(bytes(data))
    return f"{count} bytes in [{lo}, {hi})"


def _zip_region(path: Path, rng: random.Random, region: str) -> tuple[int, int]:
    infos = _members(path)
    size = path.stat().st_size
    if not infos:
        return 0, size
    if region == "header":
        i = rng.choice(infos)
        return i.header_offset, i.header_offset + 30 + len(i.filename)
    if region == "central":
        start = max(i.header_offset + 30 + len(i.filename) + i.compress_size for i in infos)
        return start, size
    pkl = [i for i in infos if i.filename.endswith("data.pkl")]
    i = pkl[0] if pkl else rng.choice(infos)
    start = i.header_offset + 30 + len(i.filename) + len(i.extra)
    return start, start + i.file_size


def _edit_state(path: Path, edit) -> None:
    import torch

    state = torch.load(path, weights_only=False)   # the fuzzer's own input: trusted here
    edit(state)
    torch.save(state, path)


def _edit_args(root: Path, edit) -> None:
    for f in _files(root, "model_optim_rng.pt") + _files(root, "common.pt"):
        _edit_state(f, lambda s: edit(s["args"]))


def _nest(depth: int):
    value: list = []
    for _ in range(depth):
        value = [value]
    return value


def _huge_tensor(path: Path) -> None:
    """Replace the file by one whose pickle declares 2**50 elements over a 16-byte storage."""
    import torch

    from mcore_proxy.checkpoint.torchfile import TorchFileWriter, _TensorRecord

    state = torch.load(path, weights_only=False)
    writer = TorchFileWriter(path)
    rec = writer.add(torch.zeros(4))
    model = state.get("model", {}) if isinstance(state, dict) else {}
    key = next((k for k, v in model.items() if isinstance(v, torch.Tensor)), "w")
    huge = _TensorRecord(rec.key, torch.float32, torch.Size([1 << 25, 1 << 25]))
    if "model" in state:
        writer.close({"args": state["args"], "checkpoint_version": 3.0, "iteration": 10, "model": {key: huge}})
    else:
        writer.close({**state, "args": state["args"], "sneaked": huge})


def _edit_dcp(path: Path, rng: random.Random, marker: Path) -> str:
    import pickle

    with open(path, "rb") as fh:
        md = pickle.load(fh)   # written by our own conversion: trusted
    what = rng.choice(["traversal", "absolute", "huge_length", "huge_offset", "huge_shape", "negative", "payload"])
    key = rng.choice(list(md.storage_data))
    info = md.storage_data[key]
    if what == "traversal":
        info.relative_path = "../../" + info.relative_path
    elif what == "absolute":
        info.relative_path = "/etc/passwd"
    elif what == "huge_length":
        info.length = 1 << 50
    elif what == "huge_offset":
        info.offset = 1 << 50
    elif what == "negative":
        info.offset = -5
    elif what == "huge_shape":
        k = rng.choice([k for k, v in md.state_dict_metadata.items() if hasattr(v, "size")])
        v = md.state_dict_metadata[k]
        v.size = type(v.size)([1 << 40] + list(v.size[1:]))
    else:
        md.planted = payloads(marker)["os.system"]
    with open(path, "wb") as fh:
        pickle.dump(md, fh)
    return what


TRACKERS = ["", "abc", "-3", "99999999999999999999", "release", "7", "10\n10", "\x00\xff", " 10 ", "1e3"]


def mutate(kind: str, root: Path, rng: random.Random, marker: Path) -> str:
    """Damage the input at `root` (a folder or one file) one way; returns what was done."""
    if kind == "truncate":
        f = rng.choice(_files(root))
        size = f.stat().st_size
        cut = rng.randrange(0, max(1, size))
        with open(f, "r+b") as fh:
            fh.truncate(cut)
        return f"{f.name} cut to {cut} of {size}"
    if kind in ("zip_header", "zip_central", "pickle"):
        zips = [f for f in _files(root) if _members(f)]
        f = rng.choice(zips or _files(root))
        lo, hi = _zip_region(f, rng, {"zip_header": "header", "zip_central": "central", "pickle": "pickle"}[kind])
        return f"{f.name}: " + _flip(f, rng, lo, hi, rng.choice([1, 2, 8]))
    if kind == "flip_any":
        f = rng.choice(_files(root))
        return f"{f.name}: " + _flip(f, rng, 0, f.stat().st_size, rng.choice([1, 16]))
    if kind == "safetensors_header":
        f = root if root.is_file() else rng.choice(_files(root, "*.safetensors"))
        n = int.from_bytes(f.read_bytes()[:8], "little")
        return _flip(f, rng, 0, min(8 + n, f.stat().st_size), rng.choice([1, 3]))
    if kind in ("swap", "duplicate", "delete"):
        files = _files(root, "model_optim_rng.pt") or _files(root, "*.distcp") or _files(root)
        a, b = rng.sample(files, 2) if len(files) > 1 else (files[0], files[0])
        if a == b and kind != "delete":
            return f"only {a.relative_to(root)}: nothing to {kind}"
        if kind == "delete":
            a.unlink()
            return f"deleted {a.relative_to(root)}"
        if kind == "duplicate":
            shutil.copy(a, b)
            return f"{a.relative_to(root)} copied over {b.relative_to(root)}"
        tmp = a.with_name(a.name + ".swap")
        a.rename(tmp)
        b.rename(a)
        tmp.rename(b)
        return f"swapped {a.relative_to(root)} and {b.relative_to(root)}"
    if kind == "tracker":
        text = rng.choice(TRACKERS)
        (root / "latest_checkpointed_iteration.txt").write_bytes(text.encode("utf-8", "surrogateescape"))
        return f"tracker {text!r}"
    if kind == "hostile_args":
        name, payload = rng.choice(sorted(payloads(marker).items()))
        field = rng.choice(["post_hook", "data_path", "transformer_impl", "num_layers", "attention_backend"])
        _edit_args(root, lambda a: setattr(a, field, payload))
        return f"args.{field} = {name} call"
    if kind == "hostile_getattr":
        from mcore_proxy.testing.hostile import hostile_getattrs

        name, payload = rng.choice(sorted(hostile_getattrs(marker).items()))
        field = rng.choice(["post_hook", "transformer_impl", "num_layers", "attention_backend", "exit_signal"])
        _edit_args(root, lambda a: setattr(a, field, payload))
        return f"args.{field} = getattr shape: {name}"
    if kind == "enum_form":
        from mcore_proxy.testing.enum_forms import FORMS, rewrite_enums

        form = rng.choice(FORMS)
        rewrite_enums(root, form)
        return f"args enums pickled {form}"
    if kind == "hostile_pattern":
        from mcore_proxy.testing.hostile import eval_escape

        _edit_args(root, lambda a: setattr(a, "moe_layer_freq", eval_escape(marker)))
        return "moe_layer_freq eval escape"
    if kind == "hostile_model":
        name, payload = rng.choice(sorted(payloads(marker).items()))
        f = rng.choice(_files(root, "model_optim_rng.pt"))
        key = "decoder.layers.0.self_attention.linear_proj._extra_state"
        _edit_state(f, lambda s: s["model"].__setitem__(key, payload))
        return f"{f.parent.name} model entry = {name} call"
    if kind == "deep_nesting":
        sys.setrecursionlimit(max(sys.getrecursionlimit(), 20000))
        depth = rng.choice([100, 2000])
        _edit_args(root, lambda a: setattr(a, "nested", _nest(depth)))
        return f"args.nested {depth} levels deep"
    if kind == "huge_size":
        f = rng.choice(_files(root, "model_optim_rng.pt") or _files(root, "common.pt"))
        _huge_tensor(f)
        return f"{f.name} declares 2**50 elements"
    if kind == "dcp_metadata":
        return _edit_dcp(next(root.rglob(".metadata")), rng, marker)
    if kind == "json":
        return _mutate_json(root, rng)
    raise ValueError(kind)


def _mutate_json(path: Path, rng: random.Random) -> str:
    doc = json.loads(path.read_text())
    how = rng.choice(["truncate", "flip", "deep", "field"])
    if how == "truncate":
        text = path.read_text()
        path.write_text(text[:rng.randrange(len(text))])
        return "json truncated"
    if how == "flip":
        return "json " + _flip(path, rng, 0, path.stat().st_size, 4)
    if how == "deep":
        path.write_text("[" * 100_000 + "]" * 100_000)
        return "json nested 100000 deep"
    leaves = []

    def walk(node, trail):
        if isinstance(node, dict):
            for k, v in node.items():
                walk(v, trail + [k])
        elif isinstance(node, list):
            for i, v in enumerate(node):
                walk(v, trail + [i])
        leaves.append(trail)

    walk(doc, [])
    trail = rng.choice([t for t in leaves if t])
    parent = doc
    for step in trail[:-1]:
        parent = parent[step]
    parent[trail[-1]] = rng.choice([None, -1, 10**30, "x", [], {}, 1.5, True, [99, 99], "../../etc"])
    path.write_text(json.dumps(doc))
    return f"json {'.'.join(map(str, trail))} replaced"


# -- cases --------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Case:
    index: int
    target: str          # which corpus input is damaged: legacy, dist, mdist, proxy, plan, stats
    kind: str            # mutation
    command: str         # inspect, convert, convert_plan, convert_dist, verify, stats_show, select
    seed: int


KINDS = {
    "legacy": ["truncate", "zip_header", "zip_central", "pickle", "flip_any", "swap", "duplicate", "delete",
               "tracker", "hostile_args", "hostile_getattr", "enum_form", "hostile_pattern", "hostile_model",
               "deep_nesting", "huge_size"],
    "dist": ["truncate", "zip_header", "pickle", "flip_any", "duplicate", "delete", "tracker", "hostile_args",
             "hostile_getattr", "enum_form", "hostile_pattern", "deep_nesting", "huge_size", "dcp_metadata"],
    "proxy": ["truncate", "pickle", "flip_any", "swap", "delete", "tracker", "hostile_args", "hostile_getattr",
              "enum_form"],
    "plan": ["json"],
    "stats": ["truncate", "safetensors_header", "flip_any", "sidecar"],
}
COMMANDS = {
    "legacy": ["inspect", "inspect", "convert", "convert_plan", "verify_orig"],
    "dist": ["inspect", "inspect", "convert", "convert_dist"],
    "proxy": ["verify_proxy"],
    "plan": ["convert_plan", "verify_plan"],
    "stats": ["stats_show", "select"],
}
WEIGHTS = {"legacy": 5, "dist": 3, "proxy": 1, "plan": 1, "stats": 1}


def make_cases(n: int, seed: int, targets=None) -> list[Case]:
    rng = random.Random(seed)
    with_mdist = bool(targets) and "mdist" in targets
    targets = [t for t in (targets or WEIGHTS) if t in WEIGHTS]
    weights = [WEIGHTS[t] for t in targets]
    out = []
    for i in range(n):
        target = rng.choices(targets, weights)[0]
        if target == "dist" and with_mdist and rng.random() < 0.5:
            target = "mdist"
        base = "dist" if target == "mdist" else target
        out.append(Case(i, target, rng.choice(KINDS[base]), rng.choice(COMMANDS[base]), rng.randrange(1 << 30)))
    return out


def _argv(case: Case, corpus: Path, inp: Path, out: Path) -> list[str]:
    c = {k: str(corpus / k) for k in ("legacy", "plan.json", "proxy", "stats.safetensors")}
    i, o = str(inp), str(out)
    quiet = ["--target-tp", "1", "--target-pp", "1", "--target-ep", "1"]
    return {
        "inspect": ["inspect", i],
        "convert": ["convert", i, "-o", o, *quiet],
        "convert_dist": ["convert", i, "-o", o, "--format", "torch_dist"],
        "convert_plan": ["convert", c["legacy"] if case.target == "plan" else i, "--plan",
                         i if case.target == "plan" else c["plan.json"], "-o", o, *quiet],
        "verify_orig": ["verify", "--orig", i, "--proxy", c["proxy"], "--plan", c["plan.json"]],
        "verify_proxy": ["verify", "--orig", c["legacy"], "--proxy", i, "--plan", c["plan.json"]],
        "verify_plan": ["verify", "--orig", c["legacy"], "--proxy", c["proxy"], "--plan", i],
        "stats_show": ["stats", "show", i],
        "select": ["select", "--ckpt", c["legacy"], "--stats", i, "--num-experts", str(KEEP), "-o",
                   str(out / "plan.json")],
    }[case.command]


def tree_digest(path: Path) -> str:
    h = hashlib.sha256()
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    for p in files:
        h.update(str(p.relative_to(path.parent)).encode())
        h.update(p.read_bytes())
    if path.is_file() and path.with_suffix(".json").is_file():   # a stats sidecar
        h.update(path.with_suffix(".json").read_bytes())
    return h.hexdigest()


def _child(case: Case, corpus: Path, case_dir: Path, result_path: Path) -> None:
    """Runs in the forked child: damage a copy, run the command, record what happened."""
    import torch

    torch.set_num_threads(1)   # a forked child must not use the parent's OpenMP pool
    rng = random.Random(case.seed)
    marker = case_dir / "MARKER"
    source = {"legacy": "legacy", "dist": "dist", "mdist": "mdist", "proxy": "proxy", "plan": "plan.json",
              "stats": "stats.safetensors"}[case.target]
    inp = case_dir / source
    if (corpus / source).is_dir():
        shutil.copytree(corpus / source, inp)
    else:
        shutil.copy(corpus / source, inp)
        if source.endswith(".safetensors"):
            shutil.copy((corpus / source).with_suffix(".json"), inp.with_suffix(".json"))
    kind = case.kind
    if kind == "sidecar":
        what = _mutate_json(inp.with_suffix(".json"), rng)
    else:
        what = mutate(kind, inp, rng, marker)
    out = case_dir / "out"
    if case.command == "select":
        out.mkdir()
    before = tree_digest(inp)
    err_path, out_path = case_dir / "stderr", case_dir / "stdout"
    fd_err, fd_out = os.open(err_path, os.O_WRONLY | os.O_CREAT), os.open(out_path, os.O_WRONLY | os.O_CREAT)
    os.dup2(fd_err, 2)
    os.dup2(fd_out, 1)
    sys.stderr = os.fdopen(2, "w", buffering=1)
    sys.stdout = os.fdopen(1, "w", buffering=1)
    from mcore_proxy.cli import main

    argv = _argv(case, corpus, inp, out)
    try:
        code = main(argv)
    except SystemExit as stop:   # argparse
        code = stop.code if isinstance(stop.code, int) else 2
    loaded = 0
    if code == 0 and case.command.startswith("convert") and out.is_dir():
        import megatron.core  # noqa: F401  (registers megatron-core's safe globals, as Megatron-LM has them)

        for f in _files(out, "*.pt"):   # load the proxy the ways Megatron does
            torch.load(f, weights_only=False)
            torch.load(f, map_location="cpu")
            loaded += 1
    sys.stdout.flush()
    sys.stderr.flush()
    result = {"code": code, "what": what, "argv": argv, "unchanged": tree_digest(inp) == before,
              "loaded": loaded, "out_exists": out.exists() and case.command != "select",
              "staging": [p.name for p in case_dir.iterdir() if ".mcore-proxy" in p.name]}
    result_path.write_text(json.dumps(result))


def start_case(case: Case, corpus: Path, work: Path) -> tuple[int, Path, float]:
    """Fork the child of one case -> (pid, case folder, start time)."""
    case_dir = work / f"case{case.index:05d}"
    shutil.rmtree(case_dir, ignore_errors=True)
    case_dir.mkdir(parents=True)
    start = time.perf_counter()
    pid = os.fork()
    if pid == 0:   # the child
        code = 0
        try:
            os.setpgid(0, 0)
            _child(case, corpus, case_dir, case_dir / "result.json")
        except BaseException:  # noqa: BLE001 - the fuzzer's own failure in the child: record it
            import traceback
            (case_dir / "child_error").write_text(traceback.format_exc())
            code = 70
        finally:
            os._exit(code)
    return pid, case_dir, start


def campaign(cases: list[Case], corpus: Path, work: Path, jobs: int = 1, limit: float = LIMIT_S,
             progress: bool = True) -> list[dict]:
    """Run cases with up to `jobs` children at a time; a child past `limit` seconds is killed (a hang).

    The parent stays single-threaded (it only forks and waits): forking from a threaded process
    could hand a child a lock held by another thread."""
    import tqdm as tqdm_module
    from tqdm import tqdm

    tqdm_module.tqdm.monitor_interval = 0   # no monitor thread: the parent forks
    pending, running, records = list(cases), {}, []
    with tqdm(total=len(cases), disable=not progress, desc="fuzz") as bar:
        while pending or running:
            while pending and len(running) < jobs:
                case = pending.pop(0)
                pid, case_dir, start = start_case(case, corpus, work)
                running[pid] = (case, case_dir, start)
            for pid, (case, case_dir, start) in list(running.items()):
                done, status = os.waitpid(pid, os.WNOHANG)
                seconds = time.perf_counter() - start
                if not done and seconds < limit:
                    continue
                if not done:
                    os.killpg(pid, signal.SIGKILL)
                    os.waitpid(pid, 0)
                    status = None
                    seconds = limit
                del running[pid]
                records.append(judge(case, case_dir, status, seconds, limit))
                bar.update(1)
            time.sleep(0.01)
    return sorted(records, key=lambda r: r["case"])


def judge(case: Case, case_dir: Path, status, seconds: float, limit: float) -> dict:
    record = {"case": case.index, "target": case.target, "kind": case.kind, "command": case.command,
              "seconds": round(seconds, 2)}
    stderr = (case_dir / "stderr").read_text(errors="replace") if (case_dir / "stderr").exists() else ""
    problems = []
    if seconds >= limit:
        record["outcome"], problems = "hang", ["no exit within the time limit"]
    elif (case_dir / "child_error").exists():
        record["outcome"], problems = "fuzzer error", [(case_dir / "child_error").read_text()[-500:]]
    elif not (case_dir / "result.json").exists():
        record["outcome"] = f"died ({os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)})"
        problems = ["the process died without a result"]
    else:
        r = json.loads((case_dir / "result.json").read_text())
        record.update(what=r["what"], argv=r["argv"], outcome=f"exit {r['code']}")
        if r["code"] not in (0, 1, 2):
            problems.append(f"exit code {r['code']}")
        if "Traceback" in stderr:
            problems.append("traceback on stderr")
        if not r["unchanged"]:
            problems.append("input modified")
        if r["code"] != 0 and r["out_exists"]:
            problems.append("a failed run left its output")
        if r["staging"]:
            problems.append(f"staging left: {r['staging']}")
    if (case_dir / "MARKER").exists():
        problems.append("CODE RAN (marker file exists)")
    record["problems"] = problems
    if problems:
        record["stderr"] = stderr[-1500:]
    else:
        shutil.rmtree(case_dir, ignore_errors=True)
    return record


def table(records: list[dict]) -> str:
    """Markdown: cases by target and mutation, counts per outcome, and failures."""
    outcomes = sorted({r["outcome"] for r in records})
    rows = collections.defaultdict(collections.Counter)
    for r in records:
        rows[(r["target"], r["kind"])][r["outcome"]] += 1
    head = "| input | damage | cases | " + " | ".join(outcomes) + " | failed |"
    lines = [head, "|" + "---|" * (4 + len(outcomes))]
    for (target, kind), counts in sorted(rows.items()):
        failed = sum(1 for r in records if (r["target"], r["kind"]) == (target, kind) and r["problems"])
        lines.append(f"| {target} | {kind} | {sum(counts.values())} | "
                     + " | ".join(str(counts.get(o, 0)) for o in outcomes) + f" | {failed} |")
    total = collections.Counter(r["outcome"] for r in records)
    failed = sum(1 for r in records if r["problems"])
    lines.append(f"| **all** | | **{len(records)}** | " + " | ".join(f"**{total.get(o, 0)}**" for o in outcomes)
                 + f" | **{failed}** |")
    return "\n".join(lines)


def summary(records: list[dict]) -> dict:
    problems = collections.Counter(p.split(":")[0] for r in records for p in r["problems"])
    return {"cases": len(records), "failed": sum(1 for r in records if r["problems"]),
            "tracebacks": problems.get("traceback on stderr", 0),
            "hangs": sum(1 for r in records if r["outcome"] == "hang"),
            "code_runs": problems.get("CODE RAN (marker file exists)", 0),
            "inputs_modified": problems.get("input modified", 0),
            "median_s": sorted(r["seconds"] for r in records)[len(records) // 2] if records else 0}


def preload(corpus: Path | None = None) -> None:
    """Import what the commands (and the fuzzer's own edits) import, once in the parent: every
    forked child then has it. Loading a rank file with torch.load imports megatron (its enums are
    in `args`), which costs seconds."""
    if corpus is not None:
        import torch

        torch.load(next((corpus / "legacy").rglob("model_optim_rng.pt")), weights_only=False)
    import importlib

    for module in ("mcore_proxy.cli", "mcore_proxy.checkpoint.legacy", "mcore_proxy.checkpoint.torch_dist",
                   "mcore_proxy.convert.pipeline", "mcore_proxy.convert.verify", "mcore_proxy.select.selector",
                   "mcore_proxy.stats", "mcore_proxy.trace.summary"):
        importlib.import_module(module)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", type=int, default=2000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--jobs", type=int, default=1)
    p.add_argument("--workdir", type=Path, default=Path("/tmp/mcore-proxy-fuzz"))
    p.add_argument("--megatron-dist", action="store_true",
                   help="also fuzz a torch_dist checkpoint saved by megatron-core itself (built once)")
    p.add_argument("--json", type=Path, help="write every record here")
    p.add_argument("--only", nargs="+", metavar="INPUT",
                   help="run only the cases (same numbers and seeds) that damage these inputs, e.g. stats")
    p.add_argument("--kinds", nargs="+", metavar="KIND",
                   help="run only the cases (same numbers and seeds) of these damage kinds, e.g. hostile_getattr")
    args = p.parse_args(argv)

    from mcore_proxy.testing.fixtures import build_fixture

    args.workdir.mkdir(parents=True, exist_ok=True)
    cache = Path(os.environ.get("MCORE_PROXY_FIXTURE_CACHE", args.workdir / "fixtures"))
    legacy, _ = build_fixture(FIXTURE, cache)
    mdist = megatron_torch_dist(args.workdir) if args.megatron_dist else None
    corpus = build_corpus(args.workdir, legacy, mdist)
    preload(corpus)
    targets = list(WEIGHTS) + (["mdist"] if mdist else [])
    cases = make_cases(args.cases, args.seed, targets)
    if args.only:
        cases = [c for c in cases if c.target in args.only]
    if args.kinds:
        cases = [c for c in cases if c.kind in args.kinds]
    start = time.perf_counter()
    records = campaign(cases, corpus, args.workdir / "cases", jobs=args.jobs)
    wall = time.perf_counter() - start
    if args.json:
        args.json.write_text(json.dumps(records, indent=1))
    print(table(records))
    print(json.dumps({**summary(records), "wall_s": round(wall, 1), "seed": args.seed, "jobs": args.jobs}))
    for r in records:
        if r["problems"]:
            print(f"case {r['case']} {r['target']}/{r['kind']} {r['command']}: {r['problems']}\n{r.get('stderr', '')}")
    return 1 if any(r["problems"] for r in records) else 0


if __name__ == "__main__":
    sys.exit(main())
