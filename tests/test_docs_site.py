"""The documentation site builds with ``mkdocs build --strict`` (what ``make docs`` runs), so a
broken link or anchor between pages, a page left out of the navigation, or a docstring the API
reference cannot parse fails the suite, not only the next person who builds the site.

The API reference lists exactly the public surface: every name of each public module's
``__all__``, and nothing from a private module.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

# Every test reads the site the module builds once: a few seconds of mkdocs.
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
# The modules of the API reference, by the page they are on (docs/reference/<page>.md).
REFERENCE = {
    "mongo_outbox": "mongo_outbox",
    "publishers": "mongo_outbox.publishers",
    "consumers": "mongo_outbox.consumers",
    "faststream": "mongo_outbox.faststream",
    "changestream": "mongo_outbox.changestream",
    "testing": "mongo_outbox.testing",
    "settings": "mongo_outbox.settings",
    "metrics": "mongo_outbox.metrics",
    "cloudevents": "mongo_outbox.cloudevents",
    "admin": "mongo_outbox.admin",
}
NEEDS = (
    "mkdocs",
    "material",
    "mkdocstrings",
    "mkdocstrings_handlers.python",
    "mkdocs_include_markdown_plugin",
)


def installed(name: str) -> bool:
    # find_spec imports a dotted name's parents, and raises when a parent is missing.
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        return False


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    missing = [name for name in NEEDS if not installed(name)]
    if missing:
        pytest.skip(
            f"the docs site needs the docs extra (pip install -e '.[docs]'); missing: {missing}"
        )
    out = tmp_path_factory.mktemp("site")
    build = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=ROOT,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert build.returncode == 0, build.stderr
    assert "WARNING" not in build.stderr, build.stderr
    return out


def test_the_site_builds_in_strict_mode_with_every_page(site: Path) -> None:
    pages = {p.stem for p in (ROOT / "docs").glob("*.md")}
    built = {p.parent.name for p in site.glob("*/index.html")}
    assert pages - {"index"} <= built
    assert (site / "index.html").exists()
    # The home page is the README, with its links to docs/ pages made relative to the site.
    home = (site / "index.html").read_text()
    assert "Reliable event publishing from MongoDB" in home
    assert 'href="outbox/"' in home and 'href="docs/' not in home


def public_names(module: str) -> set[str]:
    exported = getattr(importlib.import_module(module), "__all__", None)
    if exported is not None:
        return set(exported)
    # A module without __all__ (settings): what it defines at the top level, minus _private.
    path = importlib.util.find_spec(module).origin  # type: ignore[union-attr]
    tree = ast.parse(Path(str(path)).read_text())
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
    return {name for name in names if not name.startswith("_")}


@pytest.mark.parametrize("page", sorted(REFERENCE))
def test_the_api_reference_lists_exactly_the_public_names(site: Path, page: str) -> None:
    module = REFERENCE[page]
    html = (site / "reference" / page / "index.html").read_text()
    anchors = set(re.findall(r'id="(mongo_outbox[.\w]*)"', html))
    listed = {a.removeprefix(f"{module}.") for a in anchors if a.startswith(f"{module}.")}
    assert {name for name in listed if "." not in name} == public_names(module)
    assert not [a for a in anchors if "._" in a]
