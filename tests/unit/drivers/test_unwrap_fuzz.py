"""A damaged or hostile wrapped-passphrase record (image-meta is writable by
any client of the pool) is refused as a KeyProblem naming the image, never
an internal error, and no message carries key material.

Generated: arbitrary JSON values, arbitrary text and bytes, and valid
records with one field replaced or removed, or their text mutated. A record
that gets as far as the cipher costs one scrypt (~0.1 s), so those
properties run fewer examples. For a longer run:

    RBD_FUZZ_EXAMPLES=5000 .venv/bin/python -m pytest tests/unit/drivers/test_unwrap_fuzz.py
"""

from __future__ import annotations

import base64
import json
import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from reconciler.drivers import keys

NODE_KEY = os.urandom(64)
PHRASE = keys.new_passphrase()
ME = keys.ImageRef(7, "1234abcd")
WHAT = "rbd/victim (node key /etc/rbd-reconciler/keys/node.key)"
VALID = keys.wrap(PHRASE, NODE_KEY, ME, by="/etc/rbd-reconciler/keys/node.key")
FIELDS = sorted(json.loads(VALID))
EXAMPLES = int(os.environ.get("RBD_FUZZ_EXAMPLES", "300"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow])
SCRYPTED = settings(FUZZ, max_examples=max(10, EXAMPLES // 20))  # each costs a scrypt
pytestmark = pytest.mark.fuzz

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=40),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                 max_size=4),
    max_leaves=12)


def secrets_in(message: str) -> list[str]:
    """Any form of the node key or the passphrase a message could carry."""
    forms = {"passphrase": PHRASE.decode(), "node key (hex)": NODE_KEY.hex(),
             "node key (base64)": base64.b64encode(NODE_KEY).decode(),
             "node key": NODE_KEY.decode("latin-1")}
    return [name for name, form in forms.items() if form in message]


def only_a_key_problem(text: object) -> None:
    try:
        got = keys.unwrap(text, NODE_KEY, WHAT, ME, lambda: [])
    except keys.KeyProblem as exc:
        message = str(exc)
        assert message.startswith(WHAT + ": "), message  # names the image
        assert not secrets_in(message), (secrets_in(message), message)
        assert len(message) < 1000, message
        return
    # Only a record that still authenticates opens, and to the one passphrase.
    assert got.passphrase == PHRASE and got.bound == ME


@pytest.mark.parametrize("text", [
    "[]", "null", "1", "true", '"v"', "{}", '{"n": 1e400}', '{"v": 1e400}', "", "{",
    "[" * 100_000 + "]" * 100_000, "x" * 1_000_000,
    json.dumps({**json.loads(VALID), "nonce": ""}),
    json.dumps({**json.loads(VALID), "nonce": base64.b64encode(b"7 bytes").decode()}),
    json.dumps({**json.loads(VALID), "salt": ""}),
    json.dumps({**json.loads(VALID), "sealed": ""}),
    json.dumps({**json.loads(VALID), "sealed": base64.b64encode(b"x" * 15).decode()}),
    json.dumps({**json.loads(VALID), "n": 1e400}),
    json.dumps({**json.loads(VALID), "n": float(keys.SCRYPT_N)}),
    json.dumps({**json.loads(VALID), "n": str(keys.SCRYPT_N)}),
    json.dumps({**json.loads(VALID), "v": True}),
    json.dumps({**json.loads(VALID), "v": 2.0}),
    json.dumps({**json.loads(VALID), "pool": -1}),
    json.dumps({**json.loads(VALID), "pool": 1 << 80}),
    json.dumps({**json.loads(VALID), "image": ""}),
    json.dumps({**json.loads(VALID), "image": ["1234abcd"]}),
    json.dumps({**json.loads(VALID), "salt": "%%%%"}),
    VALID.replace('"v":2', '"v":1'),
    b"\xff\xfe".decode("latin-1"),
])
def test_named_damage_is_a_key_problem(text: str) -> None:
    """The records issue 25 names (an internal error before), and their kin."""
    with pytest.raises(keys.KeyProblem):
        keys.unwrap(text, NODE_KEY, WHAT, ME)
    only_a_key_problem(text)


def test_a_damaged_hint_is_ignored() -> None:
    rec = {**json.loads(VALID), "by": 5}
    got = keys.unwrap(json.dumps(rec), NODE_KEY, WHAT, ME)
    assert got.passphrase == PHRASE and keys.parse(json.dumps(rec)).by is None


def test_not_text_at_all_is_a_key_problem() -> None:
    for value in (None, b"{}", 1, [], {}):
        with pytest.raises(keys.KeyProblem, match="not text"):
            keys.unwrap(value, NODE_KEY, WHAT, ME)


@FUZZ
@given(json_values)
def test_any_json_value(value: object) -> None:
    only_a_key_problem(json.dumps(value))


@FUZZ
@given(st.text(max_size=300))
def test_any_text(text: str) -> None:
    only_a_key_problem(text)


@FUZZ
@given(st.binary(max_size=300))
def test_any_bytes(raw: bytes) -> None:
    # image-meta values are read as UTF-8 with errors replaced
    only_a_key_problem(raw.decode("utf-8", errors="replace"))


@FUZZ
@given(field=st.sampled_from(FIELDS), value=json_values)
def test_a_valid_record_with_one_field_replaced(field: str, value: object) -> None:
    only_a_key_problem(json.dumps({**json.loads(VALID), field: value}))


@FUZZ
@given(field=st.sampled_from(FIELDS))
def test_a_valid_record_with_one_field_missing(field: str) -> None:
    rec = json.loads(VALID)
    del rec[field]
    only_a_key_problem(json.dumps(rec))


@FUZZ
@given(st.data())
def test_a_valid_record_with_its_text_mutated(data: st.DataObject) -> None:
    text = list(VALID)
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(text) - 1))
        text[i] = data.draw(st.characters(codec="utf-8"))
    only_a_key_problem("".join(text))


@SCRYPTED
@given(field=st.sampled_from(["salt", "nonce", "sealed"]), flip=st.integers(0, 95))
def test_a_flipped_bit_in_the_sealed_fields(field: str, flip: int) -> None:
    rec = json.loads(VALID)
    raw = bytearray(base64.b64decode(rec[field]))
    raw[(flip // 8) % len(raw)] ^= 1 << (flip % 8)
    rec[field] = base64.b64encode(bytes(raw)).decode()
    with pytest.raises(keys.KeyProblem, match="does not open"):
        keys.unwrap(json.dumps(rec), NODE_KEY, WHAT, ME)
