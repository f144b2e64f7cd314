"""Data block allocator.

One byte per block in a bytearray, so finding free runs is bytearray.find at C speed. Blocks
freed by a change stay marked used ("pending") until the log record that freed them is
durable: reusing them earlier would let a crash resurrect the old owner pointing at new data.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

FREE_B = b"\x00"
USED_B = b"\x01"


class OutOfSpace(Exception):
    """Not enough free blocks; `pending` says whether a durability point would free some."""

    def __init__(self, pending: bool) -> None:
        super().__init__("no free data blocks")
        self.pending = pending


class Allocator:
    def __init__(self, nblocks: int) -> None:
        self.nblocks = nblocks
        self.map = bytearray(nblocks)
        self.free = nblocks
        self.cursor = 0
        # (seq of the record that frees them, or None while that record is not yet written, runs)
        self._pending: list[list[Any]] = []
        self._unlogged: list[tuple[int, int]] = []

    @property
    def pending_blocks(self) -> int:
        pending: int = sum(c for _, runs in self._pending for _, c in runs)
        return pending + sum(
            c for _, c in self._unlogged)

    def mark_used(self, start: int, count: int) -> None:
        """Claim a run at load time; False-free claims (double use) are the checker's business."""
        self.map[start: start + count] = USED_B * count
        self.free -= count

    def mark_blocks(self, maps: Iterable[dict[int, int]]) -> None:
        """Claim at load time the pool blocks of every block map (file block -> pool block)
        given, block by block: for the many small files of a big tree that is cheaper than
        finding their runs (a sort each) first."""
        m = self.map
        used = 0
        for blocks in maps:
            for pb in blocks.values():
                m[pb] = 1
            used += len(blocks)
        self.free -= used

    def alloc(self, count: int) -> list[tuple[int, int]]:
        """Runs (start, count) adding up to count blocks, contiguous where the map allows."""
        if count > self.free:
            raise OutOfSpace(self.pending_blocks > 0)
        runs: list[tuple[int, int]] = []
        m = self.map
        need = count
        pos = self.cursor
        wrapped = False
        while need:
            start = m.find(FREE_B, pos)
            if start < 0:
                if wrapped:  # free count says otherwise; trust the map
                    raise OutOfSpace(self.pending_blocks > 0)
                wrapped, pos = True, 0
                continue
            stop = m.find(USED_B, start, start + need)
            if stop < 0:
                stop = min(start + need, self.nblocks)
            n = stop - start
            m[start:stop] = USED_B * n
            if runs and runs[-1][0] + runs[-1][1] == start:
                runs[-1] = (runs[-1][0], runs[-1][1] + n)
            else:
                runs.append((start, n))
            need -= n
            pos = stop
        self.free -= count
        self.cursor = pos if pos < self.nblocks else 0
        return runs

    def release(self, runs: list[tuple[int, int]]) -> None:
        """Give back runs that no durable record ever referenced (safe to reuse at once)."""
        for start, n in runs:
            self.map[start: start + n] = FREE_B * n
            self.free += n

    def defer(self, runs: list[tuple[int, int]]) -> None:
        """Runs freed by a change whose record is not written yet."""
        self._unlogged.extend(runs)

    def logged(self, seq: int) -> None:
        """The changes deferred so far are in record seq."""
        if self._unlogged:
            self._pending.append([seq, self._unlogged])
            self._unlogged = []

    def durable(self, seq: int) -> int:
        """Records up to seq are durable: their freed blocks become reusable. Returns blocks."""
        freed = 0
        keep = []
        for item in self._pending:
            if item[0] <= seq:
                for start, n in item[1]:
                    self.map[start: start + n] = FREE_B * n
                    freed += n
            else:
                keep.append(item)
        self._pending = keep
        self.free += freed
        return freed
