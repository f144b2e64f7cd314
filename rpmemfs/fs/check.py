"""Offline consistency check of a pool: reads only, reports every problem it finds."""

from __future__ import annotations

import stat
from typing import Any

from rpmemfs.fs import acl
from rpmemfs.fs.errors import FsError
from rpmemfs.fs.log import scan
from rpmemfs.fs.replay import ROOT_INO, Index
from rpmemfs.pool.header import read_header
from rpmemfs.pool.layout import (
    AREA_HDR_BYTES,
    BACKUP_OFF,
    BLOCK,
    BLOCK_SHIFT,
    HEADER_BYTES,
    HEADER_OFF,
    AreaHeader,
    PoolFormatError,
)


def check(buf: memoryview, path: str = "") -> dict[str, Any]:
    report: dict[str, Any] = {"pool": path, "clean": False, "problems": [], "notes": [],
                              "layout": {}, "stats": {}}
    problems: list[str] = report["problems"]
    if len(buf) < BACKUP_OFF + HEADER_BYTES:
        problems.append(f"pool file is truncated: {len(buf)} bytes is too small for a pool")
        return report
    try:
        hdr, header_problems = read_header(buf)
    except PoolFormatError as e:
        problems.append(str(e))
        return report
    problems.extend(header_problems)
    if len(buf) < hdr.pool_size:
        problems.append(f"pool file is truncated: header says {hdr.pool_size} bytes, "
                        f"file has {len(buf)}")
        return report
    report["uuid"] = hdr.uuid_str
    report["size"] = hdr.pool_size
    layout: dict[str, Any] = {
        "header": {"offset": HEADER_OFF, "length": HEADER_BYTES},
        "header_backup": {"offset": BACKUP_OFF, "length": HEADER_BYTES},
        "log_areas": [],
        "data": {"offset": hdr.data_off, "blocks": hdr.data_blocks, "block_size": BLOCK},
    }
    report["layout"] = layout
    try:
        found = scan(buf, hdr)
    except PoolFormatError as e:
        problems.append(str(e))
        found = None
    for i in (0, 1):
        off = hdr.area_off(i)
        ah = AreaHeader.decode(buf[off: off + AREA_HDR_BYTES])
        area: dict[str, Any] = {"offset": off, "size": hdr.area_size,
                                "gen": ah.gen if ah else None,
                                "active": found is not None and found.active == i, "records": []}
        if found is not None and found.active == i:
            snap_end = found.area_header.snap_end_seq
            area["records"] = [
                {"offset": off + r.offset, "length": r.length, "seq": r.seq,
                 "checkpoint": r.seq <= snap_end}
                for r in found.records]
        layout["log_areas"].append(area)
    if found is None:
        return report
    index = Index()
    try:
        index.apply(r.payload for r in found.records)
    except ValueError as e:
        problems.append(f"log replay failed: {e}")
        return report
    problems.extend(index.problems)
    if found.stale is not None:
        report["notes"].append(
            f"records of a point that never ended past the log's tail ({found.stale[1]} bytes at "
            f"pool offset {found.stale[0]}: a crash inside their store; erased at mount)")
    _check_tree(index, hdr.data_blocks, problems, report["notes"])
    _check_acls(index, problems)
    inodes = index.inodes
    report["stats"] = {
        "inodes": len(inodes),
        "files": sum(1 for n in inodes.values() if stat.S_ISREG(n.mode)),
        "dirs": sum(1 for n in inodes.values() if n.children is not None),
        "used_blocks": sum(len(n.blocks) for n in inodes.values()),
        # preallocated with FALLOC_FL_KEEP_SIZE
        "blocks_past_eof": sum(1 for n in inodes.values() for fb in n.blocks
                               if fb >= (n.size + BLOCK - 1) >> BLOCK_SHIFT),
        "data_blocks": hdr.data_blocks,
        "log_records": len(found.records),
        "log_bytes": found.tail,
    }
    report["clean"] = not problems
    return report


def _check_tree(index: Index, nblocks: int, problems: list[str], notes: list[str]) -> None:
    inodes = index.inodes
    root = inodes.get(ROOT_INO)
    if root is None or root.children is None:
        problems.append("root directory is missing")
        return
    names: dict[int, int] = {}
    subdirs: dict[int, int] = {}
    for ino, node in inodes.items():
        if node.children is None:
            continue
        for name, child in node.children.items():
            c = inodes.get(child)
            if c is None:
                problems.append(f"directory {ino} entry {name!r} names missing inode {child}")
                continue
            names[child] = names.get(child, 0) + 1
            if c.children is not None:
                subdirs[ino] = subdirs.get(ino, 0) + 1
                if c.parent != ino:
                    problems.append(f"directory {child} has parent {c.parent}, is named in {ino}")
    owner = bytearray(nblocks)
    for ino, node in inodes.items():
        named = names.get(ino, 0)
        if node.children is not None:
            expect = 2 + subdirs.get(ino, 0)
            if ino != ROOT_INO and named > 1:
                problems.append(f"directory {ino} has {named} names")
            if named == 0 and ino != ROOT_INO:
                if node.nlink == 0:
                    notes.append(f"orphan directory {ino} (reclaimed at mount)")
                else:
                    problems.append(f"directory {ino} is not reachable")
            elif node.nlink != expect:
                problems.append(f"directory {ino} link count {node.nlink}, expected {expect}")
        else:
            if named == 0:
                if node.nlink == 0:
                    notes.append(f"orphan inode {ino} (deleted while open; reclaimed at mount)")
                else:
                    problems.append(f"inode {ino} has link count {node.nlink} but no name")
            elif node.nlink != named:
                problems.append(f"inode {ino} link count {node.nlink}, has {named} names")
        if stat.S_ISLNK(node.mode) and not node.target:
            problems.append(f"symlink {ino} has no target")
        # Blocks past the end of file are allowed: fallocate(FALLOC_FL_KEEP_SIZE) maps them.
        for fb, pb in node.blocks.items():
            if pb >= nblocks or pb < 0:
                problems.append(f"inode {ino} block {fb} points outside the data region ({pb})")
                continue
            if not stat.S_ISREG(node.mode):
                problems.append(f"inode {ino} is not a regular file but maps block {fb}")
            if owner[pb]:
                problems.append(f"pool block {pb} is used twice (inode {ino} block {fb})")
            owner[pb] = 1


def format_report(report: dict[str, Any]) -> str:
    lines = [f"pool {report['pool']}: " + ("clean" if report["clean"] else "PROBLEMS FOUND")]
    for p in report["problems"]:
        lines.append(f"  problem: {p}")
    for n in report["notes"]:
        lines.append(f"  note: {n}")
    s = report.get("stats") or {}
    if s:
        lines.append(f"  {s['inodes']} inodes ({s['files']} files, {s['dirs']} directories), "
                     f"{s['used_blocks']}/{s['data_blocks']} data blocks used, "
                     f"{s['log_records']} log records")
    return "\n".join(lines)


def _check_acls(index: Index, problems: list[str]) -> None:
    """Stored ACLs are ones the kernel would accept, where Linux allows them."""
    for ino, node in index.inodes.items():
        for name in acl.NAMES:
            value = node.xattrs.get(name)
            if value is None:
                continue
            try:
                acl.parse(value)
            except FsError as e:
                problems.append(f"inode {ino} has a malformed {name.decode()}: {e}")
            if name == acl.DEFAULT and node.children is None:
                problems.append(f"inode {ino} is not a directory but has a default ACL")
