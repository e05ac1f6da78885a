"""`mcore-proxy estimate`: a thin layer over `mcore_proxy.estimate`."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from mcore_proxy.core.errors import ProxyError
from mcore_proxy.cli_support.flags import add_command, add_option, emit, positive_int

_UNITS = {
    "": 1 << 30,
    "g": 1 << 30,
    "gi": 1 << 30,
    "gib": 1 << 30,
    "gb": 10**9,
    "m": 1 << 20,
    "mi": 1 << 20,
    "mib": 1 << 20,
    "mb": 10**6,
    "t": 1 << 40,
    "tib": 1 << 40,
    "tb": 10**12,
}


def parse_size(text: str) -> int:
    """`64GiB`, `64G`, `64` (GiB), `65536MiB`, `64GB` (decimal) -> bytes."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not m or m[2].lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size; write e.g. 64GiB, 32GiB or 80GB")
    return int(float(m[1]) * _UNITS[m[2].lower()])


def register(sub) -> None:
    from mcore_proxy.estimate.memory import OPTIMIZERS, PRECISIONS, RECOMPUTE
    from mcore_proxy.estimate.presets import PRESETS

    p = add_command(
        sub,
        "estimate",
        run_estimate,
        help="parameters, memory per device and the fewest devices, original vs proxy",
        description="Plan before converting: parameter counts, bytes of weights, gradients, optimizer state "
        "(distributed optimizer) and activations on the most loaded device, and the smallest "
        "valid layouts that fit for the original and its proxy with K experts. Reads only "
        "metadata. Sources are layered: --preset, then --hf-config, then the checkpoint's own args.",
    )
    add_option(
        p, "--ckpt", type=Path, metavar="CKPT", help="Megatron checkpoint (its args and tensor names; no tensor bytes)"
    )
    p.add_argument("--hf-config", type=Path, metavar="CONFIG", help="HF config.json (or its folder)")
    p.add_argument("--preset", choices=sorted(PRESETS), help="a public model configuration")
    p.add_argument("--num-experts", "-k", type=positive_int, required=True, metavar="K", help="experts the proxy keeps")
    p.add_argument(
        "--device-memory",
        type=parse_size,
        default=parse_size("64GiB"),
        metavar="SIZE",
        help="memory of one device (default 64GiB, as an Ascend 910B)",
    )
    p.add_argument(
        "--memory-fraction",
        type=float,
        default=0.9,
        help="share of it training may use (default 0.9: the rest for runtime, buffers, fragmentation)",
    )
    for flag, what in (
        ("--tp", "tensor"),
        ("--pp", "pipeline"),
        ("--ep", "expert"),
        ("--etp", "expert tensor"),
        ("--dp", "data"),
    ):
        add_option(p, flag, type=positive_int, metavar="N", help=f"fix the {what}-parallel size (default: searched)")
    add_option(p, "--micro-batch", type=positive_int, default=1, metavar="N")
    add_option(p, "--seq-len", type=positive_int, default=4096, metavar="N")
    p.add_argument("--optimizer", choices=OPTIMIZERS, default="adam")
    p.add_argument("--precision", choices=PRECISIONS, default="bf16")
    p.add_argument("--recompute", choices=RECOMPUTE, default="none", help="activation recomputation")
    p.add_argument(
        "--devices-per-node",
        type=positive_int,
        default=8,
        help="device counts are whole nodes or a divisor of one (default 8)",
    )
    p.add_argument("--max-devices", type=positive_int, default=16384, help="largest device count searched")


def architecture(args):
    """The ModelSpec of the layered sources (preset < config.json < checkpoint args)."""
    from mcore_proxy.checkpoint.hf import read_config_json, spec_fields_from_config
    from mcore_proxy.estimate.sources import from_preset, from_spec, merge

    parts = []
    if args.preset:
        parts.append(from_preset(args.preset))
    if args.hf_config:
        parts.append(spec_fields_from_config(read_config_json(args.hf_config), str(args.hf_config)))
    if args.ckpt:
        from mcore_proxy.checkpoint import open_checkpoint

        view = open_checkpoint(args.ckpt)
        parts.append({**from_spec(view.spec, view.names(), f"{args.ckpt} args"), "name": args.ckpt.resolve().name})
    if not parts:
        raise ProxyError("estimate needs a model: --ckpt CKPT, --hf-config config.json or --preset NAME")
    return merge(*parts)


def run_estimate(args) -> int:
    from mcore_proxy.estimate import Request, estimate
    from mcore_proxy.estimate.memory import Training
    from mcore_proxy.estimate.report import format_text, to_dict
    from mcore_proxy.estimate.search import Constraints

    for flag in ("tp", "pp", "ep", "etp", "dp", "devices_per_node", "max_devices"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise ProxyError(f"--{flag.replace('_', '-')} {value} must be a positive integer")
    req = Request(
        num_experts=args.num_experts,
        device_memory=args.device_memory,
        memory_fraction=args.memory_fraction,
        training=Training(
            micro_batch=args.micro_batch,
            seq_len=args.seq_len,
            precision=args.precision,
            optimizer=args.optimizer,
            recompute=args.recompute,
        ),
        constraints=Constraints(
            tp=args.tp,
            pp=args.pp,
            ep=args.ep,
            etp=args.etp,
            dp=args.dp,
            devices_per_node=args.devices_per_node,
            max_devices=args.max_devices,
        ),
    )
    result = estimate(architecture(args), req)
    emit(args, "estimate", to_dict(result), format_text(result))
    return 0
