"""What the source's tests share: a signer (keys, a work repository) and
one of its ssh keys; the volume file they commit (source_signing.volume_yaml)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from source_signing import Signing, SshKey


@pytest.fixture
def signer(tmp_path: Path) -> Iterator[Signing]:
    with Signing(tmp_path / "signer") as s:
        yield s


@pytest.fixture
def alice(signer: Signing) -> SshKey:
    return signer.ssh_key("alice")
