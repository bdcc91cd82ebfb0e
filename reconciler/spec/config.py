"""Node configuration: where desired files live, how to reach Ceph, what is allowed.

Imported by apply/rotate.py, apply/takeover.py; cli/ (12 modules);
csi/cephinfo.py, csi/converge.py, csi/node.py; daemon/ (8 modules); drivers/
(5 modules); engine/ (6 modules); observe/ceph.py, observe/node.py;
source/fetching.py, source/report.py, source/sync.py; spec/ (4 modules);
views.py.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from reconciler.spec.diagnostics import Diagnostic, excerpt, format_field
from reconciler.spec.lazylog import LazyLogger
from reconciler.spec.schemas import schema_errors
from reconciler.spec.source import SourceConfig, build_source, source_problems
from reconciler.spec.yamldoc import Document, YamlError, load_documents

log = LazyLogger("reconciler.config")  # the name log lines have always carried

DEFAULT_CONFIG_PATH = Path("/etc/rbd-reconciler/config.yaml")
DEFAULT_CONTROL_SOCKET = Path("/run/rbd-reconciler/control.sock")
MAX_CONFIG_BYTES = 1 << 20


@dataclass(frozen=True)
class CephConfig:
    conf: str
    user: str
    keyring: str | None  # None: whatever ceph.conf / librados defaults find


@dataclass(frozen=True)
class CsiConfig:
    endpoint: str | None  # unix:///path; None: no CSI server (`run --csi-endpoint` sets it too)
    dir: Path | None  # where the adapter writes its volume files; None: <stateDir>/csi.d
    driver_name: str
    timeout_seconds: float  # longest a call waits for the engine (never past its gRPC deadline)
    # The controller's name -> volume records in the omap of a RADOS object
    # in this pool (any replica can serve); None: csi.dir alone holds them.
    state_pool: str | None = None


DEFAULT_DRIVER_NAME = "rbd.reconciler.local"


@dataclass(frozen=True)
class MetricsConfig:
    listen: str | None  # HOST:PORT for /metrics (no host: 127.0.0.1); None: no endpoint
    textfile: Path | None  # a *.prom file for node_exporter's textfile collector


@dataclass(frozen=True)
class CloneConfig:
    max_depth: int = 8  # ceph-csi's hard limit is 8 too
    flatten: str = "depth"  # never | always | depth
    flatten_on_delete: bool = False


@dataclass(frozen=True)
class TimeoutsConfig:
    """Deadlines of node commands and of the daemon's stop (docs/daemon.md: Deadlines)."""

    command_seconds: float = 120.0  # any node command (blkid, mount, losetup, rbd ...)
    mkfs_seconds: float = 600.0  # mkfs, and e2fsck + resize2fs before mounting
    stop_seconds: float = 30.0  # SIGTERM to exit, whatever is stuck
    stop_grace_seconds: float = 5.0  # a command running at SIGTERM may finish within this


# After the grace, the stop kills what still runs and waits for it (bounded):
# stopSeconds must leave this much time after stopGraceSeconds.
STOP_AFTER_GRACE_S = 6.0


@dataclass(frozen=True)
class SnapshotsConfig:
    # Longest a filesystem stays frozen around a snapshot: a watchdog thaws
    # it then, even while the snapshot call hangs, and the snapshot fails.
    freeze_timeout_seconds: float = 5.0


@dataclass(frozen=True)
class EventsConfig:
    # Images mapped through rbd-fuse: their size is read from the header this
    # often (no open, no watch) to see a resize made elsewhere; 0: off.
    image_poll_seconds: float = 0.5
    # Volumes refused because another node holds their image's claim: that
    # claim is read from the header this often (no open, no watch) to follow
    # as soon as it goes (a volume moved between nodes); 0: off.
    claim_poll_seconds: float = 0.5
    # Mapped devices: their I/O counters (sysfs) are read this often; 0: off.
    io_poll_seconds: float = 1.0
    # I/O in flight and none completed for this long: the volume is Stalled.
    io_stall_seconds: float = 10.0


@dataclass(frozen=True)
class EncryptionConfig:
    """LUKS2 (docs/encryption.md). Key files must lie under key_root."""

    key_root: str = "/etc/rbd-reconciler/keys"
    pbkdf: str = "argon2id"  # argon2id | pbkdf2
    iter_time_ms: int = 2000  # cryptsetup benchmarks the node for this long a keyslot
    iterations: int | None = None  # fixed instead of benchmarked (no ~3 s benchmark)
    memory_kib: int | None = None  # argon2id's memory, with fixed iterations
    # Version-1 wrapped passphrases (bound to no image, from before 0.x):
    # read, and sealed again bound to their image when used. False once every
    # volume has been opened or rotated since the upgrade (docs/encryption.md).
    accept_unbound: bool = True


@dataclass(frozen=True)
class MountPrivileges:
    """Where a desired file may ask for ``suid`` or ``dev`` on a stage or a
    publish (docs/desired-files.md: Mount options): the node's decision, never a file's.
    A mount at or under one of these roots may ask; elsewhere the loader
    refuses. Empty (the default): every mount is nosuid,nodev."""

    suid_roots: tuple[str, ...] = ()
    dev_roots: tuple[str, ...] = ()


@dataclass(frozen=True)
class Config:
    desired_dir: Path
    state_dir: Path
    node_name: str
    ceph: CephConfig
    allowed_roots: tuple[str, ...]
    mapper: str
    on_remove: str
    source: Path | None
    resync_seconds: float = 60.0
    mass_removal_share: float = 0.5
    parallel: int = 4
    # A pool, image or device probe that has not answered by then is unknown.
    observe_timeout_seconds: float = 5.0
    csi: CsiConfig = CsiConfig(None, None, DEFAULT_DRIVER_NAME, 120.0)
    metrics: MetricsConfig = MetricsConfig(None, None)
    clone: CloneConfig = CloneConfig()
    timeouts: TimeoutsConfig = TimeoutsConfig()
    snapshots: SnapshotsConfig = SnapshotsConfig()
    events: EventsConfig = EventsConfig()
    encryption: EncryptionConfig = EncryptionConfig()
    mount_privileges: MountPrivileges = MountPrivileges()
    # A git repository followed instead of desiredDir (docs/gitops-source.md);
    # desired_dir is then the symlink the source switches.
    git: SourceConfig | None = None
    # Where the daemon serves the command line (README: The command line
    # beside the daemon); the CLI finds the running daemon there.
    control_socket: Path = DEFAULT_CONTROL_SOCKET
    # rbd-nbd and rbd-fuse in systemd scopes of their own: auto | never
    # (drivers/scopes.py).
    helper_scopes: str = "auto"
    # An rbd-nbd whose binary a package upgrade replaced is replaced by one
    # of the new binary, one device at a time (docs/daemon.md).
    nbd_roll_upgrades: bool = True  # docs/daemon.md, rolled

    @property
    def source_dir(self) -> Path:
        """The source's mirror, revisions and state (reconciler/source/)."""
        return self.state_dir / "source"

    @property
    def staging_root(self) -> Path:
        return self.state_dir / "staging"

    @property
    def csi_dir(self) -> Path:
        """The CSI adapter's own volume files: never desiredDir (a git checkout)."""
        return self.csi.dir or self.state_dir / "csi.d"


class ConfigError(Exception):
    def __init__(self, diagnostics: list[Diagnostic]) -> None:
        super().__init__("\n".join(str(d) for d in diagnostics))
        self.diagnostics = diagnostics


def _build(data: dict, source: Path | None) -> Config:
    ceph = data.get("ceph", {})
    csi = data.get("csi", {})
    metrics = data.get("metrics", {})
    clone = data.get("clone", {})
    timeouts = data.get("timeouts", {})
    snapshots = data.get("snapshots", {})
    events = data.get("events", {})
    enc = data.get("encryption", {})
    privileges = data.get("mountPrivileges", {})
    state_dir = Path(data.get("stateDir", "/var/lib/rbd-reconciler"))
    git = build_source(data["source"]) if data.get("source") else None
    return Config(
        desired_dir=(state_dir / "source" / "current" if git else
                     Path(data.get("desiredDir", "/etc/rbd-reconciler/volumes.d"))),
        state_dir=state_dir,
        node_name=data.get("nodeName") or os.uname().nodename,
        ceph=CephConfig(
            conf=ceph.get("conf", "/etc/ceph/ceph.conf"),
            user=ceph.get("user", "admin"),
            keyring=ceph.get("keyring"),
        ),
        allowed_roots=tuple(data.get("allowedRoots", ["/srv", "/mnt"])),
        mapper=data.get("mapper", "auto"),
        on_remove=data.get("onRemove", "release"),
        source=source,
        resync_seconds=float(data.get("resyncSeconds", 60)),
        mass_removal_share=float(data.get("massRemovalShare", 0.5)),
        parallel=int(data.get("parallel", 4)),
        observe_timeout_seconds=float(data.get("observeTimeoutSeconds", 5)),
        csi=CsiConfig(
            endpoint=csi.get("endpoint"),
            dir=Path(csi["dir"]) if csi.get("dir") else None,
            driver_name=csi.get("driverName", DEFAULT_DRIVER_NAME),
            timeout_seconds=float(csi.get("timeoutSeconds", 120)),
            state_pool=csi.get("statePool"),
        ),
        metrics=MetricsConfig(
            listen=metrics.get("listen"),
            textfile=Path(metrics["textfile"]) if metrics.get("textfile") else None,
        ),
        clone=CloneConfig(max_depth=int(clone.get("maxDepth", 8)),
                          flatten=clone.get("flatten", "depth"),
                          flatten_on_delete=bool(clone.get("flattenOnDelete", False))),
        timeouts=TimeoutsConfig(
            command_seconds=float(timeouts.get("commandSeconds", 120)),
            mkfs_seconds=float(timeouts.get("mkfsSeconds", 600)),
            stop_seconds=float(timeouts.get("stopSeconds", 30)),
            stop_grace_seconds=float(timeouts.get("stopGraceSeconds", 5)),
        ),
        snapshots=SnapshotsConfig(
            freeze_timeout_seconds=float(snapshots.get("freezeTimeoutSeconds", 5))),
        events=EventsConfig(image_poll_seconds=float(events.get("imagePollSeconds", 0.5)),
                            claim_poll_seconds=float(events.get("claimPollSeconds", 0.5)),
                            io_poll_seconds=float(events.get("ioPollSeconds", 1)),
                            io_stall_seconds=float(events.get("ioStallSeconds", 10))),
        encryption=EncryptionConfig(
            key_root=enc.get("keyRoot", "/etc/rbd-reconciler/keys"),
            pbkdf=enc.get("pbkdf", "argon2id"),
            iter_time_ms=int(enc.get("iterTimeMs", 2000)),
            iterations=int(enc["iterations"]) if enc.get("iterations") is not None else None,
            memory_kib=int(enc["memoryKiB"]) if enc.get("memoryKiB") is not None else None,
            accept_unbound=bool(enc.get("acceptUnbound", True))),
        mount_privileges=MountPrivileges(
            suid_roots=tuple(privileges.get("suidRoots", ())),
            dev_roots=tuple(privileges.get("devRoots", ()))),
        git=git,
        control_socket=Path(data.get("controlSocket", str(DEFAULT_CONTROL_SOCKET))),
        helper_scopes=data.get("helperScopes", "auto"),
        nbd_roll_upgrades=bool(data.get("nbdRollUpgrades", True)),
    )


def default_config() -> Config:
    return _build({}, None)


def load_config(path: Path | None) -> Config:
    """Load and validate the node config.

    ``None`` means the default path, which may be missing (built-in defaults
    then apply); a path given explicitly must exist. Raises ConfigError with
    every problem found.
    """
    explicit = path is not None
    path = path or DEFAULT_CONFIG_PATH
    try:
        return _load_config(path, explicit)
    except ConfigError:
        raise
    except Exception as exc:
        # The last line of defence: a config's content never kills the daemon
        # (SIGHUP reload keeps the running config on a ConfigError).
        log.exception("%s: unexpected error while loading the config", path)
        raise ConfigError([Diagnostic(path, 1, 1, "(file)", f"cannot load this file (internal "
                                      f"error {type(exc).__name__}; please report it)")]) from None


def _unreadable(path: Path, why: str) -> ConfigError:
    return ConfigError([Diagnostic(path, 1, 1, "(file)", f"cannot read: {why}")])


def _load_config(path: Path, explicit: bool) -> Config:
    try:
        if path.stat().st_size > MAX_CONFIG_BYTES:
            raise ConfigError([Diagnostic(path, 1, 1, "(file)", "larger than 1 MiB")])
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        if explicit:
            raise ConfigError([Diagnostic(path, 1, 1, "(file)", "no such file")]) from None
        return default_config()
    except PermissionError:
        raise _unreadable(path, "permission denied (run as root, or make it readable)") from None
    except OSError as exc:
        raise _unreadable(path, excerpt(exc.strerror or str(exc), 200)) from None
    except UnicodeDecodeError as exc:
        raise _unreadable(path, f"not UTF-8 text (byte {exc.start})") from None
    docs = list(load_documents(text))
    diags: list[Diagnostic] = []
    for d in docs:
        if isinstance(d, YamlError):
            diags.append(Diagnostic(path, d.line, d.column, format_field(d.path), d.message))
    if diags:
        raise ConfigError(diags)
    if len(docs) > 1:
        raise ConfigError([Diagnostic(path, docs[1].line, 1, "(document)",
                                      "the config is one YAML document")])
    doc = docs[0] if docs else Document(data={}, line=1, column=1)
    if doc.data is None:
        doc.data = {}
    diags = [Diagnostic(path, *where, field, msg)
             for where, field, msg in schema_errors("config", doc)]
    for i, root in enumerate(doc.data.get("allowedRoots", []) if not diags else []):
        if os.path.normpath(root) != root or root == "/":
            line, col = doc.where(("allowedRoots", i))
            diags.append(Diagnostic(path, line, col, f"allowedRoots[{i}]",
                                    f"{excerpt(root)} must be a normalised absolute path "
                                    "other than /"))
    privileges = (doc.data.get("mountPrivileges") or {}) if not diags else {}
    for key in ("suidRoots", "devRoots"):
        for i, root in enumerate(privileges.get(key, ())):
            if os.path.normpath(root) != root or root == "/":
                line, col = doc.where(("mountPrivileges", key, i))
                diags.append(Diagnostic(path, line, col, f"mountPrivileges.{key}[{i}]",
                                        f"{excerpt(root)} must be a normalised absolute path "
                                        "other than / (a privilege for the whole node is "
                                        "never given)"))
    source = doc.data.get("source") if not diags else None
    if source is not None:
        for where, msg in source_problems(source):
            line, col = doc.where(("source", *where))
            diags.append(Diagnostic(path, line, col, format_field(("source", *where)), msg))
        if "desiredDir" in doc.data:
            line, col = doc.where(("desiredDir",))
            diags.append(Diagnostic(path, line, col, "desiredDir",
                                    "not with source: the daemon then reads the revision the "
                                    "source applied (<stateDir>/source/current)"))
    csi_dir = (doc.data.get("csi") or {}).get("dir") if not diags else None
    desired = os.path.normpath(doc.data.get("desiredDir", "/etc/rbd-reconciler/volumes.d"))
    if csi_dir and (os.path.normpath(csi_dir) + "/").startswith(desired + "/"):
        line, col = doc.where(("csi", "dir"))
        diags.append(Diagnostic(path, line, col, "csi.dir",
                                "must not be desiredDir or inside it (that one may be a git "
                                "checkout; the adapter writes its own files)"))
    listen = (doc.data.get("metrics") or {}).get("listen") if not diags else None
    if listen and not 0 < int(listen.rsplit(":", 1)[-1]) < 65536:
        line, col = doc.where(("metrics", "listen"))
        diags.append(Diagnostic(path, line, col, "metrics.listen", "the port must be 1-65535"))
    timeouts = (doc.data.get("timeouts") or {}) if not diags else {}
    stop, grace = timeouts.get("stopSeconds", 30), timeouts.get("stopGraceSeconds", 5)
    if grace + STOP_AFTER_GRACE_S > stop:
        key = "stopGraceSeconds" if "stopGraceSeconds" in timeouts else "stopSeconds"
        line, col = doc.where(("timeouts", key))
        diags.append(Diagnostic(path, line, col, f"timeouts.{key}",
                                f"stopGraceSeconds ({grace:g}) must end at least "
                                f"{STOP_AFTER_GRACE_S:g} s before stopSeconds ({stop:g}): "
                                "the stop kills what still runs then, and waits for it"))
    if diags:
        raise ConfigError(diags)
    return _build(doc.data, path)
