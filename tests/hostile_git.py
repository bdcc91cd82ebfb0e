"""A hostile git server: an ssh forced command (``command=`` in the git
user's authorized_keys, tests/gitserver.py's sshd) that answers each git
call with one behaviour: the real ``git upload-pack`` (good syncs happen
too), or cut, garbage, a flood, a huge pkt-line length, a commit nobody
pushed, another repository's ref, a stall, a slow trickle, an exit code.

    command="/usr/bin/python3 -I -S hostile_git.py CONTROL_DIR",restrict ssh-ed25519 ...

It runs as the git user, with the standard library only (-I -S: nothing of
the test's environment). ``CONTROL_DIR/control.json`` (the test writes it,
replaced whole): ``mode`` ("fuzz" or "pass"), ``seed``, ``repo`` (the only
path served), ``lies`` (repositories whose main is offered instead),
``timeout`` (the client's timeoutSeconds: stalls outlast it), ``max_life``,
``fuzz_from`` (the first call answered in "fuzz" mode).
Call N's behaviour and parameters come from ``Random(f"{seed}:{N}")`` alone
(the first calls go through every behaviour once, in an order the seed
shuffles, so a short run covers them all) and are logged as one JSON line
in ``CONTROL_DIR/calls.log``: a seed replays the same answers to the same
calls.
"""

from __future__ import annotations

import fcntl
import json
import os
import random
import re
import select
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

GIT = "/usr/bin/git"
BEHAVIOURS = ("pass", "cut", "trickle", "stall", "garbage", "stderr-flood", "stdout-flood",
              "huge-length", "unknown-commit", "lie", "exit")
# How often each is picked after the first round: pass-through most, so that
# a sync (an ls-remote, then a fetch: two calls) gets through now and then.
WEIGHTS = {"pass": 30, "cut": 10, "trickle": 4, "stall": 4, "garbage": 7, "stderr-flood": 7,
           "stdout-flood": 4, "huge-length": 7, "unknown-commit": 7, "lie": 12, "exit": 8}
MB = 1 << 20


def pkt(data: bytes) -> bytes:
    return b"%04x" % (len(data) + 4) + data


def plan(rng: random.Random, n: int, conf: dict[str, Any]) -> dict[str, Any]:
    """What call ``n`` does, decided before anything is written."""
    if conf["mode"] == "pass":
        return {"do": "pass"}
    first = list(BEHAVIOURS)
    random.Random(f"{conf['seed']}:order").shuffle(first)
    k = n - conf["fuzz_from"]  # the calls before it were answered in "pass" mode
    do = first[k] if 0 <= k < len(first) else \
        rng.choices(list(WEIGHTS), list(WEIGHTS.values()))[0]
    t = float(conf["timeout"])
    p: dict[str, Any] = {"do": do}
    if do == "cut":  # mostly within the first messages, sometimes inside the pack
        p["at"] = rng.randrange(rng.choice((64, 1024, 65536)))
        p["code"] = rng.choice((0, 0, 1, 128, rng.randrange(256)))
    elif do == "trickle":  # the real answer, a few bytes at a time, slowly
        p["bytes"], p["delay"] = rng.randint(1, 64), rng.uniform(0.05, t / 4)
    elif do == "stall":  # part of the real answer (maybe none), then silence
        p["at"], p["sleep"] = rng.choice((0, rng.randrange(512))), rng.uniform(t, 2 * t)
    elif do == "garbage":
        p["bytes"] = rng.randint(1, rng.choice((64, 4096, MB)))
        p["code"] = rng.randrange(256)
    elif do == "stderr-flood":  # ssh carries it to git's stderr: the caller's pipe
        p["mb"] = rng.randint(150, 400)
        p["code"] = rng.choice((0, 1, 128))
    elif do == "stdout-flood":  # a v0 advertisement of main, over and over: ls-remote prints
        p["mb"] = rng.randint(20, 60)  # each one (the fetch, which does not, fills git only)
        p["flush"] = rng.random() < 0.7
    elif do == "huge-length":
        p["head"] = rng.choice((b"ffff", b"fff0", b"fffe", b"%04x" % rng.randint(65521, 65535),
                                b"zzzz")).decode()
        p["tail"] = rng.randrange(rng.choice((1, 100, 70000)))
        p["sleep"] = rng.choice((0.0, rng.uniform(0, t)))
    elif do == "unknown-commit":
        p["oid"] = rng.randbytes(20).hex()
        p["answer"] = rng.choice(("eof", "nak", "garbage"))
    elif do == "lie":
        p["repo"] = rng.choice(conf["lies"])
    elif do == "exit":
        p["code"], p["said"] = rng.randrange(256), rng.choice(("", "fatal: nope\n",
                                                               "ERR access denied\n"))
    return p


def next_call(control: Path, conf: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    """This call's number (calls logged so far) and plan, logged under a
    lock: concurrent calls get distinct numbers."""
    with (control / "calls.log").open("a+") as log:
        fcntl.flock(log, fcntl.LOCK_EX)
        log.seek(0)
        n = sum(1 for _ in log)
        p = plan(random.Random(f"{conf['seed']}:{n}"), n, conf)
        log.write(json.dumps({"n": n, "pid": os.getpid(), "t": time.time(), **p}) + "\n")
        log.flush()
    return n, p


def write(data: bytes, fd: int = 1) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def upload_pack(repo: str) -> list[str]:
    # safe.directory from the command line: the repositories are root's.
    return [GIT, "-c", f"safe.directory={repo}", "upload-pack", "--", repo]


def proxy(repo: str, at: int | None = None, chunk: int = 65536, delay: float = 0.0) -> int:
    """The real upload-pack with the client's requests passed to it; its
    answer passed back ``chunk`` bytes at a time, ``delay`` apart, and cut
    after ``at`` bytes (then the real one is killed). Its exit code, or
    -1 once cut."""
    child = subprocess.Popen(upload_pack(repo), stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert child.stdin is not None and child.stdout is not None
    inp, out = child.stdin.fileno(), child.stdout.fileno()
    sent, reading = 0, [0, out]
    while out in reading:
        ready, _, _ = select.select(reading, [], [], 1.0)
        for fd in ready:
            data = os.read(fd, 65536 if fd == 0 else chunk)
            if fd == 0:
                if data:
                    write(data, inp)
                else:
                    child.stdin.close()
                    reading.remove(0)
                continue
            if not data:
                reading.remove(out)
                break
            if at is not None and sent + len(data) >= at:
                write(data[:at - sent])
                child.kill()
                child.wait()
                return -1
            write(data)
            sent += len(data)
            if delay:
                time.sleep(delay)  # the trickle itself: the server is slow on purpose
    return child.wait()


def serve(p: dict[str, Any], conf: dict[str, Any]) -> int:
    do, repo = p["do"], conf["repo"]
    if do == "pass":
        os.execv(GIT, upload_pack(repo))
    if do == "lie":
        os.execv(GIT, upload_pack(p["repo"]))
    if do == "cut":
        proxy(repo, at=p["at"])
        return p["code"]
    if do == "trickle":
        return proxy(repo, chunk=p["bytes"], delay=p["delay"])
    if do == "stall":
        if p["at"]:
            proxy(repo, at=p["at"])
        time.sleep(p["sleep"])
        return 0
    if do == "garbage":
        write(random.Random(p["bytes"]).randbytes(p["bytes"]))
        return p["code"]
    if do == "stderr-flood":
        line = b"hostile-git: a flood on stderr, line after line after line...\n"
        block = line * (MB // len(line))
        for _ in range(p["mb"]):
            write(block, 2)
        return p["code"]
    if do == "stdout-flood":
        oid = b"%040x" % random.Random(p["mb"]).getrandbits(160)
        write(pkt(oid + b" refs/heads/main\0agent=hostile-git\n"))
        block = pkt(oid + b" refs/heads/main\n") * (MB // 57)
        for _ in range(p["mb"]):
            write(block)
        if p["flush"]:
            write(b"0000")
        os.read(0, 65536)
        return 0
    if do == "huge-length":
        write(p["head"].encode() + b"x" * p["tail"])
        time.sleep(p["sleep"])
        return 0
    if do == "unknown-commit":
        caps = b" multi_ack_detailed side-band-64k ofs-delta shallow no-progress agent=hostile\n"
        write(pkt(p["oid"].encode() + b" HEAD\0" + caps)
              + pkt(p["oid"].encode() + b" refs/heads/main\n") + b"0000")
        os.read(0, 65536)  # the client's wants (or its flush: ls-remote)
        if p["answer"] == "nak":
            write(pkt(b"NAK\n"))
        elif p["answer"] == "garbage":
            write(pkt(b"\x01PACK") + b"\x00" * 64)
        return 0
    if do == "exit":
        write(p["said"].encode(), 2)
        return p["code"]
    raise AssertionError(do)


def main() -> int:
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # the client gone: end, as git would
    control = Path(sys.argv[1])
    conf = json.loads((control / "control.json").read_text())
    signal.alarm(int(conf["max_life"]))  # no behaviour outlives this (SIGALRM ends it)
    cmd = os.environ.get("SSH_ORIGINAL_COMMAND", "")
    found = re.fullmatch(r"git-upload-pack '([^']+)'", cmd)
    if not found or found[1] != conf["repo"]:
        write(f"hostile-git: not served: {cmd!r}\n".encode(), 2)
        return 1
    _, p = next_call(control, conf)
    return serve(p, conf)


if __name__ == "__main__":
    sys.exit(main())
