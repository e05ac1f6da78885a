"""Verify a proxy against its source and plan: bit-exact tensors, consistent args, manifest hashes,
and optionally the same outputs as the source restricted to the kept experts."""

from __future__ import annotations

import argparse
import dataclasses
import json
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch

from mcore_proxy.checkpoint import open_checkpoint
from mcore_proxy.checkpoint.formats import get_format
from mcore_proxy.checkpoint.safe_globals import enum_member_name
from mcore_proxy.checkpoint.view import ModelView, tensor_nbytes
from mcore_proxy.convert.manifest import MANIFEST, check_manifest
from mcore_proxy.convert.prune import PrunedView
from mcore_proxy.core.errors import InternalError, PlanError, ProxyError
from mcore_proxy.core.units import BYTES_PROGRESS


@dataclass
class VerifyReport:
    checked_tensors: int = 0
    checked_bytes: int = 0
    problems: list[str] = field(default_factory=list)
    functional: dict | None = None
    merged: bool = False  # the expected kept experts are recomputed cluster means (--merge-clusters)

    @property
    def ok(self) -> bool:
        return not self.problems


def same_bits(a, b) -> bool:
    """Bitwise equality (NaN == NaN, -0.0 != 0.0), dtype and shape included."""
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
        return a == b
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)) if a.numel() else True


def compare_tensors(expected: ModelView, proxy: ModelView, report: VerifyReport, progress=None) -> None:
    want, have = set(expected.names()), set(proxy.names())
    report.problems += [f"{n}: missing from the proxy" for n in sorted(want - have)]
    report.problems += [f"{n}: in the proxy but not expected" for n in sorted(have - want)]
    for name in expected.names():
        if name not in have:
            continue
        a, b = expected.get(name), proxy.get(name)
        if not same_bits(a, b):
            src = expected.source_name(name) if isinstance(expected, PrunedView) else name
            shape_a = tuple(a.shape) if isinstance(a, torch.Tensor) else a
            shape_b = tuple(b.shape) if isinstance(b, torch.Tensor) else b
            report.problems.append(f"{name}: differs from source {src} ({shape_a} vs {shape_b})")
        if isinstance(a, torch.Tensor):
            report.checked_tensors += 1
            report.checked_bytes += a.numel() * a.element_size()
            if progress is not None:
                progress.update(a.numel() * a.element_size())


def compare_args(plan, proxy: ModelView, source: ModelView, report: VerifyReport) -> None:
    got, router = proxy.spec, plan.router
    checks = [
        ("num_experts", got.num_experts, plan.num_experts),
        ("moe_router_topk", got.topk, router.topk),
        ("moe_router_num_groups", got.num_groups, router.num_groups),
        ("moe_router_group_topk", got.group_topk, router.group_topk),
        ("moe_router_score_function", got.score_function, source.spec.score_function),
        ("MoE layers", got.moe_layer_ids, source.spec.moe_layer_ids),
        ("num_layers", got.num_layers, source.spec.num_layers),
        ("hidden_size", got.hidden_size, source.spec.hidden_size),
    ]
    report.problems += [f"args {what} is {have!r}, expected {want!r}" for what, have, want in checks if have != want]


def compare_arg_fields(source: ModelView, proxy: ModelView, dropped, report: VerifyReport) -> None:
    """Every enum in the source's args is the same member in the proxy's (whichever form the source
    pickled it in), and every field the proxy lacks is one the manifest records as dropped."""
    if not isinstance(source.args, argparse.Namespace) or not isinstance(proxy.args, argparse.Namespace):
        return
    have, recorded = vars(proxy.args), set(dropped)
    for name, value in sorted(vars(source.args).items()):
        if name not in have:
            if name not in recorded:
                report.problems.append(
                    f"args {name}: missing from the proxy and not recorded as dropped in its manifest"
                )
        elif enum_member_name(value) is not None and have[name] != value:
            report.problems.append(f"args {name} is {have[name]!r}, expected the source's {value!r}")


def _manifest(proxy: Path) -> dict:
    """The proxy's manifest.json as a dict ({} when unreadable: `check_manifest` reports that)."""
    try:
        doc = json.loads((Path(proxy) / MANIFEST).read_bytes())
    except (OSError, ValueError, RecursionError):
        return {}
    return doc if isinstance(doc, dict) else {}


def recorded_dropped_args(proxy: Path) -> list[str]:
    """The args fields the proxy's manifest says convert dropped."""
    dropped = _manifest(proxy).get("dropped_args", {})
    return [str(k) for k in dropped] if isinstance(dropped, dict) else []


def recorded_merge(proxy: Path) -> bool:
    """Whether the proxy's manifest says convert merged the plan's clusters (--merge-clusters)."""
    plan = _manifest(proxy).get("plan")
    return isinstance(plan, dict) and "merged_clusters" in plan


def verify(orig: Path, proxy: Path, plan_path: Path, functional: bool = False, progress: bool = True) -> VerifyReport:
    """Every check; problems are collected, not raised (the CLI turns them into exit code 1)."""
    from tqdm import tqdm

    from mcore_proxy.runtime.memory import expect_torch, return_freed_buffers_to_os
    from mcore_proxy.select.plan import load_plan

    return_freed_buffers_to_os()
    expect_torch()  # it compares tensors
    plan = load_plan(plan_path)
    merged = recorded_merge(proxy)
    if functional and merged:
        raise ProxyError(
            f"{proxy}: was written with --merge-clusters, so its experts are cluster means and not the source's "
            "restricted to the kept ones by design; leave out --functional (the means are recomputed from "
            "the source and compared bit for bit)"
        )
    source = open_checkpoint(orig)
    proxy_view = open_checkpoint(proxy)
    frameworks = {get_format(v.info.format).framework for v in (source, proxy_view)}
    if len(frameworks) > 1:  # compared under the one naming both have: megatron-core's
        source, proxy_view = source.named_for("megatron-core"), proxy_view.named_for("megatron-core")
    if source.quantized_schemes() and not proxy_view.quantized_schemes():
        source = source.dequantized()  # the proxy was written with --dequantize
    try:
        expected = PrunedView(source, plan, merge=merged)
    except PlanError as err:  # as convert says it: the plan file and the checkpoint
        raise PlanError(f"{plan_path}: {err} (checkpoint {orig})") from None
    report = VerifyReport(merged=merged)
    compare_args(plan, proxy_view, source, report)
    compare_arg_fields(source, proxy_view, recorded_dropped_args(proxy), report)
    total = sum(tensor_nbytes(expected, n) for n in expected.names())
    with tqdm(total=total, **BYTES_PROGRESS, mininterval=2, desc="verify", disable=not progress) as bar:
        compare_tensors(expected, proxy_view, report, bar)
    report.problems += [f"manifest: {p}" for p in check_manifest(Path(proxy))]
    if functional and report.ok:
        frameworks = {get_format(v.info.format).framework for v in (source, proxy_view)}
        if len(frameworks) > 1:
            raise ProxyError(
                f"--functional runs both models in one framework, but {orig} is "
                f"{source.info.format} and {proxy} is {proxy_view.info.format}; the tensors were "
                "compared bit for bit, convert one side to the other's format to run both"
            )
        if source.spec.noop_layers:
            raise ProxyError(
                f"--functional builds the models in megatron-core, which has no noop layer, but {orig} "
                f"has noop layers {list(source.spec.noop_layers)} (MindSpeed --noop-layers); the tensors "
                "were compared bit for bit, leave out --functional"
            )
        check = {"megatron-core": functional_check, "transformers": hf_functional_check}[frameworks.pop()]
        report.functional = check(source, proxy_view, plan)
        if not report.functional["match"]:
            report.problems.append(
                f"functional: proxy logits differ from the source restricted to kept experts by "
                f"{report.functional['max_abs_diff']:.3g} (tolerance {report.functional['atol']:.1g})"
            )
    return report


def hf_functional_check(source: ModelView, proxy: ModelView, plan) -> dict:
    """Both Hugging Face checkpoints run in transformers on CPU on fixed tokens; the proxy's
    logits must equal the source's when its gates may only choose the kept experts."""
    from mcore_proxy.hf.models import load_model, restrict_gates, run, vocab_size

    if plan.router.topk != source.spec.topk:
        raise ProxyError(
            f"verify --functional on Hugging Face checkpoints runs the source at its own top-{source.spec.topk}, "
            f"but the plan's proxy routes top-{plan.router.topk} (select --proxy-topk); leave out --functional "
            "(the bit-for-bit comparison still runs) or convert to a Megatron format"
        )
    orig_model, proxy_model = load_model(source), load_model(proxy)
    vocab = vocab_size(source)
    tokens = torch.randint(0, vocab, (2, 16), generator=torch.Generator().manual_seed(7))
    with restrict_gates(orig_model, plan):
        ref = run(orig_model, tokens)
    got = run(proxy_model, tokens)
    atol = 1e-5 if next(orig_model.parameters()).dtype == torch.float32 else 2e-2
    diff = (ref - got).abs().max().item()
    return {
        "max_abs_diff": diff,
        "atol": atol,
        "match": bool(diff <= atol + atol * ref.abs().max().item()),
        "tokens": int(tokens.numel()),
    }


def functional_check(source: ModelView, proxy: ModelView, plan) -> dict:
    """Build both models in megatron-core on CPU (TP=PP=EP=1, small models only; local spec, GQA or
    multi-latent attention, MTP heads included), run fixed tokens, and compare the proxy's logits
    with the source's when its routers may only choose the kept experts. The two are the same
    function, so they must agree to rounding."""
    from mcore_proxy.checkpoint.formats import write_checkpoint
    from mcore_proxy.checkpoint.target import resolve_target
    from mcore_proxy.functional.family import StagedLayout, family_from_spec, load_legacy_and_run

    keep = {lid: plan.kept(lid) for lid in source.spec.moe_layer_ids}
    # GQA or multi-latent attention, MTP, learned or rope positions; a size the args lack is named
    # (with the file) before any work
    models = {
        label: family_from_spec(view.spec, tied=view.embeddings_tied())
        for label, view in (("source", source), ("proxy", proxy))
    }
    # the reference routes as the proxy does: a proxy top-k (`select --proxy-topk`) changes how many
    # experts a token mixes, not which weights it meets
    models["source"] = dataclasses.replace(models["source"], topk=plan.router.topk)
    with tempfile.TemporaryDirectory(prefix="mcore-proxy-functional-") as tmp:
        tmp = Path(tmp)
        for label, view in (("source", source), ("proxy", proxy)):
            write_checkpoint(view, tmp / label, resolve_target(view, expert_layout="sequential"), progress=False)
        try:
            ref, got = load_legacy_and_run(
                [(models[label], StagedLayout(), tmp / label, tmp / f"{label}.pt") for label in ("source", "proxy")],
                keeps=[keep, None],
            )
        except torch.multiprocessing.ProcessRaisedException as err:
            # not a difference found by the check (exit 1): the check could not run (exit 3)
            last = str(err).strip().splitlines()[-1]
            raise InternalError(f"functional: megatron-core could not run the models ({last})") from None
    floating = {source.dtype(n) for n in source.names() if source.dtype(n) is not None}
    atol = 1e-5 if floating <= {torch.float32} else 2e-2
    diff = (ref.float() - got.float()).abs().max().item()
    return {
        "max_abs_diff": diff,
        "atol": atol,
        "match": bool(diff <= atol + atol * ref.abs().max().item()),
        "tokens": int(ref.shape[-3] * ref.shape[-2]),
    }  # logits [1 + mtp, b, s, V]: every head compared
