"""Examples validate; defaults are filled; the CLI speaks as documented."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from reconciler.cli.main import main
from reconciler.spec.config import ConfigError, default_config, load_config
from reconciler.spec.loader import load
from reconciler.spec.model import DEFAULT_FEATURES, Phase
from reconciler.spec.units import format_size, parse_size

ROOT = Path(__file__).resolve().parents[3]
EXAMPLES = ROOT / "examples"


def test_every_example_is_valid() -> None:
    result = load([EXAMPLES], default_config())
    assert result.ok, "\n".join(map(str, result.diagnostics))
    phases = {v.name: v.wanted_phase for v in result.volumes}
    # The examples cover each shape the README promises.
    assert phases["pgdata"] is Phase.PUBLISHED
    assert phases["metrics"] is Phase.PUBLISHED
    assert phases["scratch"] is Phase.PUBLISHED
    assert phases["archive"] is Phase.CREATED
    assert phases["old-cache"] is Phase.ABSENT
    by = {v.name: v for v in result.volumes}
    assert [p.read_only for p in by["pgdata"].publish] == [False, True]
    assert by["metrics"].stage.fs_type == "xfs"
    assert by["scratch"].stage.mode == "block" and by["scratch"].stage.fs_type is None


def test_snapshot_example_resolves_its_sources() -> None:
    result = load([EXAMPLES / "snapshots"], default_config())
    assert result.ok, "\n".join(map(str, result.diagnostics))
    by = {v.name: v for v in result.volumes}
    assert by["golden-v1"].kind == "Snapshot" and by["golden-v1"].image.spec == "rbd/golden"
    assert by["test-env"].image.source.spec == "rbd/golden@golden-v1"
    assert by["golden-copy"].image.source.spec == "rbd/golden"  # through a temporary one


@pytest.mark.parametrize("path", sorted((EXAMPLES / "config").glob("*.yaml")), ids=str)
def test_example_configs_are_valid(path: Path) -> None:
    config = load_config(path)
    assert config.source == path


def test_defaults_are_filled(tmp_path: Path) -> None:
    (tmp_path / "v.yaml").write_text(
        "apiVersion: rbd-reconciler/v1\nkind: Volume\nmetadata: {name: v}\n"
        "spec:\n  image: {pool: rbd, size: 2Gi}\n  map: {}\n  stage: {}\n"
    )
    [v] = load([tmp_path], default_config()).volumes
    assert v.state == "present"
    assert v.image.name == "v" and v.image.size == 2 * 2**30
    assert v.image.features == DEFAULT_FEATURES and v.image.reclaim_policy == "Retain"
    assert v.map.mapper == "auto"
    assert v.stage.mode == "filesystem" and v.stage.fs_type == "ext4"
    assert v.stage.path == "/var/lib/rbd-reconciler/staging/v"
    assert v.wanted_phase is Phase.STAGED
    assert v.on_remove is None


def test_spec_hash_ignores_source_and_tracks_content(tmp_path: Path) -> None:
    body = ("apiVersion: rbd-reconciler/v1\nkind: Volume\nmetadata: {name: v}\n"
            "spec:\n  image: {pool: rbd, size: SIZE}\n")
    (tmp_path / "a.yaml").write_text(body.replace("SIZE", "1Gi"))
    a = load([tmp_path / "a.yaml"], default_config()).volumes[0]
    (tmp_path / "b.yaml").write_text("# moved\n" + body.replace("SIZE", "1073741824"))
    b = load([tmp_path / "b.yaml"], default_config()).volumes[0]
    (tmp_path / "c.yaml").write_text(body.replace("SIZE", "2Gi"))
    c = load([tmp_path / "c.yaml"], default_config()).volumes[0]
    assert a.spec_hash == b.spec_hash != c.spec_hash


@pytest.mark.parametrize(("text", "size"), [
    ("1", 1), (1024, 1024), ("1Ki", 1024), ("10Gi", 10 * 2**30), ("10G", 10**10),
    ("3Ti", 3 * 2**40), ("512Mi", 512 * 2**20), ("7K", 7000),
])
def test_parse_size(text: str | int, size: int) -> None:
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["10GB", "-1", "1.5Gi", "0", "", "Gi", "1 Gi", "01Gi", True])
def test_parse_size_rejects(text: str | bool) -> None:
    with pytest.raises(ValueError):
        parse_size(text)


def test_format_size_round_trips() -> None:
    for n in (1, 1024, 512 * 2**20, 3 * 2**30 + 2**20, 10**10):
        assert parse_size(format_size(n)) == n


def test_config_errors_name_file_line_field(tmp_path: Path) -> None:
    f = tmp_path / "config.yaml"
    f.write_text("desiredDir: /etc/x\nstateDir: relative\nceph:\n  conf: /c\n  bogus: 1\n")
    with pytest.raises(ConfigError) as exc:
        load_config(f)
    got = sorted((d.line, d.field) for d in exc.value.diagnostics)
    assert got == [(2, "stateDir"), (5, "ceph.bogus")]


def test_explicit_missing_config_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no such file"):
        load_config(tmp_path / "absent.yaml")


def test_cli_validate_examples_exit_0(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["validate", str(EXAMPLES)]) == 0


def test_cli_validate_broken_exit_1(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "bad.yaml").write_text(
        "apiVersion: rbd-reconciler/v1\nkind: Volume\nmetadata: {name: v}\n"
        "spec:\n  image:\n    pool: rbd\n    size: 10GB\n")
    assert main(["validate", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert out.startswith(f"{tmp_path / 'bad.yaml'}:7:11: spec.image.size: '10GB' is not valid")


def test_cli_validate_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "bad.yaml").write_text("kind: [")
    assert main(["validate", "-o", "json", str(tmp_path)]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert doc["valid"] is False
    [err] = doc["errors"]
    assert err["line"] == 1 and err["field"] == "(document)" and err["file"].endswith("bad.yaml")


def test_cli_bad_config_exit_1(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "c.yaml").write_text("mapper: iscsi\n")
    assert main(["--config", str(tmp_path / "c.yaml"), "validate", str(EXAMPLES)]) == 1
    assert "c.yaml:1:9: mapper:" in capsys.readouterr().err


@pytest.mark.parametrize("args", [["--help"], ["validate", "--help"], ["--version"]])
def test_cli_help_and_version(args: list[str]) -> None:
    proc = subprocess.run([sys.executable, "-m", "reconciler", *args],
                          capture_output=True, text=True, check=False)
    assert proc.returncode == 0
    assert "rbd-reconciler" in proc.stdout


@pytest.mark.parametrize("name", ["volume", "snapshot", "config"])
def test_schemas_are_valid_draft_2020_12(name: str) -> None:
    import jsonschema

    from reconciler.spec.schemas import validator

    jsonschema.Draft202012Validator.check_schema(validator(name).schema)


def test_encryption_example_loads() -> None:
    result = load([EXAMPLES / "encryption"], default_config())
    assert result.ok, "\n".join(map(str, result.diagnostics))
    by = {v.name: v for v in result.volumes}
    assert by["vault"].encryption is not None
    assert (by["vault"].encryption.key_kind, by["ledger"].encryption.key_kind) == (
        "wrappedBy", "file")


def test_group_snapshot_example_resolves_its_members() -> None:
    result = load([EXAMPLES / "snapshots"], default_config())
    assert result.ok, "\n".join(map(str, result.diagnostics))
    group = {v.name: v for v in result.volumes}["db-nightly"]
    assert group.kind == "SnapshotGroup" and group.group is not None
    assert group.group.members == (("rbd", "db-data"), ("rbd", "db-wal"))
    src = {v.name: v for v in result.volumes}["db-data-restored"].image.source
    assert src is not None and (src.kind, src.ref, src.group) == ("group", "db-nightly",
                                                                  "db-nightly")



def test_a_restore_has_one_spec_hash_with_or_without_its_group_loaded(tmp_path: Path) -> None:
    """The CSI adapter checks one file alone, the daemon loads every file: the
    digest it waits for (observedGeneration) must be the same in both."""
    import yaml

    docs = list(yaml.safe_load_all((EXAMPLES / "snapshots" / "db-nightly.yaml").read_text()))
    restore = next(d for d in docs if d["metadata"]["name"] == "db-data-restored")
    alone = tmp_path / "alone"
    alone.mkdir()
    (alone / "restore.yaml").write_text(yaml.safe_dump(restore))
    [one] = load([alone], default_config()).volumes
    every = {v.name: v for v in load([EXAMPLES / "snapshots"], default_config()).volumes}
    assert one.image.source is not None and one.image.source.ref != "db-nightly"
    assert one.spec_hash == every["db-data-restored"].spec_hash


def test_qos_example_loads_with_its_limits() -> None:
    from reconciler.spec import qos

    result = load([EXAMPLES / "qos"], default_config())
    assert result.ok, "\n".join(map(str, result.diagnostics))
    by = {v.name: v for v in result.volumes}
    db, wal = by["tenant-db"], by["tenant-wal"]
    assert db.qos is not None and wal.qos is not None
    assert qos.librbd_meta(db.qos, db.image.size) == {
        "conf_rbd_qos_read_iops_limit": "2000", "conf_rbd_qos_write_iops_limit": "1000",
        "conf_rbd_qos_write_bps_limit": str(100 << 20)}
    assert wal.qos.unit == "tenant.slice"
    assert qos.io_max(wal.qos, wal.image.size) == {
        "riops": 2000, "wiops": 2000, "rbps": 200 << 20, "wbps": 200 << 20}


def test_the_claim_poll_key(tmp_path: Path) -> None:
    """events.claimPollSeconds: a volume waiting on another node's claim."""
    assert default_config().events.claim_poll_seconds == 0.5
    cfg = tmp_path / "c.yaml"
    cfg.write_text("events:\n  claimPollSeconds: 0\n")
    assert load_config(cfg).events.claim_poll_seconds == 0.0
    for bad in ("claimPollSeconds: -1", "claimPollSeconds: soon"):
        cfg.write_text(f"events:\n  {bad}\n")
        with pytest.raises(ConfigError):
            load_config(cfg)


def test_the_io_watch_keys(tmp_path: Path) -> None:
    """events.ioPollSeconds and ioStallSeconds (When Ceph is unreachable)."""
    assert (default_config().events.io_poll_seconds,
            default_config().events.io_stall_seconds) == (1.0, 10.0)
    cfg = tmp_path / "c.yaml"
    cfg.write_text("events:\n  ioPollSeconds: 0\n  ioStallSeconds: 2.5\n")
    c = load_config(cfg)
    assert (c.events.io_poll_seconds, c.events.io_stall_seconds) == (0.0, 2.5)
    for bad in ("ioStallSeconds: 0", "ioPollSeconds: -1", "ioStallSeconds: soon"):
        cfg.write_text(f"events:\n  {bad}\n")
        with pytest.raises(ConfigError):
            load_config(cfg)
