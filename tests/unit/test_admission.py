"""The target's admission of connections before they authenticate (target/admission.py): a
flood of handshakes from one peer or from many never pushes out a client that is about to
authenticate, and the caps hold exactly."""

from __future__ import annotations

import pytest

from rpmemfs.target.admission import (
    FAILURE_MEMORY,
    FIRST_FAILURE_DELAY,
    MAX_FAILING_PEERS,
    MAX_FAILURE_DELAY,
    Admission,
    FailedProofs,
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
    assert a.authenticate(client) and a.authenticated == 1 and a.handshakes == 3


def test_the_total_cap_pushes_out_the_biggest_flooders_first() -> None:
    a = Admission(max_connections=10, max_handshakes=64, max_per_peer=8)
    client = a.begin("10.0.0.1")
    for i in range(5000):
        assert a.begin(f"10.1.{i % 40}.1") is not None  # 40 addresses, each over its share
    assert client is not None and not client.dropped
    assert a.handshakes == 64
    assert a.authenticate(client)


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
    assert a.authenticate(first) and a.authenticate(second)
    assert a.handshakes == 0
    third = a.begin("h")
    assert third is None  # nothing a handshake could win is left
    a.end_authenticated()
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
    delays = [fp.failed("10.0.0.1") for _ in range(8)]
    assert delays == sorted(delays) and delays[0] == FIRST_FAILURE_DELAY
    assert delays[-1] == MAX_FAILURE_DELAY  # capped below the handshake deadline
    # Another address starts from the first delay: one peer's failures cost only itself.
    assert fp.failed("10.0.0.2") == FIRST_FAILURE_DELAY
    # Quiet for longer than the memory: forgotten.
    now[0] += FAILURE_MEMORY + 1
    assert fp.failed("10.0.0.1") == FIRST_FAILURE_DELAY
    assert fp.total == 10


def test_failed_proofs_remember_a_bounded_number_of_peers() -> None:
    fp = FailedProofs()
    for i in range(MAX_FAILING_PEERS + 100):
        fp.failed(f"peer{i}")
    assert len(fp._peers) == MAX_FAILING_PEERS
    assert "peer0" not in fp._peers and f"peer{MAX_FAILING_PEERS + 99}" in fp._peers
