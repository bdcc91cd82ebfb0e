"""Wrapped passphrases bound to their image (``keys.WRAP_VERSION`` 2).

A record opens for the image it was sealed for, or for an image Ceph's own
parent links name as an ancestor (a clone carries its parent's image-meta).
Whatever hangs on such a link, or on no binding at all (version 1), is
sealed again for the image itself (the same passphrase):

- when the volume's key is used (``apply``: format, open, resize), best
  effort: a lost compare-and-set leaves it for the next use;
- before a flatten, which drops the parent link: the flatten is refused
  when no node key here opens the record (it would lock the clone out);
- in a group-snapshot copy, before the copy gets its name (a copy has no
  parent link at all: the source it was made from is accepted only there).

Imported by apply/devicesteps.py.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import rados

from reconciler.drivers import ceph, keys, rbdbase
from reconciler.facts import meta

log = logging.getLogger("reconciler.apply")

# Every record that holds a wrapped passphrase: the one in force, and a
# rotation's new and old ones (apply/rotate.py).
RECORDS = (meta.LUKS_KEY, meta.LUKS_KEY_NEXT, meta.LUKS_KEY_PREV)


class ImageSeals:
    """Reading and sealing the records of one image. ``also``: images
    accepted besides Ceph's lineage (the source of a copy being made)."""

    RECORDS = RECORDS

    def __init__(self, cluster: rados.Rados, pool: str, image: str, accept_unbound: bool,
                 also: Iterable[keys.ImageRef] = ()) -> None:
        self.cluster, self.pool, self.image = cluster, pool, image
        self.accept_unbound = accept_unbound
        self.also = tuple(also)
        self._ref: keys.ImageRef | None = None
        self._lineage: list[keys.ImageRef] | None = None

    @property
    def ref(self) -> keys.ImageRef:
        if self._ref is None:
            self._ref = ceph.image_ref(self.cluster, self.pool, self.image)
        return self._ref

    def lineage(self) -> list[keys.ImageRef]:
        """Asked only for a record sealed for another image (costs an open per level)."""
        if self._lineage is None:
            self._lineage = [*ceph.lineage(self.cluster, self.pool, self.image), *self.also]
        return self._lineage

    def what(self, key_path: str) -> str:
        return f"{self.pool}/{self.image} (node key {key_path})"

    def unwrap(self, text: str, node_key: bytes, key_path: str) -> keys.Unwrapped:
        return keys.unwrap(text, node_key, self.what(key_path), self.ref, self.lineage,
                           self.accept_unbound)

    def wrap(self, passphrase: bytes, node_key: bytes, key_path: str) -> str:
        return keys.wrap(passphrase, node_key, self.ref, by=key_path)

    def reseal(self, text: str, got: keys.Unwrapped, node_key: bytes, key_path: str) -> None:
        """Best effort, for ``apply``: the record in force sealed for this
        image, if it still is ``text`` (compare-and-set)."""
        if not got.reseal_due(self.ref):
            return
        why = "a version-1 record" if got.bound is None else f"sealed for its parent ({got.bound})"
        try:
            done = ceph.update_meta(self.cluster, self.pool, self.image, {meta.LUKS_KEY: text},
                                    {meta.LUKS_KEY: self.wrap(got.passphrase, node_key,
                                                              key_path)})
        except (rbdbase.CephError, rados.Error) as exc:
            log.warning("%s/%s: wrapped passphrase (%s) not sealed again for the image: %s",
                        self.pool, self.image, why, exc)
            return
        if done:
            log.info("%s/%s: wrapped passphrase (%s) sealed again for the image itself",
                     self.pool, self.image, why)

    def bind_all(self, candidates: Iterable[str], key_root: str) -> str | None:
        """Every record that opens here only through a parent link (or
        ``also``) sealed again for this image, in one write op, with the
        first of ``candidates`` (node key files), then of the records' own
        hints, that opens it. KeyProblem when none does: losing the link
        would lose the passphrase. None when there was nothing to do."""
        texts = {k: v for k, v in ceph.get_meta(self.cluster, self.pool, self.image).items()
                 if k in RECORDS}
        todo: dict[str, tuple[str, keys.Record]] = {}
        for k, text in texts.items():
            try:
                rec = keys.parse(text)
            except keys.KeyProblem:
                continue  # damaged: refused where it is used, whatever happens here
            # Unbound (version 1) records do not depend on the link; one bound
            # to an image that is no parent never opened here anyway.
            if rec.bound is not None and rec.bound != self.ref and rec.bound in self.lineage():
                todo[k] = (text, rec)
        if not todo:
            return None
        paths = list(dict.fromkeys([*candidates, *(r.by for _, r in todo.values() if r.by)]))
        new: dict[str, str | None] = {}
        for k, (text, rec) in todo.items():
            for path in paths:
                try:
                    node_key = keys.read_key_file(path, key_root)
                    got = self.unwrap(text, node_key, path)
                except keys.KeyProblem:
                    continue
                new[k] = self.wrap(got.passphrase, node_key, path)
                break
            else:
                raise keys.KeyProblem(
                    f"{self.pool}/{self.image}: its wrapped passphrase ({k}) is sealed for "
                    f"its parent ({rec.bound}) and no node key here opens it (tried "
                    f"{', '.join(paths) or 'none: the spec names no wrappedBy key'}); "
                    "without the parent link it would open nowhere, so it is kept")
        if not ceph.update_meta(self.cluster, self.pool, self.image,
                                {k: t for k, (t, _) in todo.items()}, new):
            raise keys.KeyProblem(f"{self.pool}/{self.image}: image-meta changed while its "
                                  "wrapped passphrase was sealed again; try again")
        return f"wrapped passphrase sealed for {self.pool}/{self.image} itself"
