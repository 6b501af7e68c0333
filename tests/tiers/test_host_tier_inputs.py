"""Bad input to the Python facade (HostTier, TierConfig, parse_bytes, the key-list helper) is a
clear InvalidArgumentError naming the argument, raised before any state changes; good input is
taken exactly (no silent reinterpretation, no float rounding)."""

from __future__ import annotations

import numpy as np
import pytest

import kvtier_rs as kv
from kvtier_rs.config import MAX_BYTES, TierConfig, parse_bytes
from kvtier_rs.tiers.keys import index_list, key_list

SINGLE_KEY = "invalid argument `keys`: expected a sequence of keys, got a single key"
SINGLES = [b"\x01\x02", bytearray(b"\x01\x02"), memoryview(b"\x01\x02"), "ab", 7, np.int64(7)]


def block(i: int) -> bytes:
    return bytes([i]) * 4096


# ---- keys --------------------------------------------------------------------------------------
@pytest.mark.parametrize("single", SINGLES)
def test_host_tier_refuses_a_single_key_and_stores_nothing(single):
    tier = kv.HostTier(kv.TierConfig(8 * 4096, 4096))
    with pytest.raises(kv.InvalidArgumentError, match=SINGLE_KEY):
        tier.store(single, [block(1), block(2)])
    with pytest.raises(kv.InvalidArgumentError, match=SINGLE_KEY):
        tier.read(single)
    assert tier.index.entries() == [] and tier.stats()["stores_prepared"] == 0


def test_host_tier_takes_any_iterable_of_keys_and_lists_it_once():
    tier = kv.HostTier(kv.TierConfig(8 * 4096, 4096))
    out = tier.store((k for k in (b"a", 2)), [block(1), block(2)])
    assert out.keys == [b"a", 2]
    # A generator is consumed once: the blocks pinned for the copy are the ones unpinned.
    assert tier.read(k for k in (b"a", 2)) == [block(1), block(2)]
    assert tier.stats()["pinned_blocks"] == 0
    assert all(pins == 0 for _, _, pins, _ in tier.index.entries())


def test_key_list_names_the_argument():
    assert key_list((1, b"x")) == [1, b"x"]
    with pytest.raises(kv.InvalidArgumentError, match=r"invalid argument `chain`: .* got a single key \(bytes\)"):
        key_list(b"digest", "chain")
    with pytest.raises(kv.InvalidArgumentError, match="`keys`: expected a sequence of keys, got NoneType"):
        key_list(None)


def test_index_list_takes_integers_only():
    import torch  # in the dev environment (requirements-dev.txt): never skipped

    assert index_list([1, np.int32(2), torch.tensor(3)], "ids") == [1, 2, 3]
    assert all(type(i) is int for i in index_list([np.int64(4)], "ids"))
    for bad in ([2.9], [np.float64(2.0)], [torch.tensor(2.5)], [True], ["3"]):
        with pytest.raises(kv.InvalidArgumentError, match="invalid argument `ids`: block ids must be integers"):
            index_list(bad, "ids")
    with pytest.raises(kv.InvalidArgumentError, match="invalid argument `ids`: .* got a single block id"):
        index_list(3, "ids")


# ---- TierConfig ---------------------------------------------------------------------------------
@pytest.mark.parametrize("policy", [None, 5, b"lru", "random"])
def test_tier_config_refuses_a_bad_policy_by_name(policy):
    with pytest.raises(kv.InvalidArgumentError, match="invalid argument `policy`"):
        TierConfig("8MiB", 4096, policy=policy)


@pytest.mark.parametrize("admission", ["bogus", "uses:0", "priority:101", "", None, 2])
def test_tier_config_validates_admission_at_construction(admission):
    with pytest.raises(kv.InvalidArgumentError, match="invalid argument `admission`"):
        TierConfig("8MiB", 4096, admission=admission)


def test_tier_config_accepts_the_rules_the_core_accepts():
    for adm in ("always", "uses:2", "priority:50"):
        assert kv.HostTier(TierConfig("64KiB", 4096, policy="ARC", admission=adm)).index.admission == adm


@pytest.mark.parametrize("field", ["capacity_bytes", "block_bytes"])
def test_tier_config_bounds_sizes(field):
    sizes = {"capacity_bytes": "8MiB", "block_bytes": 4096}
    sizes[field] = 2**70
    with pytest.raises(kv.InvalidArgumentError, match=f"invalid argument `{field}`: .*more than the maximum"):
        TierConfig(**sizes)


# ---- parse_bytes --------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "text, want",
    [
        ("2.01KB", 2010),
        ("2.05MB", 2_050_000),
        ("9007199254740993", 9_007_199_254_740_993),
        ("1.5 GB", 1_500_000_000),
        ("0.5KiB", 512),
        ("1.25 GiB", 5 * 2**28),
        ("4096", 4096),
        (" 64mib ", 64 * 2**20),
        (str(MAX_BYTES), MAX_BYTES),
        (MAX_BYTES, MAX_BYTES),
    ],
)
def test_parse_bytes_is_exact(text, want):
    got = parse_bytes(text)
    assert got == want and type(got) is int


@pytest.mark.parametrize("text", ["0.5", "1.0001KB", "0.3 KiB", "2.0000000001GB"])
def test_parse_bytes_refuses_fractions_of_a_byte(text):
    with pytest.raises(kv.InvalidArgumentError, match="invalid argument `blk`: .* is not a whole number of bytes"):
        parse_bytes(text, name="blk")


@pytest.mark.parametrize("value", [MAX_BYTES + 1, str(MAX_BYTES + 1), 2**70, "5000000TiB", "9" * 30])
def test_parse_bytes_bounds_sizes(value):
    with pytest.raises(kv.InvalidArgumentError, match="invalid argument `cap`: .*more than the maximum, 2\\*\\*62"):
        parse_bytes(value, name="cap")


def test_parse_bytes_refuses_absurdly_long_numbers_clearly():
    for text in ("1" * 5000, "0." + "0" * 5000 + "1"):
        with pytest.raises(kv.InvalidArgumentError, match="invalid argument `cap`"):
            parse_bytes(text, name="cap")


def test_a_huge_integer_size_is_refused_without_echoing_it():
    # repr() of an int over 4300 digits raises ValueError: the message must not try it.
    from kvtier_rs.config import parse_bytes

    with pytest.raises(kv.InvalidArgumentError, match=r"an integer of about 5001 digits is more than the maximum"):
        parse_bytes(10**5000, name="cpu")


# ---- HostTier.store payloads ---------------------------------------------------------------------
@pytest.mark.parametrize(
    ("payload", "words"),
    [
        # Right size, but not bytes: taken as their UTF-32 or int64 encodings before.
        ("x" * 1024, "expected bytes or an array, got str"),
        ([0] * 512, "expected bytes or an array, got list"),
        # Right size, but the copy into the slot failed after the index had handed out slots:
        # a ValueError/TypeError naming nothing, with the chain's earlier blocks stored.
        (np.array([object()] * 512), "an array of object"),
        (np.zeros((1024, 2), dtype=np.float32)[:, 0], None),
        (None, "expected bytes or an array, got NoneType"),
    ],
)
def test_host_tier_store_checks_every_payload_before_the_index(payload, words):
    tier = kv.HostTier(kv.TierConfig(8 * 4096, 4096))
    if words is None:  # a non-contiguous array is fine: copied whole, exactly its bytes
        tier.store([1, 2], [block(1), payload])
        assert tier.read([2]) == [payload.tobytes()]
        return
    with pytest.raises(kv.InvalidArgumentError, match=f"payloads: the payload for key 2: .*{words}"):
        tier.store([1, 2], [block(1), payload])
    assert tier.index.entries() == [] and tier.stats()["stores_prepared"] == 0, "bad input changed nothing"


def test_host_tier_store_refuses_a_key_given_twice():
    """store([5, 5], [a, b]) stored b under 5 (the payload map kept the last), though the index
    took the first 5 and skipped the second as present: which payload a key gets was an accident."""
    tier = kv.HostTier(kv.TierConfig(8 * 4096, 4096))
    with pytest.raises(kv.InvalidArgumentError, match="keys: key 5 is given twice"):
        tier.store([5, 5], [block(1), block(2)])
    assert tier.index.entries() == []


@pytest.mark.parametrize(("slot", "exc"), [(-1, kv.InvalidArgumentError), (True, kv.InvalidArgumentError)])
def test_host_tier_slot_views_name_a_bad_slot(slot, exc):
    """slot_array(-1) was pyo3's OverflowError 'out of range integral type conversion attempted',
    naming nothing; slot_array(True) was slot 1."""
    tier = kv.HostTier(kv.TierConfig(8 * 4096, 4096))
    with pytest.raises(exc, match="`slot`"):
        tier.slot_array(slot)


@pytest.mark.parametrize("config", [{"capacity_bytes": 8 * 4096, "block_bytes": 4096}, None, 4096])
def test_host_tier_refuses_a_config_that_is_not_a_tier_config(config):
    """HostTier(dict) was `AttributeError: 'dict' object has no attribute 'capacity_bytes'`."""
    with pytest.raises(kv.InvalidArgumentError, match="invalid argument `config`: expected a TierConfig"):
        kv.HostTier(config)


def test_host_tier_store_takes_payloads_as_any_iterable():
    """Keys could be any iterable, payloads had to have a len(): a generator of payloads was
    `TypeError: object of type 'generator' has no len()`. Now listed once, as keys are."""
    tier = kv.HostTier(kv.TierConfig(8 * 4096, 4096))
    tier.store(iter([1, 2]), (block(k) for k in (1, 2)))
    assert tier.read([1, 2]) == [block(1), block(2)]
    # Not an iterable at all, or one payload where a list of them is expected: named.
    with pytest.raises(kv.InvalidArgumentError, match="invalid argument `payloads`: expected a sequence"):
        tier.store([3], 5)
    with pytest.raises(kv.InvalidArgumentError, match="invalid argument `payloads`: .* single payload"):
        tier.store([3], block(3))
    assert tier.read([1, 2]) == [block(1), block(2)] and len(tier.index.entries()) == 2
