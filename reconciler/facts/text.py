"""Text another party wrote, made safe to show: ``clip`` (control, bidi and
invisible characters escaped, the length bounded) and ``shown_name`` (a node
name as image-meta or a report carries it). Pure; no I/O.

Image-meta and the fleet's reports may be written by anyone holding the
pool's key (README, Who is trusted for what): a "node name" read there may
carry an escape sequence for the operator's terminal, a line break that
forges a log line, or a megabyte. What is compared stays the raw value;
what is shown goes through here.

Imported by apply/imagesteps.py; daemon/sdnotify.py; facts/claim.py,
facts/fleetreport.py; plan/image.py.
"""

from __future__ import annotations

import re

# The node config's nodeName pattern (schemas/config.schema.json).
NODE_NAME = re.compile(r"[A-Za-z0-9]([-A-Za-z0-9._]{0,251}[A-Za-z0-9])?")
MAX_NAME = 253
# Control and bidi characters hide what a text says (spec/diagnostics.py
# refuses the same ones in specs; facts may not import spec); so do the
# invisible format characters (soft hyphen, zero widths, word joiners, BOM,
# annotations). A lone surrogate (JSON may escape one) cannot be encoded:
# it would crash whatever prints another node's text.
FORBIDDEN = re.compile(
    r"[\x00-\x1f\x7f-\x9f\xad\u061c\u200b-\u200f\u2028\u2029\u202a-\u202e\u2060-\u2069"
    r"\ud800-\udfff\ufeff\ufff9-\ufffb]")


def clip(text: str, limit: int) -> str:
    """``text`` with control and bidi characters escaped, at most ``limit``
    characters (the end cut, marked "…")."""
    if FORBIDDEN.search(text):
        text = FORBIDDEN.sub(lambda m: repr(m.group())[1:-1], text)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def shown_name(name: str) -> str:
    """A node name as read from Ceph: as is when it is one a node config
    allows, else clipped. No allowed name contains a backslash or "…", so
    a clipped one never equals a real node's name."""
    return name if NODE_NAME.fullmatch(name) else clip(name, MAX_NAME)
