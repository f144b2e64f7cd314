/* rpmemfs native helper. See rpmem_native.h for the contract of each call.
 *
 * Instruction-set specific code sits in target(...) functions so the module
 * builds without global -m flags and still runs on CPUs lacking them: the
 * choice is made once, from cpuid, when the module is loaded.
 */
#if !defined(__x86_64__)
#error "rpmemfs native helper supports x86-64 only"
#endif

#include "rpmem_native.h"

#include <errno.h>
#include <sys/mman.h>

#include <cpuid.h>
#include <immintrin.h>
#include <stdlib.h>
#include <string.h>

#define CACHELINE 64

typedef void (*flush_fn)(const void *addr, size_t len);

static int flush_kind;
static int crc_hw;
static flush_fn flusher;
static uint32_t crc_table[256];

/* Start of the cache line holding addr. */
static inline uintptr_t line_of(const void *addr)
{
    return (uintptr_t)addr & ~(uintptr_t)(CACHELINE - 1);
}

__attribute__((target("clwb"))) static void flush_clwb(const void *addr, size_t len)
{
    for (uintptr_t p = line_of(addr); p < (uintptr_t)addr + len; p += CACHELINE)
        _mm_clwb((void *)p);
}

__attribute__((target("clflushopt"))) static void flush_clflushopt(const void *addr, size_t len)
{
    for (uintptr_t p = line_of(addr); p < (uintptr_t)addr + len; p += CACHELINE)
        _mm_clflushopt((void *)p);
}

static void flush_clflush(const void *addr, size_t len)
{
    for (uintptr_t p = line_of(addr); p < (uintptr_t)addr + len; p += CACHELINE)
        _mm_clflush((const void *)p);
}

/* Same switch as PMDK's PMEM_NO_CLWB: lets the older paths be exercised on new CPUs. */
static int disabled(const char *name)
{
    const char *v = getenv(name);
    return v != NULL && strcmp(v, "1") == 0;
}

__attribute__((constructor)) static void rpm_init(void)
{
    unsigned a, b, c, d;

    flush_kind = 0;
    if (__get_cpuid_count(7, 0, &a, &b, &c, &d)) {
        if ((b & (1u << 24)) && !disabled("RPMEMFS_NO_CLWB"))
            flush_kind = 2;
        else if ((b & (1u << 23)) && !disabled("RPMEMFS_NO_CLFLUSHOPT"))
            flush_kind = 1;
    }
    flusher = flush_kind == 2 ? flush_clwb : flush_kind == 1 ? flush_clflushopt : flush_clflush;

    crc_hw = __get_cpuid(1, &a, &b, &c, &d) && (c & (1u << 20)) &&
             !disabled("RPMEMFS_NO_CRC32C_HW");

    for (uint32_t i = 0; i < 256; i++) {
        uint32_t r = i;
        for (int k = 0; k < 8; k++)
            r = (r >> 1) ^ (0x82F63B78u & -(r & 1u));
        crc_table[i] = r;
    }
}

int rpm_flush_kind(void)
{
    return flush_kind;
}

int rpm_has_crc32c_hw(void)
{
    return crc_hw;
}

void rpm_flush(const void *addr, size_t len)
{
    flusher(addr, len);
}

void rpm_drain(void)
{
    _mm_sfence();
}

void rpm_flush_ranges(const char *base, const uint64_t *pairs, size_t npairs)
{
    for (size_t i = 0; i < npairs; i++)
        flusher(base + pairs[2 * i], (size_t)pairs[2 * i + 1]);
}

void rpm_persist_then_store(char *base, const uint64_t *pairs, size_t npairs,
                            uint64_t rec_off, const void *rec, size_t len,
                            uint64_t stamp_off, const void *stamp, size_t stamp_len)
{
    rpm_flush_ranges(base, pairs, npairs);
    rpm_drain();
    if (len) {
        memcpy(base + rec_off, rec, len);
        flusher(base + rec_off, len);
        rpm_drain();
    }
    if (stamp_len) {
        memcpy(base + stamp_off, stamp, stamp_len);
        flusher(base + stamp_off, stamp_len);
        rpm_drain();
    }
}

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif

int rpm_populate(void *addr, size_t len)
{
    return madvise(addr, len, MADV_POPULATE_WRITE) == 0 ? 0 : -errno;
}

void rpm_memcpy_nt(void *dst, const void *src, size_t len)
{
    char *d = dst;
    const char *s = src;
    size_t head = (16 - ((uintptr_t)d & 15)) & 15;

    if (head > len)
        head = len;
    /* Parts that cannot be streamed go through the cache, so flush them. */
    memcpy(d, s, head);
    flusher(d, head);
    d += head;
    s += head;
    len -= head;

    for (; len >= 16; d += 16, s += 16, len -= 16)
        _mm_stream_si128((__m128i *)d, _mm_loadu_si128((const __m128i *)s));

    memcpy(d, s, len);
    flusher(d, len);
    _mm_sfence();
}

__attribute__((target("sse4.2"))) static uint32_t crc32c_hw(uint32_t crc, const unsigned char *p,
                                                           size_t len)
{
    uint64_t c = crc;

    for (; len > 0 && ((uintptr_t)p & 7); len--)
        c = _mm_crc32_u8((uint32_t)c, *p++);
    for (; len >= 8; p += 8, len -= 8) {
        uint64_t v;
        memcpy(&v, p, 8);
        c = _mm_crc32_u64(c, v);
    }
    for (; len > 0; len--)
        c = _mm_crc32_u8((uint32_t)c, *p++);
    return (uint32_t)c;
}

static uint32_t crc32c_table(uint32_t crc, const unsigned char *p, size_t len)
{
    for (; len > 0; len--)
        crc = (crc >> 8) ^ crc_table[(crc ^ *p++) & 0xFF];
    return crc;
}

uint32_t rpm_crc32c(uint32_t crc, const void *buf, size_t len)
{
    /* The pre/post inversion is what makes 0 the start value and results chainable. */
    crc = ~crc;
    crc = crc_hw ? crc32c_hw(crc, buf, len) : crc32c_table(crc, buf, len);
    return ~crc;
}

size_t rpm_log_scan(const void *area, size_t len, size_t off, uint64_t seq, uint64_t *out,
                    size_t max)
{
    /* The record header is struct rpm_rec_hdr (rpmem_record.h, generated from
     * rpmemfs/fs/record_format.py); the CRC covers it from RPM_REC_CRC_FROM on and then the
     * payload, which lie side by side. */
    const unsigned char *a = area;
    size_t n = 0;
    while (n < max && off <= len && len - off >= RPM_REC_HEADER_SIZE) {
        struct rpm_rec_hdr h;
        memcpy(&h, a + off, sizeof h);
        if (h.seq != seq + n || h.length == 0 || h.length > len - off - RPM_REC_HEADER_SIZE)
            break;
        if (rpm_crc32c(0, a + off + RPM_REC_CRC_FROM,
                       RPM_REC_HEADER_SIZE - RPM_REC_CRC_FROM + (size_t)h.length) != h.crc)
            break;
        out[2 * n] = off;
        out[2 * n + 1] = h.length;
        n++;
        off += RPM_REC_HEADER_SIZE + (((size_t)h.length + RPM_REC_ALIGN - 1) & ~(size_t)(RPM_REC_ALIGN - 1));
    }
    return n;
}
