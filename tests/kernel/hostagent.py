"""The host's half of the partition tests: what must reach Ceph while the VM
is cut off from it (another node's ``takeover``, a blocklist entry).

scripts/kernel-tests.sh runs it in the test namespace beside the VM, with
the cluster's environment: ``hostagent.py AGENT_DIR ROOT``. The guest asks by
writing ``req-N.json`` into AGENT_DIR (shared with the host over 9p, which a
cut network does not touch) and reads ``resp-N.json``. Only these requests:

- ``{"op": "blocklist", "addr": "IP:PORT/NONCE"}`` (one client, 1 hour)
- ``{"op": "unblocklist", "addr": "IP:PORT/NONCE"}``
- ``{"op": "takeover", "config": PATH, "name": NAME}``: ``rbd-reconciler
  takeover NAME --yes-i-am-sure`` as another node, with a config the guest
  wrote under ROOT.

It exits when AGENT_DIR/stop appears or its parent is gone.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ADDR = re.compile(r"[0-9a-fA-F.:\[\]]{3,64}/[0-9]{1,20}")


def _blocklist(op: str, addr: str) -> tuple[int, str]:
    if not ADDR.fullmatch(addr):
        return 2, f"not one client's address: {addr!r}"
    argv = ["ceph", "osd", "blocklist", op, addr, *(["3600"] if op == "add" else [])]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
    return done.returncode, done.stdout + done.stderr


def handle(req: dict[str, object], root: Path) -> tuple[int, str]:
    op = req.get("op")
    if op in ("blocklist", "unblocklist"):
        return _blocklist("add" if op == "blocklist" else "rm", str(req.get("addr")))
    if op == "takeover":
        config = Path(str(req.get("config"))).resolve()
        name = str(req.get("name"))
        if not config.is_relative_to(root) or not re.fullmatch(r"[a-z0-9-]{1,63}", name):
            return 2, "refused: the config must lie under the agent's root, the name a label"
        done = subprocess.run([sys.executable, "-m", "reconciler", "--config", str(config),
                               "takeover", name, "--yes-i-am-sure"], cwd=REPO,
                              capture_output=True, text=True, timeout=120, check=False)
        return done.returncode, done.stdout + done.stderr
    return 2, f"unknown op {op!r}"


def main(agent: Path, root: Path) -> int:
    parent = os.getppid()
    while not (agent / "stop").exists() and os.getppid() == parent:
        for req_path in sorted(agent.glob("req-*.json")):
            resp = agent / req_path.name.replace("req-", "resp-")
            try:
                rc, out = handle(json.loads(req_path.read_text()), root)
            except (OSError, ValueError, subprocess.SubprocessError) as exc:
                rc, out = 2, f"{type(exc).__name__}: {exc}"
            tmp = resp.with_suffix(".tmp")
            tmp.write_text(json.dumps({"rc": rc, "out": out}))
            tmp.rename(resp)
            req_path.unlink()
            print(f"hostagent: {req_path.name}: rc {rc}", file=sys.stderr, flush=True)
        time.sleep(0.2)
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]).resolve(), Path(sys.argv[2]).resolve()))
