"""managed.json: plain JSON, one volume a line, and a line encoded again only
when its record was replaced (a pass that adds one of 1,000 volumes)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from reconciler.state import records
from reconciler.state.records import RecordsFile


def test_one_line_a_volume_and_only_replaced_records_encoded(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    encoded = []
    real = json.dumps
    monkeypatch.setattr(records.json, "dumps",
                        lambda obj, **kw: (encoded.append(obj), real(obj, **kw))[1])
    recs = {f"v{i}": {"file": f"/etc/v{i}.yaml", "volume": {"size": i}} for i in range(100)}
    f = RecordsFile(tmp_path / "state" / "managed.json")
    f.save(recs)
    text = f.path.read_text()
    assert json.loads(text) == recs
    assert len(text.splitlines()) == 102  # "{", a line each, "}"
    assert f.path.stat().st_mode & 0o777 == 0o600
    first = len(encoded)
    recs["v7"] = {"file": "/etc/v7.yaml", "volume": {"size": 70}}
    del recs["v8"]
    f.save(recs)
    assert len(encoded) - first == 2  # v7's name and record; none of the others
    assert json.loads(f.path.read_text()) == recs
    f.save({})
    assert json.loads(f.path.read_text()) == {}
