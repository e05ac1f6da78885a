"""Facts and decisions for tools/install.sh, printed as `key=value` lines (standard library only).

    python tools/install_plan.py [--torch-version 2.13.0]

Run by the interpreter that will be installed into. It reports that interpreter (version,
virtual environment or not, PEP 668 "externally managed" or not), whether `import torch` works
in it, and where a torch it lacks should come from. It asks no network:

  keep    `import torch` works (an Ascend torch_npu stack, a CUDA build, a CPU build): leave it.
  wheel   pip is configured with a local find-links folder or file:// index holding a CPU build
          of torch==VERSION for this interpreter: install that file.
  index   Linux without such a wheel: PyTorch's CPU wheel index (MCORE_PROXY_TORCH_INDEX,
          default https://download.pytorch.org/whl/cpu). PyPI's default Linux wheel depends on
          the nvidia-* CUDA packages, about 2.7 GB of downloads.
  pypi    macOS and Windows (PyPI's builds there carry no CUDA libraries), or
          MCORE_PROXY_TORCH_INDEX=pip: pip's own configured index.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path
from urllib.parse import unquote, urlparse

CPU_INDEX = "https://download.pytorch.org/whl/cpu"
MIN_PYTHON = (3, 10)
_WHEEL = re.compile(r"^torch-(?P<version>[^-]+)-(?P<py>[^-]+)-(?P<abi>[^-]+)-(?P<plat>[^-]+)\.whl$")


def parse_pip_config(text: str) -> tuple[list[str], list[str]]:
    """`pip config list` output -> (find-links entries, index URLs), in the order listed.

    Lines look like `global.find-links='/opt/wheels'` or `:env:.extra-index-url='a b'`; a value
    may hold several whitespace-separated entries."""
    links, indexes = [], []
    for line in text.splitlines():
        key, sep, value = line.partition("=")
        if not sep:
            continue
        entries = value.strip().strip("'\"").split()
        if key.endswith(".find-links"):
            links += entries
        elif key.endswith(".index-url") or key.endswith(".extra-index-url"):
            indexes += entries
    return links, indexes


def local_dir(entry: str) -> Path | None:
    """A find-links/index entry as a local folder (plain path or file:// URL), else None."""
    scheme = urlparse(entry).scheme
    if scheme == "file":
        path = Path(unquote(urlparse(entry).path))
    elif scheme == "" or len(scheme) == 1:  # a plain path (len 1: a Windows drive letter)
        path = Path(entry)
    else:
        return None
    return path if path.is_dir() else None


def wheel_folders(links: list[str], indexes: list[str]) -> list[Path]:
    """Local folders that may hold torch wheels: find-links folders and `<index>/torch/`."""
    out = [d for d in map(local_dir, links) if d]
    out += [d / "torch" for d in map(local_dir, indexes) if d and (d / "torch").is_dir()]
    return out


def _requires_cuda(wheel: Path) -> bool:
    """True when the wheel's METADATA requires nvidia-* packages (the CUDA build)."""
    try:
        with zipfile.ZipFile(wheel) as zf:
            meta = next((n for n in zf.namelist() if n.endswith(".dist-info/METADATA")), None)
            text = zf.read(meta).decode("utf-8", "replace") if meta else ""
    except (OSError, zipfile.BadZipFile):
        return True  # unreadable: do not trust it
    return any(line.lower().startswith("requires-dist: nvidia-") for line in text.splitlines())


def is_cpu_wheel(wheel: Path, version: str, supported_tags: set[str]) -> bool:
    """A torch wheel of `version` for these interpreter tags that carries no CUDA."""
    m = _WHEEL.match(wheel.name)
    if not m:
        return False
    public, _, local = m["version"].partition("+")
    if public != version:
        return False
    tags = {
        f"{py}-{abi}-{plat}"
        for py in m["py"].split(".")
        for abi in m["abi"].split(".")
        for plat in m["plat"].split(".")
    }
    if not tags & supported_tags:
        return False
    if local:
        return local.startswith("cpu")
    return not _requires_cuda(wheel)


def find_local_cpu_wheel(folders: list[Path], version: str, supported_tags: set[str]) -> Path | None:
    for folder in folders:
        for wheel in sorted(folder.glob("torch-*.whl")):
            if is_cpu_wheel(wheel, version, supported_tags):
                return wheel
    return None


def choose_torch(
    torch_importable: bool, platform: str, local_wheel: Path | None, index_override: str | None
) -> tuple[str, str]:
    """(action, source): keep / wheel PATH / index URL / pypi (see the module docstring)."""
    if torch_importable:
        return "keep", ""
    if local_wheel is not None:
        return "wheel", str(local_wheel)
    if index_override == "pip":
        return "pypi", ""
    if index_override:
        return "index", index_override
    if platform.startswith("linux"):
        return "index", CPU_INDEX
    return "pypi", ""


def supported_tags() -> set[str]:
    """This interpreter's wheel tags (pip's vendored `packaging`; pip is in every venv)."""
    try:
        from pip._vendor.packaging.tags import sys_tags
    except ImportError:  # no pip: nothing can be installed, install.sh reports that
        return set()
    return {str(t) for t in sys_tags()}


def pip_config() -> tuple[list[str], list[str]]:
    try:
        out = subprocess.run(
            [sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True, timeout=60
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        out = ""
    return parse_pip_config(out)


def probe_torch() -> tuple[str, str, str]:
    """(version, file, error) of `import torch` in a child process (a broken CUDA stack may crash)."""
    code = "import torch; print(torch.__version__); print(torch.__file__)"
    try:
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired:
        return "", "", "import torch did not finish in 300 s"
    if r.returncode == 0:
        version, file = (r.stdout.strip().splitlines() + ["", ""])[:2]
        return version, file, ""
    lines = (r.stderr or r.stdout).strip().splitlines()
    return "", "", lines[-1] if lines else f"exit code {r.returncode}"


def externally_managed() -> bool:
    """PEP 668: pip refuses to install into this interpreter outside a virtual environment."""
    if sys.prefix != sys.base_prefix:
        return False
    return (Path(sysconfig.get_path("stdlib")) / "EXTERNALLY-MANAGED").is_file()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--torch-version", default="2.13.0")
    a = ap.parse_args(argv)
    version, file, error = probe_torch()
    folders = wheel_folders(*pip_config()) if not version else []
    wheel = find_local_cpu_wheel(folders, a.torch_version, supported_tags()) if folders else None
    action, source = choose_torch(bool(version), sys.platform, wheel, os.environ.get("MCORE_PROXY_TORCH_INDEX") or None)
    facts = {
        "python": sys.executable,
        "version": ".".join(map(str, sys.version_info[:3])),
        "supported": int(sys.version_info[:2] >= MIN_PYTHON),
        "venv": int(sys.prefix != sys.base_prefix),
        "externally_managed": int(externally_managed()),
        "torch": version,
        "torch_file": file,
        "torch_error": error,
        "torch_action": action,
        "torch_source": source,
    }
    for key, value in facts.items():
        print(f"{key}={value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
