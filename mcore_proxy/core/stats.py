"""Routing statistics: the contract between trace and select (DESIGN.md 4.1).

A file is a safetensors blob plus a JSON sidecar of the same stem. Per MoE layer, keyed by its
layer id (`"12"`: global 0-based decoder layer, as in `decoder.layers.12`; `"mtp.0"`: MTP
layer 0), it holds sufficient statistics (sums), so per-rank files merge by element-wise sum.

Tensor keys: `layer.{L}.{field}` for decoder layers, `mtp.{k}.{field}` for MTP layers.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from mcore_proxy.core.jsonfile import read_json_object
from mcore_proxy.core.errors import StatsError

FORMAT = "mcore-proxy-stats/1"
REQUIRED_FIELDS = ("tokens", "freq", "gate_mass", "coact", "proto_sum")
OPTIONAL_FIELDS = ("saliency_sum",)
DTYPES = {
    "tokens": np.int64,
    "freq": np.int64,
    "gate_mass": np.float64,
    "coact": np.int64,
    "proto_sum": np.float64,
    "saliency_sum": np.float64,
}


def layer_prefix(layer_id: str) -> str:
    """`"12"` -> `"layer.12"`, `"mtp.0"` -> `"mtp.0"`."""
    return layer_id if layer_id.startswith("mtp.") else f"layer.{layer_id}"


def layer_sort_key(layer_id: str) -> tuple[int, int]:
    """Decoder layers first in numeric order, then MTP layers."""
    if layer_id.startswith("mtp."):
        return (1, int(layer_id.split(".")[1]))
    return (0, int(layer_id))


@dataclass(frozen=True, repr=False)
class LayerStats:
    """Sums over the tokens one MoE layer routed.

    tokens: routed tokens; freq [E] int64: top-k selections of e; gate_mass [E] float64: sum of
    routing probabilities given to e; coact [E, E] int64: tokens selecting both (diag = freq);
    proto_sum [E, H] float64: sum of router inputs of tokens routed to e; saliency_sum [E]
    float64 or None: sum of gate x L2 norm of e's output.
    """

    tokens: int
    freq: np.ndarray
    gate_mass: np.ndarray
    coact: np.ndarray
    proto_sum: np.ndarray
    saliency_sum: np.ndarray | None = None

    def __post_init__(self):
        e = self.freq.shape[0]
        expected = {"freq": (e,), "gate_mass": (e,), "coact": (e, e), "saliency_sum": (e,)}
        for name, shape in expected.items():
            value = getattr(self, name)
            if value is not None and value.shape != shape:
                raise StatsError(f"routing statistics field {name} has shape {value.shape}, expected {shape}")
        if self.proto_sum.ndim != 2 or self.proto_sum.shape[0] != e:
            raise StatsError(f"routing statistics field proto_sum has shape {self.proto_sum.shape}, expected ({e}, H)")

    @property
    def num_experts(self) -> int:
        return int(self.freq.shape[0])

    @property
    def hidden_size(self) -> int:
        return int(self.proto_sum.shape[1])

    def prototypes(self) -> np.ndarray:
        """Mean routed hidden state per expert, [E, H]; rows of never-selected experts are 0."""
        return self.proto_sum / np.maximum(self.freq, 1)[:, None]

    def __add__(self, other: "LayerStats") -> "LayerStats":
        sal = None
        if self.saliency_sum is not None and other.saliency_sum is not None:
            sal = self.saliency_sum + other.saliency_sum
        return LayerStats(
            self.tokens + other.tokens,
            self.freq + other.freq,
            self.gate_mass + other.gate_mass,
            self.coact + other.coact,
            self.proto_sum + other.proto_sum,
            sal,
        )

    def __repr__(self) -> str:
        return f"LayerStats(tokens={self.tokens}, E={self.num_experts}, H={self.hidden_size})"


@dataclass(frozen=True, repr=False)
class RoutingStats:
    """Statistics of every traced MoE layer plus the sidecar metadata."""

    layers: dict[str, LayerStats]
    topk: int
    meta: dict = field(default_factory=dict)

    def __post_init__(self):
        if not self.layers:
            raise StatsError("routing statistics hold no MoE layer")
        shapes = (
            self.layers.shapes()
            if isinstance(self.layers, StreamedLayers)
            else {(s.num_experts, s.hidden_size) for s in self.layers.values()}
        )
        if len(shapes) != 1:
            raise StatsError(f"routing statistics mix layer shapes (E, H) {sorted(shapes)}")
        object.__setattr__(self, "_shape", next(iter(shapes)))

    @property
    def num_experts(self) -> int:
        return int(self._shape[0])

    @property
    def hidden_size(self) -> int:
        return int(self._shape[1])

    @property
    def layer_ids(self) -> list[str]:
        return sorted(self.layers, key=layer_sort_key)

    @property
    def total_tokens(self) -> int:
        return sum(s.tokens for s in self.layers.values())

    def sidecar(self) -> dict:
        meta = dict(self.meta)
        meta.update(
            format=FORMAT,
            num_experts=self.num_experts,
            hidden_size=self.hidden_size,
            topk=self.topk,
            layers=self.layer_ids,
            total_tokens=self.total_tokens,
        )
        return meta

    def __repr__(self) -> str:
        return f"RoutingStats(layers={len(self.layers)}, E={self.num_experts}, topk={self.topk})"


def sidecar_path(path: str | os.PathLike) -> Path:
    return Path(path).with_suffix(".json")


def save_stats(stats: RoutingStats, path: str | os.PathLike) -> Path:
    """Write `path` (.safetensors) and its JSON sidecar atomically (temp file, then rename)."""
    from safetensors import SafetensorError
    from safetensors.numpy import save_file

    path = Path(path)
    tensors = {}
    for layer_id, s in stats.layers.items():
        prefix = layer_prefix(layer_id)
        tensors[f"{prefix}.tokens"] = np.array([s.tokens], dtype=np.int64)
        for name in REQUIRED_FIELDS[1:] + OPTIONAL_FIELDS:
            value = getattr(s, name)
            if value is not None:
                tensors[f"{prefix}.{name}"] = np.ascontiguousarray(value, dtype=DTYPES[name])
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        save_file(tensors, str(tmp), metadata={"format": FORMAT})
    except SafetensorError as err:
        tmp.unlink(missing_ok=True)
        raise _as_os_error(err, tmp) from None
    os.chmod(tmp, 0o666 & ~_umask())  # safetensors creates 0600; others on the cluster merge these
    side_tmp = sidecar_path(tmp)
    side_tmp.write_text(json.dumps(stats.sidecar(), indent=2, sort_keys=True))
    # the JSON last: a reader that finds the sidecar finds a complete tensor file beside it
    os.replace(tmp, path)
    os.replace(side_tmp, sidecar_path(path))
    return path


def _as_os_error(err: Exception, path: Path) -> OSError:
    """safetensors reports a failed write (full disk, file-size limit) as its own error, with the
    system's errno only in the text ("... (os error 28)"): make it the OSError it is."""
    m = re.search(r"os error (\d+)", str(err))
    code = int(m[1]) if m else errno.EIO
    return OSError(code, os.strerror(code), str(path))


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _parse_key(key: str) -> tuple[str, str]:
    parts = key.split(".")
    if len(parts) == 3 and parts[0] in ("layer", "mtp"):
        layer_id = parts[1] if parts[0] == "layer" else f"mtp.{parts[1]}"
        return layer_id, parts[2]
    raise ValueError(key)


class StreamedLayers(Mapping):
    """Layer id -> LayerStats read from the file when asked for and not kept, so a caller that
    takes one layer at a time holds one layer's statistics ([E, E] co-activation and [E, H]
    prototypes: about 15 MiB per layer at E = 256, H = 7168), whatever the depth. The file's
    header was checked when it was opened (`load_stats(stream=True)`)."""

    def __init__(self, path: Path, keys: dict[str, dict[str, str]], shapes: dict[str, tuple[int, int]]):
        self.path, self._keys, self._shapes = path, keys, shapes

    def __getitem__(self, layer_id: str) -> LayerStats:
        from safetensors import safe_open

        keys = self._keys[layer_id]
        try:
            with safe_open(str(self.path), framework="numpy") as f:
                t = {name: f.get_tensor(key) for name, key in keys.items()}
        except OSError as err:
            raise StatsError(
                f"{self.path}: cannot be read any more ({err}); keep the statistics file in place while select runs"
            ) from None
        return checked_layer(self.path, layer_id, t)

    def __iter__(self):
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)

    def shapes(self) -> set[tuple[int, int]]:
        """The (E, H) of every layer, from the header."""
        return set(self._shapes.values())


# a count above this is damage, not data: no run routes 2**48 tokens through one layer, and sums of
# such counts over many files and experts stay far from int64's end (they would wrap silently)
MAX_COUNT = 1 << 48


def _bad_values(name: str, value: np.ndarray) -> str | None:
    """What is wrong with the values of one field, and the fix, or None: every field is a count or a
    sum of non-negative quantities (gate_mass, saliency_sum) except proto_sum (of hidden states)."""
    if value.dtype.kind == "f":
        bad = ~np.isfinite(value)
        if bad.any():
            where = np.argwhere(bad)[0]
            return (
                f"holds {value[tuple(where)]} at {list(map(int, where))}, not a finite number (the traced run's "
                "router saw non-finite inputs or scores, or the file is damaged); trace a run without that fault"
            )
    if name == "proto_sum":
        return None
    low = value.min(initial=0)
    if low < 0:
        return (
            f"holds {low}, a negative {'sum' if value.dtype.kind == 'f' else 'count'}; the file is damaged, trace again"
        )
    if value.dtype.kind != "f" and value.max(initial=0) > MAX_COUNT:
        return f"holds {value.max()}, a count above 2**48 that no run routes; the file is damaged, trace again"
    return None


def checked_layer(path: Path, layer_id: str, fields: dict) -> LayerStats:
    """The LayerStats of one layer's fields read from `path`; StatsError naming the file, the layer
    and the field when a value is NaN, infinite, a negative count or sum, or an impossible count.
    The trace writes what the router saw, also when a run went non-finite: such statistics cannot
    rank experts, and select and merge say so instead of reporting 0 coverage."""
    tokens = np.asarray(fields["tokens"])
    if tokens.shape != (1,):
        raise StatsError(
            f"{path}: layer {layer_id} field tokens has shape {list(tokens.shape)}, not [1]; "
            "the file is damaged, trace again"
        )
    for name, value in fields.items():
        problem = _bad_values(name, np.asarray(value))
        if problem:
            raise StatsError(f"{path}: layer {layer_id} field {name} {problem}")
    try:
        return LayerStats(
            int(tokens[0]),
            fields["freq"],
            fields["gate_mass"],
            fields["coact"],
            fields["proto_sum"],
            fields.get("saliency_sum"),
        )
    except StatsError as err:
        raise StatsError(f"{path}: layer {layer_id}: {err}") from None


def _unreadable(path: Path, err: Exception) -> StatsError:
    statistics = path.with_suffix(".safetensors")
    if path.suffix == ".json" and statistics.is_file():  # the sidecar given for the statistics
        return StatsError(f"{path}: is the statistics' JSON sidecar; pass {statistics} (--stats)")
    return StatsError(
        f"{path}: not a readable safetensors file ({err}); it may be truncated, "
        "re-run the trace or remove it from the folder"
    )


def _fields_by_layer(path: Path, items: dict) -> dict[str, dict]:
    """{tensor key: value} of a statistics file -> {layer id: {field: value}}, every required field
    present (StatsError naming the file and the key or layer otherwise)."""
    out: dict[str, dict] = {}
    for key, value in items.items():
        try:
            layer_id, name = _parse_key(key)
        except ValueError:
            raise StatsError(
                f"{path}: unexpected tensor key {key!r}; expected layer.L.<field> or mtp.K.<field>"
            ) from None
        out.setdefault(layer_id, {})[name] = value
    for layer_id, fields in out.items():
        missing = [n for n in REQUIRED_FIELDS if n not in fields]
        if missing:
            raise StatsError(
                f"{path}: layer {layer_id} lacks {', '.join(missing)}; the file is incomplete, re-run the trace"
            )
    return out


def _streamed_layers(path: Path) -> StreamedLayers:
    """The layers of a statistics file from its header alone: every field present, shapes that
    LayerStats accepts, one token count per layer (StatsError names the file otherwise)."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="numpy") as f:
            shapes = {key: tuple(f.get_slice(key).get_shape()) for key in f.keys()}
    except (SafetensorError, OSError, ValueError) as err:
        raise _unreadable(path, err) from None
    keys = _fields_by_layer(path, {key: key for key in shapes})
    sizes = {}
    for layer_id, fields in keys.items():
        proto = shapes[fields["proto_sum"]]
        e = shapes[fields["freq"]][0] if shapes[fields["freq"]] else 0
        want = {"tokens": (1,), "freq": (e,), "gate_mass": (e,), "coact": (e, e), "saliency_sum": (e,)}
        bad = [n for n, shape in want.items() if n in fields and shapes[fields[n]] != shape]
        if bad or len(proto) != 2 or proto[0] != e:
            name = bad[0] if bad else "proto_sum"
            raise StatsError(
                f"{path}: layer {layer_id} field {name} has shape {list(shapes[fields[name]])}, "
                f"which does not fit {e} experts; the file is damaged, re-run the trace"
            )
        sizes[layer_id] = (e, proto[1])
    return StreamedLayers(path, keys, sizes)


def load_stats(path: str | os.PathLike, stream: bool = False) -> RoutingStats:
    """Read one statistics file (and its sidecar); StatsError names the file on any defect.
    `stream`: read each layer only when asked for (`StreamedLayers`; the file must stay in place)."""
    from safetensors import SafetensorError
    from safetensors.numpy import load_file

    path = Path(path)
    if not path.is_file():
        raise StatsError(
            f"{path}: routing-statistics file not found; pass a file written by "
            "`mcore-proxy stats merge` or a trace rank file"
        )
    if stream:
        return _with_meta(path, _streamed_layers(path))
    try:
        raw = load_file(str(path))
    except (SafetensorError, OSError, ValueError) as err:
        raise _unreadable(path, err) from None
    layers = {layer_id: checked_layer(path, layer_id, f) for layer_id, f in _fields_by_layer(path, raw).items()}
    return _with_meta(path, layers)


def _with_meta(path: Path, layers) -> RoutingStats:
    """RoutingStats of `layers` with the sidecar beside `path` (its `topk` required)."""
    side = sidecar_path(path)
    meta = (
        read_json_object(side, "statistics sidecar", "re-run the trace or remove it", StatsError)
        if side.is_file()
        else {}
    )
    if "topk" not in meta:
        raise StatsError(
            f"{side}: sidecar missing or without 'topk'; keep the .json written beside every statistics file"
        )
    if isinstance(meta["topk"], bool) or not isinstance(meta["topk"], int):
        raise StatsError(f"{side}: 'topk' is {meta['topk']!r}, not an integer; re-run the trace or fix the sidecar")
    try:
        return RoutingStats(layers, int(meta["topk"]), meta)
    except StatsError as err:
        raise StatsError(f"{path}: {err}") from None


def merge_stats(parts: list[tuple[Path, RoutingStats]], *, allow_missing_layers: bool = False) -> RoutingStats:
    """Element-wise sum of per-rank statistics; refuse files that describe another model.

    Pipeline stages hold different layers, so the merged layers are the union. When the
    sidecars declare the model's MoE layers (`model_layers`, written by the tracer), every file
    must declare the same list and hold only those layers, and the union must cover all of them
    (a missing stage's file is an error unless `allow_missing_layers`); files without that
    declaration must all hold the same layers. Files of runs with another world size are refused.
    """
    if not parts:
        raise StatsError("no routing-statistics files to merge")
    first_path, first = parts[0]
    declared = first.meta.get("model_layers")
    layers = dict(first.layers)
    for path, s in parts[1:]:
        for what, a, b in (
            ("num_experts", first.num_experts, s.num_experts),
            ("hidden_size", first.hidden_size, s.hidden_size),
            ("topk", first.topk, s.topk),
            ("world_size", first.meta.get("world_size"), s.meta.get("world_size")),
        ):
            if a != b and not (what == "world_size" and None in (a, b)):
                raise StatsError(
                    f"{path}: {what} is {b} but {first_path} has {a}; merge only files from one model and one run"
                )
        if declared is not None or s.meta.get("model_layers") is not None:
            if s.meta.get("model_layers") != declared:
                raise StatsError(
                    f"{path}: declares MoE layers {s.meta.get('model_layers')} but "
                    f"{first_path} declares {declared}; merge only files from one model"
                )
        elif set(s.layers) != set(first.layers):
            raise StatsError(
                f"{path}: layers {s.layer_ids} differ from {first.layer_ids} in "
                f"{first_path}; merge only files from one run"
            )
        for layer_id, ls in s.layers.items():
            layers[layer_id] = layers[layer_id] + ls if layer_id in layers else ls
    if declared is not None:
        for path, s in parts:
            extra = sorted(set(s.layers) - set(declared), key=layer_sort_key)
            if extra:
                raise StatsError(
                    f"{path}: holds layers {extra} that its sidecar does not declare "
                    f"as MoE layers {declared}; the file is inconsistent, re-run the trace"
                )
        missing = sorted(set(declared) - set(layers), key=layer_sort_key)
        if missing and not allow_missing_layers:
            raise StatsError(
                f"{first_path.parent}: no file holds statistics for MoE layers "
                f"{missing}; a pipeline stage's rank files are missing: copy them in, "
                "or if those layers really route nothing pass --allow-missing-layers"
            )
    meta = {k: v for k, v in first.meta.items() if k not in ("ranks_merged", "rank", "steps")}
    meta["ranks_merged"] = sum(int(s.meta.get("ranks_merged", 1)) for _, s in parts)
    ranks = sorted(r for _, s in parts for r in s.meta.get("ranks", [s.meta.get("rank")]) if r is not None)
    if ranks:
        meta["ranks"] = ranks
    return dataclasses.replace(first, layers=layers, meta=meta)
