"""Text the console shows cannot reorder what is around it.

An event type, an aggregate id, an error or a consumer's name is anybody's text, and a
bidirectional control character in it (a right-to-left override, U+202E) makes a browser draw
the characters after it in another order: ``t.\\u202egnp.exe`` reads as ``t.exe.png``, a name
that lies about itself. Every text the console shows has these controls replaced by their
escape (``\\u202e``), visible and inert; the page also isolates each value (``<bdi>``), so that
right-to-left letters, which are no trick, stay inside their own cell.

Only what is shown is escaped: a form's hidden field sends the stored value back as it is, or a
requeue by type would miss the type it shows.
"""

from __future__ import annotations

import re

CONTROLS = (
    "\u061c"  # ARABIC LETTER MARK
    "\u200e\u200f"  # LEFT-TO-RIGHT MARK, RIGHT-TO-LEFT MARK
    "\u202a\u202b\u202c\u202d\u202e"  # LRE, RLE, PDF, LRO, RLO (embeddings and overrides)
    "\u2066\u2067\u2068\u2069"  # LRI, RLI, FSI, PDI (isolates)
)
"""The Unicode bidirectional formatting characters (Unicode's UAX #9, table 2), and the
implicit marks."""

_CONTROL = re.compile(f"[{CONTROLS}]")


def visible(text: str) -> str:
    """``text`` with every bidirectional control replaced by its escape, ``\\u202e``."""
    return _CONTROL.sub(lambda found: f"\\u{ord(found[0]):04x}", text)
