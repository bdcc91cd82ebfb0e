"""The claim: which node may map an image read-write. Pure; no I/O.

One image-meta key (``meta.HOLDER``) carries it, as JSON. It is only ever
changed by a compare-and-set on the image's header object
(``drivers/claims.py``), so two nodes that map at the same moment cannot
both win. Held from just before the map until the unmap; it names the
mapping clients so that a takeover can fence exactly them.

Imported by apply/ (4 modules); daemon/claimpoll.py; drivers/rbdbase.py;
engine/orphans.py; plan/fence.py, plan/release.py, plan/volumeview.py.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from reconciler.facts.text import shown_name


@dataclass(frozen=True)
class Claim:
    node: str
    # Addresses ("ip:port/nonce") of the clients doing this node's I/O: the
    # image's watchers right after the map. A takeover blocklists them.
    clients: tuple[str, ...] = ()
    # Set by a takeover: the previous holder and the addresses blocklisted.
    taken_from: str | None = None
    fenced: tuple[str, ...] = ()

    def encode(self) -> str:
        doc: dict[str, object] = {"node": self.node, "clients": list(self.clients)}
        if self.taken_from is not None:
            doc["takenFrom"] = self.taken_from
            doc["fenced"] = list(self.fenced)
        # ASCII only: librados compares the value byte for byte with what we read.
        return json.dumps(doc, sort_keys=True, separators=(",", ":"))

    def as_dict(self) -> dict[str, object]:
        return {"node": self.node, "clients": list(self.clients),
                "takenFrom": self.taken_from, "fenced": list(self.fenced)}


def parse(raw: str | None) -> Claim | None:
    """None: unclaimed. A value that is not our JSON is the plain node name an
    earlier version recorded (informational then, a claim now). Anyone with
    the pool's key may have written it: a name no node config allows comes
    back escaped and bounded (it reaches messages), and so do the addresses;
    the compare-and-set compares the raw value, never this."""
    if not raw:
        return None
    try:
        doc = json.loads(raw)
    except (ValueError, RecursionError):  # RecursionError: "[[[[..." nested too deeply
        return Claim(shown_name(raw.strip()))
    if not isinstance(doc, dict) or not isinstance(doc.get("node"), str):
        return Claim(shown_name(raw.strip()))
    taken_from = doc.get("takenFrom")
    return Claim(shown_name(doc["node"]), _addrs(doc.get("clients")),
                 shown_name(taken_from) if isinstance(taken_from, str) else None,
                 _addrs(doc.get("fenced")))


MAX_ADDRS = 64  # a node's mapping has a client or two; a fence adds a few


def _addrs(value: object) -> tuple[str, ...]:
    if not isinstance(value, list):
        return ()
    return tuple(shown_name(str(a)) for a in value[:MAX_ADDRS])


def parse_blocklist(text: str) -> dict[str, str]:
    """``ceph osd blocklist ls -f json`` -> {client address: until}. 16.2
    prints two JSON lists back to back (addresses, then ranges): the first."""
    try:
        entries, _ = json.JSONDecoder().raw_decode(text.strip() or "[]")
    except ValueError:
        return {}
    if not isinstance(entries, list):
        return {}
    return {str(e["addr"]): str(e.get("until", "")) for e in entries
            if isinstance(e, dict) and "addr" in e}


def fenced_addresses(clients: tuple[str, ...], blocklist: dict[str, str]) -> dict[str, str]:
    """Which of ``clients`` Ceph has blocklisted, with until when."""
    return {a: blocklist[a] for a in sorted(clients) if a in blocklist}
