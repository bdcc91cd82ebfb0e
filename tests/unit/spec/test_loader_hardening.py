"""Issue 7, hardening: hostile desired-volume and config files.

Each test names the input that used to crash, hang, leak or pass, and
asserts the specific error that replaces it.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from conftest import NodeUnderTest
from test_spec_invalid import GOOD  # the same valid document, varied per test

from reconciler.spec.config import ConfigError, default_config, load_config
from reconciler.spec.loader import load
from reconciler.spec.yamldoc import MAX_NODES


def edit(text: str, replace: dict[str, str]) -> str:
    for old, new in replace.items():
        assert old in text, old
        text = text.replace(old, new)
    return text


def only_error(tmp_path: Path, text: str) -> tuple[str, int, str]:
    """Load ``text`` as the only file; return its one (field, line, message)."""
    (tmp_path / "v.yaml").write_text(text, encoding="utf-8")
    result = load([tmp_path], default_config())
    assert result.volumes == ()
    assert len(result.diagnostics) == 1, [str(d) for d in result.diagnostics]
    d = result.diagnostics[0]
    return d.field, d.line, d.message


# --- item 9: inputs that crashed the loader -------------------------------------

def test_float_size_is_an_error_not_a_crash(tmp_path: Path) -> None:
    # jsonschema counts 1048576.0 as an integer; parse_size then raised TypeError.
    field, line, msg = only_error(tmp_path, edit(GOOD, {"size: 1Gi": "size: 1048576.0"}))
    assert (field, line) == ("spec.image.size", 8)
    assert "1048576.0 is not valid: expected bytes as an integer (not a float)" in msg


def test_bad_explicit_timestamp_is_an_error_not_a_crash(tmp_path: Path) -> None:
    # PyYAML's timestamp constructor raised AttributeError on this.
    field, line, msg = only_error(
        tmp_path, edit(GOOD, {"kind: Volume": "kind: !!timestamp 2020-01-01x"}))
    assert (field, line) == ("kind", 2)
    assert "invalid value '2020-01-01x' for tag" in msg


@pytest.mark.parametrize("value", ["!!int 0x", "!!float x", "!!timestamp 2020-13-45",
                                   "!!bool maybe"])
def test_bad_explicit_tags_are_errors(tmp_path: Path, value: str) -> None:
    field, line, msg = only_error(tmp_path, edit(GOOD, {"pool: rbd": f"pool: {value}"}))
    assert (field, line) == ("spec.image.pool", 7)
    assert "invalid value" in msg


def test_an_unexpected_exception_fails_only_its_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The catch-all: whatever a file's content triggers, the caller (the
    # daemon) gets a diagnostic for that file, and the other files load.
    import reconciler.spec.loader as loader_mod

    (tmp_path / "good.yaml").write_text(GOOD)
    (tmp_path / "evil.yaml").write_text(edit(GOOD, {"name: vol": "name: evil",
                                                    "/srv/vol": "/srv/evil"}))
    real = loader_mod._load_file

    def explode(path: Path, config: object, *rest: object) -> object:
        if path.name == "evil.yaml":
            raise KeyError("boom")
        return real(path, config, *rest)  # type: ignore[arg-type]

    monkeypatch.setattr(loader_mod, "_load_file", explode)
    result = load([tmp_path], default_config())
    assert [v.name for v in result.volumes] == ["vol"]
    [d] = result.diagnostics
    assert d.file.name == "evil.yaml" and d.field == "(file)"
    assert "internal error KeyError" in d.message


def test_daemon_style_load_never_raises_on_many_hostile_files(tmp_path: Path) -> None:
    hostile = {
        "float.yaml": edit(GOOD, {"size: 1Gi": "size: 1048576.0"}),
        "ts.yaml": edit(GOOD, {"kind: Volume": "kind: !!timestamp 2020-01-01x"}),
        "digits.yaml": edit(GOOD, {"size: 1Gi": "size: '" + "9" * 5000 + "'"}),
        "bigint.yaml": edit(GOOD, {"size: 1Gi": "size: " + "9" * 4000}),
        "merge.yaml": "a: &a {<<: *a}\n",
    }
    for name, text in hostile.items():
        (tmp_path / name).write_text(text)
    result = load([tmp_path], default_config())
    assert result.volumes == ()
    assert {d.file.name for d in result.diagnostics} == set(hostile)


@pytest.mark.parametrize("text", [
    "parallel: 4.0\n",
    "nodeName: !!timestamp 2020-01-01x\n",
    "resyncSeconds: !!float x\n",
    "stateDir: \"/var/lib/x\\0y\"\n",
    "resyncSeconds: .nan\n",  # passed every bound: the daemon loop spun
    "massRemovalShare: -.inf\n",
])
def test_config_hostile_inputs_are_config_errors(tmp_path: Path, text: str) -> None:
    f = tmp_path / "config.yaml"
    f.write_text(text)
    with pytest.raises(ConfigError) as exc:
        load_config(f)
    [d] = exc.value.diagnostics
    assert d.file == f and d.line == 1


# --- item 10: alias expansion -----------------------------------------------------

# The classic "billion laughs": 9^9 strings from a few hundred bytes.
BILLION_LAUGHS = """\
a: &a ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]
b: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a]
c: &c [*b, *b, *b, *b, *b, *b, *b, *b, *b]
d: &d [*c, *c, *c, *c, *c, *c, *c, *c, *c]
e: &e [*d, *d, *d, *d, *d, *d, *d, *d, *d]
f: &f [*e, *e, *e, *e, *e, *e, *e, *e, *e]
g: &g [*f, *f, *f, *f, *f, *f, *f, *f, *f]
h: &h [*g, *g, *g, *g, *g, *g, *g, *g, *g]
i: &i [*h, *h, *h, *h, *h, *h, *h, *h, *h]
"""

# Merges of merges: each level doubles the merged list PyYAML would build.
MERGE_BOMB = "<<: [" + ", ".join(
    ["&l0 {k: v}"] + [f"&l{i} {{<<: [*l{i - 1}, *l{i - 1}]}}" for i in range(1, 40)]) + "]\n"


@pytest.mark.parametrize("bomb", [BILLION_LAUGHS, MERGE_BOMB], ids=["aliases", "merges"])
def test_alias_bomb_fails_fast(tmp_path: Path, bomb: str) -> None:
    assert len(bomb.encode()) < 1000
    (tmp_path / "bomb.yaml").write_text(bomb)
    # In a child with a timeout: before the limit this ran for minutes and GBs.
    proc = subprocess.run(
        [sys.executable, "-m", "reconciler", "validate", str(tmp_path)],
        capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 1
    [line] = proc.stdout.splitlines()
    assert line.startswith(f"{tmp_path / 'bomb.yaml'}:1:")
    assert line.endswith(f": (document): more than {MAX_NODES} YAML nodes (alias expansion?)")


def test_aliases_within_the_limit_still_work(tmp_path: Path) -> None:
    (tmp_path / "v.yaml").write_text(edit(GOOD, {
        "fsType: ext4": "fsType: ext4\n    mountOptions: &opts [noatime]",
        "    - path: /srv/vol": "    - path: /srv/vol\n      mountOptions: *opts"}))
    result = load([tmp_path], default_config())
    assert result.ok, [str(d) for d in result.diagnostics]
    assert result.volumes[0].stage.mount_options == ("noatime",)


# --- item 18a: control characters, bidi overrides, huge sizes ------------------------

@pytest.mark.parametrize(("where", "value", "code"), [
    ("/srv/vol", '"/srv/v\\0ol"', "U+0000"),
    ("/srv/vol", '"/srv/v\\nol"', "U+000A"),
    ("/srv/vol", '"/srv/v\\e[31mol"', "U+001B"),
    ("/srv/vol", '"/srv/\\u202Elov"', "U+202E"),
    ("/srv/vol", '"/srv/\\u2066vol"', "U+2066"),
    ("/srv/vol", '"/srv/\\u200Fvol"', "U+200F"),
    ("/srv/vol", "/srv/\u202dvol", "U+202D"),  # written raw, not escaped
    ("name: vol", 'name: "vol\\n"', "U+000A"),
])
def test_control_and_bidi_characters_are_refused(
        tmp_path: Path, where: str, value: str, code: str) -> None:
    field, line, msg = only_error(tmp_path, edit(GOOD, {where: value}))
    assert line in (4, 13)
    assert field in ("metadata.name", "spec.publish[0].path")
    assert code in msg and "control or bidi character" in msg
    assert "\u202e" not in msg and "\x00" not in msg  # shown escaped


def test_control_characters_in_config_paths_are_refused(tmp_path: Path) -> None:
    f = tmp_path / "config.yaml"
    f.write_text('allowedRoots: [/srv, "/mnt/\\u202Ex"]\n')
    with pytest.raises(ConfigError) as exc:
        load_config(f)
    [d] = exc.value.diagnostics
    assert d.field == "allowedRoots[1]" and "U+202E" in d.message


@pytest.mark.parametrize(("size", "word"), [
    ("18446744073709551616", "less than 2^64 bytes"),          # 2^64 as an integer
    ("'16777216Ti'", "less than 2^64 bytes"),       # 2^64 with a suffix
    ("'99999999999999999999Ti'", "less than 2^64 bytes"),
    ("'999999999999999999999'", "at most 20 digits"),
    ("'1025Ti'", "object map"),                     # over 256,000,000 x 4 MiB
])
def test_sizes_beyond_what_rbd_takes_are_refused(tmp_path: Path, size: str, word: str) -> None:
    field, line, msg = only_error(tmp_path, edit(GOOD, {"size: 1Gi": f"size: {size}"}))
    assert (field, line) == ("spec.image.size", 8)
    assert word in msg, msg


def test_big_size_without_object_map_is_fine(tmp_path: Path) -> None:
    (tmp_path / "v.yaml").write_text(
        edit(GOOD, {"size: 1Gi": "size: 2000Ti\n    features: [layering]"}))
    [v] = load([tmp_path], default_config()).volumes
    assert v.image.size == 2000 * 2**40


# --- item 7: messages quote an excerpt, never the whole value -------------------------

def test_a_huge_value_is_quoted_as_a_short_escaped_excerpt(tmp_path: Path) -> None:
    secret = "S3CR3T" * 5000
    field, _, msg = only_error(tmp_path, edit(GOOD, {"name: vol": f"name: X{secret}"}))
    assert field == "metadata.name"
    assert secret not in msg and len(msg) < 400
    assert "'XS3CR3TS3CR3T" in msg and "…" in msg


def test_a_document_that_is_one_long_string_is_not_echoed(tmp_path: Path) -> None:
    key = ("-----BEGIN OPENSSH PRIVATE KEY----- "
           + "b3BlbnNzaC1rZXktdjEAAAAABG5vbmUAAAAEbm9uZQAAAAAAAAABAAAAMwAAAAtzc2gtZW" * 20
           + " -----END OPENSSH PRIVATE KEY-----")
    field, _, msg = only_error(tmp_path, key + "\n")
    assert field == "(document)"
    assert "b3BlbnNzaC1yZXktdjEAAAAABG5vbmUAAAAEbm9uZQAAAAAAAAABAAAAMwAAAAtzc2gtZW" not in msg
    assert len(msg) < 200


def test_an_unknown_field_with_a_weird_key_is_escaped(tmp_path: Path) -> None:
    (tmp_path / "v.yaml").write_text(GOOD + '"\\e[2J' + "k" * 500 + '": 1\n')
    result = load([tmp_path], default_config())
    [d] = result.diagnostics
    assert "\x1b" not in str(d) and "k" * 100 not in str(d)


# --- item 6: mkfsOptions may shape our filesystem, never reach another device --------

@pytest.mark.parametrize(("fs", "options", "index", "word"), [
    ("xfs", ["-l", "logdev=/dev/sda"], 1, "'logdev' is not allowed"),
    ("xfs", ["-l", "size=64m,logdev=/dev/sda"], 1, "'logdev' is not allowed"),
    ("xfs", ["-r", "rtdev=/dev/sdb"], 0, "'-r' is not an allowed mkfs.xfs option"),
    ("xfs", ["-d", "file=1,name=/etc/passwd"], 1, "'file' is not allowed"),
    ("xfs", ["-d", "name=/dev/sda"], 1, "'name' is not allowed"),
    ("xfs", ["-l", "internal=0"], 1, "internal= needs a valid value"),
    ("xfs", ["-f"], 0, "'-f' is not an allowed"),
    ("xfs", ["-N"], 0, "'-N' is not an allowed"),
    ("xfs", ["-p", "/etc/protofile"], 0, "'-p' is not an allowed"),
    ("ext4", ["-J", "device=/dev/sdb"], 1, "'device' is not allowed"),
    ("ext4", ["-J", "size=64,device=UUID=x"], 1, "'device' is not allowed"),
    ("ext4", ["-O", "journal_dev"], 1, "not a valid value for -O"),
    ("ext4", ["-d", "/root"], 0, "'-d' is not an allowed mkfs.ext4 option"),
    ("ext4", ["-l", "/etc/badblocks"], 0, "'-l' is not an allowed"),
    ("ext4", ["-z", "/tmp/undo"], 0, "'-z' is not an allowed"),
    ("ext4", ["-E", "offset=4096"], 1, "'offset' is not allowed"),
    ("ext4", ["-F"], 0, "'-F' is not an allowed"),
    ("ext4", ["-n"], 0, "'-n' is not an allowed"),
    ("ext4", ["-S"], 0, "'-S' is not an allowed"),
    ("ext4", ["-t", "ext2"], 0, "'-t' is not an allowed"),
    ("ext4", ["/dev/sda"], 0, "'/dev/sda' is not an allowed"),   # read as the device
    ("ext4", ["-Ldata"], 0, "separate items"),
    ("ext4", ["-L", "data", "-m"], 2, "needs a value"),
    ("ext4", ["-L", "a-label-longer-than-16"], 1, "at most 16 bytes"),
    ("ext4", ["-e", "panic"], 1, "continue or remount-ro"),
])
def test_mkfs_options_that_reach_beyond_the_device_are_refused(
        tmp_path: Path, fs: str, options: list[str], index: int, word: str) -> None:
    yaml_list = "[" + ", ".join(f'"{o}"' for o in options) + "]"
    field, line, msg = only_error(tmp_path, edit(GOOD, {
        "fsType: ext4": f"fsType: {fs}\n    mkfsOptions: {yaml_list}"}))
    assert (field, line) == (f"spec.stage.mkfsOptions[{index}]", 12)
    assert word in msg, msg
    assert "allowed" in msg or "value" in msg


@pytest.mark.parametrize(("fs", "options"), [
    ("ext4", ["-L", "data", "-O", "^has_journal"]),
    ("ext4", ["-E", "stride=16,stripe_width=64,nodiscard,lazy_itable_init=1", "-m", "0"]),
    ("ext4", ["-b", "4096", "-i", "65536", "-I", "256", "-j", "-J", "size=64", "-T", "largefile",
              "-U", "clear", "-N", "1000", "-e", "remount-ro", "-q"]),
    ("xfs", ["-L", "metrics", "-d", "su=64k,sw=4", "-l", "size=64m,version=2", "-K"]),
    ("xfs", ["-m", "crc=1,reflink=1", "-i", "size=512", "-n", "ftype=1", "-s", "size=4096",
             "-b", "size=4096"]),
])
def test_safe_mkfs_options_pass(tmp_path: Path, fs: str, options: list[str]) -> None:
    yaml_list = "[" + ", ".join(f'"{o}"' for o in options) + "]"
    (tmp_path / "v.yaml").write_text(
        edit(GOOD, {"fsType: ext4": f"fsType: {fs}\n    mkfsOptions: {yaml_list}"}))
    result = load([tmp_path], default_config())
    assert result.ok, [str(d) for d in result.diagnostics]
    assert result.volumes[0].stage.mkfs_options == tuple(options)


# --- item 8: staging and publish paths never equal or nest in one another -------------

def volume_text(name: str, publish: list[str], staging: str | None = None) -> str:
    stage = f"\n    path: {staging}" if staging else ""
    targets = "".join(f"\n    - path: {p}" for p in publish)
    return (f"apiVersion: rbd-reconciler/v1\nkind: Volume\nmetadata:\n  name: {name}\n"
            f"spec:\n  image:\n    pool: rbd\n    size: 1Gi\n  map: {{}}\n  stage:\n"
            f"    fsType: ext4{stage}\n  publish:{targets}\n")


def diags_by_file(tmp_path: Path, files: dict[str, str]) -> dict[str, list[str]]:
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    result = load([tmp_path], default_config())
    out: dict[str, list[str]] = {name: [] for name in files}
    for d in result.diagnostics:
        out[d.file.name].append(f"{d.line}:{d.column}: {d.field}: {d.message}")
    return out


def test_publish_inside_another_volumes_publish_fails_both(tmp_path: Path) -> None:
    got = diags_by_file(tmp_path, {
        "app.yaml": volume_text("app", ["/srv/app"]),
        "cache.yaml": volume_text("cache", ["/srv/app/cache"]),
    })
    app, cache = tmp_path / "app.yaml", tmp_path / "cache.yaml"
    assert got["cache.yaml"] == [
        f"13:13: spec.publish[0].path: publish path '/srv/app/cache' is inside publish path "
        f"'/srv/app' claimed at {app}:13:13"]
    assert got["app.yaml"] == [
        f"13:13: spec.publish[0].path: publish path '/srv/app' contains publish path "
        f"'/srv/app/cache' claimed at {cache}:13:13"]


def test_staging_path_equal_to_another_volumes_publish_path_fails_both(tmp_path: Path) -> None:
    got = diags_by_file(tmp_path, {
        "a.yaml": volume_text("a", ["/srv/a"], staging="/srv/shared"),
        "b.yaml": volume_text("b", ["/srv/shared"]),
    })
    a, b = tmp_path / "a.yaml", tmp_path / "b.yaml"
    assert got["a.yaml"] == [
        f"12:11: spec.stage.path: staging path '/srv/shared' is also claimed at {b}:13:13 "
        f"as a publish path"]
    assert got["b.yaml"] == [
        f"13:13: spec.publish[0].path: publish path '/srv/shared' is already claimed at "
        f"{a}:12:11 as a staging path"]


def test_nesting_within_one_volume_is_refused(tmp_path: Path) -> None:
    got = diags_by_file(tmp_path, {
        "v.yaml": volume_text("v", ["/srv/v", "/srv/v/inner"], staging="/srv/v/stage/x"),
    })
    assert len(got["v.yaml"]) >= 2
    assert any("'/srv/v/inner' is inside publish path '/srv/v'" in m for m in got["v.yaml"])
    assert any("'/srv/v/stage/x' is inside publish path '/srv/v'" in m for m in got["v.yaml"])


def test_siblings_with_a_common_prefix_are_fine(tmp_path: Path) -> None:
    got = diags_by_file(tmp_path, {
        "a.yaml": volume_text("a", ["/srv/app", "/srv/app-ro"]),
        "b.yaml": volume_text("b", ["/srv/app2", "/srv/ap"], staging="/srv/app.stage"),
    })
    assert got == {"a.yaml": [], "b.yaml": []}


@pytest.mark.parametrize(("publish", "staging", "word"), [
    (["/srv/node/state"], None, "is the stateDir"),
    (["/srv/node/state/status"], None, "is inside the stateDir '/srv/node/state'"),
    (["/srv/node"], None, "contains the stateDir '/srv/node/state'"),
    (["/srv/node/specs/x"], None, "is inside the desiredDir '/srv/node/specs'"),
    (["/srv/ok"], "/srv/node/state/fuse/x", "is inside the stateDir"),
    (["/srv/ok"], "/srv/node/state/staging", "is inside the stateDir"),
    (["/srv/ok"], "/srv/node", "contains the stateDir"),
])
def test_paths_on_our_own_directories_are_refused(
        tmp_path: Path, publish: list[str], staging: str | None, word: str) -> None:
    cfg = tmp_path / "config.yaml"
    cfg.write_text("desiredDir: /srv/node/specs\nstateDir: /srv/node/state\n"
                   "allowedRoots: [/srv, /mnt]\n")
    specs = tmp_path / "specs"
    specs.mkdir()
    (specs / "v.yaml").write_text(volume_text("v", publish, staging))
    result = load([specs], load_config(cfg))
    assert [d.message for d in result.diagnostics if word in d.message], \
        [str(d) for d in result.diagnostics]


def test_custom_staging_under_the_staging_root_is_still_allowed(tmp_path: Path) -> None:
    (tmp_path / "v.yaml").write_text(
        volume_text("v", ["/srv/v"], staging="/var/lib/rbd-reconciler/staging/custom-v"))
    result = load([tmp_path], default_config())
    assert result.ok, [str(d) for d in result.diagnostics]


def test_custom_staging_on_another_volumes_default_staging_path_is_refused(
        tmp_path: Path) -> None:
    got = diags_by_file(tmp_path, {
        "a.yaml": volume_text("a", ["/srv/a"]),
        "b.yaml": volume_text("b", ["/srv/b"], staging="/var/lib/rbd-reconciler/staging/a/x"),
    })
    assert any("is inside staging path '/var/lib/rbd-reconciler/staging/a'" in m
               for m in got["b.yaml"])
    assert got["a.yaml"]


def test_one_nesting_among_many_volumes(tmp_path: Path) -> None:
    # Each path is compared with its sorted neighbourhood only, not all pairs.
    for i in range(1000):
        (tmp_path / f"v{i}.yaml").write_text(
            volume_text(f"v{i}", [f"/srv/v{i}/data", f"/mnt/v{i}"]))
    (tmp_path / "z.yaml").write_text(volume_text("z", ["/srv/v999/data/deeper"]))
    result = load([tmp_path], default_config())
    assert {d.file.name for d in result.diagnostics} == {"v999.yaml", "z.yaml"}
    assert len(result.volumes) == 999


# --- item 7: the CLI refuses what the daemon refuses -----------------------------------

FAKE_KEY = ("-----BEGIN OPENSSH PRIVATE KEY-----\n"
            "b3BlbnNzaC1rZXktdjEAAAAABG5vbmUAAAAEbm9uZQAAAAAAAAABAAAAMwAAAAtzc2gtZW\n"
            "QyNTUxOQAAACBzZWNyZXQtdGVzdC1rZXktbm90LXJlYWwtYXQtYWxsAAAAAAAAAAAAAA\n"
            "-----END OPENSSH PRIVATE KEY-----\n")


def _key_outside(tmp_path: Path) -> Path:
    secret = tmp_path / "outside" / "id_ed25519"
    secret.parent.mkdir()
    secret.write_text(FAKE_KEY)
    secret.chmod(0o600)
    return secret


def test_validate_refuses_a_symlink_out_and_never_opens_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    import os

    from reconciler.cli.main import main

    secret = _key_outside(tmp_path)
    desired = tmp_path / "desired"
    desired.mkdir()
    (desired / "good.yaml").write_text(GOOD)
    (desired / "key.yaml").symlink_to(secret)
    opened: list[str] = []
    real_open = os.open

    def spy(path: object, *args: object, **kwargs: object) -> int:
        opened.append(os.fspath(path))  # type: ignore[arg-type]
        return real_open(path, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "open", spy)
    assert main(["validate", str(desired)]) == 1
    out = capsys.readouterr()
    text = out.out + out.err
    assert "PRIVATE KEY" not in text and "b3BlbnNzaC1" not in text
    assert f"{desired / 'key.yaml'}:1:1: (file): refusing to read it:" in text
    assert f"is a symlink to {secret}, outside {desired}" in text
    assert "0 valid volume(s)" in text  # the good file is not applied on its own either
    assert str(secret) not in opened


def test_a_symlink_inside_the_directory_is_fine(tmp_path: Path) -> None:
    # ConfigMap / git-sync layouts: files are links into a ..data directory.
    data = tmp_path / "..data"
    data.mkdir()
    (data / "v.yaml").write_text(GOOD)
    (tmp_path / "v.yaml").symlink_to(data / "v.yaml")
    result = load([tmp_path], default_config())
    assert result.ok, [str(d) for d in result.diagnostics]


@pytest.mark.parametrize("mode", [0o666, 0o620])
def test_a_group_or_world_writable_file_is_refused(tmp_path: Path, mode: int) -> None:
    (tmp_path / "good.yaml").write_text(edit(GOOD, {"vol": "good"}))
    f = tmp_path / "v.yaml"
    f.write_text(GOOD)
    f.chmod(mode)
    result = load([tmp_path], default_config())
    assert result.refused and result.volumes == ()
    [d] = result.diagnostics
    assert d.file == f and "writable by group or others" in d.message
    assert result.failed_files == {f, tmp_path / "good.yaml"}


def test_a_file_owned_by_another_user_is_refused(tmp_path: Path) -> None:
    import os

    if os.geteuid() != 0:
        pytest.skip("needs root to chown")
    f = tmp_path / "v.yaml"
    f.write_text(GOOD)
    os.chown(f, 4242, 4242)
    result = load([tmp_path], default_config())
    [d] = result.diagnostics
    assert "owned by uid 4242, not root" in d.message and result.volumes == ()


def test_a_writable_directory_refuses_everything_unread(tmp_path: Path) -> None:
    desired = tmp_path / "desired"
    desired.mkdir()
    (desired / "v.yaml").write_text("this would be a YAML error if it were read: [\n")
    desired.chmod(0o777)
    result = load([desired], default_config())
    [d] = result.diagnostics
    assert (d.file, d.field) == (desired, "(directory)")
    assert "writable by group or others" in d.message
    assert result.refused and result.failed_files == {desired / "v.yaml"}


def test_a_fifo_is_refused_without_blocking(tmp_path: Path) -> None:
    import os

    os.mkfifo(tmp_path / "pipe.yaml", 0o600)
    proc = subprocess.run([sys.executable, "-m", "reconciler", "validate", str(tmp_path)],
                          capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 1
    assert "pipe.yaml:1:1: (file): refusing to read it:" in proc.stdout
    assert "not a regular file" in proc.stdout


@pytest.mark.ceph
@pytest.mark.parametrize("command", [["validate"], ["plan"], ["apply"], ["release"], ["status"],
                                     ["explain", "vol"]])
def test_every_command_refuses_an_untrusted_desired_dir(
        node: NodeUnderTest, command: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    secret = _key_outside(node.root)
    link = node.desired / "key.yaml"
    link.symlink_to(secret)
    try:
        rc, out = node.cli(*command)
        text = out + capsys.readouterr().err
        assert rc == 1, text
        assert "refusing to read it" in text
        assert "PRIVATE KEY" not in text and "b3BlbnNzaC1" not in text
    finally:
        link.unlink()


def test_a_file_name_with_control_characters_is_printed_escaped(tmp_path: Path) -> None:
    f = tmp_path / "evil\x1b[2J\u202e.yaml"
    f.write_text("kind: [\n")
    [d] = load([tmp_path], default_config()).diagnostics
    assert "\x1b" not in str(d) and "\u202e" not in str(d)
    assert "evil\\x1b[2J\\u202e.yaml:2:1:" in str(d)


def test_a_symlinked_directory_in_a_writable_parent_is_refused(tmp_path: Path) -> None:
    # git-sync style: desired -> real; a writable directory holding the link
    # lets anyone swap it.
    real = tmp_path / "real"
    real.mkdir()
    (real / "v.yaml").write_text(GOOD)
    links = tmp_path / "links"
    links.mkdir()
    (links / "desired").symlink_to(real)
    assert load([links / "desired"], default_config()).ok
    links.chmod(0o777)
    result = load([links / "desired"], default_config())
    assert result.refused
    assert any(f"directory {links} is writable" in d.message for d in result.diagnostics)


@pytest.mark.parametrize("text", [
    "[" * 200_000 + "]" * 200_000 + "\n",          # flow sequences
    "- " * 100_000 + "x\n",                         # compact block sequences
    "{a: " * 100_000 + "1" + "}" * 100_000 + "\n",  # flow mappings
    "[" * 100_000 + "\n",                           # unclosed: a syntax error that deep
    "a: &l0 {k: v}\n" + "".join(f"l{i}: &l{i} {{<<: *l{i - 1}}}\n" for i in range(1, 3000)),
], ids=["flow-seq", "block-seq", "flow-map", "unclosed", "merge-chain"])
def test_deep_nesting_is_an_error_not_a_segfault(tmp_path: Path, text: str) -> None:
    # libyaml's composer recursed in C until the process died (SIGSEGV).
    (tmp_path / "deep.yaml").write_text(text)
    proc = subprocess.run([sys.executable, "-m", "reconciler", "validate", str(tmp_path)],
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "deep.yaml:" in proc.stdout and ("nest" in proc.stdout or "YAML" in proc.stdout)
