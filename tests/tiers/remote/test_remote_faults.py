"""Faults of the shared store, against real clusters: values planted by other programs, a node
killed or stopped, a full server, a flushed one, a wrong password, a restarted engine.

Every case checks that the tier keeps answering without raising, that a failure is reported as
a job result (never a wait past the deadline) and counted by its reason, that no wrong byte
reaches a host slot, and that the tier serves again by itself once the fault is gone. Deadlines
and breakers run on fake clocks: nothing here depends on how fast this machine is.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from support.valkey import (
    BLOCK,
    Cluster,
    FakeClock,
    Host,
    bkeys,
    block_key_of,
    block_payload,
    keys_on_node,
    plain_client,
    read,
    running_cluster,
    wait_result,
    write,
)

from kvtier_rs.tiers.remote import BreakerState, CircuitBreaker, Miss, ValueFormat, derive_secret, namespace_digest
from kvtier_rs.tiers.remote.client import DEFAULT_PASSWORD_ENV, read_password

OLD = bytes([0x11]) * BLOCK  # what a host slot held before a read that must not touch it
SECRET = derive_secret(b"the deployment's secret, 32+ bytes long")


def still_serving(tier, host: Host, tag: bytes = b"after") -> None:
    """A fresh write and read round trip succeeds, byte for byte."""
    keys = bkeys(6, tag)
    ticket, res = write(tier, host, keys, first_slot=100)
    assert ticket.keys == keys and res.ok_keys == keys, f"the tier stopped writing after the fault: {tier.stats()}"
    got, slots = read(tier, host, keys, first_slot=110)
    assert got.success, f"the tier stopped serving reads after the fault: {tier.stats()}"
    assert [host.get(s) for s in slots] == [block_payload(k) for k in keys]


def misses(tier) -> dict[str, int]:
    return {m.value: n for m in Miss if (n := tier.stats()[f"miss_{m.value}"])}


def by_node(cluster: Cluster, keys: list[bytes]) -> list[list[bytes]]:
    """`keys` (written already) grouped by the primary that holds them."""
    held = [{block_key_of(k) for k in keys_on_node(cluster, i)} for i in range(len(cluster.nodes))]
    groups = [[k for k in keys if k in h] for h in held]
    assert all(groups), f"some node holds none of {len(keys)} keys: write more"
    return groups


# ---- values planted under the right key by another program ---------------------------------

FMT = ValueFormat(namespace_digest("test-model/bf16/l2h4d64/b16/tp1"))


def _flipped(value: bytes, at: int) -> bytes:
    b = bytearray(value)
    b[at] ^= 0x01
    return bytes(b)


PLANTED = {
    "foreign": (lambda key: b"some other program's value", Miss.FOREIGN),
    "another-key": (lambda key: FMT.seal(b"x" * len(key), block_payload(key)), Miss.KEY),
    "truncated": (lambda key: FMT.seal(key, block_payload(key))[:-100], Miss.LENGTH),
    "other-block-size": (lambda key: FMT.seal(key, block_payload(key)[:4096]), Miss.LENGTH),
    "payload-flipped": (lambda key: _flipped(FMT.seal(key, block_payload(key)), -7), Miss.CHECK),
    "check-flipped": (lambda key: _flipped(FMT.seal(key, block_payload(key)), 70 + len(key)), Miss.CHECK),
    "other-namespace": (lambda key: ValueFormat(namespace_digest("m2")).seal(key, block_payload(key)), Miss.NAMESPACE),
}


@pytest.mark.parametrize("kind", list(PLANTED))
def test_a_planted_value_is_a_counted_miss_and_never_reaches_the_slot(cluster, tiers, host, kind) -> None:
    make, reason = PLANTED[kind]
    tier = tiers(cluster)
    keys = bkeys(4, b"plant")
    _, res = write(tier, host, keys)
    assert res.success
    bad = keys[1]
    rc = plain_client(cluster)
    try:
        rc.set(tier._store_key(bad), make(bad))
    finally:
        rc.close()
    slots = list(range(20, 24))
    for s in slots:
        host.put(s, OLD)
    got = wait_result(tier, tier.submit_read(keys, host.pool, slots))
    assert got.failed_keys == [bad] and got.ok_keys == [keys[0], *keys[2:]] and not got.success
    assert misses(tier) == {reason.value: 1}
    assert host.get(slots[1]) == OLD
    assert [host.get(s) for s in (20, 22, 23)] == [block_payload(k) for k in (keys[0], *keys[2:])]
    assert tier.known(bad) is False  # learned: the stager recomputes it instead of reading again
    still_serving(tier, host)


@pytest.mark.parametrize(
    ("writer", "reason"),
    [
        (ValueFormat(FMT.namespace), Miss.NAMESPACE),  # no secret: flagged unkeyed
        (ValueFormat(FMT.namespace, derive_secret(b"someone else's secret")), Miss.CHECK),
    ],
    ids=["no-secret", "another-secret"],
)
def test_a_keyed_deployment_refuses_values_of_writers_without_its_secret(cluster, tiers, host, writer, reason) -> None:
    tier = tiers(cluster, secret=SECRET)
    keys = bkeys(3, b"mac")
    rc = plain_client(cluster)
    try:
        for k in keys:
            rc.set(tier._store_key(k), writer.seal(k, b"\x66" * BLOCK))
    finally:
        rc.close()
    assert tier.probe(keys) and tier.wait_idle(120)
    assert tier.contains(keys) == [True] * 3  # present, as far as existence goes
    for s in range(3):
        host.put(s, OLD)
    got = wait_result(tier, tier.submit_read(keys, host.pool, [0, 1, 2]))
    assert got.failed_keys == keys and got.bytes == 0
    assert misses(tier) == {reason.value: 3}
    assert [host.get(s) for s in range(3)] == [OLD] * 3
    # The deployment's own values, MAC-keyed, are served.
    still_serving(tier, host)


# ---- nodes down ------------------------------------------------------------------------------


def test_a_killed_node_fails_its_jobs_opens_the_breaker_and_recovers_after_restart(cluster, tiers, host) -> None:
    clock = FakeClock()
    breaker = CircuitBreaker(failures=2, cooldown_s=1.0, max_cooldown_s=4.0, clock=clock)
    tier = tiers(cluster, timeout_s=1.0, clock=clock, breaker=breaker, deadline_s=10.0)
    keys = bkeys(30, b"kill")
    _, res = write(tier, host, keys)
    assert res.success
    victims = by_node(cluster, keys)[0]

    cluster.kill(0)
    try:
        got, slots = read(tier, host, victims, first_slot=40)
        assert got.failed_keys == victims and got.ok_keys == [] and got.bytes == 0
        assert all(host.get(s) == bytes([0xEE]) * BLOCK for s in slots)
        tier.forget()
        ticket = tier.submit_write(victims, host.pool, list(range(len(victims))))
        assert ticket.keys == victims
        w = wait_result(tier, ticket.job_id)
        assert w.failed_keys == victims and not w.success
        st = tier.stats()
        assert st["read_errors"] >= 1 and st["write_errors"] >= 1
        assert st["miss_error"] == len(victims)
        # Two failures in a row: the breaker is open and nothing goes to the store.
        assert breaker.state is BreakerState.OPEN and st["breaker_state"] == int(BreakerState.OPEN)
        refused = tier.submit_write(victims, host.pool, list(range(len(victims))))
        assert refused.refused == victims and refused.keys == []
        assert tier.stats()["writes_refused_breaker"] == len(victims)
        assert tier.contains(keys) == [False] * len(keys) and tier.probe(keys) is False
        assert wait_result(tier, refused.job_id).ok_keys == []
    finally:
        cluster.restart(0)

    # Recovery by itself: each cool-down lets one probe through, until one succeeds.
    for _ in range(30):
        clock.advance(breaker.max_cooldown_s)
        ticket, w = write(tier, host, victims)
        if w.success:
            break
    else:
        raise AssertionError(f"the tier did not recover after the node came back: {tier.stats()}")
    assert breaker.state is BreakerState.CLOSED
    got, slots = read(tier, host, victims, first_slot=40)
    assert got.success and [host.get(s) for s in slots] == [block_payload(k) for k in victims]
    still_serving(tier, host)


def test_a_stopped_node_costs_the_deadline_and_an_abandoned_read_never_writes_its_slots(cluster, tiers, host) -> None:
    clock = FakeClock()
    # One worker: a job queued behind the stuck one runs only once that one is done with it.
    # A socket timeout longer than the pause: the stuck read gets its (valid) value after resume.
    tier = tiers(cluster, timeout_s=60.0, clock=clock, deadline_s=1.0, workers=1)
    keys = bkeys(30, b"stop")
    _, res = write(tier, host, keys)
    assert res.success
    groups = by_node(cluster, keys)
    victim, bystander = groups[1][0], groups[2][0]

    cluster.pause(1)
    try:
        host.put(50, OLD)
        job = tier.submit_read([victim], host.pool, [50])
        wjob = tier.submit_write(bkeys(1, b"late"), host.pool, [51])  # queued behind the read
        assert tier.poll() == []  # within the deadline: nothing reported yet
        clock.advance(1.5)
        done = {r.job_id: r for r in tier.poll()}
        assert set(done) == {job, wjob.job_id}
        assert done[job].failed_keys == [victim] and not done[job].success
        assert done[wjob.job_id].failed_keys == bkeys(1, b"late")
        st = tier.stats()
        assert st["deadline_exceeded"] == 2 and st["miss_error"] == 1 and st["jobs_in_flight"] == 0
        assert st["write_bytes_in_flight"] == 0
        # The slot is the caller's again: it reuses it at once.
        host.put(50, OLD)
    finally:
        cluster.resume(1)
    cluster.wait_ok()

    # A job behind the stuck one (one worker) finishes only after it: the stuck read has had its
    # value by then, verified, and dropped it.
    got, slots = read(tier, host, [bystander], first_slot=60)
    assert got.success and host.get(slots[0]) == block_payload(bystander)
    assert host.get(50) == OLD
    assert tier.stats()["hits"] == 1
    # The abandoned write (its slot never copied out) stored nothing.
    rc = plain_client(cluster)
    try:
        assert rc.exists(tier._store_key(bkeys(1, b"late")[0])) == 0
    finally:
        rc.close()
    still_serving(tier, host)


def test_a_read_that_fails_after_its_deadline_is_counted_once(cluster, tiers, host) -> None:
    clock = FakeClock()
    # A socket timeout the stop outlasts: the stuck read fails with an error after poll has
    # abandoned it already, and its key must not be counted a second time.
    tier = tiers(cluster, timeout_s=1.0, clock=clock, deadline_s=1.0, workers=1)
    keys = bkeys(30, b"twice")
    _, res = write(tier, host, keys)
    assert res.success
    groups = by_node(cluster, keys)
    victim, bystander = groups[0][0], groups[2][0]
    cluster.pause(0)
    try:
        host.put(50, OLD)
        job = tier.submit_read([victim], host.pool, [50])
        behind = tier.submit_read([bystander], host.pool, [51])  # runs once the stuck one is done
        clock.advance(1.5)
        done = {r.job_id: r for r in tier.poll()}
        assert done[job].failed_keys == [victim]
        assert done[behind].failed_keys == [bystander]  # both past the deadline
        third = wait_result(tier, tier.submit_read([bystander], host.pool, [52]))  # behind both
    finally:
        cluster.resume(0)
    cluster.wait_ok()
    st = tier.stats()
    assert st["deadline_exceeded"] == 2 and st["read_errors"] >= 1
    # One miss a key: the two abandoned, and the third job's key if it failed too (the cluster
    # may call itself down while a node is stopped).
    assert st["miss_error"] == 2 + len(third.failed_keys)
    assert host.get(50) == OLD
    clock.advance(60)  # past the breaker's longest cool-down, if those failures opened it
    still_serving(tier, host)


# ---- the server's own states ------------------------------------------------------------------


@pytest.fixture(scope="module")
def small_cluster(tmp_path_factory: pytest.TempPathFactory):
    with running_cluster(Path(tmp_path_factory.mktemp("small")), maxmemory="4mb") as c:
        # allkeys-lru would evict to make room; noeviction refuses writes instead (OOM).
        c.config_set("maxmemory-policy", "noeviction")
        yield c


def test_a_full_server_refuses_writes_counted_and_reads_go_on(small_cluster, tiers, host) -> None:
    tier = tiers(small_cluster)
    first = bkeys(30, b"early")
    _, res = write(tier, host, first)
    assert res.success
    # ~12 MB of values into 3 x 4 MB: the server runs full partway.
    flood = bkeys(2000, b"flood")
    ticket = tier.submit_write(flood, host.pool, [i % 100 for i in range(len(flood))])
    w = wait_result(tier, ticket.job_id)
    st = tier.stats()
    assert not w.success and st["writes_refused_full"] == len(w.failed_keys) > 0
    assert st["writes_ok"] == 30 + len(w.ok_keys) and st["write_errors"] == 0
    assert set(w.ok_keys) | set(w.failed_keys) == set(flood)
    # Refused writes are not known present; the early blocks are still read, byte for byte.
    assert tier.contains(w.failed_keys[:5]) == [False] * 5
    got, slots = read(tier, host, first, first_slot=60)
    assert got.success and [host.get(s) for s in slots] == [block_payload(k) for k in first]


def test_a_full_server_answers_the_breakers_probe(small_cluster, tiers, host) -> None:
    # The store refusing writes (OOM) is a store that answers: the probe a write carries after
    # a cool-down gets its outcome, and the breaker neither stays probing nor reopens.
    clock = FakeClock()
    breaker = CircuitBreaker(failures=1, cooldown_s=1.0, max_cooldown_s=1.0, clock=clock)
    tier = tiers(small_cluster, clock=clock, breaker=breaker, prefix="probe-full")
    small_cluster.config_set("maxmemory", "1mb")  # below what each node holds: every write refused
    try:
        breaker.failed()
        clock.advance(1.0)
        for tag in (b"probe1", b"probe2"):
            ticket, res = write(tier, host, bkeys(1, tag))
            assert ticket.keys == bkeys(1, tag), f"the write was not sent: breaker {breaker.state!r}"
            assert res.failed_keys == bkeys(1, tag)
        assert breaker.state is BreakerState.CLOSED
        assert tier.stats()["writes_refused_full"] == 2
    finally:
        small_cluster.config_set("maxmemory", "4mb")


def test_after_flushall_reads_are_absent_misses_and_the_tier_serves_on(cluster, tiers, host) -> None:
    tier = tiers(cluster)
    keys = bkeys(10, b"flush")
    write(tier, host, keys)
    assert tier.contains(keys) == [True] * 10
    cluster.flushall()
    got, slots = read(tier, host, keys, first_slot=20)
    assert got.failed_keys == keys and misses(tier) == {"absent": 10}
    assert all(host.get(s) == bytes([0xEE]) * BLOCK for s in slots)
    assert tier.contains(keys) == [False] * 10  # the misses taught it
    _, res = write(tier, host, keys)  # written again, not skipped as known
    assert res.ok_keys == keys and tier.stats()["writes_ok"] == 20
    still_serving(tier, host)


# ---- credentials ------------------------------------------------------------------------------

PASSWORD = "correct horse battery staple"


@pytest.fixture(scope="module")
def locked_cluster(tmp_path_factory: pytest.TempPathFactory):
    with running_cluster(Path(tmp_path_factory.mktemp("locked")), password=PASSWORD) as c:
        yield c


@pytest.mark.parametrize("password", ["wrong", None], ids=["wrong-password", "no-password"])
def test_a_refused_login_is_counted_never_raised_and_opens_the_breaker(locked_cluster, tiers, host, password) -> None:
    clock = FakeClock()
    breaker = CircuitBreaker(failures=3, cooldown_s=1.0, clock=clock)
    tier = tiers(locked_cluster, password=password, clock=clock, breaker=breaker)
    keys = bkeys(2, b"auth")
    _, w = write(tier, host, keys)
    assert w.failed_keys == keys and tier.stats()["write_errors"] == 1
    got, _ = read(tier, host, keys, first_slot=10)
    assert got.failed_keys == keys and tier.stats()["read_errors"] == 1
    assert tier.probe(keys) and tier.wait_idle(120)
    st = tier.stats()
    assert st["probe_errors"] == 1 and st["miss_error"] == 2
    assert breaker.state is BreakerState.OPEN and breaker.trips == 1
    assert tier.submit_write(keys, host.pool, [0, 1]).refused == keys
    assert locked_cluster.dbsize() == 0
    # A failed probe answers "absent" for absent_ttl_s (lookups go on as misses), then forgets.
    assert [tier.known(k) for k in keys] == [False, False]
    clock.advance(tier.absent_ttl_s + 0.1)
    assert [tier.known(k) for k in keys] == [None, None]


@pytest.mark.parametrize("source", ["env", "file"])
def test_the_right_password_from_env_or_file_opens_the_store(
    locked_cluster, tiers, host, tmp_path, monkeypatch, source
):
    if source == "env":
        monkeypatch.setenv("KV_TEST_PW", PASSWORD)
        monkeypatch.delenv(DEFAULT_PASSWORD_ENV, raising=False)
        password = read_password("KV_TEST_PW", None)
    else:
        (tmp_path / "pw").write_text(PASSWORD + "\n")
        password = read_password(None, str(tmp_path / "pw"))
    assert password == PASSWORD
    tier = tiers(locked_cluster, password=password, prefix=f"pw-{source}")
    still_serving(tier, host)
    assert tier.stats()["write_errors"] == tier.stats()["read_errors"] == 0


# ---- replicas and restarts --------------------------------------------------------------------


def test_a_restarted_engine_finds_the_blocks_the_old_one_wrote(cluster, tiers, host) -> None:
    old = tiers(cluster)
    keys = bkeys(12, b"persist")
    write(old, host, keys)
    old.close()
    new = tiers(cluster)
    assert new.contains(keys) == [False] * 12  # nothing learned yet
    assert new.probe(keys) and new.wait_idle(120)
    assert new.contains(keys) == [True] * 12
    got, slots = read(new, host, keys, first_slot=30)
    assert got.success and [host.get(s) for s in slots] == [block_payload(k) for k in keys]
    assert new.stats()["hits"] == 12
