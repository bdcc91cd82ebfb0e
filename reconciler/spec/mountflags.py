"""The options each stage and publish mount is made with, and whether
mountinfo shows them in force.

An image's content is anyone's who can write to the pool: every mount gets
nosuid,nodev unless its spec asks suid or dev (which only the node config's
mountPrivileges allows: mountopts.py). A remount sets a mount's flags anew,
clearing those it does not name, so what a remount says is everything the
mount should have. mountinfo hides default values and names some options its
own way: "missing" means shown not in force, never merely not shown.

Imported by plan/publishing.py, plan/staging.py, plan/volumeview.py.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from reconciler.spec.mountopts import EXT4, MOUNT, SUPER, XFS, lookup, tables

# What every stage and publish mount gets unless its spec may and does say otherwise.
DEFAULTS = ("nosuid", "nodev")
# A block volume's mounts bind one device node, which must open as a device:
# nodev would break it (and protects nothing: no other node is reachable there).
BLOCK_DEFAULTS = ("nosuid",)


def _group(option: str) -> str:
    """Options of one group replace each other (unknown ones: themselves)."""
    found = lookup(option, [MOUNT, SUPER, EXT4, XFS])
    return found[1].group if found else option


def stage_options(options: Sequence[str], block: bool = False) -> tuple[str, ...]:
    """What a staging mount is mounted (and remounted) with: ``options``, then
    nosuid and nodev (block mode: nosuid) unless they say otherwise."""
    groups = {_group(o) for o in options}
    extra = [d for d in (BLOCK_DEFAULTS if block else DEFAULTS) if _group(d) not in groups]
    return (*options, *extra)


def bind_options(stage: Sequence[str], publish: Sequence[str], block: bool
                 ) -> tuple[str, ...]:
    """What a publish bind is remounted with, besides ro/rw. A bind remount
    sets every per-mount flag anew (one not given is cleared), so it says the
    publish's own, then the staging mount's per-mount flags the publish does
    not override (never suid or dev: a publish asks for those itself), then
    the defaults."""
    own = {_group(o) for o in publish}
    kept = [o for o in stage if (found := lookup(o, [MOUNT])) is not None
            and found[1].group not in own and found[1].privilege is None]
    return stage_options([*publish, *kept], block)


# -- what mountinfo shows ----------------------------------------------------------

# Unknown to the tables (a volume recorded by an older version): compared as
# written, and these the kernel adds or implies are never "missing".
_IMPLIED = frozenset({"rw", "relatime", "seclabel"})


def in_force(option: str, shown: frozenset[str], fs_type: str | None) -> bool | None:
    """Whether mountinfo's options (per-mount and the filesystem's together)
    show ``option`` in force; None: mountinfo cannot tell (a hidden default)."""
    found = lookup(option, tables(fs_type))
    if found is None:
        return option in shown or option in _IMPLIED
    key, spec = found
    if spec.value is None:
        if spec.shown is not None:
            return spec.shown in shown
        if spec.hidden:
            return not shown.intersection(spec.hidden)
        return None
    want = spec.canon(option[len(key):])  # key is "name="
    seen = [o[len(key):] for o in shown if o.startswith(key)]
    if seen:
        return any(spec.canon(s) == want for s in seen)
    return None if spec.default is None else want == spec.canon(spec.default)


def missing(wanted: Iterable[str], shown: frozenset[str], fs_type: str | None
            ) -> tuple[str, ...]:
    """The options of ``wanted`` that mountinfo shows are not in force."""
    return tuple(o for o in wanted if in_force(o, shown, fs_type) is False)


def remountable(option: str, fs_type: str | None) -> bool:
    """A remount changes it (else it takes effect when next mounted)."""
    found = lookup(option, tables(fs_type))
    return found is None or found[1].remount
