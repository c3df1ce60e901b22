"""What the console shows is redacted before it is rendered, never after.

Any text it shows may hold a credential it did not write: a parked event's error quoting a
driver's ``mongodb://user:pass@db``, a relay's name, an inbox failure. Every string of the data
a page or a JSON answer is made of passes through ``redact_text``: the credentials of every URL
in it are replaced (``redact_url``'s rules), then every secret the command knows (its URIs'
passwords, the console's token and password). The finished HTML is never touched: a secret that
happens to be ``static`` or ``value`` would otherwise cut the page's own paths and attributes.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from datetime import datetime
from typing import Any

from mongo_outbox.cli.common import scrub
from mongo_outbox.publishers import redact_url

# A URL inside a text: a scheme, "://", then up to a space or a quote. The scheme starts where
# a run of scheme characters starts (the lookbehind): tried from every letter of a long word,
# the search would take the square of its length.
_URL = re.compile(r"(?<![A-Za-z0-9+.\-])[A-Za-z][A-Za-z0-9+.\-]*://[^\s\"'<>`]+")


def redact_text(text: str, secrets: Iterable[str] = ()) -> str:
    """``text`` with the credentials of its URLs and every one of ``secrets`` (and the
    command's registered secrets) replaced by ``***``."""
    text = _URL.sub(lambda url: redact_url(url[0]), text)
    text = scrub(text)
    for secret in sorted(secrets, key=len, reverse=True):
        text = text.replace(secret, "***")
    return text


def redacted(value: Any, secrets: Iterable[str] = ()) -> Any:
    """``value`` with every string in it redacted, through dicts, lists and tuples (keys are
    the console's own field names, and stay). Numbers, booleans, ``None`` and times stay as
    they are; any other object (an ``ObjectId``, a stored value of an odd type) becomes its
    redacted text, as it would be shown."""
    secrets = tuple(secrets)
    if value is None or isinstance(value, (bool, int, float, datetime)):
        return value
    if isinstance(value, dict):
        return {key: redacted(item, secrets) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [redacted(item, secrets) for item in value]
    return redact_text(value if isinstance(value, str) else str(value), secrets)
