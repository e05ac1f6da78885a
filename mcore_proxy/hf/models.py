"""Running Hugging Face checkpoints in transformers: loading safely, the MoE routers, restriction.

Used by `collect` (hooks on the routers), `verify --functional` and `fidelity`. transformers is
imported inside the functions: it is an optional dependency (the `hf` extra), and trace-only
training hosts need not have it. What differs between families (the router's module, what it
returns, its selection bias, hash tables, the Auto class) comes from the family's descriptor
(`checkpoint/hf/families.py`).

Loading is always `local_files_only=True`, `trust_remote_code=False`, `use_safetensors=True`,
after mcore-proxy's own reader has accepted the folder (a supported architecture, safetensors
only, config.json consistent with the tensors), so nothing from the folder runs.
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path

import torch

from mcore_proxy.core.errors import ProxyError
from mcore_proxy.core.routing import softmax_weights, topk_of
from mcore_proxy.engines import transformers as hf_models
from mcore_proxy.engines.hooks import CallbackHandle, Hooks

log = logging.getLogger(__name__)


def require_transformers():
    try:
        import transformers
    except ImportError:
        raise ProxyError(
            "this command runs Hugging Face models and needs transformers; install it with "
            "pip install 'mcore-proxy[hf]'"
        ) from None
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


def family_of_model(model):
    """The family of a loaded transformers model (by its class name): declared, or discovered in
    this process when its checkpoint was opened."""
    from mcore_proxy.checkpoint.hf import declared, discovered

    arch = type(model).__name__
    found = declared(arch) or getattr(discovered(arch), "family", None)
    if found is None:
        raise ProxyError(f"{arch} is not a Mixture-of-Experts family mcore-proxy knows; open its checkpoint first")
    return found


def load_model(source, device: str = "cpu"):
    """The checkpoint `source` (an HF folder, or its view already opened, which is not read again)
    as a transformers model in eval mode (its own dtype), built by its family's Auto class."""
    from mcore_proxy.checkpoint.formats import open_checkpoint

    # opening refuses what transformers would load unsafely or wrongly
    view = open_checkpoint(source) if isinstance(source, (str, Path)) else source
    folder = view.info.path
    family = view.info.format_info.descriptor
    _check_quantized_loads(view, folder)
    transformers = require_transformers()
    level = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()  # its load report lists MTP layers it does not build as unexpected
    transformers.utils.logging.disable_progress_bar()
    try:
        options = dict(local_files_only=True, trust_remote_code=False, use_safetensors=True, dtype="auto")
        alias = dict(family.runtime.model_type_alias).get(view.info.format_info.config.get("model_type"))
        if alias:  # a model type transformers builds under another name (Kimi-K2 as deepseek_v3)
            data = {k: v for k, v in view.info.format_info.config.items() if k != "model_type"}
            options["config"] = transformers.AutoConfig.for_model(alias, **data)
        model = getattr(transformers, family.runtime.auto_class).from_pretrained(str(folder), **options)
    finally:
        transformers.logging.set_verbosity(level)
        transformers.utils.logging.enable_progress_bar()
    return model.to(device_of(device)).eval()


def vocab_size(view) -> int:
    """The text model's vocabulary of an HF view, from its ModelSpec; ProxyError naming the
    folder's config.json where it has none."""
    if view.spec.vocab_size is None:
        raise ProxyError(f"{Path(view.info.path) / 'config.json'}: has no vocab_size; add the model's vocabulary size")
    return view.spec.vocab_size


def _check_quantized_loads(view, folder) -> None:
    """Quantized weights load on CPU as transformers dequantizes them (MXFP4 by itself, FP8 and
    DeepSeek-V4's FP4 through accelerate); compressed-tensors int4 needs its own package."""
    import importlib.util

    from mcore_proxy.checkpoint.hf import INT4_PACKED, MXFP4

    schemes = view.quantized_schemes()
    if INT4_PACKED in schemes:
        raise ProxyError(
            f"{folder}: compressed-tensors int4 weights are not run by mcore-proxy; collect statistics "
            "on the model's bf16 release (or with the patched Megatron router), then select and convert "
            "this folder: its int4 rows are pruned as they are"
        )
    if schemes - {MXFP4} and importlib.util.find_spec("accelerate") is None:
        raise ProxyError(
            f"{folder}: FP8 weights load in transformers on CPU only through accelerate's "
            "dequantization; pip install accelerate, or convert a copy with --dequantize and run that"
        )


def text_config_of(model):
    """The config of the text model (a vision-language wrapper's `text_config`)."""
    config = model.config
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def routers(model) -> dict[str, torch.nn.Module]:
    """Layer id ("3") -> the MoE router module of that decoder layer (the family's
    `runtime.router_module`, e.g. `mlp.gate`, `mlp.router`, `feed_forward.router`)."""
    runtime = family_of_model(model).runtime
    out = hf_models.routers(model, runtime.router_module, runtime.router_weight)
    if not out:
        raise ProxyError(f"{type(model).__name__} has no MoE router at layers.*.{runtime.router_module}")
    return out


def router_weight(router) -> torch.Tensor:
    """A router's weight [E, H] (its family's `runtime.router_weight`, set by `mark_routers`)."""
    return hf_models.child(router, getattr(router, "_mcore_proxy_weight", "weight"))


def routing(router, output) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k], expert ids [T, k]) from a router's output, as its family returns it."""
    kind = _output_kind(router)
    if kind == "scores_logits":  # Llama-4: sigmoid of the top-k logits, 0 elsewhere
        scores, logits = output
        experts = logits.topk(topk_of(router), dim=-1).indices
        return scores.gather(-1, experts), experts
    _, weights, experts = output
    return weights, experts


def _output_kind(router) -> str:
    return getattr(router, "_mcore_proxy_output", "logits_weights_indices")


def mark_routers(model) -> dict[str, torch.nn.Module]:
    """`routers(model)`, each told how its family's router returns its choice (for `routing`),
    where its weight is (`router_weight`) and its top-k (`core.routing.topk_of`)."""
    family = family_of_model(model)
    found = routers(model)
    text = text_config_of(model)
    topk = next((getattr(text, k) for k in family.config.topk if hasattr(text, k)), None)
    for module in found.values():
        module._mcore_proxy_output = family.runtime.output
        module._mcore_proxy_weight = family.runtime.router_weight
        if not hasattr(module, "top_k"):
            module._mcore_proxy_topk = topk
    return found


class Replay:
    """Routing replay (R3, arXiv 2510.11370): the model's routers take the expert ids another engine
    chose for the same tokens, with their own weights for those experts (`core.routing`), so the
    trainer's gradient flows through the rollout's routing. Set `ids`, layer id -> [T, k] in the
    order of the next forward pass's tokens; a layer without ids routes as usual. At a router's first
    call the rule is checked against the router's own choice: a router whose weights are not a
    softmax over its chosen experts (a sigmoid router with a selection bias) is refused.
    `close()` removes the hooks."""

    def __init__(self, routers: dict[str, torch.nn.Module]):
        self.ids: dict[str, torch.Tensor] = {}
        self._checked: set[str] = set()
        self.hooks = Hooks()
        for lid, g in routers.items():
            self.hooks.forward(g, lambda mod, args, out, lid=lid: self._replace(lid, mod, out))

    def _replace(self, lid: str, router, out):
        ids = self.ids.get(lid)
        if ids is None:
            return None
        if _output_kind(router) != "logits_weights_indices":
            raise ProxyError(f"routing replay: {type(router).__name__} does not return (logits, weights, ids)")
        logits, weights, own = out
        if lid not in self._checked:
            if not torch.allclose(softmax_weights(router, logits, own).float(), weights.float(), atol=1e-5):
                raise ProxyError(
                    f"routing replay: {type(router).__name__}'s weights are not a softmax over its chosen experts; "
                    "replay supports softmax routers (Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE, gpt-oss)"
                )
            self._checked.add(lid)
        if ids.numel() != own.numel():
            raise ProxyError(f"routing replay: layer {lid} got {tuple(ids.shape)} ids for {tuple(own.shape)} choices")
        ids = ids.to(device=own.device, dtype=own.dtype).view(own.shape)
        return (logits, softmax_weights(router, logits, ids), ids)

    def close(self) -> None:
        self.hooks.remove()


class Routes:
    """Forward hooks on a model's routers (`mark_routers`): `seen`, layer id -> (weights float32,
    expert ids) [T, k] of the last forward pass; `close()` removes the hooks."""

    def __init__(self, routers: dict[str, torch.nn.Module]):
        self.seen: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self.hooks = Hooks()
        for lid, g in routers.items():
            self.hooks.forward(g, lambda mod, args, out, lid=lid: self._keep(lid, mod, out))

    def _keep(self, lid: str, router, out) -> None:
        weights, experts = routing(router, out)
        self.seen[lid] = (
            weights.detach().reshape(-1, weights.shape[-1]).float(),
            experts.detach().reshape(-1, experts.shape[-1]),
        )

    def close(self) -> None:
        self.hooks.remove()


@contextlib.contextmanager
def restrict_gates(model, plan):
    """Within the block every router may choose only its layer's kept experts: the reference a
    correct proxy reproduces exactly (DESIGN.md 7). Logits of dropped experts are -inf (softmax:
    probability 0; sigmoid, sqrtsoftplus: score 0), a selection bias (the family's
    `runtime.score_bias`) is -inf for them so that neither group scores nor the top-k see them,
    and a hash-routed layer's table is rewritten by the plan's substitute rule, as the proxy's is
    (`select.plan.substitute_rows`). `plan`: a `select.plan.Plan`. Restored on exit.

    The logits are masked by wrapping `torch.nn.functional.linear` for the duration of the
    router's own call (its one projection), so the router's code runs unchanged."""
    family = family_of_model(model)
    layers = hf_models.decoder_layers(model)
    with Hooks() as hooks:  # each router's restore, undone newest first on exit
        for layer_id, router in mark_routers(model).items():
            hooks.add(_restrict(router, layer_id, layers[layer_id], family, plan))
        yield


def _restrict(router, layer_id: str, layer, family, plan) -> CallbackHandle:
    """Mask one router to its layer's kept experts (see `restrict_gates`); the handle restores it."""
    import torch.nn.functional as F

    from mcore_proxy.select.plan import substitute_rows

    weight = router_weight(router)
    dropped = torch.ones(weight.shape[0], dtype=torch.bool, device=weight.device)
    dropped[list(plan.kept(layer_id))] = False
    edits = []
    bias = hf_models.child(layer, family.runtime.score_bias) if family.runtime.score_bias else None
    if isinstance(bias, torch.Tensor):
        edits.append((bias, bias.detach().clone()))
        bias.data[..., dropped] = float("-inf")
    table = hf_models.child(layer, family.runtime.hash_table) if family.runtime.hash_table else None
    if isinstance(table, torch.Tensor):
        edits.append((table, table.detach().clone()))
        rows = substitute_rows(table.cpu(), plan, layer_id, dropped.numel(), f"the model's {layer_id}")
        table.data.copy_(rows.to(table.device))
    router.forward = _masked_forward(router.forward, dropped, F)

    def restore():
        del router.forward  # back to the class's method
        for tensor, value in edits:
            tensor.data.copy_(value)

    return CallbackHandle(restore)


def _masked_forward(forward, dropped: torch.Tensor, F):
    def masked(*args, **kwargs):
        linear, calls = F.linear, []

        def masked_linear(x, w, b=None):
            calls.append(1)
            return linear(x, w, b).masked_fill(dropped, float("-inf"))

        F.linear = masked_linear
        try:
            out = forward(*args, **kwargs)
        finally:
            F.linear = linear
        if len(calls) != 1:
            raise RuntimeError(
                f"the router made {len(calls)} linear calls, expected its one projection; "
                "this transformers version routes differently than mcore-proxy expects"
            )
        return out

    return masked


# what transformers' modelling code raises when a config it accepted describes a model it cannot
# compute (shapes that do not broadcast, an index past a table): the model's failure, not ours
_MODEL_FAILURES = (RuntimeError, ValueError, IndexError, TypeError, KeyError, NotImplementedError, AssertionError)
_PACKAGE_DIR = str(Path(__file__).resolve().parents[1])


def _raised_in_our_code(err: BaseException) -> bool:
    """Whether the innermost frame of `err` that belongs to mcore-proxy or transformers is ours (a
    hook of ours inside the forward), rather than the modelling code's."""
    import traceback

    import transformers

    theirs = str(Path(transformers.__file__).resolve().parent)
    owner = None
    for frame in traceback.extract_tb(err.__traceback__):
        name = str(Path(frame.filename).resolve())
        if name.startswith(_PACKAGE_DIR):
            owner = "ours"
        elif name.startswith(theirs):
            owner = "theirs"
    return owner != "theirs"


@contextlib.contextmanager
def model_forward(model):
    """Run a forward of `model`; an error of transformers' modelling code becomes one ProxyError
    sentence with its message (exit 2: the checkpoint's config describes a model transformers cannot
    run), while an error raised in mcore-proxy's own code stays an internal error."""
    try:
        yield
    except _MODEL_FAILURES as err:
        if _raised_in_our_code(err):
            raise
        import transformers

        folder = getattr(model.config, "_name_or_path", "") or "the model"
        message = " ".join(str(err).split())[:300]
        raise ProxyError(
            f"{folder}: transformers {transformers.__version__} could not run this model "
            f"({type(err).__name__}: {message}); its config.json describes a model transformers' own code "
            "cannot compute, fix the config (check it by running the model in transformers alone)"
        ) from None


@torch.no_grad()
def run(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    hidden: bool = False,
    inputs: dict | None = None,
):
    """Logits [B, S, V] (float32), and with `hidden` the output of every decoder layer
    [L][B, S, H] (captured by hooks on the layers: transformers' `hidden_states` replaces the
    last layer's output with the final norm's). inputs: further model inputs (an image-text
    record's `pixel_values`, ...)."""
    device = next(model.parameters()).device
    outputs = []
    with Hooks() as hooks:
        if hidden:
            layers = hf_models.decoder_layers(model)
            for i in sorted(layers, key=int):
                hooks.forward(
                    layers[i], lambda mod, args, out: outputs.append(out[0] if isinstance(out, tuple) else out)
                )
        with model_forward(model):
            logits = model(
                input_ids=input_ids.to(device),
                attention_mask=None if attention_mask is None else attention_mask.to(device),
                use_cache=False,
                **_on(device, inputs),
            ).logits.float()
    return (logits, outputs) if hidden else logits


def routed_run(model, input_ids: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One `run` with the routers observed: (logits [B, S, V] float32, layer id -> the model's own
    top-k expert ids [B x S, k])."""
    routes = Routes(mark_routers(model))
    try:
        logits = run(model, input_ids)
    finally:
        routes.close()
    return logits, {layer: ids for layer, (_, ids) in routes.seen.items()}


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

        nxt = torch.roll(input_ids, -1, dims=1)  # position t sees token t + 1 (the last: discarded)
        x = self.eh_proj(torch.cat([self.enorm(model.model.embed_tokens(nxt)), self.hnorm(hidden)], dim=-1))
        positions = torch.arange(x.shape[1], device=x.device)[None]
        mask = create_causal_mask(
            config=model.config, inputs_embeds=x, attention_mask=attention_mask, cache=None, position_ids=positions
        )
        return self.layer(
            x, attention_mask=mask, position_ids=positions, position_embeddings=model.model.rotary_emb(x, positions)
        )


def _fused_experts(tensors: dict[str, torch.Tensor], config) -> dict[str, torch.Tensor]:
    """Hub names (one tensor per expert) -> the decoder layer's module names (fused experts)."""
    out = {
        k: v
        for k, v in tensors.items()
        if not k.startswith(("enorm", "hnorm", "eh_proj", "shared_head", "embed_tokens", "mlp.experts."))
    }
    experts = range(config.n_routed_experts)
    out["mlp.experts.gate_up_proj"] = torch.stack(
        [
            torch.cat([tensors[f"mlp.experts.{e}.gate_proj.weight"], tensors[f"mlp.experts.{e}.up_proj.weight"]])
            for e in experts
        ]
    )
    out["mlp.experts.down_proj"] = torch.stack([tensors[f"mlp.experts.{e}.down_proj.weight"] for e in experts])
    return out


def mtp_layers(model, folder: str | Path) -> list[MTPLayer]:
    """The MTP layers of the checkpoint in `folder` that can run here: DeepSeek-style ones (layer
    `num_hidden_layers + k`: DeepSeek-V3/V3.2, GLM-4.5), none for other families (their MTP
    layers are not run: `unobserved_layers`)."""
    from mcore_proxy.checkpoint.formats import open_checkpoint

    view = open_checkpoint(folder)
    if not view.info.format_info.descriptor.mtp_after_decoder:
        return []
    n = view.num_layers
    device, dtype = next(model.parameters()).device, next(model.parameters()).dtype
    layers = []
    for depth in range(view.spec.mtp_layers):
        tensors = view.tensors_under(f"model.layers.{n + depth}.")
        layers.append(MTPLayer(model, depth, tensors).to(device=device, dtype=dtype).eval())
    return layers


@torch.no_grad()
def run_mtp(
    model, layers: list[MTPLayer], input_ids: torch.Tensor, attention_mask: torch.Tensor, inputs: dict | None = None
) -> None:
    """The main model's decoder, then every MTP depth on its output (for their gates' hooks).
    inputs: further model inputs (an image-text record's `pixel_values`, ...)."""
    device = next(model.parameters()).device
    ids, mask, more = input_ids.to(device), attention_mask.to(device), _on(device, inputs)
    with model_forward(model):
        if not layers:
            model(input_ids=ids, attention_mask=mask, use_cache=False, **more)
            return
        hidden = model.model(input_ids=ids, attention_mask=mask, use_cache=False, **more).last_hidden_state
        for layer in layers:
            mask = mtp_mask(mask)
            hidden = layer(model, ids, mask, hidden)
            ids = torch.roll(ids, -1, dims=1)


def _on(device, inputs: dict | None) -> dict:
    """`inputs`' tensors on `device`."""
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in (inputs or {}).items()}


def mtp_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """[B, S] 1 where position t and t + 1 are both real: MTP positions with a next token."""
    nxt = torch.roll(attention_mask, -1, dims=1)
    nxt[:, -1] = 0
    return attention_mask * nxt
