"""The remote tier's value format: a value opens to its payload only for the block, namespace,
secret and block size it was sealed for; every other value is a `Miss` with the reason, never
an exception and never the payload."""

from __future__ import annotations

import struct

import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier_rs.tiers.remote import Miss, ValueFormat, derive_secret, namespace_digest, store_key
from kvtier_rs.tiers.remote.values import _FIXED, CHECK_BYTES, FORMAT_VERSION, MAGIC

NS = namespace_digest("model-a/bf16/16x128", "tenant-1")
SECRET = derive_secret(b"deployment secret")
KEY = bytes(range(36))
PAYLOAD = bytes((i * 7 + 3) % 256 for i in range(4096))
PLAIN = ValueFormat(NS)
KEYED = ValueFormat(NS, SECRET)


def opened(fmt: ValueFormat, value: bytes | None, key: bytes = KEY, n: int = len(PAYLOAD)) -> Miss | bytes:
    got = fmt.open(key, value, n)
    return got if isinstance(got, Miss) else bytes(got)


def header_fields(value: bytes) -> list:
    return list(_FIXED.unpack_from(value))


def repacked(value: bytes, **changes: object) -> bytes:
    """`value` with fixed header fields replaced (magic, version, flags, namespace, key_len,
    length), the rest as it was: a crafted value, not a resealed one."""
    names = ("magic", "version", "flags", "namespace", "key_len", "length")
    fields = dict(zip(names, header_fields(value), strict=True))
    fields.update(changes)
    return _FIXED.pack(*(fields[n] for n in names)) + value[_FIXED.size :]


@pytest.mark.parametrize("fmt", [PLAIN, KEYED], ids=["plain", "keyed"])
def test_a_sealed_value_opens_to_its_payload(fmt: ValueFormat) -> None:
    value = fmt.seal(KEY, PAYLOAD)
    assert value[:4] == MAGIC
    assert len(value) == _FIXED.size + len(KEY) + CHECK_BYTES + len(PAYLOAD)
    assert opened(fmt, value) == PAYLOAD


def test_a_sealed_memoryview_payload_opens_the_same_as_bytes() -> None:
    assert KEYED.seal(KEY, memoryview(PAYLOAD)) == KEYED.seal(KEY, PAYLOAD)


def test_a_big_payload_hashed_on_several_threads_still_opens() -> None:
    big = bytes(range(256)) * (5 << 12)  # 5 MiB: past the multi-threaded hashing threshold
    assert opened(KEYED, KEYED.seal(KEY, big), n=len(big)) == big


def test_keyed_and_plain_checks_differ() -> None:
    # The same header and payload, yet the check is a MAC under the secret.
    p, k = PLAIN.seal(KEY, PAYLOAD), KEYED.seal(KEY, PAYLOAD)
    body = _FIXED.size + len(KEY)
    assert p[body : body + CHECK_BYTES] != k[body : body + CHECK_BYTES]


def test_an_absent_value_is_a_miss_absent() -> None:
    assert opened(PLAIN, None) is Miss.ABSENT


@pytest.mark.parametrize("value", [b"", b"hello", b"x" * 10_000, b"KVT", b"KVTX" + bytes(100)])
def test_another_programs_bytes_are_a_miss_foreign(value: bytes) -> None:
    assert opened(PLAIN, value) is Miss.FOREIGN
    assert opened(KEYED, value) is Miss.FOREIGN


def test_a_value_of_another_format_version_is_a_miss_format() -> None:
    value = repacked(PLAIN.seal(KEY, PAYLOAD), version=FORMAT_VERSION + 1)
    assert opened(PLAIN, value) is Miss.FORMAT


def test_a_value_of_another_namespace_is_a_miss_namespace() -> None:
    other = ValueFormat(namespace_digest("model-a/bf16/16x128", "tenant-2"))
    assert opened(PLAIN, other.seal(KEY, PAYLOAD)) is Miss.NAMESPACE


@pytest.mark.parametrize(("writer", "reader"), [(PLAIN, KEYED), (KEYED, PLAIN)], ids=["plain->keyed", "keyed->plain"])
def test_keyed_and_plain_values_do_not_open_for_each_other(writer: ValueFormat, reader: ValueFormat) -> None:
    assert opened(reader, writer.seal(KEY, PAYLOAD)) is Miss.NAMESPACE


@pytest.mark.parametrize(
    "other", [bytes(36), KEY[:-1], KEY + b"\0", b"k"], ids=["same-len", "shorter", "longer", "tiny"]
)
def test_a_value_of_another_block_key_is_a_miss_key(other: bytes) -> None:
    assert opened(PLAIN, PLAIN.seal(other, PAYLOAD)) is Miss.KEY
    assert opened(KEYED, KEYED.seal(other, PAYLOAD)) is Miss.KEY


@pytest.mark.parametrize(
    "cut",
    [
        _FIXED.size + 5,  # inside the key
        _FIXED.size + len(KEY) + 10,  # inside the check
        _FIXED.size + len(KEY) + CHECK_BYTES,  # no payload at all
        -1,  # one byte of payload short
    ],
)
def test_a_truncated_value_is_a_miss_length(cut: int) -> None:
    value = KEYED.seal(KEY, PAYLOAD)
    assert opened(KEYED, value[:cut]) is Miss.LENGTH


def test_a_value_cut_inside_the_fixed_header_is_foreign() -> None:
    value = PLAIN.seal(KEY, PAYLOAD)
    assert opened(PLAIN, value[: _FIXED.size - 1]) is Miss.FOREIGN


def test_a_padded_value_is_a_miss_length() -> None:
    assert opened(PLAIN, PLAIN.seal(KEY, PAYLOAD) + b"\0") is Miss.LENGTH


def test_a_payload_of_another_block_size_is_a_miss_length() -> None:
    small = PLAIN.seal(KEY, PAYLOAD[:1024])
    assert opened(PLAIN, small) is Miss.LENGTH  # the reader expects 4096 bytes
    assert opened(PLAIN, small, n=1024) == PAYLOAD[:1024]


def test_a_lying_payload_length_field_is_a_miss_length() -> None:
    value = PLAIN.seal(KEY, PAYLOAD)
    assert opened(PLAIN, repacked(value, length=len(PAYLOAD) + 1)) is Miss.LENGTH


@pytest.mark.parametrize("fmt", [PLAIN, KEYED], ids=["plain", "keyed"])
@pytest.mark.parametrize(
    ("where", "expected"),
    [
        ("magic", {Miss.FOREIGN}),
        ("version", {Miss.FORMAT}),
        ("flags", {Miss.NAMESPACE, Miss.CHECK}),  # a flipped keyed bit, or an unused flag bit
        ("namespace", {Miss.NAMESPACE}),
        ("key_len", {Miss.KEY, Miss.LENGTH}),
        ("length", {Miss.LENGTH}),
        ("key", {Miss.KEY}),
        ("check", {Miss.CHECK}),
        ("payload", {Miss.CHECK}),
    ],
)
def test_a_flipped_byte_anywhere_is_a_miss_with_its_reason(fmt: ValueFormat, where: str, expected: set) -> None:
    offsets = {"magic": 1, "version": 4, "flags": 7, "namespace": 8 + 5, "key_len": 24, "length": 26}
    offsets |= {"key": _FIXED.size + 3, "check": _FIXED.size + len(KEY) + 7}
    offsets["payload"] = _FIXED.size + len(KEY) + CHECK_BYTES + 1000
    value = bytearray(fmt.seal(KEY, PAYLOAD))
    value[offsets[where]] ^= 0x40
    assert opened(fmt, bytes(value)) in expected


def test_the_header_layout_is_as_documented() -> None:
    value = KEYED.seal(KEY, PAYLOAD)
    assert header_fields(value) == [MAGIC, FORMAT_VERSION, 1, NS, len(KEY), len(PAYLOAD)]
    assert struct.unpack_from("<H", value, 6) == (1,)
    assert header_fields(PLAIN.seal(KEY, PAYLOAD))[2] == 0


@settings(max_examples=300, deadline=None, derandomize=True)
@given(
    keyed=st.booleans(),
    payload=st.binary(min_size=0, max_size=300),
    key=st.binary(min_size=1, max_size=64),
    data=st.data(),
)
def test_no_single_byte_flip_or_truncation_ever_opens(keyed: bool, payload: bytes, key: bytes, data) -> None:
    fmt = KEYED if keyed else PLAIN
    value = fmt.seal(key, payload)
    assert opened(fmt, value, key, len(payload)) == payload
    i = data.draw(st.integers(0, len(value) - 1), label="offset")
    flipped = bytearray(value)
    flipped[i] ^= data.draw(st.integers(1, 255), label="xor")
    assert isinstance(fmt.open(key, bytes(flipped), len(payload)), Miss)
    cut = data.draw(st.integers(0, len(value) - 1), label="cut")
    assert isinstance(fmt.open(key, value[:cut], len(payload)), Miss)


@settings(max_examples=50, deadline=None, derandomize=True)
@given(a=st.binary(min_size=1, max_size=40), b=st.binary(min_size=1, max_size=40), payload=st.binary(max_size=200))
def test_a_value_sealed_under_one_secret_opens_under_no_other(a: bytes, b: bytes, payload: bytes) -> None:
    sealed = ValueFormat(NS, derive_secret(a)).seal(KEY, payload)
    if a != b:
        assert ValueFormat(NS, derive_secret(b)).open(KEY, sealed, len(payload)) is Miss.CHECK
    else:
        assert bytes(ValueFormat(NS, derive_secret(b)).open(KEY, sealed, len(payload))) == payload  # type: ignore[arg-type]
    assert PLAIN.open(KEY, sealed, len(payload)) is Miss.NAMESPACE


def test_a_writer_without_the_secret_cannot_forge_a_keyed_value() -> None:
    # The flags say keyed, the check is a plain hash: what a writer without the secret can make.
    forged = bytearray(PLAIN.seal(KEY, PAYLOAD))
    forged[6] = 1
    head = bytes(forged[: _FIXED.size + len(KEY)])

    check = xxhash.xxh3_128(head + PAYLOAD).digest()
    forged[_FIXED.size + len(KEY) : _FIXED.size + len(KEY) + CHECK_BYTES] = check
    assert opened(KEYED, bytes(forged)) is Miss.CHECK


def test_derive_secret_is_32_bytes_and_depends_on_the_material() -> None:
    assert len(derive_secret(b"x")) == 32
    assert derive_secret(b"x") == derive_secret(b"x") != derive_secret(b"y")


def test_namespace_digest_is_stable_and_sensitive_to_identity_and_salt() -> None:
    d = namespace_digest("model-a", "salt")
    assert len(d) == 16
    assert d == namespace_digest("model-a", "salt")
    # A fixed value: replicas of any version of this code agree on it.
    assert d.hex() == "64b8bcbf28d5a9774237942878959a56"
    assert namespace_digest("model-a", "salt2") != d
    assert namespace_digest("model-a") != d
    assert namespace_digest("model-b", "salt") != d
    # The separator keeps identity and salt apart.
    assert namespace_digest("ab", "c") != namespace_digest("a", "bc")


def test_store_key_is_prefix_namespace_hex_block_key_hex() -> None:
    assert store_key("kvtier", NS, b"\x00\xab") == f"kvtier:{NS.hex()}:00ab".encode()
    assert store_key("p", bytes(16), KEY) == b"p:" + b"00" * 16 + b":" + KEY.hex().encode()


def test_bad_formats_are_refused() -> None:
    with pytest.raises(ValueError, match="namespace"):
        ValueFormat(b"short")
    with pytest.raises(ValueError, match="secret"):
        ValueFormat(NS, b"k" * 16)
    with pytest.raises(ValueError, match="block key"):
        PLAIN.seal(b"k" * 1025, PAYLOAD)
