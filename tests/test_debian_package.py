"""The Debian package, built from this checkout by scripts/build-deb.sh
(debhelper 13, pybuild; lintian with no error or warning, or the script
fails): its files where Debian puts them, Debian's packages as its
dependencies, maintainer scripts that enable and start nothing and never
stop the release unit on an upgrade, and the code running on Debian 12's own
python3-* libraries from the extracted package.

46 s measured on 2 shared cores: two builds with lintian (~9 s each: the
version, and an upgrade's VERSION+SUFFIX) and the unit tests under Debian's
libraries (~28 s). Installing it on a booted systemd node is the VM tests'
part (issue 28)."""

from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
VERSION = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
SITE = "usr/lib/python3/dist-packages"
# A clean environment: Debian's interpreter and libraries, nothing from this
# checkout's venv (or a pyenv on PATH).
DEBIAN_ENV = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8",
              "HOME": os.environ.get("HOME", "/root"), "PYTHONDONTWRITEBYTECODE": "1"}

# Every module the code imports from outside the standard library, and the
# Debian package that provides it. A new import fails
# test_the_dependencies_are_debians until it is added here and to Depends.
DEBIAN_PACKAGE_OF = {
    "yaml": "python3-yaml", "jsonschema": "python3-jsonschema", "grpc": "python3-grpcio",
    "google": "python3-protobuf", "rados": "python3-rados", "rbd": "python3-rbd",
    "cryptography": "python3-cryptography", "prometheus_client": "python3-prometheus-client",
    "systemd": "python3-systemd",
}
# The unit tests of the code that uses the libraries whose Debian 12
# versions differ from pip's (jsonschema 4.10, prometheus-client 0.16,
# grpcio 1.51, protobuf 3.21).
DEBIAN_RUNTIME_TESTS = ["tests/unit/spec", "tests/unit/daemon/test_metrics_units.py",
                        "tests/unit/csi"]


def _run(argv: list[str | Path], env: dict[str, str] | None = None, cwd: Path | None = None,
         timeout: float = 600, ok: tuple[int, ...] = (0,)) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run([str(a) for a in argv], env=env, cwd=cwd, capture_output=True,
                          text=True, timeout=timeout, check=False)
    assert proc.returncode in ok, (f"{argv}: exit {proc.returncode}\n"
                                   f"{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return proc


def _build(outdir: Path, *args: str) -> tuple[Path, str]:
    proc = _run([REPO / "scripts" / "build-deb.sh", "--outdir", outdir, *args], timeout=900)
    lines = proc.stdout.splitlines()
    assert len(lines) == 1, f"stdout must be the path alone: {proc.stdout!r}"
    return Path(lines[0]), proc.stderr


def _checkout_state() -> str:
    return _run(["git", "-C", REPO, "status", "--porcelain", "--ignored"]).stdout


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, str, str, str]]:
    """(the .deb, the build's stderr, the checkout's git status before and after)"""
    out = tmp_path_factory.mktemp("deb")
    before = _checkout_state()
    deb, log = _build(out)
    yield deb, log, before, _checkout_state()
    shutil.rmtree(out, ignore_errors=True)


@pytest.fixture(scope="module")
def deb(built: tuple[Path, str, str, str]) -> Path:
    return built[0]


@pytest.fixture(scope="module")
def root(deb: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The package's files, extracted (not installed)."""
    out = tmp_path_factory.mktemp("root")
    _run(["dpkg-deb", "-x", deb, out])
    return out


@pytest.fixture(scope="module")
def control(deb: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The package's control area: control, postinst, prerm, postrm, ..."""
    out = tmp_path_factory.mktemp("control")
    _run(["dpkg-deb", "-e", deb, out])
    return out


def _field(deb: Path, name: str) -> str:
    return _run(["dpkg-deb", "-f", deb, name]).stdout.strip()


def _names(relation: str) -> set[str]:
    """Package names of a Depends-style field (versions and alternatives dropped)."""
    return {alt.split()[0].split(":")[0] for part in relation.split(",") if part.strip()
            for alt in part.split("|")}


def test_built_where_the_contract_says_and_lintian_clean(
        built: tuple[Path, str, str, str]) -> None:
    deb, log, before, after = built
    assert deb.name == f"rbd-reconciler_{VERSION}_all.deb" and deb.is_file()
    assert "build-deb: lintian rbd-reconciler_" in log
    tags = [line for line in log.splitlines() if re.match(r"^[EW]: ", line)]
    assert not tags, tags
    # The build ran in a copy: no file of the checkout appeared or changed
    # (debhelper's droppings, build/, an egg-info, pyproject.toml's edit).
    assert after == before


def test_contents(deb: Path) -> None:
    listing = _run(["dpkg-deb", "-c", deb]).stdout.splitlines()
    files = {line.split(None, 5)[5].removeprefix(".").split(" -> ")[0]: line.split()[0]
             for line in listing}
    assert files["/usr/bin/rbd-reconciler"] == "-rwxr-xr-x"
    for path in ("/lib/systemd/system/rbd-reconciler.service",
                 "/lib/systemd/system/rbd-reconciler-shutdown.service",
                 "/usr/lib/tmpfiles.d/rbd-reconciler.conf",
                 "/usr/share/man/man1/rbd-reconciler.1.gz",
                 # Named after the command: bash-completion loads it on first use.
                 "/usr/share/bash-completion/completions/rbd-reconciler",
                 # Uncompressed: the units' Documentation= names it, and the
                 # pages of docs/ (uncompressed too) link each other by name.
                 "/usr/share/doc/rbd-reconciler/README.md",
                 "/usr/share/doc/rbd-reconciler/docs/daemon.md",
                 "/usr/share/doc/rbd-reconciler/docs/reference/volume.md",
                 "/usr/share/doc/rbd-reconciler/copyright",
                 "/usr/share/doc/rbd-reconciler/examples/config/node.yaml",
                 # Where the README's install step copies it from: minimal
                 # images exclude /usr/share/doc (Debian Policy 12.3).
                 "/usr/share/rbd-reconciler/examples/config/node.yaml",
                 f"/{SITE}/reconciler/_schemas/volume.schema.json",
                 f"/{SITE}/reconciler/csi/csi_pb2.py",
                 f"/{SITE}/rbd_reconciler-{VERSION}.dist-info/METADATA"):
        assert files.get(path, "").startswith("-rw-r--r--"), (path, files.get(path))
    for path in files:
        assert "__pycache__" not in path and not path.endswith((".pyc", ".pyo")), path
        assert "/tests/" not in path and "/test_" not in path, path
        # No conffile, nothing under /etc or /usr/local: the operator writes
        # /etc/rbd-reconciler/config.yaml from the example (README).
        assert not path.startswith(("/etc", "/usr/local", "/var")), path


def test_the_files_are_the_repositorys(root: Path, control: Path) -> None:
    """What the package installs is the repository's, byte for byte (the
    units included: they name /usr/bin/rbd-reconciler themselves)."""
    same = {
        "lib/systemd/system/rbd-reconciler.service": "systemd/rbd-reconciler.service",
        "lib/systemd/system/rbd-reconciler-shutdown.service":
            "systemd/rbd-reconciler-shutdown.service",
        "usr/lib/tmpfiles.d/rbd-reconciler.conf": "systemd/rbd-reconciler.tmpfiles.conf",
        "usr/share/bash-completion/completions/rbd-reconciler": "completions/rbd-reconciler.bash",
        f"{SITE}/reconciler/csi/csi_pb2_grpc.py": "reconciler/csi/csi_pb2_grpc.py",
    }
    for installed, source in same.items():
        assert (root / installed).read_bytes() == (REPO / source).read_bytes(), installed
    man = _run(["zcat", root / "usr/share/man/man1/rbd-reconciler.1.gz"]).stdout
    assert man == (REPO / "man" / "rbd-reconciler.1").read_text()
    for unit in ("rbd-reconciler.service", "rbd-reconciler-shutdown.service"):
        commands = re.findall(r"^Exec(?:Start|Stop)=(\S+)", (REPO / "systemd" / unit).read_text(),
                              re.M)
        assert "/usr/bin/rbd-reconciler" in commands, (unit, commands)
    assert not (control / "conffiles").exists()


def test_the_dependencies_are_debians(deb: Path) -> None:
    depends = _names(_field(deb, "Depends"))
    recommends = _names(_field(deb, "Recommends"))
    suggests = _names(_field(deb, "Suggests"))
    imported: set[str] = set()
    for path in (REPO / "reconciler").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_bytes())):
            if isinstance(node, ast.Import):
                imported |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                imported.add(node.module.split(".")[0])
    third_party = imported - set(sys.stdlib_module_names) - {"reconciler"}
    assert third_party <= set(DEBIAN_PACKAGE_OF), (
        f"imported, with no Debian package known: {third_party - set(DEBIAN_PACKAGE_OF)}")
    for module in third_party:
        assert DEBIAN_PACKAGE_OF[module] in depends, (module, depends)
    assert {"ceph-common", "python3-rados", "python3-rbd"} <= depends
    assert {"rbd-nbd", "rbd-fuse"} <= recommends and "cryptsetup-bin" in suggests
    assert "gpg" in suggests and "gnupg" not in suggests  # git verify-commit runs gpg only
    # The daemon reads inotify itself (daemon/dirwatch.py): no watchdog.
    assert "watchdog" not in third_party
    assert not any("watchdog" in n for n in depends | recommends | suggests)
    assert _field(deb, "Version") == VERSION and _field(deb, "Architecture") == "all"


def _maintscript(control: Path, name: str, fake: Path, calls: Path, *args: str,
                 env: dict[str, str]) -> list[str]:
    """Run a maintainer script with every command it may call faked (each
    logs its argv) and /run/systemd/system present, as on a systemd node."""
    script = control / name
    text = script.read_text().replace("/run/systemd/system", str(fake / "run-systemd")) \
        .replace("/usr/bin/rbd-reconciler", str(fake / "rbd-reconciler"))
    patched = fake / name
    patched.write_text(text)
    calls.write_text("")
    _run(["sh", "-e", patched, *args], env=env)
    return calls.read_text().splitlines()


def test_maintainer_scripts_enable_start_and_release_nothing_on_install_or_upgrade(
        control: Path, tmp_path: Path) -> None:
    fake, calls = tmp_path / "bin", tmp_path / "calls"
    fake.mkdir()
    (fake / "run-systemd").mkdir()
    for cmd in ("deb-systemd-invoke", "deb-systemd-helper", "systemctl", "systemd-tmpfiles",
                "py3compile", "py3clean", "pypy3compile", "pypy3clean", "dpkg",
                "rbd-reconciler"):
        # debian-installed: no state from an earlier install, nothing enabled;
        # no unit active (what the stop leaves: tests/test_package_prerm.py
        # has the prerm's other cases); nothing of ours up.
        rc = 1 if cmd == "deb-systemd-helper" else 0
        (fake / cmd).write_text(f'#!/bin/sh\necho "{cmd} $*" >> {calls}\n'
                                f'case "$1" in debian-installed|was-enabled) exit {rc};; '
                                f'is-active) exit 3;; esac\n')
        (fake / cmd).chmod(0o755)
    env = {**DEBIAN_ENV, "PATH": f"{fake}:/usr/bin:/bin"}
    assert not (control / "preinst").exists()  # nothing stopped before an upgrade

    def invoked(lines: list[str]) -> list[str]:
        return [line for line in lines if line.startswith("deb-systemd-invoke")]

    install = _maintscript(control, "postinst", fake, calls, "configure", "", env=env)
    assert invoked(install) == []
    assert not any(" enable " in f" {line} " for line in install), install
    assert "systemd-tmpfiles --create rbd-reconciler.conf" in install
    # An upgrade: the daemon restarts if it runs (its mounts stay:
    # KillMode=process); the release unit is not touched (its stop releases).
    upgrade = _maintscript(control, "postinst", fake, calls, "configure", "0.0.1", env=env)
    assert invoked(upgrade) == ["deb-systemd-invoke try-restart rbd-reconciler.service"]
    assert _maintscript(control, "prerm", fake, calls, "upgrade", "9.9.9", env=env) == [
        "py3clean -p rbd-reconciler"]
    assert invoked(_maintscript(control, "postrm", fake, calls, "upgrade", "9.9.9",
                                env=env)) == []
    # Removal with nothing of ours up, as ceph-common does with rbdmap: the
    # daemon, then the release.
    removal = _maintscript(control, "prerm", fake, calls, "remove", env=env)
    assert "rbd-reconciler release --all --dry-run" in removal, removal
    assert invoked(removal) == [
        "deb-systemd-invoke stop rbd-reconciler.service rbd-reconciler-shutdown.service"]


def test_it_runs_on_debians_own_libraries(root: Path, tmp_path: Path) -> None:
    """The extracted package under /usr/bin/python3 with Debian 12's
    python3-* only: the command, and the unit tests of the code that uses
    the libraries whose Debian versions are older than pip's."""
    env = {**DEBIAN_ENV, "PYTHONPATH": str(root / SITE), "HOME": str(tmp_path)}
    cmd = root / "usr" / "bin" / "rbd-reconciler"
    assert _run([cmd, "--version"], env=env, cwd=tmp_path).stdout == f"rbd-reconciler {VERSION}\n"
    config = REPO / "examples" / "config" / "local-cluster.yaml"
    _run([cmd, "--config", config, "validate", *sorted((REPO / "examples").glob("*.yaml"))],
         env=env, cwd=tmp_path)
    where = _run(["/usr/bin/python3", "-c", "import reconciler, grpc, google.protobuf, "
                  "jsonschema, prometheus_client, yaml\n"
                  "for m in (reconciler, grpc, google.protobuf, jsonschema, prometheus_client, "
                  "yaml): print(m.__file__)"], env=env, cwd=tmp_path).stdout.split()
    assert where[0].startswith(str(root / SITE)), where
    assert all(w.startswith("/usr/lib/python3/dist-packages/") for w in where[1:]), where
    # pytest from Debian too (python3-pytest), run from elsewhere so that the
    # checkout is not on sys.path: `reconciler` is the package's.
    proc = _run(["/usr/bin/python3", "-m", "pytest", "-q", "-p", "no:cacheprovider",
                 "-c", REPO / "pyproject.toml", "--rootdir", REPO,
                 *(REPO / t for t in DEBIAN_RUNTIME_TESTS)], env=env, cwd=tmp_path, timeout=900)
    assert re.search(r"\d+ passed", proc.stdout), proc.stdout[-2000:]


def test_an_upgrade_package_sorts_newer_and_says_so(tmp_path: Path) -> None:
    """scripts/build-deb.sh --version-suffix: the package the VM's upgrade
    test installs over the plain one."""
    deb, _log = _build(tmp_path, "--version-suffix", "upgrade1")
    new = f"{VERSION}+upgrade1"
    assert deb == tmp_path / f"rbd-reconciler_{new}_all.deb"
    assert _field(deb, "Version") == new
    _run(["dpkg", "--compare-versions", new, "gt", VERSION])
    root = tmp_path / "root"
    _run(["dpkg-deb", "-x", deb, root])
    env = {**DEBIAN_ENV, "PYTHONPATH": str(root / SITE)}
    out = _run([root / "usr/bin/rbd-reconciler", "--version"], env=env, cwd=tmp_path).stdout
    assert out == f"rbd-reconciler {new}\n"
    # The checkout itself still says VERSION.
    assert f'__version__ = "{VERSION}"' in (REPO / "reconciler" / "__init__.py").read_text()
    bad = _run([REPO / "scripts" / "build-deb.sh", "--version-suffix", "Not_valid"], ok=(2,))
    assert "--version-suffix" in bad.stderr
