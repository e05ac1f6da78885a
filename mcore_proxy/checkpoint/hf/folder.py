"""A Hugging Face checkpoint folder as files: which shard holds which tensor (the index, or the
one model.safetensors) and every tensor's shape and dtype from the shards' headers, with no
tensor data read. Both readers (`native`, `reader`) stand on it."""

from __future__ import annotations

import fnmatch
import re
from pathlib import Path

from mcore_proxy.checkpoint.hf.config import read_json
from mcore_proxy.checkpoint.hf.safetensors_io import TensorInfo, read_header
from mcore_proxy.core.errors import CheckpointError

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
PICKLED = ("pytorch_model*.bin", "*.pt", "*.pth", "*.ckpt", "*.pkl")
_SHARD_NAME = re.compile(r"^[\w.-]+\.safetensors$")


def is_hf_checkpoint(path) -> bool:
    """A folder with config.json and weights (safetensors, or pickles that opening refuses)."""
    path = Path(path)
    if not (path / "config.json").is_file():
        return False
    names = [p.name for p in path.iterdir() if p.is_file()]
    return any(n.endswith(".safetensors") or n == INDEX or any(fnmatch.fnmatch(n, p) for p in PICKLED) for n in names)


def weight_map(folder: Path) -> dict[str, str]:
    """HF key -> shard file name, from the index (or the one model.safetensors)."""
    index = folder / INDEX
    if index.is_file():
        doc = read_json(index, INDEX, limit=256 << 20)
        wmap = doc.get("weight_map")
        if (
            not isinstance(wmap, dict)
            or not wmap
            or not all(isinstance(k, str) and isinstance(v, str) for k, v in wmap.items())
        ):
            raise CheckpointError(
                f"{index}: has no weight_map of tensor names to shard files; copy it again from the model's source"
            )
        for name in set(wmap.values()):
            if not _SHARD_NAME.match(name):
                raise CheckpointError(
                    f"{index}: shard {name!r} is not a plain *.safetensors file name in the "
                    "checkpoint folder; the index is damaged or hostile, copy it again"
                )
            if not (folder / name).is_file():
                raise CheckpointError(
                    f"{folder / name}: shard named in {INDEX} is missing; copy it from the model's source"
                )
        return dict(wmap)
    single = folder / SINGLE
    if single.is_file():
        return {key: SINGLE for key in read_header(single)}
    pickled = sorted(p.name for p in folder.iterdir() if any(fnmatch.fnmatch(p.name, pat) for pat in PICKLED))
    if pickled:
        raise CheckpointError(
            f"{folder / pickled[0]}: pickle-based weights, which mcore-proxy never loads (unpickling "
            "can run code); save the model as safetensors (save_pretrained with "
            "safe_serialization) in a trusted environment first"
        )
    shards = sorted(p.name for p in folder.glob("*.safetensors"))
    raise CheckpointError(
        f"{folder}: no {INDEX} and no {SINGLE}"
        + (
            f" beside {len(shards)} shards; copy the index from the model's source"
            if shards
            else "; copy the weights from the model's source"
        )
    )


def read_headers(folder: Path, wmap: dict[str, str]) -> dict[str, TensorInfo]:
    """Shape and dtype of every tensor the index lists, from the shards' headers (no tensor data);
    a shard that disagrees with the index is one sentence naming it."""
    infos: dict[str, TensorInfo] = {}
    for file in sorted(set(wmap.values())):
        header = read_header(folder / file)
        listed = {k for k, f in wmap.items() if f == file}
        absent, unlisted = sorted(listed - set(header)), sorted(set(header) - listed)
        if absent or unlisted:
            what = f"lacks {absent[0]}" if absent else f"holds {unlisted[0]}, which"
            raise CheckpointError(
                f"{folder / file}: {what} {INDEX} {'lists in it' if absent else 'does not list'}; "
                "the index and the shards are from different copies, copy both again"
            )
        infos.update({k: header[k] for k in listed})
    return infos
