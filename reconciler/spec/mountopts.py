"""Which mount options a spec may pass: an allow-list per filesystem.

``mountOptions`` reach ``mount -o``. Some name another device (xfs
``logdev=``/``rtdev=``, ext4 ``journal_path=``/``journal_dev=``), let a file
panic the node (``errors=panic``), make mount(8) do something else
(``bind``, ``remount``, ``loop``, ``X-mount.mkdir``) or undo nosuid/nodev
(``suid``, ``dev``, ``defaults``). Only the options listed here pass, per
filesystem, each checked like ``mkfsOptions``.

An image's content is whatever any client with write access to the pool put
there: a setuid-root binary or a world-writable device node on it must not
become privilege on this node. So every stage and publish mount is
``nosuid,nodev`` (mountflags.py) unless the node config (``mountPrivileges``)
lets that path ask for ``suid`` or ``dev``; a file alone never can.

The tables also say how mountinfo shows an option in force (the kernel hides
defaults, and shows some options under another name) and whether a remount
changes it: mountflags.py reads them, so the planner repairs drift without
remounting forever.

Imported by csi/node.py; spec/builder.py, spec/mountflags.py.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from reconciler.spec.config import MountPrivileges
from reconciler.spec.diagnostics import excerpt

Check = Callable[[str], bool]


def _same(value: str) -> str:
    return value


def _one_of(*values: str) -> Check:
    return lambda v: v in values


def _number(low: int, high: int) -> Check:
    digits = re.compile(r"[0-9]{1,10}")
    return lambda v: digits.fullmatch(v) is not None and low <= int(v) <= high


def _pow2(low: int, high: int, zero: bool = False) -> Check:
    number = _number(0, high)
    return lambda v: number(v) and ((zero and int(v) == 0) or (
        int(v) >= low and int(v) & (int(v) - 1) == 0))


_XFS_SIZE = re.compile(r"([0-9]{1,10})([kmg]?)")
_UNITS = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30}


def _xfs_bytes(value: str) -> str:
    """xfs sizes as bytes: mountinfo shows ``allocsize=1m`` as ``allocsize=1024k``."""
    m = _XFS_SIZE.fullmatch(value)
    return str(int(m[1]) * _UNITS[m[2]]) if m else value


def _xfs_size(*allowed: int) -> Check:
    return lambda v: _XFS_SIZE.fullmatch(v) is not None and int(_xfs_bytes(v)) in allowed


@dataclass(frozen=True)
class Option:
    """One allowed option: a flag (``value`` None), or ``name=VALUE``."""

    help: str
    group: str  # two options of one group contradict each other (mount takes the last)
    value: Check | None = None
    per_mount: bool = False  # a flag of the mount itself (a bind has its own), else the fs's
    remount: bool = True  # a remount changes it; else it takes effect at the next stage
    shown: str | None = None  # in force: mountinfo shows this word
    hidden: tuple[str, ...] = ()  # in force: mountinfo shows none of these
    default: str | None = None  # name=VALUE: in force while mountinfo shows no NAME=
    canon: Callable[[str], str] = _same  # values compared as this
    privilege: str | None = None  # suid | dev: only where mountPrivileges allows


def _flag(help: str, group: str, shown: str | None = None, hidden: tuple[str, ...] = (),
          remount: bool = True) -> Option:
    return Option(help, group, remount=remount, shown=shown, hidden=hidden)


def _mount(help: str, group: str, shown: str | None = None, hidden: tuple[str, ...] = (),
           privilege: str | None = None) -> Option:
    return Option(help, group, per_mount=True, shown=shown, hidden=hidden, privilege=privilege)


# Flags of the mount itself: a publish (a bind) takes these and no others.
# Keys are the whole option; ``name=`` keys take a value.
MOUNT: dict[str, Option] = {
    "nosuid": _mount("setuid and setgid bits are ignored (the default)", "suid", "nosuid"),
    "suid": _mount("setuid and setgid bits take effect (mountPrivileges.suidRoots only)", "suid",
                   hidden=("nosuid",), privilege="suid"),
    "nodev": _mount("device nodes do not open (the default)", "dev", "nodev"),
    "dev": _mount("device nodes open as devices (mountPrivileges.devRoots only)", "dev",
                  hidden=("nodev",), privilege="dev"),
    "noexec": _mount("nothing on it is executed", "exec", "noexec"),
    "exec": _mount("programs on it may be executed", "exec", hidden=("noexec",)),
    "noatime": _mount("no access times", "atime", "noatime"),
    "relatime": _mount("access times relative to modify times", "atime", "relatime"),
    "strictatime": _mount("every access time", "atime", hidden=("noatime", "relatime")),
    "nodiratime": _mount("no access times on directories", "diratime", "nodiratime"),
    "diratime": _mount("access times on directories", "diratime", hidden=("nodiratime",)),
}

# The filesystem's own, whatever its type: a stage only.
SUPER: dict[str, Option] = {
    "ro": _flag("read-only filesystem", "ro", "ro"),
    # Never drift: an ext4 that went read-only on errors=remount-ro is not forced back.
    "rw": _flag("read-write filesystem", "ro"),
    "sync": _flag("synchronous writes", "sync", "sync"),
    "async": _flag("asynchronous writes", "sync", hidden=("sync",)),
    # The kernel keeps dirsync out of what a remount changes.
    "dirsync": _flag("synchronous directory updates", "dirsync", "dirsync", remount=False),
    "lazytime": _flag("timestamps kept in memory", "lazytime", "lazytime"),
    "nolazytime": _flag("timestamps written at once", "lazytime", hidden=("lazytime",)),
}

EXT4: dict[str, Option] = {
    "discard": _flag("discard freed blocks", "discard", "discard"),
    "nodiscard": _flag("no discard", "discard", hidden=("discard",)),
    # The kernel refuses to change the data mode on a remount.
    "data=": Option("ordered, writeback or journal", "data", _one_of(
        "ordered", "writeback", "journal"), remount=False, default="ordered"),
    "data_err=": Option("ignore or abort", "data_err", _one_of("ignore", "abort"),
                        default="ignore"),
    "barrier": _flag("write barriers", "barrier", hidden=("nobarrier",)),
    "barrier=1": _flag("write barriers", "barrier", hidden=("nobarrier",)),
    "nobarrier": _flag("no write barriers", "barrier", "nobarrier"),
    "barrier=0": _flag("no write barriers", "barrier", "nobarrier"),
    "commit=": Option("seconds between journal commits, 0-3600 (0 means 5)", "commit",
                      _number(0, 3600), default="5", canon=lambda v: "5" if v == "0" else v),
    # Not panic: a file must not be able to take the node down.
    "errors=": Option("continue or remount-ro", "errors", _one_of("continue", "remount-ro")),
    "journal_checksum": _flag("journal checksums", "journal_checksum",
                              hidden=("nojournal_checksum",)),
    "nojournal_checksum": _flag("no journal checksums", "journal_checksum",
                                "nojournal_checksum"),
    "auto_da_alloc": _flag("flush on replace-by-rename", "auto_da_alloc",
                           hidden=("noauto_da_alloc",)),
    "noauto_da_alloc": _flag("no flush on replace-by-rename", "auto_da_alloc",
                             "noauto_da_alloc"),
    "inode_readahead_blks=": Option("inode table blocks read ahead: 0 or a power of two up to "
                                    "2^30", "inode_readahead_blks", _pow2(1, 2**30, zero=True),
                                    default="32"),
    "stripe=": Option("blocks per RAID stripe, 0-2^31-1", "stripe", _number(0, 2**31 - 1)),
    "dioread_nolock": _flag("direct reads without the inode lock", "dioread",
                            hidden=("nodioread_nolock",)),
    "dioread_lock": _flag("direct reads under the inode lock", "dioread", "nodioread_nolock"),
    # Delayed allocation cannot be switched on a remount.
    "delalloc": _flag("delayed allocation", "delalloc", hidden=("nodelalloc",), remount=False),
    "nodelalloc": _flag("no delayed allocation", "delalloc", "nodelalloc", remount=False),
    "init_itable": _flag("zero inode tables in the background", "init_itable",
                         hidden=("noinit_itable",)),
    "noinit_itable": _flag("no background inode table zeroing", "init_itable",
                           "noinit_itable"),
    "max_batch_time=": Option("microseconds, 0-10000000", "max_batch_time",
                              _number(0, 10_000_000), default="15000"),
    "min_batch_time=": Option("microseconds, 0-10000000", "min_batch_time",
                              _number(0, 10_000_000), default="0"),
    "journal_ioprio=": Option("journal I/O priority, 0-7", "journal_ioprio", _number(0, 7),
                              default="3"),
    "block_validity": _flag("metadata block checks", "block_validity",
                            hidden=("noblock_validity",)),
    "noblock_validity": _flag("no metadata block checks", "block_validity",
                              "noblock_validity"),
    "usrquota": _flag("user quota", "usrquota", "usrquota"),
    "quota": _flag("user quota", "quota", "usrquota"),
    "grpquota": _flag("group quota", "grpquota", "grpquota"),
    "prjquota": _flag("project quota (the filesystem needs the quota feature)", "prjquota",
                      "prjquota"),
    "noquota": _flag("no quota", "noquota"),
}

# xfs changes little on a remount: most options take effect at the next stage.
XFS: dict[str, Option] = {
    "discard": _flag("discard freed blocks", "discard", "discard", remount=False),
    "nodiscard": _flag("no discard", "discard", hidden=("discard",), remount=False),
    "inode64": _flag("inodes anywhere", "inode", "inode64"),
    "inode32": _flag("inodes in the first TiB", "inode", "inode32"),
    "largeio": _flag("report large I/O sizes", "largeio", "largeio", remount=False),
    "nolargeio": _flag("report page-size I/O", "largeio", hidden=("largeio",), remount=False),
    # A clone of an xfs volume carries its source's UUID: mounting both here needs it.
    "nouuid": _flag("ignore the UUID (a clone beside its source)", "nouuid", "nouuid",
                    remount=False),
    "allocsize=": Option("delayed allocation size: a power of two 4k-1g", "allocsize",
                         lambda v: _XFS_SIZE.fullmatch(v) is not None and _pow2(4096, 2**30)(
                             _xfs_bytes(v)), remount=False, canon=_xfs_bytes),
    "logbufs=": Option("in-memory log buffers, 2-8", "logbufs", _number(2, 8), remount=False,
                       default="8"),
    "logbsize=": Option("log buffer size: 16k, 32k, 64k, 128k or 256k", "logbsize",
                        _xfs_size(*(2**i for i in range(14, 19))), remount=False,
                        default="32k", canon=_xfs_bytes),
    "swalloc": _flag("allocate at stripe width", "swalloc", "swalloc", remount=False),
    "wsync": _flag("synchronous namespace changes", "wsync", "wsync", remount=False),
    "noquota": _flag("no quota", "noquota", "noquota", remount=False),
    # mountinfo names the quota options its own way: their drift is not tracked.
    **{q: _flag(f"{what} quota", "quota-" + q, remount=False)
       for q, what in (("quota", "user"), ("usrquota", "user"), ("uquota", "user"),
                       ("uqnoenforce", "user (not enforced)"),
                       ("qnoenforce", "user (not enforced)"), ("grpquota", "group"),
                       ("gquota", "group"), ("gqnoenforce", "group (not enforced)"),
                       ("prjquota", "project"), ("pquota", "project"),
                       ("pqnoenforce", "project (not enforced)"))},
}

ALLOWED: dict[str, dict[str, Option]] = {"ext4": EXT4, "xfs": XFS}

# Options people reach for that are refused on purpose, and why.
WHY_NOT: dict[str, str] = {
    "errors=panic": "a file must not be able to panic the node",
    "journal_path": "it names another device",
    "journal_dev": "it names another device",
    "logdev": "it names another device",
    "rtdev": "it names another device",
    "usrjquota": "it names a file",
    "grpjquota": "it names a file",
    "defaults": "it means suid, dev and exec; say what you want instead",
    "bind": "it makes mount(8) do something else (publish makes the binds)",
    "rbind": "it makes mount(8) do something else (publish makes the binds)",
    "remount": "it makes mount(8) do something else (the planner remounts)",
    "move": "it makes mount(8) do something else",
    "loop": "it sets up a loop device over a file",
    "offset": "it sets up a loop device over a file",
    "sizelimit": "it sets up a loop device over a file",
    "helper": "it runs a mount helper program",
    "context": "SELinux labels are the node's to set",
    "fscontext": "SELinux labels are the node's to set",
    "defcontext": "SELinux labels are the node's to set",
    "rootcontext": "SELinux labels are the node's to set",
    "norecovery": "it skips the journal: the filesystem is damaged or data goes missing",
    "noload": "it skips the journal: the filesystem is damaged or data goes missing",
    "user": "an fstab option, meaningless here",
    "users": "an fstab option, meaningless here",
    "nouser": "an fstab option, meaningless here",
    "owner": "an fstab option, meaningless here",
    "group": "an fstab option, meaningless here",
    "auto": "an fstab option, meaningless here",
    "noauto": "an fstab option, meaningless here",
    "nofail": "an fstab option, meaningless here",
    "_netdev": "an fstab option, meaningless here",
}

_PRIVILEGE_KEY = {"suid": "suidRoots", "dev": "devRoots"}
_PRIVILEGE_WHY = {"suid": "setuid binaries on the volume would run as their owner here",
                  "dev": "device nodes on the volume would open this node's devices"}


def tables(fs_type: str | None, publish: bool = False) -> list[dict[str, Option]]:
    """The tables a stage of ``fs_type`` draws from; a bind (or no fs type): MOUNT only."""
    if publish or fs_type is None:
        return [MOUNT]
    return [MOUNT, SUPER, ALLOWED.get(fs_type, {})]


def lookup(option: str, among: Iterable[dict[str, Option]]) -> tuple[str, Option] | None:
    """The table entry for ``option``: the whole word, else ``name=``."""
    name, eq, _ = option.partition("=")
    for table in among:
        if option in table:
            return option, table[option]
        if eq and name + "=" in table:
            return name + "=", table[name + "="]
    return None


def describe(fs_type: str | None, publish: bool = False) -> str:
    """The allowed options, for error messages: ``nosuid, ..., commit=N``."""
    return ", ".join(key + ("VALUE" if spec.value is not None else "")
                     for table in tables(fs_type, publish) for key, spec in table.items())


def _under(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def _refused(option: str) -> str | None:
    name = option.partition("=")[0]
    if option in WHY_NOT or name in WHY_NOT:
        return WHY_NOT.get(option) or WHY_NOT[name]
    if name.lower().startswith("x-"):
        return "a userspace option of mount(8) (X-mount.mkdir, .owner, .idmap ...)"
    if name.startswith("make-"):
        return "it changes mount propagation, not this mount"
    return None


def check_mount_options(options: Sequence[str], *, fs_type: str | None, publish: bool,
                        block: bool, path: str, privileges: MountPrivileges
                        ) -> list[tuple[int, str]]:
    """(index, message) for each option that ``mount -o`` must not get.
    ``publish``: a bind's own options (per-mount flags only); else a stage's
    (``fs_type`` ext4 or xfs). ``path``: where the mount goes, for suid/dev."""
    problems: list[tuple[int, str]] = []
    groups: dict[str, tuple[int, str]] = {}
    what = "publish" if publish else f"{fs_type}"
    for i, opt in enumerate(options):
        if (why := _refused(opt)) is not None:
            problems.append((i, f"mount option {excerpt(opt)} is not allowed: {why}"))
            continue
        if publish and opt in ("ro", "rw"):
            problems.append((i, f"mount option {opt!r} is not allowed here: readOnly says "
                                "whether a publish is read-only"))
            continue
        found = lookup(opt, tables(fs_type, publish))
        if found is None:
            if publish and lookup(opt, [*tables("ext4"), XFS]) is not None:
                problems.append((i, f"mount option {excerpt(opt)} is the filesystem's: a "
                                    "publish is a bind and takes per-mount options only "
                                    f"({describe(None, True)}); put it in stage.mountOptions"))
            else:
                problems.append((i, f"{excerpt(opt)} is not an allowed {what} mount option; "
                                    f"allowed: {describe(fs_type, publish)}"))
            continue
        key, spec = found
        if spec.value is not None and not spec.value(opt.partition("=")[2]):
            problems.append((i, f"{excerpt(opt.partition('=')[2])} is not a valid value for "
                                f"{key} ({spec.help})"))
            continue
        if block and spec.group == "dev":
            problems.append((i, f"mount option {opt!r} is not allowed in block mode: the bind "
                                "of the device node is never nodev (it must open as a device)"))
            continue
        if spec.privilege is not None:
            roots = (privileges.suid_roots if spec.privilege == "suid"
                     else privileges.dev_roots)
            if not any(_under(path, r) for r in roots):
                key_ = _PRIVILEGE_KEY[spec.privilege]
                problems.append((i, f"mount option {opt!r} is allowed only at or under the "
                                    f"node config's mountPrivileges.{key_} "
                                    f"({', '.join(roots) or 'none set'}), and {excerpt(path)} "
                                    f"is not: {_PRIVILEGE_WHY[spec.privilege]}"))
                continue
        first = groups.setdefault(spec.group, (i, opt))
        if first[1] != opt:
            problems.append((i, f"mount option {excerpt(opt)} contradicts {excerpt(first[1])} "
                                f"(item {first[0]}): mount would take the last one"))
    return problems
