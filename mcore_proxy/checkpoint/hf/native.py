"""Reader: a Hugging Face folder as its family's descriptor sees it (`HFNativeView`).

Every key is classified by the family (`descriptor.MoEFamily.role`). The router's tensors and
the routed experts get canonical names under the layer's canonical prefix (`decoder.layers.{L}`,
`mtp.layers.{k}.transformer_layer`):

  router weight [E, H]            ->  P.mlp.router.weight
  router logit bias [E]           ->  P.mlp.router.bias
  score-correction bias [E]/[1,E] ->  P.mlp.router.expert_bias
  hash table [V, k]               ->  P.mlp.router.hash_table
  expert e's tensor               ->  P.mlp.experts.{e}.<leaf>   (a per-expert key, or row e of a fused one)

so that selection, pruning (`convert/prune.PrunedView`) and verification treat every family
alike. Every other tensor keeps its Hugging Face key as its name and is copied bit for bit. The
view carries the spelling of every canonical name (`HFNativeSource.spelling`) for the writer,
which writes the proxy in the source's own spelling (per expert or fused). No Megatron mapping is
involved: `megatron()` gives the Megatron-named view for families that have one.
"""

from __future__ import annotations

import collections
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from mcore_proxy.checkpoint.hf.config import HFConfig
from mcore_proxy.checkpoint.hf.folder import read_headers, weight_map
from mcore_proxy.checkpoint.hf.families import family_of
from mcore_proxy.checkpoint.hf.descriptor import (
    COPY,
    EXPERT,
    FUSED,
    HASH_TABLE,
    ROUTER,
    ROUTER_LEAVES,
    MoEFamily,
    expert_leaf,
)
from mcore_proxy.checkpoint.hf.quant import FP8_BLOCK, MXFP4, check_pair, config_dtype, dequantize, find_quantized
from mcore_proxy.checkpoint.hf.safetensors_io import TensorInfo, read_tensor
from mcore_proxy.checkpoint.view import ModelView, ViewInfo
from mcore_proxy.core.errors import CheckpointError, ProxyError
from mcore_proxy.mcore.spec import MAX_EXPERTS, ModelSpec, layer_module_prefix

if TYPE_CHECKING:
    import torch


def text_config(config: HFConfig) -> HFConfig:
    """The config of the text model: `text_config` of a vision-language checkpoint, else itself."""
    nested = config.data.get("text_config")
    return HFConfig(nested, config.path) if isinstance(nested, dict) else config


def first_int(config: HFConfig, keys: tuple[str, ...], default=None) -> int:
    """The first spelling present, at the top level or in `text_config`."""
    for cfg in (config, text_config(config)):
        for key in keys:
            if cfg.has(key):
                return cfg.int(key)
    if default is None:
        raise CheckpointError(
            f"{config.path}: lacks {' / '.join(keys)}, which the model needs; add it (the model's "
            "source config.json has it)"
        )
    return default


class UnaccountedTensor(CheckpointError):
    """A key the family's record does not account for (router, routed experts, or copied)."""


def read_with_family(config: HFConfig, family: MoEFamily, make):
    """`make(family)` (a native view) with config.json's family (`family_of`); where a declared
    family does not account for a tensor (a model type transformers builds with a declared
    family's class, but spells otherwise on the Hub), the family discovered from transformers
    reads it instead, and the declaration's refusal stands if that fails too."""
    from mcore_proxy.checkpoint.hf.discovery import discover

    try:
        return make(family)
    except UnaccountedTensor as err:
        if family.origin != "declared":
            raise
        try:
            return make(discover(config).family)
        except CheckpointError:
            raise err from None


@dataclass(frozen=True)
class _Source:
    """Where a canonical tensor's bytes are: `key` in `file`, or row `row` of it (fused experts)."""

    key: str
    file: str
    info: TensorInfo
    row: int | None = None


@dataclass(frozen=True)
class HFNativeSource:
    """What a native view carries for the HF writer (`ViewInfo.format_info`): the folder (its
    tokenizer and generation config are copied), its config.json, the family, and the spelling
    of every canonical MoE name: pattern with `{e}` -> (HF key, or key pattern with `{e}`, kind)."""

    folder: Path
    config: dict
    family: str
    spelling: dict = field(default_factory=dict, compare=False)

    @property
    def descriptor(self) -> MoEFamily:
        from mcore_proxy.checkpoint.hf.families import family_named

        return family_named(self.family)


def _canonical(layer_id: str, kind: str, leaf: str) -> str:
    prefix = layer_module_prefix(layer_id)
    return f"{prefix}.{ROUTER_LEAVES[kind]}" if kind in ROUTER_LEAVES else f"{prefix}.mlp.experts.{{e}}.{leaf}"


class HFNativeView(ModelView):
    """A Hugging Face checkpoint under its family's descriptor; `get` reads only that tensor's
    bytes (one expert's rows of a fused tensor)."""

    def __init__(
        self,
        path,
        wmap: dict[str, str],
        infos: dict[str, TensorInfo],
        config: HFConfig,
        family: MoEFamily | None = None,
    ):
        self.path, self.config = Path(path), config
        self._read_index = (config, wmap, infos)  # handed to the Megatron-named view: read once
        self.family = family or family_of(config)
        text = text_config(config)
        self.num_layers = text.layer_count()
        self._sources: dict[str, _Source] = {}
        self._order: list[str] = []
        spelling: dict[str, tuple[str, str]] = {}
        self._experts: dict[tuple[str, str], dict[int, int]] = {}  # (layer, canonical pattern) -> expert -> E
        self._layers: set[int] = set()
        for key in sorted(wmap, key=_key_order):
            self._index(key, wmap[key], infos[key], spelling)
        spec = self._spec(text)
        self.source = HFNativeSource(self.path, dict(config.data), self.family.name, spelling)
        super().__init__(
            ViewInfo(
                spec=spec,
                format="hf",
                path=self.path,
                iteration="release",
                args=None,
                layout=None,
                format_info=self.source,
            )
        )
        self._check(spec)

    # -- indexing -------------------------------------------------------------------------------
    def _index(self, key: str, file: str, info: TensorInfo, spelling: dict) -> None:
        layer_id, prefix, rest = self.family.locate(key, self.num_layers)
        where = self.path / file
        if layer_id is not None and layer_id.startswith("beyond."):
            raise CheckpointError(
                f"{where}: holds {key} of layer {layer_id.split('.')[1]}, but config.json says "
                f"num_hidden_layers={self.num_layers} and {self.family.name} has no MTP layers there; "
                "fix config.json or use the shards that came with it"
            )
        if layer_id is not None and not layer_id.startswith("mtp."):
            self._layers.add(int(layer_id))
        found = self.family.role(layer_id, rest)
        if found is None:
            raise UnaccountedTensor(
                f"{where}: tensor {key} is not a part of {self.family.name} that mcore-proxy "
                "accounts for (router, routed experts, or a tensor it copies); it is not dropped "
                "or copied silently: check the architecture in config.json"
            )
        kind, pattern, expert = found
        if kind == COPY:
            return self._add(key, _Source(key, file, info))
        leaf = expert_leaf(pattern, kind) if kind in (EXPERT, FUSED) else ""
        template = _canonical(layer_id, kind, leaf)
        hf_template = prefix + pattern
        if spelling.setdefault(template, (hf_template, kind)) != (hf_template, kind):
            raise CheckpointError(
                f"{where}: {key} spells {template.replace('{e}', 'e')} a second way (beside "
                f"{spelling[template][0]}); per-expert and fused experts are mixed in one layer, "
                "the checkpoint is inconsistent"
            )
        if kind == EXPERT:
            self._note_expert(layer_id, template, expert, where, key)
            self._add(template.replace("{e}", str(expert)), _Source(key, file, info))
        elif kind == FUSED:
            if not info.shape or info.shape[0] > MAX_EXPERTS:
                raise CheckpointError(
                    f"{where}: fused expert tensor {key} has shape {list(info.shape)}; expected "
                    "the experts on its first axis"
                )
            row = TensorInfo(info.shape[1:], info.dtype)
            for e in range(info.shape[0]):
                self._note_expert(layer_id, template, e, where, key)
                self._add(template.replace("{e}", str(e)), _Source(key, file, row, e))
        else:
            self._add(template, _Source(key, file, info))

    def _note_expert(self, layer_id: str, template: str, expert: int, where: Path, key: str) -> None:
        seen = self._experts.setdefault((layer_id, template), {})
        if expert in seen:
            raise CheckpointError(
                f"{where}: {key} holds expert {expert} of layer {layer_id} a second time; the "
                "checkpoint is inconsistent, copy it again"
            )
        seen[expert] = 1

    def _add(self, name: str, source: _Source) -> None:
        if name in self._sources:
            raise CheckpointError(
                f"{self.path / source.file}: {source.key} names {name}, which "
                f"{self._sources[name].key} names too; the checkpoint is inconsistent"
            )
        self._sources[name] = source
        self._order.append(name)

    # -- the model it describes -------------------------------------------------------------------
    def _spec(self, text: HFConfig) -> ModelSpec:
        keys = self.family.config
        routers = {name.rsplit(".mlp.", 1)[0] for name in self._sources if name.endswith("." + ROUTER_LEAVES[ROUTER])}
        moe = sorted(int(p.split(".")[2]) for p in routers if p.startswith("decoder."))
        mtp = sorted(int(p.split(".")[2]) for p in routers if p.startswith("mtp."))
        if mtp != list(range(len(mtp))):
            raise CheckpointError(
                f"{self.path}: holds MTP layers {mtp}; expected 0..{len(mtp) - 1}, copy the missing shards"
            )
        experts = first_int(self.config, keys.experts)
        topk = first_int(self.config, keys.topk)
        if experts and not 0 < topk <= experts:  # ModelSpec would refuse it without naming the file
            raise CheckpointError(
                f"{self.config.path}: {' / '.join(keys.topk)} is {topk}, expected 1..{experts} (the "
                "expert count); fix config.json"
            )
        groups = (
            (first_int(self.config, keys.groups[:1], 1), first_int(self.config, keys.groups[1:], 1))
            if keys.groups
            else (None, None)
        )
        score = (
            keys.score_function
            if isinstance(keys.score_function, str)
            else str(text.data.get(keys.score_function[0]) or keys.score_function[1])
        )
        hashed = sorted(
            int(n.split(".")[2])
            for n in self._sources
            if n.startswith("decoder.") and n.endswith(ROUTER_LEAVES[HASH_TABLE])
        )
        return ModelSpec(
            num_layers=self.num_layers,
            hidden_size=text.int("hidden_size", minimum=1),
            num_experts=experts,
            topk=topk,
            moe_layers=tuple(moe),
            mtp_layers=len(mtp),
            score_function=score,
            num_groups=groups[0],
            group_topk=groups[1],
            moe_ffn_hidden_size=first_int(self.config, ("moe_intermediate_size", "intermediate_size"), 0) or None,
            expert_bias=any(n.endswith(".mlp.router.expert_bias") for n in self._sources),
            vocab_size=text.int("vocab_size", None, minimum=1),
            hash_layers=tuple(hashed),
            extra={"hf_family": self.family.name},
        )

    def _check(self, spec: ModelSpec) -> None:
        """config.json against the tensors: the decoder layers, and the shape of every router, bias,
        hash table and expert set."""
        import torch

        E, H, where = spec.num_experts, spec.hidden_size, self.config.path
        if self._layers != set(range(self.num_layers)):
            raise CheckpointError(
                f"{where} says num_hidden_layers={self.num_layers} but the shards hold decoder "
                f"layers {min(self._layers, default=0)}..{max(self._layers, default=-1)}; copy the "
                "missing shards or fix config.json"
            )
        if not spec.moe_layers:
            raise CheckpointError(
                f"{self.path}: no MoE router found ({self.family.name}: "
                f"{' or '.join(self.family.router.weight)}); this is not a MoE checkpoint"
            )
        for name, source in self._sources.items():
            if ".mlp.router." not in name:
                continue
            shape, hashed = tuple(source.info.shape), name.endswith("hash_table")
            vocab = text_config(self.config).int("vocab_size", shape[0] if shape else 0) if hashed else 0
            want = {"weight": (E, H), "bias": (E,), "expert_bias": shape[:-1] + (E,), "hash_table": (vocab, spec.topk)}[
                name.rsplit(".", 1)[1]
            ]
            if shape != want:
                says = (
                    f"{E} experts, hidden_size={H}, top-k {spec.topk}"
                    if name.endswith(".weight")
                    else f"vocab_size={vocab}, top-k {spec.topk}"
                    if hashed
                    else f"{E} experts"
                )
                raise CheckpointError(
                    f"{where} says {says} but {self.path / source.file} holds {source.key} of shape "
                    f"{list(shape)}; fix config.json or use the shards that came with it"
                )
            if hashed and (source.info.dtype.is_floating_point or source.info.dtype == torch.bool):
                raise CheckpointError(
                    f"{self.path / source.file}: hash table {source.key} holds {source.info.dtype} "
                    "values, not integer expert ids; the shard is damaged, copy it again from the "
                    "model's source"
                )
        for (layer_id, template), seen in self._experts.items():
            if sorted(seen) != list(range(E)):
                missing = sorted(set(range(E)) - set(seen)) or sorted(set(seen) - set(range(E)))
                raise CheckpointError(
                    f"{where} says {E} experts but layer {layer_id} has "
                    f"{template.rsplit('.', 1)[0].replace('{e}', str(missing[0]))}... "
                    f"{'missing' if missing[0] < E else 'beyond them'} (expert {missing[0]}); "
                    "copy the missing shards or fix config.json"
                )
            names = [template.replace("{e}", str(e)) for e in sorted(seen)]
            forms = collections.Counter((self.shape(n), self.dtype(n)) for n in names)
            if len(forms) > 1:  # one expert unlike the others: transformers could not load the proxy
                usual = forms.most_common(1)[0][0]
                odd = next(self._sources[n] for n in names if (self.shape(n), self.dtype(n)) != usual)
                raise CheckpointError(
                    f"{self.path / odd.file}: {odd.key} is {list(odd.info.shape)} {odd.info.dtype}, "
                    f"but the other experts of layer {layer_id} are {list(usual[0])} {usual[1]}; "
                    "the shard is damaged or from another checkpoint, copy it again"
                )

    # -- the ModelView ------------------------------------------------------------------------------
    def names(self) -> list[str]:
        return list(self._order)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._sources[name].info.shape)

    def dtype(self, name: str) -> torch.dtype:
        return self._sources[name].info.dtype

    def get(self, name: str) -> torch.Tensor:
        s = self._sources[name]
        return read_tensor(self.path / s.file, s.key, s.row)

    def tensors_under(self, prefix: str) -> dict[str, torch.Tensor]:
        """Every tensor of the folder whose HF key starts with `prefix`, keyed by the rest of the
        key, read now (an MTP block transformers does not build, run by `hf.models.mtp_layers`)."""
        _, wmap, _ = self._read_index
        return {k[len(prefix) :]: read_tensor(self.path / f, k) for k, f in wmap.items() if k.startswith(prefix)}

    def hf_key(self, name: str) -> str:
        """The Hugging Face key a canonical tensor is read from (a fused one: its whole tensor)."""
        return self._sources[name].key

    def megatron(self, dequantize_fp8: bool = False) -> ModelView:
        """The same checkpoint under megatron-core names (HF -> Megatron conversion), from the
        index this view read."""
        from mcore_proxy.checkpoint.hf.reader import HFCheckpoint, require_mapping

        require_mapping(self.family, self.config)
        other = next((q for q in find_quantized(self.names()) if q.scheme != FP8_BLOCK), None)
        if other is not None:  # the Megatron mapping reads FP8 block scales only
            raise ProxyError(
                f"{self.path}: {self.hf_key(other.weight)} is quantized ({other.scheme}), which the "
                f"{self.family.name} Megatron mapping does not read; convert the folder to --format hf "
                "with --dequantize first, then that folder to Megatron"
            )
        return HFCheckpoint(self.path, dequantize_fp8, family=self.family, index=self._read_index)

    def named_for(self, framework: str) -> ModelView:
        return self if framework == "transformers" else self.megatron()

    def dequantized(self) -> ModelView:
        """The same checkpoint with its quantized weights read as bf16 and their scales gone
        (`quant.py`: FP8 block scales, DeepSeek-V4's FP4 experts and E8M0 scales, MXFP4)."""
        if not find_quantized(self.names()):
            return super().dequantized()
        return DequantizedNativeView(self)


class StateDictView(HFNativeView):
    """A state dict held in memory (key -> tensor), read as a folder of `family` with this
    config.json would be: the twin proof (`convert/twin.py`) runs the reader's indexing, checks
    and spec on a model it built, with nothing written to disk."""

    def __init__(self, state: dict, config: HFConfig, family: MoEFamily):
        self._state = state
        infos = {k: TensorInfo(tuple(t.shape), t.dtype) for k, t in state.items()}
        super().__init__(config.path.parent, {k: "<memory>" for k in state}, infos, config, family)

    def get(self, name: str) -> torch.Tensor:
        s = self._sources[name]
        tensor = self._state[s.key]
        return (tensor if s.row is None else tensor[s.row]).clone()


class DequantizedNativeView(ModelView):
    """A native view with every quantized weight (`quant.find_quantized`) read in config.json's
    dtype (as transformers dequantizes it), under the dequantized tensor's name, and no
    companions; config.json without `quantization_config`."""

    def __init__(self, source: HFNativeView):
        self.source = source
        found = find_quantized(source.names())
        self._quantized = {q.name: q for q in found}
        by_weight, scales = {q.weight: q.name for q in found}, {q.scale for q in found}
        self._names = [by_weight.get(n, n) for n in source.names() if n not in scales]
        quant = source.config.data.get("quantization_config") or {}
        block = quant.get("weight_block_size") if isinstance(quant, dict) else None
        if block is not None and not (
            isinstance(block, list)
            and len(block) == 2
            and all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)
        ):  # else exit 3 mid-write
            raise CheckpointError(
                f"{source.config.path}: quantization_config.weight_block_size is {block!r}, expected "
                "two positive integers (a block's rows and columns, e.g. [128, 128]); fix "
                "config.json"
            )
        self._block = tuple(block) if block is not None else None
        for q in found:  # from the headers: an inconsistent pair is refused before anything is written
            try:
                check_pair(
                    q,
                    source.shape(q.weight),
                    source.dtype(q.weight),
                    source.shape(q.scale),
                    source.dtype(q.scale),
                    self._block,
                )
            except CheckpointError as err:
                raise CheckpointError(f"{source.path / source._sources[q.weight].file}: {err}") from None
        self._dtype = config_dtype(source.source.config)
        config = {k: v for k, v in source.source.config.items() if k not in ("quantization_config", "expert_dtype")}
        spelling = dict(source.source.spelling)
        for template, (hf, kind) in source.source.spelling.items():  # MXFP4 `X_blocks` -> `X`
            if template.endswith("_blocks"):
                spelling[template[: -len("_blocks")]] = (hf[: -len("_blocks")], kind)
        info = dataclasses.replace(
            source.info, format_info=dataclasses.replace(source.source, config=config, spelling=spelling)
        )
        super().__init__(info)

    def names(self) -> list[str]:
        return list(self._names)

    def shape(self, name: str) -> tuple[int, ...]:
        import torch

        q = self._quantized.get(name)
        if q is None:
            return self.source.shape(name)
        shape = self.source.shape(q.weight)
        if q.scheme == MXFP4:  # blocks [.., out, in/32, 16] -> weight [.., in, out]
            return (*shape[:-3], shape[-2] * 32, shape[-3])
        if self.source.dtype(q.weight) == torch.int8:  # FP4 pairs [R, C/2] -> [R, C]
            return (*shape[:-1], shape[-1] * 2)
        return shape

    def dtype(self, name: str) -> torch.dtype:
        return self._dtype if name in self._quantized else self.source.dtype(name)

    def get(self, name: str) -> torch.Tensor:
        q = self._quantized.get(name)
        if q is None:
            return self.source.get(name)
        try:
            return dequantize(q, self.source.get(q.weight), self.source.get(q.scale), self._block, self._dtype)
        except CheckpointError as err:  # quant.py names the tensor: name its shard too
            raise CheckpointError(f"{self.source.path / self.source._sources[q.weight].file}: {err}") from None

    def named_for(self, framework: str) -> ModelView:
        if framework == "transformers":
            return self
        return self.source.megatron(dequantize_fp8=True)


def _key_order(key: str):
    """Keys by layer number, then as written: shards of the proxy follow the model's order."""
    import re

    parts = re.split(r"(\d+)", key)
    return [int(p) if p.isdigit() else p for p in parts]


def open_hf(path) -> HFNativeView:
    """A Hugging Face folder as its family's descriptor sees it: what `open_checkpoint` returns."""
    path = Path(path)
    config = HFConfig.load(path)
    family = family_of(config)  # an unknown architecture is refused before any shard is read
    wmap = weight_map(path)
    headers = read_headers(path, wmap)
    return read_with_family(config, family, lambda f: HFNativeView(path, wmap, headers, config, f))
