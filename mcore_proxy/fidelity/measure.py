"""Fidelity of a proxy against its original, both run in transformers on the same tokens.

Per MoE decoder layer (DESIGN.md layer ids "1", "2", ...; MTP layers are not measured):
- gate-mass share: of each token's original top-k routing weights, the share on experts the
  plan keeps (1.0: the proxy could route this token as the original did);
- top-1 agreement: the proxy's highest-weight expert, mapped back to its original id through
  the plan, equals the original's (each model on its own hidden states).
Per decoder layer: cosine of the two models' hidden states (the layer's output). On the logits:
next-token KL(original || proxy) in nats and top-1 agreement of the next-token prediction.
Every value is a mean over the real (non-padding) tokens, the image tokens of image-text records
(`hf.calibration`, through the original's processor) included.

Megatron checkpoints are measured through their Hugging Face conversion (`convert --format hf`
into a temporary folder; exact for Qwen3-MoE, tests/checkpoint/hf/test_hf_megatron.py), so
they must be small enough to run on this machine, as for `verify --functional`.
"""

from __future__ import annotations

import contextlib
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch

from mcore_proxy.core.errors import ProxyError
from mcore_proxy.hf.models import Routes, load_model, mark_routers, router_weight, run, text_config_of, vocab_size

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


@dataclass
class Sums:
    """Running sums over tokens -> means."""

    total: dict[str, float] = field(default_factory=dict)
    count: dict[str, int] = field(default_factory=dict)

    def add(self, key: str, values: torch.Tensor) -> None:
        self.total[key] = self.total.get(key, 0.0) + float(values.double().sum())
        self.count[key] = self.count.get(key, 0) + int(values.numel())

    def mean(self, key: str) -> float:
        return self.total[key] / self.count[key]


def gate_mass_share(weights: torch.Tensor, experts: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
    """weights, experts [T, k] (original top-k), kept [E] bool -> [T] share of the weight on kept experts."""
    return (weights * kept[experts]).sum(-1) / weights.sum(-1)


def top1(weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    """[T, k] -> [T] the expert id of the highest weight."""
    return experts.gather(-1, weights.argmax(-1, keepdim=True)).squeeze(-1)


def next_token_kl(orig: torch.Tensor, proxy: torch.Tensor) -> torch.Tensor:
    """Logits [T, V] -> [T] KL(softmax(orig) || softmax(proxy)) in nats."""
    p, q = torch.log_softmax(orig.double(), -1), torch.log_softmax(proxy.double(), -1)
    return (p.exp() * (p - q)).sum(-1)


@contextlib.contextmanager
def as_hf(path: Path, what: str):
    """`path` if it is a Hugging Face folder, else its HF conversion in a temporary folder."""
    from mcore_proxy.checkpoint.hf import is_hf_checkpoint

    if is_hf_checkpoint(path):
        yield Path(path)
        return
    from mcore_proxy.convert.pipeline import ConvertRequest, convert

    with tempfile.TemporaryDirectory(prefix="mcore-proxy-fidelity-") as tmp:
        out = Path(tmp) / "hf"
        try:
            convert(ConvertRequest(ckpt=Path(path), out=out, format="hf"), progress=False, check_space=False)
        except ProxyError as err:
            raise ProxyError(
                f"{what} {path}: is not a Hugging Face folder and does not convert to one ({err})"
            ) from None
        yield out


def _check_pair(orig, proxy, plan, paths) -> dict[str, torch.Tensor]:
    """The plan's kept-expert masks per MoE layer, after checking the two models fit it."""
    og, pg = mark_routers(orig), mark_routers(proxy)
    decoder = sorted((lid for lid in plan.layer_ids if not lid.startswith("mtp.")), key=int)  # MTP: not run
    if sorted(og, key=int) != decoder or sorted(pg, key=int) != decoder:
        raise ProxyError(
            f"{paths[2]}: plan layers {decoder} do not match the MoE layers of "
            f"{paths[0]} ({sorted(og, key=int)}) and {paths[1]} ({sorted(pg, key=int)})"
        )
    masks = {}
    for lid in og:
        kept, E, K = plan.kept(lid), router_weight(og[lid]).shape[0], router_weight(pg[lid]).shape[0]
        if K != len(kept) or E <= max(kept):
            raise ProxyError(
                f"{paths[2]}: layer {lid} keeps {len(kept)} of {E} experts, but "
                f"{paths[1]} has {K}; use the plan the proxy was made with"
            )
        mask = torch.zeros(E, dtype=torch.bool)
        mask[kept] = True
        masks[lid] = mask
    return masks


def measure(
    orig_path: Path,
    proxy_path: Path,
    plan_path: Path,
    data: Path,
    *,
    max_tokens: int | None = None,
    batch_size: int = 8,
    max_length: int | None = None,
    device: str = "cpu",
    progress: bool = True,
) -> dict:
    """Load both models (converting Megatron checkpoints to HF) and measure them over `data`;
    returns the report (JSON-ready, see the module docstring)."""
    from mcore_proxy.checkpoint.formats import open_checkpoint
    from mcore_proxy.hf.calibration import data_batches
    from mcore_proxy.select.plan import load_plan

    plan = load_plan(plan_path)
    with as_hf(Path(orig_path), "--orig") as o_dir, as_hf(Path(proxy_path), "--proxy") as p_dir:
        o_view, p_view = open_checkpoint(o_dir), open_checkpoint(p_dir)
        vocab = vocab_size(o_view), vocab_size(p_view)
        if vocab[0] != vocab[1]:
            raise ProxyError(
                f"{proxy_path}: vocabulary of {vocab[1]} differs from the original's {vocab[0]} ({orig_path}); "
                "compare a proxy with its own original"
            )
        orig, proxy = load_model(o_view, device), load_model(p_view, device)
        length = max_length or int(getattr(text_config_of(orig), "max_position_embeddings", 2048))
        # a Megatron checkpoint carries no tokenizer: text is tokenised by whichever side has one
        words = next((d for d in (o_dir, p_dir) if any((d / n).is_file() for n in TOKENIZER_FILES)), o_dir)
        batches = data_batches(data, words, vocab[0], batch_size, length, max_tokens, images=True)
        report = compare_models(
            orig, proxy, plan, batches, (orig_path, proxy_path, plan_path), max_tokens=max_tokens, progress=progress
        )
    if not report["tokens"]:
        raise ProxyError(f"{data}: holds no tokens; give at least one record")
    report.update(orig=str(orig_path), proxy=str(proxy_path), plan=str(plan_path), data=str(data))
    return report


@torch.no_grad()
def compare_models(
    orig,
    proxy,
    plan,
    batches,
    paths=("original", "proxy", "plan"),
    max_tokens: int | None = None,
    progress: bool = True,
) -> dict:
    """Two transformers models run on the same `batches` (calibration.Batch) -> the report's
    measurements; `paths` (original, proxy, plan) name the inputs in errors."""
    from tqdm import tqdm

    masks = _check_pair(orig, proxy, plan, paths)
    kept_ids = {lid: torch.tensor(plan.kept(lid)) for lid in masks}
    o_routes, p_routes = Routes(mark_routers(orig)), Routes(mark_routers(proxy))
    sums, tokens = Sums(), 0
    try:
        with tqdm(total=max_tokens, unit="tok", desc="fidelity", disable=not progress) as bar:
            for batch in batches:
                real = batch.attention_mask.reshape(-1) == 1
                lo, ho = run(orig, batch.input_ids, batch.attention_mask, hidden=True, inputs=batch.inputs)
                lp, hp = run(proxy, batch.input_ids, batch.attention_mask, hidden=True, inputs=batch.inputs)
                for i, (a, b) in enumerate(zip(ho, hp)):
                    # per token: [H], or every stream of a hyper-connected layer ([hc, H], DeepSeek-V4) as one vector
                    a, b = (
                        a.reshape(real.numel(), -1).float().cpu()[real],
                        b.reshape(real.numel(), -1).float().cpu()[real],
                    )
                    sums.add(f"cos.{i}", torch.nn.functional.cosine_similarity(a, b, dim=-1))
                for lid, mask in masks.items():
                    (wo, eo), (wp, ep) = o_routes.seen[lid], p_routes.seen[lid]
                    wo, eo, wp, ep = wo.cpu()[real], eo.cpu()[real], wp.cpu()[real], ep.cpu()[real]
                    sums.add(f"mass.{lid}", gate_mass_share(wo, eo, mask))
                    sums.add(f"top1.{lid}", (top1(wo, eo) == kept_ids[lid][top1(wp, ep)]).float())
                lo, lp = lo.reshape(-1, lo.shape[-1]).cpu()[real], lp.reshape(-1, lp.shape[-1]).cpu()[real]
                sums.add("kl", next_token_kl(lo, lp))
                sums.add("next_top1", (lo.argmax(-1) == lp.argmax(-1)).float())
                tokens += batch.tokens
                bar.update(batch.tokens)
    finally:
        o_routes.close()
        p_routes.close()
    if not tokens:
        return {"tokens": 0}
    return {
        "tokens": tokens,
        "moe_layers": [
            {
                "layer": lid,
                "kept": int(masks[lid].sum()),
                "experts": int(masks[lid].numel()),
                "gate_mass_share": sums.mean(f"mass.{lid}"),
                "top1_routing_agreement": sums.mean(f"top1.{lid}"),
            }
            for lid in sorted(masks, key=int)
        ],
        "hidden_cosine": [sums.mean(key) for key in sums.count if key.startswith("cos.")],  # layer by layer
        "next_token_kl": sums.mean("kl"),
        "next_token_top1_agreement": sums.mean("next_top1"),
    }
