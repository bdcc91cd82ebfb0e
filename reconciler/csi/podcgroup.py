"""The cgroup v2 directory of the pod a kubelet publish path belongs to.

krbd's I/O never passes through librbd's QoS: the node limits it with
io.max on the cgroup of whoever uses the device, here the pod. Kubelet names
the pod in the target path; its cgroup is ``...pod<uid>`` (cgroupfs driver)
or ``...pod<uid with _ for ->.slice`` (systemd driver) under kubepods.

Imported by csi/node.py.
"""

from __future__ import annotations

import os
import re

# .../pods/<uid>/volumes/kubernetes.io~csi/<pv>/mount (filesystem) and
# .../volumeDevices/publish/<pv>/<uid> (block).
_POD_UID = re.compile(r"/pods/([0-9a-f-]{36})/volumes/"
                      r"|/volumeDevices/publish/[^/]+/([0-9a-f-]{36})$")
_ROOTS = ("/sys/fs/cgroup", "/sys/fs/cgroup/unified")  # pure v2, or v2 beside v1 (hybrid)
# kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod….slice (systemd),
# kubepods/burstable/pod… (cgroupfs): a pod is at most 3 levels down.
MAX_DEPTH = 3


def pod_uid(target_path: str) -> str | None:
    m = _POD_UID.search(target_path)
    return (m.group(1) or m.group(2)) if m else None


def _v2_root(roots: tuple[str, ...]) -> str | None:
    for root in roots:
        if os.path.exists(os.path.join(root, "cgroup.controllers")):
            return root
    return None


def find(target_path: str, roots: tuple[str, ...] = _ROOTS) -> str | None:
    """The pod's cgroup directory, or None (not a kubelet path, no cgroup v2,
    or the pod's cgroup not found under kubepods)."""
    uid = pod_uid(target_path)
    root = _v2_root(roots)
    if uid is None or root is None:
        return None
    names = (f"pod{uid}", f"pod{uid.replace('-', '_')}")
    level = [os.path.join(root, d) for d in _subdirs(root) if d.startswith("kubepods")]
    for _ in range(MAX_DEPTH):
        nxt = []
        for path in level:
            base = os.path.basename(path).removesuffix(".slice")
            if any(base == n or base.endswith("-" + n) for n in names):
                return path
            nxt += [os.path.join(path, d) for d in _subdirs(path)]
        level = nxt
    return None


def _subdirs(path: str) -> list[str]:
    try:
        return sorted(e.name for e in os.scandir(path) if e.is_dir(follow_symlinks=False))
    except OSError:
        return []
