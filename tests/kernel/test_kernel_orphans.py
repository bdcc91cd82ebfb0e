"""Nothing unaccounted for (issue 41, item 5), in the VM of
scripts/kernel-tests.sh: the kinds tests/cluster/test_orphans.py cannot make
on a host without krbd, nbd and dm-crypt.

Ours, each left behind as a crash or a file removed while no daemon ran
leaves it (the volume files, and any record of them, gone): a krbd mapping
in no record whose image's claim names this node, with its staging mount
and publish bind; an nbd mapping and its rbd-nbd, recorded in our nbd.json
this boot, with its mounts; a LUKS2 volume over krbd (its dm-crypt device
over our leftover krbd mapping, its mounts); a tmpfs under the state dir,
held by a process with a file open on it. Not ours: a krbd mapping made by
hand (`rbd device map`) of an image we never claimed, an nbd mapping made
by hand (`rbd device map -t nbd`), a dm-crypt device made by hand over a
loop device of a plain file (named with our `rbdr-` prefix: a name proves
nothing), a tmpfs under the allowed root and one elsewhere (not listed).

`status -o json` lists each with its verdict; `release --orphans` removes
ours but the one in use, in order, says what it left and why (exit 1), and
everything not ours is still there afterwards; with its user gone, the last
one goes (exit 0). Everything made here is undone in a finally."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import time
from pathlib import Path

import pytest
from conftest import NodeUnderTest
from test_kernel_lifecycle import mapped_devices

from reconciler.drivers.kernelmapper import udev_running
from reconciler.drivers.mappers import ceph_args
from reconciler.facts.parsers import parse_mountinfo
from reconciler.spec.config import load_config

pytestmark = [pytest.mark.kernel, pytest.mark.ceph]


def _env() -> dict[str, str]:
    """Without udevd (this VM), libdevmapper makes /dev/mapper/NAME itself
    (as drivers/crypt.py has it) instead of waiting for udev."""
    return {**os.environ, **({} if udev_running() else {"DM_DISABLE_UDEV": "1"})}


def _run(*args: str) -> str:
    """Its stdout: through a file, not a pipe (rbd-nbd, daemonized by
    `rbd device map -t nbd`, could hold a pipe open)."""
    import tempfile

    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        r = subprocess.run(list(args), stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                           timeout=120, check=False, env=_env())
        out.seek(0)
        err.seek(0)
        assert r.returncode == 0, f"{args}: {r.returncode} {err.read().decode()}"
        return out.read().decode().strip()


def _mounted(point: Path | str) -> bool:
    text = Path("/proc/self/mountinfo").read_bytes()
    return any(m.mount_point == str(point) for m in parse_mountinfo(text))


def _device_of(image: str) -> str | None:
    return next((d["device"] for d in mapped_devices()
                 if d.get("name", d.get("image")) == image), None)


def _loop_backing(dev: str) -> str | None:
    with contextlib.suppress(OSError):
        return Path(f"/sys/block/{os.path.basename(dev)}/loop/backing_file").read_text().strip()
    return None


def _alive(pid: int) -> bool:
    """Running (a zombie is not: the test session may be its reaper)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return text[text.rindex(")") + 2] not in "ZX"


def _by_what(doc: dict) -> dict[str, dict]:
    return {o["what"]: o for o in doc["unaccounted"]["orphans"]}


def test_leftovers_of_every_kernel_kind_and_only_ours_released(node: NodeUnderTest) -> None:
    n = node
    pool = n.cluster.pool
    keys = n.root / "keys"
    keys.mkdir(mode=0o700)
    (keys / "node.key").write_bytes(os.urandom(64))
    (keys / "node.key").chmod(0o600)
    with n.config.open("a") as f:
        f.write(f"encryption:\n  keyRoot: {keys}\n  pbkdf: pbkdf2\n  iterations: 1000\n")
    cargs = ceph_args(load_config(n.config).ceph)
    noudev = [] if udev_running() else ["--options=noudev"]
    k, nb, lk = n.name("ok"), n.name("on"), n.name("ol")
    enc = f"  encryption: {{type: luks2, key: {{wrappedBy: {keys / 'node.key'}}}}}\n"
    files = {}
    for name, base, mapper, extra in ((k, "k", "krbd", ""), (nb, "n", "nbd", ""),
                                      (lk, "l", "krbd", enc)):
        files[name] = n.write(name, f"  image: {{pool: {pool}, size: 64Mi}}\n"
                                    f"  map: {{mapper: {mapper}}}\n{extra}"
                                    f"  stage: {{fsType: ext4, path: {n.srv / ('st-' + base)}}}\n"
                                    f"  publish:\n    - path: {n.srv / base}\n")
    crypt_ours = f"/dev/mapper/rbdr-{lk}"
    crypt_theirs = f"rbdr-byhand-{n.tag}"
    loop: str | None = None
    holder: subprocess.Popen[bytes] | None = None
    try:
        doc = n.apply()
        assert doc["rc"] == 0, json.dumps(doc, indent=1)
        dev_k, dev_n, dev_l = _device_of(k), _device_of(nb), _device_of(lk)
        assert dev_k and dev_k.startswith("/dev/rbd"), mapped_devices()
        assert dev_n and dev_n.startswith("/dev/nbd"), mapped_devices()
        assert dev_l and dev_l.startswith("/dev/rbd") and Path(crypt_ours).exists()
        nbd_pid = next(int(d["id"]) for d in mapped_devices() if d.get("device") == dev_n)

        # Gone while no daemon runs: the volume files and any record of them
        # (nbd.json, our record of this boot's nbd mappings, stays).
        for path in files.values():
            path.unlink()
        managed = n.state / "managed.json"
        if managed.exists():
            recs = json.loads(managed.read_text() or "{}")
            for name in files:
                recs.pop(name, None)
            managed.write_text(json.dumps(recs))

        # Ours too: a tmpfs under the state dir, a file on it held open.
        scratch = n.state / "scratch"
        scratch.mkdir()
        _run("mount", "-t", "tmpfs", "tmpfs", str(scratch))
        held = scratch / "held"
        holder = subprocess.Popen(["sh", "-c", 'exec 3>"$0"; exec sleep 600', str(held)])
        deadline = time.monotonic() + 30
        while not any(os.readlink(fd) == str(held) for fd in Path(
                f"/proc/{holder.pid}/fd").iterdir() if fd.is_symlink()):
            assert time.monotonic() < deadline, "the holder never opened its file"
            time.sleep(0.05)

        # Not ours: images we never claimed, mapped by hand (krbd, nbd).
        import rbd

        hk, hn = n.name("hand-k"), n.name("hand-n")
        with n.cluster.client() as c, c.open_ioctx(pool) as io:
            for img in (hk, hn):
                n.images.add(img)
                rbd.RBD().create(io, img, 16 << 20, features=rbd.RBD_FEATURE_LAYERING)
        # (krbd without udevd, as in this VM: noudev, or rbd waits forever.)
        hand_k = _run("rbd", "device", "map", *noudev, f"--pool={pool}", f"--image={hk}",
                      *cargs)
        hand_n = _run("rbd", "device", "map", "-t", "nbd", f"--pool={pool}", f"--image={hn}",
                      *cargs)
        assert hand_k.startswith("/dev/rbd") and hand_n.startswith("/dev/nbd")
        # A LUKS2 device made by hand over a loop device of a plain file.
        plain = n.root / "plain.img"
        with open(plain, "wb") as f:
            f.truncate(32 << 20)
        _run("modprobe", "loop")  # the VM loads rbd, nbd and dm-crypt only
        loop = _run("losetup", "--find", "--show", "--", str(plain))
        hand_key = n.root / "hand.key"
        hand_key.write_bytes(os.urandom(64))
        _run("cryptsetup", "luksFormat", "--batch-mode", "--type", "luks2", "--pbkdf",
             "pbkdf2", "--pbkdf-force-iterations", "1000", f"--key-file={hand_key}", loop)
        _run("cryptsetup", "open", "--type", "luks2", f"--key-file={hand_key}", loop,
             crypt_theirs)
        # Mounts of someone else: under the allowed root (listed, not ours)
        # and outside every root of ours (not listed at all).
        theirs, elsewhere = n.srv / "theirs", n.root / "elsewhere"
        for point in (theirs, elsewhere):
            point.mkdir()
            _run("mount", "-t", "tmpfs", "tmpfs", str(point))

        rc, doc = n.cli_json("status")
        print(json.dumps(doc["unaccounted"], indent=1))
        assert doc["unaccounted"]["unknown"] == []
        found = _by_what(doc)
        want = {
            str(n.srv / "k"): ("mount", True), str(n.srv / "st-k"): ("mount", True),
            dev_k: ("krbd", True),
            str(n.srv / "n"): ("mount", True), str(n.srv / "st-n"): ("mount", True),
            dev_n: ("nbd", True),
            str(n.srv / "l"): ("mount", True), str(n.srv / "st-l"): ("mount", True),
            crypt_ours: ("dm-crypt", True), dev_l: ("krbd", True),
            str(scratch): ("mount", True),
            hand_k: ("krbd", False), hand_n: ("nbd", False),
            f"/dev/mapper/{crypt_theirs}": ("dm-crypt", False),
            str(theirs): ("mount", False),
        }
        assert {w: (o["kind"], o["ours"]) for w, o in found.items()} == want
        assert "its image claim names this node" in found[dev_k]["why"]
        assert f"{pool}/{k}" == found[dev_k]["image"]
        assert "recorded by us this boot" in found[dev_n]["why"]
        assert f"one of our leftovers ({dev_l})" in found[crypt_ours]["why"]
        assert "dm name has our prefix" in found[crypt_ours]["why"]
        assert f"one of our leftovers ({crypt_ours})" in found[str(n.srv / "l")]["why"]
        assert "mount under our state dir" in found[str(scratch)]["why"]
        assert "not in any record" in found[hand_k]["why"]
        assert "not in any record of ours" in found[hand_n]["why"]
        assert "not provably one of our devices" in found[f"/dev/mapper/{crypt_theirs}"]["why"]
        assert "under allowed root" in found[str(theirs)]["why"]
        assert str(elsewhere) not in found and loop not in found

        rc, swept = n.cli_json("release", "--orphans")
        print(json.dumps(swept, indent=1))
        assert rc == 1, swept  # one of ours left: the mount in use
        assert swept["refused"] is None
        removed = [(o["kind"], o["what"]) for o in swept["removed"]]
        assert {w for _, w in removed} == {w for w, (_, ours) in want.items()
                                           if ours and w != str(scratch)}
        kinds = [kind for kind, _ in removed]
        # Mounts first, then the dm-crypt device, then the mappings.
        assert kinds == sorted(kinds, key={"mount": 0, "dm-crypt": 1, "krbd": 2,
                                           "nbd": 2}.__getitem__), removed
        [left] = swept["left"]
        assert str(scratch) in left and f"in use by pid {holder.pid}" in left, left
        assert {o["what"] for o in swept["notOurs"]} == {
            hand_k, hand_n, f"/dev/mapper/{crypt_theirs}", str(theirs)}

        # Ours are gone: mounts, the dm-crypt device, the mappings (and with
        # the nbd mapping its rbd-nbd).
        for base in ("k", "st-k", "n", "st-n", "l", "st-l"):
            assert not _mounted(n.srv / base), base
        assert not Path(crypt_ours).exists()
        assert not any(_device_of(img) for img in (k, nb, lk)), mapped_devices()
        deadline = time.monotonic() + 30
        while _alive(nbd_pid):
            assert time.monotonic() < deadline, f"rbd-nbd {nbd_pid} still running"
            time.sleep(0.1)
        # What is not ours, and the one in use, are all still there.
        assert _device_of(hk) == hand_k and _device_of(hn) == hand_n, mapped_devices()
        assert Path(f"/dev/mapper/{crypt_theirs}").exists()
        assert _loop_backing(loop) == str(plain)
        assert _mounted(theirs) and _mounted(elsewhere) and _mounted(scratch)
        assert held.exists()

        # Its user gone, the last of ours goes too.
        holder.kill()
        holder.wait(timeout=30)
        rc, out = n.cli("release", "--orphans")
        assert rc == 0, out
        assert out.splitlines() == [f"removed: mount {scratch}: mount under our state dir",
                                    "removed: 1; left: 0 of ours, 4 not known to be ours"]
        rc, doc = n.cli_json("status")
        assert {(o["what"], o["ours"]) for o in doc["unaccounted"]["orphans"]} == {
            (hand_k, False), (hand_n, False), (f"/dev/mapper/{crypt_theirs}", False),
            (str(theirs), False)}
    finally:
        if holder is not None and holder.poll() is None:
            holder.kill()
            holder.wait(timeout=30)
        # Whatever of ours a failure left, then what was made by hand.
        for point in sorted((m for m in n.mounts()), reverse=True):
            if subprocess.run(["umount", point], check=False, timeout=60).returncode:
                subprocess.run(["umount", "-l", point], check=False, timeout=60)
        for name in (f"rbdr-{lk}", crypt_theirs):
            if Path(f"/dev/mapper/{name}").exists():
                subprocess.run(["cryptsetup", "close", name], check=False, timeout=60,
                               env=_env())
        if loop is not None and _loop_backing(loop) == str(n.root / "plain.img"):
            subprocess.run(["losetup", f"--detach={loop}"], check=False, timeout=60)
        for d in mapped_devices():
            if d.get("name", d.get("image")) in n.images:
                kind = ["-t", "nbd"] if d["device"].startswith("/dev/nbd") else noudev
                subprocess.run(["rbd", "device", "unmap", *kind, d["device"], *cargs],
                               check=False, timeout=120)
