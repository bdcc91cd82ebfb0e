#!/usr/bin/env python3
"""P14: the kernel paths, in the VM of scripts/kernel-tests.sh (ratios only:
everything there is emulated, so absolute times mean little).

For krbd and rbd-nbd: one `rbd-reconciler apply` of a new volume (create,
map, mkfs.ext4, mount at staging, bind at the target) vs the same raw
commands in a shell; and an encrypted volume (LUKS2, wrappedBy, pbkdf2 with
fixed iterations) vs a plain one, both through apply on krbd. Trials are
paired and interleaved; each side's teardown is not timed.

Run it with: scripts/kernel-tests.sh --bench [--trials N] [--breakdown NAME]
[--daemon] [--before CHECKOUT]
(inside the VM it reads the cluster from RBD_RECONCILER_CEPH_CONF/...).

--breakdown NAME: first, for krbd, nbd and krbd with LUKS2, where one
apply's time goes: each raw command timed on its own; one apply traced by
benchmarks/p14_trace.py (phases, steps, every command, Ceph calls, sleeps:
trace-*.json, and the summary breakdown.txt); one under cProfile
(profile-*.pstats, its top in breakdown.txt); one with -X importtime
(importtime-*.txt). Written in the guest under $KERNEL_TESTS_OUT/NAME, which
kernel-tests.sh copies to .p14-breakdown/NAME on the host. --trials 0: the
breakdown alone.

--daemon: one more arm, the same apply while `rbd-reconciler run` serves a
node of its own (the command line hands the apply to it: no cold start).

--before CHECKOUT: another checkout of the project with its own .venv (the
code before a change; outside /tmp, which the guest does not share): its
apply is one more arm of every trial, so before, after and raw are measured
paired and interleaved in one boot (the order of the arms rotates); with
--breakdown, one apply of that code is traced too.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CLI = str(REPO / ".venv" / "bin" / "rbd-reconciler")
PY = str(REPO / ".venv" / "bin" / "python")
TRACE = str(REPO / "benchmarks" / "p14_trace.py")
TIMEOUT = 600.0
MKFS = "-q -m0 -E nodiscard,lazy_itable_init=1,lazy_journal_init=1"

RAW = f"""\
set -euo pipefail
conf=$1 pool=$2 img=$3 mapper=$4 staging=$5 target=$6
rbd create -c "$conf" --size 64M "$pool/$img"
if [[ $mapper == krbd ]]; then
  dev=$(rbd device map -c "$conf" -o noudev "$pool/$img")
else
  dev=$(rbd device map -t nbd -c "$conf" "$pool/$img")
fi
mkfs.ext4 {MKFS} "$dev"
mkdir -p "$staging" "$target"
mount "$dev" "$staging"
mount --bind "$staging" "$target"
echo "$dev"
"""


def sh(argv: list[str], stderr: Path | None = None) -> str:
    """stdout; ``stderr``: a file it goes to (else captured, shown on failure)."""
    with open(stderr or os.devnull, "w") as err:
        res = subprocess.run(argv, stdout=subprocess.PIPE,
                             stderr=err if stderr else subprocess.PIPE, text=True,
                             timeout=TIMEOUT)
    if res.returncode:
        said = (res.stderr or "")[-2000:] if not stderr else f"(stderr in {stderr})"
        raise RuntimeError(f"{' '.join(argv)}: exit {res.returncode}: {said}")
    return res.stdout


class Node:
    def __init__(self, root: Path, encrypted_keys: Path, cli: str = CLI) -> None:
        self.root, self.cli = root, cli
        self.desired, self.state, self.srv = root / "desired", root / "state", root / "srv"
        for d in (self.desired, self.state, self.srv):
            d.mkdir(parents=True)
        self.pool = os.environ.get("RBD_RECONCILER_POOL", "rbd")
        self.conf = os.environ["RBD_RECONCILER_CEPH_CONF"]
        self.config = root / "config.yaml"
        self.config.write_text(
            f"desiredDir: {self.desired}\nstateDir: {self.state}\nnodeName: p14\n"
            f"controlSocket: {self.state}/control.sock\n"
            f"ceph:\n  conf: {self.conf}\n  user: {os.environ.get('RBD_RECONCILER_CEPH_USER')}\n"
            f"  keyring: {os.environ['RBD_RECONCILER_CEPH_KEYRING']}\n"
            f"allowedRoots: [{self.srv}]\n"
            f"encryption:\n  keyRoot: {encrypted_keys}\n  pbkdf: pbkdf2\n  iterations: 1000\n")
        self.keys = encrypted_keys
        self.daemon: subprocess.Popen[bytes] | None = None

    def start_daemon(self, deadline_s: float = 300.0) -> None:
        """`rbd-reconciler run` for this node: its `apply` is then done by
        the running daemon (the command line hands it over the control
        socket), as on a node where the units run it."""
        with open(self.root / "daemon.log", "ab") as log:
            self.daemon = subprocess.Popen([self.cli, "--config", str(self.config), "run",
                                            "--log-format", "plain"], stdout=log,
                                           stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + deadline_s
        while not (self.state / "control.sock").exists():
            if self.daemon.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the daemon did not start (see {self.root}/daemon.log)")
            time.sleep(0.1)  # a start-up wait, bounded above

    def stop_daemon(self) -> None:
        if self.daemon is not None and self.daemon.poll() is None:
            self.daemon.terminate()
            try:
                self.daemon.wait(timeout=120)
            except subprocess.TimeoutExpired:
                self.daemon.kill()
                self.daemon.wait(timeout=30)

    def apply_one(self, name: str, mapper: str, encrypted: bool,
                  how: list[str] | None = None, stderr: Path | None = None) -> float:
        """``how``: what runs the CLI (default: the console script itself);
        ``stderr``: where the timed apply's stderr goes."""
        enc = (f"  encryption: {{type: luks2, key: {{wrappedBy: {self.keys / 'node.key'}}}}}\n"
               if encrypted else "")
        (self.desired / f"{name}.yaml").write_text(
            f"apiVersion: rbd-reconciler/v1\nkind: Volume\nmetadata:\n  name: {name}\n"
            f"spec:\n  image: {{pool: {self.pool}, size: 64Mi, reclaimPolicy: Delete}}\n"
            f"  map: {{mapper: {mapper}}}\n{enc}"
            f"  stage: {{fsType: ext4, path: {self.srv / 'stage' / name}}}\n"
            f"  publish:\n    - path: {self.srv / 'app' / name}\n")
        t0 = time.perf_counter()
        sh([*(how or [self.cli]), "--config", str(self.config), "apply"], stderr)
        took = time.perf_counter() - t0
        # Down and gone (not timed): the file says absent, then it is removed.
        f = self.desired / f"{name}.yaml"
        f.write_text(f.read_text().replace("spec:\n", "spec:\n  state: absent\n"))
        sh([self.cli, "--config", str(self.config), "apply"])
        (self.desired / f"{name}.yaml").unlink()
        return took

    def raw_steps(self, name: str, mapper: str) -> list[tuple[str, float]]:
        """The raw sequence one command at a time, each timed (as RAW runs them)."""
        staging, target = self.srv / "raw-stage" / name, self.srv / "raw-app" / name
        spec = f"{self.pool}/{name}"
        kind = ["-o", "noudev"] if mapper == "krbd" else ["-t", "nbd"]
        out: list[tuple[str, float]] = []

        def timed(label: str, argv: list[str]) -> str:
            t0 = time.perf_counter()
            got = sh(argv)
            out.append((label, time.perf_counter() - t0))
            return got

        timed("rbd create", ["rbd", "create", "-c", self.conf, "--size", "64M", spec])
        dev = timed(f"rbd device map ({mapper})",
                    ["rbd", "device", "map", "-c", self.conf, *kind, spec]).strip()
        timed("mkfs.ext4", ["mkfs.ext4", *MKFS.split(), dev])
        timed("mkdir -p", ["mkdir", "-p", str(staging), str(target)])
        timed("mount", ["mount", dev, str(staging)])
        timed("mount --bind", ["mount", "--bind", str(staging), str(target)])
        sh(["umount", str(target)])
        sh(["umount", str(staging)])
        sh(["rbd", "device", "unmap", "-c", self.conf, *(["-o", "noudev"] if mapper == "krbd"
                                                         else ["-t", "nbd"]), dev])
        sh(["rbd", "rm", "-c", self.conf, spec])
        return out

    def raw_one(self, name: str, mapper: str) -> float:
        staging, target = self.srv / "raw-stage" / name, self.srv / "raw-app" / name
        t0 = time.perf_counter()
        dev = sh(["bash", "-c", RAW, "raw", self.conf, self.pool, name, mapper, str(staging),
                  str(target)]).strip().splitlines()[-1]
        took = time.perf_counter() - t0
        sh(["umount", str(target)])
        sh(["umount", str(staging)])
        if mapper == "krbd":
            sh(["rbd", "device", "unmap", "-c", self.conf, "-o", "noudev", dev])
        else:
            sh(["rbd", "device", "unmap", "-t", "nbd", "-c", self.conf, dev])
        sh(["rbd", "rm", "-c", self.conf, f"{self.pool}/{name}"])
        return took


def start_costs(trials: int = 3) -> list[str]:
    """What starting things costs here, each the median of ``trials``."""
    mods = "reconciler.cli.reconcile, reconciler.engine, reconciler.observe.node"
    what = [("a small C binary (true)", ["true"]),
            ("mount --version", ["mount", "--version"]),
            ("python3 -S -c pass (no site)", ["/usr/bin/python3", "-S", "-c", "pass"]),
            (".venv/bin/python -c pass (site and every .pth)", [PY, "-c", "pass"]),
            ("rbd-reconciler --version", [CLI, "--version"]),
            ("python: import rados, rbd", [PY, "-c", "import rados, rbd"]),
            ("python: import the apply path", [PY, "-c", f"import {mods}"]),
            ("rbd --version (the C++ CLI, no cluster)", ["rbd", "--version"]),
            ("rbd device list (krbd)", ["rbd", "device", "list", "--format", "json"])]
    out = []
    for label, argv in what:
        took = []
        for _ in range(trials):
            t0 = time.perf_counter()
            sh(argv)
            took.append(time.perf_counter() - t0)
        out.append(f"  {statistics.median(took):7.3f} s  {label}")
    # Why a module costs so much here: a stat of a file of the root (the
    # host's, over 9p, uncached) against one on the guest's own tmpfs.
    probe = ("import os, statistics, sys, time\n"
             "def each(p, n=200):\n"
             "    t = []\n"
             "    for _ in range(n):\n"
             "        t0 = time.perf_counter(); os.stat(p); t.append(time.perf_counter() - t0)\n"
             "    return statistics.median(t)\n"
             "print(each(sys.argv[1]), each(sys.argv[2]))")
    nine, tmp = sh(["/usr/bin/python3", "-S", "-c", probe, str(REPO / "reconciler" / "engine.py"),
                    tempfile.gettempdir()]).split()
    out.append(f"  {float(nine) * 1e3:7.3f} ms one stat over 9p (the root: every module, "
               f"every PATH lookup); {float(tmp) * 1e3:.3f} ms on the guest's tmpfs")
    return out


def breakdown(node: Node, out: Path, before: Node | None = None) -> None:
    """Where the time of one apply goes, per mapper (see the module's doc);
    with ``before``, one apply of that checkout's code traced too (its own
    interpreter runs the same tracer)."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    import pstats

    from p14_trace import summarize

    out.mkdir(parents=True, exist_ok=True)
    text = ["== starting things here (median of 3)", *start_costs()]
    print("\n".join(text), flush=True)
    for label, mapper, encrypted in (("krbd", "krbd", False), ("nbd", "nbd", False),
                                     ("krbd-luks2", "krbd", True)):
        node.apply_one(f"p14-bd-warm-{label}", mapper, encrypted)  # caches, modules
        if not encrypted:
            steps = node.raw_steps(f"p14-bd-raw-{mapper}", mapper)
            text.append(f"== raw {mapper}, one command at a time: "
                        f"{sum(t for _, t in steps):.2f} s")
            text += [f"  {t:7.3f} s  {what}" for what, t in steps]
        plain = node.apply_one(f"p14-bd-plain-{label}", mapper, encrypted)
        text.append(f"== apply {label}, untraced: {plain:.2f} s wall")
        trace = out / f"trace-{label}.json"
        wall = node.apply_one(f"p14-bd-trace-{label}", mapper, encrypted,
                              [PY, TRACE, "--out", str(trace), "--"])
        text.append(summarize(json.loads(trace.read_text()), wall, f"apply {label}, traced"))
        if before is not None:
            old = out / f"trace-before-{label}.json"
            wall = before.apply_one(f"p14-bd-before-{label}", mapper, encrypted,
                                    [str(Path(before.cli).parent / "python"), TRACE, "--out",
                                     str(old), "--"])
            text.append(summarize(json.loads(old.read_text()), wall,
                                  f"apply {label} (before), traced"))
        if encrypted:
            continue
        prof = out / f"profile-{label}.pstats"
        wall = node.apply_one(f"p14-bd-prof-{label}", mapper, encrypted,
                              [PY, TRACE, "--profile", str(prof), "--"])
        buf = io.StringIO()
        stats = pstats.Stats(str(prof), stream=buf)
        stats.sort_stats("cumulative").print_stats(45)
        stats.sort_stats("tottime").print_stats(30)
        text.append(f"== apply {label} under cProfile: {wall:.2f} s wall\n{buf.getvalue()}")
        imp = out / f"importtime-{label}.txt"
        wall = node.apply_one(f"p14-bd-imp-{label}", mapper, encrypted,
                              [PY, "-X", "importtime", CLI], stderr=imp)
        text.append(f"== apply {label} with -X importtime: {wall:.2f} s wall; top imports:\n"
                    + top_imports(imp.read_text()))
        (out / "breakdown.txt").write_text("\n".join(text) + "\n")
    (out / "breakdown.txt").write_text("\n".join(text) + "\n")
    print("\n".join(t for t in text if not t.startswith("== apply") or "traced" in t),
          flush=True)


def top_imports(stderr: str, n: int = 25) -> str:
    """-X importtime lines ("import time: self | cumulative | name"), by cumulative."""
    rows = []
    for line in stderr.splitlines():
        parts = line.removeprefix("import time:").split("|")
        if len(parts) == 3 and parts[1].strip().isdigit():
            rows.append((int(parts[1]), int(parts[0]), parts[2].rstrip()))
    total = sum(self_us for _, self_us, _ in rows)
    rows.sort(reverse=True)
    return (f"  all imports (sum of self): {total / 1e6:.3f} s\n"
            + "\n".join(f"  {cum / 1e6:7.3f} s cum {own / 1e6:7.3f} s self {name}"
                        for cum, own, name in rows[:n]))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--breakdown", type=Path, metavar="NAME",
                    help="first, where one apply's time goes (see above)")
    ap.add_argument("--daemon", action="store_true",
                    help="one more arm: the same apply with the daemon running (`run`), "
                         "which the command line hands the apply to")
    ap.add_argument("--before", type=Path, metavar="CHECKOUT",
                    help="another checkout with its own .venv (the code before a change): "
                         "its apply runs as one more arm of each trial, interleaved")
    args = ap.parse_args()
    if os.environ.get("RUN_IN_VM") != "1":
        print("p14: runs inside the VM: scripts/kernel-tests.sh --bench", file=sys.stderr)
        return 2
    root = Path(tempfile.mkdtemp(prefix="p14-"))
    keys = root / "keys"
    keys.mkdir(mode=0o700)
    (keys / "node.key").write_bytes(os.urandom(64))
    (keys / "node.key").chmod(0o600)
    node = Node(root / "node", keys)
    before = (Node(root / "node-before", keys, str(args.before / ".venv/bin/rbd-reconciler"))
              if args.before else None)
    served = Node(root / "node-daemon", keys) if args.daemon else None
    times: dict[str, list[float]] = {}
    try:
        if served is not None:
            served.start_daemon()
        if args.breakdown is not None:
            breakdown(node, Path(os.environ.get("KERNEL_TESTS_OUT", REPO / ".p14-breakdown"))
                      / args.breakdown, before)
        if args.trials < 1:
            return 0
        for _ in range(args.trials):  # what an emulated interpreter start costs here
            t0 = time.perf_counter()
            sh([CLI, "--version"])
            times.setdefault("cli start", []).append(time.perf_counter() - t0)
        for i in range(args.trials):
            groups = [[("apply", node, m, False), ("raw", node, m, False)]
                      + ([("before", before, m, False)] if before else [])
                      + ([("daemon", served, m, False)] if served else [])
                      for m in ("krbd", "nbd")]
            groups.append([("apply", node, "krbd", True)]
                          + ([("before", before, "krbd", True)] if before else []))
            for arms in groups:
                for arm, n, mapper, enc in arms[i % len(arms):] + arms[:i % len(arms)]:
                    name = f"p14-{arm}-{mapper}{'-luks' if enc else ''}-{i}"
                    took = n.raw_one(name, mapper) if arm == "raw" else \
                        n.apply_one(name, mapper, enc)
                    times.setdefault(f"{arm} {mapper}{' LUKS2' if enc else ''}", []).append(took)
            print(f"  trial {i + 1}: " + ", ".join(f"{k} {v[-1]:.1f} s"
                                                   for k, v in times.items()), flush=True)
    finally:
        if served is not None:
            served.stop_daemon()
        shutil.rmtree(root, ignore_errors=True)
    print(report(times, args.trials))
    return 0


def paired(times: dict[str, list[float]], a: str, b: str) -> float:
    """The median of the per-trial ratios a/b (the trials are paired)."""
    return statistics.median(x / y for x, y in zip(times[a], times[b], strict=True))


def report(times: dict[str, list[float]], trials: int) -> str:
    med = {k: statistics.median(v) for k, v in times.items()}
    lines = [f"\nP14 (in the VM, TCG; median of {trials}, paired ratio = median of the "
             "per-trial ratios):"]
    words = {"apply": "apply (a cold command)", "before": "apply before the change",
             "daemon": "apply with the daemon running"}
    for mapper in ("krbd", "nbd"):
        for arm in ("apply", "before", "daemon"):
            k = f"{arm} {mapper}"
            if k in med:
                lines.append(f"  {words[arm]}, one {mapper} volume, vs the raw commands: "
                             f"{med[k]:.1f} s "
                             f"vs {med[f'raw {mapper}']:.1f} s, paired ratio "
                             f"{paired(times, k, f'raw {mapper}'):.2f}")
        if f"before {mapper}" in med:
            lines.append(f"  {mapper}: apply now vs before, paired ratio "
                         f"{paired(times, f'apply {mapper}', f'before {mapper}'):.2f}")
    lines.append(f"  (a cold `rbd-reconciler --version` alone takes {med['cli start']:.1f} s "
                 "here: the interpreter is emulated too)")
    for arm in ("apply", "before"):
        if f"{arm} krbd LUKS2" in med:
            lines.append(f"  {arm}: encrypted (LUKS2) vs plain, krbd apply: "
                         f"{med[f'{arm} krbd LUKS2']:.1f} s vs {med[f'{arm} krbd']:.1f} s, "
                         f"paired ratio {paired(times, f'{arm} krbd LUKS2', f'{arm} krbd'):.2f}")
    lines.append("  every trial (s): " + "; ".join(
        f"{k}: {', '.join(f'{x:.1f}' for x in v)}" for k, v in times.items()))
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
