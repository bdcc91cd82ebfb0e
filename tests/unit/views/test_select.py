"""What PATH|NAME arguments pick among the loaded volumes (views.select),
the same for the command line alone and for the daemon."""

from __future__ import annotations

from pathlib import Path

from reconciler.spec.diagnostics import Diagnostic
from reconciler.spec.model import ImageSpec, Source, Volume
from reconciler.views import select

D = Path("/etc/rbd-reconciler/volumes.d")


def vol(name: str, file: str) -> Volume:
    return Volume(name=name, state="present", image=ImageSpec("rbd", name, 1 << 20, (), "Retain"),
                  map=None, stage=None, publish=(), on_remove=None, source=Source(D / file, 1))


VOLUMES = [vol("a", "ab.yaml"), vol("b", "ab.yaml"), vol("c", "c.yaml")]
BROKEN = D / "broken.yaml"
ERRORS = [Diagnostic(BROKEN, 3, 1, "spec.size", "bad"),
          Diagnostic(D / "other.yaml", 1, 1, "x", "y")]


def pick(*targets: dict[str, str]) -> tuple[list[str], list[str], list[Diagnostic]]:
    sel = select(VOLUMES, {"f"}, {BROKEN, D / "other.yaml"}, ERRORS, list(targets))
    return sel.names, sel.missing, sel.errors


def test_nothing_named_is_everything_and_every_error() -> None:
    assert pick() == (["a", "b", "c", "f"], [], ERRORS)


def test_names_and_files_and_directories() -> None:
    assert pick({"name": "c"}) == (["c"], [], [])
    assert pick({"path": str(D / "ab.yaml")}) == (["a", "b"], [], [])
    assert pick({"path": str(D)}, {"name": "a"})[0] == ["a", "b", "c"]
    assert pick({"path": str(D) + "/"})[0] == ["a", "b", "c"]


def test_a_broken_file_named_brings_its_errors_a_missing_name_all_of_them() -> None:
    assert pick({"path": str(BROKEN)}) == ([], [], [ERRORS[0]])
    assert pick({"name": "f"}) == (["f"], [], ERRORS)  # frozen: where it lives may be broken
    assert pick({"name": "zz"}, {"path": "/elsewhere/x.yaml"}) == (
        [], ["zz", "/elsewhere/x.yaml"], ERRORS)
