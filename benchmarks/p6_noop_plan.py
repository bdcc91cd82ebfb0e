#!/usr/bin/env python3
"""P6: a real no-op `plan` over 10, 50 and 200 published volumes, and Ansible's
`mount` module in check mode over the same mounts.

On a disposable local cluster (reconciler.testing.devcluster), N volumes (ext4, 16 MiB,
fuse mapper, one publish target) are applied, then, interleaved --repeat times:

- warm: ``engine.plan_pass`` in this process with one ``Node`` kept across
  passes (as the daemon keeps it): load, observe (Ceph, mappings, devices,
  mounts), plan. Each pass must find nothing to do;
- cold: the `rbd-reconciler plan` CLI as a subprocess (interpreter start and
  imports counted);
- the forks of one warm pass (Runner.history) are printed: no blkid/dumpe2fs.

Then, for --ansible-sizes, ONE `ansible-playbook --check` run of
`ansible.posix.mount` (state: mounted) over the same 2N mounts (staging
filesystem mounts and publish binds; no Ceph at all), with /etc/fstab's hash
checked unchanged. Ansible is installed by this script into its own venv
(--ansible-venv, default /tmp/rbd-bench-ansible-venv) with pip's `ansible`
package (it bundles ansible.posix).

Cleanup (also on Ctrl-C): `rbd-reconciler release`, a sweep of anything left
mounted under the work dir, then the memstore cluster is stopped (its images
live in its RAM and go with it).

Usage: .venv/bin/python benchmarks/p6_noop_plan.py [--sizes 10,50,200] [--repeat 5]
       [--ansible-sizes 10,50] [--no-ansible]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from harness import (  # noqa: E402
    BenchError,
    find_cli,
    run,
    signals_ignored,
    signals_raise,
    sweep,
)

from reconciler.drivers.reaper import become_subreaper  # noqa: E402
from reconciler.testing.devcluster import DevCluster, start_cluster  # noqa: E402

GOAL_MS_PER_VOLUME = 2.0
GOAL_VS_ANSIBLE = 50.0

VOLUME = """\
apiVersion: rbd-reconciler/v1
kind: Volume
metadata:
  name: {name}
spec:
  image:
    pool: {pool}
    size: 16Mi
  map:
    mapper: fuse
  stage:
    fsType: ext4
  publish:
    - path: {target}
"""

CONFIG = """\
desiredDir: {desired}
stateDir: {state}
controlSocket: {state}/control.sock
nodeName: p6-bench
ceph:
  conf: {conf}
  user: {user}
  keyring: {keyring}
allowedRoots: [{pub}]
parallel: 4
"""

PLAYBOOK = """\
- hosts: localhost
  connection: local
  gather_facts: false
  tasks:
    - name: mounts
      ansible.posix.mount:
        path: "{{{{ item.path }}}}"
        src: "{{{{ item.src }}}}"
        fstype: "{{{{ item.fstype }}}}"
        opts: "{{{{ item.opts }}}}"
        state: mounted
      loop: {items}
"""


def ensure_ansible(venv: Path) -> Path:
    playbook = venv / "bin" / "ansible-playbook"
    if not playbook.exists():
        print(f"installing ansible into {venv} ...", flush=True)
        subprocess.run(["/usr/bin/python3", "-m", "venv", str(venv)], check=True)
        subprocess.run([str(venv / "bin" / "pip"), "install", "-q",
                        "--disable-pip-version-check", "ansible"], check=True)
    return playbook


def fstab_hash() -> str:
    try:
        return hashlib.sha256(Path("/etc/fstab").read_bytes()).hexdigest()
    except FileNotFoundError:
        return "absent"


def ansible_check(playbook_bin: Path, root: Path, n: int) -> float:
    state = root / "state" / "staging"
    mounts = {}
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        f = line.split(" ")
        sep = f.index("-", 6)
        mounts[f[4]] = f[sep + 2]
    items = []
    for i in range(n):
        name = f"v{i:04d}"
        staging = str(state / name)
        items.append({"path": staging, "src": mounts[staging], "fstype": "ext4",
                      "opts": "defaults"})
        items.append({"path": str(root / "pub" / name), "src": staging, "fstype": "none",
                      "opts": "bind"})
    book = root / f"mounts-{n}.yml"
    book.write_text(PLAYBOOK.format(items=json.dumps(items)))
    before = fstab_hash()
    env = {**os.environ, "ANSIBLE_NOCOLOR": "1", "ANSIBLE_LOCALHOST_WARNING": "False",
           "ANSIBLE_INVENTORY_UNPARSED_WARNING": "False"}
    t0 = time.perf_counter()
    python = playbook_bin.parent / "python"  # the modules run in Ansible's own venv
    r = subprocess.run([str(playbook_bin), "--check", "-i", "localhost,",
                        "-e", f"ansible_python_interpreter={python}", str(book)],
                       capture_output=True, text=True, env=env, timeout=3600)
    elapsed = time.perf_counter() - t0
    if r.returncode != 0:
        raise BenchError(f"ansible-playbook failed:\n{r.stdout[-3000:]}{r.stderr[-2000:]}")
    if fstab_hash() != before:
        raise BenchError("/etc/fstab changed under ansible --check")
    return elapsed


def _cpu_rss(pid: int) -> tuple[float, int, int]:
    """(user+system CPU seconds, VmRSS, VmHWM in KiB) of one process."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    cpu = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    status = dict(line.split(":", 1) for line in
                  Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    return cpu, int(status["VmRSS"].split()[0]), int(status["VmHWM"].split()[0])


def daemon_idle(cli: Path, cfg: Path, root: Path, seconds: float) -> None:
    """`rbd-reconciler run` over the published volumes, nothing to do: CPU and RSS."""
    log = root / "daemon.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([str(cli), "--config", str(cfg), "run", "--log-format", "plain"],
                                stdin=subprocess.DEVNULL, stdout=out, stderr=out)
    try:
        deadline = time.monotonic() + 300
        while "pass 1:" not in log.read_text():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise BenchError(f"daemon did not finish a pass:\n{log.read_text()[-2000:]}")
            time.sleep(0.1)
        cpu0, _, _ = _cpu_rss(proc.pid)
        t0 = time.monotonic()
        time.sleep(seconds)
        cpu1, rss, hwm = _cpu_rss(proc.pid)
        wall = time.monotonic() - t0
        passes = [ln for ln in log.read_text().splitlines() if " pass " in ln and "observe" in ln]
        print(f"daemon idle {wall:.0f} s: CPU {cpu1 - cpu0:.2f} s "
              f"({(cpu1 - cpu0) / wall * 100:.2f}% of a core), RSS {rss / 1024:.0f} MiB "
              f"(peak {hwm / 1024:.0f} MiB), {len(passes)} passes; last: "
              f"{passes[-1].split(': ', 1)[-1] if passes else '-'}", flush=True)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def write_volumes(root: Path, cluster: DevCluster, upto: int) -> None:
    desired = root / "desired"
    for i in range(upto):
        f = desired / f"v{i:04d}.yaml"
        if not f.exists():
            f.write_text(VOLUME.format(name=f"v{i:04d}", pool=cluster.pool,
                                       target=root / "pub" / f"v{i:04d}"))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="10,50,200")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--ansible-sizes", default="10,50")
    ap.add_argument("--no-ansible", action="store_true")
    ap.add_argument("--ansible-venv", type=Path, default=Path("/tmp/rbd-bench-ansible-venv"))
    ap.add_argument("--idle", type=float, default=0.0, metavar="SECONDS",
                    help="then run the daemon idle this long over the largest N: CPU and RSS")
    ap.add_argument("--resync", type=float, default=60.0, help="the daemon's resyncSeconds")
    args = ap.parse_args(argv)
    if os.geteuid() != 0:
        print("needs root", file=sys.stderr)
        return 1
    sizes = [int(x) for x in args.sizes.split(",")]
    ansible_sizes = set() if args.no_ansible else {int(x) for x in args.ansible_sizes.split(",")}
    playbook_bin = ensure_ansible(args.ansible_venv) if ansible_sizes else None
    become_subreaper()
    root = Path(tempfile.mkdtemp(prefix="p6-"))
    cluster = None
    cli = find_cli()
    rows = []
    try:
        with signals_raise():
            cluster = start_cluster(root=root / "ceph")
            for d in ("desired", "state", "pub"):
                (root / d).mkdir(mode=0o755)
            os.chmod(root, 0o755)
            cfg_path = root / "config.yaml"
            cfg_path.write_text(CONFIG.format(
                desired=root / "desired", state=root / "state", conf=cluster.conf,
                user=cluster.user, keyring=cluster.keyring, pub=root / "pub"))
            from reconciler.engine import plan_pass
            from reconciler.observe.node import Node
            from reconciler.spec.config import load_config
            config = load_config(cfg_path)
            for n in sizes:
                write_volumes(root, cluster, n)
                t0 = time.perf_counter()
                r = run([str(cli), "--config", str(cfg_path), "apply"], timeout=3600,
                        check=False)
                if r.returncode != 0:
                    raise BenchError(f"apply failed:\n{r.stdout[-3000:]}{r.stderr[-3000:]}")
                print(f"N={n}: apply of the new volumes {time.perf_counter() - t0:.1f} s",
                      flush=True)
                node = Node.from_config(config)
                first = time.perf_counter()
                p = plan_pass([config.desired_dir], config, node)
                first = time.perf_counter() - first
                warm, cold = [], []
                for _ in range(args.repeat):
                    node.runner.history.clear()
                    t0 = time.perf_counter()
                    p = plan_pass([config.desired_dir], config, node)
                    warm.append(time.perf_counter() - t0)
                    if any(vp.steps or vp.refusal or vp.unknown for vp in p.plans) \
                            or len(p.plans) != n:
                        raise BenchError(f"not a no-op plan at N={n}")
                    forks = [a[0] for a in node.runner.history]
                    t0 = time.perf_counter()
                    r = run([str(cli), "--config", str(cfg_path), "plan"], check=False)
                    cold.append(time.perf_counter() - t0)
                    if r.returncode != 0:
                        raise BenchError(f"cold plan exited {r.returncode}:\n{r.stdout[-2000:]}")
                w, c = statistics.median(warm), statistics.median(cold)
                ans = ansible_check(playbook_bin, root, n) if n in ansible_sizes else None
                rows.append((n, first, w, c, ans, forks))
                print(f"N={n}: warm plan median {w * 1000:.1f} ms ({w / n * 1000:.2f} ms/volume), "
                      f"first in-process {first * 1000:.1f} ms, cold CLI {c * 1000:.0f} ms "
                      f"({c / n * 1000:.2f} ms/volume); forks in a warm pass: "
                      f"{sorted(set(forks)) or 'none'} x{len(forks)}"
                      + (f"; ansible --check {ans:.1f} s" if ans else ""), flush=True)
            if args.idle > 0:
                with open(cfg_path, "a") as f:
                    f.write(f"resyncSeconds: {args.resync}\n")
                daemon_idle(cli, cfg_path, root, args.idle)
    except KeyboardInterrupt:
        print("interrupted; cleaning up", file=sys.stderr)
    finally:
        with signals_ignored():
            run([str(cli), "--config", str(root / "config.yaml"), "release"], timeout=3600,
                check=False)
            problems = sweep(root)
            if cluster is not None:
                cluster.stop()
            if problems:
                print("cleanup problems: " + "; ".join(problems), file=sys.stderr)
    print("\n   N  warm ms  ms/vol  cold CLI ms  ms/vol  ansible s  warm×  cold×")
    base = rows[0][2] / rows[0][0] if rows else 1
    for n, _first, w, c, ans, _ in rows:
        print(f"{n:4d} {w * 1000:8.1f} {w / n * 1000:7.2f} {c * 1000:12.0f} {c / n * 1000:7.2f} "
              + (f"{ans:10.1f} {ans / w:6.0f} {ans / c:6.0f}" if ans else f"{'-':>10}")
              + f"   growth per volume vs N={rows[0][0]}: {(w / n) / base:.2f}")
    print(f"goals: <= {GOAL_MS_PER_VOLUME} ms/volume warm; >= {GOAL_VS_ANSIBLE:.0f}x ansible")
    return 0


if __name__ == "__main__":
    sys.exit(main())
