"""`config.json` of a Hugging Face checkpoint: read as data (never as code), with typed access.

Every value comes from whoever made the file, so each access checks the type and names the file
and the key in its message. Nothing in the folder is imported or executed: `auto_map` and
`trust_remote_code` model code are never loaded.
"""

from __future__ import annotations

import json
import numbers
from dataclasses import dataclass
from pathlib import Path

from mcore_proxy.core.jsonfile import read_json_object
from mcore_proxy.core.errors import CheckpointError
from mcore_proxy.mcore.spec import MAX_SIZE

CONFIG = "config.json"
MAX_CONFIG_BYTES = 16 << 20  # a real config.json is a few KiB; refuse a file that is not one
_MISSING = object()


def read_json(path: Path, what: str, limit: int = MAX_CONFIG_BYTES) -> dict:
    """A JSON object from `path`; CheckpointError naming the file otherwise."""
    return read_json_object(
        path,
        what,
        "copy it again from the model's source",
        CheckpointError,
        missing_fix="copy it from the model's source",
        limit=limit,
    )


# per-layer lists a config.json may hold instead of num_hidden_layers (`HFConfig.layer_count`)
LAYER_LISTS = ("layers_block_type",)


@dataclass(frozen=True)
class HFConfig:
    """The parsed `config.json` (`data`) and where it came from (`path`, for messages)."""

    data: dict
    path: Path

    @classmethod
    def load(cls, folder: Path) -> "HFConfig":
        return cls(read_json(Path(folder) / CONFIG, CONFIG), Path(folder) / CONFIG)

    def has(self, key: str) -> bool:
        return self.data.get(key) is not None

    def layer_count(self) -> int:
        """The decoder layers: `num_hidden_layers`, else the length of a per-layer list that
        transformers derives the count from (NemotronH's `layers_block_type`, saved instead)."""
        listed = next((k for k in LAYER_LISTS if self.has(k)), None)
        if self.has("num_hidden_layers") or listed is None:
            return self.int("num_hidden_layers", minimum=1)
        value = self.data[listed]
        if not isinstance(value, list) or not value:
            raise CheckpointError(f"{self.path}: {listed} is {value!r}, expected one entry per layer; fix config.json")
        return len(value)

    def _value(self, key: str, default):
        value = self.data.get(key, _MISSING)
        if value is _MISSING or value is None:
            if default is _MISSING:
                raise CheckpointError(
                    f"{self.path}: lacks {key!r}, which the model needs; add it (the model's source config.json has it)"
                )
            return default
        return value

    def int(self, key: str, default=_MISSING, minimum: int = 0) -> int:
        """A size or count (`config_int`); `default` when the key is absent or null."""
        value = self._value(key, default)
        if value is default and default is not _MISSING:
            return value
        return config_int(value, key, self.path, minimum)

    def float(self, key: str, default=_MISSING) -> float:
        value = self._value(key, default)
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise CheckpointError(f"{self.path}: {key} is {value!r}, expected a number; fix config.json")
        return float(value)

    def bool(self, key: str, default=_MISSING) -> bool:
        value = self._value(key, default)
        if not isinstance(value, bool):
            raise CheckpointError(f"{self.path}: {key} is {value!r}, expected true or false; fix config.json")
        return value

    def str(self, key: str, default=_MISSING) -> str:
        value = self._value(key, default)
        if not isinstance(value, str):
            raise CheckpointError(f"{self.path}: {key} is {value!r}, expected a string; fix config.json")
        return value

    def list(self, key: str, default=_MISSING) -> list:
        value = self._value(key, default)
        if not isinstance(value, list):
            raise CheckpointError(f"{self.path}: {key} is {value!r}, expected a list; fix config.json")
        return value

    def dict(self, key: str, default=_MISSING) -> dict:
        value = self._value(key, default)
        if not isinstance(value, dict):
            raise CheckpointError(f"{self.path}: {key} is {value!r}, expected an object; fix config.json")
        return value

    def first_int(self, *keys: str, default=_MISSING) -> int:
        """The first of several spellings present (transformers' `attribute_map` aliases)."""
        for key in keys:
            if self.has(key):
                return self.int(key)
        if default is _MISSING:
            raise CheckpointError(
                f"{self.path}: lacks {' / '.join(keys)}, which the model needs; add it (the "
                "model's source config.json has it)"
            )
        return default

    def architecture(self) -> str:
        archs = self.data.get("architectures")
        if isinstance(archs, list) and len(archs) == 1 and isinstance(archs[0], str):
            return archs[0]
        return ""

    def rope(self) -> dict:
        """RoPE parameters: transformers 5 writes `rope_parameters`, older configs `rope_theta` and
        `rope_scaling`; returned as one dict with at least `rope_type` and `rope_theta`."""
        params = dict(self.dict("rope_parameters", {}))
        if not params:
            params = dict(self.dict("rope_scaling", {}))
            if self.has("rope_theta"):
                params["rope_theta"] = self.float("rope_theta")
        params.setdefault("rope_type", params.pop("type", "default"))
        params.setdefault("rope_theta", 10000.0)
        return params


def config_int(value, key: str, source, minimum: int = 0) -> int:
    """A size or count of a config.json (`hidden_size`, `num_experts`, ...): a JSON integer in
    minimum..MAX_SIZE. CheckpointError naming `source` and the key for a non-integer (1.5, 1e308,
    "256", true: transformers builds no layer of such a width) or an integer out of range."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise CheckpointError(
            f"{source}: {key} is {_as_json(value)}, not an integer; a size or count in a config.json is a "
            "whole number such as 4096"
        )
    if not minimum <= value <= MAX_SIZE:
        shown = value if len(str(abs(value))) <= 16 else f"a {len(str(abs(value)))}-digit number"
        raise CheckpointError(
            f"{source}: {key} is {shown}, outside {minimum}..{MAX_SIZE}, which no model's size is; fix the config"
        )
    return int(value)


def _as_json(value) -> str:
    """A config value as the file spells it (true, 1e+308, NaN, "256"), cut at 40 characters."""
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):  # not from a JSON file (a preset or a caller's dict)
        text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."
