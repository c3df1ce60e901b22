"""The import paths of before, kept working from one table, each with a ``DeprecationWarning``.

Modules that only handed names on from where they had moved (``mongo_outbox.publishers.nats``,
``mongo_outbox.consumers.base``, ``mongo_outbox.changestream.checkpoint``, ...) were a file each,
and a reader had to open every one to learn it held nothing. ``MOVED`` says it in one place: an
old module's path gives the module that holds its names now, and an old ``module.Name`` path the
object that it is now, where it moved to another module or got another name. A finder at the end
of ``sys.meta_path`` (installed by ``mongo_outbox/__init__.py``) answers for an old module that no
file provides: importing it warns once, and each name is looked up where it lives, when first
asked for, so an old path of a broker still needs only that broker's extra. The warning sends
users to a public path (``FRONTS``), never to a private module.

The library and its tests import the new paths only, so that ``-W error::DeprecationWarning``
holds for them. This module imports none of the library: it is a leaf.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import types
import warnings
from collections.abc import Sequence
from typing import Any

__all__ = ["FRONTS", "MOVED", "advice", "install"]

MOVED: dict[str, str] = {
    # -- the seam below the brokers (brokers/_publishing.py, brokers/_consuming.py) ------------
    "mongo_outbox.publishers.base": "mongo_outbox.brokers._publishing",
    "mongo_outbox.publishers.base.unavailable": "mongo_outbox.errors.unavailable",
    "mongo_outbox.consumers.base": "mongo_outbox.brokers._consuming",
    # -- each broker in its own package (brokers/<name>/) ---------------------------------------
    "mongo_outbox.publishers.memory": "mongo_outbox.brokers.memory.publisher",
    "mongo_outbox.publishers.nats": "mongo_outbox.brokers.nats.publisher",
    "mongo_outbox.publishers.rabbitmq": "mongo_outbox.brokers.rabbitmq.publisher",
    "mongo_outbox.publishers.redis": "mongo_outbox.brokers.redis.publisher",
    "mongo_outbox.publishers.redis.classify": "mongo_outbox.brokers.redis.errors.classify",
    "mongo_outbox.publishers.faststream": "mongo_outbox.brokers.faststream.publisher",
    "mongo_outbox.consumers.nats": "mongo_outbox.brokers.nats.consumer",
    "mongo_outbox.consumers.rabbitmq": "mongo_outbox.brokers.rabbitmq.consumer",
    "mongo_outbox.consumers.redis": "mongo_outbox.brokers.redis.consumer",
    # -- a change-stream relay's checkpoint is its fenced lease ---------------------------------
    "mongo_outbox.changestream.checkpoint": "mongo_outbox._relay.lease",
    "mongo_outbox.changestream.checkpoint.Checkpoint": "mongo_outbox._relay.lease.FencedLease",
    # -- the first version's paths ---------------------------------------------------------------
    "mongo_outbox.backoff": "mongo_outbox.settings",
    "mongo_outbox.guard": "mongo_outbox.inbox",
}
"""Old path -> new path: a module's, or a ``module.Name``'s where the name moved on its own."""

FRONTS: dict[str, str] = {
    "mongo_outbox.brokers._publishing": "mongo_outbox.publishers",
    "mongo_outbox.brokers._consuming": "mongo_outbox.consumers",
}
"""The public front of a private new path, which the warning names instead."""


def advice(old: str) -> str:
    """What the warning says of ``old``: where to import from now, never a private module."""
    new = MOVED[old]
    if new in FRONTS:
        return (
            f"{old} is deprecated: import from {FRONTS[new]} instead "
            "(what that does not offer is internal now)"
        )
    if any(part.startswith("_") for part in new.split(".")):
        return f"{old} is deprecated: what it offered is internal now ({new})"
    return f"{old} is deprecated: import from {new} instead"


def _found(path: str) -> Any:
    """The object at a new ``module.Name`` path."""
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


class _Moved(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds and loads an old module of ``MOVED`` as a module that looks its names up in the
    new one."""

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None,
        target: types.ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in MOVED:
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        return None  # the default module

    def exec_module(self, module: types.ModuleType) -> None:
        old = module.__name__
        new = MOVED[old]
        # Skipping the import system's frames, the warning points at the line that imported.
        warnings.warn(advice(old), DeprecationWarning, stacklevel=2)

        def public() -> list[str]:
            # What ``from old import *`` and dir() see: every public name of the new module
            # (the old one may have offered more than the new one's __all__), and those that
            # moved on their own.
            names = [n for n in vars(importlib.import_module(new)) if not n.startswith("_")]
            moved = [path.rpartition(".")[2] for path in MOVED if path.startswith(f"{old}.")]
            return names + moved

        def attribute(name: str) -> Any:
            if name == "__all__":
                return public()
            if name.startswith("__"):
                raise AttributeError(f"module {old!r} has no attribute {name!r}")
            moved = MOVED.get(f"{old}.{name}")
            if moved is not None:
                return _found(moved)
            try:
                return getattr(importlib.import_module(new), name)
            except AttributeError:
                raise AttributeError(f"module {old!r} has no attribute {name!r}") from None

        module.__getattr__ = attribute  # type: ignore[method-assign]
        module.__dir__ = public  # type: ignore[method-assign]
        module.__doc__ = f"Deprecated: the names of {old} are in {new}."


_FINDER = _Moved()


def install() -> None:
    """Answer for the old paths; last in ``sys.meta_path``, so that no real module is shadowed,
    and once."""
    if _FINDER not in sys.meta_path:
        sys.meta_path.append(_FINDER)
