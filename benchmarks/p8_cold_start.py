#!/usr/bin/env python3
"""P8: cold start. `rbd-reconciler --version` and `validate` of one file vs
the bare interpreter, interleaved --runs times; medians and ratios.

Contenders: /usr/bin/python3 -c pass (the bare interpreter), the venv's
python -c pass, `rbd-reconciler --version`, `rbd-reconciler validate FILE`
(a valid example: jsonschema is not imported) and the same with an invalid
file (jsonschema words the errors), each with --config pointing at a valid
node config. Also prints which heavy modules a `--version` and a `validate`
import (none of rados, rbd, jsonschema is the goal).

Usage: .venv/bin/python benchmarks/p8_cold_start.py [--runs 21]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
VENV = REPO / ".venv" / "bin"
GOAL_VERSION = 2.0


def timed(argv: list[str]) -> float:
    t0 = time.perf_counter()
    subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)
    return time.perf_counter() - t0


def heavy(args: list[str]) -> list[str]:
    code = ("import sys; from reconciler.cli.main import main\n"
            f"try:\n    main({args!r})\nexcept SystemExit:\n    pass\n"
            "print('MODULES:', *(m for m in ('rados', 'rbd', 'jsonschema', 'yaml', 'watchdog', "
            "'grpc') if m in sys.modules))")
    out = subprocess.run([str(VENV / "python"), "-c", code], capture_output=True, text=True)
    line = next(ln for ln in out.stdout.splitlines() if ln.startswith("MODULES:"))
    return line.split()[1:]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=21)
    args = ap.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="p8-"))
    cfg = tmp / "config.yaml"
    cfg.write_text(f"desiredDir: {tmp}\nstateDir: {tmp}/state\nallowedRoots: [/srv]\n")
    good = REPO / "examples" / "pgdata.yaml"
    bad = tmp / "bad.yaml"
    bad.write_text(good.read_text().replace("fsType: ext4", "fsType: ext5"))
    cli = str(VENV / "rbd-reconciler")
    cases = {
        "python3 -c pass (bare)": ["/usr/bin/python3", "-c", "pass"],
        "venv python -c pass": [str(VENV / "python"), "-c", "pass"],
        "--version": [cli, "--version"],
        "validate (valid file)": [cli, "--config", str(cfg), "validate", str(good)],
        "validate (invalid file)": [cli, "--config", str(cfg), "validate", str(bad)],
    }
    times: dict[str, list[float]] = {k: [] for k in cases}
    for _ in range(args.runs):
        for k, a in cases.items():
            times[k].append(timed(a))
    bare = statistics.median(times["python3 -c pass (bare)"])
    for k, ts in times.items():
        m = statistics.median(ts)
        print(f"{k:<26} median {m * 1000:6.1f} ms  ({m / bare:4.2f}x bare)")
    v = statistics.median(times["--version"]) / bare
    print(f"--version / bare: {v:.2f} (goal <= {GOAL_VERSION}: "
          f"{'met' if v <= GOAL_VERSION else 'NOT met'})")
    print(f"heavy modules imported by --version: {heavy(['--version']) or 'none'}; by validate: "
          f"{heavy(['--config', str(cfg), 'validate', str(good)]) or 'none'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
