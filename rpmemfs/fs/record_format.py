"""The log record's header: the one definition of it, for Python and for C.

A record in a log area is this header (crc32c, payload length, sequence number; little
endian), the payload, and zeros up to the next multiple of ALIGN bytes. The CRC covers the
header from CRC_FROM on (the length and the sequence number) and then the payload, which lie
side by side, so that a record is checked in one pass.

records.py packs and reads records with these; the C log scan a mount reads them with
(rpm_log_scan, native/rpmem_native.c) takes them from native/rpmem_record.h, which
native/record_header.py generates from this module at every build of the native helper;
tests/unit/test_record_header.py fails when the two disagree. The build loads this file on
its own, before the package can be imported, so it imports the standard library only.
"""

from __future__ import annotations

import struct

# The header, field by field (name, struct code); C gets it as struct rpm_rec_hdr.
HEADER_FIELDS = (("crc", "I"), ("length", "I"), ("seq", "Q"))
HEADER = struct.Struct("<" + "".join(code for _, code in HEADER_FIELDS))
HEADER_SIZE = HEADER.size
# The CRC covers every field after its own.
CRC_FROM = struct.calcsize("<" + HEADER_FIELDS[0][1])
# Records, and the entries in a payload, start at multiples of this.
ALIGN = 8
assert HEADER_SIZE == 16 and HEADER_SIZE % ALIGN == 0
