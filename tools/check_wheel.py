"""Build mcore-proxy's wheel from a clean copy of the source tree and check what it holds.

    python tools/check_wheel.py [--out DIR] [--keep]      build, check, print a summary (exit 1 on a problem)

The copy leaves out what is not source (.git, virtual environments, build/, *.egg-info, caches),
so a stale build/lib of an in-tree build cannot slip into the wheel, and the checkout is left as
it was. `pip wheel --no-deps --no-build-isolation` builds with this interpreter's setuptools
(nothing downloaded). Checked:

- every module of the source package is in the wheel (a folder without __init__.py would be
  silently left out by find_packages), and the activation folder `mcore_proxy/activation/_patches/` with its
  `sitecustomize.py`, byte for byte the file a checkout's `patches/sitecustomize.py` links to;
- nothing but `mcore_proxy/` and its dist-info: no tests/, bench/, patches/, examples/, docs/,
  tools/, and no __pycache__;
- the console script `mcore-proxy`, and every extra `mcore_proxy.core.optional` names in its
  sentences is declared with that package in the metadata.

`tests/tools/test_wheel.py` uses `build_wheel` and `check_wheel` and installs the result.
"""

from __future__ import annotations

import argparse
import email.parser
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGE = "mcore_proxy"
ACTIVATION = f"{PACKAGE}/activation/_patches/sitecustomize.py"
# .gitignore's entries: at the top of the tree, and anywhere
NOT_SOURCE_TOP = (".git", ".venv*", "build", "dist", "*.egg-info", "out*", ".ruff_cache", ".pytest_cache")
NOT_SOURCE = ("__pycache__", "*.pyc")
FORBIDDEN_TOP = ("tests", "bench", "patches", "examples", "docs", "tools", ".ci")


def source_copy(repo: Path, dest: Path) -> Path:
    """The source tree without build products and environments (symbolic links kept as links)."""
    anywhere, top = shutil.ignore_patterns(*NOT_SOURCE), shutil.ignore_patterns(*NOT_SOURCE_TOP)

    def ignore(folder, names):
        return anywhere(folder, names) | (top(folder, names) if Path(folder) == repo else set())

    shutil.copytree(repo, dest, symlinks=True, ignore=ignore)
    return dest


def build_wheel(out: Path, repo: Path = REPO, python: str = sys.executable) -> Path:
    """Build the wheel of `repo` (through a clean copy) into `out`; returns its path."""
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="mcore-proxy-src-") as tmp:
        src = source_copy(repo, Path(tmp) / "src")
        proc = subprocess.run(
            [python, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(src)],
            check=False,
            capture_output=True,
            text=True,
        )
        if proc.returncode != 0:
            raise RuntimeError(
                f"pip wheel failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}"
            )
    wheels = sorted(out.glob("mcore_proxy-*.whl"), key=lambda p: p.stat().st_mtime)
    if not wheels:
        raise RuntimeError(f"pip wheel wrote no mcore_proxy-*.whl into {out}")
    return wheels[-1]


def _extras(metadata: str) -> dict[str, set[str]]:
    """extra -> the distribution names it requires, from METADATA's Requires-Dist lines."""
    out: dict[str, set[str]] = {}
    for line in email.parser.Parser().parsestr(metadata).get_all("Requires-Dist") or ():
        requirement, _, marker = line.partition(";")
        extra = re.search(r"extra\s*==\s*['\"]([^'\"]+)['\"]", marker)
        name = re.split(r"[\s<>=!~\[(]", requirement.strip(), maxsplit=1)[0].lower()
        out.setdefault(extra.group(1) if extra else "", set()).add(name)
    return out


def check_wheel(wheel: Path, repo: Path = REPO) -> dict:
    """The wheel's summary; AssertionError listing every problem found."""
    sys.path.insert(0, str(repo))
    try:
        from mcore_proxy.core.optional import PACKAGES
    finally:
        sys.path.remove(str(repo))
    problems = []
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        dist_info = next((n.split("/")[0] for n in names if n.split("/")[0].endswith(".dist-info")), None)
        if dist_info is None:
            raise AssertionError(f"{wheel}: no .dist-info")
        metadata = zf.read(f"{dist_info}/METADATA").decode()
        entry_points = (
            zf.read(f"{dist_info}/entry_points.txt").decode() if f"{dist_info}/entry_points.txt" in names else ""
        )
        activation = zf.read(ACTIVATION) if ACTIVATION in names else None
    top = sorted({n.split("/")[0] for n in names})
    modules = sorted(
        str(p.relative_to(repo).as_posix()) for p in (repo / PACKAGE).rglob("*.py") if "__pycache__" not in p.parts
    )
    problems += [f"{m} is not in the wheel" for m in modules if m not in names]
    problems += [f"unexpected top-level entry {t}/" for t in top if t not in (PACKAGE, dist_info)]
    problems += [f"{t}/ is in the wheel" for t in FORBIDDEN_TOP if t in top]
    problems += [f"{n} is in the wheel" for n in names if "__pycache__" in n or n.endswith(".pyc")]
    if activation is None:
        problems.append(f"{ACTIVATION} (the activation `mcore-proxy patches` prints) is not in the wheel")
    else:
        for source in (repo / ACTIVATION, repo / "patches" / "sitecustomize.py"):
            if source.exists() and source.read_bytes() != activation:
                problems.append(f"the wheel's {ACTIVATION} differs from {source.relative_to(repo)}")
    if not re.search(r"^mcore-proxy\s*=\s*mcore_proxy\.cli:main\s*$", entry_points, re.MULTILINE):
        problems.append("no console script mcore-proxy = mcore_proxy.cli:main")
    extras = _extras(metadata)
    for package in PACKAGES.values():
        if package.extra and package.dist.lower() not in extras.get(package.extra, set()):
            problems.append(
                f"extra [{package.extra}] does not require {package.dist} "
                "(mcore_proxy.core.optional names it in its sentences)"
            )
    if problems:
        raise AssertionError(f"{wheel.name}:\n  " + "\n  ".join(problems))
    return {
        "wheel": str(wheel),
        "bytes": wheel.stat().st_size,
        "files": len(names),
        "modules": sum(n.endswith(".py") for n in names),
        "top": top,
        "activation": ACTIVATION,
        "extras": {k: sorted(v) for k, v in sorted(extras.items()) if k},
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, help="folder for the wheel (default: a temporary one, removed)")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="mcore-proxy-wheel-") as tmp:
        wheel = build_wheel(args.out or Path(tmp))
        try:
            s = check_wheel(wheel)
        except AssertionError as err:
            print(f"check_wheel: {err}", file=sys.stderr)
            return 1
        print(
            f"check_wheel: {Path(s['wheel']).name}: {s['bytes'] / 1024:.0f} KiB, {s['files']} files "
            f"({s['modules']} modules), top level {', '.join(s['top'])}; {s['activation']} inside; extras "
            + "; ".join(f"[{k}] {' '.join(v)}" for k, v in s["extras"].items())
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
