"""The campaign file (JSON, `"format": "mcore-proxy-campaign-config/1"`), expanded into run entries.

    {
      "format": "mcore-proxy-campaign-config/1",
      "command": ["{python}", "examples/rl_faults/grpo.py", "--ckpt", "proxy", "--out", "{run_dir}"],
      "log": "{run_dir}/metrics.jsonl",        # the metric log each run writes (read_log formats)
      "work": "campaign",                      # run folders and library.json go here
      "jobs": 2,                               # runs at once
      "env": {"OMP_NUM_THREADS": "1"},         # added to every run's environment
      "patches": true,                         # put mcore-proxy's patches/ on PYTHONPATH
      "metrics": ["reward", "logprob_diff"],   # optional: the signature's metrics (default: all known)
      "baseline": {"args": []},                # optional: extra command arguments of the baseline
      "faults": [
        {"name": "router_noise", "spec": "router_noise:std={strength}", "strengths": [0.3, 1.0],
         "schedule": "start=5", "args": []},
        {"name": "omission", "spec": "update_omission", "schedules": ["start=5", "start=5,every=2"]}
      ]
    }

Every run is an ordinary process of the user's launcher (torchrun, a MindSpeed launch script):
the fault reaches it through `MCORE_PROXY_FAULTS` only. Placeholders in `command`, `log`, `args`
and `env` values: `{run_dir}` (the run's folder, absolute), `{name}`, `{fault}`, `{strength}`, `{python}`
(this interpreter), `{config_dir}`. Relative `work` is taken from the config file's folder, and
commands run there. A fault's `schedule` (`start=`, `stop=`, `every=`, `steps=`) is added to each
fault of its spec; `schedules`, a list, makes one run per schedule and strength, named
`NAME@STRENGTH@SCHEDULE` (commas as `+`). Every spec is parsed here, so a typo fails before any
run starts.
"""

from __future__ import annotations

import hashlib
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from mcore_proxy.core.jsonfile import read_json_object
from mcore_proxy.core.errors import ProxyError

FORMAT = "mcore-proxy-campaign-config/1"
BASELINE = "baseline"
KEYS = {"format", "command", "log", "work", "jobs", "env", "patches", "metrics", "baseline", "faults"}
FAULT_KEYS = {"name", "spec", "strengths", "schedule", "schedules", "args"}
NAME = re.compile(r"^[A-Za-z0-9_.@=+-]+$")


class ConfigError(ProxyError):
    """A campaign file that cannot be used."""


@dataclass(frozen=True)
class Entry:
    """One run of the campaign: the baseline (spec "") or one fault at one strength."""

    name: str
    fault: str
    strength: str
    spec: str
    command: tuple
    log: str
    run_dir: Path
    env: tuple = ()  # (name, value) added to the run's environment

    @property
    def is_baseline(self) -> bool:
        return not self.spec

    def identity(self) -> str:
        """What makes a finished run still valid: a changed command or spec means a rerun."""
        text = json.dumps([self.spec, list(self.command), self.log])
        return hashlib.sha256(text.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class CampaignConfig:
    path: Path
    work: Path
    jobs: int
    patches: bool = True
    metrics: tuple | None = None
    entries: tuple = ()  # Entry; the baseline first

    @property
    def library(self) -> Path:
        return self.work / "library.json"

    @property
    def baseline(self) -> Entry:
        return self.entries[0]


def _fail(path: Path, what: str) -> ConfigError:
    return ConfigError(f"{path}: {what}")


def _with_schedule(spec: str, schedule: str) -> str:
    if not schedule:
        return spec
    return ";".join(f"{part}{',' if ':' in part else ':'}{schedule}" for part in spec.split(";") if part.strip())


def _fill(text: str, values: dict, path: Path) -> str:
    try:
        return str(text).format(**values)
    except (KeyError, IndexError, ValueError) as err:
        raise _fail(
            path,
            f"placeholder in {text!r} is not one of {{{'}, {'.join(values)}}} ({err}); "
            "write literal braces as {{ }}",
        ) from None


def _entry(path: Path, work: Path, raw: dict, name: str, fault: str, strength: str, spec: str, args: list) -> Entry:
    """One run; placeholders filled in its command, args, log and env values."""
    if not NAME.match(name):
        raise _fail(path, f"run name {name!r} may use only letters, digits and _.@=+-")
    run_dir = work / "runs" / name
    values = {
        "run_dir": str(run_dir),
        "name": name,
        "fault": fault,
        "strength": strength,
        "python": sys.executable,
        "config_dir": str(path.parent),
    }
    command = tuple(_fill(c, values, path) for c in [*raw["command"], *args])
    env = tuple((k, _fill(v, values, path)) for k, v in raw.get("env", {}).items())
    return Entry(name, fault, strength, spec, command, _fill(raw["log"], values, path), run_dir, env)


def _check_spec(path: Path, name: str, spec: str) -> None:
    from mcore_proxy.faults.spec import FaultSpecError, parse

    try:
        parse(spec)
    except FaultSpecError as err:
        raise _fail(path, f"fault {name!r}: {err}") from None


def parse_config(raw, path: Path) -> CampaignConfig:
    """The config dict `raw` of the file `path` -> CampaignConfig (every spec parsed)."""
    if not isinstance(raw, dict) or raw.get("format") != FORMAT:
        found = raw.get("format") if isinstance(raw, dict) else type(raw).__name__
        raise _fail(path, f'format {found!r} is not {FORMAT!r}; start the file with "format": "{FORMAT}"')
    unknown = set(raw) - KEYS
    if unknown:
        raise _fail(path, f"unknown key(s) {sorted(unknown)}; known: {sorted(KEYS)}")
    for key in ("command", "log", "faults"):
        if key not in raw:
            raise _fail(path, f'no "{key}"; a campaign needs "command" (a list), "log" and "faults"')
    if (
        not isinstance(raw["command"], list)
        or not raw["command"]
        or not all(isinstance(c, str) for c in raw["command"])
    ):
        raise _fail(
            path, '"command" must be a non-empty list of strings, e.g. ["torchrun", "train.py", "--out", "{run_dir}"]'
        )
    jobs = raw.get("jobs", 1)
    if not isinstance(jobs, int) or isinstance(jobs, bool) or jobs < 1:
        raise _fail(path, f'"jobs" must be an integer >= 1, not {jobs!r}')
    env = raw.get("env", {})
    if not isinstance(env, dict) or not all(isinstance(v, str) for v in env.values()):
        raise _fail(path, '"env" must map names to strings')
    work = raw.get("work", path.stem)
    if not isinstance(work, str) or not work.strip():
        raise _fail(path, f'"work" must name a folder (a new one, or an earlier run\'s of this campaign), not {work!r}')
    work = (path.parent / work).resolve()
    base_args = raw.get("baseline", {}).get("args", []) if isinstance(raw.get("baseline", {}), dict) else None
    if not isinstance(base_args, list):
        raise _fail(path, '"baseline" must be {"args": [...]}')
    entries = [_entry(path, work, raw, BASELINE, BASELINE, "", "", base_args)]
    if not isinstance(raw["faults"], list) or not raw["faults"]:
        raise _fail(path, '"faults" must be a non-empty list of {"name", "spec", "strengths"}')
    for i, fault in enumerate(raw["faults"]):
        if not isinstance(fault, dict) or "name" not in fault or "spec" not in fault:
            raise _fail(path, f'faults[{i}] must be an object with "name" and "spec"')
        unknown = set(fault) - FAULT_KEYS
        if unknown:
            raise _fail(path, f"faults[{i}]: unknown key(s) {sorted(unknown)}; known: {sorted(FAULT_KEYS)}")
        strengths = fault.get("strengths", [None])
        if not isinstance(strengths, list) or not strengths:
            raise _fail(path, f"faults[{i}] ({fault['name']}): \"strengths\" must be a non-empty list")
        schedules = fault.get("schedules", [None])
        if not isinstance(schedules, list) or not schedules or "schedule" in fault and "schedules" in fault:
            raise _fail(
                path,
                f"faults[{i}] ({fault['name']}): give \"schedule\" (one) or \"schedules\" (a non-empty list), not both",
            )
        for strength in strengths:
            for schedule in schedules:
                label = "" if strength is None else str(strength)
                spec = _with_schedule(
                    str(fault["spec"]).replace("{strength}", label),
                    fault.get("schedule", "") if schedule is None else str(schedule),
                )
                name = "@".join(
                    [
                        str(fault["name"]),
                        *([label] if label else []),
                        *([str(schedule).replace(",", "+")] if schedule is not None else []),
                    ]
                )
                _check_spec(path, name, spec)
                entries.append(_entry(path, work, raw, name, str(fault["name"]), label, spec, fault.get("args", [])))
    names = [e.name for e in entries]
    duplicated = sorted({n for n in names if names.count(n) > 1})
    if duplicated:
        raise _fail(path, f"run names {duplicated} occur twice; give the faults distinct names or strengths")
    metrics = raw.get("metrics")
    return CampaignConfig(
        path, work, jobs, bool(raw.get("patches", True)), tuple(metrics) if metrics else None, tuple(entries)
    )


def load_config(path) -> CampaignConfig:
    path = Path(path).resolve()
    raw = read_json_object(
        path, "campaign file", "fix it or write a new one (see `mcore-proxy campaign --help`)", ConfigError
    )
    return parse_config(raw, path)
