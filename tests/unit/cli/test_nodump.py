"""Core dumps hold keys: the commands that read node keys or unseal
passphrases (apply, release, rotate-key, and the daemon, run) make
themselves non-dumpable and set RLIMIT_CORE to 0 before anything is read;
the units set LimitCORE=0 (tests/cluster/test_shutdown.py checks them, and
tests/cluster/test_daemon.py a running daemon's limit)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

PROBE = """
import json, resource, sys
from reconciler.cli.main import main
from reconciler.drivers import nodump
before = nodump.dumpable()
rc = main(sys.argv[1:])
print(json.dumps({"before": before, "rc": rc, "dumpable": nodump.dumpable(),
                  "core": resource.getrlimit(resource.RLIMIT_CORE),
                  "limits": [l for l in open("/proc/self/limits") if "core" in l]}))
"""


def probe(*argv: str) -> dict:
    """``main(argv)`` in a fresh interpreter (the flags last for a process);
    the config is missing, so the command stops right after its start-up."""
    proc = subprocess.run([sys.executable, "-c", PROBE, "--config", "/nonexistent/c.yaml",
                           *argv], capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(os.geteuid() != 0, reason="the commands that hold keys need root")
@pytest.mark.parametrize("argv", [["apply"], ["release"], ["rotate-key", "vault"], ["run"],
                                  ["release", "--all"]])
def test_commands_that_hold_keys_dump_no_core(argv: list[str]) -> None:
    got = probe(*argv)
    assert got["before"] is True and got["rc"] == 1  # the missing config, after the guard
    assert got["dumpable"] is False, got
    assert got["core"] == [0, 0], got
    assert got["limits"][0].split()[-3:-1] == ["0", "0"], got["limits"]


@pytest.mark.skipif(os.geteuid() != 0, reason="the commands that hold keys need root")
def test_read_only_commands_are_left_as_they_are() -> None:
    assert probe("status")["dumpable"] is True  # it reads no key: left as it was


def test_forbid_core_dumps() -> None:
    code = ("from reconciler.drivers import nodump; import resource;"
            "nodump.forbid_core_dumps();"
            "print(nodump.dumpable(), resource.getrlimit(resource.RLIMIT_CORE))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, check=True).stdout.strip()
    assert out == "False (0, 0)"
