"""The node tests' guest half: run by nodebox-agent.service at every boot of
the node (scripts/node-tests.sh), from the read-only share of the checkout,
with the node's own /usr/bin/python3 and nothing but the standard library.

Boot 1 installs the package as the README says and checks the product
through its units: krbd with udev, LUKS2 through udev, rbd-nbd, rbd-fuse,
the helpers' own scopes, the journal's fields, `systemd-analyze security`,
QoS on a systemd unit, an upgrade and a crash (`systemctl kill`, every
process of the unit) while volumes are published; then it writes data and
reboots through systemd with an application using one volume. Boot 2
checks that the units alone brought every volume back with the same data,
and how the previous shutdown went (from the persistent journal: the
release before the helpers' scopes); then it powers off with the volumes
published.

Parameters, the packages and the node's Ceph config come from the run
share (argv[1]); each check's result goes to results-bootN.jsonl there, the
log to guest-bootN.log; `end-bootN` says how the boot ends (`reboot` or
`poweroff`), written just before systemd is asked to do it. Every wait has
a deadline and says what it waited for.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from loadwriters import Load

T = TypeVar("T")
RUN = Path(sys.argv[1]) if len(sys.argv) > 1 else Path("/mnt/run")
REPO = Path(__file__).resolve().parents[2]
PARAMS: dict[str, Any] = json.loads((RUN / "params.json").read_text()) if RUN.exists() else {}
BOOT = int((RUN / "boot").read_text()) if (RUN / "boot").exists() else 0
POOL = PARAMS.get("pool", "rbd")
ETC = Path("/etc/rbd-reconciler")
DESIRED = ETC / "volumes.d"
STATE = Path("/var/lib/rbd-reconciler")
KEEP = Path("/var/lib/nodebox-tests")  # the node's own disk: survives the reboot
APP_VOLUME = "box-krbd"
SLICE = "nodebox.slice"
MiB = 1 << 20
# name -> (mapper, fsType, size, encrypted)
VOLUMES: dict[str, tuple[str, str, str, bool]] = {
    "box-krbd": ("krbd", "ext4", "64Mi", False),
    "box-nbd": ("nbd", "xfs", "320Mi", False),
    "box-luks": ("krbd", "ext4", "64Mi", True),
    "box-fuse": ("fuse", "ext4", "64Mi", False),
}
CRASH_VOLUME = "box-crash"
# Written by an application (tests/node/loadwriters.py) while the daemon is
# restarted, upgraded and killed: krbd, rbd-nbd and LUKS2 over krbd.
LOADED = ["box-krbd", "box-nbd", "box-luks"]
LOAD: Load | None = None
ALL_VOLUMES = {**VOLUMES, CRASH_VOLUME: ("krbd", "ext4", "64Mi", False)}


class Log:
    def __init__(self) -> None:
        self.f = (RUN / f"guest-boot{BOOT}.log").open("a", buffering=1)

    def __call__(self, msg: str) -> None:
        line = f"{uptime():7.1f} {msg}"
        self.f.write(line + "\n")
        print(line, flush=True)


def uptime() -> float:
    return time.clock_gettime(time.CLOCK_BOOTTIME)


log = Log()


def record(**kw: Any) -> None:
    with (RUN / f"results-boot{BOOT}.jsonl").open("a") as f:
        f.write(json.dumps({"boot": BOOT, **kw}) + "\n")


def metric(name: str, value: Any) -> None:
    log(f"metric {name}: {value}")
    record(metric=name, value=value)


def check(name: str, fn: Callable[[], str | None]) -> bool:
    """Run one check: its result (ok or the failure), time and detail are recorded."""
    log(f"--- {name}")
    t0 = time.monotonic()
    try:
        detail = fn() or ""
        ok = True
    except Exception as exc:  # a failed check is reported, the boot goes on
        detail = f"{type(exc).__name__}: {exc}" if not isinstance(exc, AssertionError) \
            else str(exc)
        ok = False
        log("".join(traceback.format_exception(exc)).rstrip())
        diagnose()
    secs = time.monotonic() - t0
    log(f"--- {name}: {'ok' if ok else 'FAILED'} in {secs:.1f} s{': ' + detail if detail else ''}")
    record(check=name, ok=ok, seconds=round(secs, 1), detail=detail[:400])
    return ok


def diagnose() -> None:
    """After a failed check: what the units and the journal say."""
    for argv in (["systemctl", "--no-pager", "--full", "status", "rbd-reconciler",
                  "rbd-reconciler-shutdown"],
                 ["journalctl", "--no-pager", "-n", "60", "-u", "rbd-reconciler",
                  "-u", "rbd-reconciler-shutdown"]):
        try:
            done = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
            log(f"$ {' '.join(argv)}\n{done.stdout}{done.stderr}")
        except subprocess.TimeoutExpired:
            log(f"$ {' '.join(argv)}: no answer within 60 s")


def sh(*argv: str, timeout: float = 120, check: bool = True, cwd: str | None = None,
       quiet: bool = False) -> subprocess.CompletedProcess[str]:
    if not quiet:
        log("$ " + " ".join(argv))
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, cwd=cwd,
                              check=False)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"{' '.join(argv)}: no answer within {timeout:g} s") from None
    if check and done.returncode != 0:
        raise AssertionError(f"{' '.join(argv)}: exit {done.returncode}: "
                             f"{(done.stderr or done.stdout).strip()[-600:]}")
    return done


def wait_for(what: str, probe: Callable[[], T], seconds: float, every: float = 0.5) -> T:
    """probe() until it returns something true; past the deadline, fail saying
    what was awaited and what the last probe saw."""
    deadline = time.monotonic() + seconds
    last: Any = None
    while True:
        try:
            last = probe()
        except (OSError, ValueError, AssertionError) as exc:
            last = f"{type(exc).__name__}: {exc}"
        else:
            if last:
                return last
        if time.monotonic() > deadline:
            raise AssertionError(f"waited {seconds:g} s for {what}; last seen: {last!r}"[:600])
        time.sleep(every)


def end_boot(action: str) -> None:
    """Hand the node to systemd: `reboot` or `poweroff`. The host times the
    shutdown from the marker to QEMU's exit."""
    now = mounts()  # a status file outlives a removed package: mounted too
    published = [n for n in ALL_VOLUMES if phase(n) == "Published" and f"/srv/{n}" in now]
    (RUN / f"shutdown-boot{BOOT}").write_text(json.dumps({"uptime": uptime(),
                                                          "published": published}))
    (RUN / f"end-boot{BOOT}").write_text(action + "\n")
    log(f"systemctl {action} with {len(published)} volume(s) published: {', '.join(published)}")
    log.f.flush()
    os.sync()
    subprocess.run(["systemctl", action, "--no-block"], check=False)
    time.sleep(600)  # stopped by the shutdown


# ---------------------------------------------------------------- the node's facts


def unit(name: str, *props: str) -> dict[str, str]:
    out = sh("systemctl", "show", *(f"--property={p}" for p in props), "--", name,
             quiet=True).stdout
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)


def phase(name: str) -> str | None:
    try:
        return json.loads((STATE / "status" / f"{name}.json").read_text()).get("phase")
    except (OSError, ValueError):
        return None


def mounts() -> dict[str, dict[str, str]]:
    """Mount point -> its mount id, MAJ:MIN and source, for /srv and ours."""
    out = {}
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        f = line.split()
        point = f[4]
        if point.startswith(("/srv/", str(STATE))):
            sep = f.index("-")
            out[point] = {"id": f[0], "dev": f[2], "source": f[sep + 2]}
    return out


def published(names: list[str] | dict[str, Any]) -> list[str] | None:
    """The names whose status says Published and whose target is mounted now."""
    now = mounts()
    left = [n for n in names if phase(n) != "Published" or f"/srv/{n}" not in now]
    return None if left else list(names)


def not_published(names: list[str] | dict[str, Any]) -> str:
    now = mounts()
    return ", ".join(f"{n} ({phase(n)}{'' if f'/srv/{n}' in now else ', not mounted'})"
                     for n in names)


def krbd_devices() -> dict[str, str]:
    """image -> /dev/rbdN, from sysfs (what the kernel maps, udev or not)."""
    out = {}
    for d in Path("/sys/bus/rbd/devices").glob("*"):
        out[(d / "name").read_text().strip()] = f"/dev/rbd{d.name}"
    return out


def nbd_pids() -> dict[str, str]:
    return {p.parent.name: p.read_text().strip() for p in Path("/sys/block").glob("nbd*/pid")}


def fuse_pids() -> dict[str, str]:
    """Our rbd-fuse helpers: their mount point (the last path argument) -> pid."""
    out = {}
    for d in Path("/proc").glob("[0-9]*"):
        try:
            args = (d / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if args and args[0].endswith(b"rbd-fuse"):
            paths = [a.decode() for a in args if a.startswith(str(STATE).encode())]
            out[paths[-1] if paths else "?"] = d.name
    return out


def helper_pids() -> dict[str, str]:
    """Every long-lived helper: nbd device or FUSE mount -> pid."""
    return {**nbd_pids(), **fuse_pids()}


def cgroup_of(pid: str) -> str:
    """The process's cgroup v2 path (`0::/system.slice/X.scope`)."""
    lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
    return next(x.split("::", 1)[1] for x in lines if x.startswith("0::"))


def dm_names() -> dict[str, str]:
    return {p.parent.parent.name: p.read_text().strip()
            for p in Path("/sys/block").glob("dm-*/dm/name")}


def udev_props(dev: str) -> dict[str, str]:
    out = sh("udevadm", "info", "--query=property", f"--name={dev}", quiet=True).stdout
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)


def journal(*args: str, timeout: float = 120) -> list[dict[str, Any]]:
    out = sh("journalctl", "-o", "json", "--no-pager", *args, quiet=True, timeout=timeout).stdout
    return [json.loads(line) for line in out.splitlines() if line.strip()]


def cursor() -> str:
    out = sh("journalctl", "-n", "0", "--show-cursor", "--no-pager", quiet=True).stdout
    return out.strip().rsplit("cursor: ", 1)[-1]


def spec(name: str, qos: str | None = None) -> str:
    mapper, fs, size, encrypted = ALL_VOLUMES[name]
    return "".join([
        f"apiVersion: rbd-reconciler/v1\nkind: Volume\nmetadata:\n  name: {name}\n",
        f"spec:\n  image: {{pool: {POOL}, size: {size}}}\n  map: {{mapper: {mapper}}}\n",
        f"  encryption: {{type: luks2, key: {{wrappedBy: {ETC}/keys/node.key}}}}\n"
        if encrypted else "",
        f"  qos: {{{qos}}}\n" if qos is not None else "",
        f"  stage: {{fsType: {fs}}}\n  publish:\n    - path: /srv/{name}\n"])


def write_spec(name: str, qos: str | None = None) -> None:
    tmp = DESIRED / f".{name}.tmp"
    tmp.write_text(spec(name, qos))
    tmp.chmod(0o644)
    tmp.rename(DESIRED / f"{name}.yaml")
    log(f"wrote {DESIRED / name}.yaml" + (f" (qos: {{{qos}}})" if qos is not None else ""))


def daemon() -> dict[str, str]:
    return unit("rbd-reconciler.service", "MainPID", "ActiveState", "SubState", "NRestarts",
                "ExecMainStartTimestampMonotonic")


def first_pass(pid: str, volumes: int) -> str | None:
    """The daemon's `pass N: ...` line where it observed every volume and had
    nothing to converge and nothing unknown (a Ceph slow to answer, under
    emulation, makes a pass's volumes unknown: not yet seen), from the
    process ``pid``."""
    for e in journal("-u", "rbd-reconciler", f"_PID={pid}"):
        msg = str(e.get("MESSAGE", ""))
        m = re.match(r"pass \d+: \d+ volume\(s\), (\d+) observed, 0 converging, 0 unknown",
                     msg)
        if m and int(m.group(1)) >= volumes:
            return msg
    return None


def snapshot() -> dict[str, Any]:
    """What must not move while the daemon restarts: mounts (by id),
    mappings, dm devices, rbd-nbd and rbd-fuse processes."""
    return {"mounts": mounts(), "krbd": krbd_devices(), "nbd": nbd_pids(), "fuse": fuse_pids(),
            "dm": dm_names()}


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# ---------------------------------------------------------------- boot 1


def system_up() -> str:
    state = sh("systemctl", "is-system-running", "--wait", check=False, timeout=300).stdout.strip()
    failed = sh("systemctl", "--failed", "--plain", "--no-legend", "--no-pager",
                quiet=True).stdout.strip()
    assert state == "running", f"system {state}; failed units: {failed or 'none'}"
    comm = Path("/proc/1/comm").read_text().strip()
    assert comm == "systemd", f"PID 1 is {comm}"
    assert unit("systemd-udevd.service", "ActiveState")["ActiveState"] == "active", "no udevd"
    assert Path("/run/udev/control").exists(), "no /run/udev/control"
    times = sh("systemd-analyze", quiet=True).stdout.splitlines()[0]
    metric("systemd_analyze", times)
    return f"PID 1 systemd, udevd running; {times}"


def readme_install() -> list[str]:
    """The README's install commands on the node, as written (a line ending
    in a backslash joined to the next)."""
    lines = (REPO / "README.md").read_text().splitlines()
    at = next(i for i, x in enumerate(lines) if x.rstrip().endswith("on the node:"))
    block, i = [], at + 1
    while i < len(lines) and not lines[i].strip():
        i += 1
    while i < len(lines) and lines[i].startswith("    "):
        block.append(lines[i].strip())
        i += 1
    commands, joined = [], ""
    for line in block:
        if line.endswith("\\"):
            joined += line[:-1].rstrip() + " "
            continue
        commands.append(joined + line)
        joined = ""
    assert commands and commands[0].startswith("apt install ./rbd-reconciler_"), commands
    return commands


def edit_config() -> None:
    """The README's `editor` step: the Ceph user and keyring, allowedRoots;
    with it what docs/daemon.md asks of a node with krbd, nbd and LUKS2
    volumes (the node key; the kernel modules: the sandbox has no
    CAP_SYS_MODULE)."""
    example = (ETC / "config.yaml").read_text()
    assert "allowedRoots" in example, "the copied example config has no allowedRoots"
    (ETC / "config.yaml").write_text(
        "nodeName: nodebox\n"
        "ceph: {conf: /etc/ceph/ceph.conf, user: admin, "
        "keyring: /etc/ceph/ceph.client.admin.keyring}\n"
        "allowedRoots: [/srv]\n"
        # TCG: a fixed, cheap PBKDF instead of a 2 s benchmark per keyslot.
        f"encryption: {{keyRoot: {ETC}/keys, pbkdf: pbkdf2, iterations: 1000}}\n")
    (ETC / "keys").mkdir(mode=0o700, exist_ok=True)
    key = ETC / "keys" / "node.key"
    key.write_bytes(os.urandom(64))
    key.chmod(0o600)
    Path("/etc/modules-load.d/rbd-reconciler.conf").write_text("rbd\nnbd\n")
    sh("systemctl", "restart", "systemd-modules-load.service")


def install() -> str:
    """The README's install commands, verbatim (its `editor` step is
    edit_config), on an image without /usr/share/doc (node-tests.sh builds
    it with path-exclude, as minimal and cloud images do)."""
    assert not Path("/usr/share/doc/ceph-common/README").exists() and \
        not any(Path("/usr/share/doc").glob("*/README*")), "the image has /usr/share/doc"
    cephdir = Path("/etc/ceph")
    cephdir.mkdir(exist_ok=True)
    for f in ("ceph.conf", "ceph.client.admin.keyring"):
        shutil.copy(RUN / "ceph" / f, cephdir / f)
    (cephdir / "ceph.client.admin.keyring").chmod(0o600)
    debs = str(RUN / "debs" / "old")
    ran = []
    for command in readme_install():
        if command.startswith("editor "):
            edit_config()
            ran.append("editor")
            continue
        t0 = time.monotonic()
        done = sh("sh", "-c", command, cwd=debs, timeout=300)
        if command.startswith("systemctl enable --now"):
            metric("enable_now_s", round(time.monotonic() - t0, 1))
        if command.startswith("apt install"):
            log(done.stdout[-1500:])
        ran.append(command.split()[0])
    version = sh("dpkg-query", "-W", "-f=${Version}", "rbd-reconciler").stdout
    # "Then desired-volume files go into /etc/rbd-reconciler/volumes.d/."
    for name in VOLUMES:
        write_spec(name)
    d = daemon()
    assert d["ActiveState"] == "active", d
    return f"rbd-reconciler {version}, daemon {d['SubState']}; README ran: {', '.join(ran)}"


def all_published() -> str:
    t0 = time.monotonic()
    wait_for("every volume Published (status) and mounted", lambda: published(VOLUMES), 300,
             every=1)
    metric("install_to_published_s", round(time.monotonic() - t0, 1))
    return ", ".join(VOLUMES)


def links(top: str) -> list[str]:
    return sorted(str(p.relative_to(top)) for p in Path(top).rglob("*")) \
        if os.path.isdir(top) else ["(none)"]


def krbd_udev() -> str:
    devs = krbd_devices()
    out = []
    for name in ("box-krbd", "box-luks"):
        link = Path(f"/dev/rbd/{POOL}/{name}")
        assert link.is_symlink(), f"{link}: no udev link (under /dev/rbd: {links('/dev/rbd')})"
        target = os.path.realpath(link)
        assert target == devs[name], f"{link} -> {target}, the kernel maps {devs[name]}"
        assert Path(target).is_block_device(), target
        # Debian 12's udev runs no blkid on rbd* (60-persistent-storage.rules
        # leaves them out): ceph-common's 50-rbd.rules makes the one link.
        props = udev_props(target)
        assert f"/dev/rbd/{POOL}/{name}" in props.get("DEVLINKS", "").split(), props
        out.append(f"{link} -> {target}")
    # The publish is a mount of that very device.
    m = mounts()[f"/srv/{APP_VOLUME}"]
    st = os.stat(devs[APP_VOLUME])
    assert m["dev"] == f"{os.major(st.st_rdev)}:{os.minor(st.st_rdev)}", m
    return "; ".join(out)


def luks_udev() -> str:
    backing = os.path.basename(krbd_devices()["box-luks"])
    holders = [h.name for h in Path(f"/sys/block/{backing}/holders").iterdir()]
    assert len(holders) == 1 and holders[0].startswith("dm-"), f"{backing} holders: {holders}"
    dm = holders[0]
    name = Path(f"/sys/block/{dm}/dm/name").read_text().strip()
    mapper = Path("/dev/mapper") / name
    assert mapper.is_symlink(), f"{mapper} is not udev's link (a node made without udev?)"
    assert os.path.realpath(mapper) == f"/dev/{dm}", f"{mapper} -> {os.path.realpath(mapper)}"
    props = udev_props(f"/dev/{dm}")
    assert props.get("DM_NAME") == name, props
    assert props.get("DM_UUID", "").startswith("CRYPT-LUKS2-"), props.get("DM_UUID")
    assert props.get("ID_FS_TYPE") == "ext4", props.get("ID_FS_TYPE")
    assert props.get("DM_UDEV_RULES_VSN"), "the dm udev rules did not run"
    by_id = Path(f"/dev/disk/by-id/dm-name-{name}")
    assert by_id.is_symlink(), f"no {by_id}"
    st = os.stat(f"/dev/{dm}")
    assert mounts()["/srv/box-luks"]["dev"] == f"{os.major(st.st_rdev)}:{os.minor(st.st_rdev)}"
    return f"{mapper} -> ../{dm} (udev; {props['DM_UUID'][:22]}...), ext4 by udev's blkid"


def nbd_mapped() -> str:
    pids = nbd_pids()
    assert len(pids) == 1, f"nbd devices with a pid: {pids}"
    dev, pid = next(iter(pids.items()))
    cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    assert cmd[0].endswith(b"rbd-nbd"), cmd
    props = udev_props(f"/dev/{dev}")
    assert props.get("ID_FS_TYPE") == "xfs", props.get("ID_FS_TYPE")
    st = os.stat(f"/dev/{dev}")
    assert mounts()["/srv/box-nbd"]["dev"] == f"{os.major(st.st_rdev)}:{os.minor(st.st_rdev)}"
    return f"/dev/{dev} by rbd-nbd (pid {pid}), xfs"


def fuse_mapped() -> str:
    pids = fuse_pids()
    mnt = str(STATE / "fuse" / f"{POOL}@box-fuse")
    assert list(pids) == [mnt], f"rbd-fuse helpers: {pids}"
    st = os.stat(mounts()["/srv/box-fuse"]["source"])
    loop = f"/sys/dev/block/{os.major(st.st_rdev)}:{os.minor(st.st_rdev)}/loop/backing_file"
    backing = Path(loop).read_text().strip()
    assert backing == f"{mnt}/box-fuse", f"{loop}: {backing}"
    return (f"{mounts()['/srv/box-fuse']['source']} on {backing}, served by rbd-fuse "
            f"(pid {pids[mnt]})")


# A helper's scope (reconciler/drivers/scopes.py), under system.slice.
HELPER_SCOPE = re.compile(r"^/system\.slice/(rbd-reconciler-helper-[A-Za-z0-9:_.-]+\.scope)$")


def helper_scopes() -> str:
    """Each rbd-nbd and rbd-fuse helper runs in a transient scope of its own,
    out of the daemon unit's cgroup (so `systemctl kill rbd-reconciler`
    cannot reach it), listed by `systemctl list-units 'rbd-reconciler-helper-*'`
    and ordered before the release unit (stopped only after it)."""
    helpers = helper_pids()
    assert any(k.startswith("nbd") for k in helpers) and any(k.startswith("/") for k in helpers), \
        f"no rbd-nbd or no rbd-fuse helper: {helpers}"
    listed = sh("systemctl", "list-units", "--plain", "--no-legend", "--no-pager",
                "rbd-reconciler-helper-*", quiet=True).stdout
    active = {line.split()[0] for line in listed.splitlines() if line.strip()}
    out, seen = [], set()
    for what, pid in sorted(helpers.items()):
        cg = cgroup_of(pid)
        assert "/rbd-reconciler.service" not in cg, \
            f"{what} (pid {pid}) is in the daemon's cgroup {cg}"
        m = HELPER_SCOPE.match(cg)
        assert m, f"{what} (pid {pid}) is not in a helper scope: {cg}"
        scope = m.group(1)
        assert scope not in seen, f"two helpers in {scope}"
        seen.add(scope)
        assert scope in active, \
            f"systemctl list-units 'rbd-reconciler-helper-*' lacks {scope}: {listed}"
        u = unit(scope, "ActiveState", "Before", "CollectMode", "Description")
        assert u["ActiveState"] == "active", (scope, u)
        assert "rbd-reconciler-shutdown.service" in u["Before"].split(), (scope, u)
        assert u["CollectMode"] == "inactive-or-failed", (scope, u)
        out.append(f"{scope} ({u['Description']}; pid {pid}; Before={u['Before']})")
    assert len(active) == len(seen), f"helper scopes with no helper of ours: {active - seen}"
    log("helper scopes:\n  " + "\n  ".join(out))
    return "; ".join(out)


def scope_overhead() -> str:
    """What a scope adds to a helper's start: `systemd-run --scope` of
    `true` against `true` alone (the best of three each)."""
    took = []
    for argv in (["true"], ["systemd-run", "--scope", "--quiet", "--collect", "--", "true"]):
        best = float("inf")
        for _ in range(3):
            t0 = time.monotonic()
            sh(*argv, quiet=True)
            best = min(best, time.monotonic() - t0)
        took.append(best * 1000)
    metric("scope_overhead_ms", round(took[1] - took[0]))
    return f"{took[1] - took[0]:.0f} ms"


def journal_fields() -> str:
    entries = journal("-u", "rbd-reconciler.service")
    steps = [e for e in entries if "STEP" in e]
    assert steps, f"no entry with STEP= among {len(entries)} of rbd-reconciler.service"
    out = []
    for name in VOLUMES:
        mine = [e for e in steps if e.get("VOLUME") == name]
        assert mine, f"no step entry with VOLUME={name}"
        for e in mine:
            for field in ("VOLUME", "STEP", "TARGET", "RESULT", "DURATION_MS", "PRIORITY"):
                assert field in e, f"{field} missing from {e.get('MESSAGE')!r}"
            assert e["DURATION_MS"].isdigit(), e["DURATION_MS"]
            assert e["SYSLOG_IDENTIFIER"] == "rbd-reconciler", e["SYSLOG_IDENTIFIER"]
        kinds = [e["STEP"] for e in mine if e["RESULT"] == "changed"]
        assert "map" in kinds and "publish" in kinds, f"{name}: changed steps {kinds}"
        # The map step's time: for rbd-nbd and rbd-fuse, the helper's scope included.
        ms = {e["STEP"]: int(e["DURATION_MS"]) for e in mine if e["RESULT"] == "changed"}
        out.append(f"{name}: {' '.join(kinds)} (map {ms['map']} ms, all {sum(ms.values())} ms)")
    # journalctl's own field match, as the README shows it.
    by_field = journal("-u", "rbd-reconciler", f"VOLUME={APP_VOLUME}")
    assert by_field and all(e.get("VOLUME") == APP_VOLUME for e in by_field)
    return "; ".join(out)


def readme_exposure() -> str:
    """The exposure the manual states (docs/daemon.md, Install)."""
    text = " ".join((REPO / "docs" / "daemon.md").read_text().split())
    m = re.search(r"`systemd-analyze security` exposure (\d+\.\d+), \"(\w+)\"", text)
    assert m, "docs/daemon.md states no `systemd-analyze security` exposure"
    return f"{m.group(1)} {m.group(2)}"


def security() -> str:
    stated = readme_exposure()
    got = {}
    for u in ("rbd-reconciler.service", "rbd-reconciler-shutdown.service"):
        out = sh("systemd-analyze", "security", "--no-pager", u, check=False).stdout
        m = re.search(r"Overall exposure level for \S+: (\d+\.\d+) (\w+)", out)
        assert m, f"systemd-analyze security {u}: {out[-300:]}"
        got[u] = f"{m.group(1)} {m.group(2)}"
    assert got["rbd-reconciler.service"] == stated, \
        f"rbd-reconciler.service: {got['rbd-reconciler.service']}, docs/daemon.md states {stated}"
    # ProtectClock= adds no device ACL on systemd 252 (the unit's comment):
    # none, and the daemon's loop device over rbd-fuse works (box-fuse).
    dev = unit("rbd-reconciler.service", "DeviceAllow", "DevicePolicy")
    assert dev.get("DeviceAllow", "") == "" and dev["DevicePolicy"] == "auto", dev
    assert phase("box-fuse") == "Published", phase("box-fuse")
    return (", ".join(f"{u}: {v}" for u, v in got.items()) + f" (docs/daemon.md: {stated}); "
            f"DevicePolicy={dev['DevicePolicy']} DeviceAllow=(none): loop and fuse work")


APP = """\
import os, signal, sys, time
d = sys.argv[1]
boot = open("/proc/sys/kernel/random/boot_id").read().strip()
def note(what):
    with open(os.path.join(d, "app.log"), "a") as f:
        f.write(f"{what} boot={boot} mounted={os.path.ismount(d)} t={time.time():.3f}\\n")
        f.flush()
        os.fsync(f.fileno())
note("started")
held = open(os.path.join(d, "heartbeat"), "a")  # keeps the mount busy while it runs
def stop(*_):
    note("stopping")
    held.close()
    sys.exit(0)
signal.signal(signal.SIGTERM, stop)
while True:
    held.write(f"{time.time():.3f}\\n")
    held.flush()
    time.sleep(1)
"""

APP_UNIT = f"""\
[Unit]
Description=an application using the volume {APP_VOLUME} (node tests)
# docs/daemon.md "Shutdown and reboot" and "Removal": applications order
# After= the daemon and are part of the release unit, whose stop (a
# shutdown, a removal) stops them first.
After=rbd-reconciler.service rbd-reconciler-shutdown.service
PartOf=rbd-reconciler-shutdown.service

# READY=1 does not wait for a volume whose Ceph does not answer
# (docs/daemon.md, "Boot"): the application waits for its mount itself.
StartLimitIntervalSec=0

[Service]
Slice={SLICE}
ExecStartPre=/bin/mountpoint -q /srv/{APP_VOLUME}
ExecStart=/usr/bin/python3 /usr/local/lib/nodebox-app.py /srv/{APP_VOLUME}
Restart=on-failure
RestartSec=2

[Install]
WantedBy=multi-user.target
"""


def reload() -> str:
    """`systemctl reload`: ExecReload is the shell's kill (a minimal Debian 12
    has no /bin/kill, procps's): the same process reads its config again."""
    before = daemon()
    mark = cursor()
    sh("systemctl", "reload", "rbd-reconciler")
    wait_for("the daemon's 'config reloaded' line",
             lambda: any("config reloaded" in str(e.get("MESSAGE", ""))
                         for e in journal("-u", "rbd-reconciler", f"--after-cursor={mark}")),
             60)
    after = daemon()
    assert after["MainPID"] == before["MainPID"], (before, after)
    assert after["ActiveState"] == "active", after
    return f"reloaded in place (pid {after['MainPID']})"


def application() -> str:
    Path("/usr/local/lib/nodebox-app.py").write_text(APP)
    Path("/etc/systemd/system/nodebox-app.service").write_text(APP_UNIT)
    sh("systemctl", "daemon-reload")
    sh("systemctl", "enable", "--now", "nodebox-app.service")
    wait_for("the application's first heartbeat",
             lambda: (Path(f"/srv/{APP_VOLUME}/heartbeat").exists()
                      and Path(f"/srv/{APP_VOLUME}/heartbeat").stat().st_size > 0), 60)
    return f"nodebox-app.service in {SLICE}, writing to /srv/{APP_VOLUME}"


def timed_write(mib: int) -> float:
    """O_DIRECT writes from a transient service in the slice (io.max holds
    for the slice's processes)."""
    t0 = time.monotonic()
    sh("systemd-run", "--wait", "--quiet", "--collect", f"--slice={SLICE}", "--",
       "dd", "if=/dev/zero", f"of=/srv/{APP_VOLUME}/qos.bin", "bs=1M", f"count={mib}",
       "oflag=direct", "status=none", timeout=300)
    return time.monotonic() - t0


def qos_unit() -> str:
    device = krbd_devices()[APP_VOLUME]
    st = os.stat(device)
    rdev = f"{os.major(st.st_rdev)}:{os.minor(st.st_rdev)}"
    io_max = Path(f"/sys/fs/cgroup/{SLICE}/io.max")

    def in_force() -> str:
        line = next((x for x in io_max.read_text().splitlines() if x.startswith(rdev + " ")), "")
        return line

    write_spec(APP_VOLUME, f"unit: {SLICE}, writeBps: 1Mi, readIops: 5000")
    shown = wait_for(f"systemctl show {SLICE} to carry {device}'s limits",
                     lambda: (u := unit(SLICE, "IOWriteBandwidthMax", "IOReadIOPSMax"))
                     and device in u["IOWriteBandwidthMax"] and device in u["IOReadIOPSMax"]
                     and u, 120)
    assert shown["IOWriteBandwidthMax"] == f"{device} 1048576", shown
    assert shown["IOReadIOPSMax"] == f"{device} 5000", shown
    line = wait_for(f"{io_max} to hold {rdev}", in_force, 30)
    assert "wbps=1048576" in line and "riops=5000" in line, line
    took = timed_write(4)
    assert took >= 2.5, f"4 MiB in {took:.1f} s: the 1 MiB/s limit is not in force"
    # Lifted in place: the same device, no remap.
    write_spec(APP_VOLUME, f"unit: {SLICE}")
    wait_for(f"{io_max} to lift {rdev}'s limits",
             lambda: "wbps=1048576" not in in_force() and "riops=5000" not in in_force(), 120)
    fast = timed_write(4)
    # Lifted: unthrottled (0.4-1.5 s measured); under load, emulation itself is slow.
    assert fast < took * 0.75, f"lifted: 4 MiB in {fast:.1f} s, limited {took:.1f} s"
    assert krbd_devices()[APP_VOLUME] == device, "remapped"
    return (f"{SLICE}: IOWriteBandwidthMax={shown['IOWriteBandwidthMax']}, io.max '{line}'; "
            f"4 MiB O_DIRECT in {took:.1f} s limited, {fast:.1f} s lifted")


def under_load(event: str, t0: float) -> str:
    """After ``event`` (begun at ``t0``): no writer saw an I/O error, each
    completes records again, and the longest pause is recorded."""
    assert LOAD is not None, "no writers"
    assert not LOAD.errors(), f"I/O errors across the {event}: {LOAD.errors()}"
    t1 = time.monotonic()
    wait_for(f"every writer to complete records after the {event}",
             lambda: LOAD.progressed_since(t1) or LOAD.errors(), 120)
    assert not LOAD.errors(), f"I/O errors after the {event}: {LOAD.errors()}"
    gaps = LOAD.gaps(t0, time.monotonic())
    metric(f"{event}_longest_write_gap_s", gaps)
    return f"writers: no I/O error, longest pause {max(gaps.values()):.2f} s"


def start_load() -> str:
    global LOAD
    LOAD = Load(LOADED)
    t0 = time.monotonic()
    wait_for("every writer's first records", lambda: LOAD.progressed_since(t0, 3)
             or LOAD.errors(), 120)
    assert not LOAD.errors(), LOAD.errors()
    return f"1 MiB O_DIRECT+fsync records on {', '.join(LOADED)}"


def restart() -> str:
    """`systemctl restart` under writers: a new daemon, the same mounts (by
    id), mappings, dm devices and helpers, no step, no I/O error."""
    before = snapshot()
    d0 = daemon()
    mark = cursor()
    t0 = time.monotonic()
    sh("systemctl", "restart", "rbd-reconciler", timeout=300)
    d1 = wait_for("the daemon to run again under a new pid",
                  lambda: (d := daemon())["ActiveState"] == "active"
                  and d["MainPID"] not in ("0", d0["MainPID"]) and d, 120)
    wait_for("the new daemon's first pass over every volume, nothing to converge",
             lambda: first_pass(d1["MainPID"], len(VOLUMES)), 180, every=1)
    after = snapshot()
    assert after == before, f"moved across the restart:\nbefore {before}\nafter  {after}"
    changed = [e.get("MESSAGE") for e in journal(f"--after-cursor={mark}")
               if e.get("RESULT") in ("changed", "failed")]
    assert not changed, f"steps ran across the restart: {changed[:5]}"
    metric("restart_s", round(time.monotonic() - t0, 1))
    return (f"daemon pid {d0['MainPID']} -> {d1['MainPID']}, {len(before['mounts'])} mounts "
            f"unchanged (ids); {under_load('restart', t0)}")


def load_verified() -> str:
    assert LOAD is not None, "no writers"
    p99 = LOAD.p99()
    checked = LOAD.finish()
    assert not LOAD.errors(), LOAD.errors()
    metric("writer_p99_gap_s", p99)
    return (f"every acknowledged record reads back ({checked}); the writers' p99 pause "
            f"over the whole run {p99}")


def upgrade() -> str:
    newer = PARAMS.get("newer_deb")
    assert newer, "no newer package (--newer-deb)"
    before = snapshot()
    d0 = daemon()
    sd0 = unit("rbd-reconciler-shutdown.service", "ActiveEnterTimestampMonotonic", "ActiveState")
    mark = cursor()
    old = sh("dpkg-query", "-W", "-f=${Version}", "rbd-reconciler", quiet=True).stdout
    t0 = time.monotonic()
    done = sh("sh", "-c", "apt install -y ./rbd-reconciler_*.deb", cwd=str(RUN / "debs" / "new"),
              timeout=300)
    log(done.stdout[-1500:])
    new = sh("dpkg-query", "-W", "-f=${Version}", "rbd-reconciler", quiet=True).stdout
    assert new != old, f"still {old}"
    d1 = wait_for("the daemon to run again under a new pid",
                  lambda: (d := daemon())["ActiveState"] == "active"
                  and d["MainPID"] not in ("0", d0["MainPID"]) and d, 120)
    restart_s = time.monotonic() - t0
    # One whole pass of the new daemon over every volume, then compare.
    wait_for("the new daemon's first pass over every volume, nothing to converge",
             lambda: first_pass(d1["MainPID"], len(VOLUMES)), 180, every=1)
    after = snapshot()
    assert after == before, f"moved across the upgrade:\nbefore {before}\nafter  {after}"
    sd1 = unit("rbd-reconciler-shutdown.service", "ActiveEnterTimestampMonotonic", "ActiveState")
    assert sd1 == sd0, f"rbd-reconciler-shutdown.service was restarted: {sd0} -> {sd1}"
    since = journal(f"--after-cursor={mark}")
    released = [e.get("MESSAGE") for e in since
                if e.get("_SYSTEMD_UNIT") == "rbd-reconciler-shutdown.service"
                or e.get("UNIT") == "rbd-reconciler-shutdown.service"]
    assert not released, f"the shutdown unit ran: {released[:5]}"
    changed = [e.get("MESSAGE") for e in since if e.get("RESULT") in ("changed", "failed")]
    assert not changed, f"steps ran across the upgrade: {changed[:5]}"
    assert published(VOLUMES), not_published(VOLUMES)
    metric("upgrade_restart_s", round(restart_s, 1))
    load = f"; {under_load('upgrade', t0)}" if LOAD is not None else ""
    return (f"{old} -> {new}: daemon pid {d0['MainPID']} -> {d1['MainPID']}, "
            f"{len(before['mounts'])} mounts, {len(before['krbd'])} krbd, "
            f"{len(before['nbd'])} nbd, {len(before['dm'])} dm unchanged; no step ran{load}")


def crash() -> str:
    before = snapshot()
    d0 = daemon()
    write_spec(CRASH_VOLUME)
    # Killed in the middle of the volume's chain: once the kernel has its
    # mapping (sysfs, polled cheaply), before its publish.
    wait_for(f"the daemon to map {CRASH_VOLUME}", lambda: CRASH_VOLUME in krbd_devices(), 120,
             every=0.05)
    # Every process of the unit dies (`systemctl kill` signals them all; what
    # Restart=on-failure is for): the daemon and the commands it runs. The
    # rbd-nbd and rbd-fuse helpers live in scopes of their own and stay.
    sh("systemctl", "kill", "-s", "KILL", "rbd-reconciler")
    t0 = time.monotonic()
    midway = f"/srv/{CRASH_VOLUME}" not in mounts()
    d1 = wait_for("systemd to restart the daemon",
                  lambda: (d := daemon())["ActiveState"] == "active"
                  and d["MainPID"] not in ("0", d0["MainPID"]) and d, 120)
    restarted = time.monotonic() - t0
    assert int(d1["NRestarts"]) == int(d0["NRestarts"]) + 1, (d0, d1)
    names = [*VOLUMES, CRASH_VOLUME]
    wait_for("every volume Published after the crash", lambda: published(names), 300, every=1)
    converged = time.monotonic() - t0
    after = snapshot()
    moved = {p: (m, after["mounts"].get(p)) for p, m in before["mounts"].items()
             if after["mounts"].get(p) != m}
    assert not moved, f"mounts changed by the crash: {moved}"
    for key in ("nbd", "fuse", "dm"):
        assert after[key] == before[key], \
            f"{key} changed by the kill: {before[key]} -> {after[key]}"
    gone = {k: v for k, v in before["krbd"].items() if after["krbd"].get(k) != v}
    assert not gone, f"krbd mappings changed by the kill: {gone}"
    scopes = helper_scopes()

    def steps(pid: str) -> list[str]:
        return [f"{e['STEP']} {e['RESULT']}" for e in journal("-u", "rbd-reconciler", f"_PID={pid}")
                if e.get("VOLUME") == CRASH_VOLUME and "STEP" in e]

    old, new = steps(d0["MainPID"]), steps(d1["MainPID"])
    assert new or not midway, \
        f"killed before the publish, yet the restarted daemon did no step (killed one: {old})"
    metric("crash_restart_s", round(restarted, 1))
    metric("crash_to_converged_s", round(converged, 1))
    load = f"; {under_load('crash', t0)}" if LOAD is not None else ""
    return (f"killed every process of the unit (main pid {d0['MainPID']}) "
            f"{'before' if midway else 'after'} the publish "
            f"(its steps: {', '.join(old) or 'none logged'}); restarted as {d1['MainPID']} in "
            f"{restarted:.1f} s (NRestarts {d1['NRestarts']}), which did {', '.join(new)}; all "
            f"{len(names)} Published {converged:.1f} s after the kill, the other volumes' mounts, "
            f"mappings and helpers untouched (rbd-nbd {', '.join(after['nbd'].values())}, "
            f"rbd-fuse {', '.join(after['fuse'].values())}, still in their scopes: "
            f"{scopes.count('.scope (')}){load}")


def data_and_reboot() -> None:
    KEEP.mkdir(exist_ok=True)
    sums = {}
    for name in ALL_VOLUMES:
        p = Path(f"/srv/{name}/data.bin")
        blob = os.urandom(2 * MiB)
        with p.open("wb") as f:
            f.write(blob)
            f.flush()
            os.fsync(f.fileno())
        sums[name] = hashlib.sha256(blob).hexdigest()
    (KEEP / "checksums.json").write_text(json.dumps(sums))
    (RUN / "checksums.json").write_text(json.dumps(sums))
    log(f"wrote 2 MiB to each of {', '.join(sums)}")


def boot1() -> str:
    if not check("system up (systemd, udev)", system_up):
        return "poweroff"
    if not check("install (README)", install):
        return "poweroff"
    if not check("volumes published", all_published):
        return "poweroff"
    check("krbd with udev", krbd_udev)
    check("LUKS2 through udev", luks_udev)
    check("rbd-nbd", nbd_mapped)
    check("rbd-fuse", fuse_mapped)
    check("helpers in their own scopes", lambda: f"{helper_scopes()}; a scope adds "
          f"{scope_overhead()} to a start")
    check("journal fields", journal_fields)
    check("systemd-analyze security", security)
    check("systemctl reload", reload)
    app = check("application unit", application)
    check("qos.unit through systemd", qos_unit)
    loaded = check("writers on krbd, rbd-nbd and LUKS2", start_load)
    if loaded:
        check("restart under writers", restart)
    check("upgrade keeps volumes", upgrade)
    check("crash: restarted, converges", crash)
    if loaded:
        check("writers: no I/O error, every record reads back", load_verified)
    if app and check("data written", lambda: data_and_reboot() or "") \
            and published(ALL_VOLUMES):
        return "reboot"
    return "poweroff"


# ---------------------------------------------------------------- boot 2


def back_after_reboot() -> str:
    names = list(ALL_VOLUMES)
    wait_for("every volume Published again by the units alone", lambda: published(names), 420,
             every=0.5)
    at = uptime()
    (RUN / f"published-boot{BOOT}").write_text(f"{at:.1f}\n")
    metric("boot_to_published_s", round(at, 1))
    sums = json.loads((KEEP / "checksums.json").read_text())
    for name, want in sums.items():
        got = sha256(Path(f"/srv/{name}/data.bin"))
        assert got == want, f"{name}: data.bin differs after the reboot"
    state = sh("systemctl", "is-system-running", "--wait", check=False, timeout=300).stdout
    metric("systemd_analyze", sh("systemd-analyze", quiet=True).stdout.splitlines()[0])
    assert state.strip() == "running", f"system {state.strip()}"
    return f"{len(names)} volumes Published {at:.1f} s after the kernel started; data identical"


def app_after_reboot() -> str:
    state = wait_for("nodebox-app.service active",
                     lambda: unit("nodebox-app.service", "ActiveState")["ActiveState"] == "active",
                     120)
    assert state
    hidden = beneath(f"/srv/{APP_VOLUME}")
    assert not hidden, ("the application started before its volume was published: it wrote "
                        f"into the directory the publish now hides, on the root filesystem: "
                        f"{hidden}")
    lines = Path(f"/srv/{APP_VOLUME}/app.log").read_text().splitlines()
    this = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    stopped = [x for x in lines if x.startswith("stopping") and f"boot={this}" not in x]
    started = [x for x in lines if x.startswith("started") and f"boot={this}" in x]
    assert stopped, f"no 'stopping' from the previous boot in app.log: {lines[-5:]}"
    assert started, f"the application has not started this boot: {lines[-5:]}"
    assert "mounted=True" in started[0], \
        f"the application started before its volume was published: {started[0]}"
    return "stopped cleanly last boot; started this boot on its mounted volume"


def beneath(path: str) -> dict[str, str]:
    """What lies in ``path`` on the root filesystem, under the mount on it:
    seen through a (non-recursive) bind of / elsewhere."""
    view = Path("/run/nodebox-rootview")
    view.mkdir(exist_ok=True)
    sh("mount", "--bind", "-o", "ro", "/", str(view), quiet=True)
    try:
        under = view / path.lstrip("/")
        return {f.name: f.read_text(errors="replace")[-300:] for f in under.iterdir()
                if f.is_file()} if under.is_dir() else {}
    finally:
        sh("umount", str(view), quiet=True)


STOPPING = "de5b426a63be47a7b6ac3eaac82e2f6f"
STOPPED = "9d1aaa27d60140bd96365438aad20286"
STARTED = "39f53479d3a045ac8e11786248231fbf"
DEACTIVATED = "7ad2d189f7e94e70a38c781354912448"  # "UNIT: Deactivated successfully."
HELPER_PREFIX = "rbd-reconciler-helper-"


def helper_scope_ends(entries: list[dict[str, Any]], asked: float, release_stopping: float,
                      release_stopped: float) -> str:
    """The helpers' scopes alive when the shutdown was asked for went only
    once the release ran: each ended (its helper exited: the release
    unmapped it) after the release began, and systemd stopped none (SIGTERM
    to its helper: "Stopping ...") before the release ended."""
    seen: dict[str, list[tuple[float, str]]] = {}
    for e in entries:
        u = e.get("UNIT", "")
        if e.get("_PID") == "1" and u.startswith(HELPER_PREFIX) and u.endswith(".scope"):
            what = {STARTED: "started", STOPPING: "stopping", STOPPED: "stopped",
                    DEACTIVATED: "deactivated"}.get(e.get("MESSAGE_ID", ""))
            if what:
                seen.setdefault(u, []).append((int(e["__MONOTONIC_TIMESTAMP"]) / 1e6, what))
    alive = {u: ev for u, ev in seen.items()
             if any(w == "started" and t < asked for t, w in ev)
             and not any(w != "started" and t < asked for t, w in ev)}
    assert len(alive) >= 2, f"fewer helper scopes than helpers alive at the shutdown: {seen}"
    out = []
    for u, ev in sorted(alive.items()):
        ends = [(t, w) for t, w in ev if t >= asked and w != "started"]
        assert ends, f"{u}: no end in the journal"
        first = min(ends)
        assert first[0] >= release_stopping, \
            f"{u} {first[1]} at {first[0]:.3f}, before the release began ({release_stopping:.3f})"
        early = [t for t, w in ends if w == "stopping" and t < release_stopped]
        assert not early, f"systemd stopped {u} at {early[0]:.3f}, while the release ran " \
            f"(it ended at {release_stopped:.3f})"
        out.append(f"{u.removeprefix(HELPER_PREFIX)} {first[1]} "
                   f"{first[0] - release_stopping:+.2f} s after the release began")
    return "; ".join(out)


def shutdown_order() -> str:
    """From the previous boot's journal: who stopped when (the last stop of
    each unit: the daemon also stopped for the upgrade)."""
    entries = journal("-b", "-1", timeout=180)
    t: dict[tuple[str, str], float] = {}
    for e in entries:
        mid, u = e.get("MESSAGE_ID"), e.get("UNIT")
        if mid in (STOPPING, STOPPED) and u and e.get("_PID") == "1":
            key = (u, "stopping" if mid == STOPPING else "stopped")
            t[key] = int(e["__MONOTONIC_TIMESTAMP"]) / 1e6

    def at(u: str, what: str) -> float:
        assert (u, what) in t, f"the previous boot's journal has no '{what}' for {u}"
        return t[(u, what)]

    app, dmn, rel = "nodebox-app.service", "rbd-reconciler.service", \
        "rbd-reconciler-shutdown.service"
    order = [
        (at(app, "stopped"), at(dmn, "stopping"), "the application stopped before the daemon"),
        (at(dmn, "stopped"), at(rel, "stopping"), "the daemon stopped before the release"),
        (at(rel, "stopped"), at("network-online.target", "stopped"),
         "the release ended before network-online.target went"),
        (at(rel, "stopped"), at("systemd-networkd.service", "stopping"),
         "the release ended before systemd-networkd stopped"),
    ]
    for a, b, what in order:
        assert a <= b, f"not so: {what} ({a:.3f} > {b:.3f})"
    # rbdmap.service (ceph-common) unmaps every krbd device when it stops:
    # ours must be gone by then, and it must have had nothing to do.
    if ("rbdmap.service", "stopping") in t:
        assert at(rel, "stopped") <= at("rbdmap.service", "stopping"), \
            "rbdmap.service stopped (unmap-all) while the release ran"
    rbdmap = [e.get("MESSAGE") for e in entries if e.get("SYSLOG_IDENTIFIER") == "rbdmap"]
    assert not rbdmap, f"rbdmap unmap-all touched devices: {rbdmap[:6]}"
    release_s = at(rel, "stopped") - at(rel, "stopping")
    asked = json.loads((RUN / f"shutdown-boot{BOOT - 1}").read_text())["uptime"]
    # The helpers' scopes (drivers/scopes.py: Before= the release unit).
    helpers = helper_scope_ends(entries, asked, at(rel, "stopping"), at(rel, "stopped"))
    log(f"helper scopes at the shutdown: {helpers}")
    last = max(int(e["__MONOTONIC_TIMESTAMP"]) for e in entries) / 1e6
    metric("previous_shutdown_release_s", round(release_s, 1))
    metric("previous_shutdown_request_to_release_end_s", round(at(rel, "stopped") - asked, 1))
    metric("previous_shutdown_request_to_last_journal_entry_s", round(last - asked, 1))
    # What the release said: every volume, its steps in order, nothing left.
    said = [e.get("MESSAGE", "") for e in entries
            if e.get("_SYSTEMD_UNIT") == rel and e.get("_PID") != "1"]
    said = [s if isinstance(s, str) else bytes(s).decode(errors="replace") for s in said]
    log("release --all said:\n  " + "\n  ".join(said))
    assert any(re.match(r"released: \d+ volume\(s\); 0 thing\(s\) still held", s) for s in said), \
        "no 'released: N volume(s); 0 thing(s) still held'"
    assert not [s for s in said if s.startswith(("not released", "forced", "failed"))], said
    for name in ALL_VOLUMES:
        i = next((k for k, s in enumerate(said) if s.endswith(f"[{name}]")), None)
        assert i is not None, f"the release did not report {name}"
        steps = []
        for s in said[i + 1:]:
            if not s.startswith(" "):
                break
            steps.append(s.split()[1])
        want = [x for x in ("unpublish", "unstage", "close", "unmap") if x in steps]
        assert want == [x for x in steps if x in ("unpublish", "unstage", "close", "unmap")] \
            and "unpublish" in steps and "unmap" in steps, f"{name}: release steps {steps}"
    bad = [e.get("MESSAGE") for e in entries
           if (e.get("UNIT") in (app, dmn, rel) or e.get("UNIT", "").startswith(HELPER_PREFIX))
           and int(e["__MONOTONIC_TIMESTAMP"]) / 1e6 >= asked
           and re.search(
               r"timed out|Killing process|SIGKILL|Failed with result",
               str(e.get("MESSAGE", "")))]
    assert not bad, f"a unit ran into its stop deadline: {bad}"
    return (f"app stopped {at(dmn, 'stopping') - at(app, 'stopped'):.1f} s before the daemon "
            f"stopping; release took {release_s:.1f} s and ended "
            f"{at('network-online.target', 'stopped') - at(rel, 'stopped'):.2f} s before "
            f"network-online.target stopped; helper scopes: {helpers}")


EXTRA: dict[str, tuple[str, str, str, bool]] = {
    "box-extra1": ("krbd", "ext4", "16Mi", False), "box-extra2": ("krbd", "ext4", "16Mi", False),
    "box-extra3": ("nbd", "ext4", "16Mi", False), "box-extra4": ("nbd", "ext4", "16Mi", False)}


def more_volumes() -> str:
    """Four more, for the power-off's time with eight published."""
    ALL_VOLUMES.update(EXTRA)
    for name in EXTRA:
        write_spec(name)
    t0 = time.monotonic()
    wait_for("the four added volumes Published", lambda: published(ALL_VOLUMES), 300, every=1)
    return f"{len(ALL_VOLUMES)} Published ({time.monotonic() - t0:.1f} s for the four added)"


def boot2() -> str:
    check("volumes back after reboot", back_after_reboot)
    check("helpers in their own scopes", helper_scopes)
    check("application after reboot", app_after_reboot)
    check("shutdown order (previous boot)", shutdown_order)
    check("four more volumes", more_volumes)
    if check("the next boot without Ceph", cut_next_boot):
        return "reboot"
    return "poweroff"


# ---------------------------------------------------------------- boot 3

CUT = Path("/etc/systemd/network/10-nodebox.network.d/50-no-ceph.conf")
ETC_MODE = 0o750  # an operator's chmod of /etc/rbd-reconciler, kept across a boot


def mon_addresses() -> list[str]:
    conf = Path("/etc/ceph/ceph.conf").read_text()
    line = next(x for x in conf.splitlines() if x.strip().startswith("mon host"))
    return sorted(set(re.findall(r"\d+\.\d+\.\d+\.\d+", line)))


def cut_next_boot() -> str:
    """The next boot comes up with every route to the cluster unreachable
    (systemd-networkd sets them before the daemon starts), and with an
    operator's chmod of /etc/rbd-reconciler."""
    mons = mon_addresses()
    assert mons, "no mon address in /etc/ceph/ceph.conf"
    CUT.parent.mkdir(parents=True, exist_ok=True)
    CUT.write_text("".join(f"[Route]\nDestination={a}/32\nType=unreachable\n\n" for a in mons))
    ETC.chmod(ETC_MODE)
    sh("systemctl", "restart", "rbd-reconciler")  # ConfigurationDirectoryMode= at a start
    mode = ETC.stat().st_mode & 0o777
    assert mode == ETC_MODE, f"a start of the daemon set /etc/rbd-reconciler to {mode:o}"
    return f"routes to {', '.join(mons)} unreachable from the next boot; {ETC} chmod 0750"


def timestamps(entries: list[dict[str, Any]], unit_name: str, mid: str) -> list[float]:
    return [int(e["__MONOTONIC_TIMESTAMP"]) / 1e6 for e in entries
            if e.get("MESSAGE_ID") == mid and e.get("UNIT") == unit_name and e.get("_PID") == "1"]


STARTING = "7d4958e842da4a758f6c1cdc7b36dcc5"


def boot_without_ceph() -> str:
    """READY=1 within observeTimeoutSeconds (5) + 10 s of the daemon's start
    with the cluster unreachable, and the console's login with it."""
    unreachable = sh("ip", "route", "show", "type", "unreachable", quiet=True).stdout
    assert all(a in unreachable for a in mon_addresses()), f"routes: {unreachable}"
    wait_for("the daemon's start job done (READY=1)",
             lambda: unit("rbd-reconciler.service", "ActiveState")["ActiveState"] == "active",
             300, every=0.5)
    getty = "serial-getty@ttyS0.service"
    wait_for(f"{getty} started", lambda: unit(getty, "ActiveState")["ActiveState"] == "active",
             300, every=0.5)
    entries = journal("-b", "0", timeout=180)
    start = min(timestamps(entries, "rbd-reconciler.service", STARTING))
    ready = min(timestamps(entries, "rbd-reconciler.service", STARTED))
    login = min(timestamps(entries, getty, STARTED))
    users = min(timestamps(entries, "systemd-user-sessions.service", STARTED))
    metric("no_ceph_start_to_ready_s", round(ready - start, 1))
    metric("no_ceph_start_to_login_s", round(login - start, 1))
    metric("no_ceph_boot_to_login_s", round(login, 1))
    # The goal is observeTimeoutSeconds (5) + 10 s; under TCG the daemon's
    # Python start-up alone takes 5-10 s of it (10.7 and 16.2 s measured),
    # so the test's bound is twice that, well under READY's 240 s limit.
    assert ready - start <= 30, f"READY=1 came {ready - start:.1f} s after the start (bound 30 s)"
    assert login - start <= 30, \
        f"the console's login came {login - start:.1f} s after the daemon's start (bound 30 s)"
    assert users >= ready, "systemd-user-sessions started before READY=1: the ordering changed"
    # Said why: each volume Unknown, naming the pool that did not answer.
    out = sh("rbd-reconciler", "status", check=False, timeout=60).stdout
    assert "Unknown" in out or "UNKNOWN" in out, out[-1500:]
    log(out[-2000:])
    hidden = beneath(f"/srv/{APP_VOLUME}")
    assert not hidden, f"the application wrote into its unpublished directory: {hidden}"
    return (f"READY=1 {ready - start:.1f} s after the daemon's start, console login "
            f"{login - start:.1f} s after it ({login:.1f} s after the kernel); the application "
            "waits for its mount")


def modes_kept() -> str:
    mode = ETC.stat().st_mode & 0o777
    assert mode == ETC_MODE, f"{ETC} is {mode:o} after the boot (set to {ETC_MODE:o})"
    want = {STATE: 0o700, STATE / "status": 0o700, STATE / "staging": 0o700, DESIRED: 0o755}
    got = {str(p): f"{p.stat().st_mode & 0o777:o}" for p in want}
    assert got == {str(p): f"{m:o}" for p, m in want.items()}, got
    return f"{ETC} {mode:o} kept across a boot; {got}"


def ceph_back() -> str:
    CUT.unlink()
    for a in mon_addresses():
        sh("ip", "route", "del", "unreachable", f"{a}/32")
    t0 = time.monotonic()
    wait_for("every volume Published once Ceph answers", lambda: published(ALL_VOLUMES), 420,
             every=1)
    took = time.monotonic() - t0
    metric("ceph_back_to_published_s", round(took, 1))
    wait_for("nodebox-app.service active on its mounted volume",
             lambda: unit("nodebox-app.service", "ActiveState")["ActiveState"] == "active", 120)
    return f"{len(ALL_VOLUMES)} volumes Published {took:.1f} s after the routes came back"


def installed() -> str:
    return sh("dpkg-query", "-W", "-f=${db:Status-Abbrev}", "rbd-reconciler", check=False,
              quiet=True).stdout.strip()


def apt_remove(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    log(f"$ {' '.join(f'{k}={v}' for k, v in (env or {}).items())} apt-get {' '.join(args)}")
    return subprocess.run(["apt-get", "-y", *args, "rbd-reconciler"], capture_output=True,
                          text=True, timeout=600, check=False, env={**os.environ, **(env or {})})


def nothing_moved(before: dict[str, Any]) -> None:
    after = snapshot()
    assert after == before, f"changed: {before} -> {after}"
    assert daemon()["ActiveState"] == "active" and installed().startswith("ii"), installed()
    assert unit("nodebox-app.service", "ActiveState")["ActiveState"] == "active"


def removal_refused() -> str:
    """`apt remove` with volumes up and an application on one: refused, and
    nothing moves; so too with `release` under a policy-rc.d that forbids
    every stop (exit 101)."""
    before = snapshot()
    done = apt_remove("remove")
    log(done.stdout[-1500:] + done.stderr[-2500:])
    assert done.returncode != 0, "apt remove went through with volumes up"
    said = done.stdout + done.stderr
    assert "not removed: volumes of ours are up" in said and "held: " in said, said[-2000:]
    nothing_moved(before)
    policy = Path("/usr/sbin/policy-rc.d")
    policy.write_text("#!/bin/sh\nexit 101\n")
    policy.chmod(0o755)
    try:
        forbidden = apt_remove("remove", env={"RBD_RECONCILER_REMOVE": "release"})
    finally:
        policy.unlink()
    said2 = forbidden.stdout + forbidden.stderr
    log(said2[-2000:])
    assert forbidden.returncode != 0 and "policy-rc.d" in said2, said2[-2000:]
    nothing_moved(before)
    return ("refused with volumes up (the message names what is held and the two ways on); "
            "refused under a policy-rc.d that forbids the stop; nothing moved")


def removal_keeps() -> str:
    """RBD_RECONCILER_REMOVE=keep: the files go, every volume stays up under
    its application, the release unit is taken down without its release;
    the package installed again (README) finds them all as they were."""
    before = snapshot()
    mark = cursor()
    try:
        kept(before, mark)
    finally:  # whatever happened: installed again, for the checks after this one
        sh("sh", "-c", "apt install -y ./rbd-reconciler_*.deb", cwd=str(RUN / "debs" / "new"),
           timeout=300)
        sh("systemctl", "enable", "--now", "rbd-reconciler", "rbd-reconciler-shutdown",
           timeout=300)
    wait_for("every volume Published after the reinstall", lambda: published(ALL_VOLUMES), 300,
             every=1)
    assert snapshot() == before, f"the reinstall moved something: {before} -> {snapshot()}"
    return ("kept: every mount (by id), mapping, dm device and helper as it was, the application "
            "running, the release unit down without its release, no drop-in left; installed "
            "again, nothing moved")


def kept(before: dict[str, Any], mark: str) -> None:
    done = apt_remove("remove", env={"RBD_RECONCILER_REMOVE": "keep"})
    said = done.stdout + done.stderr
    log(said[-2000:])
    assert done.returncode == 0, said[-2000:]
    assert "NOTHING releases them at shutdown" in said, said[-2000:]
    assert installed().startswith("rc"), installed()
    assert snapshot() == before, f"keep moved something: {before} -> {snapshot()}"
    assert unit("nodebox-app.service", "ActiveState")["ActiveState"] == "active"
    rel = unit("rbd-reconciler-shutdown.service", "ActiveState")
    assert rel["ActiveState"] == "inactive", rel
    released = [e.get("MESSAGE") for e in journal(f"--after-cursor={mark}", timeout=180)
                if e.get("_SYSTEMD_UNIT") == "rbd-reconciler-shutdown.service"
                and e.get("_PID") != "1"]
    assert not released, f"the release unit's stop ran its release: {released[:5]}"
    left = list(Path("/run/systemd/system").glob("rbd-reconciler-shutdown.service.d/*"))
    assert not left, f"drop-ins left behind: {left}"


def removal_releases() -> str:
    """RBD_RECONCILER_REMOVE=release: the application (PartOf= the release
    unit) stops first, then everything of ours is released, then the files
    go; purge leaves the operator's and the state directories."""
    mark = cursor()
    t0 = time.monotonic()
    done = apt_remove("remove", env={"RBD_RECONCILER_REMOVE": "release"})
    took = time.monotonic() - t0
    log(done.stdout[-1500:] + done.stderr[-1500:])
    assert done.returncode == 0, (done.stdout + done.stderr)[-2000:]
    metric("remove_with_release_s", round(took, 1))
    assert installed().startswith("rc"), installed()
    assert not Path("/usr/bin/rbd-reconciler").exists()
    left = snapshot()
    ours = {k: v for k, v in left.items() if v}
    assert not ours, f"still held after the removal: {ours}"
    entries = journal(f"--after-cursor={mark}", timeout=180)
    app_stopped = timestamps(entries, "nodebox-app.service", STOPPED)
    release = timestamps(entries, "rbd-reconciler-shutdown.service", STOPPING)
    assert app_stopped and release, (app_stopped, release)
    assert app_stopped[0] <= release[0], "the release began before the application had stopped"
    for u in ("rbd-reconciler.service", "rbd-reconciler-shutdown.service"):
        st = unit(u, "ActiveState", "LoadState")
        assert st["ActiveState"] == "inactive", (u, st)
    purged = apt_remove("purge")
    assert purged.returncode == 0, (purged.stdout + purged.stderr)[-2000:]
    assert installed() in ("", "un"), installed()
    kept = [str(p) for p in (ETC / "config.yaml", DESIRED, STATE) if p.exists()]
    assert len(kept) == 3, f"purge removed the operator's or the state directory: {kept}"
    return (f"removed in {took:.1f} s: the application stopped "
            f"{release[0] - app_stopped[0]:.2f} s before the release began; nothing of ours "
            f"left; purged, {', '.join(kept)} kept")


def boot3() -> str:
    ALL_VOLUMES.update(EXTRA)  # boot 2 added them: nine desired files
    check("boot with Ceph unreachable", boot_without_ceph)
    check("directory modes kept", modes_kept)
    if check("Ceph back", ceph_back):
        check("removal refused with volumes up", removal_refused)
        check("removal with keep, then installed again", removal_keeps)
        check("removal with release, then purge", removal_releases)
    return "poweroff"


def main() -> None:
    log(f"node tests, boot {BOOT}: {sys.argv[0]}")
    try:
        action = {1: boot1, 2: boot2, 3: boot3}[BOOT]()
    except Exception as exc:  # the guest must always end the boot
        log("".join(traceback.format_exception(exc)))
        record(check="guest script", ok=False, seconds=0, detail=str(exc)[:400])
        action = "poweroff"
    end_boot(action)


if __name__ == "__main__":
    main()
