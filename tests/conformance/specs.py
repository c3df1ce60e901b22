"""MongoDB's specification tests, fetched at test time, never committed.

The unified-format JSON files of mongodb/specifications (``transactions``,
``transactions-convenient-api``, ``change-streams`` and ``retryable-writes``) ship in PyPI's
PyMongo sdist under ``test/``. The sdist of the PyMongo version installed here is downloaded once
per machine with pip and those folders are extracted to ``~/.cache/mongo-outbox-specs/<version>``
(``$XDG_CACHE_HOME`` is honoured); ``MONGO_OUTBOX_SPECS_DIR`` points at another cache. A cache
that lacks one of them (made before it was added) is fetched again.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from importlib.metadata import version
from pathlib import Path

# The sdist's folders, and the names the suite gives them (the spec's own folder names).
FOLDERS = {
    "test/transactions/unified": "transactions",
    "test/transactions-convenient-api/unified": "transactions-convenient-api",
    "test/change_streams/unified": "change-streams",
    "test/retryable_writes/unified": "retryable-writes",
}
TRANSACTIONS = ("transactions", "transactions-convenient-api")
DOWNLOAD_TIMEOUT = 300.0
# What the report says about this run besides outcomes (the server under test, and how its
# topology was evaluated); filled by the test module, printed by conftest.py.
NOTES: set[str] = set()


class SpecsUnavailable(Exception):
    """The specification files could not be fetched; the message says why."""


def cache_dir(pymongo_version: str) -> Path:
    configured = os.environ.get("MONGO_OUTBOX_SPECS_DIR")
    if configured:
        return Path(configured) / pymongo_version
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "mongo-outbox-specs" / pymongo_version


def _complete(cache: Path) -> bool:
    folders = (cache / name for name in FOLDERS.values())
    return (cache / ".complete").exists() and all(folder.is_dir() for folder in folders)


def spec_files(folders: tuple[str, ...] = TRANSACTIONS) -> list[Path]:
    """The spec files of ``folders``, downloaded and cached on first use; raises
    ``SpecsUnavailable``."""
    pymongo_version = version("pymongo")
    cache = cache_dir(pymongo_version)
    if not _complete(cache):
        _download(pymongo_version, cache)
    files = sorted(path for name in folders for path in (cache / name).glob("*.json"))
    if not files:
        raise SpecsUnavailable(f"no spec files in {cache}")
    return files


def _download(pymongo_version: str, cache: Path) -> None:
    cache.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache.parent) as scratch:
        # --no-binary for pymongo alone: with ":all:", an older pip (23, on Python 3.10) builds
        # the sdist's build backend and its dependencies from source too (over 5 minutes).
        command = [
            sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
            "--no-binary", "pymongo", f"pymongo=={pymongo_version}", "-d", scratch,
        ]  # fmt: skip
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=DOWNLOAD_TIMEOUT)
        except (OSError, subprocess.TimeoutExpired) as error:
            message = f"pip download of pymongo=={pymongo_version}: {error}"
            raise SpecsUnavailable(message) from error
        sdists = list(Path(scratch).glob("pymongo-*.tar.gz"))
        if done.returncode != 0 or not sdists:
            tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
            raise SpecsUnavailable(
                f"pip download of the pymongo=={pymongo_version} sdist failed "
                f"(exit {done.returncode}): {' | '.join(tail)}"
            )
        staged = Path(scratch) / "specs"
        with tarfile.open(sdists[0]) as sdist:
            for member in sdist.getmembers():
                # pymongo-<version>/test/transactions/unified/abort.json
                parts = member.name.split("/", 1)
                if len(parts) != 2 or not member.isfile() or not parts[1].endswith(".json"):
                    continue
                folder, _, filename = parts[1].rpartition("/")
                if folder not in FOLDERS or "/" in filename:
                    continue
                source = sdist.extractfile(member)
                assert source is not None
                target = staged / FOLDERS[folder] / filename
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(source.read())
        if not staged.exists():
            raise SpecsUnavailable(f"{sdists[0].name} has none of {sorted(FOLDERS)}")
        (staged / ".complete").write_text(sdists[0].name + "\n")
        # Another process may have cached them meanwhile: either copy is the same.
        if not _complete(cache):
            shutil.rmtree(cache, ignore_errors=True)
            try:
                staged.rename(cache)
            except OSError:
                if not (cache / ".complete").exists():
                    raise
