"""Block-range operations on files: fallocate(2), SEEK_DATA/SEEK_HOLE and copy_file_range(2).

They work on the files' block maps with the same rules as writes and truncates
(rpmemfs.fs.data, rpmemfs.fs.changes): new blocks are zeroed before any record maps them,
freed blocks wait for the record that frees them to be durable, and every check that can
fail runs before anything changes, so an error leaves the file as it was.

Preallocated blocks (fallocate, ZERO_RANGE) read as zeros and count in st_blocks; until
written they are holes to SEEK_DATA/SEEK_HOLE, as ext4's unwritten extents are. Their MAP
entries say so (MAP_PREALLOC); writes log nothing about it, and the mount takes back only
those that still read as zeros (rpmemfs.fs.recovery.restore_unwritten).
"""

from __future__ import annotations

import errno

from rpmemfs.fs import records as R
from rpmemfs.fs.data import MAX_FILE_SIZE, NT_MIN, Data, NeedSync
from rpmemfs.fs.errors import FsError
from rpmemfs.fs.inode import Inode
from rpmemfs.pool.layout import BLOCK, BLOCK_SHIFT

# fallocate(2) mode bits (linux/falloc.h)
KEEP_SIZE = 0x01
PUNCH_HOLE = 0x02
NO_HIDE_STALE = 0x04
COLLAPSE_RANGE = 0x08
ZERO_RANGE = 0x10
INSERT_RANGE = 0x20
UNSHARE_RANGE = 0x40

SEEK_DATA = 3
SEEK_HOLE = 4

# One copy_file_range call copies at most this much; callers loop on short copies, and the
# FUSE reply carries the count in 32 bits.
COPY_MAX = 1 << 30
_ZEROS = memoryview(bytes(1 << 20))


class Extents:
    """The range operations on the files of one filesystem, and their counters. Preallocated
    blocks not written since are the data's ``unwritten`` (its writes clear them)."""

    def __init__(self, data: Data) -> None:
        self.data = data
        self.changes = data.changes
        self.node = data.node
        self.unwritten = data.unwritten
        self.copies = 0  # copy_file_range calls served
        self.copied = 0  # bytes they copied

    def stats(self) -> dict[str, int]:
        """For the status document: proof that copies ran here, not through the kernel."""
        return {"calls": self.copies, "bytes": self.copied}

    # ---------------------------------------------------------------- fallocate

    def fallocate(self, ino: int, mode: int, off: int, length: int) -> Inode:
        """fallocate(2). Errnos as Linux gives them on ext4 (vfs_fallocate's checks first),
        except COLLAPSE_RANGE and INSERT_RANGE: EOPNOTSUPP here (ext4 supports them)."""
        if off < 0 or length <= 0:
            raise FsError(errno.EINVAL)
        if mode & (PUNCH_HOLE | ZERO_RANGE) == PUNCH_HOLE | ZERO_RANGE:
            raise FsError(errno.EOPNOTSUPP)
        if mode & PUNCH_HOLE and not mode & KEEP_SIZE:
            raise FsError(errno.EOPNOTSUPP)
        if mode & COLLAPSE_RANGE and mode & ~COLLAPSE_RANGE:
            raise FsError(errno.EINVAL)
        if mode & INSERT_RANGE and mode & ~INSERT_RANGE:
            raise FsError(errno.EINVAL)
        if mode & ~(KEEP_SIZE | PUNCH_HOLE | ZERO_RANGE):
            raise FsError(errno.EOPNOTSUPP)  # collapse, insert, unshare, no-hide-stale, unknown
        node = self.node(ino)
        if node.is_dir:
            raise FsError(errno.EISDIR)
        if not node.is_reg:
            raise FsError(errno.ENODEV)
        if off + length > MAX_FILE_SIZE:
            raise FsError(errno.EFBIG)
        if mode & PUNCH_HOLE:
            self._punch(node, off, off + length)
        else:
            self._allocate(node, off, off + length, zero=bool(mode & ZERO_RANGE),
                           keep_size=bool(mode & KEEP_SIZE))
        return node

    def _allocate(self, node: Inode, off: int, end: int, zero: bool, keep_size: bool) -> None:
        """Modes 0, KEEP_SIZE and ZERO_RANGE: map every block of the range (zeroed), and with
        ZERO_RANGE zero the bytes of the range in blocks mapped already."""
        changes, alloc = self.changes, self.changes.alloc
        blocks = node.blocks
        first, last = off >> BLOCK_SHIFT, (end - 1) >> BLOCK_SHIFT
        mapped = sum(1 for b in blocks if first <= b <= last)
        need = last - first + 1 - mapped
        if need > alloc.free:  # before listing the range: it may be huge
            if need <= alloc.free + alloc.pending_blocks:
                raise NeedSync
            raise FsError(errno.ENOSPC)
        missing = [b for b in range(first, last + 1) if b not in blocks] if need else []
        runs: list[tuple[int, int]] = []
        if missing:
            runs = self.data.alloc_blocks(len(missing))
        # (file block, pool block) of every block that reads as zeros when this is done and
        # was not written: the new ones, and with ZERO_RANGE the whole blocks mapped already.
        pairs = list(zip(missing, (pb + k for pb, n in runs for k in range(n)), strict=True))
        if zero:
            whole = range((off + BLOCK - 1) >> BLOCK_SHIFT, end >> BLOCK_SHIFT)
            pairs += [(fb, blocks[fb]) for fb in whole if fb in blocks]
            pairs.sort()
        entries = _runs(pairs)
        try:
            changes.room(len(entries) * R.MAP.size + R.INODE.size)
        except FsError:
            alloc.release(runs)
            raise
        # Nothing can fail from here on.
        if zero:
            self._zero_mapped(node, off, end)
        for pb, n in runs:
            self._zero_pool(pb << BLOCK_SHIFT, n << BLOCK_SHIFT)
        # The zeros first, then the map: the entries reach the log after them (durability).
        for fb, pb, n in entries:
            for k in range(n):
                blocks[fb + k] = pb + k
            changes.map_change(node, R.map_run(node.ino, fb, pb, n, R.MAP_PREALLOC))
        if pairs:
            self.unwritten.setdefault(node.ino, set()).update(fb for fb, _pb in pairs)
        grows = not keep_size and end > node.size
        if grows:
            self.data.zero_tail(node, node.size, end)
            node.size = end
        node.tick(mtime=grows or zero)  # ctime always, mtime when contents or size change
        changes.touch(node)

    def _punch(self, node: Inode, off: int, end: int) -> None:
        """PUNCH_HOLE|KEEP_SIZE: free the whole blocks of the range, zero the partial ones.
        As ext4, nothing past the block holding the end of file is punched."""
        changes = self.changes
        if off >= node.size:
            return
        end = min(end, (node.size + BLOCK - 1) & ~(BLOCK - 1))
        changes.room(R.UNMAP.size + R.INODE.size)
        whole_first = (off + BLOCK - 1) >> BLOCK_SHIFT
        whole_end = end >> BLOCK_SHIFT
        if whole_first >= whole_end:
            self._zero_mapped(node, off, end)  # inside one block, or two partial ones
        else:
            self._zero_mapped(node, off, whole_first << BLOCK_SHIFT)
            self._zero_mapped(node, whole_end << BLOCK_SHIFT, end)
            blocks = node.blocks
            if whole_end - whole_first <= len(blocks):
                gone = [b for b in range(whole_first, whole_end) if b in blocks]
            else:
                gone = sorted(b for b in blocks if whole_first <= b < whole_end)
            if gone:
                runs: list[tuple[int, int]] = []
                for pb in sorted(blocks.pop(b) for b in gone):
                    if runs and runs[-1][0] + runs[-1][1] == pb:
                        runs[-1] = (runs[-1][0], runs[-1][1] + 1)
                    else:
                        runs.append((pb, 1))
                changes.alloc.defer(runs)
                changes.map_change(node, R.unmap(node.ino, whole_first, whole_end - whole_first))
                uw = self.unwritten.get(node.ino)
                if uw:
                    uw.difference_update(gone)
        node.tick(mtime=True)
        changes.touch(node)

    def _zero_mapped(self, node: Inode, off: int, end: int) -> None:
        """Zero the bytes [off, end) of the file where blocks are mapped (holes read as zeros)."""
        pos = off
        blocks = node.blocks
        while pos < end:
            fb = pos >> BLOCK_SHIFT
            stop = min(end, (fb + 1) << BLOCK_SHIFT)
            pb = blocks.get(fb)
            if pb is not None:
                # extend over file and pool blocks that stay contiguous
                while stop < end and blocks.get(stop >> BLOCK_SHIFT) == pb + (stop >> BLOCK_SHIFT) - fb:
                    stop = min(end, stop + BLOCK)
                self._zero_pool((pb << BLOCK_SHIFT) + (pos & (BLOCK - 1)), stop - pos)
            pos = stop

    def _zero_pool(self, data_off: int, n: int) -> None:
        """Zero n bytes at data_off in the data region, listed for the next durability point."""
        data = self.data
        a = data.data_off + data_off
        nt = data.copy_nt
        if nt is not None and n >= NT_MIN:
            for k in range(0, n, len(_ZEROS)):
                m = min(len(_ZEROS), n - k)
                nt(a + k, _ZEROS[:m])
            self.changes.stored.append((a, n))
        else:
            for k in range(0, n, len(_ZEROS)):
                m = min(len(_ZEROS), n - k)
                data.buf[a + k: a + k + m] = _ZEROS[:m]
            self.changes.data.append((a, n))

    # ---------------------------------------------------------------- SEEK_DATA / SEEK_HOLE

    def _is_data(self, node: Inode, fb: int) -> bool:
        if fb not in node.blocks:
            return False
        uw = self.unwritten.get(node.ino)
        return not uw or fb not in uw

    def seek(self, ino: int, off: int, whence: int) -> int:
        """lseek(2) with SEEK_DATA or SEEK_HOLE, at block granularity as ext4: blocks never
        mapped, punched, or preallocated and not written are holes, and so is the end of
        file. ENXIO at or past the end of file, as ext4."""
        node = self.node(ino)
        if whence not in (SEEK_DATA, SEEK_HOLE):
            raise FsError(errno.EINVAL)
        size = node.size
        if off < 0 or off >= size:
            raise FsError(errno.ENXIO)
        fb = off >> BLOCK_SHIFT
        # Walking block by block costs the length of the extent skipped, so a scan of the
        # whole file by extents costs its length once; a hole longer than the file has blocks
        # is skipped by a pass over the blocks instead.
        if whence == SEEK_DATA:
            limit = (size + BLOCK - 1) >> BLOCK_SHIFT
            stop = min(limit, fb + len(node.blocks) + 1)
            while fb < stop:
                if self._is_data(node, fb):
                    return max(off, fb << BLOCK_SHIFT)
                fb += 1
            found = min((b for b in node.blocks if fb <= b < limit and self._is_data(node, b)),
                        default=None)
            if found is None:
                raise FsError(errno.ENXIO)
            return found << BLOCK_SHIFT
        while self._is_data(node, fb):
            fb += 1
        return min(size, max(off, fb << BLOCK_SHIFT))

    # ---------------------------------------------------------------- copy_file_range

    def copy(self, ino_in: int, off_in: int, ino_out: int, off_out: int, length: int,
             flags: int) -> int:
        """copy_file_range(2) inside the pool: each run of source blocks is copied from the
        mapping into the destination by its write path (one memcpy; dirty ranges, block
        allocation, size and times as a write), and source holes stay holes where the
        destination has no blocks either. Returns the bytes copied, short when the pool
        fills up after some were (ENOSPC when none were) or past COPY_MAX."""
        data = self.data
        if flags:
            raise FsError(errno.EINVAL)
        if off_in < 0 or off_out < 0 or length < 0:
            raise FsError(errno.EINVAL)
        src, dst = self.node(ino_in), self.node(ino_out)
        if src.is_dir or dst.is_dir:
            raise FsError(errno.EISDIR)
        if not src.is_reg or not dst.is_reg:
            raise FsError(errno.EINVAL)
        self.copies += 1
        n = min(length, src.size - off_in, COPY_MAX)
        if n <= 0:
            return 0
        if off_out + n > MAX_FILE_SIZE:
            raise FsError(errno.EFBIG)
        if ino_in == ino_out and off_in < off_out + n and off_out < off_in + n:
            raise FsError(errno.EINVAL)  # overlapping ranges of one file, as the VFS says
        done = 0
        buf = data.buf
        one_block = False  # after ENOSPC: copy what still fits, a block at a time
        while done < n:
            pos = off_in + done
            fb = pos >> BLOCK_SHIFT
            stop = min(off_in + n, (fb + 1) << BLOCK_SHIFT)
            is_data = self._is_data(src, fb)
            pb = src.blocks.get(fb, 0)
            # extend the run while the source stays contiguous data (or holes)
            while stop < off_in + n and not one_block:
                nfb = stop >> BLOCK_SHIFT
                if is_data != self._is_data(src, nfb) or (is_data and src.blocks[nfb] != pb + nfb - fb):
                    break
                stop = min(off_in + n, stop + BLOCK)
            k = stop - pos
            to = off_out + done
            try:
                if is_data:
                    a = data.data_off + (pb << BLOCK_SHIFT) + (pos & (BLOCK - 1))
                    data.write(ino_out, to, buf[a: a + k])
                elif any(to >> BLOCK_SHIFT <= b <= (to + k - 1) >> BLOCK_SHIFT for b in dst.blocks):
                    data.write(ino_out, to, bytes(k))  # zeros over the destination's blocks
            except FsError as e:
                if e.errno != errno.ENOSPC:
                    raise
                if k > BLOCK - (to & (BLOCK - 1)) and not one_block:
                    one_block = True
                    continue
                if done == 0:
                    raise
                break
            except NeedSync:
                if done == 0:
                    raise
                break  # a short copy; the next call makes the durability point
            done += k
        if off_out + done > dst.size:
            data.truncate(dst, off_out + done)  # the copy ended in a source hole
        dst.tick(mtime=True)
        self.changes.touch(dst)
        self.copied += done
        return done


def _runs(pairs: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """(file block, pool block, count) runs of sorted (file block, pool block) pairs."""
    out: list[tuple[int, int, int]] = []
    for fb, pb in pairs:
        if out and out[-1][0] + out[-1][2] == fb and out[-1][1] + out[-1][2] == pb:
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + 1)
        else:
            out.append((fb, pb, 1))
    return out
