"""`mcore-proxy inspect CKPT [--json]`."""

from __future__ import annotations

import dataclasses

from mcore_proxy.cli_support.flags import add_checkpoint_argument, add_command, emit


def register(sub) -> None:
    p = add_command(
        sub,
        "inspect",
        run_inspect,
        help="what a checkpoint holds: format, layout, layers, experts, bytes",
        description="Show a Megatron checkpoint's format, iteration, parallel layout and stage sizes, "
        "dense/MoE/MTP layers, experts, router settings, dtype and bytes. Reads no tensor data.",
    )
    add_checkpoint_argument(p, "checkpoint folder (root with the tracker file, or an iter_* folder)")


def run_inspect(args) -> int:
    from mcore_proxy.checkpoint import open_checkpoint
    from mcore_proxy.checkpoint.inspect import describe, format_description
    from mcore_proxy.convert.twin import proof_of

    view = open_checkpoint(args.ckpt)
    info = describe(view)
    proof = proof_of(view)  # a family discovered from transformers: proven on its tiny twin, reported
    if proof is not None:
        info["twin_proof"] = {**dataclasses.asdict(proof), "summary": proof.summary()}
    emit(args, "inspect", info, format_description(info))
    return 0
