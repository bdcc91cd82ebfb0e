"""Issue 37, item 3: `status`, `plan` and `explain` give the same answer
through the daemon as alone (docs/cli.md: "prints what it did as it would
have printed it alone"), in every state a node can be in.

One node and one daemon for the whole module (resync 600 s: only events and
questions start its passes); each test puts the node in one state, asks
each command twice, through the daemon's control socket and alone (a config
whose controlSocket nobody serves: ``local_config``), and compares the
answers: exit codes, and the JSON documents field by field (status' phases,
plan's steps and refusals, explain's verdict), each after ``normalised``.
Each test leaves the node healthy again (in a ``finally``), but the last
one (a fence is left for the module's teardown).

What ``normalised`` takes out is this allow-list, and only it; anything else
that differs is a difference the issue forbids:

- ``daemon`` (status rows, explain): the daemon's status file, read by
  either side from the same file; it says what the daemon last recorded and
  when (where an answer came from, and how old), not what is there. Both
  sides print it from that file, so it can differ only by a write between
  the two reads.
- ``applying`` (plan entries): "the daemon is running these steps now", an
  addition of the daemon's (a command alone cannot know what another
  process runs). Its words (``note: the daemon is running these steps now``)
  are only in the human form, not compared here.
- ``stalled.seconds``, and the ``N`` in "none completed for N s" of the
  stall's words: how long the stall had lasted when it was looked at, i.e.
  how old the look is; two looks a moment apart count differently.
- ``stalled.since``, ``stalled.lastCompleted`` and their words ("(the last
  I/O completed at T)" or "(none completed since watching began at T)"):
  how old the stall is. The daemon has watched the device all along and
  knows when its last I/O completed; a command alone has watched it for a
  second. The verdict (STALLED, the refusal, the exit code) is the same:
  the daemon judges a stall for these answers as the command does
  (observe/iowatch.py ``as_a_command_judges``).
- ``stalled.inFlight`` and the ``N`` of "N request(s) in flight": the
  count at the moment of each look; a writer blocked on a stalled device
  queues more between two looks a moment apart (1, then 4).
- "(no answer within N s)" and "(no answer: the previous call is still
  waiting)", both made "(no answer)": which of the looking process's calls
  to Ceph went unanswered (this one, at its deadline, or one of its earlier
  looks still stuck: drivers/bounded.py), i.e. the looker's own history.
- ``PROVENANCE``: the keys the answers carry to say where they came from and
  how old they are (the issue asks for them): ``answeredBy`` (the daemon,
  with its pid, or this command) and ``observedAt`` (when the look began).

The states, in this order (each test its own; ~50 s for the module):

- healthy: ``pub``, ``stl``, ``fen`` published, ``map`` mapped only;
- a file that fails to load (``map``'s size made invalid: its name is still
  read, so it is FROZEN), once the daemon says Frozen;
- a chain running: a new volume whose mkfs is held by a gate on the daemon's
  PATH (created and mapped, not formatted);
- a removal in flight: that volume's file removed, its unpublish held by the
  gate;
- I/O that does not complete (``stl``'s rbd-fuse helper stopped under a
  write with O_DIRECT), asked within ``events.ioStallSeconds`` (15 s), and
  again once the daemon has reported it Stalled;
- Ceph's OSD paused (SIGSTOP, SIGCONT in a finally), asked at once: far
  below the resync, and after the daemon has seen every volume healthy;
- ``fen`` fenced by another node (its takeover: the claim swapped, this
  node's client blocklisted) while its helper was stopped, with no I/O after
  that would tell this node; left so for the teardown. ``fen`` is published,
  not mapped only: a probe of a fenced device's content (blkid reads it)
  fails, then hangs in the kernel, so each look of a mapped-only volume would
  change what the next one sees.
"""

from __future__ import annotations

import contextlib
import difflib
import io
import json
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from conftest import NodeUnderTest, _force_cleanup, _loops_under, _remove_with_snapshots, new_node
from test_claim import Node, map_only, mon, second_node, watchers
from test_control import local_config
from test_daemon import Daemon, spec, wait_for
from test_events import _fuse_pid

from reconciler.cli import main as cli
from reconciler.drivers.reaper import reap_zombies
from reconciler.testing.devcluster import DevCluster

pytestmark = pytest.mark.ceph

RESYNC_S = 600  # far beyond the module: no resync pass hides a stale view
OBSERVE_TIMEOUT_S = 2  # Ceph paused: every answer within ~2x this
IO_STALL_S = 15  # events.ioStallSeconds: long enough to ask within it

# Keys that say where an answer came from or how old it is (the issue's
# "say how old what they report is"): forgiven wherever they appear.
PROVENANCE: frozenset[str] = frozenset({"answeredBy", "observedAt"})


# -- the gate: a command held on the daemon's PATH ----------------------------------
class Gate:
    """Stand-ins for ``mkfs.ext4`` and ``umount`` first on the daemon's PATH:
    while ``hold(command, word)`` is in force, a call whose argument (or the
    loop device's backing file it names) contains ``word`` waits (and says so
    in a file) until ``let_go``; every other call runs the real command."""

    COMMANDS = ("mkfs.ext4", "umount")

    def __init__(self, root: Path) -> None:
        self.dir = root / "gate"
        self.bin = self.dir / "bin"
        self.bin.mkdir(parents=True)
        for command in self.COMMANDS:
            real = shutil.which(command)
            assert real is not None, command
            hold, held = self.dir / f"hold-{command}", self.dir / f"held-{command}"
            script = self.bin / command
            script.write_text(f"""#!/bin/sh
if [ -e {hold} ]; then
  want=$(cat {hold})
  for a; do
    b=
    case "$a" in /dev/loop*) b=$(cat "/sys/block/${{a##*/}}/loop/backing_file" 2>/dev/null);; esac
    case "$a $b" in *"$want"*)
      echo "$$ $a" > {held}
      n=0
      while [ -e {hold} ] && [ $n -lt 6000 ]; do sleep 0.05; n=$((n+1)); done
      break;;
    esac
  done
fi
exec {real} "$@"
""")
            script.chmod(0o755)
        self.path = f"{self.bin}:{os.environ['PATH']}"

    def hold(self, command: str, word: str) -> None:
        (self.dir / f"held-{command}").unlink(missing_ok=True)
        (self.dir / f"hold-{command}").write_text(word)

    def wait_held(self, command: str) -> str:
        held = self.dir / f"held-{command}"
        wait_for(lambda: held.exists() and held.read_text().strip(), f"{command} to be held")
        return held.read_text().strip()

    def let_go(self) -> None:
        for command in self.COMMANDS:
            (self.dir / f"hold-{command}").unlink(missing_ok=True)


# -- the module's node and daemon ---------------------------------------------------
@dataclass
class Bed:
    node: NodeUnderTest
    daemon: Daemon
    alone: Path
    gate: Gate
    names: dict[str, str]  # role -> volume name
    published: set[str]  # the volumes (by name) to be at rest Published, ...
    mapped: set[str]  # ... and Mapped
    # What a state left for the teardown: run before the daemon stops, and after.
    before_stop: list[Callable[[], None]] = field(default_factory=list)
    after_stop: list[Callable[[], None]] = field(default_factory=list)


@pytest.fixture(scope="module")
def bed(ceph_cluster: DevCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Bed]:
    """The conftest ``node`` of this module (its teardown too), with a daemon
    running: ``pub``, ``stl`` and ``fen`` published, ``map`` mapped only."""
    root = tmp_path_factory.mktemp("differential")
    node = new_node(root, ceph_cluster,
                    f"resyncSeconds: {RESYNC_S}\nobserveTimeoutSeconds: {OBSERVE_TIMEOUT_S}\n"
                    f"events:\n  ioStallSeconds: {IO_STALL_S}\n")
    names = {role: node.name(role) for role in ("pub", "map", "stl", "fen", "chn")}
    gate = Gate(root)
    for role in ("pub", "stl", "fen"):
        node.write(names[role], spec(node, target=role))
    node.write(names["map"], f"  image: {{pool: {ceph_cluster.pool}, size: 64Mi}}\n"
                             "  map: {mapper: fuse}\n")
    daemon = None
    b = Bed(node, None, local_config(node), gate, names,  # type: ignore[arg-type]
            {names["pub"], names["stl"], names["fen"]}, {names["map"]})
    try:
        daemon = b.daemon = Daemon(node, extra_env={"PATH": gate.path})
        yield b
    finally:
        gate.let_go()
        try:
            for cleanup in b.before_stop:
                cleanup()
            if daemon is not None:
                assert daemon.stop() == 0, daemon.log.read_text()[-6000:]
            for cleanup in b.after_stop:
                cleanup()
            node.cli("release")
            with ceph_cluster.client() as c, c.open_ioctx(ceph_cluster.pool) as ioctx:
                for _ in range(2):
                    for name in sorted(node.images):
                        _remove_with_snapshots(ioctx, name)
        finally:
            reap_zombies()
            leaked_mounts = sorted(node.mounts())
            leaked_loops = _loops_under(root, node.tag)
            _force_cleanup(leaked_mounts, leaked_loops)
        assert not leaked_mounts, f"mounts leaked: {leaked_mounts}"
        assert not leaked_loops, f"loop devices leaked: {leaked_loops}"


def at_rest(b: Bed) -> None:
    """Every volume where it belongs, as the daemon's status files say, and
    the daemon's view confirmed after its chains (a status through it waits
    for that)."""
    for name in sorted(b.published):
        b.daemon.wait_phase(name, "Published")
    for name in sorted(b.mapped):
        b.daemon.wait_phase(name, "Mapped")
    wait_for(lambda: all(b.daemon.status(n).get("device") for n in b.published | b.mapped),
             "every volume's confirming pass")
    through_daemon(b, "status")


# -- asking -------------------------------------------------------------------------
def run(config: Path, *args: str) -> tuple[int, str, str]:
    """The CLI in this process: exit code, stdout, stderr."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = cli.main(["--config", str(config), *args])
    return rc, out.getvalue(), err.getvalue()


def through_daemon(b: Bed, *args: str) -> tuple[int, str, str]:
    rc, out, err = run(b.node.config, *args)
    assert "looking without it" not in err, err  # it was the daemon that answered
    return rc, out, err


def alone(b: Bed, *args: str) -> tuple[int, str, str]:
    return run(b.alone, *args)


@dataclass
class Answers:
    """Each command's (exit code, JSON document or None) by its words."""
    got: dict[str, tuple[int, Any]]
    stderr: dict[str, str]


def ask(b: Bed, how: str, explain: list[str]) -> Answers:
    runner = through_daemon if how == "daemon" else alone
    commands = [("status", "-o", "json"), ("plan", "-o", "json")]
    commands += [("explain", name, "-o", "json") for name in explain]
    got, stderr = {}, {}
    for args in commands:
        rc, out, err = runner(b, *args)
        key = " ".join(a for a in args if a not in ("-o", "json"))
        got[key] = (rc, json.loads(out) if out.strip() else None)
        stderr[key] = err
    return Answers(got, stderr)


# -- comparing ----------------------------------------------------------------------
_STALL_FOR = re.compile(r"(none completed for) \d+ s")
_IN_FLIGHT = re.compile(r"\d+ (request\(s\) in flight)")
_STALL_SINCE = re.compile(r"\((?:the last I/O completed at|none completed since watching began "
                          r"at) [^)]*\)")
_NO_ANSWER = re.compile(r"\(no answer(?: within [\d.]+ s|: the previous call is still waiting)\)")


def normalised(doc: Any, key: str = "") -> Any:
    """``doc`` with the allow-listed fields (module docstring) taken out."""
    if isinstance(doc, dict):
        out = {}
        for k, v in doc.items():
            if k in PROVENANCE or k in ("daemon", "applying"):
                continue
            if key == "stalled" and k in ("seconds", "since", "lastCompleted", "inFlight"):
                continue
            out[k] = normalised(v, k)
        return out
    if isinstance(doc, list):
        return [normalised(v, key) for v in doc]
    if isinstance(doc, str):
        return _IN_FLIGHT.sub(r"N \1", _STALL_SINCE.sub("(since T)", _NO_ANSWER.sub(
            "(no answer)", _STALL_FOR.sub(r"\1 N s", doc))))
    return doc


def phases(answers: Answers) -> dict[str, Any]:
    """The verdicts in a line each: rc, and each volume's phase."""
    out: dict[str, Any] = {}
    for key, (rc, doc) in answers.got.items():
        if doc is None:
            out[key] = (rc, None)
        elif key.startswith("status"):
            out[key] = (rc, {r["name"]: r["phase"] for r in doc["volumes"]}, doc["frozen"])
        elif key.startswith("plan"):
            out[key] = (rc, {e["name"]: (e["phase"], e["refusal"] is not None,
                                         [s["action"] for s in e["steps"]])
                             for e in doc["volumes"]})
        else:
            actual = doc["actual"] or {}
            out[key] = (rc, actual.get("phase"), doc["unknown"] is not None,
                        doc["refusal"] is not None, [s["action"] for s in doc["nextSteps"]])
    return out


def differences(daemon: Answers, alone_: Answers) -> str:
    """'' when the same; else the verdicts of each side and a diff of the documents."""
    lines = []
    for key in daemon.got:
        d, a = daemon.got[key], alone_.got[key]
        dn, an = (d[0], normalised(d[1])), (a[0], normalised(a[1]))
        if dn == an:
            continue
        lines.append(f"== {key}: exit {d[0]} through the daemon, {a[0]} alone")
        lines += difflib.unified_diff(
            json.dumps(dn[1], indent=1, sort_keys=True).splitlines(),
            json.dumps(an[1], indent=1, sort_keys=True).splitlines(),
            "through the daemon", "alone", n=1, lineterm="")
        for side, answers in (("daemon", daemon), ("alone", alone_)):
            if answers.stderr[key].strip():
                lines.append(f"-- stderr ({side}): {answers.stderr[key].strip()}")
    if not lines:
        return ""
    verdicts = phases(daemon), phases(alone_)
    head = ["verdicts (daemon | alone):"]
    head += [f"  {k}: {verdicts[0][k]} | {verdicts[1][k]}" for k in verdicts[0]
             if verdicts[0][k] != verdicts[1][k]]
    return "\n".join(head + lines)


def same_either_way(b: Bed, explain: list[str], first: str = "daemon") -> Answers:
    """Ask through the daemon and alone (``first`` first); the answers must
    be the same but for the allow-list. Returns the daemon's."""
    order = [first, "alone" if first == "daemon" else "daemon"]
    got = {how: ask(b, how, explain) for how in order}
    diff = differences(got["daemon"], got["alone"])
    assert not diff, "\n" + diff
    return got["daemon"]


# -- the states ---------------------------------------------------------------------
def test_healthy(bed: Bed) -> None:
    at_rest(bed)
    got = same_either_way(bed, sorted(bed.published | bed.mapped))
    rc, doc = got.got["status"]
    assert rc == 0, doc
    assert {r["name"]: r["phase"] for r in doc["volumes"]} == {
        **{n: "PUBLISHED" for n in bed.published}, **{n: "MAPPED" for n in bed.mapped}}


def test_a_file_that_fails_to_load(bed: Bed) -> None:
    at_rest(bed)
    name = bed.names["map"]
    f = bed.node.desired / f"{name}.yaml"
    good = f.read_text()
    try:
        f.write_text(good.replace("size: 64Mi", "size: 64 megs"))  # its name still read
        bed.daemon.wait_phase(name, "Frozen")
        got = same_either_way(bed, [name, bed.names["pub"]])
        rc, doc = got.got["status"]
        assert rc == 1 and doc["frozen"] == [name], doc
    finally:
        f.write_text(good)
    bed.daemon.wait_phase(name, "Mapped")


def test_a_chain_running(bed: Bed) -> None:
    at_rest(bed)
    name = bed.names["chn"]
    bed.gate.hold("mkfs.ext4", f"@{name}/")
    try:
        bed.node.write(name, spec(bed.node, target="chn"))
        bed.gate.wait_held("mkfs.ext4")  # created and mapped; its format waits
        got = same_either_way(bed, [name, bed.names["pub"]])
        rc, doc = got.got["plan"]
        [entry] = [e for e in doc["volumes"] if e["name"] == name]
        assert rc == 2 and entry.get("applying"), entry
    finally:
        bed.gate.let_go()
        bed.daemon.wait_phase(name, "Published")
        bed.published.add(name)


def test_a_removal_in_flight(bed: Bed) -> None:
    name = bed.names["chn"]
    if name not in bed.published:  # the test before did not run
        bed.node.write(name, spec(bed.node, target="chn"))
        bed.published.add(name)
    at_rest(bed)
    bed.gate.hold("umount", "/chn")
    try:
        (bed.node.desired / f"{name}.yaml").unlink()
        bed.published.discard(name)
        bed.gate.wait_held("umount")  # its release began: the unpublish waits
        got = same_either_way(bed, [name, bed.names["pub"]])
        assert name not in {r["name"] for r in got.got["status"][1]["volumes"]}
    finally:
        bed.gate.let_go()
        bed.daemon.wait_phase(name, "Released")


@contextlib.contextmanager
def stalled(b: Bed) -> Iterator[float]:
    """``stl``'s I/O not completing: its rbd-fuse helper stopped under a
    write with O_DIRECT and fsync. Yields when the write began (monotonic)."""
    name = b.names["stl"]
    helper = _fuse_pid(b.node, name)
    writer = None
    os.kill(helper, signal.SIGSTOP)
    try:
        began = time.monotonic()
        writer = subprocess.Popen(["dd", "if=/dev/zero", f"of={b.node.srv / 'stl' / 'w'}",
                                   "bs=4096", "count=1", "oflag=direct", "conv=fsync",
                                   "status=none"], stderr=subprocess.PIPE)
        device = str(b.daemon.status(name)["device"])
        stat = Path(f"/sys/class/block/{Path(device).name}/stat")
        wait_for(lambda: int(stat.read_text().split()[8]) > 0, "a request in flight", 30)
        yield began
    finally:
        os.kill(helper, signal.SIGCONT)
        if writer is not None:
            writer.wait(timeout=120)
    b.daemon.wait_phase(name, "Published")


def test_a_stall_younger_than_io_stall_seconds(bed: Bed) -> None:
    """I/O in flight for a few seconds, none completing: not Stalled yet by
    ``events.ioStallSeconds``; both must say the same (whatever it is)."""
    at_rest(bed)
    with stalled(bed) as began:
        got = same_either_way(bed, [bed.names["stl"]])
        assert time.monotonic() - began < IO_STALL_S, "asked too late for this state"
    del got


def test_a_volume_stalled(bed: Bed) -> None:
    """Stalled past ``events.ioStallSeconds``, the daemon having said so."""
    at_rest(bed)
    name = bed.names["stl"]
    with stalled(bed):
        bed.daemon.wait_phase(name, "Stalled", timeout=IO_STALL_S + 60)
        got = same_either_way(bed, [name, bed.names["pub"]])
        rc, doc = got.got["status"]
        assert rc == 1 and {r["name"]: r["phase"] for r in doc["volumes"]}[name] == "STALLED"


def test_ceph_paused(bed: Bed) -> None:
    """The OSD stopped: what only Ceph knows does not answer. Asked within a
    few seconds, far below the resync (600 s): the daemon must not answer
    from what it saw before."""
    at_rest(bed)
    osd = bed.node.cluster.pids.get("osd.0")
    if osd is None:
        pytest.skip("a cluster attached, not started here: its OSD is not ours to stop")
    os.kill(osd, signal.SIGSTOP)
    try:
        began = time.monotonic()
        got = same_either_way(bed, [bed.names["pub"], bed.names["map"]])
        assert time.monotonic() - began < RESYNC_S / 4
        rc, doc = got.got["status"]
        assert rc == 1, doc
    finally:
        os.kill(osd, signal.SIGCONT)
    wait_for(lambda: watchers(bed.node, bed.names["pub"]), "Ceph to answer again")


def test_fenced_by_another_node(bed: Bed) -> None:
    """Node B takes ``fen`` over (its claim swapped, this node's client
    blocklisted) while this node's helper is stopped; nothing is written
    after, so nothing on this node says so but Ceph. Left fenced for the
    module's teardown (this is the last state)."""
    at_rest(bed)
    node, name = bed.node, bed.names["fen"]
    other = second_node(node, node.root)
    (other.root / "desired" / f"{name}.yaml").write_text(map_only(node.cluster.pool, name))
    old = watchers(node, name)
    helper = _fuse_pid(node, name)
    bed.before_stop.append(lambda: kill_helper(helper))
    bed.after_stop.append(lambda: fenced_cleanup(bed, other, old))
    os.kill(helper, signal.SIGSTOP)
    try:
        rc, out = other.cli("takeover", name, "--yes-i-am-sure")
        assert rc == 0, out
    finally:
        os.kill(helper, signal.SIGCONT)
    got = same_either_way(bed, [name, bed.names["pub"]])
    rc, doc = got.got["status"]
    assert rc == 1 and {r["name"]: r["phase"] for r in doc["volumes"]}[name] == "FENCED"


def kill_helper(helper: int) -> None:
    """The fenced helper, before the daemon stops: a read of its device (a
    probe, the daemon's or a command's) waits in the kernel until the FUSE
    connection ends, and a daemon with such a thread cannot exit."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(helper, signal.SIGKILL)
    wait_for(lambda: (reap_zombies(), not Path(f"/proc/{helper}").exists())[1],
             "the fenced helper gone")


def fenced_cleanup(b: Bed, other: Node, old: list[str]) -> None:
    """With the daemon stopped: both nodes released, this node's old client
    off the blocklist."""
    b.node.cli("release")
    other.cli("release")
    for addr in old:
        mon(b.node, {"prefix": "osd blocklist", "blocklistop": "rm", "addr": addr})

