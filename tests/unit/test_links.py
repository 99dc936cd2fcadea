"""Every relative link in README.md and docs/ resolves to a file inside the repository."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from gangrun import Options

ROOT = Path(__file__).resolve().parents[2]
DOCS = sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md")])
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
CODE_PATH = re.compile(r"`((?:\.\./)+[\w./-]+)`")  # `../x/y.md` written as code: still a path


def _links(path: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)  # not inside code blocks
    return LINK.findall(text) + CODE_PATH.findall(text)


def _bad(doc: Path, links: list[str]) -> list[str]:
    bad = []
    for link in links:
        if re.match(r"^[a-z][a-z0-9+.-]*:", link) or link.startswith("#"):
            continue  # http(s)://, mailto:, an anchor on the same page
        if link.startswith("/"):
            bad.append(f"{link} (absolute path)")
            continue
        target = (doc.parent / link.split("#", 1)[0]).resolve()
        if not target.is_relative_to(ROOT):
            bad.append(f"{link} (outside the repository)")
        elif not target.exists():
            bad.append(f"{link} (no such file)")
    return bad


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve_inside_the_repository(doc):
    bad = _bad(doc, _links(doc))
    assert not bad, f"{doc.relative_to(ROOT)}: {bad}"


def test_link_checker_catches_escapes_and_missing_files():
    doc = ROOT / "docs" / "architecture.md"
    text = "[f](../../shared/FACTS.md), `../../shared/FACTS.md`, [g](nope.md), [h](/etc/x)"
    links = LINK.findall(text) + CODE_PATH.findall(text)
    assert _bad(doc, links) == [
        "../../shared/FACTS.md (outside the repository)",
        "nope.md (no such file)",
        "/etc/x (absolute path)",
        "../../shared/FACTS.md (outside the repository)",
    ]
    assert _bad(doc, ["frameworks.md#threads", "../examples", "https://x.org/a"]) == []


def test_configuration_table_lists_every_option():
    text = (ROOT / "docs" / "configuration.md").read_text()
    tracking = {"experiment_name", "run_name", "run_id", "tags"}  # documented with tracking
    missing = [
        f.name
        for f in dataclasses.fields(Options)
        if f.name not in tracking and f"`GANGRUN_{f.name.upper()}`" not in text
    ]
    assert not missing
