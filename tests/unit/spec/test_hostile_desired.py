"""Hostile values in every field of a desired file that reaches a command, a
path or a mount option: the real loader refuses them with a Diagnostic, or
what it accepts is safe to hand on.

"Safe" is the loader's side only (the command builders put ``--`` before
their operands as well): an operand (pool, image, snapshot and volume names,
a systemd unit) never begins with ``-``; every path is absolute, normalised,
without a ``..`` component and inside its root (allowedRoots, the staging
root, keyRoot, /sys/fs/cgroup); mount, mkfs and map options come only from
their allow-lists; suid/dev only where the node config allows; no control or
bidi character anywhere. Never an exception, never the loader's "internal
error" (its last line of defence).

400 examples by default (~3 s); ``RBD_FUZZ_EXAMPLES=N`` for a longer run.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from reconciler.spec import mountopts
from reconciler.spec.config import Config, MountPrivileges, default_config
from reconciler.spec.diagnostics import FORBIDDEN_CHARS
from reconciler.spec.loader import load
from reconciler.spec.mapopts import check_map_options
from reconciler.spec.mkfsopts import check_mkfs_options
from reconciler.spec.model import Volume
from reconciler.spec.mountopts import check_mount_options

pytestmark = pytest.mark.fuzz
EXAMPLES = int(os.environ.get("RBD_FUZZ_EXAMPLES", "400"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])

CONFIG: Config = replace(default_config(), allowed_roots=("/srv", "/mnt/data"),
                         mount_privileges=MountPrivileges(suid_roots=("/srv/trusted",),
                                                          dev_roots=("/mnt/data/devs",)))
RBD_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")


def base(block: bool = False) -> dict[str, Any]:
    """A valid volume with every field that reaches a command, path or option."""
    stage: dict[str, Any] = (
        {"mode": "block", "path": "/srv/stage/vol.dev"} if block else
        {"fsType": "ext4", "mkfsOptions": ["-L", "data"], "mountOptions": ["noatime"],
         "path": "/srv/stage/vol"})
    return {
        "apiVersion": "rbd-reconciler/v1", "kind": "Volume",
        "metadata": {"name": "vol", "labels": {"team": "db"}},
        "spec": {
            "image": {"pool": "rbd", "name": "vol", "size": "1Gi",
                      "source": {"image": {"pool": "rbd", "name": "golden",
                                           "snapshot": "v1"}}},
            "map": {"mapper": "krbd", "options": ["queue_depth=128"]},
            "encryption": {"type": "luks2",
                           "key": {"wrappedBy": "/etc/rbd-reconciler/keys/node.key"}},
            "qos": {"writeIops": 100, "unit": "db.slice"},
            "stage": stage,
            "publish": [{"path": "/srv/app", "readOnly": False, "mountOptions": ["noexec"],
                         "ioCgroup": "/sys/fs/cgroup/pods/a"}],
        },
    }


# Where a hostile value goes: a path into the document (list items may be
# appended past the end).
FIELDS: list[tuple[str | int, ...]] = [
    ("metadata", "name"), ("metadata", "labels", "team"),
    ("spec", "image", "pool"), ("spec", "image", "name"), ("spec", "image", "size"),
    ("spec", "image", "source", "image", "pool"), ("spec", "image", "source", "image", "name"),
    ("spec", "image", "source", "image", "snapshot"),
    ("spec", "map", "mapper"), ("spec", "map", "options", 0), ("spec", "map", "options", 1),
    ("spec", "encryption", "key", "wrappedBy"),
    ("spec", "qos", "unit"), ("spec", "qos", "cgroup"),
    ("spec", "stage", "fsType"), ("spec", "stage", "mode"), ("spec", "stage", "path"),
    ("spec", "stage", "mkfsOptions", 0), ("spec", "stage", "mkfsOptions", 1),
    ("spec", "stage", "mkfsOptions", 2), ("spec", "stage", "mountOptions", 0),
    ("spec", "stage", "mountOptions", 1),
    ("spec", "publish", 0, "path"), ("spec", "publish", 0, "mountOptions", 0),
    ("spec", "publish", 0, "mountOptions", 1), ("spec", "publish", 0, "ioCgroup"),
]

HOSTILE = [
    "-rf", "--help", "-o", "--", "-", "-L", "-J", "device=/dev/sda", "-l", "logdev=/dev/sda",
    "rtdev=/dev/sdb", "journal_path=/dev/sda", "errors=panic", "suid", "dev", "defaults",
    "nosuid,suid", "noatime,dev", "bind", "remount", "loop", "X-mount.mkdir", "-F", "-f",
    "/", "/srv", "/srv/", "/srv/../etc", "/srv/./app", "/srv//app", "/srv/app/..", "srv/app",
    "/etc/shadow", "/var/lib/rbd-reconciler", "/var/lib/rbd-reconciler/staging/../x",
    "/var/lib/rbd-reconciler/staging/x", "/srv/trusted/x", "/mnt/data/devs/x", "..", ".",
    "/sys/fs/cgroup/..", "/sys/fs/cgroup/a/../../../etc", "/sys/fs/cgroup", "-x.service",
    "a.service", "-.slice", "../x.slice", "/etc/rbd-reconciler/keys/../../shadow",
    "/etc/rbd-reconciler/keys", "/etc/rbd-reconciler/keysx/k", "ext4", "xfs", "btrfs",
    "block", "filesystem", "krbd", "nbd", "fuse", "auto", "a\x00b", "a\nb", "\u202e",
    "\u2066x", "x" * 300, "", " ", "1Gi", "-1", "0", "1e9", "99999999999999999999Ti",
    "ms_mode=secure", "ip=1.2.3.4", "secret=AQD", "quiesce-hook=/bin/sh", "$(reboot)",
    "`id`", "a;b", "a b", "*", "~root", "%s", "{}", "[]", "!!python/object:os.system",
]
scalar = st.one_of(
    st.sampled_from(HOSTILE), st.text(max_size=30),
    st.builds(lambda a, b: a + b, st.sampled_from(HOSTILE), st.sampled_from(HOSTILE)),
    st.integers(min_value=-(2**70), max_value=2**70), st.booleans(), st.none(),
    st.floats(allow_nan=False),
)
# Values that pass somewhere: accepted ones must be checked too.
PLAUSIBLE = [
    *sorted(k for t in (mountopts.MOUNT, mountopts.SUPER, mountopts.EXT4, mountopts.XFS)
            for k in t if not k.endswith("=")),
    "commit=30", "data=journal", "errors=remount-ro", "allocsize=64k", "logbsize=64k",
    "/srv/x", "/srv/app2", "/srv/trusted/x", "/mnt/data/devs/x", "/mnt/data/y",
    "/var/lib/rbd-reconciler/staging/v2", "/sys/fs/cgroup/x/y", "x.service", "a@b.scope",
    "/etc/rbd-reconciler/keys/sub/k", "xfs", "ext4", "nbd", "auto", "fuse", "exclusive",
    "-L", "-E", "lazy_itable_init=1", "-q", "golden", "v_1.2-3", "V", "512Mi", 2**30,
]
value = st.one_of(scalar, st.lists(scalar, max_size=3),
                  st.dictionaries(st.sampled_from(["a", "path", "-o"]), scalar, max_size=2))


def mutations(valid: object) -> list[str]:
    """The field's own valid value, bent: most refusals are one character away."""
    s = str(valid)
    return ["-" + s, "--" + s, s + "/..", s + "/../../etc", "../" + s, s + "/.", s + "//x",
            s + ",suid", s + ",dev", s + "=", s + "=/dev/sda", s + "\n", s + "\x00", " " + s,
            s + " ", s.upper(), s + "\u202e", s[:-1], s * 20, "/" + s, s.lstrip("/")]


def get(doc: dict[str, Any], path: tuple[str | int, ...]) -> object:
    node: Any = doc
    for key in path:
        try:
            node = node[key]
        except (KeyError, IndexError):
            return "noatime"
    return node


def put(doc: dict[str, Any], path: tuple[str | int, ...], v: object) -> None:
    """Set ``path`` to ``v``, making what is missing on the way (lists padded
    with a harmless option)."""
    node: Any = doc
    for key, nxt in zip(path, (*path[1:], None), strict=True):
        if isinstance(key, int):
            while len(node) <= key:
                node.append("noatime")
        elif key not in node or not isinstance(node[key], (dict, list)):
            node[key] = [] if isinstance(nxt, int) else {}
        if nxt is None:
            node[key] = v
        else:
            node = node[key]


def under(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def clean(path: str) -> bool:
    """Absolute, normalised, no '.' or '..' component, no control character."""
    return (path.startswith("/") and os.path.normpath(path) == path
            and ".." not in path.split("/") and FORBIDDEN_CHARS.search(path) is None)


def not_an_option(operand: str) -> bool:
    return not operand.startswith("-")


def assert_safe(v: Volume, config: Config) -> None:
    assert DNS_LABEL.fullmatch(v.name), v.name
    for name in (v.image.pool, v.image.name):
        assert RBD_NAME.fullmatch(name) and not_an_option(name), name
    src = v.image.source
    if src is not None:
        for name in (src.pool, src.image, src.snap or "x", src.group or "x"):
            assert RBD_NAME.fullmatch(name) and not_an_option(name), name
    if v.map is not None:
        assert v.map.mapper in ("auto", "krbd", "nbd", "fuse")
        assert check_map_options(v.map.mapper, v.map.options) == []
        assert all("," not in o and not_an_option(o) for o in v.map.options), v.map.options
    if v.encryption is not None:
        key = v.encryption.key_path
        assert clean(key) and under(key, config.encryption.key_root) and \
            key != config.encryption.key_root, key
    if v.qos is not None:
        if v.qos.unit is not None:
            # The root slice is the one unit name starting with "-" (systemctl gets "--").
            assert (not_an_option(v.qos.unit) or v.qos.unit == "-.slice") and \
                "/" not in v.qos.unit, v.qos.unit
        if v.qos.cgroup is not None:
            assert clean(v.qos.cgroup) and under(v.qos.cgroup, "/sys/fs/cgroup"), v.qos.cgroup
    roots = config.allowed_roots
    reserved = (str(config.state_dir), str(config.desired_dir))
    st_ = v.stage
    if st_ is not None:
        assert st_.mode in ("filesystem", "block")
        assert clean(st_.path), st_.path
        assert any(under(st_.path, r) and st_.path != r
                   for r in (*roots, str(config.staging_root))), st_.path
        if st_.mode == "block":
            assert st_.fs_type is None and not st_.mount_options and not st_.mkfs_options
        else:
            assert st_.fs_type in ("ext4", "xfs")
            assert check_mkfs_options(st_.fs_type, st_.mkfs_options) == []
            assert check_mount_options(st_.mount_options, fs_type=st_.fs_type, publish=False,
                                       block=False, path=st_.path,
                                       privileges=config.mount_privileges) == []
    for p in v.publish:
        assert clean(p.path) and any(under(p.path, r) and p.path != r for r in roots), p.path
        assert not any(under(p.path, d) or under(d, p.path) for d in reserved), p.path
        assert check_mount_options(p.mount_options, fs_type=None, publish=True,
                                   block=st_ is not None and st_.mode == "block",
                                   path=p.path, privileges=config.mount_privileges) == []
        if p.io_cgroup is not None:
            assert clean(p.io_cgroup) and under(p.io_cgroup, "/sys/fs/cgroup"), p.io_cgroup
    for o in (*(st_.mount_options if st_ else ()), *(o for p in v.publish
                                                       for o in p.mount_options)):
        assert re.fullmatch(r"[A-Za-z0-9_=.-]+", o) and not_an_option(o), o


@pytest.fixture(scope="module")
def scratch() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="rbd-hostile-"))
    yield d
    shutil.rmtree(d)


@FUZZ
@given(block=st.booleans(), data=st.data(),
       fields=st.lists(st.sampled_from(FIELDS), min_size=1, max_size=4))
def test_hostile_values_are_refused_or_safe(
        scratch: Path, caplog: pytest.LogCaptureFixture, block: bool, data: st.DataObject,
        fields: list[tuple[str | int, ...]]) -> None:
    doc = base(block)
    for path in fields:
        if block and path[:3] in (("spec", "stage", "mkfsOptions"),
                                  ("spec", "stage", "mountOptions")):
            continue  # refused in block mode whatever they hold: elsewhere, the real test
        bent = st.sampled_from(mutations(get(doc, path)))
        put(doc, path, data.draw(st.one_of(bent, st.sampled_from(PLAUSIBLE), value),
                                 label=str(path)))
    f = scratch / "vol.yaml"
    f.write_text(yaml.safe_dump(doc, allow_unicode=True), encoding="utf-8")
    caplog.clear()
    with caplog.at_level(logging.ERROR, logger="reconciler"):
        result = load([scratch], CONFIG)
    assert not caplog.records, [r.getMessage() for r in caplog.records]
    for d in result.diagnostics:
        assert "internal error" not in d.message, d
        assert d.file == f and d.line >= 1 and d.column >= 1 and d.message
        assert FORBIDDEN_CHARS.search(str(d)[len(str(f)):]) is None, str(d)
    if result.volumes:
        assert result.ok
        [vol] = result.volumes
        assert_safe(vol, CONFIG)
    else:
        assert result.diagnostics and f in result.failed_files


def test_the_base_documents_load() -> None:
    """The fuzz starts from files that load: each refusal is the hostile value's."""
    d = Path(tempfile.mkdtemp(prefix="rbd-hostile-"))
    try:
        for block in (False, True):
            (d / "vol.yaml").write_text(yaml.safe_dump(base(block)))
            result = load([d], CONFIG)
            assert result.ok, result.diagnostics
            assert_safe(result.volumes[0], CONFIG)
    finally:
        shutil.rmtree(d)
