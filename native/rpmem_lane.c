/* rpmemfs data path in C: the target's receive loop of one lane connection, run in a thread,
 * with the regions and counters it shares with Python; and the initiator's barrier
 * builder (rpm_post_barrier, at the end), which writes the frames that loop reads.
 *
 * This plays the NIC of docs/wire.md. It takes frames off the lane's socket strictly in
 * order, places WRITE payloads into the registered pool mappings, answers a READ only
 * after everything before it on the lane is placed (and, under the appliance method,
 * written back), and serves general-purpose flushes. cffi drops the GIL around the call,
 * so the lanes of every session run beside each other and beside the Python daemon.
 *
 * It is the one place a lane's frames are checked. A frame that breaks a rule is refused:
 * RPM_LANE_REFUSED, with the ERROR code it is answered with (rpm_wire.h's, generated from
 * wire.py), the rule (RPM_REFUSED_*) and its figures, which Python puts in words and sends
 * before it closes the lane. Only control SENDs are left to Python (RPM_LANE_HANDOFF),
 * unconsumed in the staging buffer: they are JSON for the control service.
 *
 * Waiting: after a frame, the loop spins on recv() for spin_us before it sleeps in
 * poll(). On virtual machines whose idle vCPUs halt, waking a sleeping thread costs
 * about 100 us, more than a whole barrier; spinning is what an RDMA consumer polling its
 * completion queue does, and it burns CPU only while the lane is busy. Every pass yields
 * the CPU first, and once another thread ran on this CPU meanwhile (the thread's
 * involuntary context switches: a yield taken, or a preemption) the spin ends; when that
 * happens to SPIN_GIVEN spins in a row, the lane does not spin for SPIN_BACKOFF_NS. A
 * kernel worker now and then ends one spin; a program that wants the CPU ends them all. On
 * a machine with no idle CPU, spinning takes time from the threads the lane is waiting
 * for: on 2 cores with the mount daemon and two targets, a 4 KiB write + fsync p50 was
 * 807 us spinning blindly and 316 us not spinning at all. Ending the spin when one yield
 * took over 30 us, as before, still left the targets at 70% of a core each at 4 writers
 * (1.5-2.7k IOPS against 5.6-6.5k): a program that runs a moment and blocks in its next
 * request is rarely runnable at a yield, but it preempts the lane. (Not the time the
 * thread's CPU clock missed: on our VMs every timer tick takes 10-100 us of interrupt
 * time from whatever runs, with no other thread wanting the CPU.)
 */
#define _GNU_SOURCE
#include "rpmem_native.h"

#include <errno.h>
#include <poll.h>
#include <sched.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

/* The wire format (opcodes, flags, limits, the frame header and the flush list) is
 * rpmem_wire.h's, generated from rpmemfs/transport/wire.py; none of it is spelled here.
 * What this file assumes of it beyond the names: */
_Static_assert(sizeof(struct rpm_wire_flush_range) == 2 * sizeof(uint64_t),
               "flush ranges are copied as the (offset, length) pairs persist() takes");
_Static_assert(RPM_WIRE_FLUSH_COUNT_SIZE == sizeof(uint32_t), "a flush list's count is a uint32_t");
_Static_assert(RPM_WIRE_ATOMIC_SIZE == sizeof(uint64_t), "an atomic write stores one 64-bit word");

/* A payload remainder smaller than this comes through the staging buffer (it may bring
 * the next frames along); a larger one is received straight into the mapping. */
#define STRAIGHT_MIN (16u << 10)
#define PAGE 4096u

static uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

/* No spinning for SPIN_BACKOFF_NS after SPIN_GIVEN spins in a row gave way to another
 * thread: a machine that busy stays busy for a while. By time, not by frames: a quiet lane
 * would otherwise stay without spinning for seconds after a kernel worker's bad moment. */
#define SPIN_GIVEN 2u
#define SPIN_BACKOFF_NS 50000000u

static long involuntary_switches(void)
{
    struct rusage ru;
    return getrusage(RUSAGE_THREAD, &ru) ? -1 : ru.ru_nivcsw;
}

/* ---- regions: published by Python, used here one frame at a time ---------------- */

int rpm_region_publish(struct rpm_region *r, uint32_t key, char *base, uint64_t size,
                       int pmem, int writable, struct rpm_counters *counters)
{
    if (__atomic_load_n(&r->live, __ATOMIC_SEQ_CST) ||
        __atomic_load_n(&r->inflight, __ATOMIC_SEQ_CST))
        return -1;
    r->base = base;
    r->size = size;
    r->pmem = pmem;
    r->writable = writable;
    r->counters = counters;
    __atomic_store_n(&r->key, key, __ATOMIC_RELEASE);
    __atomic_store_n(&r->live, 1, __ATOMIC_SEQ_CST);
    return 0;
}

int rpm_region_retire(struct rpm_region *r)
{
    /* Dekker with hold(): a lane either sees live == 0, or is counted in inflight here. */
    __atomic_store_n(&r->live, 0, __ATOMIC_SEQ_CST);
    return __atomic_load_n(&r->inflight, __ATOMIC_SEQ_CST);
}

int rpm_region_inflight(struct rpm_region *r)
{
    return __atomic_load_n(&r->inflight, __ATOMIC_SEQ_CST);
}

void rpm_count(uint64_t *field, uint64_t n)
{
    __atomic_add_fetch(field, n, __ATOMIC_RELAXED);
}

static uint64_t persist_bounds[RPM_PERSIST_BUCKETS - 1];
static uint32_t n_persist_bounds;

void rpm_persist_bounds(const uint64_t *ns, uint32_t n)
{
    if (n > RPM_PERSIST_BUCKETS - 1)
        n = RPM_PERSIST_BUCKETS - 1;
    memcpy(persist_bounds, ns, sizeof *ns * n);
    n_persist_bounds = n;
}

void rpm_count_persist(struct rpm_counters *c, uint64_t ns, uint64_t bytes)
{
    uint32_t i = 0;
    while (i < n_persist_bounds && ns > persist_bounds[i])
        i++;
    rpm_count(&c->persist_hist[i], 1);
    rpm_count(&c->persists, 1);
    rpm_count(&c->persist_ns, ns);
    rpm_count(&c->persisted_bytes, bytes);
}

static struct rpm_region *hold(struct rpm_lane *l, uint32_t key)
{
    if (!key)
        return NULL;
    for (uint32_t i = 0; i < l->nregions; i++) {
        struct rpm_region *r = &l->regions[i];
        if (__atomic_load_n(&r->key, __ATOMIC_RELAXED) != key)
            continue;
        __atomic_add_fetch(&r->inflight, 1, __ATOMIC_SEQ_CST);
        if (__atomic_load_n(&r->live, __ATOMIC_SEQ_CST) &&
            __atomic_load_n(&r->key, __ATOMIC_ACQUIRE) == key)
            return r;
        __atomic_sub_fetch(&r->inflight, 1, __ATOMIC_SEQ_CST);
    }
    return NULL;
}

static void unhold(struct rpm_region *r)
{
    __atomic_sub_fetch(&r->inflight, 1, __ATOMIC_SEQ_CST);
}

static int in_bounds(const struct rpm_region *r, uint64_t off, uint64_t len)
{
    return off <= r->size && len <= r->size - off;
}

/* ---- socket waits ------------------------------------------------------------------ */

/* Wait until the socket is readable (want_out = 0) or writable (1). deadline 0 = none. */
static int wait_fd(struct rpm_lane *l, int want_out, uint64_t deadline, int idle)
{
    for (;;) {
        if (__atomic_load_n(&l->stop, __ATOMIC_RELAXED))
            return RPM_LANE_STOPPED;
        int ms = -1;
        if (deadline) {
            uint64_t t = now_ns();
            if (t >= deadline)
                return idle ? RPM_LANE_IDLE : RPM_LANE_STALLED;
            ms = (int)((deadline - t + 999999) / 1000000);
        }
        struct pollfd p = {.fd = l->fd, .events = want_out ? POLLOUT : POLLIN};
        int n = poll(&p, 1, ms);
        if (n > 0)
            return 0;
        if (n < 0 && errno != EINTR) {
            l->err = errno;
            return RPM_LANE_SOCKET;
        }
    }
}

static uint64_t deadline_after(int ms)
{
    return ms < 0 ? 0 : now_ns() + (uint64_t)ms * 1000000u + 1;
}

/* recv into dst; >0 bytes, or a status (<= 0 means: closed, see mid). */
static int recv_some(struct rpm_lane *l, char *dst, size_t cap, uint64_t deadline, int idle,
                     int spin, ssize_t *got)
{
    uint64_t spin_until = 0;
    long switches = 0;
    int spun = 0; /* passes of this spin so far */
    if (spin && l->spin_us > 0) {
        uint64_t t = now_ns();
        if (t >= l->spin_after) {
            spin_until = t + (uint64_t)l->spin_us * 1000u;
            switches = involuntary_switches();
        }
    }
    for (;;) {
        ssize_t n;
        if (l->sec) {
            /* Verified plaintext only: a record is opened in the record layer's own buffer
             * and copied here (maybe straight into the pool) after its tag checked out. */
            long got = rpm_sec_recv(l->sec, l->fd, dst, cap);
            n = got < 0 ? -1 : got;
            if (got < 0)
                errno = (int)-got;
        } else {
            n = recv(l->fd, dst, cap, MSG_DONTWAIT);
        }
        if (n >= 0) {
            if (spin_until && spun)
                l->spin_given = 0; /* a spin that lasted until the frame came */
            *got = n;
            return 0;
        }
        if (errno == EINTR)
            continue;
        if (errno != EAGAIN && errno != EWOULDBLOCK) {
            l->err = errno;
            return RPM_LANE_SOCKET;
        }
        if (spin_until && now_ns() < spin_until) {
            if (__atomic_load_n(&l->stop, __ATOMIC_RELAXED))
                return RPM_LANE_STOPPED;
            sched_yield();
            spun++;
            if (involuntary_switches() != switches) {
                spin_until = 0;
                if (++l->spin_given >= SPIN_GIVEN) {
                    l->spin_given = 0;
                    l->spin_after = now_ns() + SPIN_BACKOFF_NS;
                }
            }
            continue;
        }
        int rc = wait_fd(l, 0, deadline, idle);
        if (rc)
            return rc;
    }
}

/* Make at least n bytes (n <= stage_size) sit in the staging buffer. */
static int fill(struct rpm_lane *l, uint32_t n, uint64_t deadline, int idle)
{
    if (l->end - l->start >= n)
        return 0;
    if (l->start == l->end) {
        l->start = l->end = 0;
    } else if (l->start + n > l->stage_size) {
        uint32_t have = l->end - l->start;
        memmove(l->stage, l->stage + l->start, have);
        l->start = 0;
        l->end = have;
    }
    while (l->end - l->start < n) {
        ssize_t got = 0;
        int rc = recv_some(l, l->stage + l->end, l->stage_size - l->end, deadline, idle, 1, &got);
        if (rc)
            return rc;
        if (!got)
            return l->end > l->start ? RPM_LANE_TRUNCATED : RPM_LANE_CLOSED;
        l->end += (uint32_t)got;
    }
    return 0;
}

/* Seal and send every byte of the buffers, waiting for the socket as needed. */
static int sec_send_all(struct rpm_lane *l, struct iovec *iov, int cnt, uint64_t deadline)
{
    struct rpm_buf bufs[4];
    if (cnt > 4)
        return RPM_LANE_SOCKET;
    for (int i = 0; i < cnt; i++)
        bufs[i] = (struct rpm_buf){iov[i].iov_base, iov[i].iov_len};
    int i = 0;
    for (;;) {
        long n = i < cnt ? rpm_sec_sendv(l->sec, l->fd, bufs + i, cnt - i) : rpm_sec_flush(l->sec, l->fd);
        if (n < 0 && n != -EAGAIN) {
            l->err = (int)-n;
            return RPM_LANE_SOCKET;
        }
        if (i < cnt && n > 0) {
            size_t left = (size_t)n;
            while (i < cnt && left >= bufs[i].len)
                left -= bufs[i++].len;
            if (i < cnt) {
                bufs[i].base = (const char *)bufs[i].base + left;
                bufs[i].len -= left;
            }
            continue;
        }
        if (i == cnt && !rpm_sec_pending(l->sec))
            return 0;
        int rc = wait_fd(l, 1, deadline, 0);
        if (rc)
            return rc;
    }
}

static int send_all(struct rpm_lane *l, struct iovec *iov, int cnt, uint64_t deadline)
{
    if (l->sec)
        return sec_send_all(l, iov, cnt, deadline);
    while (cnt) {
        struct msghdr m = {.msg_iov = iov, .msg_iovlen = (size_t)cnt};
        ssize_t n = sendmsg(l->fd, &m, MSG_DONTWAIT | MSG_NOSIGNAL);
        if (n < 0) {
            if (errno == EINTR)
                continue;
            if (errno != EAGAIN && errno != EWOULDBLOCK) {
                l->err = errno;
                return RPM_LANE_SOCKET;
            }
            int rc = wait_fd(l, 1, deadline, 0);
            if (rc)
                return rc;
            continue;
        }
        while (cnt && (size_t)n >= iov->iov_len) {
            n -= (ssize_t)iov->iov_len;
            iov++;
            cnt--;
        }
        if (cnt) {
            iov->iov_base = (char *)iov->iov_base + n;
            iov->iov_len -= (size_t)n;
        }
    }
    return 0;
}

static int reply(struct rpm_lane *l, uint8_t op, uint32_t id, const void *data, uint32_t len,
                 uint64_t deadline)
{
    struct rpm_wire_hdr h = {.op = op, .length = len, .id = id};
    struct iovec iov[2] = {{&h, RPM_WIRE_HEADER_SIZE}, {(void *)data, len}};
    return send_all(l, iov, len ? 2 : 1, deadline);
}

/* ---- the data ops -------------------------------------------------------------------- */

static void persist(struct rpm_region *r, const uint64_t *pairs, uint32_t n, int *failed)
{
    if (r->pmem) {
        rpm_flush_ranges(r->base, pairs, n);
        rpm_drain();
    } else {
        for (uint32_t i = 0; i < n; i++) {
            uint64_t off = pairs[2 * i], len = pairs[2 * i + 1];
            if (!len)
                continue;
            uint64_t start = off & ~(uint64_t)(PAGE - 1);
            if (msync(r->base + start, off + len - start, MS_SYNC) && !*failed)
                *failed = errno;
        }
    }
    rpm_count(&r->counters->persisted_ranges, n);
}

/* Copy from the staging buffer into the pool. Under apm the bytes must reach the
 * persistence domain as a NIC with DDIO off would place them: non-temporal stores do that
 * without a write-back of each line afterwards. */
static void place(const struct rpm_lane *l, char *dst, const char *src, size_t n)
{
    if (l->apm)
        rpm_memcpy_nt(dst, src, n);
    else
        memcpy(dst, src, n);
}

static int do_write(struct rpm_lane *l, const struct rpm_wire_hdr *h, struct rpm_region *r,
                    uint64_t deadline)
{
    char *dst = r->base + h->offset;
    uint32_t total = h->length, pos = l->end - l->start;
    uint32_t straight_from = total, straight_to = 0; /* what recv placed through the cache */
    if (pos > total)
        pos = total;
    place(l, dst, l->stage + l->start, pos);
    l->start += pos;
    while (pos < total) {
        uint32_t rest = total - pos;
        if (rest < STRAIGHT_MIN) {
            int rc = fill(l, rest, deadline, 0);
            if (rc)
                return rc == RPM_LANE_CLOSED ? RPM_LANE_TRUNCATED : rc;
            place(l, dst + pos, l->stage + l->start, rest);
            l->start += rest;
            break;
        }
        ssize_t got = 0;
        int rc = recv_some(l, dst + pos, rest, deadline, 0, 0, &got);
        if (rc)
            return rc;
        if (!got)
            return RPM_LANE_TRUNCATED;
        if (pos < straight_from)
            straight_from = pos;
        pos += (uint32_t)got;
        straight_to = pos;
    }
    if (l->apm && straight_to > straight_from)
        rpm_flush(dst + straight_from, straight_to - straight_from); /* fenced before the next READ */
    rpm_count(&r->counters->writes, 1);
    rpm_count(&r->counters->bytes, total);
    return 0;
}

static int do_read(struct rpm_lane *l, const struct rpm_wire_hdr *h, struct rpm_region *r,
                   uint64_t deadline)
{
    /* Everything earlier on the lane is placed; under apm it must also be persistent. */
    if (l->apm)
        rpm_drain();
    /* Counted before the reply, so a peer that saw the answer also sees it counted. */
    rpm_count(h->flags & RPM_WIRE_F_FLUSH ? &r->counters->flushes : &r->counters->reads, 1);
    return reply(l, RPM_WIRE_OP_READ_RESP, h->id, r->base + h->offset, h->length, deadline);
}

static void do_atomic(struct rpm_lane *l, const struct rpm_wire_hdr *h, struct rpm_region *r)
{
    uint64_t *word = (uint64_t *)(r->base + h->offset);
    __atomic_store_n(word, h->imm, __ATOMIC_RELEASE);
    if (l->apm)
        rpm_flush(word, RPM_WIRE_ATOMIC_SIZE);
    rpm_count(&r->counters->atomics, 1);
}

/* Record why a frame is refused; the lane ends with it. */
static int refuse(struct rpm_lane *l, const struct rpm_wire_hdr *h, uint32_t code, uint32_t rule,
                  uint64_t a, uint64_t b, uint64_t c)
{
    l->code = code;
    l->refused = rule;
    l->args[0] = a;
    l->args[1] = b;
    l->args[2] = c;
    memcpy(l->hdr, h, RPM_WIRE_HEADER_SIZE);
    return RPM_LANE_REFUSED;
}

/* Persist a flush's ranges, pairs of them at a time as they arrive (a list may be larger
 * than the staging buffer): each piece is bounds-checked before any of it is persisted. A
 * failed persist still reads the rest, so the stream stays intact and the lane goes on. */
static int do_flush(struct rpm_lane *l, const struct rpm_wire_hdr *h, struct rpm_region *r,
                    uint64_t deadline)
{
    if (h->length < RPM_WIRE_FLUSH_COUNT_SIZE)
        return refuse(l, h, RPM_WIRE_CODE_BAD_FRAME, RPM_REFUSED_FLUSH_LIST, 0, 1, 0);
    int rc = fill(l, RPM_WIRE_FLUSH_COUNT_SIZE, deadline, 0);
    if (rc)
        return rc == RPM_LANE_CLOSED ? RPM_LANE_TRUNCATED : rc;
    uint32_t count;
    memcpy(&count, l->stage + l->start, RPM_WIRE_FLUSH_COUNT_SIZE);
    if ((uint64_t)h->length != RPM_WIRE_FLUSH_COUNT_SIZE + (uint64_t)RPM_WIRE_FLUSH_RANGE_SIZE * count)
        return refuse(l, h, RPM_WIRE_CODE_BAD_FRAME, RPM_REFUSED_FLUSH_LIST, count, 0, 0);
    l->start += RPM_WIRE_FLUSH_COUNT_SIZE;
    uint32_t piece = l->stage_size / RPM_WIRE_FLUSH_RANGE_SIZE;
    uint64_t pairs[2 * 64]; /* the ranges may be unaligned in the staging buffer */
    int failed = 0;
    uint64_t bytes = 0, took = 0;
    for (uint32_t left = count; left;) {
        uint32_t n = left < piece ? left : piece;
        rc = fill(l, n * RPM_WIRE_FLUSH_RANGE_SIZE, deadline, 0);
        if (rc)
            return rc == RPM_LANE_CLOSED ? RPM_LANE_TRUNCATED : rc;
        const char *list = l->stage + l->start;
        for (uint32_t i = 0; i < n; i++) {
            struct rpm_wire_flush_range range;
            memcpy(&range, list + (size_t)RPM_WIRE_FLUSH_RANGE_SIZE * i, sizeof range);
            if (!in_bounds(r, range.offset, range.length))
                return refuse(l, h, RPM_WIRE_CODE_OUT_OF_BOUNDS, RPM_REFUSED_FLUSH_RANGE, range.offset,
                              range.length, r->size);
        }
        if (!failed) {
            uint64_t started = now_ns();
            for (uint32_t i = 0; i < n; i += 64) {
                uint32_t k = n - i < 64 ? n - i : 64;
                memcpy(pairs, list + (size_t)RPM_WIRE_FLUSH_RANGE_SIZE * i, (size_t)RPM_WIRE_FLUSH_RANGE_SIZE * k);
                persist(r, pairs, k, &failed);
                for (uint32_t j = 0; j < k; j++)
                    bytes += pairs[2 * j + 1];
            }
            took += now_ns() - started;
            deadline = deadline_after(l->frame_ms); /* a slow disk is not a stalled peer */
        }
        l->start += n * RPM_WIRE_FLUSH_RANGE_SIZE;
        left -= n;
    }
    rpm_count_persist(r->counters, took, bytes);
    if (failed) {
        l->err = failed;
        memcpy(l->hdr, h, RPM_WIRE_HEADER_SIZE);
        return RPM_LANE_PERSIST_FAILED;
    }
    rpm_count(&r->counters->flushes, 1);
    return reply(l, RPM_WIRE_OP_SEND_REPLY, h->id, NULL, 0, deadline);
}

/* The checks of a header that need no registration, in unpack_header's order and then
 * the op's own (wire.py, target docs/wire.md): 0, or a refusal. */
static int check_header(struct rpm_lane *l, const struct rpm_wire_hdr *h)
{
    int known = rpm_wire_op_flags(h->op);
    if (known < 0)
        return refuse(l, h, RPM_WIRE_CODE_BAD_FRAME, RPM_REFUSED_OP, h->op, 0, 0);
    if (h->reserved)
        return refuse(l, h, RPM_WIRE_CODE_BAD_FRAME, RPM_REFUSED_RESERVED, h->reserved, 0, 0);
    if (h->flags & ~known)
        return refuse(l, h, RPM_WIRE_CODE_BAD_FRAME, RPM_REFUSED_FLAGS, h->flags, 0, 0);
    switch (h->op) {
    case RPM_WIRE_OP_WRITE:
        if (h->length > RPM_WIRE_MAX_WRITE)
            return refuse(l, h, RPM_WIRE_CODE_TOO_LARGE, RPM_REFUSED_TOO_LARGE, RPM_WIRE_MAX_WRITE, 0, 0);
        return 0;
    case RPM_WIRE_OP_READ:
        if (h->length > RPM_WIRE_MAX_READ)
            return refuse(l, h, RPM_WIRE_CODE_TOO_LARGE, RPM_REFUSED_TOO_LARGE, RPM_WIRE_MAX_READ, 0, 0);
        return 0;
    case RPM_WIRE_OP_ATOMIC_WRITE:
        if (h->length)
            return refuse(l, h, RPM_WIRE_CODE_BAD_FRAME, RPM_REFUSED_ATOMIC_PAYLOAD, 0, 0, 0);
        if (h->offset % RPM_WIRE_ATOMIC_SIZE)
            return refuse(l, h, RPM_WIRE_CODE_MISALIGNED, RPM_REFUSED_MISALIGNED, 0, 0, 0);
        return 0;
    case RPM_WIRE_OP_SEND:
        if (h->imm == RPM_WIRE_SEND_CONTROL)
            return RPM_LANE_HANDOFF;
        if (h->imm != RPM_WIRE_SEND_FLUSH)
            return refuse(l, h, RPM_WIRE_CODE_BAD_FRAME, RPM_REFUSED_SEND_KIND, 0, 0, 0);
        return 0;
    default:
        return refuse(l, h, RPM_WIRE_CODE_NOT_ALLOWED, RPM_REFUSED_NOT_INITIATORS, 0, 0, 0);
    }
}

/* Serve one frame whose header is in the staging buffer. */
static int serve_one(struct rpm_lane *l, uint64_t deadline)
{
    struct rpm_wire_hdr h;
    memcpy(&h, l->stage + l->start, RPM_WIRE_HEADER_SIZE);
    int rc = check_header(l, &h);
    if (rc)
        return rc;
    struct rpm_region *r = hold(l, h.key);
    if (!r)
        return refuse(l, &h, RPM_WIRE_CODE_BAD_KEY, RPM_REFUSED_KEY, 0, 0, 0);
    uint64_t span = h.op == RPM_WIRE_OP_ATOMIC_WRITE ? RPM_WIRE_ATOMIC_SIZE
                    : h.op == RPM_WIRE_OP_SEND ? 0 : h.length;
    if (!in_bounds(r, h.offset, span)) {
        rc = refuse(l, &h, RPM_WIRE_CODE_OUT_OF_BOUNDS, RPM_REFUSED_BOUNDS, span, r->size, 0);
    } else if ((h.op == RPM_WIRE_OP_WRITE || h.op == RPM_WIRE_OP_ATOMIC_WRITE) && !r->writable) {
        rc = refuse(l, &h, RPM_WIRE_CODE_NOT_ALLOWED, RPM_REFUSED_READ_ONLY, 0, 0, 0);
    } else if (h.op == RPM_WIRE_OP_SEND && h.length > RPM_WIRE_MAX_SEND) {
        rc = refuse(l, &h, RPM_WIRE_CODE_TOO_LARGE, RPM_REFUSED_TOO_LARGE, RPM_WIRE_MAX_SEND, 0, 0);
    } else {
        l->start += RPM_WIRE_HEADER_SIZE;
        switch (h.op) {
        case RPM_WIRE_OP_WRITE:
            rc = do_write(l, &h, r, deadline);
            break;
        case RPM_WIRE_OP_READ:
            rc = do_read(l, &h, r, deadline);
            break;
        case RPM_WIRE_OP_ATOMIC_WRITE:
            do_atomic(l, &h, r);
            break;
        default:
            rc = do_flush(l, &h, r, deadline);
            break;
        }
    }
    unhold(r);
    return rc;
}

int rpm_lane_serve(struct rpm_lane *l)
{
    l->err = 0;
    for (;;) {
        /* Idle until the first byte of a header; from then on a frame is in progress and
         * the rest of it must come within the frame deadline. */
        int rc = 0;
        if (l->end == l->start)
            rc = fill(l, 1, deadline_after(l->idle_ms), 1);
        if (!rc)
            rc = fill(l, RPM_WIRE_HEADER_SIZE, deadline_after(l->frame_ms), 0);
        if (rc)
            return rc == RPM_LANE_CLOSED && l->end > l->start ? RPM_LANE_TRUNCATED : rc;
        rc = serve_one(l, deadline_after(l->frame_ms));
        if (rc)
            return rc;
    }
}

/* ---- initiator side -------------------------------------------------------------------- */

/* One barrier's frames, built and handed to the socket without a Python object per range:
 * a WRITE per range, then its one flush. Range i's bytes are at base + src[i], or, without
 * src, at base + its remote offset (a range of the local pool, placed at the same offset). */
long rpm_post_barrier(struct rpm_sec *sec, int fd, const char *base, const uint64_t *src,
                      const uint64_t *pairs, uint32_t n, uint32_t key, uint64_t region_size,
                      uint32_t first_id, int apm, uint8_t *hdrs, uint8_t *flush_list, uint64_t *total)
{
    struct rpm_wire_hdr *h = (struct rpm_wire_hdr *)hdrs;
    uint64_t bytes = 0;
    if (rpm_ranges_bad(pairs, n, region_size) >= 0)
        return -EINVAL;
    for (uint32_t i = 0; i < n; i++) {
        uint64_t off = pairs[2 * i], len = pairs[2 * i + 1];
        h[i] = (struct rpm_wire_hdr){.op = RPM_WIRE_OP_WRITE, .key = key, .offset = off,
                                     .length = (uint32_t)len, .id = first_id + i};
        bytes += RPM_WIRE_HEADER_SIZE + len;
    }
    uint32_t list_len = RPM_WIRE_FLUSH_COUNT_SIZE + RPM_WIRE_FLUSH_RANGE_SIZE * n;
    if (apm) {
        h[n] = (struct rpm_wire_hdr){.op = RPM_WIRE_OP_READ, .flags = RPM_WIRE_F_FLUSH, .key = key,
                                     .length = RPM_WIRE_FLUSH_READ_SIZE, .id = first_id + n};
        list_len = 0;
    } else {
        memcpy(flush_list, &n, RPM_WIRE_FLUSH_COUNT_SIZE);
        memcpy(flush_list + RPM_WIRE_FLUSH_COUNT_SIZE, pairs, (size_t)RPM_WIRE_FLUSH_RANGE_SIZE * n);
        h[n] = (struct rpm_wire_hdr){.op = RPM_WIRE_OP_SEND, .key = key, .length = list_len,
                                     .id = first_id + n, .imm = RPM_WIRE_SEND_FLUSH};
    }
    bytes += RPM_WIRE_HEADER_SIZE + list_len;
    *total = bytes;
    if (fd < 0)
        return 0; /* frames built for the caller to send later */

    /* iovecs in rounds of at most IOV_BATCH: header, payload, header, payload, ... flush */
    enum { IOV_BATCH = 1024 };
    struct iovec iov[IOV_BATCH];
    uint64_t sent = 0;
    uint32_t next = 0; /* iovec index over the whole barrier: 2 n + 1 or 2 */
    uint32_t count = 2 * n + (apm ? 1 : 2);
    uint64_t skip = 0; /* bytes of iovec `next` already sent */
    while (next < count) {
        int k = 0;
        for (uint32_t j = next; j < count && k < IOV_BATCH; j++, k++) {
            char *p;
            size_t len;
            if (j < 2 * n) {
                uint32_t i = j / 2;
                p = j % 2 ? (char *)base + (src ? src[i] : pairs[2 * i]) : (char *)&h[i];
                len = j % 2 ? pairs[2 * i + 1] : RPM_WIRE_HEADER_SIZE;
            } else if (j == 2 * n) {
                p = (char *)&h[n];
                len = RPM_WIRE_HEADER_SIZE;
            } else {
                p = (char *)flush_list;
                len = list_len;
            }
            iov[k].iov_base = p;
            iov[k].iov_len = len;
        }
        iov[0].iov_base = (char *)iov[0].iov_base + skip;
        iov[0].iov_len -= skip;
        ssize_t got;
        if (sec) {
            /* Sealed bytes the socket does not take now wait in sec (the caller sees
             * rpm_sec_pending). */
            static __thread struct rpm_buf bufs[IOV_BATCH];
            for (int m = 0; m < k; m++)
                bufs[m] = (struct rpm_buf){iov[m].iov_base, iov[m].iov_len};
            long n = rpm_sec_sendv(sec, fd, bufs, k);
            got = n;
            if (n < 0)
                errno = (int)-n;
        } else {
            struct msghdr msg = {.msg_iov = iov, .msg_iovlen = (size_t)k};
            got = sendmsg(fd, &msg, MSG_DONTWAIT | MSG_NOSIGNAL);
        }
        if (got < 0) {
            if (errno == EINTR)
                continue;
            if (errno == EAGAIN || errno == EWOULDBLOCK)
                break;
            return -errno;
        }
        sent += (uint64_t)got;
        size_t left = (size_t)got;
        int full = 1;
        for (int m = 0; m < k; m++) {
            if (left >= iov[m].iov_len) {
                left -= iov[m].iov_len;
                next++;
                skip = 0;
            } else {
                skip = (m == 0 ? skip : 0) + left;
                full = 0;
                break;
            }
        }
        if (!full)
            break; /* the socket took what it could; the caller sends the rest */
    }
    return (long)sent;
}

/* The reply a barrier waits for, taken off the connection without Python when it is the next
 * frame: op, request id and length exactly as expected, no flags, nothing reserved. Frames
 * come into the connection's staging buffer buf[*start, *end) of cap bytes, which Python's
 * reader shares (it takes over whatever is left there). Anything else next on the stream (an
 * earlier request's reply, an ERROR frame, a closed or failed socket) is left alone for
 * Python, which owns every check and its wording: 2. 1: taken; 0: not all of it here yet. */
long rpm_take_reply(struct rpm_sec *sec, int fd, uint8_t *buf, uint32_t cap, uint32_t *start,
                    uint32_t *end, uint8_t op, uint32_t id, uint32_t length)
{
    uint32_t want = RPM_WIRE_HEADER_SIZE + length;
    if (want > cap)
        return 2;
    for (;;) {
        uint32_t have = *end - *start;
        if (have >= RPM_WIRE_HEADER_SIZE) {
            struct rpm_wire_hdr h;
            memcpy(&h, buf + *start, RPM_WIRE_HEADER_SIZE);
            if (h.op != op || h.id != id || h.length != length || h.flags || h.reserved)
                return 2;
            if (have >= want) {
                *start += want;
                if (*start == *end)
                    *start = *end = 0;
                return 1;
            }
        }
        if (*start + want > cap) { /* make room for the whole frame */
            memmove(buf, buf + *start, have);
            *start = 0;
            *end = have;
        }
        long got;
        if (sec) {
            got = rpm_sec_recv(sec, fd, (char *)buf + *end, cap - *end);
        } else {
            got = recv(fd, buf + *end, cap - *end, MSG_DONTWAIT);
            if (got < 0)
                got = -errno;
        }
        if (got == -EINTR)
            continue;
        if (got == -EAGAIN || got == -EWOULDBLOCK)
            return 0;
        if (got <= 0)
            return 2; /* the end of the stream, or an error: Python's reader reports it */
        *end += (uint32_t)got;
    }
}

long rpm_ranges_bad(const uint64_t *pairs, uint32_t n, uint64_t region_size)
{
    for (uint32_t i = 0; i < n; i++) {
        uint64_t off = pairs[2 * i], len = pairs[2 * i + 1];
        if (!len || len > RPM_WIRE_MAX_WRITE || off > region_size || len > region_size - off)
            return (long)i;
    }
    return -1;
}
