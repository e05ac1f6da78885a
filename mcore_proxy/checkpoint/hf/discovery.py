"""A Mixture-of-Experts family discovered from transformers itself, for an architecture no
declaration in `families.py` covers.

From config.json alone (remote code is never run: the architecture must be a class transformers
ships), the tiny twin of the config (`twin.py`) is built twice on the meta device, with E and with
E/2 experts. Every tensor whose shape follows the expert count is expert-indexed; by shape and
place it is
- a router weight [E, H] (a 2-D tensor outside the experts);
- a router logit bias [E] (the `bias` of the router's own linear);
- a selection bias [E] or [1, E] (a bias/correction/statics tensor elsewhere: DeepSeek's
  `e_score_correction_bias`);
- a routed expert tensor: a leading expert axis on a fused tensor [E, ...] (biases [E, F] and
  per-expert scales [E] of the experts included), or one module per expert in a list of E;
- a hash table [V, k] of expert ids (an integer tensor in the router's module).
Everything else is copied bit for bit: attention, norms, dense MLPs and shared experts (which
never change with E). One forward of the twin on CPU then finds the router module: the module
whose output is (logits [T, E], weights [T, k], expert ids [T, k]) and that holds the router
weight. The spellings a checkpoint may use beside transformers' in-memory names are transformers'
own: `revert_weight_conversion`, what `save_pretrained` writes (per-expert keys, renamed blocks).

The result is an ordinary `MoEFamily` (origin "discovered"), registered in this process under
its architecture, so every part of mcore-proxy reads the checkpoint through it as through a
declared one. Before a proxy is written from it, `convert/twin.py` proves it on the twin.

What discovery refuses, each in one sentence: an architecture transformers does not ship, a
config with no expert count, a per-layer expert count, axes of E + c (always-on extra slots such
as zero-computation experts), more than one router per layer, transposed routers, and routers
whose output is not (logits, weights, ids).
"""

from __future__ import annotations

import functools
import json
import math
import re
from dataclasses import dataclass

from mcore_proxy.checkpoint.hf import twin
from mcore_proxy.checkpoint.hf.config import HFConfig
from mcore_proxy.checkpoint.hf.descriptor import ConfigKeys, Experts, MoEFamily, Router, Runtime
from mcore_proxy.core.errors import CheckpointError
from mcore_proxy.engines.hooks import Hooks

FULL_LIST = "docs/families.md"  # where the refusals point: every family, and why
_TEXT_KEYS = ("text_config", "language_config", "llm_config", "thinker_config", "text_model_config")
_LAYER = re.compile(r"^(?P<prefix>(?:.*\.)?layers\.)(?P<n>\d+)\.(?P<rest>.+)$")
_SELECTION_BIAS = re.compile(r"bias|correction|statics")


@dataclass(frozen=True)
class Discovery:
    """A discovered family and the twin it was read from (what the proof builds)."""

    family: MoEFamily
    twin: dict  # the twin's config.json
    twin_experts: int


class NotDiscovered(CheckpointError):
    """The architecture's structure could not be read as a prunable MoE family."""


# -- the registry of this process -----------------------------------------------------------------
_FOUND: dict[str, Discovery] = {}


# elements (parameters and buffers) a twin may hold; the largest that transformers 5.25 builds: 2.4e7
MAX_TWIN_NUMEL = 50_000_000


def discovered(architecture: str) -> Discovery | None:
    """The discovery registered for `architecture` in this process, or None."""
    return _FOUND.get(architecture)


def discovered_named(name: str) -> MoEFamily | None:
    """The family discovered in this process under `name`, or None."""
    return next((d.family for d in _FOUND.values() if d.family.name == name), None)


def discover(config: HFConfig) -> Discovery:
    """The family of config.json's architecture, discovered and registered (cached by the
    architecture and the config's structure); NotDiscovered in one sentence otherwise."""
    data = {k: v for k, v in config.data.items() if k not in ("_name_or_path", "transformers_version")}
    found = _discover(config.architecture(), json.dumps(data, sort_keys=True, default=str), str(config.path))
    _FOUND[found.family.architectures[0]] = found
    return found


def _refuse(where: str, arch: str, why: str, kind: type[NotDiscovered] = NotDiscovered) -> NotDiscovered:
    return kind(f"{where}: {arch or 'its architecture'} {why}; every family and its status: {FULL_LIST}")


@functools.lru_cache(maxsize=32)
def _discover(arch: str, data_json: str, where: str) -> Discovery:

    from mcore_proxy.core.optional import require

    transformers = require("transformers", why="reading a model family from transformers itself")
    data = special_floats(json.loads(data_json))
    model_type = data.get("model_type")
    mapping = transformers.CONFIG_MAPPING
    config_class = mapping[model_type] if isinstance(model_type, str) and model_type in mapping else None
    model_class = getattr(transformers, arch, None) if arch else None
    if config_class is None or not (
        isinstance(model_class, type) and issubclass(model_class, transformers.PreTrainedModel)
    ):
        raise _refuse(
            where,
            arch,
            f"(model_type {model_type!r}) is not a model transformers {transformers.__version__} ships, and "
            "remote code is never run",
        )
    try:
        config = config_class(**{k: v for k, v in data.items() if k not in ("model_type", "auto_map")})
    except Exception as err:  # transformers' own validation of the config, whatever it raises
        raise _refuse(where, arch, f"has a config transformers refuses ({_reason(err)})") from None
    full = config.to_dict()
    text_key = _text_key(config)
    text = full[text_key] if text_key else full
    counts = twin.expert_count_keys(text)
    if not counts:
        raise _refuse(where, arch, "has no config key that counts routed experts")
    experts = twin.experts_of(counts)
    count_keys = tuple(k for k, v in counts.items() if v == experts or (isinstance(v, list) and experts in v))
    if any(isinstance(counts[k], list) for k in count_keys):
        raise _refuse(where, arch, f"counts experts per layer ({count_keys[0]}), which mcore-proxy does not prune yet")
    if experts < 4:
        raise _refuse(where, arch, f"has {experts} experts per layer: too few to prune")
    twin_experts = min(experts, twin.MAX_EXPERTS) // 2 * 2
    small = twin.twin_config(full, text_key, list(count_keys), experts, twin_experts)
    found = (where, arch, model_type, text_key, count_keys, text, twin_experts, transformers.__version__)
    try:
        return _discover_twin(small, *found)
    except _NotRunSmall:
        wide = twin.with_source_head_dim(small, text_key, text)
        if wide == small:
            raise
        # a rotary split sized for the source's heads (GLM-4.5V's mrope_section): the twin keeps them
        return _discover_twin(wide, *found)


class _NotRunSmall(NotDiscovered):
    """The twin was built but transformers could not run it."""


def _discover_twin(small: dict, where, arch, model_type, text_key, count_keys, text, twin_experts, version):
    """The family read from one twin config (`small`): built with E and E/2 experts on the meta
    device, the expert-indexed tensors by shape, the router by one forward."""
    half = twin.with_experts(small, text_key, list(count_keys), twin_experts, twin_experts // 2)
    twin_json = dict(small, model_type=model_type, architectures=[arch])
    try:
        a = build_twin(twin_json, meta=True)
        b = build_twin(dict(half, model_type=model_type, architectures=[arch]), meta=True)
        size = sum(t.numel() for t in [*a.parameters(), *a.buffers()])
        if size > MAX_TWIN_NUMEL:  # a size the twin rules do not shrink: never allocated on CPU
            raise _refuse(where, arch, f"has a twin of {size:.1e} parameters, not small (a size key the twin misses)")
        model = build_twin(twin_json)
    except NotDiscovered:
        raise
    except Exception as err:  # transformers' own code on a config it accepted: the reason, named
        raise _refuse(where, arch, f"could not be built small by transformers ({_reason(err)})") from None
    roles = expert_indexed(a, b, twin_experts, twin_experts // 2)
    where_arch = (where, arch)
    structure = _structure(roles, dict(a.named_modules()), _tensors(a), where_arch)
    runtime, scoring = _observe(model, structure, twin_experts, text, where_arch)
    if scoring is None and _score_key(text) is None:  # a top-1 twin (as a proxy's) of a config naming none
        scoring = _scoring_at_top2(twin_json, text_key, structure, twin_experts, text, where_arch)
    family = _family(arch, model_type, structure, runtime, scoring, model, count_keys, text, version)
    return Discovery(family, twin_json, twin_experts)


def build_twin(config: dict, meta: bool = False):
    """transformers' model of a twin's config.json (its `model_type` and `architectures`): on the
    meta device, or on CPU in float32 from seed 0, in eval mode."""
    import torch
    import transformers

    config_class = transformers.CONFIG_MAPPING[config["model_type"]]
    model_class = getattr(transformers, config["architectures"][0])
    # a twin is made from a config object's values, whose special floats are floats already
    args = {k: v for k, v in config.items() if k not in ("model_type", "architectures", "transformers_version")}
    if meta:
        with torch.device("meta"):
            return model_class._from_config(config_class(**args))
    torch.manual_seed(0)
    return model_class._from_config(config_class(**args), dtype=torch.float32).eval()


# transformers' save_pretrained writes inf and NaN, which JSON lacks, as {"__float__": "Infinity"}
# (NemotronH's time_step_limit); its from_pretrained reads them back, and so does discovery
_SPECIAL_FLOATS = {"Infinity": math.inf, "-Infinity": -math.inf, "NaN": math.nan}


def special_floats(value):
    """`value` (parsed JSON) with transformers' encoded special floats as floats."""
    if isinstance(value, dict):
        if len(value) == 1 and value.get("__float__") in _SPECIAL_FLOATS:
            return _SPECIAL_FLOATS[value["__float__"]]
        return {k: special_floats(v) for k, v in value.items()}
    if isinstance(value, list):
        return [special_floats(v) for v in value]
    return value


def _reason(err: BaseException) -> str:
    """An exception of transformers' code as part of one sentence: its type and first 160 characters."""
    return f"{type(err).__name__}: {' '.join(str(err).split())[:160]}"


def _text_key(config) -> str | None:
    try:
        text = config.get_text_config()
    except ValueError:  # several text configs (an encoder-decoder): the top level is read
        return None
    if text is config:
        return None
    return next((k for k in _TEXT_KEYS if getattr(config, k, None) is text), None)


def split_layer(name: str) -> tuple[str | None, str, str]:
    """(layer number or None, the layer prefix with `{L}`, the layer-relative rest)."""
    m = _LAYER.match(name)
    if not m:
        return None, "", name
    return m.group("n"), m.group("prefix") + "{L}.", m.group("rest")


# -- structure: what follows the expert count -----------------------------------------------------
def _tensors(model) -> dict:
    out = {n: (tuple(p.shape), p.dtype) for n, p in model.named_parameters()}
    out.update({n: (tuple(b.shape), b.dtype) for n, b in model.named_buffers()})
    return out


def expert_indexed(a, b, experts: int, half: int) -> dict[str, tuple]:
    """Tensors of build `a` (E experts) whose shape differs in build `b` (E/2): name -> (shape,
    changed axes, extra slots c where an axis is E + c, dtype); modules that are lists of E ->
    ("list", E). Axes that do not follow E exactly are recorded as ("odd", shape in b)."""
    import torch

    ta, tb = _tensors(a), _tensors(b)
    out: dict[str, tuple] = {}
    for name, (shape, dtype) in ta.items():
        other = tb.get(name, (None,))[0]
        if other is None or other == shape:
            continue
        axes = [i for i, (x, y) in enumerate(zip(shape, other)) if x != y]
        extra = {shape[i] - experts for i in axes}
        if len(shape) == len(other) and all(shape[i] - other[i] == experts - half for i in axes) and len(extra) == 1:
            out[name] = ("tensor", shape, tuple(axes), extra.pop(), dtype)
        else:
            out[name] = ("odd", shape, other)
    mods_b = dict(b.named_modules())
    for name, module in a.named_modules():
        other = mods_b.get(name)
        lists = isinstance(module, torch.nn.ModuleList) and isinstance(other, torch.nn.ModuleList)
        if lists and len(module) == experts and len(other) == half:
            out[name] = ("list", experts)
    return out


@dataclass(frozen=True)
class _Structure:
    """Layer-relative names (in-memory spelling) of each role, and the layer prefixes."""

    prefixes: tuple[str, ...]
    router: tuple[str, ...]
    router_bias: tuple[str, ...]
    score_bias: tuple[str, ...]
    hash_table: tuple[str, ...]
    fused: tuple[str, ...]
    per_expert: tuple[str, ...]  # `{e}` patterns of module lists


def _structure(roles: dict, modules: dict, tensors: dict, where_arch) -> _Structure:
    import torch

    kinds: dict[str, set] = {k: set() for k in ("router", "router_bias", "score_bias", "hash", "fused", "per_expert")}
    prefixes = set()
    lists = sorted(n for n, r in roles.items() if r[0] == "list")
    for name in lists:
        layer, prefix, rest = split_layer(name)
        if layer is None:
            raise _refuse(*where_arch, f"keeps a list of experts outside its decoder layers ({name})")
        prefixes.add(prefix)
        for sub, _ in modules[name][0].named_parameters():
            kinds["per_expert"].add(f"{rest}.{{e}}.{sub}")
    fused_owners = {
        n.rsplit(".", 1)[0] for n, r in roles.items() if r[0] == "tensor" and len(r[1]) >= 3 and r[2] == (0,)
    }
    routers = [n for n, r in roles.items() if r[0] == "tensor" and _is_router(n, r, fused_owners)]
    router_owners = {n.rsplit(".", 1)[0] for n in routers}
    for name, (shape, dtype) in tensors.items():  # hash tables [V, k]: their shape does not follow E
        if (
            not dtype.is_floating_point
            and dtype != torch.bool
            and len(shape) == 2
            and name.rsplit(".", 1)[0] in router_owners
        ):
            kinds["hash"].add(split_layer(name)[2])
    for name, role in sorted(roles.items()):
        if role[0] == "list" or any(name.startswith(x + ".") for x in lists):
            continue
        layer, prefix, rest = split_layer(name)
        if layer is None:
            raise _refuse(*where_arch, f"has an expert-indexed tensor outside its decoder layers ({name})")
        prefixes.add(prefix)
        if role[0] == "odd":
            raise _refuse(*where_arch, f"has {rest} of shape {list(role[1])}, which does not follow the expert count")
        _, shape, axes, extra, dtype = role
        if extra:
            raise _refuse(
                *where_arch,
                f"holds E + {extra} slots in {rest} (always-on extra experts), which mcore-proxy does not prune yet",
            )
        owner, leaf = name.rsplit(".", 1)
        if name in routers:
            kinds["router"].add(rest)
        elif not dtype.is_floating_point and len(shape) == 2 and owner in router_owners:
            kinds["hash"].add(rest)
        elif axes != (0,) and not (len(shape) == 2 and shape[0] == 1 and axes == (1,)):
            raise _refuse(
                *where_arch, f"has {rest} with the experts on axis {axes[0]}, which mcore-proxy does not prune yet"
            )
        elif len(shape) >= 2 and shape[0] != 1 or any(owner == f or owner.startswith(f + ".") for f in fused_owners):
            kinds["fused"].add(rest)
        elif leaf == "bias" and owner in router_owners:
            kinds["router_bias"].add(rest)
        elif _SELECTION_BIAS.search(leaf):
            kinds["score_bias"].add(rest)
        else:
            kinds["fused"].add(rest)  # a per-expert scale [E]: used for the chosen experts only
    if not kinds["router"]:
        raise _refuse(*where_arch, "has no router weight [E, H] that follows the expert count")
    if len(kinds["router"]) > 1 or len(kinds["score_bias"]) > 1:
        raise _refuse(
            *where_arch, f"has {len(kinds['router'])} routers per layer, which mcore-proxy does not prune yet"
        )
    if not (kinds["fused"] or kinds["per_expert"]):
        raise _refuse(*where_arch, "has routers but no routed expert tensors that follow the expert count")
    return _Structure(
        tuple(sorted(prefixes)),
        *(tuple(sorted(kinds[k])) for k in ("router", "router_bias", "score_bias", "hash", "fused", "per_expert")),
    )


def _is_router(name: str, role: tuple, fused_owners: set) -> bool:
    """A 2-D floating tensor [E, d] outside the experts whose leaf is not a bias."""
    _, shape, axes, _, dtype = role
    owner, leaf = name.rsplit(".", 1)
    in_experts = any(owner == f or owner.startswith(f + ".") for f in fused_owners)
    if len(shape) != 2 or not dtype.is_floating_point or in_experts or leaf.endswith("bias") or shape[0] == 1:
        return False
    return axes == (0,)  # not a transposed [H, E]: refused later as an axis mcore-proxy does not prune


# -- runtime: the router module, by one forward of the twin ---------------------------------------
def _observe(model, structure: _Structure, experts: int, text: dict, where_arch) -> tuple[Runtime, str | None]:
    """The module of a decoder layer whose output is (logits [.., E], weights [.., k], ids [.., k])
    and that holds the router weight, and the score function its weights follow (`_scoring`)."""
    import torch

    layers = {}
    for name, module in model.named_modules():
        layer, _, rest = split_layer(name + ".")
        if layer is not None and rest != ".":
            layers.setdefault(layer, {})[rest.rstrip(".")] = module
    router_leaf = structure.router[0]
    seen: dict[str, str] = {}

    scoring: dict[str, str | None] = {}

    def note(rest):
        def hook(module, args, out):  # returns None: the output stays as it is
            seen.setdefault(rest, _kind(out, experts))
            if seen[rest] == "logits_weights_indices":
                scoring.setdefault(rest, _scoring(*out))

        return hook

    vocab = int(text.get("vocab_size") or twin.VOCAB)
    tokens = torch.randint(3, min(vocab, twin.VOCAB) - 8, (2, 9), generator=torch.Generator().manual_seed(0))
    with Hooks() as hooks:
        for modules in layers.values():
            for rest, module in modules.items():
                if router_leaf.startswith(rest + "."):
                    hooks.forward(module, note(rest))
        try:
            with torch.no_grad():
                model(input_ids=tokens, use_cache=False)
        except Exception as err:
            raise _refuse(*where_arch, f"could not run small in transformers ({_reason(err)})", _NotRunSmall) from None
    found = sorted((r for r, k in seen.items() if k == "logits_weights_indices"), key=len, reverse=True)
    if not found:
        raise _refuse(*where_arch, "has a router whose output is not (logits, weights, expert ids)")
    module = found[0]
    score_bias = structure.score_bias[0] if structure.score_bias else None
    runtime = Runtime(
        router_module=module,
        router_weight=router_leaf[len(module) + 1 :],
        score_bias=score_bias,
        hash_table=structure.hash_table[0] if structure.hash_table else None,
        auto_class=type(model).__name__,
    )
    return runtime, scoring.get(module)


def _scoring_at_top2(twin_json: dict, text_key, structure, experts: int, text: dict, where_arch) -> str | None:
    try:
        return _observe(build_twin(twin.with_topk(twin_json, text_key, 2)), structure, experts, text, where_arch)[1]
    except Exception:  # transformers' own code refusing top-2 here: the score function stays untold
        return None


def _scoring(logits, weights, ids) -> str | None:
    """ "softmax" or "sigmoid": which the router's top-k weights follow, told by their ratios
    (w_i / w_j is exp(l_i - l_j) for a softmax, sigmoid(l_i) / sigmoid(l_j) for sigmoid scores,
    whatever renormalisation or scaling follows). None where no row tells (top-1, weights of
    zero) or neither fits (a per-expert scale)."""
    import torch

    logits, weights = logits.detach().double(), weights.detach().double()
    chosen = logits.reshape(-1, logits.shape[-1]).gather(-1, ids.reshape(-1, ids.shape[-1]))
    weights = weights.reshape(chosen.shape)
    rows = (weights > 0).all(-1)
    if chosen.shape[-1] < 2 or not rows.any():
        return None
    got, chosen = weights[rows].log(), chosen[rows]
    got = got - got[:, :1]
    sig = torch.nn.functional.logsigmoid(chosen)
    errors = {
        "softmax": float((got - (chosen - chosen[:, :1])).abs().max()),
        "sigmoid": float((got - (sig - sig[:, :1])).abs().max()),
    }
    best, other = sorted(errors, key=errors.get)
    # fp32 weights hold a ratio to about 1e-6; the two rules part by half a logit difference
    return best if errors[best] < 1e-4 and errors[other] > 10 * errors[best] else None


def _kind(out, experts: int) -> str:
    import torch

    if isinstance(out, (tuple, list)) and len(out) == 3 and all(isinstance(t, torch.Tensor) for t in out):
        logits, weights, ids = out
        if (
            logits.is_floating_point()
            and logits.shape[-1] == experts
            and weights.is_floating_point()
            and not ids.is_floating_point()
            and weights.shape == ids.shape
        ):
            return "logits_weights_indices"
    return "other"


# -- the spellings a checkpoint uses --------------------------------------------------------------
def _saved_spellings(model, fused: tuple[str, ...]) -> tuple[list[str], dict[str, tuple[str, ...]]]:
    """(every in-memory tensor name, in-memory name -> each other key `save_pretrained` writes for
    it). transformers' `revert_weight_conversion` gives the keys; a key belongs to the in-memory
    tensor it shares storage with (a renaming), else to the tensor of its layer that holds its
    values as one block or whose values it holds (a per-expert slice of a fused expert tensor,
    layer-relative names `fused`, tried first; a fused QKV made of copied projections)."""
    from transformers.core_model_loading import revert_weight_conversion

    state = model.state_dict()
    saved = revert_weight_conversion(model, dict(state))
    by_storage: dict[int, str] = {}
    for name, tensor in state.items():
        by_storage.setdefault(tensor.untyped_storage().data_ptr(), name)
    ordered = sorted(state, key=lambda n: split_layer(n)[2] not in fused)
    out: dict[str, set] = {}
    for key, tensor in saved.items():
        if key in state:
            continue
        origin = by_storage.get(tensor.untyped_storage().data_ptr()) or _related(key, tensor, ordered, state)
        if origin is not None:
            out.setdefault(origin, set()).add(key)
    return list(state), {k: tuple(sorted(v)) for k, v in out.items()}


def _related(key: str, tensor, names: list[str], state: dict) -> str | None:
    """The first in-memory tensor of `key`'s layer (or outside layers, as `key`) that holds
    `tensor`'s values as one block, or whose values `tensor` holds as one block."""
    if not tensor.is_floating_point() or tensor.numel() == 0:
        return None
    layer = split_layer(key)[0]
    for name in names:
        other = state[name]
        if split_layer(name)[0] != layer or not other.is_floating_point() or other.numel() == 0:
            continue
        small, big = (tensor, other) if tensor.numel() <= other.numel() else (other, tensor)
        if _holds(big.flatten(), small.flatten()):
            return name
    return None


def _holds(flat, block) -> bool:
    n = block.numel()
    for start in (flat == block[0]).nonzero().flatten().tolist():
        if start + n <= flat.numel() and bool((flat[start : start + n] == block).all()):
            return True
    return False


_NUMBERED = re.compile(r"^(?P<head>.*\.)(?P<e>\d+)(?P<tail>\..+)$")


def _spellings(rests: tuple[str, ...], saved: dict, fused: bool = False) -> tuple[set, set, set]:
    """(layer-relative spellings, per-expert `{e}` patterns (of fused tensors), layer prefixes)
    that save_pretrained writes for the layer-relative names `rests`, beside the names themselves."""
    names, per_expert, prefixes = set(rests), set(), set()
    for name, keys in saved.items():
        layer, _, rest = split_layer(name)
        if layer is None or rest not in rests:
            continue
        for key in keys:
            k_layer, k_prefix, k_rest = split_layer(key)
            if k_layer is None:
                continue
            prefixes.add(k_prefix)
            m = _NUMBERED.match(k_rest) if fused else None
            if m:
                per_expert.add(f"{m.group('head')}{{e}}{m.group('tail')}")
            else:
                names.add(k_rest)
    return names, per_expert, prefixes


def _family(arch, model_type, s: _Structure, runtime: Runtime, scoring, model, count_keys, text, version) -> MoEFamily:
    """The family record; `scoring`: the score function the router was seen to follow (None: not
    told apart), where config.json names none."""
    names, saved = _saved_spellings(model, s.fused)
    router, _, p1 = _spellings(s.router, saved)
    router_bias = _spellings(s.router_bias, saved)[0]
    score_bias = _spellings(s.score_bias, saved)[0]
    hash_table = _spellings(s.hash_table, saved)[0]
    fused, hub_experts, p2 = _spellings(s.fused, saved, fused=True)
    roles = set(router) | router_bias | score_bias | hash_table | fused
    # a decoder layer is one under the MoE layers' prefix; other numbered layers (a vision tower's)
    # are copied as whole-key globs
    inside = [n for n in names if split_layer(n)[0] is not None and split_layer(n)[1] in s.prefixes]
    layer_rests = {split_layer(n)[2] for n in inside}
    others = tuple(r for r in layer_rests if r not in roles and not _in_lists(r, s.per_expert))
    copied = {_glob_of(r) for r in _spellings(others, saved)[0]}
    outside = [n for n in names if n not in set(inside)]
    model_copied = {"lm_head.*"} | {_numbered_glob(k) for n in outside for k in (n, *saved.get(n, ()))}
    topk = tuple(k for k in text if twin.TOPK.search(k)) or ("num_experts_per_tok",)
    groups = tuple(next((k for k in text if rx.search(k)), "") for rx in (twin.GROUPS, twin.TOPK_GROUP))
    score = _score_key(text)
    return MoEFamily(
        arch.removesuffix("ForCausalLM"),
        (arch,),
        Router(tuple(sorted(router)), tuple(sorted(router_bias)), tuple(sorted(score_bias)), tuple(sorted(hash_table))),
        Experts(per_expert=s.per_expert + tuple(sorted(hub_experts)), fused=tuple(sorted(fused))),
        ConfigKeys(
            count_keys,
            topk=topk,
            groups=groups if all(groups) else None,
            # a config.json without the key gets the config class's default, as in transformers
            score_function=(score, text[score]) if score else scoring or "softmax",
        ),
        runtime=runtime,
        layers=tuple(sorted(set(s.prefixes) | p1 | p2)),
        copied=tuple(sorted(copied)),
        model_copied=tuple(sorted(model_copied)),
        notes=f"discovered from transformers {version} ({model_type})",
        origin="discovered",
    )


def _score_key(text: dict) -> str | None:
    """The config key that names the router's score function, if the config class has one."""
    return next((k for k in twin.SCORE_FUNCTION if isinstance(text.get(k), str)), None)


def _in_lists(rest: str, per_expert: tuple[str, ...]) -> bool:
    return any(rest.startswith(p.split("{e}", 1)[0]) for p in per_expert)


def _numbered_glob(name: str) -> str:
    """`_glob_of` with every numbered part a wildcard: the twin's one vision block stands for the
    checkpoint's many (`model.visual.blocks.*.attn.qkv.*`)."""
    return re.sub(r"(?<=\.)\d+(?=\.)", "*", _glob_of(name))


def _glob_of(name: str) -> str:
    """A module's tensors: `self_attn.q_proj.weight` -> `self_attn.q_proj.*` (quantization
    companions included); a tensor directly on the layer stays as it is."""
    return name.rsplit(".", 1)[0] + ".*" if "." in name else name
