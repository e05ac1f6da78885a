"""Running Hugging Face checkpoints in transformers: loading safely, the MoE gates, restriction.

Used by `collect` (hooks on the gates), `verify --functional` and `fidelity`. transformers is
imported inside the functions: it is an optional dependency (the `hf` extra), and trace-only
training hosts need not have it.

Loading is always `local_files_only=True`, `trust_remote_code=False`, `use_safetensors=True`,
after mcore-proxy's own reader has accepted the folder (a supported architecture, safetensors
only, config.json consistent with the tensors), so nothing from the folder runs.
"""
from __future__ import annotations

import contextlib
import logging
import re
from pathlib import Path

import torch

from mcore_proxy.errors import ProxyError

log = logging.getLogger(__name__)

_GATE = re.compile(r"^model\.layers\.(\d+)\.mlp\.gate$")


def require_transformers():
    try:
        import transformers
    except ImportError:
        raise ProxyError("this command runs Hugging Face models and needs transformers; install it with "
                         "pip install 'mcore-proxy[hf]'") from None
    return transformers


def device_of(name: str) -> torch.device:
    """`cpu`, `cuda` or `npu` (Ascend, through torch_npu); ProxyError if it is not there."""
    if name == "cpu":
        return torch.device("cpu")
    if name == "cuda":
        if not torch.cuda.is_available():
            raise ProxyError("--device cuda: torch sees no CUDA device here; use --device cpu")
        return torch.device("cuda")
    if name == "npu":
        try:
            import torch_npu  # noqa: F401 - registers the npu device with torch
        except ImportError:
            raise ProxyError("--device npu needs torch_npu (the Ascend stack), which is not installed here") from None
        return torch.device("npu")
    raise ProxyError(f"--device {name!r} is not one of cpu, cuda, npu")


def load_model(folder: str | Path, device: str = "cpu"):
    """The checkpoint in `folder` as a transformers causal LM in eval mode (its own dtype)."""
    from mcore_proxy.checkpoint.hf.reader import HFCheckpoint

    view = HFCheckpoint(folder)          # refuses what transformers would load unsafely or wrongly
    if view.hf.fp8_block:
        raise ProxyError(f"{folder}: FP8 block-quantised weights run in transformers only with GPU FP8 kernels; "
                         "convert a copy with --dequantize-fp8 and run that")
    transformers = require_transformers()
    level = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()   # its load report lists DeepSeek's MTP layer as unexpected
    transformers.utils.logging.disable_progress_bar()
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(
            str(folder), local_files_only=True, trust_remote_code=False, use_safetensors=True, dtype="auto")
    finally:
        transformers.logging.set_verbosity(level)
        transformers.utils.logging.enable_progress_bar()
    return model.to(device_of(device)).eval()


def gates(model) -> dict[str, torch.nn.Module]:
    """Layer id ("3") -> the MoE router of that decoder layer (`model.layers.3.mlp.gate`)."""
    out = {}
    for name, module in model.named_modules():
        m = _GATE.match(name)
        if m and hasattr(module, "top_k") and isinstance(getattr(module, "weight", None), torch.Tensor):
            out[m.group(1)] = module
    if not out:
        raise ProxyError(f"{type(model).__name__} has no MoE router under model.layers.*.mlp.gate")
    return out


@contextlib.contextmanager
def restrict_gates(model, keep: dict[str, list[int]]):
    """Within the block every gate may choose only its layer's kept experts: the reference a
    correct proxy reproduces exactly (DESIGN.md 7). Logits of dropped experts are -inf (softmax:
    probability 0; sigmoid: score 0), and an expert-score correction bias is -inf for them so
    that neither the group scores nor the top-k see them. Restored on exit.

    The logits are masked by wrapping `torch.nn.functional.linear` for the duration of the gate's
    own call (its one projection), so the gate's code runs unchanged."""
    import torch.nn.functional as F

    saved = []
    for layer_id, gate in gates(model).items():
        dropped = torch.ones(gate.weight.shape[0], dtype=torch.bool, device=gate.weight.device)
        dropped[keep[layer_id]] = False
        bias = getattr(gate, "e_score_correction_bias", None)
        saved.append((gate, None if bias is None else bias.detach().clone()))
        if bias is not None:
            bias.data.masked_fill_(dropped, float("-inf"))
        gate.forward = _masked_forward(gate.forward, dropped, F)
    try:
        yield
    finally:
        for gate, bias in saved:
            del gate.forward          # back to the class's method
            if bias is not None:
                gate.e_score_correction_bias.data.copy_(bias)


def _masked_forward(forward, dropped: torch.Tensor, F):
    def masked(hidden_states):
        linear, calls = F.linear, []

        def masked_linear(x, w, b=None):
            calls.append(1)
            return linear(x, w, b).masked_fill(dropped, float("-inf"))

        F.linear = masked_linear
        try:
            out = forward(hidden_states)
        finally:
            F.linear = linear
        if len(calls) != 1:
            raise RuntimeError(f"the gate made {len(calls)} linear calls, expected its one router projection; "
                               "this transformers version routes differently than mcore-proxy expects")
        return out

    return masked


@torch.no_grad()
def run(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
        hidden: bool = False):
    """Logits [B, S, V] (float32), and with `hidden` the output of every decoder layer
    [L][B, S, H] (captured by hooks on the layers: transformers' `hidden_states` replaces the
    last layer's output with the final norm's)."""
    device = next(model.parameters()).device
    outputs, handles = [], []
    if hidden:
        handles = [layer.register_forward_hook(lambda mod, args, out: outputs.append(out[0] if isinstance(out, tuple)
                                                                                     else out))
                   for layer in model.model.layers]
    try:
        logits = model(input_ids=input_ids.to(device),
                       attention_mask=None if attention_mask is None else attention_mask.to(device),
                       use_cache=False).logits.float()
    finally:
        for h in handles:
            h.remove()
    return (logits, outputs) if hidden else logits


# -- DeepSeek's MTP layers, which transformers does not build -----------------------------------

class MTPLayer(torch.nn.Module):
    """MTP depth k of a DeepSeek checkpoint (HF layer `num_hidden_layers + k`) as megatron-core and
    vLLM compute it: h' = eh_proj(cat(enorm(embed(token t+1)), hnorm(h_t))), then one decoder layer
    of the main model's kind (its gate is `mtp.{k}` for the statistics). h is the main model's
    final hidden state (after its final norm, as megatron's decoder and vLLM hand it over)."""

    def __init__(self, model, depth: int, tensors: dict[str, torch.Tensor]):
        super().__init__()
        config = model.config
        hidden = config.hidden_size
        norm_cls = type(model.model.norm)
        self.depth = depth
        self.enorm = norm_cls(hidden, eps=config.rms_norm_eps)
        self.hnorm = norm_cls(hidden, eps=config.rms_norm_eps)
        self.eh_proj = torch.nn.Linear(2 * hidden, hidden, bias=False)
        # the decoder layer's index only selects its kind (the last layer is MoE) and its cache slot
        self.layer = type(model.model.layers[-1])(config, config.num_hidden_layers - 1)
        state = {k: v for k, v in tensors.items() if k.split(".")[0] in ("enorm", "hnorm", "eh_proj")}
        state.update({f"layer.{k}": v for k, v in _fused_experts(tensors, config).items()})
        self.load_state_dict(state, strict=True)

    def forward(self, model, input_ids, attention_mask, hidden):
        from transformers.masking_utils import create_causal_mask

        nxt = torch.roll(input_ids, -1, dims=1)     # position t sees token t + 1 (the last: discarded)
        x = self.eh_proj(torch.cat([self.enorm(model.model.embed_tokens(nxt)), self.hnorm(hidden)], dim=-1))
        positions = torch.arange(x.shape[1], device=x.device)[None]
        mask = create_causal_mask(config=model.config, inputs_embeds=x, attention_mask=attention_mask,
                                  cache=None, position_ids=positions)
        return self.layer(x, attention_mask=mask, position_ids=positions,
                          position_embeddings=model.model.rotary_emb(x, positions))


def _fused_experts(tensors: dict[str, torch.Tensor], config) -> dict[str, torch.Tensor]:
    """Hub names (one tensor per expert) -> the decoder layer's module names (fused experts)."""
    out = {k: v for k, v in tensors.items() if not k.startswith(("enorm", "hnorm", "eh_proj", "shared_head",
                                                                    "embed_tokens", "mlp.experts."))}
    experts = range(config.n_routed_experts)
    out["mlp.experts.gate_up_proj"] = torch.stack(
        [torch.cat([tensors[f"mlp.experts.{e}.gate_proj.weight"], tensors[f"mlp.experts.{e}.up_proj.weight"]])
         for e in experts])
    out["mlp.experts.down_proj"] = torch.stack([tensors[f"mlp.experts.{e}.down_proj.weight"] for e in experts])
    return out


def mtp_layers(model, folder: str | Path) -> list[MTPLayer]:
    """The MTP layers the checkpoint in `folder` holds (none for Qwen3-MoE)."""
    from mcore_proxy.checkpoint.hf.reader import HFCheckpoint, weight_map
    from mcore_proxy.checkpoint.hf.safetensors_io import read_tensor

    view = HFCheckpoint(folder)
    wmap, n = weight_map(Path(folder)), view.num_layers
    device, dtype = next(model.parameters()).device, next(model.parameters()).dtype
    layers = []
    for depth in range(view.mtp_layers):
        prefix = f"model.layers.{n + depth}."
        tensors = {k[len(prefix):]: read_tensor(Path(folder) / f, k) for k, f in wmap.items() if k.startswith(prefix)}
        layers.append(MTPLayer(model, depth, tensors).to(device=device, dtype=dtype).eval())
    return layers


@torch.no_grad()
def run_mtp(model, layers: list[MTPLayer], input_ids: torch.Tensor, attention_mask: torch.Tensor) -> None:
    """The main model's decoder, then every MTP depth on its output (for their gates' hooks)."""
    device = next(model.parameters()).device
    ids, mask = input_ids.to(device), attention_mask.to(device)
    hidden = model.model(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state
    for layer in layers:
        mask = mtp_mask(mask)
        hidden = layer(model, ids, mask, hidden)
        ids = torch.roll(ids, -1, dims=1)


def mtp_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """[B, S] 1 where position t and t + 1 are both real: MTP positions with a next token."""
    nxt = torch.roll(attention_mask, -1, dims=1)
    nxt[:, -1] = 0
    return attention_mask * nxt
