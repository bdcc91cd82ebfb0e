#!/usr/bin/env python3
"""Where one `rbd-reconciler` command spends its time: P14's breakdown.

Runs the console script's ``main`` in this process with timing hooks and
writes one JSON document: the process start (from /proc, so the interpreter's
own start counts), the imports, the engine's phases (load, observe, plan,
apply), each step, each external command (through ``Runner.run`` or
anything else that forks), each call into the Ceph drivers, every
``time.sleep`` (who slept, how long) and the exit. With ``--profile`` the
whole command also runs under cProfile (main thread; its overhead inflates
Python-heavy parts, so the timings of a traced run without it are the ones
to read).

Usage (as root, what `rbd-reconciler` would get after the `--`):

    .venv/bin/python benchmarks/p14_trace.py --out T.json [--profile P] -- --config C apply

benchmarks/p14_kernel_paths.py --breakdown runs it in the VM.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

T0 = time.monotonic()  # this script's first line (the interpreter is up)


def _process_start() -> float:
    """Monotonic-ish time this process was created (its /proc start time,
    in clock ticks since boot, against CLOCK_BOOTTIME now)."""
    ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
    started = ticks / os.sysconf("SC_CLK_TCK")
    return T0 - (time.clock_gettime(time.CLOCK_BOOTTIME) - started)


START = _process_start()
EVENTS: list[dict[str, Any]] = []
_LOCK = threading.Lock()


def _event(kind: str, name: str, t0: float, t1: float, **extra: Any) -> None:
    with _LOCK:
        EVENTS.append({"kind": kind, "name": name, "start": round(t0 - START, 4),
                       "seconds": round(t1 - t0, 4), "thread": threading.current_thread().name,
                       **extra})


def timed(kind: str, name: str, fn: Callable[..., Any],
          describe: Callable[..., dict[str, Any]] | None = None) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kw: Any) -> Any:
        t0 = time.monotonic()
        try:
            return fn(*args, **kw)
        finally:
            _event(kind, name, t0, time.monotonic(), **(describe(*args, **kw) if describe else {}))
    wrapper.__p14_traced__ = True  # type: ignore[attr-defined]
    return wrapper


def patch(module: Any, attr: str, kind: str, name: str | None = None,
          describe: Callable[..., dict[str, Any]] | None = None) -> None:
    """Time ``module.attr`` (absent in the code traced, e.g. an older
    checkout's: left alone)."""
    fn = getattr(module, attr, None)
    if fn is not None and not getattr(fn, "__p14_traced__", False):
        setattr(module, attr, timed(kind, name or f"{module.__name__.rsplit('.', 1)[-1]}.{attr}",
                                    fn, describe))


def _argv_words(argv: Any) -> list[str]:
    return [str(a) for a in argv]


def install() -> None:
    """Hook what the command does. Modules are imported here (timed as the
    "imports" phase), so the hooks are in place before ``main`` runs."""
    import subprocess

    import reconciler.apply.claims as claims
    import reconciler.apply.runner as runner
    import reconciler.cli.main  # noqa: F401  (the apply path imports it)
    import reconciler.cli.reconcile as reconcile
    import reconciler.drivers.ceph as ceph
    import reconciler.drivers.rbdbase as rbdbase
    import reconciler.drivers.rbdheader as rbdheader
    import reconciler.drivers.run as run
    import reconciler.engine as engine
    import reconciler.observe.ceph as oceph
    import reconciler.observe.node as onode
    import reconciler.spec.loader as loader

    _event("phase", "imports", T0, time.monotonic())

    popen_init = subprocess.Popen.__init__

    @functools.wraps(popen_init)
    def popen(self: subprocess.Popen[Any], args: Any, *a: Any, **kw: Any) -> None:
        t0 = time.monotonic()  # fork + exec: what starting any command costs
        popen_init(self, args, *a, **kw)
        _event("fork", " ".join(_argv_words(args if isinstance(args, list) else [args])[:3]),
               t0, time.monotonic())

    subprocess.Popen.__init__ = popen  # type: ignore[method-assign]

    def cmd(self: Any, argv: Any, **kw: Any) -> dict[str, Any]:
        words = _argv_words(argv)
        return {"argv": words}

    run_fn = run.Runner.run
    run.Runner.run = timed("cmd", "", run_fn, cmd)  # type: ignore[method-assign]

    real_sleep = time.sleep

    def sleep(seconds: float) -> None:
        t0 = time.monotonic()
        real_sleep(seconds)
        caller = sys._getframe(1)
        _event("sleep", f"{Path(caller.f_code.co_filename).name}:{caller.f_lineno}", t0,
               time.monotonic())

    time.sleep = sleep

    real_connect = ceph.connect

    @contextlib.contextmanager
    def connect(*a: Any, **kw: Any) -> Iterator[Any]:
        t0 = time.monotonic()
        with real_connect(*a, **kw) as cluster:
            _event("ceph", "connect (librados)", t0, time.monotonic())
            yield cluster

    ceph.connect = connect
    for mod in (ceph, rbdbase, claims, rbdheader):
        for attr, fn in list(vars(mod).items()):
            if callable(fn) and not attr.startswith("_") and not isinstance(fn, type) \
                    and getattr(fn, "__module__", None) == mod.__name__ and attr != "connect":
                patch(mod, attr, "ceph")
    patch(oceph, "observe_images", "ceph")
    patch(oceph, "_wait_connected", "wait", "observe waits for the connect")
    patch(onode, "observe", "phase", "observe")
    patch(onode, "_devices", "phase", "observe: probe devices")
    patch(onode, "open_crypts", "phase", "observe: open crypts")
    for module, mapper in (("kernelmapper", "KernelMapper"), ("fusemapper", "FuseMapper")):
        cls = getattr(__import__(f"reconciler.drivers.{module}", fromlist=[mapper]), mapper)
        patch(cls, "list", "phase", f"observe: {mapper}.list")
    patch(loader, "load", "phase", "load")
    patch(engine, "observe", "phase", "observe (engine)")
    patch(engine, "plan", "phase", "plan")
    patch(engine, "apply", "phase", "apply")
    patch(reconcile, "pick", "phase", "pick (load + select)")
    patch(reconcile, "_thaw_first", "phase", "thaw first")

    def step(self: Any, s: Any) -> dict[str, Any]:
        return {"step": s.action, "target": s.target}

    patch(runner._VolumeRun, "execute", "step", "", step)


def _outermost(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Those not inside another of the list on the same thread (a Ceph
    driver call that calls another is counted once)."""
    def inside(e: dict[str, Any], o: dict[str, Any]) -> bool:
        return (o is not e and o["thread"] == e["thread"] and o["start"] <= e["start"]
                and e["start"] + e["seconds"] <= o["start"] + o["seconds"])
    return [e for e in events if not any(inside(e, o) for o in events)]


def _label(e: dict[str, Any]) -> str:
    if e["kind"] == "cmd":
        words = [w for w in e["argv"] if not w.startswith(("--conf=", "--id=", "--keyring="))]
        return " ".join(w if len(w) < 40 else "..." + w[-24:] for w in words)
    if e["kind"] == "step":
        return f"{e['step']} {e['target']}"
    return str(e["name"])


def summarize(doc: dict[str, Any], wall: float | None = None, title: str = "") -> str:
    """The breakdown as text: phases, steps, commands, Ceph calls, sleeps."""
    ev = doc["events"]
    lines = [f"== {title or ' '.join(doc['argv'])}" + (f": {wall:.2f} s wall" if wall else "")]

    def row(name: str, seconds: float, at: float | None = None, note: str = "") -> None:
        when = f"  @{at:6.2f}" if at is not None else " " * 9
        lines.append(f"  {seconds:7.3f} s{when}  {name}{note}")

    row("process start -> trace script (interpreter, site)", doc["process_start_to_script"], 0.0)
    for e in ev:
        if e["kind"] == "phase":
            row(e["name"], e["seconds"], e["start"], f"  [{e['thread']}]"
                if e["thread"] != "MainThread" else "")
    ended = doc["process_start_to_script"] + doc["script_to_main"] + doc["main"]
    if wall:
        row("after main: interpreter exit (atexit, librados shutdown), as seen outside",
            wall - ended)
    for kind, head in (("step", "steps"), ("cmd", "external commands (Runner.run)"),
                       ("fork", "forks (Popen: fork+exec only)"),
                       ("ceph", "Ceph driver calls (outermost)"),
                       ("wait", "waits for a connect begun earlier"), ("sleep", "sleeps")):
        these = [e for e in ev if e["kind"] == kind]
        if kind == "ceph":
            these = _outermost(these)
        if not these:
            continue
        lines.append(f" {head}: {len(these)}, {sum(e['seconds'] for e in these):.3f} s")
        for e in these:
            row(_label(e), e["seconds"], e["start"],
                f"  [{e['thread']}]" if e["thread"] != "MainThread" else "")
    return "\n".join(lines)


def main() -> int:
    args = sys.argv[1:]
    if args[:1] == ["--summary"]:  # print the breakdown of a written trace
        for path in args[1:]:
            print(summarize(json.loads(Path(path).read_text())))
        return 0
    out, profile = None, None
    while args and args[0] != "--":
        if args[0] == "--out":
            out, args = args[1], args[2:]
        elif args[0] == "--profile":
            profile, args = args[1], args[2:]
        else:
            print(f"p14_trace: unknown option {args[0]}", file=sys.stderr)
            return 2
    argv = args[1:]
    install()
    sys.argv = ["rbd-reconciler", *argv]
    from reconciler.entry import main as entry_main

    t_main = time.monotonic()
    if profile:
        import cProfile

        prof = cProfile.Profile()
        rc = prof.runcall(entry_main)
        prof.dump_stats(profile)
    else:
        rc = entry_main()
    t_end = time.monotonic()
    _event("phase", "main", t_main, t_end)
    if out:
        doc = {"argv": argv, "rc": rc, "process_start_to_script": round(T0 - START, 4),
               "script_to_main": round(t_main - T0, 4), "main": round(t_end - t_main, 4),
               "events": sorted(EVENTS, key=lambda e: e["start"])}
        # The interpreter's exit (atexit, librados shutdown) comes after this:
        # the caller times the whole process and sees it as the remainder.
        Path(out).write_text(json.dumps(doc, indent=1))
    return int(rc or 0)


if __name__ == "__main__":
    sys.exit(main())
