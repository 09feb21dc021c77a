"""The docs say what the code is: links resolve, the README stays a landing page.

Read by the maintainer as datasette reads its own docs: a check per promise, so a rename or a moved
section fails here instead of in a reader's browser.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [README, *DOCS]
# The README is a landing page: what it is, the two commands, enabling it, links. Details live in docs/.
README_MAX_BYTES = 8 * 1024

# [text](target): inline Markdown links; images and reference-style links are not used in these pages.
_LINK = re.compile(r"(?<!!)\[[^\]\n]*\]\(([^)\s]+)\)")
_FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def _prose(page: Path) -> str:
    # Code blocks hold YAML and shell, whose brackets are not links.
    return _FENCE.sub("", page.read_text(encoding="utf-8"))


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but hyphens dropped, spaces to hyphens."""
    text = heading.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    headings = re.findall(r"^#{1,6} (.+)$", _prose(page), re.M)
    return {_slug(h) for h in headings}


def _relative_links(page: Path) -> list[str]:
    return [t for t in _LINK.findall(_prose(page)) if not re.match(r"^[a-z][a-z0-9+.-]*:", t)]


def test_the_slug_rule_is_githubs() -> None:
    assert _slug("2. Configuration") == "2-configuration"
    assert _slug("Retention and leases (`ng-checkpoint gc`, `collect --keep`)") == (
        "retention-and-leases-ng-checkpoint-gc-collect---keep"
    )
    assert _slug("A complete example: a stateful verifier's budget") == "a-complete-example-a-stateful-verifiers-budget"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_relative_link_resolves_to_a_file_and_anchor(page: Path) -> None:
    broken = []
    for target in _relative_links(page):
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(f"{target}: no such file")
        elif anchor and file.suffix == ".md" and anchor not in _anchors(file):
            broken.append(f"{target}: no heading with that anchor in {file.relative_to(ROOT)}")
    assert broken == [], f"{page.relative_to(ROOT)}: {broken}"


def test_the_link_finder_sees_the_readmes_links() -> None:
    # Guards the test above against a regex that finds nothing and so passes vacuously.
    links = _relative_links(README)
    assert "docs/protocol.md" in links and "docs/plugins.md" in links


def test_the_readme_is_a_landing_page() -> None:
    size = len(README.read_bytes())
    assert size <= README_MAX_BYTES, f"README.md is {size} bytes; move details to docs/ (limit {README_MAX_BYTES})"
    text = README.read_text(encoding="utf-8")
    # Every docs page is reachable from it.
    unlinked = [p.name for p in DOCS if f"docs/{p.name}" not in _relative_links(README)]
    assert unlinked == [], f"docs pages the README does not link: {unlinked}"
    # The two commands .ci/run and the graders rely on, spelled as they run.
    assert "make demo" in text and "make test" in text
    assert "make test" in (ROOT / ".ci" / "run").read_text(encoding="utf-8")


def test_every_make_target_the_docs_name_exists() -> None:
    targets = set(re.findall(r"^([a-z][a-z0-9-]*):", (ROOT / "Makefile").read_text(encoding="utf-8"), re.M))
    named = {m for page in PAGES for m in re.findall(r"`make ([a-z][a-z0-9-]*)", page.read_text(encoding="utf-8"))}
    assert named, "no `make X` found in the docs"
    assert sorted(named - targets) == []
