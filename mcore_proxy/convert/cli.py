"""`mcore-proxy convert` and `mcore-proxy verify`: thin layers over convert.pipeline / convert.verify."""
from __future__ import annotations

from pathlib import Path

from mcore_proxy.checkpoint.formats import format_names


def _int_list(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(","))


def register(sub) -> None:
    p = sub.add_parser("convert", help="apply a selection plan and/or re-shard a checkpoint",
                       description="Write the proxy checkpoint: kept experts renumbered, router rows "
                       "subset, everything else copied bit for bit, at the target parallel layout. "
                       "Without --plan it only re-shards.")
    p.add_argument("ckpt", type=Path, help="source checkpoint folder (legacy, torch_dist or Hugging Face)")
    p.add_argument("--plan", type=Path, help="plan.json from `mcore-proxy select`")
    p.add_argument("-o", "--out", type=Path, required=True, help="output folder (must not exist)")
    p.add_argument("--target-tp", "--target-tensor-parallel-size", dest="tp", type=int,
                   help="default: the source's TP")
    p.add_argument("--target-pp", "--target-pipeline-parallel-size", dest="pp", type=int,
                   help="default: the source's PP")
    p.add_argument("--target-ep", "--target-expert-model-parallel-size", dest="ep", type=int,
                   help="default: the plan's expert-parallel degree (the source's without a plan)")
    p.add_argument("--target-etp", "--target-expert-tensor-parallel-size", dest="etp", type=int,
                   help="default: the source's ETP when it is 1 or TP, else equal to TP")
    p.add_argument("--target-stage-layers", type=_int_list, help="decoder layers per pipeline stage, e.g. 1,3")
    p.add_argument("--expert-layout", choices=("sequential", "grouped"),
                   help="SequentialMLP or GroupedMLP (--moe-grouped-gemm) experts; default: the source's")
    p.add_argument("--format", choices=format_names(writable=True), default=None,
                   help="output format (default: the source's)")
    p.add_argument("--dequantize-fp8", action="store_true",
                   help="read an FP8 Hugging Face checkpoint's block-quantised weights as bf16 (default: copy "
                        "them and their scales bit for bit; Megatron output needs this)")
    p.add_argument("--workers", type=int, default=1, help="writer processes")
    p.add_argument("--dry-run", action="store_true",
                   help="run every check the conversion runs (including the output's lock and free space), "
                        "print the plan, write nothing")
    p.add_argument("--no-space-check", action="store_true",
                   help="skip the comparison of the bytes to write with the free space of the target")
    p.set_defaults(func=run_convert)

    v = sub.add_parser("verify", help="check a proxy against its source and plan")
    v.add_argument("--orig", type=Path, required=True, help="source checkpoint")
    v.add_argument("--proxy", type=Path, required=True, help="proxy checkpoint written by convert")
    v.add_argument("--plan", type=Path, required=True, help="plan.json used for the conversion")
    v.add_argument("--functional", action="store_true",
                   help="also run both in megatron-core on CPU (small models only)")
    v.set_defaults(func=run_verify)


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def run_convert(args) -> int:
    from mcore_proxy.convert.pipeline import ConvertRequest, convert

    req = ConvertRequest(ckpt=args.ckpt, out=args.out, plan=args.plan, tp=args.tp, pp=args.pp, ep=args.ep,
                         etp=args.etp, expert_layout=args.expert_layout, stage_layers=args.target_stage_layers,
                         format=args.format, workers=args.workers, dequantize_fp8=args.dequantize_fp8)
    r = convert(req, dry_run=args.dry_run, check_space=not args.no_space_check)
    t = r.target
    layout = "sharded safetensors" if t is None else f"{t.describe()}, layout {t.expert_layout}"
    print(f"{'would write' if args.dry_run else 'wrote'} {r.out} ({r.format}): {r.num_experts} of "
          f"{r.source_experts} experts per MoE layer, {layout}")
    print(f"reads {_gib(r.bytes_read)} of tensors, writes about {_gib(r.output_bytes)}" + ("" if args.dry_run else
                                                      f"; {r.files} files in {r.seconds:.1f} s; manifest.json lists sha256 of each"))
    for name, why in r.dropped_args.items():
        print(f"args {name} {'would be' if args.dry_run else 'was'} dropped: it holds {why} "
              "(recorded in manifest.json)")
    if t is None:
        print("config.json holds the expert count, top-k and routing groups: load it with transformers or vLLM as is")
        return 0
    print("optimizer and RNG state are not carried over; launch the proxy with these flags changed:")
    print("  " + " ".join(f for f in r.launch_flags if not f.startswith("(")))
    return 0


def run_verify(args) -> int:
    from mcore_proxy.convert.verify import verify
    from mcore_proxy.errors import CheckFailed

    report = verify(args.orig, args.proxy, args.plan, functional=args.functional)
    print(f"checked {report.checked_tensors} tensors ({_gib(report.checked_bytes)}) bit for bit, args and manifest")
    if report.functional:
        f = report.functional
        print(f"functional: max |logit difference| {f['max_abs_diff']:.3g} over {f['tokens']} tokens "
              f"against the source restricted to the kept experts (tolerance {f['atol']:.1g})")
    if not report.ok:
        shown = report.problems[:5]
        more = f" (and {len(report.problems) - 5} more)" if len(report.problems) > 5 else ""
        raise CheckFailed("; ".join(shown) + more)
    print("verify: OK")
    return 0
