"""`mcore-proxy convert` and `mcore-proxy verify`: thin layers over convert.pipeline / convert.verify."""

from __future__ import annotations

import argparse
from pathlib import Path

from mcore_proxy.cli_support.flags import (
    add_checkpoint_argument,
    add_command,
    add_not_yet,
    add_option,
    emit,
    positive_int,
)
from mcore_proxy.core.units import format_bytes

# checkpoint.formats' writable rows (tests/checkpoint/test_formats.py keeps them equal), spelled out
# so that building the parser does not import every reader and torch (`--help`, `watch`: issue 23)
WRITABLE_FORMATS = ("torch_dist", "legacy", "hf")

MAX_PROBLEMS_SHOWN = 20


def _int_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of layer counts, e.g. 1,3") from None


def register(sub) -> None:
    p = add_command(
        sub,
        "convert",
        run_convert,
        help="write the proxy checkpoint (or only re-shard)",
        writes="output folder (an earlier mcore-proxy output)",
        description="Write the proxy checkpoint: kept experts renumbered, router rows subset, "
        "everything else copied bit for bit, at the target parallel layout, with "
        "manifest.json (sha256 of every file) and the launch flags to change. "
        "Without --plan it only re-shards.",
    )
    add_checkpoint_argument(p, "source checkpoint folder (legacy, torch_dist or Hugging Face)", type=Path)
    p.add_argument("--plan", type=Path, help="plan.json from `mcore-proxy select`")
    add_option(
        p, "-o", "--out", type=Path, required=True, metavar="OUT", help="output folder (must not exist unless --force)"
    )
    add_option(p, "--target-tp", dest="tp", type=positive_int, metavar="N", help="default: the source's TP")
    add_option(p, "--target-pp", dest="pp", type=positive_int, metavar="N", help="default: the source's PP")
    add_option(
        p,
        "--target-ep",
        dest="ep",
        type=positive_int,
        metavar="N",
        help="any divisor of K; default: the plan's expert-parallel degree (the source's without a plan)",
    )
    add_option(
        p,
        "--target-etp",
        dest="etp",
        type=positive_int,
        metavar="N",
        help="default: the source's ETP when it is 1 or TP, else equal to TP",
    )
    add_option(
        p,
        "--target-stage-layers",
        type=_int_list,
        metavar="N,N,..",
        help="decoder layers per pipeline stage, e.g. 1,3 (default: the source's when PP is kept, else even)",
    )
    add_option(
        p,
        "--target-pipeline-layout",
        metavar="STR",
        help="Megatron's --pipeline-model-parallel-layout for the proxy, e.g. 'Et|tt|m|L' (E embedding, "
        "t decoder layer, m MTP layer, L loss; stages split by '|', PP x VPP of them; default: the "
        "source's when PP is kept)",
    )
    add_option(
        p,
        "--target-vpp",
        dest="vpp",
        type=positive_int,
        metavar="N",
        help="virtual pipeline stages per rank, Megatron's even interleaved split: chunk (pp, vp) holds "
        "layers (vp*PP + pp)*n .. +n (default: the source's when PP is kept; 1: none)",
    )
    add_option(
        p,
        "--expert-layout",
        choices=("sequential", "grouped"),
        help="SequentialMLP or GroupedMLP (--moe-grouped-gemm) experts; default: the source's",
    )
    p.add_argument(
        "--naming",
        choices=("megatron", "mindspeed-llm"),
        help="tensor names of multi-latent attention: megatron-core's or MindSpeed-LLM's (fused linear_qkv, "
        "--mla-mm-split parts as the source has them); default: the source's (legacy output)",
    )
    p.add_argument(
        "--moe-tp-extend-ep",
        dest="tp_extend_ep",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="MindSpeed-LLM --moe-tp-extend-ep: whole experts over EP x TP rank folders; default: the "
        "source's when writing MindSpeed-LLM names",
    )
    p.add_argument("--format", choices=WRITABLE_FORMATS, default=None, help="output format (default: the source's)")
    p.add_argument(
        "--dequantize",
        "--dequantize-fp8",
        dest="dequantize",
        action="store_true",
        help="read a quantized Hugging Face checkpoint's weights as bf16: FP8 with block scales, "
        "DeepSeek-V4's FP4 experts, gpt-oss's MXFP4 (default: copy them and their scales bit for "
        "bit; Megatron output needs this)",
    )
    p.add_argument(
        "--merge-clusters",
        dest="merge",
        action="store_true",
        help="opt-in, changes weights: each kept expert becomes the mean of its plan cluster's members, "
        "weighted by their routed-selection frequencies (reads the dropped experts too; `verify` "
        "recomputes the means; see docs/selection.md for what it preserves)",
    )
    p.add_argument("--workers", type=positive_int, default=1, help="writer processes")
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="run every check the conversion runs (including the output's lock and free space), "
        "print the plan, write nothing",
    )
    p.add_argument(
        "--no-space-check",
        action="store_true",
        help="skip the comparison of the bytes to write with the free space of the target",
    )
    add_not_yet(p, "convert")

    v = add_command(
        sub,
        "verify",
        run_verify,
        help="check a proxy against its source and plan",
        checks="a tensor, an args field, a manifest hash or the functional check differs",
        description="Check every tensor of the proxy bit for bit against its source, the args "
        "against the plan, the files against manifest.json, and with --functional "
        "that both compute the same in megatron-core.",
    )
    add_option(v, "--orig", type=Path, required=True, metavar="CKPT", help="source checkpoint")
    add_option(v, "--proxy", type=Path, required=True, metavar="OUT", help="proxy checkpoint written by convert")
    v.add_argument("--plan", type=Path, required=True, help="plan.json used for the conversion")
    v.add_argument(
        "--functional", action="store_true", help="also run both in megatron-core on CPU (small models only)"
    )

    d = add_command(
        sub,
        "distill",
        run_distill,
        help="train a proxy briefly against its original (changes weights; opt-in)",
        writes="a distilled proxy checkpoint",
        description="A short distillation: every proxy parameter trained on KL(original || proxy) over "
        "calibration token rows, both models in megatron-core on CPU (one rank, small models). The result "
        "is not a bit-for-bit proxy: see docs/selection.md for what it changes about reproducing faults.",
    )
    add_option(d, "--orig", type=Path, required=True, metavar="CKPT", help="the original (legacy, one rank)")
    d.add_argument("--proxy", type=Path, required=True, help="the proxy convert wrote (legacy, one rank)")
    d.add_argument("--tokens", type=Path, required=True, help=".npy of token ids [rows, sequence] (calibration data)")
    d.add_argument("--steps", type=positive_int, default=300, help="optimizer steps (default %(default)s)")
    d.add_argument("--lr", type=float, default=1e-3, help="Adam learning rate (default %(default)s)")
    d.add_argument("--batch", type=positive_int, default=64, help="token rows per step (default %(default)s)")
    d.add_argument("--pad-id", type=int, default=None, help="token id whose positions are left out (default: none)")
    d.add_argument("--held-out", type=int, default=None, help="last rows kept to measure KL (default: a tenth)")
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("-o", "--output", type=Path, required=True, help="folder to write (must not exist unless --force)")


def convert_dict(r, dry_run: bool) -> dict:
    """The `--json` document of convert: the numbers of the text, sizes in bytes. `target` is None for
    Hugging Face output, which is sharded by file, not by parallel rank."""
    t = r.target
    return {
        "out": str(r.out),
        "dry_run": dry_run,
        "output_format": r.format,
        "num_experts": r.num_experts,
        "source_experts": r.source_experts,
        "target": None
        if t is None
        else {
            "tp": t.tp,
            "pp": t.pp,
            "ep": t.ep,
            "etp": t.etp,
            "expert_layout": t.expert_layout,
            "stage_layers": list(t.stage_layers),
            "vpp": t.vpp,
            "pipeline_layout": t.pipeline_layout,
            "naming": t.naming.describe() if t.naming else "megatron-core",
            "moe_tp_extend_ep": t.tp_extend_ep,
        },
        "read_bytes": r.bytes_read,
        "output_bytes": r.output_bytes,
        "files": None if dry_run else r.files,
        "seconds": None if dry_run else r.seconds,
        "dropped_args": dict(r.dropped_args),
        "merged_clusters": r.merged,
        "launch_flags": [f for f in r.launch_flags if not f.startswith("(")],
        # flags of the source's launch that the proxy's must not carry: "(no --moe-grouped-gemm)"
        "remove_flags": [f[4:-1] for f in r.launch_flags if f.startswith("(no ")],
    }


def convert_text(d: dict) -> str:
    t, dry = d["target"], d["dry_run"]
    if t is None:
        layout = "sharded safetensors"
    else:
        layout = f"TP={t['tp']} PP={t['pp']} EP={t['ep']} ETP={t['etp']}"
        if t["vpp"] > 1:
            layout += f" VPP={t['vpp']}"
        if t["pipeline_layout"]:
            layout += f" layout {t['pipeline_layout']!r}"
        elif len(set(t["stage_layers"])) > 1:
            layout += f" stages={t['stage_layers']}"
        layout += f", layout {t['expert_layout']}"
        if t.get("moe_tp_extend_ep"):
            layout += ", --moe-tp-extend-ep"
        layout += f", {t.get('naming', 'megatron-core')} names"
    lines = [
        f"{'would write' if dry else 'wrote'} {d['out']} ({d['output_format']}): {d['num_experts']} of "
        f"{d['source_experts']} experts per MoE layer, {layout}",
        f"reads {format_bytes(d['read_bytes'])} of tensors, writes about {format_bytes(d['output_bytes'])}"
        + ("" if dry else f"; {d['files']} files in {d['seconds']:.1f} s; manifest.json lists sha256 of each"),
    ]
    if d["merged_clusters"]:
        lines.append(
            "kept experts are their clusters' frequency-weighted means (--merge-clusters): not the source's "
            "weights bit for bit; manifest.json records it and verify recomputes them"
        )
    lines += [
        f"args {name} {'would be' if dry else 'was'} dropped: it holds {why} (recorded in manifest.json)"
        for name, why in d["dropped_args"].items()
    ]
    if t is None:
        lines.append(
            "config.json holds the expert count, top-k and routing groups: load it with transformers or vLLM as is"
        )
    else:
        lines += [
            "optimizer and RNG state are not carried over; launch the proxy with these flags changed:",
            "  " + " ".join(d["launch_flags"]),
        ]
        if d["remove_flags"]:
            lines.append("and without: " + ", ".join(d["remove_flags"]))
    return "\n".join(lines)


def run_convert(args) -> int:
    from mcore_proxy.checkpoint.interface import TargetOptions
    from mcore_proxy.convert.pipeline import ConvertRequest, convert

    target = TargetOptions(
        tp=args.tp,
        pp=args.pp,
        ep=args.ep,
        etp=args.etp,
        expert_layout=args.expert_layout,
        stage_layers=args.target_stage_layers,
        pipeline_layout=args.target_pipeline_layout,
        vpp=args.vpp,
        naming=args.naming,
        tp_extend_ep=args.tp_extend_ep,
    )
    req = ConvertRequest(
        ckpt=args.ckpt,
        out=args.out,
        plan=args.plan,
        target=target,
        format=args.format,
        workers=args.workers,
        force=args.force,
        dequantize=args.dequantize,
        merge=args.merge,
    )
    result = convert(req, dry_run=args.dry_run, check_space=not args.no_space_check)
    doc = convert_dict(result, args.dry_run)
    emit(args, "convert", doc, convert_text(doc))
    return 0


def verify_dict(report) -> dict:
    return {
        "ok": report.ok,
        "checked_tensors": report.checked_tensors,
        "checked_bytes": report.checked_bytes,
        "problems": list(report.problems),
        "functional": report.functional,
        "merged_clusters": report.merged,
    }


def verify_text(d: dict) -> str:
    checked = f"{d['checked_tensors']} tensors ({format_bytes(d['checked_bytes'])})"
    lines = [
        f"checked {checked} bit for bit, args and manifest"
        if d["ok"]
        else f"verify: {len(d['problems'])} difference(s) found, checking {checked}, args and manifest:"
    ]
    if d["merged_clusters"]:
        lines.append(
            "the kept experts were compared with their clusters' means recomputed from the source (--merge-clusters)"
        )
    if not d["ok"]:
        shown = d["problems"][:MAX_PROBLEMS_SHOWN]
        lines += [f"  {p}" for p in shown]
        if len(d["problems"]) > len(shown):
            lines.append(f"  (and {len(d['problems']) - len(shown)} more; --json lists them all)")
    if f := d["functional"]:
        lines.append(
            f"functional: max |logit difference| {f['max_abs_diff']:.3g} over {f['tokens']} tokens "
            f"against the source restricted to the kept experts (tolerance {f['atol']:.1g})"
        )
    if d["ok"]:
        lines.append("verify: OK")
    return "\n".join(lines)


def require_functional_framework(orig) -> None:
    """--functional runs the models in their framework (transformers for Hugging Face checkpoints,
    megatron-core for Megatron ones): checked before the bit-for-bit pass, which may take long."""
    from mcore_proxy.checkpoint.formats import detect_format, get_format
    from mcore_proxy.core.optional import check

    framework = get_format(detect_format(orig)).framework
    module = {"transformers": "transformers", "megatron-core": "megatron"}.get(framework)
    if module is not None:
        check(module, why=f"verify --functional (it runs both models in {framework})")


def run_distill(args) -> int:
    from tqdm import tqdm

    from mcore_proxy.convert.distill import DistillSettings, distill, read_tokens
    from mcore_proxy.core.errors import ProxyError
    from mcore_proxy.core.optional import check

    if min(args.steps, args.batch) < 1 or args.lr <= 0:
        raise ProxyError("--steps and --batch must be at least 1 and --lr above 0")
    check("megatron", why="distill (it trains the proxy in megatron-core)")
    settings = DistillSettings(args.steps, args.lr, args.batch, args.pad_id, args.held_out, args.seed)
    r = distill(
        args.orig,
        args.proxy,
        read_tokens(args.tokens),
        args.output,
        settings,
        force=args.force,
        progress=lambda steps: tqdm(steps, desc="distill", unit="step"),
    )
    doc = {
        "out": str(r.out),
        "rows_trained": r.rows,
        "held_out_rows": r.held_out,
        "kl_before": r.kl_before,
        "kl_after": r.kl_after,
        "seconds": r.seconds,
    }
    text = (
        f"distilled {args.proxy} against {args.orig}: {args.steps} steps on {r.rows} token rows; held-out KL "
        f"{r.kl_before:.4f} -> {r.kl_after:.4f} nats per position ({r.held_out} rows); {r.seconds:.0f} s\n"
        f"wrote {r.out} (its weights are no longer the original's bit for bit: distill.json says so)"
    )
    emit(args, "distill", doc, text)
    return 0


def run_verify(args) -> int:
    from mcore_proxy.convert.verify import verify
    from mcore_proxy.core.errors import CheckFailed

    if args.functional:
        require_functional_framework(args.orig)
    report = verify(args.orig, args.proxy, args.plan, functional=args.functional)
    doc = verify_dict(report)
    emit(args, "verify", doc, verify_text(doc))
    if not report.ok:
        shown = report.problems[:5]
        more = f" (and {len(report.problems) - 5} more)" if len(report.problems) > 5 else ""
        raise CheckFailed("; ".join(shown) + more)
    return 0
