"""Bytes at real width (issue 23 item 2): `mcore-proxy convert` of a DeepSeek-V3-width legacy
checkpoint against `cp -r` and against the I/O floor of the bytes the proxy needs.

    python bench/bench_real_width.py [--data /work/benchdata-wide] [--repeat 3] [--profile]
    python bench/bench_real_width.py --smoke --warm --data DIR     # tiny sizes, seconds (tests/bench)

The checkpoint (`wide_model`, written by bench_deepseek_scale's `write_checkpoint`, megatron-core
local-spec names, legacy `--ckpt-format torch`, bf16, TP 1, PP 1, EP 32 = 32 rank folders
`mp_rank_00_EEE`): DeepSeek-V3's expert width, hidden 7168, 256 routed experts of FFN 2048 (8 per
rank file), top-8 of 8 groups / top-4 groups, sigmoid scores with expert bias, one shared expert
of FFN 2048, MLA with DeepSeek-V3's q_lora 1536 / kv_lora 512 / head dims 128 + 64 rope / v 128.
What the disk here does not allow, reduced and said so: 2 decoder layers (1 dense + 1 MoE; the
issue asked for 2-4 MoE layers: one MoE layer of 256 experts is 21 GiB), no MTP layer, 8
attention heads instead of 128, dense FFN 1024 instead of 18432, vocab 1024 instead of 129280.
The reason is replication: legacy Megatron saves every non-expert tensor in each of the 32 EP
rank files, so each MiB of attention, dense MLP or embedding costs 32 MiB on disk; at the real
attention and dense widths the two layers would take 50 GiB. As built: 29.0 GiB (256 MiB of
replicated tensors + 672 MiB of experts per rank file), of it 21 GiB routed experts.
`cp -r` of it must fit beside it (the script checks the free space first).

Values: expert tensors are a random bf16 block of 1,048,573 elements (prime) tiled from an
offset keyed by the tensor's name (cheap, non-constant, different per expert); every other tensor
random as in bench_deepseek_scale; routers and the routing statistics are its planted clusters
(32 per layer), so `mcore-proxy select` sees a coherent router and trace.

Measured, in one run, repetitions interleaved (--repeat, default 3), each command under
`/usr/bin/time -v` after `sync; echo 3 > /proc/sys/vm/drop_caches` (--warm: not dropped):

  cp -r SRC DST && sync -f DST                  the whole checkpoint (copy deleted after, untimed)
  dd if=RANKFILE of=/dev/null bs=16M            sequential read of --dd-files rank files -> MB/s
  dd if=/dev/zero of=F bs=16M count=64 conv=fsync   sequential write of 1 GiB -> MB/s
  python -c 'import torch, mcore_proxy...'      convert's start-up: the imports, cold
  python bench/bench_real_width.py --floor SPEC OUT   the I/O floor of each plan (below)
  mcore-proxy convert SRC --plan PLAN -o OUT --target-tp 1 --target-pp 1 --target-ep T

for plans from `mcore-proxy select --num-experts K --target-ep T` (run once before, untimed):
K=16 -> EP 2 and K=32 -> EP 4, 8 experts per output rank file as in the source's (--keeps,
--target-eps). convert runs with its defaults (one writer process, `--workers 1`). Every command
leaves its output on disk before it exits: convert and the floor fsync each file they write,
`cp -r` is followed by `sync -f` in the same timed shell. The library is the committed HEAD
(`git archive`, first on PYTHONPATH: others edit the working tree during runs).

The floor (`floor_spec`, `run_floor`): what convert must read, computed outside the timing from
the rank files' zip index and `data.pkl` (torch.save members are stored uncompressed, so each
tensor is one byte range): every non-expert tensor once (from EP rank 0's file; the router and
expert bias as the kept rows/entries only) and the kept experts' fc1 and fc2, plus the data.pkl
of each rank file read from. A plain Python loop (no library code, no torch) preads exactly those
ranges and writes to as many rank files as convert writes (T, one per output EP rank) what
convert puts in them: the non-expert tensors in each, that rank's kept experts in one; each file
fsynced. Its tensor bytes written are checked to equal convert's (the storages in convert's
output zip files). The dd rows give the floor's estimate: bytes read / read MB/s + bytes written
/ write MB/s.

Peak RSS of convert (time -v, largest process) is compared with "2 layers + 1 GiB" read two ways:
two of the proxy's largest layers (all its kept experts and the layer's other tensors, counted
once) + 1 GiB, and as the earlier sections computed it, two of the source's largest layers (all
256 experts) + 1 GiB. Medians print as a markdown table; / floor and / cp -r are medians of the
per-repetition ratios; every sample goes to DATA/wide-results.json. --profile then runs convert
of the largest plan once more, warm, under cProfile (DATA/convert-profile.txt). Plans and floor
specs stay in DATA/wide-plans for two diagnostics behind bench/RESULTS.md's breakdown:

    python bench/bench_real_width.py --variant base|nokick|nohash|nothing convert SRC ...   # run_variant
    python bench/bench_real_width.py --buffers DATA/wide-plans/floor-K32-ep4.json          # run_buffers
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import json
import math
import os
import pickle
import platform
import shutil
import statistics
import struct
import subprocess
import sys
import time
import zipfile
import zlib
from pathlib import Path

HERE = Path(__file__).resolve().parent
MIB, GIB = 2**20, 2**30
BLOCK = 1_048_573  # elements of the tiled random block of expert tensors (prime)


# -- the checkpoint ----------------------------------------------------------------------------


def wide_model():
    """DeepSeek-V3's expert width and counts; attention heads, dense FFN and vocab reduced (docstring)."""
    from mcore_proxy.mcore.spec import MLA
    from mcore_proxy.testing.families import DEEPSEEK_V3

    return dataclasses.replace(
        DEEPSEEK_V3,
        num_layers=2,
        hidden_size=7168,
        num_attention_heads=8,
        ffn_hidden_size=1024,
        mla=MLA(q_lora_rank=1536, kv_lora_rank=512, qk_head_dim=128, qk_pos_emb_head_dim=64, v_head_dim=128),
        num_experts=256,
        moe_ffn_hidden_size=2048,
        shared_expert_size=2048,
        topk=8,
        num_groups=8,
        group_topk=4,
        moe_layers=(1,),
        mtp_layers=0,
        vocab_size=1024,
        seq_length=4096,
    )


def smoke_model():
    """The same structure at test size: the megatron-core DeepSeek fixture's widths (H 32, 32
    experts of FFN 8, 8 groups), 1 dense + 1 MoE layer, no MTP."""
    from mcore_proxy.testing.families import DEEPSEEK_V3

    return dataclasses.replace(DEEPSEEK_V3, num_layers=2, moe_layers=(1,), mtp_layers=0)


def _scale_bench():
    """bench/bench_deepseek_scale.py as the module the script itself imports (bench/ on sys.path)."""
    if str(HERE) not in sys.path:
        sys.path.insert(0, str(HERE))
    import bench_deepseek_scale

    return bench_deepseek_scale


@contextlib.contextmanager
def cheap_experts():
    """bench_deepseek_scale's value generator with routed-expert tensors tiled from one random
    block (torch.randn of 21 GiB would dominate the build); other tensors unchanged."""
    import torch

    bds = _scale_bench()
    random = bds._randn
    g = torch.Generator().manual_seed(23)
    base = (torch.randn(BLOCK, generator=g) * 0.02).to(torch.bfloat16)

    def fill(shape, name, dtype=torch.bfloat16, std=0.02, memo=None):
        if ".mlp.experts." not in name or dtype != torch.bfloat16:
            return random(shape, name, dtype, std, memo)
        n = math.prod(shape)
        start = zlib.crc32(name.encode()) % BLOCK
        return base.repeat(-(-(start + n) // BLOCK))[start : start + n].clone().view(shape)

    bds._randn = fill
    try:
        yield
    finally:
        bds._randn = random


def build(root: Path, stats: Path, model, ep: int, tokens: int) -> None:
    with cheap_experts():
        _scale_bench().write_checkpoint(root, model, pp=1, ep=ep, tokens=tokens, stats_path=stats)


# -- the rank files' index (no torch, no library) ------------------------------------------------

_ITEMSIZE = {
    "BFloat16Storage": 2,
    "HalfStorage": 2,
    "FloatStorage": 4,
    "DoubleStorage": 8,
    "LongStorage": 8,
    "IntStorage": 4,
    "ShortStorage": 2,
    "CharStorage": 1,
    "ByteStorage": 1,
    "BoolStorage": 1,
}


class _Inert:
    """Anything data.pkl names besides tensors (args, enums, dtypes): built, never used."""

    def __init__(self, *args, **kwargs):
        pass

    def __setstate__(self, state):
        pass


@dataclasses.dataclass(frozen=True)
class _Tensor:
    storage: tuple  # (storage type name, key)
    offset: int  # in elements
    shape: tuple
    stride: tuple


def _rebuild(storage, offset, shape, stride, *rest):
    return _Tensor(storage, offset, tuple(shape), tuple(stride))


class _MetaUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        if module == "torch._utils" and name == "_rebuild_tensor_v2":
            return _rebuild
        if module == "torch._utils" and name == "_rebuild_parameter":
            return lambda data, *rest: data
        if module == "collections" and name == "OrderedDict":
            return collections.OrderedDict
        if module == "torch" and name.endswith("Storage"):
            return name
        return _Inert

    def persistent_load(self, pid):
        return (pid[1], pid[2])  # ('storage', type, key, location, numel)


def _data_offset(fh, header_offset: int) -> int:
    fh.seek(header_offset)
    head = fh.read(30)
    name_len, extra_len = struct.unpack("<HH", head[26:30])
    return header_offset + 30 + name_len + extra_len


def rank_index(path: Path) -> tuple[dict[str, tuple[int, int]], tuple[int, int]]:
    """{model key: (file offset, bytes)} of one legacy rank file's tensors, and data.pkl's range."""
    with zipfile.ZipFile(path) as zf, open(path, "rb") as fh:
        pkl = next(i for i in zf.infolist() if i.filename.endswith("/data.pkl"))
        archive = pkl.filename.split("/")[0]
        state = _MetaUnpickler(zf.open(pkl)).load()
        out = {}
        for key, t in state["model"].items():
            if not isinstance(t, _Tensor):
                continue
            size = _ITEMSIZE[t.storage[0]]
            numel = math.prod(t.shape)
            expected = tuple(math.prod(t.shape[i + 1 :]) for i in range(len(t.shape)))
            assert t.stride == expected or numel <= 1, f"{path}: {key} is not contiguous"
            info = zf.getinfo(f"{archive}/data/{t.storage[1]}")
            assert info.compress_type == zipfile.ZIP_STORED
            out[key] = (_data_offset(fh, info.header_offset) + t.offset * size, numel * size)
        return out, (_data_offset(fh, pkl.header_offset), pkl.file_size)


def rank_files(src: Path) -> list[Path]:
    return sorted(src.glob("iter_*/mp_rank_*/model_optim_rng.pt"))


def floor_spec(src: Path, plan: Path, target_ep: int) -> dict:
    """The byte ranges convert must read for `plan` and what each of its T output rank files holds,
    as ranges of the source: {"files", "reads": [[file, offset, length]], "outputs": [[[file,
    offset, length]]] (per output file), byte counts, and per layer the proxy's and the source's
    tensor bytes (for "2 layers + 1 GiB")}."""
    files = rank_files(src)
    index = [rank_index(f) for f in files]
    first = index[0][0]  # EP rank 0: every non-expert tensor (each rank file holds them all)
    layers = {str(k): v["kept"] for k, v in json.loads(plan.read_text())["layers"].items()}
    bias = next(k for k in first if k.endswith(".mlp.router.expert_bias"))
    num_experts = first[bias][1] // 4  # [E] float32
    local = num_experts // len(files)
    common, proxy_layer, source_layer = [], collections.Counter(), collections.Counter()
    for key, (off, n) in first.items():
        if ".local_experts." in key:
            continue
        layer = key.split(".")[2] if key.startswith("decoder.layers.") else "other"
        if ".mlp.router." in key:  # the kept rows ([E, H] weight) or entries ([E] bias) only
            row = n // num_experts
            ranges = [(0, off + e * row, row) for e in layers[layer]]
        else:
            ranges = [(0, off, n)]
        common += ranges
        proxy_layer[layer] += sum(r[2] for r in ranges)
        source_layer[layer] += n
    outputs = [list(common) for _ in range(target_ep)]
    reads = set(common)
    for layer, kept in layers.items():
        per_out = len(kept) // target_ep
        for j, e in enumerate(kept):
            rank, le = divmod(e, local)
            for fc in (1, 2):
                r = (
                    rank,
                    *index[rank][0][f"decoder.layers.{layer}.mlp.experts.local_experts.{le}.linear_fc{fc}.weight"],
                )
                outputs[j // per_out].append(r)
                reads.add(r)
                proxy_layer[layer] += r[2]
        for rank, (tensors, _) in enumerate(index):
            source_layer[layer] += sum(
                n for k, (_, n) in tensors.items() if k.startswith(f"decoder.layers.{layer}.mlp.experts.local_experts.")
            )
    reads = sorted(reads)
    meta = [(rank, *index[rank][1]) for rank in sorted({r[0] for r in reads})]  # data.pkl: read, not written
    return {
        "files": [str(f) for f in files],
        "reads": [list(r) for r in reads],
        "meta": [list(r) for r in meta],
        "outputs": [[list(r) for r in out] for out in outputs],
        "read_bytes": sum(r[2] for r in reads),
        "meta_bytes": sum(r[2] for r in meta),
        "write_bytes": sum(r[2] for out in outputs for r in out),
        "proxy_layer_bytes": dict(proxy_layer),
        "source_layer_bytes": dict(source_layer),
    }


# -- the floor: a plain reader/writer of exactly those bytes ---------------------------------------


def _pread_into(fd: int, view: memoryview, offset: int) -> None:
    got = 0
    while got < len(view):
        n = os.preadv(fd, [view[got:]], offset + got)
        if n <= 0:
            raise OSError(f"short read at {offset + got}")
        got += n


def _write_all(fd: int, view: memoryview) -> None:
    done = 0
    while done < len(view):
        done += os.write(fd, view[done:])


def run_floor(spec_path: Path, out: Path) -> int:
    """Read every range of the spec once (data.pkl too), write each output file's ranges back to
    back, fsync each file. Ranges several outputs hold (the non-expert tensors) are kept in memory."""
    spec = json.loads(spec_path.read_text())
    fds = [os.open(f, os.O_RDONLY) for f in spec["files"]]
    for rank, off, n in spec["meta"]:
        _pread_into(fds[rank], memoryview(bytearray(n)), off)
    uses = collections.Counter(tuple(r) for o in spec["outputs"] for r in o)
    kept: dict[tuple, memoryview] = {}
    scratch = memoryview(bytearray(max((r[2] for r in uses), default=0)))
    out.mkdir(parents=True)
    written = 0
    for t, ranges in enumerate(spec["outputs"]):
        fd = os.open(out / f"rank_{t:03d}.bin", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        for r in map(tuple, ranges):
            rank, off, n = r
            data = kept.get(r)
            if data is None:
                data = memoryview(bytearray(n)) if uses[r] > 1 else scratch[:n]
                _pread_into(fds[rank], data, off)
                if uses[r] > 1:
                    kept[r] = data
            _write_all(fd, data)
            written += n
        os.fsync(fd)
        os.close(fd)
    for fd in fds:
        os.close(fd)
    print(json.dumps({"written": written}))
    return 0


def tensor_bytes(out: Path) -> int:
    """Bytes of the tensor storages in a legacy output's rank files (zip members under data/)."""
    total = 0
    for f in rank_files(out):
        with zipfile.ZipFile(f) as zf:
            total += sum(i.file_size for i in zf.infolist() if "/data/" in i.filename)
    return total


def machine() -> dict:
    mem = Path("/proc/meminfo").read_text().split("\n", 1)[0].split()[1]
    dev = subprocess.run(["findmnt", "-n", "-o", "SOURCE,FSTYPE", "-T", "/work"], capture_output=True, text=True)
    disk = dev.stdout.split()
    ra = Path(f"/sys/block/{Path(disk[0]).name}/queue/read_ahead_kb") if disk else None
    return {
        "nproc": os.cpu_count(),
        "ram_gib": round(int(mem) / 2**20, 1),
        "cpu": next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?"),
        "disk": " ".join(disk) + (f", read_ahead_kb {ra.read_text().strip()}" if ra and ra.exists() else ""),
        "kernel": platform.release(),
        "python": platform.python_version(),
    }


# -- diagnostics behind the profile (bench/RESULTS.md) ---------------------------------------------

VARIANTS = ("base", "nokick", "nohash", "nothing")


def run_variant(variant: str, args: list[str]) -> int:
    """`mcore-proxy ARGS` with one cost of the zip writer's helper thread switched off, timing only
    (`nohash` / `nothing` write zero CRCs or skip the header patch: the output is not loadable):
    nokick: no sync_file_range every 32 MiB; nohash: CRC-32 and header patch but no sha256;
    nothing: none of CRC, header patch, sha256, sync_file_range (the writing thread alone)."""
    import struct as _struct

    from mcore_proxy.checkpoint import zipwrite

    if variant not in VARIANTS:
        raise SystemExit(f"--variant {variant!r}: one of {', '.join(VARIANTS)}")
    if variant in ("nokick", "nothing"):
        zipwrite.WRITEBACK_EVERY = 1 << 62
    if variant in ("nohash", "nothing"):

        def _digest(self, offset, header, buffers, member):
            if member is not None:
                crc = 0
                if variant == "nohash":
                    for b in buffers:
                        crc = zlib.crc32(b, crc)
                    _struct.pack_into("<I", header, zipwrite._CRC_AT, crc)
                    os.pwrite(self._fd, header, offset)
                member.crc = crc
            self._hashed += len(header) + sum(len(b) for b in buffers)
            if zipwrite._SYNC_FILE_RANGE is not None and self._hashed - self._kicked >= zipwrite.WRITEBACK_EVERY:
                zipwrite._SYNC_FILE_RANGE(self._fd, self._kicked, self._hashed - self._kicked, 2)
                self._kicked = self._hashed

        zipwrite.HashingSink._digest = _digest
    from mcore_proxy.cli import main as cli_main

    sys.argv = ["mcore-proxy", *args]
    return cli_main()


def run_buffers(spec_path: Path, repeat: int = 2) -> int:
    """pread of a floor spec's large ranges (the kept experts) into a fresh torch.empty per tensor
    under convert's `mallopt(M_MMAP_THRESHOLD, 1 MiB)` (as `TorchFile.read_elements` does) against
    one reused buffer; run it warm (the ranges in the page cache) to see the allocation's cost."""
    import ctypes

    import torch

    spec = json.loads(spec_path.read_text())
    fds = [os.open(f, os.O_RDONLY) for f in spec["files"]]
    reads = [r for r in spec["reads"] if r[2] >= MIB]
    total = sum(r[2] for r in reads)
    ctypes.CDLL("libc.so.6").mallopt(-3, MIB)  # M_MMAP_THRESHOLD, as runtime.memory sets it

    def fresh():
        for rank, off, n in reads:
            t = torch.empty(n, dtype=torch.uint8)
            _pread_into(fds[rank], memoryview(t.numpy()), off)
            del t

    def reused():
        buf = memoryview(torch.empty(max(r[2] for r in reads), dtype=torch.uint8).numpy())
        for rank, off, n in reads:
            _pread_into(fds[rank], buf[:n], off)

    for _ in range(repeat):
        for fn in (fresh, reused):
            t = time.perf_counter()
            fn()
            dt = time.perf_counter() - t
            print(f"{fn.__name__}: {dt:.2f} s for {total / GIB:.2f} GiB ({total / dt / 1e9:.2f} GB/s)", flush=True)
    return 0


# -- the run -----------------------------------------------------------------------------------


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--variant"]:  # --variant NAME mcore-proxy-arguments...
        return run_variant(argv[1], argv[2:])
    if argv[:1] == ["--buffers"]:  # --buffers SPEC
        return run_buffers(Path(argv[1]))
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", default="/work/benchdata-wide", help="checkpoint (built once), plans, outputs")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--ep", type=int, default=32, help="source EP (rank files)")
    ap.add_argument("--keeps", default="16,32", help="K per MoE layer of each plan")
    ap.add_argument("--target-eps", default="2,4", help="target EP of each plan")
    ap.add_argument("--tokens", type=int, default=4096, help="planted tokens per MoE layer")
    ap.add_argument("--dd-files", type=int, default=4, help="rank files the dd read row reads")
    ap.add_argument("--warm", action="store_true", help="do not drop the page cache")
    ap.add_argument("--no-verify", dest="verify", action="store_false", help="skip verify of the first outputs")
    ap.add_argument("--profile", action="store_true", help="then convert the largest plan warm under cProfile")
    ap.add_argument("--lib", default="HEAD", help="library commit measured (git archive first on PYTHONPATH)")
    ap.add_argument("--build-only", action="store_true")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes: H 32, 32 experts, EP 4, K 16 / 24, once")
    ap.add_argument("--floor", nargs=2, metavar=("SPEC", "OUT"), help=argparse.SUPPRESS)  # the floor's process
    a = ap.parse_args(argv)
    if a.floor:
        return run_floor(Path(a.floor[0]), Path(a.floor[1]))

    sys.path.insert(0, str(HERE))
    import torch

    from bench_convert import drop_caches, measure, pin_library, rm
    from bench_deepseek_scale import cached_bytes, disk_bytes

    if a.smoke:
        a.ep, a.keeps, a.target_eps, a.repeat, a.tokens, a.dd_files = 4, "16,24", "2,4", 1, 256, 2
    keeps = [int(k) for k in a.keeps.split(",")]
    teps = [int(t) for t in a.target_eps.split(",")]
    if len(keeps) != len(teps):
        raise SystemExit("--keeps and --target-eps need one entry each per plan")
    data = Path(a.data)
    data.mkdir(parents=True, exist_ok=True)
    model = smoke_model() if a.smoke else wide_model()
    tag = f"{'smoke' if a.smoke else 'dsv3w'}-H{model.hidden_size}-E{model.num_experts}"
    tag += f"-F{model.moe_ffn_hidden_size}-ep{a.ep}"
    src, stats = data / tag, data / f"{tag}.stats.safetensors"
    if not src.exists():
        print(f"building {src} ...", flush=True)
        t = time.perf_counter()
        build(src, stats, model, a.ep, a.tokens)
        print(f"  built in {time.perf_counter() - t:.0f} s", flush=True)
    files = rank_files(src)
    size = disk_bytes(src)
    print(f"{src.name}: {size / GIB:.2f} GiB in {len(files)} rank files", flush=True)
    if a.build_only:
        return 0

    mcore = (
        shutil.which("mcore-proxy", path=str(Path(sys.executable).parent))
        or shutil.which("mcore-proxy")
        or "mcore-proxy"
    )
    sha, lib = pin_library(data, a.lib)
    env = {"PYTHONPATH": lib}
    tmp = data / "wide-tmp"
    rm(tmp)
    tmp.mkdir()
    log = data / "wide-bench.log"
    log.write_text("")
    cold = not a.warm and drop_caches()

    # plans and floor specs, untimed; kept in DATA/wide-plans for the diagnostics (--variant, --buffers)
    keep_dir = data / "wide-plans"
    keep_dir.mkdir(exist_ok=True)
    plans, specs = {}, {}
    for k, tep in zip(keeps, teps):
        plans[k] = keep_dir / f"plan-K{k}-ep{tep}.json"
        cmd = [mcore, "select", "--ckpt", str(src), "--stats", str(stats), "--num-experts", str(k)]
        subprocess.run(
            cmd + ["--target-ep", str(tep), "-o", str(plans[k]), "--force"],
            check=True,
            capture_output=True,
            env={**os.environ, **env},
        )
        spec = floor_spec(src, plans[k], tep)
        specs[k] = keep_dir / f"floor-K{k}-ep{tep}.json"
        specs[k].write_text(json.dumps(spec))
        print(
            f"K={k} -> EP {tep}: convert must read {spec['read_bytes'] / GIB:.3f} GiB of tensors "
            f"(+ {spec['meta_bytes'] / 1024:.0f} KiB data.pkl) and write {spec['write_bytes'] / GIB:.3f} GiB "
            f"into {tep} rank files",
            flush=True,
        )
    spec_of = {k: json.loads(specs[k].read_text()) for k in keeps}

    dd_files = files[-a.dd_files :]
    dd_bytes = sum(f.stat().st_size for f in dd_files)
    dd_count = 4 if a.smoke else 64
    ddw = tmp / "dd-write"
    imports = "import torch, mcore_proxy.cli, mcore_proxy.convert.pipeline, mcore_proxy.checkpoint.legacy.reader"
    jobs: dict[str, tuple[list[str], Path | None, dict]] = {
        "cp -r": (["sh", "-c", f"cp -r '{src}' '{tmp / 'copy'}' && sync -f '{tmp / 'copy'}'"], tmp / "copy", {}),
        f"dd read ({len(dd_files)} rank files)": (
            ["sh", "-c", " ".join(f"dd if='{f}' of=/dev/null bs=16M status=none;" for f in dd_files)],
            None,
            {},
        ),
        f"dd write ({dd_count * 16} MiB, conv=fsync)": (
            ["dd", "if=/dev/zero", f"of={ddw}", "bs=16M", f"count={dd_count}", "conv=fsync", "status=none"],
            ddw,
            {},
        ),
        "start-up (imports)": ([sys.executable, "-c", imports], None, env),
    }
    for k, tep in zip(keeps, teps):
        out = tmp / f"out-K{k}"
        jobs[f"floor K={k} -> EP {tep}"] = (
            [sys.executable, str(Path(__file__).resolve()), "--floor", str(specs[k]), str(out)],
            out,
            {},
        )
        convert = [mcore, "convert", str(src), "--plan", str(plans[k]), "-o", str(out)]
        convert += ["--target-tp", "1", "--target-pp", "1", "--target-ep", str(tep)]
        jobs[f"convert K={k} -> EP {tep}"] = (convert, out, env)

    info = machine()
    print(
        f"machine: {info['cpu']}, {info['nproc']} cores, {info['ram_gib']} GiB, {info['disk']}, kernel "
        f"{info['kernel']}, torch {torch.__version__}; library {sha}; page cache "
        f"{'dropped before every command' if cold else 'warm'}",
        flush=True,
    )
    print(f"command: python {' '.join(sys.argv)}", flush=True)
    load_before = os.getloadavg()
    samples: dict[str, list[dict]] = {k: [] for k in jobs}
    out_tensor_bytes: dict[str, int] = {}
    for r in range(a.repeat):
        for label, (cmd, out, e) in jobs.items():
            if label == "cp -r" and shutil.disk_usage(data).free < size + 2 * GIB:
                raise SystemExit(f"cp -r needs {size / GIB:.1f} GiB free beside the checkpoint under {data}")
            if out is not None:
                rm(out)
                out.unlink(missing_ok=True)
            m = measure(cmd, cold, log, e)
            m["load"] = os.getloadavg()
            m["source_read"] = cached_bytes(src) if cold else None
            if label.startswith(("floor", "convert")):
                k = int(label.split("K=")[1].split()[0])
                if label.startswith("floor"):
                    m["tensor_bytes"] = json.loads(m["stdout"].strip().splitlines()[-1])["written"]
                else:
                    m["tensor_bytes"] = tensor_bytes(out)
                    if r == 0 and a.verify:
                        v = subprocess.run(
                            [mcore, "verify", "--orig", str(src), "--proxy", str(out), "--plan", str(plans[k])],
                            capture_output=True,
                            text=True,
                            check=False,
                            env={**os.environ, **env},
                        )
                        m["verify_rc"] = v.returncode
                        if v.returncode:
                            raise SystemExit(f"verify failed on {out}:\n{v.stdout[-2000:]}{v.stderr[-2000:]}")
                out_tensor_bytes[label] = m["tensor_bytes"]
                if m["tensor_bytes"] != spec_of[k]["write_bytes"]:
                    print(
                        f"  note: {label} wrote {m['tensor_bytes']} tensor bytes, the spec {spec_of[k]['write_bytes']}",
                        flush=True,
                    )
            if out is not None:
                rm(out)
                out.unlink(missing_ok=True)
            samples[label].append(m)
            print(
                f"[{r + 1}/{a.repeat}] {label}: wall {m['wall']:.2f} s, max RSS {m['rss_max'] / MIB:.0f} MiB, "
                f"disk read {m['read_bytes'] / MIB:.0f} MiB, written {m['write_bytes'] / MIB:.0f} MiB"
                + (
                    f" (source in cache after: {m['source_read'] / MIB:.0f} MiB)"
                    if m["source_read"] is not None
                    else ""
                )
                + (f", tensors out {m['tensor_bytes'] / MIB:.1f} MiB" if "tensor_bytes" in m else "")
                + (", verify ok" if m.get("verify_rc") == 0 else "")
                + f", load {m['load'][0]:.2f}",
                flush=True,
            )
    load_after = os.getloadavg()

    def per_rep(x: str, y: str) -> float:
        return statistics.median(p["wall"] / max(q["wall"], 0.01) for p, q in zip(samples[x], samples[y]))

    med = {
        k: {f: statistics.median(s[f] for s in v) for f in ("wall", "rss_max", "read_bytes", "write_bytes")}
        | {"cp_ratio": per_rep(k, "cp -r")}
        for k, v in samples.items()
    }
    dd_read_label = next(k for k in jobs if k.startswith("dd read"))
    dd_write_label = next(k for k in jobs if k.startswith("dd write"))
    read_mbs = statistics.median(dd_bytes / 1e6 / max(s["wall"], 0.01) for s in samples[dd_read_label])
    write_mbs = statistics.median(dd_count * 16 * MIB / 1e6 / max(s["wall"], 0.01) for s in samples[dd_write_label])
    cp_mbs = statistics.median(size / 1e6 / max(s["wall"], 0.01) for s in samples["cp -r"])
    summary = {}
    for k, tep in zip(keeps, teps):
        fl, cv, spec = f"floor K={k} -> EP {tep}", f"convert K={k} -> EP {tep}", spec_of[k]
        proxy_layer = max(spec["proxy_layer_bytes"].values())
        source_layer = max(spec["source_layer_bytes"].values())
        summary[cv] = {
            "read_bytes": spec["read_bytes"] + spec["meta_bytes"],
            "write_bytes": spec["write_bytes"],
            "convert_tensor_bytes": out_tensor_bytes.get(cv),
            "floor_tensor_bytes": out_tensor_bytes.get(fl),
            "dd_estimate_s": (spec["read_bytes"] + spec["meta_bytes"]) / 1e6 / read_mbs
            + spec["write_bytes"] / 1e6 / write_mbs,
            "dd_read_only_estimate_s": (spec["read_bytes"] + spec["meta_bytes"]) / 1e6 / read_mbs,
            "floor_s": med[fl]["wall"],
            "convert_s": med[cv]["wall"],
            "convert_over_floor": per_rep(cv, fl),
            "convert_over_cp": per_rep(cv, "cp -r"),
            "floor_over_cp": per_rep(fl, "cp -r"),
            "convert_rss": med[cv]["rss_max"],
            "bound_proxy_layers": 2 * proxy_layer + GIB,
            "bound_source_layers": 2 * source_layer + GIB,
        }
    profile = profile_convert(jobs, keeps, teps, tmp, data, env, log, measure, rm) if a.profile else None
    rm(tmp)
    (data / "wide-results.json").write_text(
        json.dumps(
            {
                "date": time.strftime("%Y-%m-%d %H:%M"),
                "argv": sys.argv,
                "library": sha,
                "machine": info,
                "cold_cache": cold,
                "source": {"path": str(src), "bytes": size, "rank_files": len(files)},
                "load_before": load_before,
                "load_after": load_after,
                "throughput_MBps": {"dd_read": read_mbs, "dd_write": write_mbs, "cp_r": cp_mbs},
                "specs": {
                    k: {f: v for f, v in s.items() if f not in ("reads", "outputs", "meta")} for k, s in spec_of.items()
                },
                "summary": summary,
                "medians": med,
                "samples": samples,
                "profile": profile,
            },
            indent=1,
            default=str,
        )
    )
    print(
        f"\nload average (1, 5, 15 min): before {load_before[0]:.2f} {load_before[1]:.2f} {load_before[2]:.2f}, "
        f"after {load_after[0]:.2f} {load_after[1]:.2f} {load_after[2]:.2f}"
    )
    print(
        f"source {size / GIB:.2f} GiB in {len(files)} rank files; dd read {read_mbs:.0f} MB/s, dd write "
        f"{write_mbs:.0f} MB/s, cp -r {cp_mbs:.0f} MB/s (source bytes / wall)"
    )
    print(
        f"medians of {a.repeat}; ratios: medians over repetitions of (wall / wall of the other in the same repetition)"
    )
    print("| command | wall s | / cp -r | peak RSS MiB | disk read MiB | disk written MiB |")
    print("|---|---|---|---|---|---|")
    for k, m in med.items():
        print(
            f"| {k} | {m['wall']:.2f} | {m['cp_ratio']:.2f} | {m['rss_max'] / MIB:.0f} | {m['read_bytes'] / MIB:.0f} "
            f"| {m['write_bytes'] / MIB:.0f} |"
        )
    print()
    print(
        "| plan | must read GiB | writes GiB (floor / convert tensors) | dd estimate s | floor s | convert s "
        "| convert / floor | convert / cp -r | convert peak RSS MiB | 2 proxy layers + 1 GiB, MiB "
        "| 2 source layers + 1 GiB, MiB |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for cv, s in summary.items():
        fb, cb = s["floor_tensor_bytes"] or 0, s["convert_tensor_bytes"] or 0
        print(
            f"| {cv.removeprefix('convert ')} | {s['read_bytes'] / GIB:.3f} | {fb / GIB:.3f} / {cb / GIB:.3f} "
            f"| {s['dd_estimate_s']:.2f} | {s['floor_s']:.2f} | {s['convert_s']:.2f} | {s['convert_over_floor']:.2f} "
            f"| {s['convert_over_cp']:.2f} | {s['convert_rss'] / MIB:.0f} | {s['bound_proxy_layers'] / MIB:.0f} "
            f"| {s['bound_source_layers'] / MIB:.0f} |"
        )
    if profile:
        print(f"\nprofile (warm, cProfile, {profile['label']}): wall {profile['wall']:.2f} s without the profiler")
        print(profile["top"])
    return 0


def profile_convert(jobs, keeps, teps, tmp, data, env, log, measure, rm) -> dict:
    """convert of the largest plan, warm: once untimed (warms the cache), once timed, once under cProfile."""
    import io
    import pstats

    k, tep = max(zip(keeps, teps))
    label = f"convert K={k} -> EP {tep}"
    cmd, out, _ = jobs[label]
    for _ in range(2):
        rm(out)
        m = measure(cmd, False, log, env)
    rm(out)
    prof = data / "convert-profile.prof"
    pcmd = [sys.executable, "-m", "cProfile", "-o", str(prof), "-m", "mcore_proxy", *cmd[1:]]
    t = time.perf_counter()
    subprocess.run(pcmd, check=True, capture_output=True, env={**os.environ, **env})
    profiled = time.perf_counter() - t
    rm(out)
    text = io.StringIO()
    st = pstats.Stats(str(prof), stream=text)
    st.sort_stats("tottime").print_stats(25)
    st.sort_stats("cumulative").print_stats(30)
    (data / "convert-profile.txt").write_text(text.getvalue())
    top = "\n".join(ln for ln in text.getvalue().splitlines()[:60])
    return {"label": label, "wall": m["wall"], "profiled_wall": profiled, "top": top}


if __name__ == "__main__":
    sys.exit(main())
