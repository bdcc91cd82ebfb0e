"""Every kind of bad input gives the expected field path and line, and no volumes."""

from __future__ import annotations

from pathlib import Path

import pytest

from reconciler.spec.config import default_config
from reconciler.spec.loader import load

GOOD = """\
apiVersion: rbd-reconciler/v1
kind: Volume
metadata:
  name: vol
spec:
  image:
    pool: rbd
    size: 1Gi
  map: {}
  stage:
    fsType: ext4
  publish:
    - path: /srv/vol
"""


def with_lines(replace: dict[str, str]) -> str:
    text = GOOD
    for old, new in replace.items():
        assert old in text, old
        text = text.replace(old, new)
    return text


# (id, file text, expected field, expected line, a word the message must contain)
CASES: list[tuple[str, str, str, int, str]] = [
    ("size-GB", with_lines({"size: 1Gi": "size: 10GB"}), "spec.image.size", 8, "Ki, Mi"),
    ("size-negative", with_lines({"size: 1Gi": "size: -1"}), "spec.image.size", 8, "-1"),
    ("size-fraction", with_lines({"size: 1Gi": "size: 1.5Gi"}), "spec.image.size", 8, "1.5Gi"),
    ("size-zero", with_lines({"size: 1Gi": "size: 0"}), "spec.image.size", 8, "valid"),
    ("size-float", with_lines({"size: 1Gi": "size: 1.5"}), "spec.image.size", 8, "valid"),
    ("size-tiny", with_lines({"size: 1Gi": "size: 4Ki"}), "spec.image.size", 8, "1Mi"),
    ("size-bool", with_lines({"size: 1Gi": "size: true"}), "spec.image.size", 8, "True"),
    ("name-upper", with_lines({"name: vol": "name: Vol"}), "metadata.name", 4, "DNS label"),
    ("name-underscore", with_lines({"name: vol": "name: my_vol"}), "metadata.name", 4, "DNS"),
    ("name-long", with_lines({"name: vol": "name: " + "a" * 64}), "metadata.name", 4, "DNS"),
    ("name-int", with_lines({"name: vol": "name: 5"}), "metadata.name", 4, "string"),
    ("name-missing", with_lines({"  name: vol\n": "  labels: {}\n"}), "metadata.name", 3,
     "required"),
    ("unknown-top", GOOD + "extra: 1\n", "extra", 14, "unknown field"),
    ("unknown-image-key", with_lines({"    pool: rbd": "    pool: rbd\n    sise: 1Gi"}),
     "spec.image.sise", 8, "unknown field"),
    ("wrong-apiversion", with_lines({"rbd-reconciler/v1": "v1"}), "apiVersion", 1,
     "rbd-reconciler/v1"),
    ("wrong-kind", with_lines({"kind: Volume": "kind: Pod"}), "kind", 2, "Volume"),
    ("state-bad", with_lines({"spec:\n": "spec:\n  state: gone\n"}), "spec.state", 6, "gone"),
    ("publish-relative", with_lines({"path: /srv/vol": "path: srv/vol"}),
     "spec.publish[0].path", 13, "absolute"),
    ("publish-unnormalised", with_lines({"path: /srv/vol": "path: /srv/x/../vol"}),
     "spec.publish[0].path", 13, "normalised"),
    ("publish-outside-roots", with_lines({"path: /srv/vol": "path: /etc/vol"}),
     "spec.publish[0].path", 13, "allowed root"),
    ("publish-readonly-type",
     with_lines({"path: /srv/vol": "path: /srv/vol\n      readOnly: yes please"}),
     "spec.publish[0].readOnly", 14, "boolean"),
    ("publish-twice", with_lines({"path: /srv/vol": "path: /srv/vol\n    - path: /srv/vol"}),
     "spec.publish[1].path", 14, "twice"),
    ("stage-without-map", with_lines({"  map: {}\n": ""}), "spec.stage", 9, "map"),
    ("publish-without-stage", with_lines({"  stage:\n    fsType: ext4\n": ""}),
     "spec.publish", 10, "stage"),
    ("xfs-too-small", with_lines({"size: 1Gi": "size: 200Mi", "ext4": "xfs"}),
     "spec.image.size", 8, "300Mi"),
    ("block-with-fstype", with_lines({"fsType: ext4": "mode: block\n    fsType: ext4"}),
     "spec.stage.fsType", 12, "no fsType"),
    ("fstype-unknown", with_lines({"fsType: ext4": "fsType: btrfs"}), "spec.stage.fsType", 11,
     "btrfs"),
    ("mapper-unknown", with_lines({"map: {}": "map: {mapper: iscsi}"}), "spec.map.mapper", 9,
     "iscsi"),
    ("feature-needs", with_lines({"size: 1Gi": "size: 1Gi\n    features: [layering, fast-diff]"}),
     "spec.image.features", 9, "object-map"),
    ("mount-option-comma", with_lines({"fsType: ext4": "fsType: ext4\n    mountOptions: ['a,b']"}),
     "spec.stage.mountOptions[0]", 12, "does not match"),
    ("yaml-syntax", with_lines({"  map: {}": "  map: {"}), "(document)", 11, "YAML syntax"),
    ("yaml-tab-indent", with_lines({"    pool: rbd": "\tpool: rbd"}), "(document)", 7, "YAML"),
    ("duplicate-key", with_lines({"    pool: rbd": "    pool: rbd\n    pool: ssd"}),
     "spec.image.pool", 8, "duplicate key"),
    ("non-mapping-document", "- just\n- a list\n", "(document)", 1, "object"),
    ("scalar-document", "hello\n", "(document)", 1, "object"),
    ("empty-file", "", "(file)", 1, "no Volume documents"),
    ("comments-only", "# nothing here\n---\n", "(file)", 1, "no Volume documents"),
    ("timestamp-value", with_lines({"name: vol": "name: 2024-01-01"}), "metadata.name", 4,
     "quote it"),
    ("not-utf8", "apiVersion: x\nkind: \xff\n", "(file)", 2, "UTF-8"),
    ("second-doc-bad", GOOD + "---\n" + with_lines({"name: vol": "name: vol2",
                                                     "/srv/vol": "/srv/vol2",
                                                     "size: 1Gi": "size: lots"}),
     "spec.image.size", 22, "lots"),
    ("encryption-no-map", with_lines({"  map: {}\n  stage:\n    fsType: ext4\n  publish:\n"
                                      "    - path: /srv/vol\n": "  encryption: {type: luks2, "
                                      "key: {file: /etc/rbd-reconciler/keys/k}}\n"}),
     "spec.encryption", 9, "needs a map"),
    ("encryption-key-outside-root", with_lines({"  map: {}\n": "  map: {}\n  encryption: "
                                                "{type: luks2, key: {file: /root/k}}\n"}),
     "spec.encryption.key.file", 10, "not under the key root"),
    ("encryption-key-dotdot", with_lines({"  map: {}\n": "  map: {}\n  encryption: {type: "
                                          "luks2, key: {wrappedBy: /etc/rbd-reconciler/keys/"
                                          "../k}}\n"}),
     "spec.encryption.key.wrappedBy", 10, "not a clean absolute path"),
    ("encryption-two-keys", with_lines({"  map: {}\n": "  map: {}\n  encryption: {type: luks2, "
                                        "key: {file: /etc/rbd-reconciler/keys/a, wrappedBy: "
                                        "/etc/rbd-reconciler/keys/b}}\n"}),
     "spec.encryption.key", 10, "more than 1"),
    ("encryption-luks1", with_lines({"  map: {}\n": "  map: {}\n  encryption: {type: luks1, "
                                     "key: {file: /etc/rbd-reconciler/keys/a}}\n"}),
     "spec.encryption.type", 10, "luks2"),
    ("qos-unknown", with_lines({"  map: {}\n": "  map: {}\n  qos: {iopz: 5}\n"}),
     "spec.qos.iopz", 10, "unknown field"),
    ("qos-zero", with_lines({"  map: {}\n": "  map: {}\n  qos: {readIops: 0}\n"}),
     "spec.qos.readIops", 10, "0"),
    ("qos-bps-GB", with_lines({"  map: {}\n": "  map: {}\n  qos: {bps: 10GB}\n"}),
     "spec.qos.bps", 10, "10GB"),
    ("qos-max-alone", with_lines({"  map: {}\n": "  map: {}\n  qos: {maxIops: 50}\n"}),
     "spec.qos.maxIops", 10, "iopsPerGiB"),
    ("qos-unit-not-a-unit", with_lines({"  map: {}\n": "  map: {}\n  qos: {unit: ../x}\n"}),
     "spec.qos.unit", 10, "../x"),
    # A leading "-" (other than the root slice -.slice) is an option to systemctl.
    ("qos-unit-an-option", with_lines({"  map: {}\n": "  map: {}\n  qos: {unit: "
                                       "'-Hnobody@host.service'}\n"}),
     "spec.qos.unit", 10, "-Hnobody"),
    # librbd holds a limit as an int64: more is refused at its line, before
    # anything is set (issue 24: a half-applied change).
    ("qos-bps-beyond-librbd", with_lines({"  map: {}\n": "  map: {}\n  qos:\n    iops: 100\n"
                                                         "    bps: 18446744073709551615\n"}),
     "spec.qos.bps", 12, "librbd"),
    ("qos-per-gib-scaled-beyond-librbd",
     with_lines({"size: 1Gi": "size: 8Gi", "  map: {}\n": "  map: {}\n  qos:\n"
                 "    bpsPerGiB: 4611686018427387904\n"}),
     "spec.qos.bpsPerGiB", 11, "librbd"),
]


@pytest.mark.parametrize(("text", "field", "line", "word"),
                         [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_invalid_document(tmp_path: Path, text: str, field: str, line: int, word: str) -> None:
    f = tmp_path / "v.yaml"
    f.write_bytes(text.encode("latin-1") if "\xff" in text else text.encode())
    result = load([tmp_path], default_config())
    assert not result.ok
    assert result.volumes == ()  # a file with an error contributes no volumes
    assert f in result.failed_files
    hits = [d for d in result.diagnostics if d.field == field]
    assert hits, [str(d) for d in result.diagnostics]
    assert hits[0].line == line, str(hits[0])
    assert word in hits[0].message, str(hits[0])
    assert str(hits[0]).startswith(f"{f}:{line}:")


def test_at_least_25_cases() -> None:
    assert len(CASES) >= 25


def test_huge_file_refused_without_reading(tmp_path: Path) -> None:
    f = tmp_path / "big.yaml"
    f.write_text(GOOD + "# " + "x" * (10 * 2**20) + "\n")
    result = load([tmp_path], default_config())
    [d] = result.diagnostics
    assert (d.field, d.line) == ("(file)", 1)
    assert "limit" in d.message


def test_duplicate_names_across_files_fail_both(tmp_path: Path) -> None:
    (tmp_path / "a.yaml").write_text(GOOD)
    (tmp_path / "b.yaml").write_text(with_lines({"/srv/vol": "/srv/other"}))
    result = load([tmp_path], default_config())
    assert result.volumes == ()
    fields = sorted((d.file.name, d.field, d.line) for d in result.diagnostics)
    assert ("a.yaml", "metadata.name", 4) in fields
    assert ("b.yaml", "metadata.name", 4) in fields
    assert any("already claimed at" in d.message and str(tmp_path / "a.yaml") in d.message
               for d in result.diagnostics)
    assert result.frozen_names == {"vol"}


def test_duplicate_publish_path_and_image_across_files(tmp_path: Path) -> None:
    (tmp_path / "a.yaml").write_text(GOOD)
    (tmp_path / "b.yaml").write_text(
        with_lines({"name: vol": "name: other", "pool: rbd": "pool: rbd\n    name: vol"}))
    result = load([tmp_path], default_config())
    fields = {(d.file.name, d.field, d.line) for d in result.diagnostics}
    assert ("b.yaml", "spec.publish[0].path", 14) in fields
    assert ("b.yaml", "spec.image", 6) in fields
    assert ("a.yaml", "spec.image", 6) in fields
    assert result.frozen_names == {"vol", "other"}


def test_bad_file_does_not_hide_good_file(tmp_path: Path) -> None:
    (tmp_path / "good.yaml").write_text(GOOD)
    (tmp_path / "bad.yaml").write_text("a: [\n")
    result = load([tmp_path], default_config())
    assert [v.name for v in result.volumes] == ["vol"]
    assert result.failed_files == {tmp_path / "bad.yaml"}


def test_editor_and_temp_files_are_ignored(tmp_path: Path) -> None:
    (tmp_path / "good.yaml").write_text(GOOD)
    for junk in (".good.yaml.swp", "good.yaml~", ".hidden.yaml", "x.tmp", "#good.yaml#",
                 "notes.txt"):
        (tmp_path / junk).write_text("garbage: [")
    result = load([tmp_path], default_config())
    assert result.ok, [str(d) for d in result.diagnostics]
    assert [f.name for f in result.files] == ["good.yaml"]


def test_missing_path_is_an_error(tmp_path: Path) -> None:
    result = load([tmp_path / "nope"], default_config())
    [d] = result.diagnostics
    assert d.field == "(file)" and "no such file" in d.message
