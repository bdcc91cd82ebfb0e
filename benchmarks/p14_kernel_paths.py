#!/usr/bin/env python3
"""P14: the kernel paths, in the VM of scripts/kernel-tests.sh (ratios only:
everything there is emulated, so absolute times mean little).

For krbd and rbd-nbd: one `rbd-reconciler apply` of a new volume (create,
map, mkfs.ext4, mount at staging, bind at the target) vs the same raw
commands in a shell; and an encrypted volume (LUKS2, wrappedBy, pbkdf2 with
fixed iterations) vs a plain one, both through apply on krbd. Trials are
paired and interleaved; each side's teardown is not timed.

Run it with: scripts/kernel-tests.sh --bench [--trials N]
(inside the VM it reads the cluster from RBD_RECONCILER_CEPH_CONF/...).
"""

from __future__ import annotations

import argparse
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


def sh(argv: list[str], **kw: object) -> str:
    return subprocess.run(argv, check=True, capture_output=True, text=True, timeout=TIMEOUT,
                          **kw).stdout  # type: ignore[call-overload]


class Node:
    def __init__(self, root: Path, encrypted_keys: Path) -> None:
        self.root = root
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

    def apply_one(self, name: str, mapper: str, encrypted: bool) -> float:
        enc = (f"  encryption: {{type: luks2, key: {{wrappedBy: {self.keys / 'node.key'}}}}}\n"
               if encrypted else "")
        (self.desired / f"{name}.yaml").write_text(
            f"apiVersion: rbd-reconciler/v1\nkind: Volume\nmetadata:\n  name: {name}\n"
            f"spec:\n  image: {{pool: {self.pool}, size: 64Mi, reclaimPolicy: Delete}}\n"
            f"  map: {{mapper: {mapper}}}\n{enc}"
            f"  stage: {{fsType: ext4, path: {self.srv / 'stage' / name}}}\n"
            f"  publish:\n    - path: {self.srv / 'app' / name}\n")
        t0 = time.perf_counter()
        sh([CLI, "--config", str(self.config), "apply"])
        took = time.perf_counter() - t0
        # Down and gone (not timed): the file says absent, then it is removed.
        f = self.desired / f"{name}.yaml"
        f.write_text(f.read_text().replace("spec:\n", "spec:\n  state: absent\n"))
        sh([CLI, "--config", str(self.config), "apply"])
        (self.desired / f"{name}.yaml").unlink()
        return took

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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--trials", type=int, default=3)
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
    times: dict[str, list[float]] = {}
    try:
        for _ in range(args.trials):  # what an emulated interpreter start costs here
            t0 = time.perf_counter()
            sh([CLI, "--version"])
            times.setdefault("cli start", []).append(time.perf_counter() - t0)
        for i in range(args.trials):
            for mapper in ("krbd", "nbd"):
                times.setdefault(f"apply {mapper}", []).append(
                    node.apply_one(f"p14-{mapper}-{i}", mapper, False))
                times.setdefault(f"raw {mapper}", []).append(
                    node.raw_one(f"p14-raw-{mapper}-{i}", mapper))
            times.setdefault("apply krbd LUKS2", []).append(
                node.apply_one(f"p14-luks-{i}", "krbd", True))
            print(f"  trial {i + 1}: " + ", ".join(f"{k} {v[-1]:.1f} s"
                                                   for k, v in times.items()), flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"\nP14 (in the VM, TCG; median of {args.trials}):")
    for mapper in ("krbd", "nbd"):
        ours, raw = med[f"apply {mapper}"], med[f"raw {mapper}"]
        print(f"  apply one {mapper} volume vs the raw commands: {ours:.1f} s vs {raw:.1f} s, "
              f"ratio {ours / raw:.2f}")
    print(f"  (a cold `rbd-reconciler --version` alone takes {med['cli start']:.1f} s here: "
          "the interpreter is emulated too)")
    print(f"  encrypted (LUKS2) vs plain, krbd apply: {med['apply krbd LUKS2']:.1f} s vs "
          f"{med['apply krbd']:.1f} s, ratio {med['apply krbd LUKS2'] / med['apply krbd']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
