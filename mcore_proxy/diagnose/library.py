"""The signature library of a fault-injection campaign: one JSON file, versioned
(`mcore-proxy-library/1`), written by `mcore-proxy campaign` and read by triage.

    {"format": "mcore-proxy-library/1", "campaign": CONFIG, "baseline": {"name", "log"},
     "entries": [{"name": "router_noise@1.0", "fault": "router_noise", "strength": "1.0",
                  "spec": "router_noise:std=1.0", "log": LOG, "signature": {mcore-proxy-signature/1}}]}

Each entry's signature is its run against the campaign's baseline run (`pair_signature`); the
logs stay where the campaign wrote them, so a library can be rebuilt from them with another
metric set. An entry's *earliest warning* is the shifted metric with the first onset (ties: the
larger effect), the metric to watch for that fault.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from mcore_proxy.core.jsonfile import read_json_object
from mcore_proxy.diagnose.signature import FaultSignature, MetricSignature
from mcore_proxy.core.errors import ProxyError

FORMAT = "mcore-proxy-library/1"


class LibraryError(ProxyError):
    """A signature library that is missing, unreadable or of another format."""


def earliest_warning(signature: FaultSignature) -> MetricSignature | None:
    """The shifted metric whose shift begins first (ties: the larger |effect|); None if none shifted."""
    shifted = [m for m in signature.metrics.values() if m.shifted and m.onset is not None]
    if not shifted:
        return None
    return min(shifted, key=lambda m: (m.onset, -abs(m.effect or 0.0)))


@dataclass(frozen=True)
class LibraryEntry:
    name: str  # unique in the library, e.g. "router_noise@1.0"
    fault: str  # the fault family the entry is a strength of, e.g. "router_noise"
    strength: str
    spec: str  # the MCORE_PROXY_FAULTS text the run had
    log: str  # the run's metric log
    signature: FaultSignature = field(repr=False)

    @property
    def informative(self) -> bool:
        """Whether the run departed from the baseline in any metric (else it cannot be matched)."""
        return any(m.shifted for m in self.signature.metrics.values())

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "fault": self.fault,
            "strength": self.strength,
            "spec": self.spec,
            "log": self.log,
            "signature": self.signature.to_dict(),
        }

    @classmethod
    def from_dict(cls, data: dict) -> "LibraryEntry":
        return cls(
            data["name"],
            data["fault"],
            str(data["strength"]),
            data["spec"],
            data["log"],
            FaultSignature.from_dict(data["signature"]),
        )


@dataclass(frozen=True)
class Library:
    baseline_name: str
    baseline_log: str
    entries: tuple = ()  # LibraryEntry, in campaign order
    campaign: str = ""  # the campaign config that built it

    def to_dict(self) -> dict:
        return {
            "format": FORMAT,
            "campaign": self.campaign,
            "baseline": {"name": self.baseline_name, "log": self.baseline_log},
            "entries": [e.to_dict() for e in self.entries],
        }

    @classmethod
    def from_dict(cls, data: dict) -> "Library":
        return cls(
            data["baseline"]["name"],
            data["baseline"]["log"],
            tuple(LibraryEntry.from_dict(e) for e in data["entries"]),
            data.get("campaign", ""),
        )

    def save(self, path) -> Path:
        """Write atomically (a reader never sees half a library)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
        tmp.write_text(json.dumps(self.to_dict(), indent=1))
        os.replace(tmp, path)
        return path


def load_library(path) -> Library:
    path = Path(path)
    data = read_json_object(
        path,
        "signature library",
        "rebuild it with `mcore-proxy campaign CONFIG`",
        LibraryError,
        missing_fix="build one with `mcore-proxy campaign CONFIG` (it writes "
        "library.json in the campaign's work folder)",
    )
    if data.get("format") != FORMAT:
        found = data.get("format")
        raise LibraryError(
            f"{path}: format {found!r} is not {FORMAT!r}; pass the library.json that `mcore-proxy campaign` wrote"
        )
    try:
        return Library.from_dict(data)
    except (KeyError, TypeError, ValueError) as err:
        raise LibraryError(
            f"{path}: incomplete signature library ({type(err).__name__}: {err}); "
            "rebuild it with `mcore-proxy campaign CONFIG`"
        ) from None
