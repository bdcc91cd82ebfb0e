"""drivers/freeze.py (review): the record of a freeze names its child from
the moment the child runs, not only once it has outlived its deadline.

The owner (the daemon) may die while its fsfreeze child is still in the
kernel (SIGKILL, or SIGTERM on a stalled device: the daemon exits within its
bound and the child, in a session of its own, lives on). A record naming
only the dead owner is then "left frozen by a dead owner": the next run
thaws it (EINVAL, the child's freeze has not landed yet: "was not frozen")
and forgets it, and the child's freeze lands later with no record: frozen
for good. A fake fsfreeze here stands for the child stuck in the kernel."""

from __future__ import annotations

import os
import subprocess
import threading
import time
from pathlib import Path

import pytest

from reconciler.drivers import freeze


def test_the_record_names_the_child_while_it_runs(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "fsfreeze").write_text("#!/bin/sh\nsleep 3\n")
    (bin_dir / "fsfreeze").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    state, target = tmp_path / "state", tmp_path / "fs"
    state.mkdir()
    target.mkdir()
    st = os.stat(target)
    rdev = (os.major(st.st_dev), os.minor(st.st_dev))
    errors: list[BaseException] = []

    def run() -> None:
        try:
            with freeze.frozen(str(target), state, rdev, timeout=10):
                pass
        except BaseException as exc:
            errors.append(exc)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    deadline = time.monotonic() + 2
    recs: list[freeze.Record] = []
    while time.monotonic() < deadline and not recs:
        recs = freeze.recorded(state)
        time.sleep(0.05)
    time.sleep(0.5)  # the child runs now (its sleep)
    [rec] = freeze.recorded(state)
    assert rec.child is not None, "the record does not name the running child"
    # As the next run reads it once the owner died: never a dead owner's
    # while its child lives.
    dead = subprocess.Popen(["true"])
    dead.wait()
    orphaned = freeze.Record(rec.key, rec.path, rec.dev, dead.pid, rec.start,
                             rec.earlier_boot, rec.child)
    assert orphaned.owner_alive()
    t.join(30)
    assert not t.is_alive() and not errors, errors
    # The child gone (reaped), the record is an ordinary one: thawed, forgotten.
    assert freeze.recorded(state) == []
