"""What the docs tell a new user: extras that exist, links that
work on the built site, docstrings mkdocstrings renders, how to open the example notebooks.
The build itself (``mkdocs build --strict``, where such links are warnings, so errors):
tests/system/test_packaging.py::test_docs_build_strict."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from test_links import LINK

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
PAGES = sorted(DOCS.rglob("*.md"))
SOURCES = sorted((ROOT / "src" / "gangrun").rglob("*.py"))
# Sphinx cross-reference roles, which mkdocstrings shows as raw text (":class:`Options`")
SPHINX_ROLE = re.compile(r":(?:py:)?(?:class|func|meth|mod|attr|exc|data|obj|const|ref):`")


def _extras() -> set[str]:
    text = (ROOT / "pyproject.toml").read_text()
    section = text.split("[project.optional-dependencies]", 1)[1].split("\n[", 1)[0]
    return set(re.findall(r"^([a-z][\w-]*)\s*=\s*\[", section, flags=re.M))


def _extras_tables() -> dict[str, set[str]]:
    found = {}
    for doc in (ROOT / "README.md", DOCS / "index.md"):
        cells = re.findall(r"^\| (`[^|]*) \|", doc.read_text(), flags=re.M)  # "`data`, `s3`"
        found[doc.name] = {name for cell in cells for name in re.findall(r"`([\w-]+)`", cell)}
    return found


def test_every_extra_the_docs_name_exists_and_every_extra_is_named():
    extras = _extras()
    assert {"torch", "mlflow", "gpu", "notebook"} <= extras
    for doc, named in _extras_tables().items():
        assert named - extras == set(), f"{doc} names extras that do not exist"
        assert extras - {"dev"} - named == set(), f"{doc} leaves out extras"
    for doc in (ROOT / "README.md", *PAGES):
        text = doc.read_text()
        assert "`nvml` extra" not in text and "gangrun[nvml" not in text, doc


def test_docs_say_how_to_open_the_example_notebooks():
    for doc in (ROOT / "README.md", DOCS / "index.md"):
        assert "jupyter lab examples/quickstart.ipynb" in doc.read_text(), doc
    text = (ROOT / "pyproject.toml").read_text()
    assert re.search(r'^notebook = \["jupyterlab[^"]*", "ipykernel', text, flags=re.M)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_stay_inside_the_site(page):
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    outside = []
    for link in LINK.findall(text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", link) or link.startswith("#"):
            continue
        target = (page.parent / link.split("#", 1)[0]).resolve()
        if not target.is_relative_to(DOCS):
            outside.append(link)  # fine on GitHub, a broken link on the built site
    assert not outside, f"{page.relative_to(ROOT)}: {outside} (name repository files as code)"


def test_no_raw_sphinx_roles_in_docstrings_or_pages():
    found = [
        f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
        for path in [*SOURCES, *PAGES]
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if SPHINX_ROLE.search(line)
    ]
    assert not found, "use [`Name`][gangrun.Name] or `Name`:\n" + "\n".join(found[:40])


def test_the_strict_build_fails_on_links_out_of_the_site():
    text = (ROOT / "mkdocs.yml").read_text()
    assert re.search(r"^\s+not_found: warn$", text, flags=re.M)
    assert re.search(r"^\s+unrecognized_links: warn$", text, flags=re.M)


# `::: gangrun.x.y` in a page: mkdocstrings renders that object
DIRECTIVE = re.compile(r"^:::\s*(gangrun(?:\.\w+)*)\s*$", re.M)


def private_parts(path: str) -> list[str]:
    """The ``_private`` parts of a dotted path (dunder names are not private)."""
    return [p for p in path.split(".") if p.startswith("_") and not p.startswith("__")]


def test_the_api_reference_documents_no_private_module_or_name():
    # The reference is the public surface: a private module (gangrun._log) or name shown
    # there is one a user would import, and then it could never change.
    directives = [(page, m) for page in PAGES for m in DIRECTIVE.findall(page.read_text())]
    assert len(directives) > 20, directives  # the pattern still reads the pages
    bad = [f"{page.relative_to(ROOT)}: ::: {m}" for page, m in directives if private_parts(m)]
    assert not bad, "the API reference shows private modules or names:\n" + "\n".join(bad)


def test_the_private_check_reads_each_part():
    assert private_parts("gangrun._log.get_logger") == ["_log"]
    assert private_parts("gangrun.errors._Hidden") == ["_Hidden"]
    assert private_parts("gangrun.api.RunHandle.__init__") == []
    assert DIRECTIVE.findall("x\n::: gangrun._compat_imports.private_import\n") == [
        "gangrun._compat_imports.private_import"
    ]
