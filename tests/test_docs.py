"""The docs say what the code is: links resolve, the README stays a landing page.

Read by the maintainer as datasette reads its own docs: a check per promise, so a rename or a moved
section fails here instead of in a reader's browser.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import pkgutil
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


# --- docs/plugins.md is the plugin author's whole reference -------------------------------------------------

PLUGINS_GUIDE = ROOT / "docs" / "plugins.md"


def _hook_signatures() -> list[str]:
    from nemo_gym_checkpoint_plugin.hookspecs import SPEC_MODULES

    signatures = []
    for module in SPEC_MODULES:
        for name, function in vars(module).items():
            if callable(function) and hasattr(function, "nemo_gym_checkpoint_spec"):
                params = ", ".join(inspect.signature(function).parameters)
                signatures.append(f"{name}({params})")
    return signatures


def test_every_hook_appears_in_the_plugin_guide_with_its_arguments() -> None:
    signatures = _hook_signatures()
    # The participant hooks and the three core ones, at least: the marker attribute did find them.
    assert len(signatures) >= 16 and "attach(server, app, kind, instance, settings)" in signatures
    guide = PLUGINS_GUIDE.read_text(encoding="utf-8")
    assert sorted(s for s in signatures if f"`{s}`" not in guide) == []


def test_every_api_export_appears_in_the_plugin_guide() -> None:
    from nemo_gym_checkpoint_plugin import api

    guide = PLUGINS_GUIDE.read_text(encoding="utf-8")
    # Named in code spans: `name` or a call `name(...)`.
    assert sorted(name for name in api.__all__ if not re.search(rf"`{re.escape(name)}[`(]", guide)) == []


def test_the_public_modules_are_listed_once_and_agree_with_the_layer_test() -> None:
    from test_layers import PUBLIC_TOP

    guide = PLUGINS_GUIDE.read_text(encoding="utf-8")
    section = guide.split("\n## Public modules\n", 1)[1].split("\n## ", 1)[0]
    listed = set(re.findall(r"^- `([a-z_]+)`(?: and `([a-z_]+)`)?", section, re.M))
    assert {name for pair in listed for name in pair if name} == PUBLIC_TOP
    # Every other page points to that section instead of listing the modules again.
    for page in PAGES:
        if page != PLUGINS_GUIDE:
            assert "Public modules:" not in page.read_text(encoding="utf-8"), page.name


# --- every `module.name` a docstring cites resolves ---------------------------------------------------------

PACKAGE = "nemo_gym_checkpoint_plugin"
# ``a.b`` or ``a.b.c()`` in a docstring, with single or double backticks.
_CITE = re.compile(r"(?<![\w.`/])`{1,2}([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+)(?:\(\))?`{1,2}")


def _package_modules() -> list[str]:
    # hookspecs/ and builtin_participants/ are installed into the package from their own directories.
    names = {PACKAGE}
    for package_name in (PACKAGE, f"{PACKAGE}.hookspecs", f"{PACKAGE}.builtin_participants"):
        package = importlib.import_module(package_name)
        names.add(package_name)
        names.update(m.name for m in pkgutil.walk_packages(package.__path__, package_name + "."))
    return sorted(names)


def _members(obj: object) -> set[str]:
    # Fields of dataclasses and pydantic models without a default are annotations, not attributes.
    names = set(dir(obj))
    for klass in getattr(obj, "__mro__", ()):
        names |= set(getattr(klass, "__annotations__", {}))
    return names


def _resolves(dotted: str, bases: list[str]) -> bool:
    parts = dotted.split(".")
    for base in bases:
        for cut in range(len(parts), 0, -1):
            name = ".".join([base, *parts[:cut]] if base else parts[:cut])
            if name.endswith("__main__"):
                continue
            try:
                obj: object = importlib.import_module(name)
            except ImportError:
                continue
            for attr in parts[cut:]:
                if attr not in _members(obj):
                    break
                obj = getattr(obj, attr, None)
                if obj is None:  # an annotated field: nothing deeper to check
                    return True
            else:
                return True
    return False


def _citations() -> list[tuple[str, str, list[str]]]:
    modules = _package_modules()
    # A citation starts with the name of one of the package's modules (an underscore dropped, so a
    # pre-rename ``control.facade`` of today's ``_control`` is one) or with the package itself.
    names = {part.lstrip("_") for m in modules for part in m.split(".")[1:]}
    found = []
    for module_name in modules:
        # Read, not imported: importing a ``__main__`` module would run its program.
        spec = importlib.util.find_spec(module_name)
        assert spec is not None and spec.origin, module_name
        source = Path(spec.origin)
        package = module_name if source.name == "__init__.py" else module_name.rpartition(".")[0]
        # Resolved from the citing module's package, then each enclosing one, then as an absolute name.
        bases, prefix = [], package
        while prefix:
            bases.append(prefix)
            prefix = prefix.rpartition(".")[0]
        bases.append("")
        for node in ast.walk(ast.parse(source.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                for cited in _CITE.findall(ast.get_docstring(node) or ""):
                    first = cited.split(".")[0]
                    if first == PACKAGE or first.lstrip("_") in names:
                        found.append((module_name, cited, bases))
    return found


# A cited file name (``_client.py``) names a module by its file; other suffixes name data files
# (``collect.lock``, ``gym_config.yaml``) that exist only at run time.
_DATA_SUFFIXES = ("lock", "yaml", "json", "jsonl", "toml", "md", "txt")
_SOURCE_TREES = ("nemo_gym_checkpoint_plugin", "hookspecs", "builtin_participants")
_SOURCE_FILES = {p.name for tree in _SOURCE_TREES for p in (ROOT / tree).rglob("*.py")}


def _cited_resolves(cited: str, bases: list[str]) -> bool:
    suffix = cited.rpartition(".")[2]
    if suffix in _DATA_SUFFIXES:
        return True
    if suffix == "py":
        return cited.rpartition("/")[2] in _SOURCE_FILES
    return _resolves(cited, bases)


def test_every_module_name_a_docstring_cites_resolves() -> None:
    citations = _citations()
    assert len(citations) > 50, "the citation finder found almost nothing"
    broken = sorted({f"{module}: {cited}" for module, cited, bases in citations if not _cited_resolves(cited, bases)})
    assert broken == []


def test_the_citation_check_refuses_a_pre_rename_module() -> None:
    # What the check is for: ``control`` became ``_control``; the old name must not resolve.
    assert not _resolves("control.facade.Participants", [PACKAGE, ""])
    assert _resolves("_control.facade.Participants", [PACKAGE, ""])


# --- CHANGELOG.md: one line per user-visible change ---------------------------------------------------------


def test_the_changelog_has_one_line_per_change_and_one_heading_of_each_kind_per_release() -> None:
    text = (ROOT / "CHANGELOG.md").read_text(encoding="utf-8")
    releases = re.split(r"^## ", text, flags=re.M)[1:]
    assert releases and releases[0].startswith("[Unreleased]")
    for release in releases:
        name = release.splitlines()[0]
        kinds = re.findall(r"^### (.+)$", release, re.M)
        assert len(kinds) == len(set(kinds)), f"{name}: a heading repeated: {kinds}"
        assert set(kinds) <= {"Added", "Changed", "Deprecated", "Removed", "Fixed", "Security"}, name
        body = release.split("\n### ", 1)[1] if kinds else ""
        # Under a heading, every line is the heading, a blank, or a whole entry: no continued paragraphs.
        strays = [line for line in body.splitlines()[1:] if line and not line.startswith(("- ", "### "))]
        assert strays == [], f"{name}: entries continued over several lines: {strays[:3]}"
