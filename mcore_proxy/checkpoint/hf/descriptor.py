"""A Mixture-of-Experts family of Hugging Face checkpoints, as data (`MoEFamily`).

What the HF -> HF path does (read, prune, write, collect, restrict, measure) is driven by one
descriptor; what differs between families lives in its fields, never in `if family == ...`:

- where a decoder layer's tensors live (`layers`: `model.layers.{L}.` and the other spellings
  the Hub, `save_pretrained` or a multimodal wrapper write), and its MTP layers (`mtp`);
- the router (`Router`): weight [E, H], optional logit bias [E] (gpt-oss), score-correction
  bias [E] or [1, E] (DeepSeek, GLM, Kimi, MiniMax, ERNIE), hash table [V, k] of expert ids
  (DeepSeek-V4's hash-routed layers);
- the routed experts (`Experts`): one key per expert (`{e}`: the Hub's spelling), or fused
  tensors with the expert on axis 0 (transformers' in-memory spelling), each with its
  quantization companions (`suffixes`: `_scale_inv`, `_blocks`, `_scales`, ...);
- every other tensor, copied bit for bit (`copied`, `model_copied`, `mtp_copied`: globs);
- the config.json keys that count experts and top-k, the routing groups, where the text model's
  keys sit (`text_config`), and how transformers runs it (`Runtime`).

Patterns use `{e}` for an expert id and `*` for any text. Layer patterns are relative to the
layer prefix. A key is tried as router, router bias, score bias, hash table, per-expert tensor,
fused expert tensor, then copied tensor; a key that matches nothing is refused by name, and a
copied key that looks like a routed expert's (`.experts.`) is refused too: a tensor is never
dropped, or copied unpruned, by accident.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from mcore_proxy.checkpoint.hf.mapping import Table, routed_rows

ROUTER, ROUTER_BIAS, SCORE_BIAS, HASH_TABLE, EXPERT, FUSED, COPY = (
    "router",
    "router_bias",
    "score_bias",
    "hash_table",
    "expert",
    "fused",
    "copy",
)
# the canonical names of the router's tensors under a layer prefix (select and prune read these)
ROUTER_LEAVES = {
    ROUTER: "mlp.router.weight",
    ROUTER_BIAS: "mlp.router.bias",
    SCORE_BIAS: "mlp.router.expert_bias",
    HASH_TABLE: "mlp.router.hash_table",
}
_EXPERT_LOOKALIKE = re.compile(r"(^|\.)experts\.")
# quantization companions of a weight, as checkpoints spell them: FP8 block scales (`X_scale_inv`),
# compressed-tensors int4 (`X_packed`, `X_scale`, `X_shape`), MXFP4 (`X_blocks`, `X_scales`)
QUANT_SUFFIXES = ("_scale_inv", "_scale", "_packed", "_shape", "_blocks", "_scales")


def _glob(pattern: str) -> re.Pattern:
    text = re.escape(pattern).replace(r"\{e\}", r"(?P<e>\d+)").replace(r"\*", r".*")
    return re.compile("^" + text + "$")


def _prefix(pattern: str) -> re.Pattern:
    """`model.layers.{L}.` -> a regex capturing the layer number and the rest of the key."""
    text = re.escape(pattern).replace(r"\{L\}", r"(?P<n>\d+)").replace(r"\{k\}", r"(?P<n>\d+)")
    return re.compile("^" + text + "(?P<rest>.+)$")


@dataclass(frozen=True)
class Router:
    """The router's tensors (layer-relative patterns; each tuple: alternative spellings)."""

    weight: tuple[str, ...]
    bias: tuple[str, ...] = ()  # [E] added to the logits
    score_bias: tuple[str, ...] = ()  # [E] or [1, E] added to the scores for selection only
    hash_table: tuple[str, ...] = ()  # [V, k] int: expert ids by token id


@dataclass(frozen=True)
class Experts:
    """Routed expert tensors: `per_expert` patterns hold `{e}`; `fused` ones hold all E on axis 0.
    `suffixes`: quantization companions that follow their tensor (key + suffix)."""

    per_expert: tuple[str, ...]
    fused: tuple[str, ...] = ()
    suffixes: tuple[str, ...] = ("",) + QUANT_SUFFIXES


# the config.json spellings of the expert count E, the first one the family's own (and the one
# a config made from Megatron args gets); transformers 5 aliases `num_local_experts` to each
E_QWEN = ("num_experts", "num_local_experts")  # Qwen, OLMoE, Kimi-Linear
E_ROUTED = ("n_routed_experts", "num_local_experts")  # DeepSeek, GLM, MiMo, Kimi-K2.5
E_LOCAL = ("num_local_experts", "num_experts")  # Mixtral, MiniMax, gpt-oss


@dataclass(frozen=True)
class ConfigKeys:
    """config.json keys. Reads take the first present spelling (top level, then `text_config`);
    the proxy's config rewrites every present spelling of the expert count, top-k and groups."""

    experts: tuple[str, ...]
    topk: tuple[str, ...] = ("num_experts_per_tok",)
    groups: tuple[str, str] | None = None  # (number of groups, groups chosen per token)
    score_function: str | tuple[str, str] = "softmax"  # a constant, or (key, default)
    mtp: tuple[str, ...] = ()  # MTP layer count, read for checks only


@dataclass(frozen=True)
class Runtime:
    """How the model runs in transformers (module paths relative to a decoder layer module).

    router_module: the router whose forward hooks record routing; router_weight: its weight, from
    the router module (`wg.weight` where the module wraps its linear); `output`: what it returns,
    "logits_weights_indices" ((logits [T, E], top-k weights [T, k], ids [T, k]), transformers 5's
    TopKRouter) or "scores_logits" (Llama-4: (scores [T, E] sigmoid of the top-k logits, 0
    elsewhere, logits [T, E])). score_bias / hash_table: in-memory tensors a restriction edits.
    auto_class: the transformers Auto class that builds it from the folder. model_type_alias:
    config `model_type`s transformers does not know but builds as another (Kimi-K2 text-only)."""

    router_module: str = "mlp.gate"
    router_weight: str = "weight"  # the router's weight [E, H], relative to router_module
    output: str = "logits_weights_indices"
    score_bias: str | None = None
    hash_table: str | None = None
    auto_class: str = "AutoModelForCausalLM"
    model_type_alias: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class MoEFamily:
    """One model family's declaration; see the module docstring."""

    name: str
    architectures: tuple[str, ...]
    router: Router
    experts: Experts
    config: ConfigKeys
    runtime: Runtime = Runtime()
    layers: tuple[str, ...] = ("model.layers.{L}.",)
    copied: tuple[str, ...] = ()  # layer-relative globs of every other tensor of a layer
    model_copied: tuple[str, ...] = ()  # whole-key globs outside layers
    mtp: tuple[str, ...] = ()  # MTP layer prefixes (`mtp.layers.{k}.`); "after" in
    mtp_after_decoder: bool = False  # ... or MTP layer k is decoder layer num_hidden_layers + k
    mtp_copied: tuple[str, ...] = ()  # globs (relative to an MTP layer) of its own extra tensors
    megatron: object | None = None  # its Megatron side, if any (megatron_mapping.MegatronMapping)
    notes: str = ""  # what transformers does not do for this family (README, inspect)
    origin: str = "declared"  # or "discovered" (discovery.py): read from transformers itself
    _compiled: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self):
        c = self._compiled
        c["layers"] = tuple(_prefix(p) for p in self.layers)
        c["mtp"] = tuple(_prefix(p) for p in self.mtp)
        roles = [(ROUTER, p, "") for p in self.router.weight] + [(ROUTER_BIAS, p, "") for p in self.router.bias]
        roles += [(SCORE_BIAS, p, "") for p in self.router.score_bias]
        roles += [(HASH_TABLE, p, "") for p in self.router.hash_table]
        roles += [(EXPERT, p, s) for p in self.experts.per_expert for s in self.experts.suffixes]
        roles += [(FUSED, p, s) for p in self.experts.fused for s in self.experts.suffixes]
        c["roles"] = tuple((kind, pattern + suffix, _glob(pattern + suffix)) for kind, pattern, suffix in roles)
        for name in ("copied", "mtp_copied", "model_copied"):
            c[name] = tuple(_glob(p) for p in getattr(self, name))
        if (m := self.megatron) is not None:
            c["table"] = Table(m.rows + routed_rows(self.router, self.experts, m.hash_table), m.ignored, m.mtp_prefix)

    def megatron_table(self) -> Table:
        """The HF <-> megatron-core mapping table: the Megatron mapping's rows and the router and
        expert rows derived from this record's layout (`mapping.routed_rows`)."""
        return self._compiled["table"]

    # -- classifying a checkpoint key ----------------------------------------------------------
    def locate(self, key: str, num_layers: int) -> tuple[str | None, str, str]:
        """(layer id or None, the layer prefix as written, the rest): "3" for decoder layer 3,
        "mtp.0" for MTP layer 0, None for keys outside layers."""
        for regex in self._compiled["mtp"]:
            if m := regex.match(key):
                return f"mtp.{int(m.group('n'))}", key[: m.start("rest")], m.group("rest")
        for regex in self._compiled["layers"]:
            if m := regex.match(key):
                n = int(m.group("n"))
                if n >= num_layers and self.mtp_after_decoder:
                    return f"mtp.{n - num_layers}", key[: m.start("rest")], m.group("rest")
                return (str(n) if n < num_layers else f"beyond.{n}"), key[: m.start("rest")], m.group("rest")
        return None, "", key

    def role(self, layer_id: str | None, rest: str) -> tuple[str, str, int | None] | None:
        """(kind, matched pattern, expert id or None) of a key's layer-relative rest; None if the
        family does not account for it."""
        if layer_id is None:
            return (COPY, rest, None) if any(r.match(rest) for r in self._compiled["model_copied"]) else None
        for kind, pattern, regex in self._compiled["roles"]:
            if m := regex.match(rest):
                return kind, pattern, int(m.group("e")) if "e" in regex.groupindex else None
        copied = self._compiled["copied"] + (self._compiled["mtp_copied"] if layer_id.startswith("mtp.") else ())
        if any(r.match(rest) for r in copied) and not _EXPERT_LOOKALIKE.search(_shared_free(rest)):
            return COPY, rest, None
        return None


def _shared_free(rest: str) -> str:
    """The key without `shared_expert(s)` parts: shared experts are copied, routed ones never."""
    return re.sub(r"shared_experts?\.", "", rest)


def expert_leaf(pattern: str, kind: str) -> str:
    """The canonical leaf of a routed-expert pattern: what follows `{e}.` (`w1.weight`,
    `gate_proj.weight_scale_inv`), or a fused tensor's last name (`gate_up_proj_blocks`; with its
    module's name where that is `weight` or `bias`: `input_linear.weight`)."""
    if kind == EXPERT:
        return pattern.split("{e}.", 1)[1]
    parts = pattern.split(".")  # a module's `weight` / `bias` keeps its module's name: `fc1.weight`
    return ".".join(parts[-2:]) if parts[-1] in ("weight", "bias") and len(parts) > 1 else parts[-1]
