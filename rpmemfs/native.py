"""Python face of the compiled helper in ``native/``, and the few wrappers Python needs of it.

The helper (cffi, built by native/build.py) holds: cache-line write-back, fences,
non-temporal copies and the ordered commit of a durability point (pmem.py calls them through
``lib``); CRC-32C; the log scan a mount reads its records with (:func:`log_scan`); the AEAD
record layer of protected connections (rpmem_sec.c, through transport/sockio.py); the
target's lane loop and the initiator's barrier builder (rpmem_lane.c, through
target/lane_native.py and transport/tcp.py); and, as ``lib`` constants, the wire format and
the log record header it was compiled with (generated from rpmemfs/transport/wire.py and
rpmemfs/fs/record_header.py).
"""

try:
    from rpmemfs._native import ffi, lib
except ImportError as exc:  # pragma: no cover - exercised only on a broken install
    # Without the helper there is no way to make pool writes durable, so running
    # on a pure-Python fallback would silently lose data: refuse instead.
    raise RuntimeError(
        "rpmemfs native helper is not built: reinstall with `pip install .` from the "
        "source tree; needs a C compiler and Python headers"
    ) from exc

__all__ = ["BytesLike", "crc32c", "crc32c_hw", "ffi", "flush_kind", "lib", "log_scan"]

BytesLike = bytes | bytearray | memoryview

_FLUSH_KINDS = {2: "clwb", 1: "clflushopt", 0: "clflush"}


def flush_kind() -> str:
    """The cache-line write-back instruction in use: "clwb", "clflushopt" or "clflush"."""
    return _FLUSH_KINDS[lib.rpm_flush_kind()]


def crc32c_hw() -> bool:
    """True when CRC-32C runs on the SSE4.2 crc32 instruction rather than a table."""
    return bool(lib.rpm_has_crc32c_hw())


def crc32c(data: BytesLike, crc: int = 0) -> int:
    """CRC-32C of ``data``; pass a previous result as ``crc`` to continue it."""
    if type(data) is bytes:
        # cffi passes bytes as a char pointer directly; from_buffer costs more than the CRC
        # of a log record (this runs twice per durability point).
        return int(lib.rpm_crc32c(crc, data, len(data)))
    # nbytes, not len(): a memoryview of a wider format counts items, not bytes.
    nbytes = data.nbytes if isinstance(data, memoryview) else len(data)
    return int(lib.rpm_crc32c(crc, ffi.from_buffer(data), nbytes))


# Records found per call of rpm_log_scan: 1 MiB of offsets and lengths at most.
_SCAN_BATCH = 65536
_REC_HEADER = int(lib.RPM_REC_HEADER_SIZE)
_REC_ALIGN = int(lib.RPM_REC_ALIGN)


def log_scan(area: BytesLike, off: int, seq: int) -> list[int]:
    """The intact log records of ``area`` from ``off`` on, the first numbered ``seq``, up
    to the first one missing, out of sequence or failing its CRC, as a flat list: offset,
    payload length, offset, payload length... (rpm_log_scan: a mount reads hundreds of
    thousands of records, and a Python loop per record was a third of its time)."""
    out = ffi.new("uint64_t[]", 2 * _SCAN_BATCH)
    size = area.nbytes if isinstance(area, memoryview) else len(area)
    found: list[int] = []
    # Released at once: an export of the pool's mapping would keep it from closing.
    with ffi.from_buffer(area) as ptr:
        while True:
            n = int(lib.rpm_log_scan(ptr, size, off, seq, out, _SCAN_BATCH))
            if n == 0:
                break
            batch: list[int] = ffi.unpack(out, 2 * n)
            found += batch
            seq += n
            # The next record's offset, by the header C was built with (rpmem_record.h).
            off = batch[-2] + _REC_HEADER + ((batch[-1] + _REC_ALIGN - 1) & ~(_REC_ALIGN - 1))
            if n < _SCAN_BATCH:
                break
    return found
