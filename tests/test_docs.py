"""The documentation: links resolve, the README stays a front door, docs/cli.md matches the parser."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
PAGES = [README, REPO / "CHANGELOG.md", *sorted((REPO / "docs").glob("*.md"))]
# [text](target) and ![alt](target); the target ends at whitespace (a "title") or the closing paren
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
FENCE = re.compile(r"^(```|~~~)")


def _prose(text: str) -> str:
    """The text outside fenced code blocks (where a `[x](y)` is code, not a link)."""
    out, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line.lstrip()):
            fenced = not fenced
            continue
        if not fenced:
            out.append(re.sub(r"`[^`]*`", "", line))  # nor inside inline code
    return "\n".join(out)


def _links(path: Path) -> list[str]:
    return [m.group(1) for m in LINK.finditer(_prose(path.read_text()))]


def _local(target: str) -> str | None:
    """The file part of a relative link, or None for a web address, a mail address or an anchor."""
    if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target) or target.startswith("#"):
        return None
    return target.split("#", 1)[0].split("?", 1)[0] or None


def test_link_parser_sees_both_kinds_and_skips_code():
    page = "[a](docs/x.md#y) ![b](img.png) [c](https://e.org) [d](#top)\n`[e](no.md)`\n```\n[f](no2.md)\n```\n"
    found = [m.group(1) for m in LINK.finditer(_prose(page))]
    assert found == ["docs/x.md#y", "img.png", "https://e.org", "#top"]
    assert [_local(t) for t in found] == ["docs/x.md", "img.png", None, None]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_resolves(page):
    missing = [t for t in _links(page) if (f := _local(t)) is not None and not (page.parent / f).exists()]
    assert not missing, f"{page.relative_to(REPO)} links to paths that do not exist: {missing}"


def test_readme_is_a_front_door():
    lines = README.read_text().splitlines()
    assert len(lines) <= 220, f"README.md has {len(lines)} lines; move details to docs/"


def _section(text: str, heading: str) -> str:
    match = re.search(rf"^## {re.escape(heading)}.*?$(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert match, f"README.md has no '## {heading}' section"
    return match.group(1)


def test_readme_setup_section_holds_exactly_two_commands():
    section = _section(README.read_text(), "Set-up: the two commands")
    blocks = re.findall(r"^```(?:bash|sh|shell)\n(.*?)^```", section, re.M | re.S)
    assert len(blocks) == 1, "the set-up section has one fenced bash block"
    commands = [line for line in blocks[0].splitlines() if line.strip() and not line.lstrip().startswith("#")]
    assert len(commands) == 2, commands
    assert commands[0].startswith("bash examples/quickstart.sh") and commands[1].startswith("bash tests/run.sh")
    for command in commands:
        assert (REPO / command.split()[1]).is_file()


def test_families_table_is_up_to_date():
    """docs/families.md's table of every MoE type in the installed transformers (pinned in the test
    extra): discovery and the twin proof on each, about a minute."""
    spec = importlib.util.spec_from_file_location("families_table", REPO / "tools" / "families_table.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.main(["--check"]) == 0, "docs/families.md is stale: run python tools/families_table.py"


def test_cli_reference_is_up_to_date():
    spec = importlib.util.spec_from_file_location("cli_reference", REPO / "tools" / "cli_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    problem = module.check()
    assert problem is None, problem
