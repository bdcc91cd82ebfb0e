"""debian/rbd-reconciler.prerm at a removal: refused while volumes of ours
are up, unless the operator says `release` or `keep`; never past a stop
that did not happen (a policy-rc.d).

The script itself (its #DEBHELPER# part aside) runs under sh with every
command it calls faked: systemctl and deb-systemd-invoke keep which units
are active in a file, `rbd-reconciler release --all --dry-run` answers
what a file says. The booted node runs the real thing (tests/node/guest.py,
"removal").
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PRERM = REPO / "debian" / "rbd-reconciler.prerm"
DAEMON, RELEASE = "rbd-reconciler.service", "rbd-reconciler-shutdown.service"

# The fakes. deb-systemd-invoke stops (or starts) what it is given unless a
# policy-rc.d forbids it (exit 0 all the same, as the real one); a stop of
# the release unit "releases" (the dry run then finds what `after-release`
# says) unless a drop-in clears its ExecStop. systemctl: is-active from the
# state file.
FAKES = {
    "deb-systemd-invoke": r'''#!/bin/sh
echo "deb-systemd-invoke $*" >> "$T/calls"
action=$1; shift
[ -e "$T/policy-forbids" ] && exit 0
for u in "$@"; do
    case $action in
    stop) grep -vx "$u" "$T/active" > "$T/active.new" || true; mv "$T/active.new" "$T/active"
          [ "$u" = rbd-reconciler-shutdown.service ] || continue
          if grep -qsx 'ExecStop=' "$T/run-systemd/$u.d/50-package-removed.conf"; then
              echo "stopped $u without ExecStop" >> "$T/calls"
          else
              cp "$T/after-release" "$T/held"
          fi ;;
    start) echo "$u" >> "$T/active" ;;
    esac
done
exit 0
''',
    "systemctl": r'''#!/bin/sh
echo "systemctl $*" >> "$T/calls"
case $1 in
is-active) grep -qx "$3" "$T/active"; exit $? ;;
esac
exit 0
''',
    "rbd-reconciler": r'''#!/bin/sh
echo "rbd-reconciler $*" >> "$T/calls"
if [ -s "$T/held" ]; then sed 's/^/held: /' "$T/held"; exit 2; fi
echo "release --all has nothing to take down"
''',
}


class Node:
    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.bin = tmp / "bin"
        self.bin.mkdir()
        (tmp / "run-systemd").mkdir()
        for name, text in FAKES.items():
            (self.bin / name).write_text(text)
            (self.bin / name).chmod(0o755)
        for f in ("calls", "held", "after-release"):
            (tmp / f).write_text("")
        self.active(DAEMON, RELEASE)
        text = PRERM.read_text().replace("#DEBHELPER#", "") \
            .replace("/run/systemd/system", str(tmp / "run-systemd")) \
            .replace("/usr/bin/rbd-reconciler", str(self.bin / "rbd-reconciler"))
        self.script = tmp / "prerm"
        self.script.write_text(text)

    def active(self, *units: str) -> None:
        (self.tmp / "active").write_text("".join(f"{u}\n" for u in units))

    def held(self, *lines: str, after_release: tuple[str, ...] = ()) -> None:
        (self.tmp / "held").write_text("".join(f"{x}\n" for x in lines))
        (self.tmp / "after-release").write_text("".join(f"{x}\n" for x in after_release))

    def run(self, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["sh", "-e", str(self.script), *args], capture_output=True, text=True, timeout=60,
            env={"PATH": f"{self.bin}:/usr/bin:/bin", "T": str(self.tmp), **env}, check=False)

    def now_active(self) -> list[str]:
        return (self.tmp / "active").read_text().split()

    def calls(self) -> list[str]:
        return (self.tmp / "calls").read_text().splitlines()

    def invoked(self) -> list[str]:
        return [c for c in self.calls() if c.startswith("deb-systemd-invoke")]


@pytest.fixture
def node(tmp_path: Path) -> Node:
    return Node(tmp_path)


def test_nothing_of_ours_up_stops_both_units_and_goes(node: Node) -> None:
    p = node.run("remove")
    assert p.returncode == 0, p.stderr
    assert node.invoked() == [f"deb-systemd-invoke stop {DAEMON} {RELEASE}"]
    assert node.now_active() == []


def test_volumes_up_refuse_the_removal_and_stop_nothing(node: Node) -> None:
    node.held("pgdata: unpublish /srv/pg", "pgdata: unmap /dev/rbd0")
    p = node.run("remove")
    assert p.returncode == 1
    assert "not removed: volumes of ours are up" in p.stderr
    assert "held: pgdata: unpublish /srv/pg" in p.stderr  # what, for the operator
    assert "RBD_RECONCILER_REMOVE=release" in p.stderr and "RBD_RECONCILER_REMOVE=keep" in p.stderr
    assert node.invoked() == [] and node.now_active() == [DAEMON, RELEASE]


def test_release_stops_the_units_which_release_everything(node: Node) -> None:
    node.held("pgdata: unpublish /srv/pg")  # the release unit's stop clears it
    p = node.run("remove", RBD_RECONCILER_REMOVE="release")
    assert p.returncode == 0, p.stderr
    assert node.invoked() == [f"deb-systemd-invoke stop {DAEMON} {RELEASE}"]
    assert node.now_active() == []


def test_release_that_leaves_something_held_refuses_and_starts_the_units_again(
        node: Node) -> None:
    node.held("pgdata: unpublish /srv/pg", after_release=("pgdata: unstage busy",))
    p = node.run("remove", RBD_RECONCILER_REMOVE="release")
    assert p.returncode == 1
    assert "still held after the release" in p.stderr and "pgdata: unstage busy" in p.stderr
    assert node.invoked() == [f"deb-systemd-invoke stop {DAEMON} {RELEASE}",
                              f"deb-systemd-invoke start {DAEMON} {RELEASE}"]
    assert sorted(node.now_active()) == sorted([DAEMON, RELEASE])


def test_a_policy_rc_d_that_forbids_the_stop_refuses_the_removal(node: Node) -> None:
    (node.tmp / "policy-forbids").write_text("")
    p = node.run("remove")
    assert p.returncode == 1
    assert "still running after the stop" in p.stderr and "policy-rc.d" in p.stderr
    assert node.now_active() == [DAEMON, RELEASE]


def test_keep_stops_the_daemon_and_the_release_unit_without_its_release(node: Node) -> None:
    node.held("pgdata: unpublish /srv/pg", after_release=())
    p = node.run("remove", RBD_RECONCILER_REMOVE="keep")
    assert p.returncode == 0, p.stderr
    assert "NOTHING releases them at shutdown" in p.stderr
    assert "pgdata: unpublish /srv/pg" in p.stderr  # what stays, said
    assert f"stopped {RELEASE} without ExecStop" in node.calls()
    assert node.invoked() == [f"deb-systemd-invoke stop {DAEMON}",
                              f"deb-systemd-invoke stop {RELEASE}"]
    assert node.now_active() == []
    # The drop-in was for that stop only.
    assert not (node.tmp / "run-systemd" / f"{RELEASE}.d").exists()
    assert (node.tmp / "held").read_text() == "pgdata: unpublish /srv/pg\n"


def test_an_unknown_answer_refuses(node: Node) -> None:
    p = node.run("remove", RBD_RECONCILER_REMOVE="yes")
    assert p.returncode == 1 and "expected 'release' or 'keep'" in p.stderr
    (node.bin / "rbd-reconciler").write_text("#!/bin/sh\necho 'config: bad line 3' >&2\nexit 1\n")
    p = node.run("remove")
    assert p.returncode == 1 and "could not tell" in p.stderr and "bad line 3" in p.stderr
    assert node.invoked() == []


@pytest.mark.parametrize("args", [("upgrade", "9.9"), ("failed-upgrade", "9.9"), ("deconfigure",)])
def test_other_calls_touch_nothing(node: Node, args: tuple[str, ...]) -> None:
    node.held("pgdata: unpublish /srv/pg")
    p = node.run(*args)
    assert p.returncode == 0, p.stderr
    assert node.calls() == []


def test_not_on_systemd_or_in_a_dpkg_root_it_does_nothing(node: Node) -> None:
    node.held("pgdata: unpublish /srv/pg")
    assert node.run("remove", DPKG_ROOT="/target").returncode == 0
    os.rmdir(node.tmp / "run-systemd")
    assert node.run("remove").returncode == 0
    assert node.calls() == []
