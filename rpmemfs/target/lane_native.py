"""A lane's receive loop in a C thread (native/rpmem_lane.c), driven from trio.

The C loop checks every frame and serves WRITE, READ, ATOMIC_WRITE and flush SENDs without
the GIL. It returns only for what Python handles: a control SEND (left unconsumed), a frame
it refused (``refused()`` says which rule and ``target/refusals.py`` says it in words), a
failed persist, the end of the connection, or a deadline. It shares the Python reader's
staging buffer, so bytes never have to be handed across.
"""

from __future__ import annotations

import math
import socket
from typing import Any

import trio

from rpmemfs.native import ffi, lib
from rpmemfs.target.refusals import Refused
from rpmemfs.target.regions import MAX_REGIONS, RegionTable
from rpmemfs.transport.sockio import SockIO
from rpmemfs.transport.stream import FrameReader
from rpmemfs.transport.wire import Code, Frame, unpack_header


def _ms(seconds: float) -> int:
    return -1 if math.isinf(seconds) else max(1, math.ceil(seconds * 1000))


class NativeLane:
    def __init__(
        self,
        io: SockIO,
        reader: FrameReader,
        table: RegionTable,
        *,
        apm: bool,
        spin_us: int,
        idle_timeout: float,
        frame_timeout: float,
    ) -> None:
        self._io = io
        self._reader = reader
        self._table = table  # the C loop reads its slots
        c = self._c = ffi.new("struct rpm_lane *")
        c.fd = io.fileno()
        c.apm = int(apm)
        c.spin_us = spin_us
        c.idle_ms = _ms(idle_timeout)
        c.frame_ms = _ms(frame_timeout)
        c.regions = table.c
        c.nregions = MAX_REGIONS
        c.sec = io.sec  # the record layer's state (NULL unprotected); io keeps it alive
        self._buf: bytearray | None = None
        self._stage: Any = None
        # One thread per lane, whatever trio's default thread limit.
        self._limiter = trio.CapacityLimiter(1)

    @property
    def err(self) -> int:
        return int(self._c.err)

    def frame(self) -> Frame:
        """The frame a persist failed for."""
        return unpack_header(bytes(ffi.buffer(self._c.hdr)))

    def refused(self) -> tuple[Code, Refused]:
        """The frame refused, and the ERROR code it is answered with."""
        c = self._c
        args = (int(c.args[0]), int(c.args[1]), int(c.args[2]))
        return Code(c.code), Refused(int(c.refused), bytes(ffi.buffer(c.hdr)), args)

    async def serve(self) -> int:
        """Run the C loop until it returns; its status (lib.RPM_LANE_*)."""
        c = self._c
        buf, start, end = self._reader.window()
        if buf is not self._buf:
            self._buf, self._stage = buf, ffi.from_buffer(buf)
            c.stage = self._stage
            c.stage_size = len(buf)
        c.start, c.end, c.stop = start, end, 0
        done = False

        async def interrupt_on_cancel() -> None:
            try:
                await trio.sleep_forever()
            finally:
                if not done:
                    # The thread cannot be cancelled; ending the stream makes it return.
                    c.stop = 1
                    try:
                        self._io.sock.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass

        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(interrupt_on_cancel)
                status = int(await trio.to_thread.run_sync(lib.rpm_lane_serve, c, limiter=self._limiter))
                done = True
                nursery.cancel_scope.cancel()
        finally:
            self._reader.set_window(int(c.start), int(c.end))
        return status
