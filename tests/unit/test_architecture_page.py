"""docs/architecture.md names modules and files to send a newcomer to: each one it names exists,
so that the tour cannot keep pointing at a module after it moved or was renamed."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from mongo_outbox.brokers import BROKERS

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "mongo_outbox"
PAGE = (ROOT / "docs" / "architecture.md").read_text()
CODE = re.compile(r"`([^`\n]+)`")
DOTTED = re.compile(r"(?:mongo_outbox\.)?_?[a-z][a-z_]*(?:\.[A-Za-z_<>][\w<>]*)+")
MODULES = {
    ".".join(path.relative_to(PACKAGE).with_suffix("").parts).removesuffix(".__init__")
    for path in PACKAGE.rglob("*.py")
}


def expanded(name: str) -> list[str]:
    """``brokers/<name>/...`` stands for the package of every broker that has that part: its
    command line (``cli.py``) where its entry names one, the rest where it has a client (the
    in-process ``memory`` has a publisher only)."""
    if "<name>" not in name:
        return [name]
    has_it = (
        (lambda broker: broker.command_line is not None)
        if name.rstrip("/").endswith("/cli.py")
        else (lambda broker: bool(broker.extra))
    )
    return [name.replace("<name>", b.name) for b in BROKERS.values() if has_it(b)]


def defines(module: str, name: str) -> bool:
    """Whether ``module`` defines or imports ``name`` at its top level (read, not imported)."""
    path = PACKAGE.joinpath(*module.split("."))
    source = path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
    names: set[str] = set()
    for node in ast.parse(source.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(t.id for t in targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.ImportFrom):
            names.update(alias.asname or alias.name for alias in node.names)
    return name in names


def missing_path(text: str) -> bool:
    for path in expanded(text.rstrip("/")):
        if not ((ROOT / path).exists() or (PACKAGE / path).exists()):
            return True
    return False


def missing_dotted(text: str) -> bool:
    for dotted in expanded(text.removeprefix("mongo_outbox.")):
        parts = dotted.split(".")
        # The longest prefix that is a module; at most one name after it.
        for cut in range(len(parts), 0, -1):
            module = ".".join(parts[:cut])
            if module in MODULES:
                rest = parts[cut:]
                if len(rest) > 1 or (rest and not defines(module, rest[0])):
                    return True
                break
        else:
            return True
    return False


def test_every_file_the_page_names_exists() -> None:
    paths = {c for c in CODE.findall(PAGE) if c.endswith(".py") or c.endswith("/")}
    paths = {p for p in paths if " " not in p and not p.startswith("<")}
    assert len(paths) > 30  # the page's tour names its files
    assert [p for p in sorted(paths) if missing_path(p)] == []


def test_every_module_path_the_page_names_exists() -> None:
    modules = {
        c
        for c in CODE.findall(PAGE)
        if DOTTED.fullmatch(c) and not c.endswith(".py") and c.split(".")[0].islower()
    }
    # Lowercase dotted words that are no module path: a collection's name.
    modules -= {"inbox.handlers"}
    assert len(modules) > 20
    assert [m for m in sorted(modules) if missing_dotted(m)] == []


def test_the_checks_find_a_name_that_does_not_exist() -> None:
    assert missing_path("_relay/store/basic.py")
    assert missing_path("brokers/<name>/errorz.py")
    assert missing_dotted("_write.plans")
    assert missing_dotted("_write.rules.Rulez")
    assert not missing_dotted("mongo_outbox.brokers.<name>.publisher")
    assert missing_dotted("mongo_outbox.brokers.<name>.errors.classify")  # FastStream has none
