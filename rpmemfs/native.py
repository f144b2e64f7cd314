"""Python face of the compiled helper in ``native/`` (cache flushes, NT copies, CRC-32C)."""

from collections.abc import Callable

try:
    from rpmemfs._native import ffi, lib
except ImportError as exc:  # pragma: no cover - exercised only on a broken install
    # Without the helper there is no way to make pool writes durable, so running
    # on a pure-Python fallback would silently lose data: refuse instead.
    raise RuntimeError(
        "rpmemfs native helper is not built: reinstall with `pip install .` from the "
        "source tree; needs a C compiler and Python headers"
    ) from exc

__all__ = ["BytesLike", "crc32c", "crc32c_hw", "crc32c_in", "ffi", "flush_kind", "lib"]

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


def crc32c_in(data: BytesLike) -> Callable[[int, int], int]:
    """CRC-32C of ranges of one buffer, ``crc(offset, length)``, which the caller keeps
    within it: the buffer is handed to C once rather than per call (a mount checks a log
    record's CRC per record, hundreds of thousands of times). The function holds an export
    of the buffer while it lives."""
    ptr = ffi.from_buffer(data)
    rpm_crc32c = lib.rpm_crc32c

    def crc(off: int, n: int) -> int:
        return int(rpm_crc32c(0, ptr + off, n))

    return crc
