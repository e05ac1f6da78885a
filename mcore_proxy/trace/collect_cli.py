"""`mcore-proxy collect --hf MODEL --data FILE -o DIR`: routing statistics of a Hugging Face model."""

from __future__ import annotations

from pathlib import Path

from mcore_proxy.cli_support.flags import add_command, emit, positive_int


def register(sub) -> None:
    p = add_command(
        sub,
        "collect",
        run_collect,
        help="routing statistics of a Hugging Face model over calibration data",
        writes="routing_stats.safetensors and its .json in DIR",
        description="Run a Hugging Face MoE checkpoint in transformers over JSONL records "
        "({\"text\": ...} with the checkpoint's tokenizer, {\"input_ids\": [...]}, or for a "
        "vision-language model {\"text\": ..., \"image\": \"file.png\"} with the checkpoint's "
        "processor) and write DIR/routing_stats.safetensors (+ .json) for `mcore-proxy select`.",
    )
    p.add_argument("--hf", type=Path, required=True, metavar="MODEL", help="Hugging Face checkpoint folder")
    p.add_argument("--data", type=Path, required=True, metavar="FILE", help="JSONL calibration data")
    p.add_argument("-o", "--out", type=Path, required=True, metavar="DIR", help="folder for the statistics")
    p.add_argument("--max-tokens", type=positive_int, help="stop after this many tokens (default: all of FILE)")
    p.add_argument("--batch-size", type=positive_int, default=8, help="sequences per forward pass (default 8)")
    p.add_argument(
        "--max-length",
        type=positive_int,
        help="longest sequence; longer records are cut into windows (default: max_position_embeddings)",
    )
    p.add_argument("--device", choices=("cpu", "cuda", "npu"), default="cpu")


def run_collect(args) -> int:
    from mcore_proxy.core.optional import check

    check("transformers", why="collect --hf (it runs the model in transformers)")  # before DIR is touched
    from mcore_proxy.core.output import staged_files
    from mcore_proxy.core.stats import load_stats, sidecar_path
    from mcore_proxy.trace.hf import STATS_NAME, collect

    path = args.out / STATS_NAME
    # refused before the model runs if it exists (without --force); moved into place only when complete
    with staged_files(
        args.out,
        STATS_NAME,
        (STATS_NAME, sidecar_path(STATS_NAME).name),
        replace=args.force,
        inputs=(args.hf, args.data),
    ) as tmp:
        _, tokens = collect(
            args.hf,
            args.data,
            tmp,
            max_tokens=args.max_tokens,
            batch_size=args.batch_size,
            max_length=args.max_length,
            device=args.device,
        )
    stats = load_stats(path)
    doc = {
        "stats": str(path),
        "tokens": tokens,
        "moe_layers": len(stats.layers),
        "num_experts": stats.num_experts,
        "topk": stats.topk,
    }
    emit(
        args,
        "collect",
        doc,
        f"wrote {path}: {tokens} tokens through {len(stats.layers)} MoE layers "
        f"({stats.num_experts} experts, top-{stats.topk}); next: mcore-proxy select --ckpt {args.hf} --stats {path}",
    )
    return 0
