"""Cold commands pay only for what they use (issue 17, cold paths): what
`validate` imports, and the parser built for the command that runs."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

from reconciler.cli import main as cli

ROOT = Path(__file__).resolve().parents[3]

# Loaded by `validate` of a valid file, they would cost it start-up time for nothing.
NOT_FOR_VALIDATE = ("rados", "rbd", "jsonschema", "socket", "logging", "hashlib", "typing",
                    "subprocess", "grpc", "watchdog", "shutil", "reconciler.engine",
                    "reconciler.drivers.ceph", "reconciler.drivers.rbdbase",
                    "reconciler.plan.planner")


def test_validate_imports_nothing_it_does_not_use(tmp_path: Path) -> None:
    cfg = tmp_path / "config.yaml"
    cfg.write_text(f"desiredDir: {tmp_path}\nstateDir: {tmp_path}/state\nallowedRoots: [/srv]\n")
    code = ("import sys\nfrom reconciler.entry import main\n"
            f"sys.argv = ['rbd-reconciler', '--config', {str(cfg)!r}, 'validate', "
            f"{str(ROOT / 'examples' / 'pgdata.yaml')!r}]\n"
            "rc = main()\n"
            "print(__import__('json').dumps([rc, sorted(sys.modules)]))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=ROOT, timeout=60)
    assert proc.returncode == 0, proc.stderr
    rc, modules = json.loads(proc.stdout.splitlines()[-1])
    assert rc == 0, proc.stderr
    assert "reconciler.spec.loader" in modules  # it did validate
    # What the interpreter itself loads before any of ours (site's .pth
    # files: a machine's own, e.g. one that imports certifi) is not
    # validate's; json is imported by the probe itself.
    bare = subprocess.run([sys.executable, "-c", "import sys, json; "
                           "print(json.dumps(sorted(sys.modules)))"],
                          capture_output=True, text=True, cwd=ROOT, timeout=60, check=True)
    at_start = set(json.loads(bare.stdout))
    assert sorted(set(NOT_FOR_VALIDATE) & (set(modules) - at_start)) == []


# Loaded by a cold `apply` only when a volume needs them (issue 29: in the VM
# of the kernel tests every module costs ~0.05 s over 9p).
ONLY_WHEN_NEEDED = ("reconciler.apply.groups", "reconciler.apply.sealing",
                    "reconciler.drivers.freeze", "reconciler.drivers.groups",
                    "reconciler.drivers.iolimits", "reconciler.drivers.fuseforce",
                    "concurrent.futures.thread", "socket")


def test_the_apply_path_imports_only_what_every_apply_uses() -> None:
    """Importing what a cold `apply` runs (the CLI, the engine) loads none of
    the drivers only some volumes use; a module that can never be here fails
    to import at once, and what tries it still works."""
    code = ("import sys, json\nfrom reconciler import entry\n"
            "for n in entry.NEVER_HERE: sys.modules.setdefault(n, None)\n"
            "import reconciler.cli.main, reconciler.cli.reconcile, reconciler.engine\n"
            "import copy, subprocess, rados, rbd\n"
            "print(json.dumps([sorted(sys.modules), subprocess.run(['true']).returncode,\n"
            "                  copy.copy([1]) == [1]]))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=ROOT, timeout=60)
    assert proc.returncode == 0, proc.stderr
    modules, rc, copied = json.loads(proc.stdout.splitlines()[-1])
    assert rc == 0 and copied
    assert "reconciler.apply.runner" in modules  # it did import the apply path
    assert sorted(set(ONLY_WHEN_NEEDED) & set(modules)) == []


def test_an_internal_error_in_validate_is_still_logged_as_before(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Logging is set up only when the loader logs; the line looks as it did."""
    import logging

    from reconciler.spec import lazylog, loader

    f = tmp_path / "v.yaml"
    f.write_text((ROOT / "examples" / "pgdata.yaml").read_text())
    cfg = tmp_path / "config.yaml"
    cfg.write_text(f"desiredDir: {tmp_path}\nstateDir: {tmp_path}/state\nallowedRoots: [/srv]\n")

    def boom(*_: object, **__: object) -> None:
        raise RuntimeError("boom")

    monkeypatch.setattr(loader, "_load_file", boom, raising=True)
    root = logging.getLogger()
    handlers = root.handlers[:]
    monkeypatch.setattr(root, "handlers", [])  # basicConfig acts only on a bare root
    try:
        rc = cli.main(["--config", str(cfg), "validate", str(f)])
    finally:
        added = [h for h in root.handlers if h not in handlers]
        for h in added:
            root.removeHandler(h)
    assert not lazylog._setup
    assert rc == 1
    assert [type(h) for h in added] == [logging.StreamHandler]
    assert added[0].formatter._fmt == "%(levelname)s %(name)s: %(message)s"  # type: ignore[union-attr]


@pytest.mark.parametrize("argv,command", [
    (["validate", "f"], "validate"),
    (["-c", "x.yaml", "-v", "apply"], "apply"),
    (["--config=x.yaml", "release", "--all"], "release"),
    (["--verbose", "--config", "x", "rotate-key", "v"], "rotate-key"),
    (["--help"], None), (["--conf", "x", "plan"], None), (["-vc", "x", "plan"], None),
    (["aply"], None), ([], None), (["-c"], None),
])
def test_command_of(argv: list[str], command: str | None) -> None:
    assert cli._command_of(argv) == command


def _subparsers(p: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in p._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


@pytest.mark.parametrize("command", cli.COMMANDS)
def test_a_command_alone_parses_and_helps_as_with_all(command: str,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "100")
    full, alone = cli.build_parser(), cli.build_parser(only=command)
    assert set(_subparsers(full)) == set(cli.COMMANDS)
    assert list(_subparsers(alone)) == [command]
    assert _subparsers(alone)[command].format_help() == _subparsers(full)[command].format_help()
    assert alone.format_usage() == full.format_usage()
    argv = ["-c", "c.yaml", command, *(["NAME"] if command in (
        "explain", "takeover", "recover", "rotate-key") else [])]
    a, b = vars(full.parse_args(argv)), vars(alone.parse_args(argv))
    assert {k: v for k, v in a.items() if k != "func"} == {
        k: v for k, v in b.items() if k != "func"}
    if "func" in a:
        assert (a["func"].module, a["func"].name) == (b["func"].module, b["func"].name)


def test_help_is_as_wide_as_shutil_says(monkeypatch: pytest.MonkeyPatch) -> None:
    import shutil

    for cols in ("60", "133", "junk"):
        monkeypatch.setenv("COLUMNS", cols)
        assert cli._columns() == shutil.get_terminal_size().columns
