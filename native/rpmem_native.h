/* rpmemfs native helper: cache-line write-back and the ordered commit of a durability
 * point, non-temporal copies, CRC-32C and the log scan (rpmem_native.c); the AEAD record
 * layer of protected connections (rpmem_sec.c); the target's lane loop and the
 * initiator's barrier builder (rpmem_lane.c).
 *
 * This header doubles as the cffi cdef: build.py feeds it to cffi with the
 * preprocessor lines dropped (after the cdefs of the wire format and the log record header,
 * which define the RPM_WIRE_ and RPM_REC_ names), so it must hold only plain declarations.
 */
#ifndef RPMEM_NATIVE_H
#define RPMEM_NATIVE_H

#include <stddef.h>
#include <stdint.h>

#include "rpmem_record.h" /* generated from rpmemfs/fs/record_format.py (native/record_header.py) */
#include "rpmem_wire.h" /* generated from rpmemfs/transport/wire.py (native/wire_header.py) */

/* 2 = clwb, 1 = clflushopt, 0 = clflush; the instruction rpm_flush uses. */
int rpm_flush_kind(void);

/* 1 when rpm_crc32c uses the SSE4.2 crc32 instruction. */
int rpm_has_crc32c_hw(void);

/* Write back every cache line overlapping [addr, addr + len). No fence. */
void rpm_flush(const void *addr, size_t len);

/* Store fence: orders earlier flushes and non-temporal stores. */
void rpm_drain(void);

/* pairs holds npairs (offset, length) pairs relative to base. No fence. */
void rpm_flush_ranges(const char *base, const uint64_t *pairs, size_t npairs);

/* A commit: write back the npairs data ranges, fence, then store len bytes of
 * rec at base + rec_off, write them back and fence; then the same for the
 * stamp_len bytes of stamp at base + stamp_off (none when stamp_len is 0). The
 * record can reach the media only after the data it describes, and the stamp
 * only after the record, whatever the cache evicts when. */
void rpm_persist_then_store(char *base, const uint64_t *pairs, size_t npairs,
                            uint64_t rec_off, const void *rec, size_t len,
                            uint64_t stamp_off, const void *stamp, size_t stamp_len);

/* Copy with non-temporal stores; dst is in the persistence domain on return. */
void rpm_memcpy_nt(void *dst, const void *src, size_t len);

/* Fault in the pages of [addr, addr + len) for writing (MADV_POPULATE_WRITE), so
 * first stores into a fresh pool do not each take a page fault. 0 or -errno. */
int rpm_populate(void *addr, size_t len);

/* CRC-32C (Castagnoli). Start with crc = 0; chaining a previous result
 * continues the checksum: rpm_crc32c(rpm_crc32c(0, a), b) == crc of a+b. */
uint32_t rpm_crc32c(uint32_t crc, const void *buf, size_t len);

/* The intact log records (struct rpm_rec_hdr, then the payload, padded to RPM_REC_ALIGN)
 * of a log area of len bytes (docs/format.md, "Log areas"), from
 * offset off on, record i carrying sequence number seq + i: up to max of them, each as
 * its offset and payload length in out[2i] and out[2i + 1]. Stops at the first record
 * that is missing, out of sequence or fails its CRC; returns how many it found. */
size_t rpm_log_scan(const void *area, size_t len, size_t off, uint64_t seq, uint64_t *out,
                    size_t max);

/* ---- wire protection: the AEAD record layer (rpmem_sec.c, docs/wire.md) ---- */

/* One piece of a gather list. */
struct rpm_buf {
    const void *base;
    size_t len;
};

/* A protected connection's record state: keys, sequence numbers, buffers. Opaque. */
struct rpm_sec;

/* 1 when the CPU has AES-NI and PCLMULQDQ (AES-256-GCM is then the fast choice). */
int rpm_sec_has_aes(void);
/* A record state for cipher (RPM_WIRE_CIPHER_*) with each direction's key
 * (RPM_WIRE_KEY_SIZE bytes); NULL for an unknown cipher or no memory. */
struct rpm_sec *rpm_sec_new(int cipher, const uint8_t *tx_key, const uint8_t *rx_key);
void rpm_sec_free(struct rpm_sec *s);
/* Seal the buffers' bytes into records and send what the socket takes now. Returns the
 * plaintext bytes taken (a prefix of the buffers; sealed ones the socket did not take yet
 * wait in the state: see rpm_sec_pending), -EAGAIN when nothing could be taken, or -errno. */
long rpm_sec_sendv(struct rpm_sec *s, int fd, const struct rpm_buf *bufs, int cnt);
/* Send sealed bytes still waiting; returns how many still wait, or -errno. */
long rpm_sec_flush(struct rpm_sec *s, int fd);
uint32_t rpm_sec_pending(const struct rpm_sec *s);
/* Up to cap bytes of verified plaintext; 0 at the end of the stream, -EAGAIN when no whole
 * record is there yet, -EBADMSG for a record that fails its tag (changed, dropped, replayed
 * or reordered in transit), -EPROTO for a bad record length, or -errno. Failures stick. */
long rpm_sec_recv(struct rpm_sec *s, int fd, char *dst, size_t cap);
/* Verified plaintext held, not handed out yet. */
uint32_t rpm_sec_buffered(const struct rpm_sec *s);
/* 0, or the -errno every later call returns. */
int rpm_sec_failed(const struct rpm_sec *s);

/* ---- target data path (rpmem_lane.c) ---- */

/* Buckets of the persist-latency histogram: the bounds Python sets (rpm_persist_bounds),
 * then +Inf. */
#define RPM_PERSIST_BUCKETS 24

/* Per-pool counters, shared by every lane that writes into the pool. */
struct rpm_counters {
    uint64_t writes;
    uint64_t bytes;
    uint64_t flushes;
    uint64_t reads;
    uint64_t atomics;
    uint64_t persisted_ranges;
    uint64_t persisted_bytes;
    uint64_t persists;
    uint64_t persist_ns;
    uint64_t persist_hist[RPM_PERSIST_BUCKETS];
};

/* One registration of a session, as lanes see it. live and inflight make the handover
 * safe: a lane uses base only between incrementing inflight and seeing live set. */
struct rpm_region {
    uint32_t key;
    uint32_t live;
    int32_t inflight;
    int32_t pmem;
    int32_t writable; /* 0: WRITE and ATOMIC_WRITE to it are refused */
    int32_t unused;
    char *base;
    uint64_t size;
    struct rpm_counters *counters;
};

/* One lane connection. The staging buffer is the Python reader's: [start, end) holds
 * bytes received and not yet consumed, before and after a call. */
struct rpm_lane {
    int fd;
    int apm;
    int spin_us;
    uint64_t spin_after; /* no spinning before this (CLOCK_MONOTONIC ns; rpmem_lane.c) */
    unsigned spin_given; /* spins in a row that gave way to another thread */
    int idle_ms;
    int frame_ms;
    int stop;
    int err;
    uint32_t nregions;
    struct rpm_region *regions;
    char *stage;
    uint32_t stage_size;
    uint32_t start;
    uint32_t end;
    uint8_t hdr[RPM_WIRE_HEADER_SIZE]; /* the frame a persist failed for, or refused */
    struct rpm_sec *sec; /* NULL on a link whose both ends run with wire protection none */
    /* A refused frame (RPM_LANE_REFUSED): the ERROR code it is answered with
     * (RPM_WIRE_CODE_*), which rule it broke (RPM_REFUSED_*) and that rule's figures, which
     * Python puts in words (rpmemfs/target/refusals.py). */
    uint32_t code;
    uint32_t refused;
    uint64_t args[3];
};

/* What rpm_lane_serve returns. */
#define RPM_LANE_CLOSED 1
#define RPM_LANE_TRUNCATED 2
#define RPM_LANE_IDLE 3
#define RPM_LANE_STALLED 4
#define RPM_LANE_HANDOFF 5
#define RPM_LANE_PERSIST_FAILED 6
#define RPM_LANE_SOCKET 7
#define RPM_LANE_STOPPED 8
#define RPM_LANE_REFUSED 9

/* The rules a frame can break on a lane, each with what args holds for it (if anything):
 * OP unknown op (op); RESERVED reserved field not zero (its value); FLAGS unknown flags
 * (flags); NOT_INITIATORS an op only a target sends; TOO_LARGE a length over the op's limit
 * (limit); ATOMIC_PAYLOAD an ATOMIC_WRITE with a length; MISALIGNED an ATOMIC_WRITE off
 * 8-byte alignment; SEND_KIND a SEND of neither kind; KEY no live registration has the key;
 * BOUNDS outside the region (length, region size); READ_ONLY a write to a region opened
 * without its claim; FLUSH_LIST a flush's length that is not its count of ranges (count), or
 * too short to hold a count (0, 1); FLUSH_RANGE a listed range outside the region (offset,
 * length, region size). */
#define RPM_REFUSED_OP 1
#define RPM_REFUSED_RESERVED 2
#define RPM_REFUSED_FLAGS 3
#define RPM_REFUSED_NOT_INITIATORS 4
#define RPM_REFUSED_TOO_LARGE 5
#define RPM_REFUSED_ATOMIC_PAYLOAD 6
#define RPM_REFUSED_MISALIGNED 7
#define RPM_REFUSED_SEND_KIND 8
#define RPM_REFUSED_KEY 9
#define RPM_REFUSED_BOUNDS 10
#define RPM_REFUSED_READ_ONLY 11
#define RPM_REFUSED_FLUSH_LIST 12
#define RPM_REFUSED_FLUSH_RANGE 13

/* Fill a free slot (live == 0, inflight == 0) and make it live; -1 if not free. */
int rpm_region_publish(struct rpm_region *r, uint32_t key, char *base, uint64_t size,
                       int pmem, int writable, struct rpm_counters *counters);
/* Take a slot out of use; returns how many lanes are still inside a frame using it. */
int rpm_region_retire(struct rpm_region *r);
int rpm_region_inflight(struct rpm_region *r);
/* Atomic add, for counters that lanes update too. */
void rpm_count(uint64_t *field, uint64_t n);
/* The persist-latency histogram's upper bounds in ns, ascending (at most
 * RPM_PERSIST_BUCKETS - 1); set once, before any lane runs. */
void rpm_persist_bounds(const uint64_t *ns, uint32_t n);
/* One persist (a flush's ranges written back) took ns and covered bytes. */
void rpm_count_persist(struct rpm_counters *c, uint64_t ns, uint64_t bytes);

/* Serve frames until one it leaves to Python (a control SEND: RPM_LANE_HANDOFF), one it
 * refuses, a failed persist, the end of the stream or a deadline: never returns 0. */
int rpm_lane_serve(struct rpm_lane *lane);

/* Initiator: build one barrier's frames and send what the socket takes now. n WRITEs of
 * the ranges in pairs (offset, length) of the remote region key (ids first_id ...), range
 * i's bytes at base + src[i] (a copy) or, with src NULL, at base + its offset (the local
 * pool at base, same offsets), then the flush (id first_id + n): with apm
 * a flush READ, else a SEND of the range list. hdrs holds RPM_WIRE_HEADER_SIZE (n + 1)
 * bytes, flush_list RPM_WIRE_FLUSH_COUNT_SIZE + RPM_WIRE_FLUSH_RANGE_SIZE n. Returns the
 * bytes sent (less than *total when the socket is full), -EINVAL for a range outside the
 * region, or another -errno; with fd < 0 it only builds the frames. With sec, the frames
 * are sealed (rpm_sec_sendv): bytes sent then counts the plaintext taken. */
long rpm_post_barrier(struct rpm_sec *sec, int fd, const char *base, const uint64_t *src,
                      const uint64_t *pairs, uint32_t n, uint32_t key, uint64_t region_size,
                      uint32_t first_id, int apm, uint8_t *hdrs, uint8_t *flush_list, uint64_t *total);

/* Initiator: the index of the first (offset, length) pair rpm_post_barrier would refuse
 * (empty, longer than a WRITE, or outside region_size), or -1 when it takes them all. */
long rpm_ranges_bad(const uint64_t *pairs, uint32_t n, uint64_t region_size);

/* Initiator: take the reply (op, id, length) off the connection if it is the next frame, into
 * and out of the staging buffer buf[*start, *end) of cap bytes (read through sec when the
 * connection is protected). 1 taken, 0 not all here yet, 2 something else is next (or the
 * socket failed): Python's reader takes over. */
long rpm_take_reply(struct rpm_sec *sec, int fd, uint8_t *buf, uint32_t cap, uint32_t *start,
                    uint32_t *end, uint8_t op, uint32_t id, uint32_t length);

#endif
