#!/usr/bin/env python3
"""P4: NodePublishVolume through the CSI adapter vs a direct bind mount.

One daemon serves CSI on a unix socket (benchmarks/csi_bench.py) on a
disposable local cluster; one 64Mi ext4 volume is created and staged once.
Then, interleaved, N times each (untimed teardown between runs):

- adapter: NodePublishVolume(target) over gRPC, timed from the call to its
  answer (the adapter writes the file, wakes the engine, which observes, plans
  and binds; the answer comes from the status); then NodeUnpublishVolume;
- direct: `mount --bind <staging> <target2>` as one command, timed from spawn
  to exit; then umount.

Printed: median and p99 of each, and the median overhead (goal <= 50 ms).
Usage: .venv/bin/python benchmarks/p4_csi_publish.py [--runs N]   (default 50)
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from csi_bench import CALL_TIMEOUT, csi_daemon, figures, mount_cap, percentile

from reconciler.csi import csi_pb2 as pb


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=50)
    args = ap.parse_args()
    with csi_daemon() as b:
        vol = b.create("p4-Publish")
        staging = b.root / "kubelet" / "staging" / "p4"
        staging.mkdir(parents=True)
        b.node.NodeStageVolume(pb.NodeStageVolumeRequest(
            volume_id=vol.volume_id, staging_target_path=str(staging),
            volume_capability=mount_cap()), timeout=CALL_TIMEOUT)
        target = b.root / "kubelet" / "pods" / "p4" / "mount"
        target.parent.mkdir(parents=True)
        direct = b.root / "kubelet" / "direct"
        direct.mkdir()
        adapter_t, direct_t = [], []
        for _ in range(args.runs):
            t0 = time.perf_counter()
            b.node.NodePublishVolume(pb.NodePublishVolumeRequest(
                volume_id=vol.volume_id, staging_target_path=str(staging),
                target_path=str(target), volume_capability=mount_cap()), timeout=CALL_TIMEOUT)
            adapter_t.append(time.perf_counter() - t0)
            b.node.NodeUnpublishVolume(pb.NodeUnpublishVolumeRequest(
                volume_id=vol.volume_id, target_path=str(target)), timeout=CALL_TIMEOUT)

            t0 = time.perf_counter()
            subprocess.run(["mount", "--bind", str(staging), str(direct)], check=True)
            direct_t.append(time.perf_counter() - t0)
            subprocess.run(["umount", str(direct)], check=True)
        b.node.NodeUnstageVolume(pb.NodeUnstageVolumeRequest(
            volume_id=vol.volume_id, staging_target_path=str(staging)), timeout=CALL_TIMEOUT)
    over = percentile(adapter_t, 50) - percentile(direct_t, 50)
    print(f"P4 NodePublishVolume via the adapter: {figures(adapter_t)}")
    print(f"P4 direct mount --bind:               {figures(direct_t)}")
    print(f"P4 median overhead {over * 1000:.1f} ms (goal <= 50 ms: "
          f"{'met' if over <= 0.050 else 'NOT met'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
