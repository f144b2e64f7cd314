"""The target's admission of connections (target/admission.py): a flood of handshakes from one
peer or from many never pushes out a client that is about to authenticate, and the caps hold
exactly; authenticated connections are capped per token with room kept for admin tokens, and
only connections that hold nothing are pushed out; failed proofs are throttled per address,
per key id and in all."""

from __future__ import annotations

import pytest

from rpmemfs.target.admission import (
    FAILURE_MEMORY,
    FIRST_FAILURE_DELAY,
    GLOBAL_FAILURE_BURST,
    GLOBAL_FAILURE_RATE,
    MAX_FAILING_PEERS,
    MAX_FAILURE_DELAY,
    Admission,
    Connection,
    FailedProofs,
    Full,
)


def test_one_peer_over_its_cap_pushes_out_only_its_own_oldest() -> None:
    a = Admission(max_connections=10, max_handshakes=100, max_per_peer=3)
    client = a.begin("10.0.0.1")
    flood = [a.begin("10.0.0.66") for _ in range(50)]
    assert client is not None and not client.dropped
    assert a.handshakes == 4  # the client's and the flooder's newest three
    alive = [h for h in flood if h is not None and not h.dropped]
    assert alive == flood[-3:]
    assert all(h is not None and h.scope.cancel_called for h in flood[:-3])
    a.authenticate(client, "t", admin=True)
    assert a.authenticated == 1 and a.handshakes == 3


def test_the_total_cap_pushes_out_the_biggest_flooders_first() -> None:
    a = Admission(max_connections=10, max_handshakes=64, max_per_peer=8)
    client = a.begin("10.0.0.1")
    for i in range(5000):
        assert a.begin(f"10.1.{i % 40}.1") is not None  # 40 addresses, each over its share
    assert client is not None and not client.dropped
    assert a.handshakes == 64
    a.authenticate(client, "t", admin=True)


def test_at_a_tie_the_oldest_handshake_goes() -> None:
    a = Admission(max_connections=10, max_handshakes=4, max_per_peer=8)
    old = [a.begin(f"10.1.0.{i}") for i in range(4)]
    client = a.begin("10.0.0.1")  # every peer holds one: the oldest (an idle one) makes room
    assert client is not None and not client.dropped
    assert old[0] is not None and old[0].dropped
    assert [h is not None and h.dropped for h in old[1:]] == [False] * 3


def test_handshake_slots_come_back_and_authenticated_connections_have_their_own_cap() -> None:
    a = Admission(max_connections=2, max_handshakes=4, max_per_peer=4)
    first, second = a.begin("h"), a.begin("h")
    assert first is not None and second is not None
    held = a.authenticate(first, "t", admin=True)
    a.authenticate(second, "t", admin=True)
    assert a.handshakes == 0
    third = a.begin("h")
    assert third is None  # nothing a handshake could win is left
    a.end_authenticated(held)
    a.end_authenticated(held)  # (counted once)
    assert a.authenticated == 1
    fourth = a.begin("h")
    assert fourth is not None
    a.end_handshake(fourth)
    a.end_handshake(fourth)  # ending twice (failed, then closed) is harmless
    assert a.handshakes == 0


def test_caps_below_one_are_refused() -> None:
    with pytest.raises(ValueError):
        Admission(max_connections=0)


def test_failed_proofs_are_answered_ever_later_per_peer_and_forgotten() -> None:
    now = [100.0]
    fp = FailedProofs(clock=lambda: now[0])
    delays = []
    for i in range(8):
        delays.append(fp.failed("10.0.0.1", bytes([i])))  # a key id of its own each time
        now[0] += 1  # (slower than the global rate)
    assert delays == sorted(delays) and delays[0] == FIRST_FAILURE_DELAY
    assert delays[-1] == MAX_FAILURE_DELAY  # capped below the handshake deadline
    # Another address, another key id, starts from the first delay: one peer's failures
    # cost only itself.
    assert fp.failed("10.0.0.2", b"other") == FIRST_FAILURE_DELAY
    # Quiet for longer than the memory: forgotten.
    now[0] += FAILURE_MEMORY + 1
    assert fp.failed("10.0.0.1", b"\x00") == FIRST_FAILURE_DELAY
    assert fp.total == 10


def test_failed_proofs_are_answered_ever_later_per_key_id_whatever_the_address() -> None:
    """Issue 30, item 9: a guesser that binds a fresh loopback address for each guess."""
    now = [100.0]
    fp = FailedProofs(clock=lambda: now[0])
    delays = []
    for i in range(8):
        delays.append(fp.failed(f"127.0.{i}.1", b"alice's key id"))
        now[0] += 1
    assert delays == sorted(delays) and delays[-1] == MAX_FAILURE_DELAY
    # Every key id the target does not know counts as one.
    unknown = []
    for i in range(8):
        unknown.append(fp.failed(f"127.1.{i}.1", None))
        now[0] += 1
    assert unknown == delays
    assert fp.failed("127.2.0.1", b"bob's key id") == FIRST_FAILURE_DELAY


def test_beyond_a_burst_of_failures_in_all_every_failure_waits_the_longest() -> None:
    """Fresh addresses and fresh key ids each time: only the global count holds them."""
    now = [100.0]
    fp = FailedProofs(clock=lambda: now[0])
    burst = [fp.failed(f"10.0.0.{i}", bytes([i])) for i in range(GLOBAL_FAILURE_BURST)]
    assert burst == [FIRST_FAILURE_DELAY] * GLOBAL_FAILURE_BURST
    assert fp.failed("10.0.1.1", b"new") == MAX_FAILURE_DELAY
    # At the global rate or slower, quick answers again (after the bucket drained).
    now[0] += 2 * GLOBAL_FAILURE_BURST / GLOBAL_FAILURE_RATE
    steady = []
    for i in range(20):
        steady.append(fp.failed(f"10.0.2.{i}", bytes([100 + i])))
        now[0] += 1 / GLOBAL_FAILURE_RATE
    assert steady == [FIRST_FAILURE_DELAY] * 20


def test_failed_proofs_remember_a_bounded_number_of_peers_and_key_ids() -> None:
    fp = FailedProofs()
    for i in range(MAX_FAILING_PEERS + 100):
        fp.failed(f"peer{i}", i.to_bytes(4))
    assert len(fp._peers) == MAX_FAILING_PEERS and len(fp._keys) == MAX_FAILING_PEERS
    assert "peer0" not in fp._peers and f"peer{MAX_FAILING_PEERS + 99}" in fp._peers


# --------------------------------------------------------------------------- authenticated


def _connect(a: Admission, token: str, admin: bool = False, cap: int | None = None,
             empty: bool = True) -> Connection:
    hs = a.begin("10.0.0.1")
    assert hs is not None
    conn = a.authenticate(hs, token, admin, cap)
    conn.idle_and_empty = lambda: empty
    return conn


def test_a_token_over_its_cap_pushes_out_only_its_own_that_hold_nothing() -> None:
    a = Admission(max_connections=100, max_per_token=4, admin_reserve=10)
    bob = _connect(a, "bob")
    holding = _connect(a, "alice", empty=False)  # a session with a pool open: never pushed out
    flood = [_connect(a, "alice") for _ in range(3)]
    newest = _connect(a, "alice")
    assert flood[0].dropped and flood[0].scope.cancel_called
    assert not any(c.dropped for c in (bob, holding, *flood[1:], newest))
    assert a.token_connections("alice") == 4 and a.pushed_out == 1
    for c in flood[1:]:
        c.idle_and_empty = lambda: False
    newest.idle_and_empty = lambda: False
    with pytest.raises(Full, match="token 'alice' has 4 connections open, its cap"):
        _connect(a, "alice")
    assert a.token_connections("alice") == 4 and a.authenticated == 5
    # Its own line's cap, above the default.
    _connect(a, "alice", cap=5)
    assert a.token_connections("alice") == 5


def test_pools_tokens_leave_the_reserve_to_admin_tokens() -> None:
    a = Admission(max_connections=10, max_per_token=100, admin_reserve=3)
    alice = [_connect(a, "alice", empty=False) for _ in range(7)]
    with pytest.raises(Full, match="the 7 connections .* pools tokens may use are all open"):
        _connect(a, "bob")
    late = a.begin("10.0.0.9")  # begun while a slot was left
    admins = [_connect(a, "default", admin=True, empty=False) for _ in range(3)]
    assert late is not None
    with pytest.raises(Full, match="at most 10 connections"):
        a.authenticate(late, "default", admin=True)
    assert a.authenticated == 10 and a.begin("10.0.0.2") is None
    # One of alice's lets its pool go: the next newcomer, admin or not, takes its place.
    alice[3].idle_and_empty = lambda: True
    assert a.begin("10.0.0.2") is not None
    _connect(a, "bob")
    assert alice[3].dropped and not any(c.dropped for c in alice[:3] + alice[4:] + admins)


def test_over_the_shared_cap_the_token_with_the_most_makes_room() -> None:
    a = Admission(max_connections=12, max_per_token=100, admin_reserve=2)
    carol = [_connect(a, "carol") for _ in range(3)]  # older, but fewer
    alice = [_connect(a, "alice") for _ in range(7)]
    _connect(a, "bob")
    assert alice[0].dropped and not any(c.dropped for c in carol + alice[1:])
    _connect(a, "default", admin=True)  # (the reserve: nobody pushed out)
    _connect(a, "default", admin=True)
    assert a.pushed_out == 1 and a.authenticated == 12


def test_the_reserve_must_leave_pools_tokens_something() -> None:
    with pytest.raises(ValueError):
        Admission(max_connections=10, admin_reserve=10)
