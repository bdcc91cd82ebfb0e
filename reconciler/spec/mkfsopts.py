"""Which mkfs options a spec may pass: an allow-list per filesystem.

``mkfsOptions`` becomes argv words between ``mkfs.TYPE`` and the device, so
an option that names another device or file (``-l logdev=/dev/sda`` for xfs,
``-J device=`` or ``-d DIR`` for ext4, ``-r rtdev=``, ``-d file=``) or a stray
word that mkfs reads as the device formats or reads something else. Only
options that shape the filesystem on our own device pass, each flag in its
own word and its value in the next: ``["-L", "data", "-O", "^has_journal"]``.

Imported by spec/builder.py.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from reconciler.spec.diagnostics import excerpt

Check = Callable[[str], bool]


def _re(pattern: str) -> Check:
    compiled = re.compile(pattern)
    return lambda v: compiled.fullmatch(v) is not None


NUMBER = _re(r"[0-9]{1,12}")
BOOL = _re(r"[01]")
# xfs takes sizes with a unit: 64k, 1g, 8s (sectors), 4b (blocks).
XFS_SIZE = _re(r"[0-9]{1,12}[kmgtpesb]?")
_UUID = r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}"
UUID = _re(_UUID)
PRINTABLE = _re(r"[\x21-\x7e][\x20-\x7e]*")  # plain ASCII, no leading space


@dataclass(frozen=True)
class Flag:
    """One flag: without a value (``value is None``), with a value checked by
    ``value``, or with comma-separated ``sub`` options (``name`` or ``name=value``)."""

    help: str
    value: Check | None = None
    sub: dict[str, Check | None] | None = None  # sub-option -> value check (None: no value)


def _label(limit: int) -> Check:
    return lambda v: PRINTABLE(v) and len(v.encode()) <= limit


EXT4: dict[str, Flag] = {
    "-b": Flag("block size in bytes", NUMBER),
    "-C": Flag("cluster size in bytes (bigalloc)", NUMBER),
    "-e": Flag("errors behaviour: continue or remount-ro", _re(r"continue|remount-ro")),
    "-E": Flag("extended options", sub={
        "stride": NUMBER, "stripe_width": NUMBER, "stripe-width": NUMBER, "resize": NUMBER,
        "lazy_itable_init": BOOL, "lazy_journal_init": BOOL, "packed_meta_blocks": BOOL,
        "assume_storage_prezeroed": BOOL,
        "num_backup_sb": _re(r"[012]"), "root_owner": _re(r"[0-9]{1,10}:[0-9]{1,10}"),
        "discard": None, "nodiscard": None, "encoding": _re(r"utf8(-12\.1)?"),
        "encoding_flags": _re(r"strict"), "quotatype": _re(r"(usrquota|grpquota|prjquota)"
                                                           r"(:(usrquota|grpquota|prjquota))*"),
    }),
    "-g": Flag("blocks per group", NUMBER),
    "-G": Flag("groups per flex group", NUMBER),
    "-i": Flag("bytes per inode", NUMBER),
    "-I": Flag("inode size", NUMBER),
    "-j": Flag("an internal journal"),
    "-J": Flag("journal options (internal journal only)",
               sub={"size": NUMBER, "fast_commit_size": NUMBER}),
    "-L": Flag("volume label, at most 16 bytes of printable ASCII", _label(16)),
    "-m": Flag("reserved blocks percentage", _re(r"[0-9]{1,2}(\.[0-9]{1,3})?")),
    "-N": Flag("number of inodes", NUMBER),
    "-O": Flag("features, comma-separated, ^ to clear one (not journal_dev)",
               _re(r"\^?(?!journal_dev\b)[a-z0-9_]{1,32}(,\^?(?!journal_dev\b)[a-z0-9_]{1,32})*")),
    "-q": Flag("quiet"),
    "-T": Flag("usage type from mke2fs.conf", _re(r"[a-z0-9_]{1,32}(,[a-z0-9_]{1,32})*")),
    "-U": Flag("filesystem UUID, or clear, random or time", _re(_UUID + "|clear|random|time")),
}

XFS: dict[str, Flag] = {
    "-b": Flag("block size", sub={"size": XFS_SIZE}),
    "-m": Flag("metadata options", sub={
        "crc": BOOL, "finobt": BOOL, "rmapbt": BOOL, "reflink": BOOL, "inobtcount": BOOL,
        "bigtime": BOOL, "uuid": UUID,
    }),
    "-d": Flag("data section (no file=, name=, size=)", sub={
        "agcount": NUMBER, "agsize": XFS_SIZE, "su": XFS_SIZE, "sunit": NUMBER, "sw": NUMBER,
        "swidth": NUMBER, "noalign": None, "cowextsize": NUMBER, "extszinherit": NUMBER,
        "projinherit": NUMBER,
    }),
    "-i": Flag("inode options", sub={
        "size": XFS_SIZE, "maxpct": NUMBER, "align": BOOL, "sparse": BOOL, "attr": _re(r"[12]"),
        "projid32bit": BOOL, "perblock": NUMBER,
    }),
    "-l": Flag("log options (internal log only)", sub={
        "size": XFS_SIZE, "version": _re(r"[12]"), "su": XFS_SIZE, "sunit": NUMBER,
        "lazy-count": BOOL, "internal": _re(r"1"),
    }),
    "-n": Flag("naming options", sub={
        "size": XFS_SIZE, "version": _re(r"2|ci"), "ftype": BOOL,
    }),
    "-s": Flag("sector size", sub={"size": XFS_SIZE}),
    "-L": Flag("volume label, at most 12 bytes of printable ASCII", _label(12)),
    "-K": Flag("do not discard blocks"),
    "-q": Flag("quiet"),
}

ALLOWED: dict[str, dict[str, Flag]] = {"ext4": EXT4, "xfs": XFS}


def describe(fs_type: str) -> str:
    """The allowed flags, for error messages: ``-b N, -E stride=|... , -j``."""
    parts = []
    for flag, spec in ALLOWED[fs_type].items():
        if spec.sub is not None:
            parts.append(f"{flag} {'|'.join(k + ('=' if v else '') for k, v in spec.sub.items())}")
        else:
            parts.append(flag if spec.value is None else f"{flag} VALUE")
    return ", ".join(parts)


def _check_sub(flag: str, spec: Flag, value: str) -> str | None:
    assert spec.sub is not None
    for item in value.split(","):
        name, eq, arg = item.partition("=")
        if name not in spec.sub:
            return (f"{flag} sub-option {excerpt(name)} is not allowed; allowed: "
                    f"{', '.join(spec.sub)}")
        check = spec.sub[name]
        if check is None and eq:
            return f"{flag} {name} takes no value"
        if check is not None and not (eq and check(arg)):
            return f"{flag} {name}= needs a valid value, got {excerpt(arg) if eq else 'none'}"
    return None


def check_mkfs_options(fs_type: str, options: Sequence[str]) -> list[tuple[int, str]]:
    """(index, message) for each word of ``options`` that mkfs.``fs_type``
    must not get. Each flag is one word and its value the next word."""
    allowed = ALLOWED[fs_type]
    problems: list[tuple[int, str]] = []
    i = 0
    while i < len(options):
        word = options[i]
        spec = allowed.get(word)
        if spec is None:
            # What follows cannot be read reliably (is it this word's value?): stop.
            problems.append((i, f"{excerpt(word)} is not an allowed mkfs.{fs_type} option "
                                f"(a flag and its value are separate items); allowed: "
                                f"{describe(fs_type)}"))
            break
        if spec.value is None and spec.sub is None:
            i += 1
            continue
        if i + 1 >= len(options):
            problems.append((i, f"{word} ({spec.help}) needs a value in the next item"))
            break
        value = options[i + 1]
        if spec.sub is not None:
            if (msg := _check_sub(word, spec, value)) is not None:
                problems.append((i + 1, msg))
        elif spec.value is not None and not spec.value(value):
            problems.append((i + 1, f"{excerpt(value)} is not a valid value for {word} "
                                    f"({spec.help})"))
        i += 2
    return problems
