"""Running a campaign: every entry's command as its own process, `jobs` at a time, resumable.

- A run writes into `work/runs/NAME/`; `run.json` is written there last, when the process exited
  0: it marks the run finished (with the identity of its command and spec, its exit status and
  duration). A folder without it is a partial run: removed and run again. A finished run whose
  command or spec has changed since is run again too.
- The run's console output goes to `console.log` in its folder; the fault reaches it through
  `MCORE_PROXY_FAULTS` (and `MCORE_PROXY_FAULTS_REPORT=run_dir/faults.json`), with the installed
  package's activation folder (`mcore-proxy patches`, the same file as a checkout's `patches/`) on
  `PYTHONPATH` unless the config says `"patches": false`.
- Each run is started in its own process group (so a terminal's Ctrl-C reaches the campaign, not
  the runs) and is sent SIGTERM if the campaign itself dies (PR_SET_PDEATHSIG). On SIGINT, SIGTERM
  or SIGHUP the campaign sends SIGTERM to every running group (SIGKILL after `GRACE` seconds),
  removes their partial folders and re-raises; started again, it runs only what is not finished.
- The work folder is new, empty, or a campaign's (its marker `campaign.json`); anything else is
  refused. A lock (`work/.lock`, flock, removed when the campaign ends) keeps a second campaign off it.
- After each finished run (once the baseline has finished) the library is rebuilt from every
  finished run's log and written atomically: it is complete for the runs it lists at any moment.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from mcore_proxy.campaign.config import CampaignConfig, ConfigError, Entry
from mcore_proxy.diagnose.library import Library, LibraryEntry

log = logging.getLogger(__name__)

DONE = "run.json"
CONSOLE = "console.log"
GRACE = 20.0
POLL = 0.5


@dataclass(frozen=True)
class RunOutcome:
    entry: Entry
    status: str  # "done" (this time), "finished earlier", "failed"
    seconds: float
    returncode: int = 0


@dataclass(frozen=True)
class CampaignResult:
    config: CampaignConfig
    outcomes: tuple = ()  # RunOutcome, in entry order
    library: Library | None = field(default=None, repr=False)

    @property
    def failed(self) -> list:
        return [o for o in self.outcomes if o.status == "failed"]


def patches_dir() -> Path | None:
    """The activation folder of this mcore-proxy (fault activation at interpreter start): the
    package's `_patches/`, installed with it (`mcore-proxy patches`); None if the install lacks it."""
    from mcore_proxy import activation

    folder = Path(activation.patches_dir())
    return folder if (folder / activation.SITECUSTOMIZE).is_file() else None


def run_env(config: CampaignConfig, entry: Entry, base: dict | None = None) -> dict:
    env = {k: v for k, v in (os.environ if base is None else base).items() if not k.startswith("MCORE_PROXY_FAULTS")}
    env.update(entry.env)
    if config.patches:
        patches = patches_dir()
        if patches is None:
            raise ConfigError(
                f"{config.path}: \"patches\": true, but this mcore-proxy install lacks its "
                "activation folder (mcore_proxy/activation/_patches); reinstall mcore-proxy, or put a "
                'checkout\'s patches/ on PYTHONPATH yourself (in "env") and set "patches": false'
            )
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(patches), env.get("PYTHONPATH")]))
    if not entry.is_baseline:
        env["MCORE_PROXY_FAULTS"] = entry.spec
        env["MCORE_PROXY_FAULTS_REPORT"] = str(entry.run_dir / "faults.json")
    return env


def finished(entry: Entry) -> dict | None:
    """The run's record if it finished with the entry's current command and spec."""
    try:
        record = json.loads((entry.run_dir / DONE).read_text())
    except (OSError, ValueError):
        return None
    return record if record.get("identity") == entry.identity() and record.get("returncode") == 0 else None


def _start(config: CampaignConfig, entry: Entry) -> tuple[subprocess.Popen, float]:
    from mcore_proxy.runtime.interrupts import die_with_parent

    shutil.rmtree(entry.run_dir, ignore_errors=True)
    entry.run_dir.mkdir(parents=True)
    env = run_env(config, entry)
    with open(entry.run_dir / CONSOLE, "wb") as console:
        proc = subprocess.Popen(
            list(entry.command),
            cwd=config.path.parent,
            env=env,
            stdout=console,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=lambda: die_with_parent(signal.SIGTERM),
        )
    log.info("started %s (pid %d): %s", entry.name, proc.pid, entry.spec or "no fault")
    return proc, time.time()


def _stop(running: dict) -> None:
    """SIGTERM every running process group, SIGKILL what is left after GRACE seconds, and remove
    the partial folders."""
    for proc, _ in running.values():
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
    deadline = time.time() + GRACE
    for entry, (proc, _) in running.items():
        try:
            proc.wait(max(0.0, deadline - time.time()))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        shutil.rmtree(entry.run_dir, ignore_errors=True)
        log.info("stopped %s; its partial folder removed", entry.name)


def build_library(config: CampaignConfig) -> Library | None:
    """The library of every finished run (None before the baseline finished); written atomically,
    with stop signals held until it is written (no temporary file left behind by a SIGINT)."""
    from mcore_proxy.runtime.interrupts import deferred

    with deferred():
        return _build_library(config)


def _build_library(config: CampaignConfig) -> Library | None:
    from mcore_proxy.diagnose.compare import pair_signature
    from mcore_proxy.diagnose.readers import read_log

    baseline = config.baseline
    if finished(baseline) is None:
        return None
    base_log = read_log(baseline.log)
    entries = []
    for entry in config.entries[1:]:
        if finished(entry) is None:
            continue
        signature, left_out = pair_signature(base_log, read_log(entry.log), config.metrics, label=entry.spec)
        for note in left_out:
            log.info("%s: %s", entry.name, note)
        entries.append(LibraryEntry(entry.name, entry.fault, entry.strength, entry.spec, entry.log, signature))
    library = Library(baseline.name, baseline.log, tuple(entries), str(config.path))
    library.save(config.library)
    return library


# the marker of a campaign's work folder: a folder is used only when it is new, empty, or has it
WORK_MARKER = "campaign.json"
WORK_FORMAT = "mcore-proxy-campaign-work/1"
# what an earlier version's campaign left in its work folder, before the marker existed
_OWN_NAMES = {"runs", "library.json", ".lock", WORK_MARKER}


def check_work_folder(config: CampaignConfig) -> None:
    """`config.work` may become the campaign's: a new folder (made, one level), an empty one, or one
    that holds a campaign already; any other folder (a checkpoint, `/`, a home folder) is refused,
    and so is a folder inside a checkpoint. Writes nothing (`campaign --dry-run` runs it too)."""
    from mcore_proxy.core.output import check_folder, check_not_in_checkpoint, has_marker

    work = config.work
    if work.is_dir() and not has_marker(work, WORK_MARKER, WORK_FORMAT):
        others = sorted(p.name for p in work.iterdir() if p.name not in _OWN_NAMES)
        if others:
            raise ConfigError(
                f'{config.path}: "work" is {work}, which holds other files ({others[0]}, ...) and no '
                f"{WORK_MARKER} of a campaign; give a new folder, or the work folder of an earlier run of this campaign"
            )
    check_folder(work, create=True)
    check_not_in_checkpoint(work)


def claim_work_folder(config: CampaignConfig) -> None:
    """Check the work folder, make it, and mark it as this campaign's."""
    from mcore_proxy.core.output import write_synced

    check_work_folder(config)
    config.work.mkdir(exist_ok=True)
    if not (config.work / WORK_MARKER).is_file():
        marker = {"format": WORK_FORMAT, "config": str(config.path)}
        write_synced(config.work / WORK_MARKER, json.dumps(marker, indent=1).encode())


@contextlib.contextmanager
def _locked(config: CampaignConfig):
    """The work folder, claimed and locked for the block (`work/.lock`, removed after)."""
    from mcore_proxy.core.output import held_lock

    claim_work_folder(config)
    with held_lock(config.work / ".lock", f"{config.work}: another campaign is running on this work folder"):
        yield


def _finish(entry: Entry, proc: subprocess.Popen, t0: float) -> RunOutcome:
    seconds = time.time() - t0
    if proc.returncode != 0:
        log.warning("%s failed (exit %d); see %s", entry.name, proc.returncode, entry.run_dir / CONSOLE)
        return RunOutcome(entry, "failed", seconds, proc.returncode)
    if not Path(entry.log).exists():
        log.warning("%s exited 0 but wrote no log %s; see %s", entry.name, entry.log, entry.run_dir / CONSOLE)
        return RunOutcome(entry, "failed", seconds, 0)
    record = {
        "name": entry.name,
        "fault": entry.fault,
        "strength": entry.strength,
        "spec": entry.spec,
        "command": list(entry.command),
        "log": entry.log,
        "identity": entry.identity(),
        "returncode": 0,
        "seconds": seconds,
        "finished": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    tmp = entry.run_dir / f".{DONE}.tmp"
    tmp.write_text(json.dumps(record, indent=1))
    os.replace(tmp, entry.run_dir / DONE)
    return RunOutcome(entry, "done", seconds)


def run_campaign(config: CampaignConfig, progress: bool = True) -> CampaignResult:
    """Run every unfinished entry (baseline first), `config.jobs` at a time; see the module docstring."""
    from tqdm import tqdm

    outcomes: dict[str, RunOutcome] = {}
    with _locked(config):
        queue = []
        for entry in config.entries:
            record = finished(entry)
            if record is not None:
                outcomes[entry.name] = RunOutcome(entry, "finished earlier", record["seconds"])
            else:
                queue.append(entry)
        if outcomes:
            log.info("resuming: %d of %d runs finished earlier", len(outcomes), len(config.entries))
        build_library(config)
        running: dict[Entry, tuple] = {}
        bar = tqdm(total=len(config.entries), initial=len(outcomes), desc="campaign", unit="run", disable=not progress)
        try:
            while queue or running:
                while queue and len(running) < config.jobs:
                    entry = queue.pop(0)
                    running[entry] = _start(config, entry)
                names = ", ".join(e.name for e in running)
                if names != bar.postfix:  # redraw on change only: a log file gets few lines
                    bar.set_postfix_str(names)
                time.sleep(POLL)
                for entry, (proc, t0) in list(running.items()):
                    if proc.poll() is None:
                        continue
                    del running[entry]
                    outcomes[entry.name] = _finish(entry, proc, t0)
                    bar.update()
                    if outcomes[entry.name].status == "done":
                        build_library(config)
        finally:
            for entry, (proc, t0) in list(running.items()):  # finished before the signal: keep it
                if proc.poll() == 0:
                    del running[entry]
                    outcomes[entry.name] = _finish(entry, proc, t0)
            if running:
                _stop(running)
            bar.close()
        library = build_library(config)
    order = {e.name: i for i, e in enumerate(config.entries)}
    return CampaignResult(config, tuple(sorted(outcomes.values(), key=lambda o: order[o.entry.name])), library)
