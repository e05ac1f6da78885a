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

With `--hf` the campaign runs on Hugging Face inputs instead (no Megatron fixture is built): tiny
MoE checkpoints that transformers saves in several shards (`testing/hf_fixtures.py`), of three
families that store the MoE block differently (`HF_MODELS`: qwen2_moe per expert, gpt_oss fused with
a router bias, deepseek_v4 with a hash table, hyper-connections and an MTP block) and a quantized
copy of each (`HF_QUANTIZED`, `testing/quantized.py`: FP8 `*_scale_inv` blocks, gpt-oss MXFP4
`*_blocks`/`*_scales`, DeepSeek-V4's release with FP4 experts and E8M0 `.scale`); for each, routing
statistics from `collect`, a plan from `select` (K = E/2) and a proxy from `convert` (HF -> HF), all
built once in a forked child (`build_hf_corpus`). Inputs (`HF_TARGETS`): `hf` (a checkpoint),
`hf_proxy`, `hf_stats`, `hf_plan`. Damage kinds: `st_length` (the 8-byte header length: huge,
negative as signed, past EOF, short, odd), `st_json` (the header cut, garbage, not UTF-8, an array,
null, 100 000 deep, a duplicate key, trailing bytes, NaN, a BOM), `st_dtype` (unknown or other dtype
strings, non-strings), `st_offsets` (inverted, overlapping, out of range, negative, non-integer,
malformed), `st_shape` (sizes not matching the bytes, negative, overflowing, transposed, an extra
1), `st_entry` (an entry not an object, renamed to "", ../, 100 000 characters or NUL, removed, a
zero-size extra, an extra field), `st_metadata` (__metadata__ not a map of strings, another format,
100 kB, removed), `hf_truncate`, `flip_data` (bytes of tensor data: benign), `shards` (missing,
unlisted copies or another model's shard, swapped, duplicated, renamed, a folder, a symlink, a FIFO,
empty, all gone), `index` (model.safetensors.index.json: weight_map missing or not a map, shard
names with ../, absolute or in a subfolder, 300 characters or NUL, keys in the wrong shard, unlisted
or phantom, duplicate keys, not JSON, 100 000 deep, 300 MB, a folder, removed), `config`
(config.json: keys missing or of wrong types, expert counts zero, negative, huge or off by one,
top-k 0 or beyond the experts, architectures unknown, other families' or malformed, not JSON, 100
000 deep, a 5000-digit number, NaN/Infinity, 17 MB, duplicate keys), `tensors` (valid shards with
wrong tensors: dropped, unknown keys, a row more or less, an extra or leading-zero expert id,
NaN/inf, other dtypes, scalars, empty, 1-D), `quant` (quantized copies: scales of wrong shape or
dtype, missing, orphaned, NaN/0/negative or extreme exponents, weights of other dtype or 1-D, stray
`.scale` / `_blocks` + `_scales` / `weight_packed` companions, quantization_config damaged),
`hash_table` (DeepSeek-V4's tid2eid: ids past the experts or negative, wrong shapes,
float/bool/narrow int dtypes, dropped, on a second layer), `pickles` (a pickled
os.system/eval/exec/subprocess/open call as pytorch_model.bin, model.pt, consolidated.pth, a .bin
index, training_args.bin, beside or instead of the safetensors, as a shard or as model.safetensors,
and `auto_map` remote code that would create the marker on import), `manifest` (the proxy's
manifest.json), `plan_swap` (another family's plan), and the `json` / `sidecar` / `truncate` /
`safetensors_header` / `flip_any` kinds above for plans and statistics. Commands: `inspect`,
`convert --plan` (HF -> HF; `--dequantize` too on the quantized copies), `verify` (damaged source,
proxy or plan), `stats show`, `select`. A successful HF convert's shards are also read with
`safetensors.torch.load_file`, and no file of the proxy may be a pickle or code. `--by command kind`
(or `model kind`, ...) changes the rows of the table.

    python bench/fuzz.py --hf --cases 2000 --jobs 2 --workdir /tmp/fuzz-hf   # the HF campaign

`tests/test_fuzz.py` runs a fixed sample of about 100 Megatron cases and 30 HF cases (one per input
and damage kind, for 30 of the 31) in the test suite.
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

MEGATRON_INPUTS = ("legacy", "dist", "mdist", "proxy", "plan.json", "stats.safetensors", "stats.json", "done")


def build_corpus(
    work: Path, legacy_ckpt: Path | None, megatron_dist: Path | None = None, hf_cache: Path | None = None
) -> Path:
    """Inputs every case copies from (built once): legacy, dist, plan, stats, proxy (from
    `legacy_ckpt`, unless None); with `hf_cache` (where the tiny HF models are built and kept)
    also the HF corpus under hf/ (`build_hf_corpus`)."""
    corpus = work / "corpus"
    if legacy_ckpt is not None and not (corpus / "done").is_file():
        for name in MEGATRON_INPUTS:
            p = corpus / name
            if p.is_dir():
                shutil.rmtree(p)
            else:
                p.unlink(missing_ok=True)
        corpus.mkdir(parents=True, exist_ok=True)
        _build_megatron_inputs(corpus, legacy_ckpt, megatron_dist)
    if hf_cache is not None:
        build_hf_corpus(corpus, hf_cache)
    return corpus


def _build_megatron_inputs(corpus: Path, legacy_ckpt: Path, megatron_dist: Path | None) -> None:
    from mcore_proxy.checkpoint import open_checkpoint
    from mcore_proxy.cli import main
    from mcore_proxy.select import select_experts
    from mcore_proxy.select.synthetic import stats_like
    from mcore_proxy.core.stats import save_stats

    shutil.copytree(legacy_ckpt, corpus / "legacy")
    view = open_checkpoint(corpus / "legacy")
    spec = view.spec
    stats = stats_like(spec, KEEP, tokens=500, seed=3)
    save_stats(stats, corpus / "stats.safetensors")
    select_experts(view, stats, KEEP, target_ep=1).save(corpus / "plan.json")
    quiet = ["--target-tp", "1", "--target-pp", "1", "--target-ep", "1"]
    assert main(["convert", str(corpus / "legacy"), "-o", str(corpus / "dist"), "--format", "torch_dist", *quiet]) == 0
    assert main(["convert", corpus / "legacy", "--plan", corpus / "plan.json", "-o", corpus / "proxy", *quiet]) == 0
    if megatron_dist is not None:
        shutil.copytree(megatron_dist, corpus / "mdist")
    (corpus / "done").write_text("ok")


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

    state = torch.load(path, weights_only=False)  # the fuzzer's own input: trusted here
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

    from mcore_proxy.checkpoint.torchfile import TorchFileWriter, TensorRecord

    state = torch.load(path, weights_only=False)
    writer = TorchFileWriter(path)
    rec = writer.add(torch.zeros(4))
    model = state.get("model", {}) if isinstance(state, dict) else {}
    key = next((k for k, v in model.items() if isinstance(v, torch.Tensor)), "w")
    huge = TensorRecord(rec.key, torch.float32, torch.Size([1 << 25, 1 << 25]))
    if "model" in state:
        writer.close({"args": state["args"], "checkpoint_version": 3.0, "iteration": 10, "model": {key: huge}})
    else:
        writer.close({**state, "args": state["args"], "sneaked": huge})


def _edit_dcp(path: Path, rng: random.Random, marker: Path) -> str:
    import pickle

    with open(path, "rb") as fh:
        md = pickle.load(fh)  # written by our own conversion: trusted
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
        path.write_text(text[: rng.randrange(len(text))])
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
    target: str  # which corpus input is damaged: legacy, dist, mdist, proxy, plan, stats
    kind: str  # mutation
    command: str  # inspect, convert, convert_plan, convert_dist, convert_deq, verify_*, stats_show, select
    seed: int
    model: str = ""  # HF cases: which input of the HF corpus (HF_INPUTS)


KINDS = {
    "legacy": [
        "truncate",
        "zip_header",
        "zip_central",
        "pickle",
        "flip_any",
        "swap",
        "duplicate",
        "delete",
        "tracker",
        "hostile_args",
        "hostile_getattr",
        "enum_form",
        "hostile_pattern",
        "hostile_model",
        "deep_nesting",
        "huge_size",
    ],
    "dist": [
        "truncate",
        "zip_header",
        "pickle",
        "flip_any",
        "duplicate",
        "delete",
        "tracker",
        "hostile_args",
        "hostile_getattr",
        "enum_form",
        "hostile_pattern",
        "deep_nesting",
        "huge_size",
        "dcp_metadata",
    ],
    "proxy": [
        "truncate",
        "pickle",
        "flip_any",
        "swap",
        "delete",
        "tracker",
        "hostile_args",
        "hostile_getattr",
        "enum_form",
    ],
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


# -- Hugging Face inputs ------------------------------------------------------------------------

# tiny MoE checkpoints transformers saves in several shards (testing/hf_fixtures.py), three
# families that differ in how they store the MoE block, plus a quantized copy of each
HF_MODELS = {
    "qwen2_moe": "per-expert experts (gate/up/down_proj), a shared expert and its gate, dense layer 0",
    "gpt_oss": "fused experts (gate_up interleaved) with biases, a router logit bias, attention sinks",
    "deepseek_v4": "hash-routed layer 0 (tid2eid), selection bias, hyper-connections, an MTP block mtp.0.*",
}
# input -> (the model it copies, its maker in testing/quantized.py): the three layouts releases use
HF_QUANTIZED = {
    "qwen2_moe_fp8": ("qwen2_moe", "fp8_copy"),  # float8_e4m3fn linears, fp32 *_scale_inv blocks
    "gpt_oss_mxfp4": ("gpt_oss", "mxfp4_copy"),  # fused experts as *_blocks (FP4) + *_scales (E8M0)
    "deepseek_v4_fp4": ("deepseek_v4", "v4_release_copy"),  # release names, FP4 experts, FP8 linears, E8M0 .scale
}
HF_INPUTS = (*HF_MODELS, *HF_QUANTIZED)
HF_BASE = {**{m: m for m in HF_MODELS}, **{q: base for q, (base, _) in HF_QUANTIZED.items()}}
HF_KEEP = 4  # K = E/2: every model above has 8 routed experts


def build_hf_corpus(corpus: Path, cache: Path) -> Path:
    """corpus/hf/{input}/: `model` (save_pretrained, several shards), `stats.safetensors` + `.json`
    (`collect` on 8 calibration records), `plan.json` (`select` K = E/2), `proxy` (`convert` HF ->
    HF with the plan). A quantized copy shares its model's statistics and plan (routers are not
    quantized). Built once, in a forked child, so that the parent (which forks every case) never
    imports transformers nor runs a model."""
    root = corpus / "hf"
    if (root / "done").is_file():
        return root
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    pid = os.fork()
    if pid == 0:  # the child
        code = 1
        try:
            with open(root / "build.log", "w") as log:
                os.dup2(log.fileno(), 1)
                os.dup2(log.fileno(), 2)
                _build_hf_inputs(root, cache)
            code = 0
        except BaseException:  # noqa: BLE001 - reported by the parent
            import traceback

            (root / "build_error").write_text(traceback.format_exc())
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    if status != 0 or not (root / "done").is_file():
        error = root / "build_error"
        raise RuntimeError(
            "building the HF corpus failed:\n"
            + (error.read_text() if error.exists() else (root / "build.log").read_text()[-3000:])
        )
    return root


def _build_hf_inputs(root: Path, cache: Path) -> None:
    import torch

    from mcore_proxy.cli import main
    from mcore_proxy.testing import hf_fixtures

    torch.set_num_threads(1)
    for name in HF_MODELS:
        d = root / name
        d.mkdir()
        shutil.copytree(hf_fixtures.build_cached(name, cache), d / "model")
        data = hf_fixtures.calibration_jsonl(d / "data.jsonl", records=8)
        assert main(["collect", "--hf", d / "model", "--data", data, "-o", d / "collect", "--batch-size", "8"]) == 0
        for suffix in (".safetensors", ".json"):
            (d / "collect" / f"routing_stats{suffix}").rename(d / f"stats{suffix}")
        shutil.rmtree(d / "collect")
        assert (
            main(
                [
                    "select",
                    "--ckpt",
                    d / "model",
                    "--stats",
                    d / "stats.safetensors",
                    "--num-experts",
                    HF_KEEP,
                    "-o",
                    d / "plan.json",
                ]
            )
            == 0
        )
    from mcore_proxy.testing import quantized

    for name, (base, maker) in HF_QUANTIZED.items():
        src, d = root / base, root / name
        d.mkdir()
        getattr(quantized, maker)(src / "model", d / "model")
        for f in ("stats.safetensors", "stats.json", "plan.json"):
            shutil.copy(src / f, d / f)
    for name in HF_INPUTS:
        d = root / name
        assert main(["convert", str(d / "model"), "--plan", str(d / "plan.json"), "-o", str(d / "proxy")]) == 0
    (root / "done").write_text("ok")


def _pickle_payload(marker: Path, rng: random.Random) -> tuple[str, bytes]:
    import pickle

    name, payload = rng.choice(sorted(payloads(marker).items()))
    return name, pickle.dumps({"model.embed_tokens.weight": payload}, protocol=2)


def _shards(root: Path) -> list[Path]:
    return sorted(p for p in root.glob("*.safetensors") if p.is_file())


def _st_split(path: Path) -> tuple[bytes, bytes]:
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    return raw[8 : 8 + n], raw[8 + n :]


def _st_join(path: Path, header: bytes, data: bytes, length: int | None = None) -> None:
    header += b" " * (-len(header) % 8)
    path.write_bytes((len(header) if length is None else length).to_bytes(8, "little") + header + data)


def _st_header(root: Path, rng: random.Random, how: str) -> str:
    """Damage the header of one shard (or of the one file `root`) the way `how` says."""
    f = root if root.is_file() else rng.choice(_shards(root))
    text, data = _st_split(f)
    header = json.loads(text)
    keys = sorted(k for k in header if k != "__metadata__")
    key = rng.choice(keys)
    entry = header[key]
    where = f"{f.name}: "
    if how == "st_length":
        n, size = len(text), f.stat().st_size
        value, what = rng.choice(
            [
                (2**64 - 1, "2**64-1 (-1 signed)"),
                (2**63, "2**63 (negative signed)"),
                (2**63 - 1, "2**63-1"),
                (1 << 40, "2**40"),
                (size, "the file size (past EOF)"),
                (n + 8, "8 past the header"),
                (max(0, n - 8), "8 short"),
                (0, "0"),
                (1, "1"),
                (max(0, n - 3), "not a multiple of 8"),
                (100_000_001, "just above 100 MB"),
            ]
        )
        _st_join(f, text, data, value)
        return where + f"header length {what}"
    if how == "st_json":
        what = rng.choice(
            [
                "cut",
                "garbage",
                "non-utf8",
                "array",
                "null",
                "string",
                "deep",
                "duplicate key",
                "trailing",
                "nan",
                "bom",
                "nul padding",
                "empty",
            ]
        )
        if what == "cut":
            new = text.rstrip()[: rng.randrange(1, len(text.rstrip()))]
        elif what == "garbage":
            new = bytes(rng.randrange(256) for _ in range(len(text)))
        elif what == "non-utf8":
            i = text.index(key.encode()) + 1
            new = text[:i] + b"\xff\xfe" + text[i + 2 :]
        elif what == "array":
            new = b"[]"
        elif what == "null":
            new = b"null"
        elif what == "string":
            new = b'"model.safetensors"'
        elif what == "deep":
            new = b"[" * 100_000 + b"]" * 100_000
        elif what == "duplicate key":
            other = rng.choice(keys)
            new = b"{" + json.dumps(key).encode() + b":" + json.dumps(header[other]).encode() + b"," + text.lstrip()[1:]
        elif what == "trailing":
            new = text.rstrip() + b"}{]"
        elif what == "nan":
            new = text.replace(b"[" + str(entry["data_offsets"][0]).encode() + b",", b"[NaN,", 1)
        elif what == "bom":
            new = b"\xef\xbb\xbf" + text
        elif what == "nul padding":
            new = text.rstrip() + b"\x00" * 8
        else:
            new = b""
        _st_join(f, new, data)
        return where + f"header JSON {what}"
    if how == "st_dtype":
        value = rng.choice(
            [
                "F128",
                "",
                "f32",
                "C64",
                "F4",
                "U64",
                "I4",
                "F8_E8M0",
                "F8_E5M2",
                "BF16",
                "F16",
                "F64",
                "I64",
                "U8",
                "BOOL",
                "F6_E2M3",
                5,
                None,
                ["F32"],
                {"F32": 1},
            ]
        )
        entry["dtype"] = value
        what = f"{key} dtype {value!r}"
    elif how == "st_offsets":
        b, e = entry["data_offsets"]
        value = rng.choice(
            [
                [e, b],
                [b, e + 8],
                [max(0, b - 8), e],
                [b, 2**64 - 1],
                [b, len(data) + 100],
                [-1, e],
                [b + 0.5, e],
                [str(b), str(e)],
                [b],
                [b, e, e],
                None,
                [0, e - b],
                [b, b],
                [2**63, 2**63 + e - b],
                "0,4",
            ]
        )
        entry["data_offsets"] = value
        what = f"{key} data_offsets {value!r} (was {[b, e]})"
    elif how == "st_shape":
        shape = list(entry["shape"])
        value = rng.choice(
            [
                [shape[0] + 1, *shape[1:]] if shape else [2],
                [-1, *shape[1:]],
                [1 << 40, 1 << 40],
                [2**63],
                [1.5],
                "8",
                None,
                [],
                [*shape, 1],
                shape[::-1],
                [0],
                [[2]],
                [2**32 + s for s in shape],
                [True] * len(shape),
            ]
        )
        entry["shape"] = value
        what = f"{key} shape {value!r} (was {shape})"
    elif how == "st_entry":
        what = rng.choice(
            [
                "not an object",
                "renamed empty",
                "renamed traversal",
                "renamed long",
                "renamed nul",
                "removed",
                "zero-size extra",
                "extra field",
            ]
        )
        if what == "not an object":
            header[key] = rng.choice(["x", 5, [], None, [entry]])
        elif what.startswith("renamed"):
            new = {
                "renamed empty": "",
                "renamed traversal": "../../" + key,
                "renamed long": key + "x" * 100_000,
                "renamed nul": key + "\x00",
            }[what]
            header = {new if k == key else k: v for k, v in header.items()}
        elif what == "removed":
            del header[key]
        elif what == "zero-size extra":
            end = max(v["data_offsets"][1] for k, v in header.items() if k != "__metadata__")
            header[key.rsplit(".", 1)[0] + ".extra"] = {"dtype": "F32", "shape": [0], "data_offsets": [end, end]}
        else:
            entry["offset"] = 0
        what = f"{key}: {what}"
    else:  # st_metadata
        value = rng.choice(
            [
                [],
                5,
                "pt",
                {"format": 5},
                {"format": "np"},
                {"format": "tf"},
                {"a": {"b": 1}},
                None,
                {"k" * 1000: "v" * 100_000},
                "delete",
            ]
        )
        if value == "delete":
            header.pop("__metadata__", None)
        else:
            header["__metadata__"] = value
        what = f"__metadata__ {str(value)[:40]!r}"
    _st_join(f, json.dumps(header).encode(), data)
    return where + what


def _load_hf(root: Path) -> tuple[dict, dict[str, dict]]:
    """(index, {shard file: {key: tensor}}) of an HF folder: the fuzzer's own input, trusted."""
    from safetensors.torch import load_file

    index = json.loads((root / "model.safetensors.index.json").read_text())
    return index, {f.name: load_file(str(f)) for f in _shards(root)}


def _save_hf(root: Path, index: dict, shards: dict[str, dict], changed: set[str]) -> None:
    from safetensors.torch import save_file

    for file in changed:
        save_file({k: v.contiguous() for k, v in shards[file].items()}, str(root / file), metadata={"format": "pt"})
    (root / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def _put(index: dict, shards: dict, file: str, key: str, value) -> None:
    shards[file][key] = value
    index["weight_map"][key] = file


def _drop(index: dict, shards: dict, key: str) -> str:
    file = index["weight_map"].pop(key)
    del shards[file][key]
    return file


def _retyped(value, dtype):
    import torch

    if value.is_floating_point() or dtype.is_floating_point:
        return value.to(torch.float32).to(dtype)
    return value.to(dtype)


def _tensors(root: Path, rng: random.Random) -> str:
    """Valid safetensors files whose tensors are wrong for the model."""
    import torch

    index, shards = _load_hf(root)
    wmap = index["weight_map"]
    keys = sorted(wmap)
    routers = [k for k in keys if k.endswith(("mlp.gate.weight", "mlp.router.weight", "ffn.gate.weight"))]
    experts = [k for k in keys if ".experts." in k]
    key = rng.choice(rng.choice([routers, experts, keys]))
    file = wmap[key]
    value = shards[file][key]
    what = rng.choice(
        [
            "drop",
            "unknown key",
            "rows +1",
            "rows -1",
            "last dim +1",
            "extra expert",
            "leading zero id",
            "nan",
            "inf",
            "float16",
            "int32",
            "scalar",
            "empty rows",
            "1-D",
            "huge values",
        ]
    )
    if what == "drop":
        _drop(index, shards, key)
    elif what == "unknown key":
        _put(
            index,
            shards,
            file,
            rng.choice(
                [
                    "model.layers.1.mlp.mystery.weight",
                    "model.mystery",
                    "model.layers.99.mlp.gate.weight",
                    "mtp.7.ffn.gate.weight",
                    "lm_head.weight.extra",
                ]
            ),
            torch.zeros(4),
        )
    elif what in ("rows +1", "rows -1", "last dim +1") and value.dim():
        if what == "rows +1":
            value = torch.cat([value, value[:1]])
        elif what == "rows -1":
            value = value[:-1]
        else:
            value = torch.cat([value, value[..., :1]], dim=-1)
        shards[file][key] = value
    elif what in ("extra expert", "leading zero id") and experts:
        import re

        src = rng.choice(experts)
        m = re.search(r"\.experts\.(\d+)\.", src)
        if m:
            new = src.replace(m.group(0), ".experts.8." if what == "extra expert" else f".experts.0{m.group(1)}.")
            _put(index, shards, wmap[src], new, shards[wmap[src]][src].clone())
            key = new
        else:  # fused: one more row
            shards[wmap[src]][src] = torch.cat([shards[wmap[src]][src], shards[wmap[src]][src][:1]])
            key = src
    elif what in ("nan", "inf", "huge values") and value.is_floating_point():
        value = value.clone()
        value.view(-1)[rng.randrange(value.numel())] = {"nan": float("nan"), "inf": float("inf"), "huge values": 3e38}[
            what
        ]
        shards[file][key] = value
    elif what in ("float16", "int32"):
        shards[file][key] = _retyped(value, getattr(torch, what))
    elif what == "scalar":
        shards[file][key] = value.reshape(-1)[0].clone()
    elif what == "empty rows":
        shards[file][key] = value[:0].clone() if value.dim() else value
    elif what == "1-D":
        shards[file][key] = value.reshape(-1).clone()
    else:
        shards[file][key] = value[:0].clone() if value.dim() else value
    _save_hf(root, index, shards, set(shards))
    return f"{key}: {what}"


def _quant(root: Path, rng: random.Random) -> str:
    """Damage a quantized copy's scales (FP8 `_scale_inv` blocks, MXFP4 `_scales`, E8M0 `.scale`),
    its quantized weights, stray companions, or its quantization_config."""
    import torch

    from mcore_proxy.checkpoint.hf.quant import find_quantized

    what = rng.choice(
        [
            "scale shape",
            "scale dtype",
            "scale missing",
            "weight missing",
            "scale values",
            "weight dtype",
            "weight 1-D",
            "v4 scale",
            "mxfp4 pair",
            "int4 packed",
            "config",
            "config",
            "config",
        ]
    )
    if what == "config":
        config = json.loads((root / "config.json").read_text())
        q = config["quantization_config"]
        field, value = rng.choice(
            [
                ("weight_block_size", [0, 0]),
                ("weight_block_size", [-8, 8]),
                ("weight_block_size", [10**9, 10**9]),
                ("weight_block_size", ["8", "8"]),
                ("weight_block_size", [8]),
                ("weight_block_size", [8, 8, 8]),
                ("weight_block_size", None),
                ("weight_block_size", "8x8"),
                ("weight_block_size", [8.5, 8]),
                ("weight_block_size", [True, 8]),
                ("weight_block_size", [3, 5]),
                ("weight_block_size", [2**63, 8]),
                ("weight_block_size", [None, 8]),
                ("weight_block_size", [1e999, 8]),
                ("quant_method", "foo"),
                ("quant_method", 5),
                ("quant_method", None),
                ("fmt", "e5m2"),
                ("activation_scheme", ["x"]),
                (None, []),
                (None, "fp8"),
                (None, None),
                (None, 5),
            ]
        )
        if field is None:
            config["quantization_config"] = value
        else:
            q[field] = value
        (root / "config.json").write_text(json.dumps(config))
        return f"quantization_config{'.' + field if field else ''} = {value!r}"
    index, shards = _load_hf(root)
    wmap = index["weight_map"]
    q = rng.choice(find_quantized(sorted(wmap)))
    scale, weight = q.scale, q.weight
    if what in ("v4 scale", "mxfp4 pair", "int4 packed"):  # companions beside a 2-D `.weight`
        weight = rng.choice([k for k in sorted(wmap) if k.endswith(".weight") and shards[wmap[k]][k].dim() == 2])
    s, w = shards[wmap[scale]][scale], shards[wmap[weight]][weight]
    if what == "scale shape":
        shards[wmap[scale]][scale] = rng.choice(
            [
                torch.cat([s, s[:1]]),
                s[:, :-1] if s.dim() > 1 else s[:0],
                s.reshape(-1),
                s.unsqueeze(-1),
                s.reshape(-1)[0].clone(),
                s[:0],
                s.transpose(0, -1).contiguous(),
            ]
        )
    elif what == "scale dtype":
        dtype = rng.choice(
            [torch.bfloat16, torch.float16, torch.int32, torch.uint8, torch.float8_e4m3fn, torch.float64, torch.bool]
        )
        shards[wmap[scale]][scale] = _retyped(s, dtype)
        what += f" {dtype}"
    elif what == "scale missing":
        _drop(index, shards, scale)
    elif what == "weight missing":
        _drop(index, shards, weight)
    elif what == "scale values":
        s = s.clone()
        if s.dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16):
            s.view(-1)[rng.randrange(s.numel())] = rng.choice([float("nan"), float("inf"), 0.0, -1.0, 3e38])
        else:  # E8M0 exponents (uint8 or float8_e8m0fnu): the smallest, the largest, NaN's byte
            s.view(torch.uint8).view(-1)[rng.randrange(s.numel())] = rng.choice([0, 254, 255])
        shards[wmap[scale]][scale] = s
    elif what == "weight dtype":
        shards[wmap[weight]][weight] = _retyped(w, rng.choice([torch.bfloat16, torch.float32, torch.int8, torch.uint8]))
    elif what == "weight 1-D":
        shards[wmap[weight]][weight] = w.reshape(-1).clone()
    elif what == "v4 scale":  # DeepSeek-V4's spelling of a scale: `X.scale` beside `X.weight` (E8M0 bytes)
        stem = weight[: -len("weight")]
        _put(
            index,
            shards,
            wmap[weight],
            stem + "scale",
            torch.full(
                rng.choice([tuple(s.shape), (w.shape[0], 1), (w.shape[0], w.shape[-1] // 32 + 1), (3,)]),
                127,
                dtype=torch.uint8,
            ),
        )
        key = stem + "scale"
        what += f" {key} {list(shards[wmap[weight]][key].shape)}"
    elif what == "mxfp4 pair":  # gpt-oss's MXFP4: `X_blocks` uint8 [.., out, in/32, 16] with `X_scales`
        stem = weight[: -len(".weight")]
        shape = rng.choice([(4, 1, 16), (4, 2, 15), (4,), (0, 1, 16)])
        _put(index, shards, wmap[weight], stem + "_blocks", torch.zeros(shape, dtype=torch.uint8))
        _put(
            index,
            shards,
            wmap[weight],
            stem + "_scales",
            torch.full(rng.choice([shape[:-1] or (1,), (5, 5), (4, 1)]), 127, dtype=torch.uint8),
        )
        what += f" {stem}_blocks {list(shape)}"
    else:  # compressed-tensors int4: `X_packed` with `X_scale`
        stem = weight[: -len("weight")]
        _put(index, shards, wmap[weight], stem + "weight_packed", torch.zeros((w.shape[0], 1), dtype=torch.int32))
        if rng.random() < 0.5:
            _put(index, shards, wmap[weight], stem + "weight_scale", torch.ones((w.shape[0], 1)))
    _save_hf(root, index, shards, set(shards))
    return f"{weight}: {what}"


def _hash_table(root: Path, rng: random.Random) -> str:
    """Damage DeepSeek-V4's hash table (`tid2eid` [vocab, top-k] int: expert ids by token id)."""
    import torch

    index, shards = _load_hf(root)
    wmap = index["weight_map"]
    key = next(k for k in wmap if k.endswith("tid2eid"))
    file = wmap[key]
    t = shards[file][key]
    what = rng.choice(
        [
            "value 8",
            "value 100",
            "value -1",
            "value 2**62",
            "all 7",
            "1-D",
            "[V, k+1]",
            "[V-1, k]",
            "[V, k, 1]",
            "[0, k]",
            "[2V, k]",
            "float32",
            "float64 fractions",
            "bool",
            "int8",
            "uint8",
            "int32",
            "dropped",
            "on layer 1 too",
        ]
    )
    if what.startswith("value"):
        t = t.clone()
        t.view(-1)[rng.randrange(t.numel())] = {"value 8": 8, "value 100": 100, "value -1": -1, "value 2**62": 2**62}[
            what
        ]
    elif what == "all 7":
        t = torch.full_like(t, 7)
    elif what == "1-D":
        t = t.reshape(-1).clone()
    elif what == "[V, k+1]":
        t = torch.cat([t, t[:, :1]], dim=1)
    elif what == "[V-1, k]":
        t = t[:-1].clone()
    elif what == "[V, k, 1]":
        t = t.unsqueeze(-1).clone()
    elif what == "[0, k]":
        t = t[:0].clone()
    elif what == "[2V, k]":
        t = torch.cat([t, t])
    elif what == "float32":
        t = t.to(torch.float32)
    elif what == "float64 fractions":
        t = t.to(torch.float64) + 0.5
    elif what in ("bool", "int8", "uint8", "int32"):
        t = t.to(getattr(torch, what))
    if what == "dropped":
        _drop(index, shards, key)
    elif what == "on layer 1 too":
        _put(index, shards, file, key.replace("layers.0.", "layers.1."), t.clone())
    else:
        shards[file][key] = t
    _save_hf(root, index, shards, {file} if what != "on layer 1 too" else set(shards))
    return f"{key}: {what}"


def _shard_files(root: Path, rng: random.Random, corpus: Path) -> str:
    """Missing, extra, swapped, duplicated or odd shard files."""
    shards = _shards(root)
    a, b = rng.sample(shards, 2)
    what = rng.choice(
        [
            "missing",
            "extra copy",
            "extra foreign",
            "swap",
            "duplicate",
            "renamed",
            "folder",
            "symlink",
            "fifo",
            "empty",
            "all missing",
        ]
    )
    if what == "missing":
        a.unlink()
    elif what == "extra copy":
        shutil.copy(a, root / "model-99999-of-99999.safetensors")
    elif what == "extra foreign":
        other = rng.choice([p for p in (corpus / "hf").iterdir() if p.is_dir() and p.name != root.name] or [root])
        shutil.copy(rng.choice(_shards(other / "model")), root / "model-extra.safetensors")
    elif what == "swap":
        tmp = a.with_name("swap.tmp")
        a.rename(tmp)
        b.rename(a)
        tmp.rename(b)
    elif what == "duplicate":
        shutil.copy(a, b)
    elif what == "renamed":
        a.rename(a.with_name("renamed-" + a.name))
    elif what == "folder":
        a.unlink()
        a.mkdir()
    elif what == "symlink":
        a.unlink()
        a.symlink_to(b.resolve())
    elif what == "fifo":
        a.unlink()
        os.mkfifo(a)
    elif what == "empty":
        a.write_bytes(b"")
    else:
        for f in shards:
            f.unlink()
    return f"{what}: {a.name}" + (f", {b.name}" if what in ("swap", "duplicate", "symlink") else "")


def _index(root: Path, rng: random.Random) -> str:
    """Damage model.safetensors.index.json."""
    path = root / "model.safetensors.index.json"
    index = json.loads(path.read_text())
    wmap = index["weight_map"]
    keys, files = sorted(wmap), sorted(set(wmap.values()))
    key, file = rng.choice(keys), rng.choice(files)
    what = rng.choice(
        [
            "no weight_map",
            "weight_map not a map",
            "empty weight_map",
            "traversal",
            "absolute",
            "subfolder",
            "long name",
            "nul name",
            "non-string shard",
            "wrong shard",
            "unlisted key",
            "phantom key",
            "duplicate key",
            "one shard",
            "total_size",
            "not json",
            "deep",
            "removed",
            "folder",
            "huge",
        ]
    )
    text = None
    if what == "no weight_map":
        del index["weight_map"]
    elif what == "weight_map not a map":
        index["weight_map"] = rng.choice([[], "model.safetensors", None, 5, [[key, file]]])
    elif what == "empty weight_map":
        index["weight_map"] = {}
    elif what in ("traversal", "absolute", "subfolder"):
        if what == "traversal":
            name = "../" + file
            shutil.copy(root / file, root.parent / file)
        elif what == "absolute":
            (root.parent / "elsewhere").mkdir(exist_ok=True)
            name = str(shutil.copy(root / file, root.parent / "elsewhere" / file))
        else:
            (root / "sub").mkdir(exist_ok=True)
            name = "sub/" + file
            shutil.copy(root / file, root / name)
        for k in keys:
            if wmap[k] == file:
                wmap[k] = name
    elif what in ("long name", "nul name"):
        name = ("m" * 300 + ".safetensors") if what == "long name" else "model\x00.safetensors"
        for k in keys:
            if wmap[k] == file:
                wmap[k] = name
    elif what == "non-string shard":
        wmap[key] = rng.choice([5, None, ["x"], {"file": file}])
    elif what == "wrong shard":
        wmap[key] = rng.choice([f for f in files if f != wmap[key]])
    elif what == "unlisted key":
        del wmap[key]
    elif what == "phantom key":
        wmap["model.layers.0.mlp.phantom.weight"] = file
    elif what == "duplicate key":
        other = rng.choice([f for f in files if f != wmap[key]])
        text = json.dumps(index).replace(
            json.dumps(key) + ":", json.dumps(key) + ": " + json.dumps(other) + ", " + json.dumps(key) + ":", 1
        )
    elif what == "one shard":
        for k in keys:
            wmap[k] = file
    elif what == "total_size":
        index.setdefault("metadata", {})["total_size"] = rng.choice([-1, "x", 10**30, None, 1.5])
    elif what == "not json":
        raw = json.dumps(index)
        text = rng.choice([raw[: rng.randrange(len(raw))], "", "nan", "\xff" + raw, "[" + raw + "]", "1" * 10_000])
    elif what == "deep":
        index["weight_map"][key] = _nest(100_000)
        text = '{"weight_map": ' + "[" * 100_000 + "]" * 100_000 + "}"
    elif what == "removed":
        path.unlink()
        return what
    elif what == "folder":
        path.unlink()
        path.mkdir()
        return what
    path.write_text(text if text is not None else json.dumps(index), errors="surrogateescape")
    if what == "huge":
        os.truncate(path, 300 << 20)  # past the 256 MiB an index may have; sparse, so cheap
    return f"index {what} ({key} in {file})"


CONFIG_KEYS = (
    "architectures",
    "model_type",
    "num_hidden_layers",
    "hidden_size",
    "num_experts",
    "num_local_experts",
    "n_routed_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "intermediate_size",
    "vocab_size",
    "num_attention_heads",
    "head_dim",
    "mlp_only_layers",
    "mlp_layer_types",
    "layer_types",
    "n_shared_experts",
    "scoring_func",
    "hc_mult",
    "decoder_sparse_step",
    "norm_topk_prob",
    "quantization_config",
    "num_nextn_predict_layers",
    "shared_expert_intermediate_size",
    "tie_word_embeddings",
)
EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")


def _config(root: Path, rng: random.Random) -> str:
    """Damage config.json: keys missing or of wrong types and values, expert counts and top-k,
    architectures, not JSON, deep nesting, huge numbers."""
    path = root / "config.json"
    config = json.loads(path.read_text())
    present = [k for k in CONFIG_KEYS if k in config]
    experts = next(k for k in EXPERT_KEYS if k in config)
    what = rng.choice(
        [
            "missing",
            "wrong value",
            "wrong value",
            "experts",
            "top-k",
            "architectures",
            "not json",
            "deep",
            "huge literal",
            "nan",
            "large file",
            "duplicate key",
        ]
    )
    text = None
    if what == "missing":
        key = rng.choice(present)
        del config[key]
        what = f"{key} missing"
    elif what == "wrong value":
        key = rng.choice(present)
        config[key] = value = rng.choice(
            [
                None,
                "8",
                8.0,
                8.5,
                True,
                [],
                {},
                -1,
                0,
                1,
                10**30,
                2**63,
                1e308,
                "../../etc",
                [8, 8],
                2**31,
                [None],
                {"a": 1},
            ]
        )
        what = f"{key} = {value!r}"
    elif what == "experts":
        config[experts] = value = rng.choice([0, -8, 1, 2, 7, 9, 16, 10**9, 2**63, 1e3, "8"])
        what = f"{experts} = {value!r}"
    elif what == "top-k":
        config["num_experts_per_tok"] = value = rng.choice([0, -1, 9, 1000, config[experts], 2**63, 2.5, None])
        what = f"num_experts_per_tok = {value!r}"
    elif what == "architectures":
        config["architectures"] = value = rng.choice(
            [
                ["LlamaForCausalLM"],
                [],
                ["A", "B"],
                config["architectures"][0],
                [5],
                ["MixtralForCausalLM"],
                ["GptOssForCausalLM"],
                ["DeepseekV4ForCausalLM"],
                ["Qwen2MoeForCausalLM"],
                None,
            ]
        )
        what = f"architectures = {value!r}"
    elif what == "not json":
        raw = json.dumps(config)
        text = rng.choice(
            [raw[: rng.randrange(len(raw))], "", "nan", "\ufeff" + raw, "[" + raw + "]", "null", raw.replace('"', "'")]
        )
    elif what == "deep":
        text = json.dumps(config)[:-1] + ', "nested": ' + "[" * 100_000 + "]" * 100_000 + "}"
    elif what == "huge literal":
        key = rng.choice([k for k in present if isinstance(config[k], int)] or present)
        text = json.dumps({**config, key: 0}).replace(f'"{key}": 0', f'"{key}": ' + "9" * 5000)
        what = f"{key} has 5000 digits"
    elif what == "nan":
        key = rng.choice([experts, "num_experts_per_tok", "hidden_size", "num_hidden_layers"])
        lit = rng.choice(["NaN", "Infinity", "-Infinity", "1e999"])
        text = json.dumps({**config, key: 0}).replace(f'"{key}": 0', f'"{key}": {lit}')
        what = f"{key} = {lit}"
    elif what == "large file":
        text = json.dumps({**config, "padding": "x" * (17 << 20)})
    else:
        text = json.dumps(config)[:-1] + f', "{experts}": 16}}'
    path.write_text(text if text is not None else json.dumps(config))
    return f"config {what}"


def _pickles(root: Path, rng: random.Random, marker: Path) -> str:
    """Pickles (each a call that would create `marker`) beside or instead of the safetensors, and
    remote code named by config.json: none may be loaded."""
    name, blob = _pickle_payload(marker, rng)
    where = rng.choice(
        [
            "beside",
            "instead",
            "bin index",
            "as a shard",
            "as model.safetensors",
            "torch zip",
            "training_args.bin",
            "remote code",
        ]
    )
    if where in ("instead", "bin index", "as model.safetensors", "torch zip"):
        for f in _shards(root):
            f.unlink()
        (root / "model.safetensors.index.json").unlink()
    if where in ("beside", "instead"):
        (root / rng.choice(["pytorch_model.bin", "model.pt", "model.ckpt", "consolidated.pth"])).write_bytes(blob)
    elif where == "bin index":
        (root / "pytorch_model-00001-of-00001.bin").write_bytes(blob)
        (root / "pytorch_model.bin.index.json").write_text(
            json.dumps(
                {"metadata": {}, "weight_map": {"model.embed_tokens.weight": "pytorch_model-00001-of-00001.bin"}}
            )
        )
    elif where == "as a shard":
        rng.choice(_shards(root)).write_bytes(blob)
    elif where == "as model.safetensors":
        (root / "model.safetensors").write_bytes(blob)
    elif where == "torch zip":
        import torch

        torch.save({"model.embed_tokens.weight": payloads(marker)[name]}, root / "pytorch_model.bin")
    elif where == "training_args.bin":
        (root / "training_args.bin").write_bytes(blob)
    else:
        config = json.loads((root / "config.json").read_text())
        config["auto_map"] = {"AutoConfig": "evil.EvilConfig", "AutoModelForCausalLM": "evil.EvilModel"}
        config["trust_remote_code"] = True
        (root / "config.json").write_text(json.dumps(config))
        (root / "evil.py").write_text(f"open({str(marker)!r}, 'w').write('x')\n")
        return "remote code (auto_map -> evil.py)"
    return f"{name} pickle {where}"


def mutate_hf(kind: str, root: Path, rng: random.Random, marker: Path, corpus: Path, model: str) -> str:
    """Damage an HF input (a folder: model or proxy; a file: statistics) one way."""
    if kind.startswith("st_"):
        return _st_header(root, rng, kind)
    if kind == "hf_truncate":
        f = rng.choice(_shards(root)) if rng.random() < 0.8 else rng.choice(_files(root))
        size = f.stat().st_size
        cut = rng.randrange(0, max(1, size))
        with open(f, "r+b") as fh:
            fh.truncate(cut)
        return f"{f.name} cut to {cut} of {size}"
    if kind == "flip_data":
        f = rng.choice(_shards(root))
        n = int.from_bytes(f.read_bytes()[:8], "little")
        return f"{f.name}: " + _flip(f, rng, 8 + n, f.stat().st_size, rng.choice([1, 4, 16]))
    if kind == "shards":
        return _shard_files(root, rng, corpus)
    if kind == "index":
        return _index(root, rng)
    if kind == "config":
        return _config(root, rng)
    if kind == "tensors":
        return _tensors(root, rng)
    if kind == "quant":
        return _quant(root, rng)
    if kind == "hash_table":
        return _hash_table(root, rng)
    if kind == "pickles":
        return _pickles(root, rng, marker)
    if kind == "manifest":
        return _mutate_json(root / "manifest.json", rng)
    if kind == "plan_swap":
        other = rng.choice([m for m in HF_MODELS if m != HF_BASE[model]])
        shutil.copy(corpus / "hf" / other / "plan.json", root)
        return f"the plan of {other}"
    raise ValueError(kind)


HF_CHECKPOINT_KINDS = [
    "st_length",
    "st_json",
    "st_dtype",
    "st_offsets",
    "st_shape",
    "st_entry",
    "st_metadata",
    "hf_truncate",
    "flip_data",
    "shards",
    "index",
    "config",
    "config",
    "tensors",
    "tensors",
    "pickles",
]
HF_TARGETS = {  # target -> (weight, kinds, commands)
    "hf": (8, HF_CHECKPOINT_KINDS, ["inspect", "convert_plan", "convert_plan", "verify_orig", "select"]),
    "hf_proxy": (
        1,
        ["hf_truncate", "flip_data", "shards", "index", "config", "manifest", "st_length", "st_offsets", "st_dtype"],
        ["verify_proxy"],
    ),
    "hf_stats": (1, ["truncate", "safetensors_header", "flip_any", "sidecar"], ["stats_show", "select"]),
    "hf_plan": (1, ["json", "json", "plan_swap"], ["convert_plan", "verify_plan"]),
}
HF_EXTRA = {
    **{q: (["quant"] * 8, ["convert_deq"] * 3) for q in HF_QUANTIZED},  # more kinds and commands
    "deepseek_v4": (["hash_table"] * 8, []),
}
HF_EXTRA["deepseek_v4_fp4"] = (HF_EXTRA["deepseek_v4_fp4"][0] + ["hash_table"] * 8, ["convert_deq"] * 3)


def make_hf_cases(n: int, seed: int) -> list[Case]:
    """`n` cases that damage the HF corpus: checkpoints (each family alike; quantized copies also
    their scales, DeepSeek-V4 also its hash table), proxies, statistics and plans."""
    rng = random.Random(seed * 7919 + 48)
    targets = list(HF_TARGETS)
    weights = [HF_TARGETS[t][0] for t in targets]
    out = []
    for i in range(n):
        target = rng.choices(targets, weights)[0]
        model = rng.choice(HF_INPUTS)
        _, kinds, commands = HF_TARGETS[target]
        if target == "hf":
            extra = HF_EXTRA.get(model, ([], []))
            kinds, commands = kinds + extra[0], commands + extra[1]
        out.append(Case(i, target, rng.choice(kinds), rng.choice(commands), rng.randrange(1 << 30), model))
    return out


def _argv(case: Case, corpus: Path, inp: Path, out: Path) -> list[str]:
    if case.model:
        return _hf_argv(case, corpus, inp, out)
    c = {k: str(corpus / k) for k in ("legacy", "plan.json", "proxy", "stats.safetensors")}
    i, o = str(inp), str(out)
    quiet = ["--target-tp", "1", "--target-pp", "1", "--target-ep", "1"]
    return {
        "inspect": ["inspect", i],
        "convert": ["convert", i, "-o", o, *quiet],
        "convert_dist": ["convert", i, "-o", o, "--format", "torch_dist"],
        "convert_plan": [
            "convert",
            c["legacy"] if case.target == "plan" else i,
            "--plan",
            i if case.target == "plan" else c["plan.json"],
            "-o",
            o,
            *quiet,
        ],
        "verify_orig": ["verify", "--orig", i, "--proxy", c["proxy"], "--plan", c["plan.json"]],
        "verify_proxy": ["verify", "--orig", c["legacy"], "--proxy", i, "--plan", c["plan.json"]],
        "verify_plan": ["verify", "--orig", c["legacy"], "--proxy", c["proxy"], "--plan", i],
        "stats_show": ["stats", "show", i],
        "select": [
            "select",
            "--ckpt",
            c["legacy"],
            "--stats",
            i,
            "--num-experts",
            str(KEEP),
            "-o",
            str(out / "plan.json"),
        ],
    }[case.command]


def _hf_argv(case: Case, corpus: Path, inp: Path, out: Path) -> list[str]:
    c = {k: str(corpus / "hf" / case.model / k) for k in ("model", "plan.json", "proxy", "stats.safetensors")}
    own = {"hf": "model", "hf_proxy": "proxy", "hf_stats": "stats.safetensors", "hf_plan": "plan.json"}[case.target]
    c[own] = str(inp)
    return {
        "inspect": ["inspect", c["model"]],
        "convert_plan": ["convert", c["model"], "--plan", c["plan.json"], "-o", str(out)],
        "convert_deq": ["convert", c["model"], "--plan", c["plan.json"], "-o", str(out), "--dequantize"],
        "verify_orig": ["verify", "--orig", c["model"], "--proxy", c["proxy"], "--plan", c["plan.json"]],
        "verify_proxy": ["verify", "--orig", c["model"], "--proxy", c["proxy"], "--plan", c["plan.json"]],
        "verify_plan": ["verify", "--orig", c["model"], "--proxy", c["proxy"], "--plan", c["plan.json"]],
        "stats_show": ["stats", "show", c["stats.safetensors"]],
        "select": [
            "select",
            "--ckpt",
            c["model"],
            "--stats",
            c["stats.safetensors"],
            "--num-experts",
            str(HF_KEEP),
            "-o",
            str(out / "plan.json"),
        ],
    }[case.command]


def _hf_outputs(out: Path) -> tuple[int, list[str]]:
    """Read every tensor of an HF proxy the way transformers does (safetensors) -> (shards read,
    files that are pickles or code: none may be written into a proxy)."""
    from safetensors.torch import load_file

    odd = [
        f.name
        for f in _files(out)
        if f.suffix in (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".py")
        or (f.suffix != ".safetensors" and f.read_bytes()[:1] in (b"\x80", b"P"))
    ]
    shards = _files(out, "*.safetensors")
    for f in shards:
        load_file(str(f))
    return len(shards), odd


def tree_digest(path: Path) -> str:
    h = hashlib.sha256()
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    for p in files:
        h.update(str(p.relative_to(path.parent)).encode())
        h.update(p.read_bytes())
    if path.is_file() and path.with_suffix(".json").is_file():  # a stats sidecar
        h.update(path.with_suffix(".json").read_bytes())
    return h.hexdigest()


def _child(case: Case, corpus: Path, case_dir: Path, result_path: Path) -> None:
    """Runs in the forked child: damage a copy, run the command, record what happened."""
    import torch

    torch.set_num_threads(1)  # a forked child must not use the parent's OpenMP pool
    rng = random.Random(case.seed)
    marker = case_dir / "MARKER"
    source = {
        "legacy": "legacy",
        "dist": "dist",
        "mdist": "mdist",
        "proxy": "proxy",
        "plan": "plan.json",
        "stats": "stats.safetensors",
        "hf": "model",
        "hf_proxy": "proxy",
        "hf_stats": "stats.safetensors",
        "hf_plan": "plan.json",
    }[case.target]
    home = corpus / "hf" / case.model if case.model else corpus
    inp = case_dir / source
    if (home / source).is_dir():
        shutil.copytree(home / source, inp)
    else:
        shutil.copy(home / source, inp)
        if source.endswith(".safetensors"):
            shutil.copy((home / source).with_suffix(".json"), inp.with_suffix(".json"))
    kind = case.kind
    if kind == "sidecar":
        what = _mutate_json(inp.with_suffix(".json"), rng)
    elif case.model and kind not in KINDS["stats"] + KINDS["plan"]:
        what = mutate_hf(kind, inp, rng, marker, corpus, case.model)
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
    except SystemExit as stop:  # argparse
        code = stop.code if isinstance(stop.code, int) else 2
    loaded, odd = 0, []
    if code == 0 and case.command.startswith("convert") and out.is_dir() and case.model:
        loaded, odd = _hf_outputs(out)
    elif code == 0 and case.command.startswith("convert") and out.is_dir():
        import megatron.core  # noqa: F401  (registers megatron-core's safe globals, as Megatron-LM has them)

        for f in _files(out, "*.pt"):  # load the proxy the ways Megatron does
            torch.load(f, weights_only=False)
            torch.load(f, map_location="cpu")
            loaded += 1
    sys.stdout.flush()
    sys.stderr.flush()
    result = {
        "code": code,
        "what": what,
        "argv": argv,
        "unchanged": tree_digest(inp) == before,
        "loaded": loaded,
        "pickles_written": odd,
        "out_exists": out.exists() and case.command != "select",
        "staging": [p.name for p in case_dir.iterdir() if ".mcore-proxy" in p.name],
    }
    result_path.write_text(json.dumps(result))


def start_case(case: Case, corpus: Path, work: Path) -> tuple[int, Path, float]:
    """Fork the child of one case -> (pid, case folder, start time)."""
    case_dir = work / f"case{case.index:05d}"
    shutil.rmtree(case_dir, ignore_errors=True)
    case_dir.mkdir(parents=True)
    start = time.perf_counter()
    pid = os.fork()
    if pid == 0:  # the child
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


def campaign(
    cases: list[Case], corpus: Path, work: Path, jobs: int = 1, limit: float = LIMIT_S, progress: bool = True
) -> list[dict]:
    """Run cases with up to `jobs` children at a time; a child past `limit` seconds is killed (a hang).

    The parent stays single-threaded (it only forks and waits): forking from a threaded process
    could hand a child a lock held by another thread."""
    import tqdm as tqdm_module
    from tqdm import tqdm

    tqdm_module.tqdm.monitor_interval = 0  # no monitor thread: the parent forks
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
    record = {
        "case": case.index,
        "target": case.target,
        "kind": case.kind,
        "command": case.command,
        "seconds": round(seconds, 2),
        **({"model": case.model} if case.model else {}),
    }
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
        said = [line for line in stderr.splitlines() if line.startswith("mcore-proxy ")]
        if said:
            record["message"] = said[-1][:400]
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
        if r.get("pickles_written"):
            problems.append(f"pickle or code written into the proxy: {r['pickles_written']}")
    if (case_dir / "MARKER").exists():
        problems.append("CODE RAN (marker file exists)")
    record["problems"] = problems
    if problems:
        record["stderr"] = stderr[-1500:]
    else:
        shutil.rmtree(case_dir, ignore_errors=True)
    return record


def table(records: list[dict], by: tuple[str, str] = ("target", "kind")) -> str:
    """Markdown: cases by two fields of a record (input and mutation by default; `model`,
    `command`), counts per outcome, and failures."""
    outcomes = sorted({r["outcome"] for r in records})
    rows = collections.defaultdict(collections.Counter)
    for r in records:
        rows[tuple(r.get(k, "") for k in by)][r["outcome"]] += 1
    names = {"target": "input", "kind": "damage"}
    head = f"| {names.get(by[0], by[0])} | {names.get(by[1], by[1])} | cases | " + " | ".join(outcomes) + " | failed |"
    lines = [head, "|" + "---|" * (4 + len(outcomes))]
    for (a, b), counts in sorted(rows.items()):
        failed = sum(1 for r in records if tuple(r.get(k, "") for k in by) == (a, b) and r["problems"])
        lines.append(
            f"| {a} | {b} | {sum(counts.values())} | "
            + " | ".join(str(counts.get(o, 0)) for o in outcomes)
            + f" | {failed} |"
        )
    total = collections.Counter(r["outcome"] for r in records)
    failed = sum(1 for r in records if r["problems"])
    lines.append(
        f"| **all** | | **{len(records)}** | "
        + " | ".join(f"**{total.get(o, 0)}**" for o in outcomes)
        + f" | **{failed}** |"
    )
    return "\n".join(lines)


def summary(records: list[dict]) -> dict:
    problems = collections.Counter(p.split(":")[0] for r in records for p in r["problems"])
    return {
        "cases": len(records),
        "failed": sum(1 for r in records if r["problems"]),
        "tracebacks": problems.get("traceback on stderr", 0),
        "hangs": sum(1 for r in records if r["outcome"] == "hang"),
        "code_runs": problems.get("CODE RAN (marker file exists)", 0),
        "inputs_modified": problems.get("input modified", 0),
        "median_s": sorted(r["seconds"] for r in records)[len(records) // 2] if records else 0,
    }


def preload(corpus: Path | None = None) -> None:
    """Import what the commands (and the fuzzer's own edits) import, once in the parent: every
    forked child then has it. Loading a rank file with torch.load imports megatron (its enums are
    in `args`), which costs seconds."""
    if corpus is not None and (corpus / "legacy").is_dir():
        import torch

        torch.load(next((corpus / "legacy").rglob("model_optim_rng.pt")), weights_only=False)
    import importlib

    for module in (
        "mcore_proxy.cli",
        "mcore_proxy.checkpoint.legacy",
        "mcore_proxy.checkpoint.torch_dist",
        "mcore_proxy.convert.pipeline",
        "mcore_proxy.convert.verify",
        "mcore_proxy.select.selector",
        "mcore_proxy.core.stats",
        "mcore_proxy.trace.summary",
        "mcore_proxy.checkpoint.hf",
        "mcore_proxy.checkpoint.hf.native_writer",
        "mcore_proxy.checkpoint.hf.quant",
        "safetensors.torch",
    ):
        importlib.import_module(module)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", type=int, default=2000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--jobs", type=int, default=1)
    p.add_argument("--workdir", type=Path, default=Path("/tmp/mcore-proxy-fuzz"))
    p.add_argument(
        "--megatron-dist",
        action="store_true",
        help="also fuzz a torch_dist checkpoint saved by megatron-core itself (built once)",
    )
    p.add_argument("--json", type=Path, help="write every record here")
    p.add_argument(
        "--only",
        nargs="+",
        metavar="INPUT",
        help="run only the cases (same numbers and seeds) that damage these inputs, e.g. stats",
    )
    p.add_argument(
        "--kinds",
        nargs="+",
        metavar="KIND",
        help="run only the cases (same numbers and seeds) of these damage kinds, e.g. hostile_getattr",
    )
    p.add_argument(
        "--hf",
        action="store_true",
        help="fuzz the Hugging Face corpus instead (tiny transformers-built checkpoints of three families "
        "and an FP8 copy, their statistics, plans and proxies; no Megatron fixture is built)",
    )
    p.add_argument(
        "--by",
        nargs=2,
        default=["target", "kind"],
        metavar=("FIELD", "FIELD"),
        help="rows of the printed table: two of target, kind, command, model (default: target kind)",
    )
    args = p.parse_args(argv)

    from mcore_proxy.testing.fixtures import build_fixture

    args.workdir.mkdir(parents=True, exist_ok=True)
    cache = Path(os.environ.get("MCORE_PROXY_FIXTURE_CACHE", args.workdir / "fixtures"))
    if args.hf:
        corpus = build_corpus(args.workdir, None, hf_cache=cache)
        cases = make_hf_cases(args.cases, args.seed)
    else:
        legacy, _ = build_fixture(FIXTURE, cache)
        mdist = megatron_torch_dist(args.workdir) if args.megatron_dist else None
        corpus = build_corpus(args.workdir, legacy, mdist)
        cases = make_cases(args.cases, args.seed, list(WEIGHTS) + (["mdist"] if mdist else []))
    preload(corpus)
    if args.only:
        cases = [c for c in cases if c.target in args.only]
    if args.kinds:
        cases = [c for c in cases if c.kind in args.kinds]
    start = time.perf_counter()
    records = campaign(cases, corpus, args.workdir / "cases", jobs=args.jobs)
    wall = time.perf_counter() - start
    if args.json:
        args.json.write_text(json.dumps(records, indent=1))
    print(table(records, tuple(args.by)))
    print(json.dumps({**summary(records), "wall_s": round(wall, 1), "seed": args.seed, "jobs": args.jobs}))
    for r in records:
        if r["problems"]:
            print(
                f"case {r['case']} {r['target']}/{r.get('model', '')}/{r['kind']} {r['command']}: {r['problems']}\n"
                f"{r.get('what', '')}\n{r.get('stderr', '')}"
            )
    return 1 if any(r["problems"] for r in records) else 0


if __name__ == "__main__":
    sys.exit(main())
