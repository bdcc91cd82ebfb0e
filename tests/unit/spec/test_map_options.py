"""map.options: an allow-list per mapper, with a reason for what is refused."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_spec_invalid import GOOD

from reconciler.spec.config import default_config
from reconciler.spec.loader import load
from reconciler.spec.mapopts import check_map_options


@pytest.mark.parametrize(("mapper", "options"), [
    ("krbd", ("exclusive", "ms_mode=secure", "alloc_size=65536", "queue_depth=256",
              "read_from_replica=balance", "compression_hint=compressible", "notrim",
              "osd_request_timeout=60")),
    ("nbd", ("try-netlink", "io-timeout=60", "exclusive", "notrim")),
    ("auto", ("exclusive", "ms_mode=prefer-crc", "io-timeout=30")),
    ("fuse", ()),
])
def test_allowed(mapper: str, options: tuple[str, ...]) -> None:
    assert check_map_options(mapper, options) == []


@pytest.mark.parametrize(("mapper", "option", "word"), [
    ("krbd", "secret=AQD", "not known for mapper krbd"),
    ("krbd", "fsid=1234", "not known"),
    ("krbd", "ms_mode=plain", "needs a valid value"),
    ("krbd", "alloc_size=3000", "needs a valid value"),
    ("krbd", "exclusive=1", "takes no value"),
    ("krbd", "osd_request_timeout", "needs a valid value"),
    ("krbd", "osd_request_timeout=-1", "needs a valid value"),
    ("nbd", "osd_request_timeout=60", "not known for mapper nbd"),
    ("krbd", "ro", "publish with readOnly"),
    ("nbd", "quiesce-hook=/tmp/x", "runs a program"),
    ("nbd", "encryption-format=luks2", "spec.encryption"),
    ("nbd", "ms_mode=crc", "not known for mapper nbd"),
    ("fuse", "exclusive", "rbd-fuse takes no map options"),
])
def test_refused(mapper: str, option: str, word: str) -> None:
    [(index, message)] = check_map_options(mapper, ("exclusive",) * (mapper != "fuse")
                                           + (option,))
    assert index == (mapper != "fuse") and word in message


def test_loader_names_the_option(tmp_path: Path) -> None:
    (tmp_path / "v.yaml").write_text(GOOD.replace(
        "  map: {}", "  map: {mapper: krbd, options: [exclusive, 'ip=10.0.0.1']}"))
    result = load([tmp_path], default_config())
    [d] = result.diagnostics
    assert d.field == "spec.map.options[1]" and d.line == 9 and "'ip'" in d.message
