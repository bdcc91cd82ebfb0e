"""A wheel built with the standard backend installs into a fresh venv and
works from anywhere: the schemas ride along as package data."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from reconciler.testing.devcluster import DevCluster

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = sorted((REPO / "examples").glob("*.yaml")) + sorted(
    (REPO / "examples" / "snapshots").glob("*.yaml"))


def _run(argv: list[str | Path], cwd: Path, timeout: float = 300,
         ok: tuple[int, ...] = (0,)) -> subprocess.CompletedProcess[str]:
    # A clean environment: nothing from this checkout's venv leaks in.
    env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "HOME": os.environ.get("HOME", "/root"),
           "LANG": "C.UTF-8"}
    proc = subprocess.run([str(a) for a in argv], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout, check=False)
    assert proc.returncode in ok, (f"{argv}: exit {proc.returncode}\n"
                                   f"{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    return proc


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The wheel (and sdist) built from this checkout, the wheel installed
    into a new venv made the documented way; returns the venv."""
    root = tmp_path_factory.mktemp("wheel")
    dist = root / "dist"
    # --no-isolation: the backend (setuptools) comes from this venv, not the network.
    _run([sys.executable, "-m", "build", "--no-isolation", "--outdir", dist, REPO], cwd=root)
    wheels, sdists = list(dist.glob("*.whl")), list(dist.glob("*.tar.gz"))
    assert len(wheels) == 1 and len(sdists) == 1, list(dist.iterdir())
    venv = root / "venv"
    _run(["/usr/bin/python3", "-m", "venv", "--system-site-packages", venv], cwd=root)
    _run([venv / "bin" / "pip", "install", "-q", "--disable-pip-version-check", wheels[0]],
         cwd=root)
    yield venv
    shutil.rmtree(root, ignore_errors=True)


def test_sdist_carries_the_sources_of_truth(installed: Path) -> None:
    sdist = next((installed.parent / "dist").glob("*.tar.gz"))
    names = _run(["tar", "tzf", sdist], cwd=installed.parent).stdout.split()
    top = names[0].split("/")[0]
    for want in ("schemas/volume.schema.json", "schemas/config.schema.json",
                 "CHANGELOG.md", "README.md", "systemd/rbd-reconciler.service",
                 "examples/pgdata.yaml", "man/rbd-reconciler.1",
                 "completions/rbd-reconciler.bash", "scripts/gen-manpage.py",
                 "debian/control", "debian/rules", "scripts/build-deb.sh",
                 # The manual and what builds it (scripts/build-docs.sh).
                 "docs/index.md", "docs/reference/volume.md", "mkdocs.yml",
                 "scripts/gen-docs.py", "scripts/mkdocs_hooks.py"):
        assert f"{top}/{want}" in names, f"{want} missing from the sdist"


def test_the_installed_commands_work_from_another_directory(
        installed: Path, tmp_path: Path) -> None:
    cmd = installed / "bin" / "rbd-reconciler"
    assert _run([cmd, "--version"], cwd=tmp_path).stdout.startswith("rbd-reconciler ")
    # The package (and its schemas) come from the venv, not from this checkout.
    where = _run([installed / "bin" / "python", "-c",
                  "import reconciler.spec.schemas as s, json; print(s.__file__); "
                  "print(sorted(json.loads(s.schema_text('volume'))['properties']))"],
                 cwd=tmp_path).stdout.splitlines()
    assert where[0].startswith(str(installed)), where
    assert "spec" in where[1]
    config = REPO / "examples" / "config" / "local-cluster.yaml"
    for example in EXAMPLES:
        _run([cmd, "--config", config, "validate", example], cwd=tmp_path)
    # A schema error is found and phrased from the packaged schema.
    bad = tmp_path / "bad.yaml"
    bad.write_text("apiVersion: rbd-reconciler/v1\nkind: Volume\nmetadata: {name: x}\n"
                   "spec: {image: {pool: rbd, size: 1Gi, reclaimPolicy: Sometimes}}\n")
    out = _run([cmd, "--config", config, "validate", bad], cwd=tmp_path, ok=(1,))
    assert "reclaimPolicy" in out.stdout + out.stderr
    assert "Traceback" not in out.stdout + out.stderr


def test_the_man_page_and_completion_are_installed(installed: Path, tmp_path: Path) -> None:
    for installed_at, source in (
            ("share/man/man1/rbd-reconciler.1", "man/rbd-reconciler.1"),
            ("share/bash-completion/completions/rbd-reconciler.bash",
             "completions/rbd-reconciler.bash")):
        assert (installed / installed_at).read_text() == (REPO / source).read_text()
    shown = _run(["man", "-M", installed / "share" / "man", "rbd-reconciler"], cwd=tmp_path)
    assert "EXIT STATUS" in shown.stdout


@pytest.mark.ceph
def test_the_installed_plan_talks_to_ceph(installed: Path, tmp_path: Path,
                                          ceph_cluster: DevCluster) -> None:
    desired = tmp_path / "desired"
    desired.mkdir()
    shutil.copy(REPO / "examples" / "image-only.yaml", desired)
    config = tmp_path / "config.yaml"
    config.write_text(
        f"desiredDir: {desired}\nstateDir: {tmp_path / 'state'}\nnodeName: wheel-node\n"
        f"ceph:\n  conf: {ceph_cluster.conf}\n  user: {ceph_cluster.user}\n"
        f"  keyring: {ceph_cluster.keyring}\nallowedRoots: [{tmp_path}]\nmapper: fuse\n")
    out = _run([installed / "bin" / "rbd-reconciler", "--config", config, "plan"],
               cwd=tmp_path, ok=(2,))
    assert "archive" in out.stdout and "create" in out.stdout, out.stdout


def test_every_package_of_the_tree_is_listed_for_the_wheel() -> None:
    """pyproject.toml lists the packages by name (no discovery): a package
    added to the tree and not there is missing from the wheel and the Debian
    package, and every installed command fails to import it (engine.py
    became engine/ and was missed once)."""
    import tomllib

    listed = set(tomllib.loads((REPO / "pyproject.toml").read_text())
                 ["tool"]["setuptools"]["packages"])
    tree = {".".join(p.parent.relative_to(REPO).parts)
            for p in (REPO / "reconciler").rglob("__init__.py")
            if "__pycache__" not in p.parts}
    assert tree - listed == set(), "add these to [tool.setuptools] packages"
