"""io.max for a mapped device: on a cgroup v2 directory directly, or on a
systemd unit through systemd (which owns its units' cgroups).

Imported by apply/runner.py; observe/node.py.
"""

from __future__ import annotations

import os

from reconciler.drivers.run import CommandError, Runner
from reconciler.facts.parsers import IO_MAX_KEYS, SYSTEMD_IO, parse_io_max, parse_systemd_io


class IoLimitError(Exception):
    pass


def rdev_of(device: str) -> str:
    st = os.stat(device)
    return f"{os.major(st.st_rdev)}:{os.minor(st.st_rdev)}"


def _no_io_max(target: str) -> IoLimitError:
    return IoLimitError(f"{target}: no io.max (not a cgroup v2 directory, or its parent does "
                        "not enable the io controller: +io in its cgroup.subtree_control)")


def read(runner: Runner, target: str, devices: list[str]) -> dict[str, dict[str, int]]:
    """The limits in force on ``target`` (a cgroup directory or a unit name),
    by "MAJ:MIN" of the devices asked about."""
    if target.startswith("/"):
        try:
            with open(os.path.join(target, "io.max")) as f:
                return parse_io_max(f.read())
        except FileNotFoundError:
            raise _no_io_max(target) from None
    try:
        # "--" before the unit: "-.slice" is a unit, "-H..." must never be an option.
        out = runner.run(["systemctl", "show",
                          *(f"--property={p}" for p in SYSTEMD_IO.values()), "--",
                          target]).stdout
    except CommandError as exc:
        raise IoLimitError(f"unit {target}: systemctl show failed ({exc}); QoS on a unit "
                           "needs systemd as PID 1") from None
    by_path = parse_systemd_io(out)
    wanted = {d: rdev_of(d) for d in devices if os.path.exists(d)}
    return {wanted[path]: limits for path, limits in by_path.items() if path in wanted}


def write(runner: Runner, target: str, device: str, limits: dict[str, int]) -> None:
    """Set ``limits`` for ``device``; every io.max key not in it is lifted."""
    if target.startswith("/"):
        line = rdev_of(device) + " " + " ".join(
            f"{k}={limits.get(k, 'max')}" for k in IO_MAX_KEYS)
        if not os.path.exists(os.path.join(target, "io.max")):
            raise _no_io_max(target)  # cgroupfs answers EACCES for a file it lacks
        try:
            with open(os.path.join(target, "io.max"), "w") as f:
                f.write(line + "\n")
        except OSError as exc:
            raise IoLimitError(f"{target}/io.max: {exc.strerror or exc}") from None
        return
    # --runtime: gone at reboot, as the mapping is; the next pass sets it again.
    props = [f"{prop}={device} {limits.get(key, 'infinity')}"
             for key, prop in SYSTEMD_IO.items()]
    try:
        runner.run(["systemctl", "set-property", "--runtime", "--", target, *props])
    except CommandError as exc:
        raise IoLimitError(f"unit {target}: systemctl set-property failed ({exc})") from None
