"""Where every copy of the pool stands, before a promote chooses one.

For each node: its copy's uuid, header epoch and position stamp (pool/position.py: the log
sequence number of the last point it holds), and whether its target marks a resync of it as
cut short. This node's copy is read from its file (its target daemon is stopped first, so
nothing writes it); the others are asked of their targets, in parallel, without claiming
anything: a promote that stops here must not have fenced anyone.
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass, field

import trio

from rpmemfs.ha.config import HaConfig, Node
from rpmemfs.pool import position
from rpmemfs.pool.header import read_header
from rpmemfs.pool.layout import BLOCK, PoolFormatError
from rpmemfs.replica.fencing import read_probe
from rpmemfs.transport.base import TransportError
from rpmemfs.transport.choose import transport_for


@dataclass(frozen=True)
class Copy:
    node: str
    local: bool
    uuid: bytes
    size: int
    epoch: int  # the header's: the primary that last wrote it
    position: position.Position | None
    resync: str | None = None  # who began a resync of it that did not end

    @property
    def seq(self) -> int:
        return self.position.seq if self.position else -1


@dataclass
class Survey:
    copies: list[Copy] = field(default_factory=list)
    reached: list[str] = field(default_factory=list)  # nodes that answered, this one included
    unreached: dict[str, str] = field(default_factory=dict)  # node: why not
    unusable: dict[str, str] = field(default_factory=dict)  # node: why its copy is no copy

    def describe(self) -> str:
        parts = [f"{c.node}: epoch {c.epoch >> 32}, seq {c.seq}"
                 + (" (resync unfinished)" if c.resync else "") for c in self.copies]
        parts += [f"{n}: no copy ({why})" for n, why in self.unusable.items()]
        parts += [f"{n}: not reached ({why})" for n, why in self.unreached.items()]
        return "; ".join(parts)


def _copy_from(node: str, local: bool, head: bytes, size: int, resync: str | None = None) -> Copy:
    hdr, _ = read_header(memoryview(head))  # PoolFormatError when neither header copy is intact
    if hdr.pool_size != size:
        raise PoolFormatError(f"header says {hdr.pool_size} bytes, the pool is {size}")
    return Copy(node, local, hdr.uuid, size, hdr.epoch,
                position.decode(head[position.POSITION_OFF:position.POSITION_OFF + position.SIZE]),
                resync)


def local_copy(cfg: HaConfig, survey: Survey) -> None:
    survey.reached.append(cfg.me)
    try:
        fd = os.open(cfg.pool_path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        survey.unusable[cfg.me] = f"{cfg.pool_path} does not exist"
        return
    except OSError as e:
        survey.unusable[cfg.me] = f"{cfg.pool_path}: {e.strerror}"
        return
    try:
        head = os.pread(fd, 2 * BLOCK, 0)
        size = os.fstat(fd).st_size
    finally:
        os.close(fd)
    try:
        survey.copies.append(_copy_from(cfg.me, True, head, size))
    except PoolFormatError as e:
        survey.unusable[cfg.me] = f"{cfg.pool_path}: {e}"


async def _remote_copy(cfg: HaConfig, node: Node, token: bytes | None, survey: Survey) -> None:
    spec = cfg.spec(node)
    tp = transport_for(spec.transport, wire_protection=cfg.wire_protection)
    try:
        with trio.fail_after(cfg.probe_timeout):
            async with await tp.connect(spec.address, token, lanes=1,
                                        timeout=cfg.probe_timeout) as session:
                try:
                    probe = read_probe(spec, await session.probe_pool(spec.name))
                except TransportError as e:
                    if e.lane_lost:
                        raise
                    survey.reached.append(node.name)  # it answered: it has no such pool
                    survey.unusable[node.name] = e.reason
                    return
                region = await session.open_pool(spec.name)
                head = await session.lanes[0].read(region, 0, 2 * BLOCK)
    except trio.TooSlowError:
        survey.unreached[node.name] = f"no answer within {cfg.probe_timeout:g}s"
        return
    except TransportError as e:
        survey.unreached[node.name] = str(e)
        return
    survey.reached.append(node.name)
    try:
        survey.copies.append(_copy_from(node.name, False, head, region.size, probe.resync))
    except PoolFormatError as e:
        survey.unusable[node.name] = str(e)


def partition_members() -> set[str] | None:
    """The nodes in this node's cluster partition (`crm_node -p`), or None when there is no
    cluster to ask (a manual run, ocf-tester)."""
    try:
        done = subprocess.run(["crm_node", "-p"], capture_output=True, text=True, timeout=5,
                              check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    names = set(done.stdout.split())
    return names if done.returncode == 0 and names and not done.stderr.strip() else None


async def survey(cfg: HaConfig, token: bytes | None, members: set[str] | None = None) -> Survey:
    """Every node's copy: this one's from its file, the others' from their targets. A node
    outside ``members`` (the cluster partition: Pacemaker lost it, and has fenced it) is not
    asked: its address answers nothing, and each wait would be a whole probe_timeout. This
    costs no safety: the majority rule counts only the copies reached."""
    found = Survey()
    local_copy(cfg, found)
    async with trio.open_nursery() as nursery:
        for node in cfg.others:
            if members is not None and node.name not in members:
                found.unreached[node.name] = "not in this node's cluster partition"
                continue
            nursery.start_soon(_remote_copy, cfg, node, token, found)
    return found
