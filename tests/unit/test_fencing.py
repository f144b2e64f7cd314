"""Fencing: the target's decision (owners.refusal), its durable record (OwnerBook), and the
initiator's side over the in-memory transport: a replica another primary claimed is never
claimed, written, or resynced by the old one."""

from __future__ import annotations

import json
from pathlib import Path

import trio
import trio.testing
from mempool import new_pool
from memtransport import MemTarget, MemTransport

from rpmemfs.mountd.assemble import unanswered
from rpmemfs.pool.layout import epoch_gen, next_epoch, show_epoch
from rpmemfs.replica import ReplicaSet, ReplicaSpec
from rpmemfs.replica.fencing import Claim, Probe, ask_owners, probe_one, probe_replicas
from rpmemfs.target.owners import Owner, OwnerBook, refusal
from rpmemfs.target.pooldir import PoolDir
from rpmemfs.transport.base import TransportError

G1 = next_epoch(0, 0x1111)
G2A = next_epoch(G1, 0xAAAA)
G2B = next_epoch(G1, 0xBBBB)
G3 = next_epoch(G2A, 0x3333)


def test_a_normal_claim_is_let_in_where_this_lineage_left_the_pool() -> None:
    assert refusal(None, G1, G2A, False) is None  # nobody claimed it yet
    assert refusal(Owner(G1), G1, G2A, False) is None  # where this initiator left it
    assert refusal(Owner(G2A), G1, G2A, False) is None  # a reconnect within one mount
    assert refusal(Owner(G1), G2A, G3, False) is None  # a replica that missed a mount


def test_a_normal_claim_is_refused_once_another_initiator_claimed_the_pool() -> None:
    why = refusal(Owner(G2B, {"host": "nodeB", "pid": 7}), G1, G2A, False)
    assert why and "nodeB" in why and "taken over" in why
    # The owner it holds now, and the epoch the initiator claims under (not the one before).
    assert show_epoch(G2B) in why and show_epoch(G2A) in why and show_epoch(G1) not in why
    assert refusal(Owner(G3), G1, G2A, False)  # a generation ahead
    assert refusal(Owner(G2B), G2A, G3, False)  # same generation, another nonce


def test_no_claim_moves_the_recorded_epoch_back_whatever_prev_it_names() -> None:
    # prev = the record, as a client that read it (probe) can always say, or a later one.
    for prev in (G2A, G3):
        for cur in (0, G1, G2A - 1, G2A + 1, G2B):
            why = refusal(Owner(G2A, {"host": "nodeA"}), prev, cur, False)
            assert why and "nodeA" in why, (show_epoch(prev), show_epoch(cur))
            assert "only rise" in why or "taken over" in why, why
    assert refusal(Owner(G2A), G2A, G3, False) is None  # the next generation: rising
    assert refusal(Owner(G2A), G3, G2A, False) is None  # at the record itself: a reconnect
    for cur in (0, G1, G2A):  # takeovers too: never below the record, nor at it
        assert refusal(Owner(G2A), G2A, cur, True)


def test_takeovers_need_a_higher_epoch_so_exactly_one_of_two_racing_wins() -> None:
    low, high = sorted((G2A, G2B))
    for first, second in ((low, high), (high, low)):
        owner = Owner(G1)
        assert refusal(owner, G1, first, True) is None
        owner = Owner(first)
        # the second takeover wins only if its epoch is the higher one, whatever the order
        assert (refusal(owner, G1, second, True) is None) == (second == high)
    assert refusal(Owner(G2A), G1, G2A, True)  # not above: refused


def test_the_owner_record_is_durable_and_atomic(tmp_path: Path) -> None:
    book = OwnerBook(PoolDir(str(tmp_path)))
    assert book.get("app") is None
    book.set("app", Owner(G2A, {"host": "h", "pid": 1}, 123.0))
    again = OwnerBook(PoolDir(str(tmp_path))).get("app")  # read back from disk, not the cache
    assert again == Owner(G2A, {"host": "h", "pid": 1}, 123.0)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".app.owner"]  # no temp file left
    (tmp_path / ".app.owner").write_text("{not json")
    assert OwnerBook(PoolDir(str(tmp_path))).get("app") is None  # unreadable: the header's epoch fences
    book.forget("app")
    assert not (tmp_path / ".app.owner").exists()


def test_holder_fields_are_checked() -> None:
    from rpmemfs.target.owners import clean_holder

    assert clean_holder({"host": "h" * 1000, "pid": "7", "evil": 1, "pool": "/p"}) == {
        "host": "h" * 256, "pool": "/p"}
    assert clean_holder([1, 2]) == {}
    json.dumps(clean_holder({"host": "x", "pid": 3}))


class Rig:
    def __init__(self) -> None:
        self.buf, self.hdr = new_pool()
        self.transport = MemTransport()
        self.targets = [self.transport.add(MemTarget(f"10.0.0.{i + 1}:7420")) for i in range(2)]
        for t in self.targets:
            t.pools["app"] = bytearray(self.buf)
        self.specs = [ReplicaSpec.make(t.address, "app") for t in self.targets]

    async def open(self, prev: int, cur: int) -> ReplicaSet:
        return await ReplicaSet.open(self.specs, memoryview(self.buf), self.hdr.uuid, None, lanes=1,
                                     timeout=2.0, min_replicas=0, transport=self.transport,
                                     epoch=(prev, cur), holder={"host": "me"})


def test_an_old_primary_never_claims_or_writes_a_replica_another_one_claimed() -> None:
    rig = Rig()
    rig.targets[1].owners["app"] = Owner(G2B, {"host": "new-primary"})

    async def main() -> None:
        probes = await probe_replicas(rig.specs, None, 2.0, rig.transport)
        assert [p.newer_than(G1) for p in probes] == [False, True]
        assert "new-primary" in probes[1].owned_by()
        rs = await rig.open(G1, G2A)
        try:
            assert [r.state for r in rs.replicas] == ["in-sync", "stale"]
            assert "taken over" in (rs.replicas[1].last_error or "")
            assert "new-primary" in (rs.replicas[1].last_error or "")
            # This mount's epoch (what its status shows) and the owner's; not the pool's before.
            why = rs.replicas[1].last_error or ""
            assert {show_epoch(e) for e in (G1, G2A, G2B) if show_epoch(e) in why} == {
                show_epoch(G2A), show_epoch(G2B)}, why
            held = rs.taken_over() or ""
            assert f"replica {rig.specs[1]} is held by " in held and "new-primary" in held, held
            assert str(rig.specs[0]) not in held, held
            rig.buf[8192:8200] = b"changed!"
            await rs.barrier([(8192, 8)])
        finally:
            await rs.aclose()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    assert rig.targets[0].owners["app"].epoch == G2A  # claimed, with who claimed it
    assert rig.targets[0].owners["app"].holder == {"host": "me"}
    assert rig.targets[1].owners["app"].epoch == G2B  # left to its owner...
    assert rig.targets[1].pools["app"][8192:8200] != b"changed!"  # ...and never written
    assert not [op for op in rig.targets[1].ops if op[0] == "write"]


def test_a_mount_moves_its_epoch_only_to_claim_replicas_nobody_else_holds() -> None:
    """ask_owners: what a mount decides before it claims (mountd/assemble.py, step 3)."""
    rig = Rig()

    async def ask(takeover: bool = False) -> Claim:
        return await ask_owners(rig.specs, G1, None, 2.0, rig.transport, takeover=takeover)

    async def main() -> None:
        claim = await ask()  # nobody claimed them since G1: the next generation
        assert not claim.taken and not claim.fencing and len(claim.reachable) == 2
        assert epoch_gen(claim.epoch) == epoch_gen(G1) + 1 and claim.epochs == (G1, claim.epoch)
        rig.targets[0].drop()
        rig.targets[1].drop()
        claim = await ask()  # none reachable: nothing records a new epoch, so it stays
        assert claim.epoch == G1 and not claim.reachable
        rig.targets[0].restart()
        rig.targets[1].restart()
        rig.targets[1].owners["app"] = Owner(G2B, {"host": "new-primary"})
        claim = await ask()  # taken over: the epoch stays, the holder is named
        assert claim.epoch == G1 and [p.spec for p in claim.taken] == [rig.specs[1]]
        assert f"replica {rig.specs[1]} is held by " in claim.held_by() and "new-primary" in claim.held_by()
        claim = await ask(takeover=True)  # above every epoch seen, fencing the owner
        assert not claim.taken and [p.spec for p in claim.fencing] == [rig.specs[1]]
        assert epoch_gen(claim.epoch) == epoch_gen(G2B) + 1 and claim.epochs == (claim.epoch, claim.epoch)

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    # Asked, never claimed: no owner recorded where there was none, the other one left as it was.
    assert "app" not in rig.targets[0].owners and rig.targets[1].owners["app"].epoch == G2B


# ------------------------------------------------------------------ an unfinished resync


def test_a_resync_is_marked_on_the_target_before_its_first_write_and_cleared_once_joined() -> None:
    rig = Rig()
    rig.buf[8192:8200] = b"changed!"  # replica 1 misses this; replica 0 is compared clean
    rig.targets[0].pools["app"][8192:8200] = b"changed!"

    async def main() -> None:
        rs = await rig.open(G1, G1)
        await rs.aclose()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    for t in rig.targets:
        marks = [(i, op[2]) for i, op in enumerate(t.ops) if op[0] == "resync"]
        writes = [i for i, op in enumerate(t.ops) if op[0] == "write"]
        if t is rig.targets[1]:
            # Every resync write lies between the mark and its clearing.
            assert [m for _, m in marks] == [1, 0], t.ops
            assert writes and marks[0][0] < min(writes) and max(writes) < marks[1][0], t.ops
        assert t.owners["app"].resync is None
        assert t.pools["app"][8192:8200] == b"changed!"


def test_a_mark_left_by_a_killed_resync_survives_claims_until_a_resync_ends() -> None:
    rig = Rig()
    left = {"since": 5.0, "by": "a mount killed mid-resync"}
    rig.targets[1].owners["app"] = Owner(G1, {"host": "old"}, 1.0, left)

    async def main() -> None:
        probes = await probe_replicas(rig.specs, None, 2.0, rig.transport)
        assert probes[0].resync is None
        assert probes[1].resync is not None
        rs = await rig.open(G1, G2A)  # nothing to send, but its compare is a resync all the same
        try:
            assert [r.state for r in rs.replicas] == ["in-sync", "in-sync"]
        finally:
            await rs.aclose()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    ops = [op[2] for op in rig.targets[1].ops if op[0] == "resync"]
    assert ops == [0]  # already marked: not marked again, and cleared once in sync
    assert rig.targets[1].owners["app"] == Owner(G2A, {"host": "me"})


def test_the_owner_record_keeps_a_resync_mark(tmp_path: Path) -> None:
    book = OwnerBook(PoolDir(str(tmp_path)))
    marked = Owner(G2A, {"host": "h"}, 2.0, {"since": 3.0, "by": "h (pid 1)"})
    book.set("app", marked)
    again = OwnerBook(PoolDir(str(tmp_path))).get("app")
    assert again == marked
    assert again is not None and "h (pid 1)" in (again.resync_text() or "")
    assert again.as_dict()["resync"] == {"since": 3.0, "by": "h (pid 1)"}
    (tmp_path / ".app.owner").write_text(json.dumps({"epoch": G2A, "resync": "garbage"}))
    unreadable = OwnerBook(PoolDir(str(tmp_path))).get("app")
    assert unreadable is not None and unreadable.resync is not None  # still marked: it was set


class _Unanswering:
    """A transport whose connect fails as told: "silent" answers nothing (the deadline ends
    it), "timeout" is the transport's own deadline, "refused" a target that said no."""

    def __init__(self, how: str) -> None:
        self.how = how

    async def connect(self, address: str, token: bytes | None, lanes: int = 0, timeout: float = 0.0) -> None:
        if self.how == "silent":
            await trio.sleep_forever()
        raise TransportError(address, "timed out after 1s connecting" if self.how == "timeout"
                             else "target refused the connection: no answer within reason",
                             lane_lost=True, timed_out=self.how == "timeout")


def test_a_mount_skips_only_replicas_that_answered_nothing_however_the_error_reads() -> None:
    specs = {how: ReplicaSpec.parse(f"127.0.0.{i + 1}:7000/{how}")
             for i, how in enumerate(("silent", "timeout", "refused"))}

    async def main() -> list[Probe]:
        return [await probe_one(spec, None, 1.0, _Unanswering(how))  # type: ignore[arg-type]
                for how, spec in specs.items()]

    probes = trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    assert [p.timed_out for p in probes] == [True, True, False]
    # A refusal that happens to say "no answer within" is still an answer.
    claim = Claim(prev=G1, epoch=G1, takeover=False, probes=probes)
    assert set(unanswered(claim)) == {str(specs["silent"]), str(specs["timeout"])}
