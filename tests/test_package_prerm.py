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
    [ -e "$T/policy-forbids-$u" ] && continue
    case $action in
    stop) was=; grep -qx "$u" "$T/active" "$T/activating" && was=1
          for f in active activating; do
              grep -vx "$u" "$T/$f" > "$T/$f.new" || true; mv "$T/$f.new" "$T/$f"
          done
          [ "$u" = rbd-reconciler-shutdown.service ] && [ -n "$was" ] || continue
          if [ -z "$(cat "$T/loaded-execstop")" ]; then
              echo "stopped $u without ExecStop" >> "$T/calls"
          else
              cp "$T/after-release" "$T/held"
          fi ;;
    start)  # as the real one: a unit that is not enabled is not started
        if [ -e "$T/disabled-$u" ]; then
            echo "$u is a disabled or a static unit, not starting it." >&2; continue
        fi
        grep -qx "$u" "$T/active" || echo "$u" >> "$T/active" ;;
    esac
done
exit 0
''',
    "systemctl": r'''#!/bin/sh
echo "systemctl $*" >> "$T/calls"
for u; do :; done  # the unit: the last argument
case $1 in
is-active)
    if grep -qx "$u" "$T/active"; then state=active; rc=0
    elif grep -qx "$u" "$T/activating"; then state=activating; rc=3
    else state=inactive; rc=3; fi
    [ "$2" = --quiet ] || echo "$state"
    exit $rc ;;
daemon-reload)
    [ -e "$T/reload-fails" ] && exit 1
    # The release unit's ExecStop as loaded: its drop-ins of every directory
    # in the order of their names; 'ExecStop=' resets, a value sets it.
    u=rbd-reconciler-shutdown.service
    for d in "$T/etc-systemd/$u.d" "$T/run-systemd/$u.d"; do
        for f in "$d"/*.conf; do [ -e "$f" ] && echo "$(basename "$f") $f"; done
    done | sort | while read -r _ f; do sed -n 's/^ExecStop=//p' "$f"; done > "$T/lines"
    eff="rbd-reconciler release --all"
    while IFS= read -r v; do eff=$v; done < "$T/lines"
    printf '%s\n' "$eff" > "$T/loaded-execstop" ;;
show) cat "$T/loaded-execstop" ;;  # show -p ExecStop --value
start)  # enabled or not; no policy-rc.d on this way
    shift
    for v; do grep -qx "$v" "$T/active" || echo "$v" >> "$T/active"; done ;;
stop)  # keep's stop of the release unit: no policy-rc.d on this way
    [ -e "$T/stop-fails" ] && exit 1
    case " $* " in
    *" --job-mode=ignore-requirements "*) ;;
    *) echo "a stop that carries to the units PartOf= $u" >> "$T/calls" ;;
    esac
    for f in active activating; do
        grep -vx "$u" "$T/$f" > "$T/$f.new" || true; mv "$T/$f.new" "$T/$f"
    done
    if [ -z "$(cat "$T/loaded-execstop")" ]; then
        echo "stopped $u without ExecStop" >> "$T/calls"
    else
        cp "$T/after-release" "$T/held"
    fi ;;
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
        for f in ("calls", "held", "after-release", "activating"):
            (tmp / f).write_text("")
        (tmp / "loaded-execstop").write_text("rbd-reconciler release --all\n")
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
        return [c for c in self.calls()
                if c.startswith(("deb-systemd-invoke", "systemctl stop", "systemctl start"))]


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
                              f"systemctl start {DAEMON} {RELEASE}"]
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
    # Not carried to the applications PartOf= it (they keep running).
    assert node.invoked() == [f"deb-systemd-invoke stop {DAEMON}",
                              f"systemctl stop --job-mode=ignore-requirements {RELEASE}"]
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


# -- attacks (review attack42) ------------------------------------------------

def test_held_lines_reach_the_operator_verbatim(node: Node) -> None:
    # A publish path may hold a backslash (schemas: absolutePath bans control
    # characters, not '\'): dash's echo would turn '\033' into ESC on root's
    # terminal and stop at '\c', hiding every line after it.
    node.held(r"pgdata: unpublish /srv/a\033[2J%sb\cX", "other: unmap /dev/rbd1")
    p = node.run("remove")
    assert p.returncode == 1
    assert r"/srv/a\033[2J%sb\cX" in p.stderr and "\x1b" not in p.stderr
    assert "other: unmap /dev/rbd1" in p.stderr
    p = node.run("remove", RBD_RECONCILER_REMOVE="keep")
    assert p.returncode == 0, p.stderr
    assert r"/srv/a\033[2J%sb\cX" in p.stderr and "other: unmap /dev/rbd1" in p.stderr


def test_keep_whose_daemon_reload_fails_leaves_no_drop_in_and_refuses(node: Node) -> None:
    # Left behind (set -e), the drop-in would take the release out of the
    # release unit's stop until the next boot, with the package still there.
    node.held("pgdata: unpublish /srv/pg")
    (node.tmp / "reload-fails").write_text("")
    p = node.run("remove", RBD_RECONCILER_REMOVE="keep")
    assert not (node.tmp / "run-systemd" / f"{RELEASE}.d").exists()
    assert p.returncode == 1
    assert "not removed" in p.stderr
    assert RELEASE in node.now_active()
    assert DAEMON in node.now_active()  # started again: the package stays
    assert "run it yourself" in p.stderr  # the reload that undoes it failed too


def test_keep_whose_release_unit_stop_fails_refuses(node: Node) -> None:
    node.held("pgdata: unpublish /srv/pg")
    (node.tmp / "stop-fails").write_text("")
    p = node.run("remove", RBD_RECONCILER_REMOVE="keep")
    assert p.returncode == 1 and "policy-rc.d" in p.stderr
    assert not (node.tmp / "run-systemd" / f"{RELEASE}.d").exists()
    assert sorted(node.now_active()) == sorted([DAEMON, RELEASE])


def test_a_daemon_still_starting_counts_as_running(node: Node) -> None:
    # Type=notify: 'activating' until READY=1 (minutes with Ceph down at
    # boot); `is-active --quiet` says no. A refused release must start it again.
    node.active(RELEASE)
    (node.tmp / "activating").write_text(f"{DAEMON}\n")
    node.held("pgdata: unpublish /srv/pg", after_release=("pgdata: unstage busy",))
    p = node.run("remove", RBD_RECONCILER_REMOVE="release")
    assert p.returncode == 1
    assert node.invoked()[-1] == f"systemctl start {DAEMON} {RELEASE}"
    # And a stop that a policy-rc.d forbids leaves it starting: refused.
    node.active()
    (node.tmp / "activating").write_text(f"{DAEMON}\n")
    node.held()
    (node.tmp / f"policy-forbids-{DAEMON}").write_text("")
    p = node.run("remove")
    assert p.returncode == 1 and "still running after the stop" in p.stderr


def test_a_dry_run_that_ignores_sigterm_does_not_hang_the_removal(node: Node) -> None:
    (node.bin / "rbd-reconciler").write_text("#!/bin/sh\ntrap '' TERM\nsleep 30\n")
    text = node.script.read_text()
    assert "LOOK_S=120" in text and "LOOK_KILL_S=10" in text
    node.script.write_text(text.replace("LOOK_S=120", "LOOK_S=1").replace("LOOK_KILL_S=10",
                                                                          "LOOK_KILL_S=1"))
    p = subprocess.run(["sh", "-e", str(node.script), "remove"], capture_output=True, text=True,
                       timeout=20, env={"PATH": f"{node.bin}:/usr/bin:/bin", "T": str(node.tmp)},
                       check=False)
    assert p.returncode == 1 and "did not answer within 1 s" in p.stderr


def test_release_with_a_dry_run_that_cannot_tell_says_so(node: Node) -> None:
    # A config that fails to load: the dry run exits 1 before and after; the
    # refusal must not claim something is "still held", and it names the way out.
    (node.bin / "rbd-reconciler").write_text("#!/bin/sh\necho 'config: bad line 3' >&2\nexit 1\n")
    p = node.run("remove")
    assert p.returncode == 1 and "RBD_RECONCILER_REMOVE=keep" in p.stderr
    assert "only RBD_RECONCILER_REMOVE=keep" in p.stderr
    p = node.run("remove", RBD_RECONCILER_REMOVE="release")
    assert p.returncode == 1
    assert "still held" not in p.stderr and "could not tell" in p.stderr
    assert "bad line 3" in p.stderr
    assert sorted(node.now_active()) == sorted([DAEMON, RELEASE])


def test_release_when_the_release_unit_was_not_active_says_nothing_released_it(
        node: Node) -> None:
    node.active(DAEMON)  # the release unit failed, or was stopped by hand
    node.held("pgdata: unpublish /srv/pg", after_release=())
    p = node.run("remove", RBD_RECONCILER_REMOVE="release")
    assert p.returncode == 1
    assert f"{RELEASE} was not active" in p.stderr
    assert "rbd-reconciler release --all" in p.stderr
    assert node.now_active() == [DAEMON]


def test_keep_with_an_operators_drop_in_that_sets_execstop_again(node: Node) -> None:
    # `systemctl edit rbd-reconciler-shutdown` (override.conf, say, for a
    # longer --deadline) sorts after a drop-in named 50-...: its ExecStop
    # came back, and keep's stop released everything under the applications.
    d = node.tmp / "etc-systemd" / f"{RELEASE}.d"
    d.mkdir(parents=True)
    (d / "override.conf").write_text(
        "[Service]\nExecStop=\nExecStop=/usr/bin/rbd-reconciler release --all --deadline 400\n")
    node.held("pgdata: unpublish /srv/pg", after_release=())
    p = node.run("remove", RBD_RECONCILER_REMOVE="keep")
    assert p.returncode == 0, p.stderr
    assert f"stopped {RELEASE} without ExecStop" in node.calls()
    assert (node.tmp / "held").read_text() == "pgdata: unpublish /srv/pg\n"  # nothing released
    # One that sorts after ours whatever its name: refused, nothing stopped by it.
    (d / "zzzz-mine.conf").write_text("[Service]\nExecStop=/bin/true\n")
    node.active(DAEMON, RELEASE)
    (node.tmp / "calls").write_text("")
    p = node.run("remove", RBD_RECONCILER_REMOVE="keep")
    assert p.returncode == 1 and "ExecStop" in p.stderr
    assert not [c for c in node.calls() if c.startswith("systemctl stop")]
    assert sorted(node.now_active()) == sorted([DAEMON, RELEASE])
    assert not (node.tmp / "run-systemd" / f"{RELEASE}.d").exists()


def test_a_refusal_starts_again_units_that_ran_without_being_enabled(node: Node) -> None:
    # `systemctl start rbd-reconciler` without `enable` (trying it out; the
    # package enables nothing): deb-systemd-invoke starts only enabled units,
    # so after a refused release the daemon and the release unit stayed
    # down, "starting again" said all the same, and nothing released what
    # was left at shutdown.
    for u in (DAEMON, RELEASE):
        (node.tmp / f"disabled-{u}").write_text("")
    node.held("pgdata: unpublish /srv/pg", after_release=("pgdata: unstage busy",))
    p = node.run("remove", RBD_RECONCILER_REMOVE="release")
    assert p.returncode == 1 and "still held after the release" in p.stderr
    assert sorted(node.now_active()) == sorted([DAEMON, RELEASE])
