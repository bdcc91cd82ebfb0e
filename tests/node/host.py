"""The node tests' host half: boot the node, follow it, report.

Run by scripts/node-tests.sh inside its private network namespace, under
`devcluster run` (the cluster's conf and keyring are in the environment).
It fills the run share (parameters, the packages, the node's Ceph config),
makes a qcow2 overlay of the cached image and boots it with QEMU (TCG) as
often as the node asks: tests/node/guest.py, run at every boot by a unit of
the image, ends each boot by writing `end-bootN` (`reboot` or `poweroff`)
and rebooting or powering off through systemd; QEMU runs with -no-reboot,
so a reboot ends QEMU and the next boot starts it again on the same disk.
Each boot has a deadline and so has the whole; what timed out is said, with
the console's last lines. The exit status is 0 only when every check of
every boot passed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

BOOTS = 3
BOOT_LIMIT_S = {1: 900, 2: 420, 3: 720}  # each boot's own deadline, inside the whole one
APPEND = ("console=ttyS0,115200 rw net.ifnames=0 panic=-1 systemd.show_status=1 "
          "random.trust_cpu=on")


def say(msg: str) -> None:
    print(f"node-tests: {msg}", file=sys.stderr, flush=True)


def ceph_config(share: Path) -> None:
    """The node's /etc/ceph: the cluster's fsid and mon address only (the
    host's conf names host paths), and the admin keyring."""
    conf = Path(os.environ["RBD_RECONCILER_CEPH_CONF"])
    keep = [line.strip() for line in conf.read_text().splitlines()
            if line.strip().split(" ", 1)[0] in ("fsid", "mon")
            and line.strip().startswith(("fsid", "mon host"))]
    d = share / "ceph"
    d.mkdir()
    (d / "ceph.conf").write_text("[global]\n" + "\n".join(keep) + "\n")
    shutil.copy(os.environ["RBD_RECONCILER_CEPH_KEYRING"], d / "ceph.client.admin.keyring")


class Follow(threading.Thread):
    """Copies the lines the guest appends to its log to our stderr."""

    def __init__(self, path: Path, prefix: str) -> None:
        super().__init__(daemon=True)
        self.path, self.prefix = path, prefix
        self.done = threading.Event()

    def run(self) -> None:
        pos, partial = 0, b""
        while True:
            last = self.done.is_set()
            try:
                with self.path.open("rb") as f:
                    f.seek(pos)
                    chunk = f.read()
            except FileNotFoundError:
                chunk = b""
            pos += len(chunk)
            lines = (partial + chunk).split(b"\n")
            partial = lines.pop()
            for line in lines:
                print(f"{self.prefix}{line.decode(errors='replace')}", file=sys.stderr, flush=True)
            if last:
                if partial:
                    print(f"{self.prefix}{partial.decode(errors='replace')}", file=sys.stderr)
                return
            self.done.wait(0.3)


def boot(n: int, args: argparse.Namespace, share: Path, overlay: Path) -> dict:
    """One boot, from QEMU's start to its exit: what the host saw, timed."""
    run: Path = args.run
    console = run / f"console-boot{n}.log"
    (share / "boot").write_text(f"{n}\n")
    argv = ["qemu-system-x86_64", "-machine", "q35,accel=tcg", "-cpu", "max",
            "-smp", "2", "-m", "2048", "-nodefaults", "-no-user-config", "-display", "none",
            "-no-reboot", "-serial", f"file:{console}",
            "-kernel", str(args.image / "vmlinuz"), "-initrd", str(args.image / "initrd.img"),
            "-append", APPEND,
            "-drive", f"file={overlay},if=virtio,format=qcow2",
            "-netdev", "user,id=n0", "-device", "virtio-net-pci,netdev=n0",
            "-device", "virtio-rng-pci",
            "-fsdev", f"local,id=run,path={share},security_model=none",
            "-device", "virtio-9p-pci,fsdev=run,mount_tag=run",
            "-fsdev", f"local,id=repo,path={args.repo},security_model=none,readonly=on",
            "-device", "virtio-9p-pci,fsdev=repo,mount_tag=repo"]
    limit = min(args.deadline - time.time(), BOOT_LIMIT_S[n])
    seen: dict[str, float] = {}
    say(f"boot {n}: QEMU (deadline {limit:.0f} s)")
    t0 = time.monotonic()
    follow = Follow(share / f"guest-boot{n}.log", f"[boot {n}] ")
    follow.start()
    qemu = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=(run / "qemu.out").open("ab"),
                            stderr=subprocess.STDOUT, start_new_session=True)
    timed_out = False
    try:
        while qemu.poll() is None:
            now = time.monotonic()
            for mark in ("published", "shutdown"):
                if mark not in seen and (share / f"{mark}-boot{n}").exists():
                    seen[mark] = now - t0
            if now - t0 > limit:
                timed_out = True
                say(f"boot {n}: the node did not finish within {limit:.0f} s (QEMU killed); "
                    "its console's last lines:")
                qemu.kill()
                qemu.wait()
                break
            time.sleep(0.1)
    finally:
        if qemu.poll() is None:
            qemu.kill()
            qemu.wait()
        follow.done.set()
        follow.join(5)
    ended = time.monotonic() - t0
    if timed_out or not (share / f"end-boot{n}").exists():
        if not timed_out:
            say(f"boot {n}: QEMU exited ({qemu.returncode}) without the guest's end of boot; "
                "its console's last lines:")
        try:
            tail = console.read_text(errors="replace").splitlines()[-40:]
        except OSError as exc:  # seen once: the run directory gone under us
            tail = [f"(no console log: {exc})"]
        print("\n".join(tail), file=sys.stderr)
    out = {"boot": n, "qemu_s": round(ended, 1), "timed_out": timed_out,
           "end": (share / f"end-boot{n}").read_text().strip()
           if (share / f"end-boot{n}").exists() else None}
    if "published" in seen:
        out["start_to_published_s"] = round(seen["published"], 1)
    if "shutdown" in seen:
        out["shutdown_s"] = round(ended - seen["shutdown"], 1)
        marker = json.loads((share / f"shutdown-boot{n}").read_text())
        out["published_at_shutdown"] = len(marker["published"])
    return out


# systemd's console line when a stop job starts running ("Stopping UNIT -
# DESCRIPTION..."); for a helper's scope that is systemd signalling the
# helper (SIGTERM, SIGKILL at the scope's stop timeout). The line is cut in
# its middle to the console's width ("rbd-reconciler-he…lper: rbd-nbd for
# rbd/x..."), so a helper's is any of ours but the release unit's (its name
# begins "rbd-reconciler-s", its description ends "unmap)") and the
# daemon's ("rbd-reconciler.service").
OURS_STOPPING = re.compile(r"Stopping (rbd-reconciler-.*?)(?:\.\.\.)?$", re.MULTILINE)
ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def helper_stops(run: Path, n: int) -> dict:
    """The shutdown that ended boot ``n``, from its console (the power-off
    has no later boot whose journal could say): each helper's scope must
    end by itself as the release unmaps its helper, before any stop job of
    its own runs; one that runs is systemd killing a helper still serving."""
    check = "helper scopes at the shutdown (console)"
    try:
        text = ANSI.sub("", (run / f"console-boot{n}.log").read_text(errors="replace"))
    except OSError as exc:
        return {"boot": n, "check": check, "ok": False, "seconds": 0,
                "detail": f"no console log: {exc}"}
    ours = [u.strip().rstrip(".") for u in OURS_STOPPING.findall(text.replace("\r", ""))]
    stopped = [u for u in ours if not u.startswith("rbd-reconciler-s") and not u.endswith("unmap)")]
    return {"boot": n, "check": check, "ok": not stopped, "seconds": 0,
            "detail": "; ".join(f"systemd stopped {u}" for u in stopped)
            or "systemd stopped none: each ended with its helper"}


def results(share: Path) -> tuple[list[dict], list[dict]]:
    checks, metrics = [], []
    for f in sorted(share.glob("results-boot*.jsonl")):
        for line in f.read_text().splitlines():
            rec = json.loads(line)
            (metrics if "metric" in rec else checks).append(rec)
    return checks, metrics


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--run", type=Path, required=True)
    p.add_argument("--image", type=Path, required=True)
    p.add_argument("--repo", type=Path, required=True)
    p.add_argument("--deb", type=Path, required=True)
    p.add_argument("--newer-deb", type=Path)
    p.add_argument("--deadline", type=float, required=True, help="epoch seconds")
    args = p.parse_args()
    share = args.run / "share"
    share.mkdir()
    for sub, deb in (("old", args.deb), ("new", args.newer_deb)):
        if deb is not None:
            (share / "debs" / sub).mkdir(parents=True)
            shutil.copy(deb, share / "debs" / sub / deb.name)
    ceph_config(share)
    (share / "params.json").write_text(json.dumps({
        "pool": os.environ.get("RBD_RECONCILER_POOL", "rbd"),
        "deb": args.deb.name,
        "newer_deb": args.newer_deb.name if args.newer_deb else None,
    }))
    overlay = args.run / "overlay.qcow2"
    subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", "-F", "raw",
                    "-b", str(args.image / "base.raw"), str(overlay)], check=True)
    boots = []
    for n in range(1, BOOTS + 1):
        if args.deadline - time.time() < 60:
            say(f"no time left for boot {n}")
            break
        b = boot(n, args, share, overlay)
        boots.append(b)
        if b["end"] != "reboot":
            break
    checks, metrics = results(share)
    checks += [helper_stops(args.run, b["boot"]) for b in boots if b["end"] is not None]
    say("results:")
    for c in checks:
        mark = "ok  " if c["ok"] else "FAIL"
        print(f"  {mark} boot {c['boot']} {c['check']:<28} {c['seconds']:7.1f} s"
              f"{'  ' + c['detail'] if c.get('detail') else ''}", file=sys.stderr)
    for m in metrics:
        print(f"  metric boot {m['boot']} {m['metric']}: {m['value']}", file=sys.stderr)
    for b in boots:
        print(f"  host: boot {b['boot']}: QEMU ran {b['qemu_s']} s"
              + (f"; QEMU start to every volume Published {b['start_to_published_s']} s"
                 if "start_to_published_s" in b else "")
              + (f"; {b['end']} with {b['published_at_shutdown']} volume(s) published: "
                 f"{b['shutdown_s']} s from the request to QEMU's exit"
                 if "shutdown_s" in b else ""), file=sys.stderr)
    (args.run / "summary.json").write_text(json.dumps(
        {"checks": checks, "metrics": metrics, "boots": boots}, indent=1))
    failed = [c["check"] for c in checks if not c["ok"]]
    incomplete = len(boots) < BOOTS or boots[-1]["end"] != "poweroff"
    if failed:
        say(f"failed: {', '.join(failed)}")
    if incomplete:
        say("the node did not go through every boot to its final power-off")
    if not checks:
        say("no check ran")
    return 1 if failed or incomplete or not checks else 0


if __name__ == "__main__":
    sys.exit(main())
