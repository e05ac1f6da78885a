"""Routing statistics of a Hugging Face model run in transformers (`mcore-proxy collect`).

Forward hooks on every MoE router (the family's `runtime.router_module`: `mlp.gate`,
`mlp.router`, `feed_forward.router`, ..., and the gates of DeepSeek-style MTP layers) feed the
same `Tracer` and `LayerAccumulator` the Megatron trace uses, so the file follows DESIGN.md 4.1:
the router's input is the router input (hidden [T, H] after the pre-MLP norm), its outputs give
the final top-k weights and expert ids (`hf_models.routing`: renormalised, and for DeepSeek
scaled by `routed_scaling_factor`, as megatron's `probs` are; a hash-routed layer's ids are its
table's). Layer ids are the 0-based decoder layers (`decoder.layers.{L}`) and `mtp.{k}`.

Padding positions of each batch are excluded; in MTP layers also each sequence's last real
position, which has no next token to predict (megatron feeds it a rolled-in token whose loss it
masks). transformers does not build MTP layers: `hf_models.MTPLayer` runs them from the
checkpoint's tensors, as megatron-core and vLLM compute them.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from mcore_proxy.trace.tracer import RouterInfo, Tracer

log = logging.getLogger(__name__)

STATS_NAME = "routing_stats.safetensors"
UNOBSERVED = (
    "an MTP layer transformers does not build (only DeepSeek-style MTP layers are run here): no tokens "
    "reach it, select chooses its experts by router weights alone"
)
DEDUPE = (
    "one process runs the whole model: every token is counted once; padding positions are excluded, "
    "in MTP layers also each sequence's last position (no next token)"
)


def source_info() -> dict:
    import transformers

    return {"framework": "transformers", "transformers": transformers.__version__, "torch": torch.__version__}


class GateHooks:
    """Hooks on gates (layer id -> gate module) that record into `tracer`. Call `set_batch`
    before each forward pass: it sets the padding of every layer. Detaches on exit."""

    def __init__(self, tracer: Tracer, gates: dict[str, torch.nn.Module]):
        from mcore_proxy.core.routing import topk_of
        from mcore_proxy.hf.models import router_weight

        self.tracer, self.padding = tracer, {}
        for layer_id, gate in gates.items():
            info = RouterInfo(layer_id, int(router_weight(gate).shape[0]), topk_of(gate))
            tracer.hooks.forward(gate, lambda mod, args, out, info=info: self._record(info, mod, args, out))

    def set_batch(self, batch) -> None:
        from mcore_proxy.hf.models import mtp_mask

        mask, self.padding = batch.attention_mask, {}
        self.padding["decoder"] = mask.reshape(-1) == 0
        for depth in range(8):
            mask = mtp_mask(mask)
            self.padding[f"mtp.{depth}"] = mask.reshape(-1) == 0

    def _record(self, info: RouterInfo, router, args, out) -> None:
        from mcore_proxy.hf.models import routing

        hidden = args[0].reshape(-1, args[0].shape[-1])
        weights, experts = routing(router, out)
        key = info.layer_id if info.layer_id.startswith("mtp.") else "decoder"
        self.tracer.record(info, hidden, weights, experts, self.padding[key].to(hidden.device))

    def __enter__(self) -> "GateHooks":
        return self

    def __exit__(self, *exc) -> None:
        self.tracer.detach()


def collect(
    model_dir: Path,
    data: Path,
    out_dir: Path,
    *,
    max_tokens: int | None = None,
    batch_size: int = 8,
    max_length: int | None = None,
    device: str = "cpu",
    progress: bool = True,
) -> tuple[Path, int]:
    """Run the model over `data`, write `out_dir/routing_stats.safetensors` (+ .json); returns
    (path, tokens)."""
    from tqdm import tqdm

    from mcore_proxy.hf.calibration import data_batches
    from mcore_proxy.checkpoint.formats import open_checkpoint
    from mcore_proxy.core.errors import OutputError, ProxyError
    from mcore_proxy.hf.models import load_model, mark_routers, mtp_layers, run_mtp, text_config_of
    from mcore_proxy.core.stats import save_stats

    out = Path(out_dir) / STATS_NAME
    if out.exists():
        raise OutputError(f"{out}: already exists; choose another -o folder or remove it first")
    view = open_checkpoint(model_dir)
    model = load_model(view, device)
    mtp = mtp_layers(model, model_dir)
    hooked = dict(mark_routers(model))
    hooked.update({f"mtp.{layer.depth}": layer.layer.mlp.gate for layer in mtp})
    config = text_config_of(model)
    length = max_length or int(getattr(config, "max_position_embeddings", 2048))
    unobserved = {lid: UNOBSERVED for lid in view.spec.moe_layer_ids if lid not in hooked}
    meta = {
        "source": source_info(),
        "model": str(Path(model_dir).absolute()),
        "data": str(Path(data).absolute()),
        "model_layers": list(hooked),
        "max_length": length,
        "collect_dedupe": DEDUPE,
        **({"unobserved_layers": unobserved} if unobserved else {}),
    }
    tracer = Tracer(out_dir, rank=0, meta=meta)
    tokens = 0
    with (
        GateHooks(tracer, hooked) as hooks,
        tqdm(total=max_tokens, unit="tok", desc="collect", disable=not progress) as bar,
    ):
        for batch in data_batches(data, model_dir, int(config.vocab_size), batch_size, length, max_tokens, images=True):
            hooks.set_batch(batch)
            run_mtp(model, mtp, batch.input_ids, batch.attention_mask, batch.inputs)
            tokens += batch.tokens
            bar.update(batch.tokens)
    stats = tracer.stats()
    if stats is None:
        raise ProxyError(f"{data}: holds no tokens; give at least one record")
    save_stats(stats, out)
    return out, tokens
