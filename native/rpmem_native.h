/* rpmemfs native helper: cache-line write-back, non-temporal copies, CRC-32C.
 *
 * This header doubles as the cffi cdef: build.py feeds it to cffi with the
 * preprocessor lines dropped, so it must hold only plain declarations.
 */
#ifndef RPMEM_NATIVE_H
#define RPMEM_NATIVE_H

#include <stddef.h>
#include <stdint.h>

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
 * rec at base + rec_off, write them back and fence. The record can reach the
 * media only after the data it describes, whatever the cache evicts when. */
void rpm_persist_then_store(char *base, const uint64_t *pairs, size_t npairs,
                            uint64_t rec_off, const void *rec, size_t len);

/* Copy with non-temporal stores; dst is in the persistence domain on return. */
void rpm_memcpy_nt(void *dst, const void *src, size_t len);

/* Fault in the pages of [addr, addr + len) for writing (MADV_POPULATE_WRITE), so
 * first stores into a fresh pool do not each take a page fault. 0 or -errno. */
int rpm_populate(void *addr, size_t len);

/* CRC-32C (Castagnoli). Start with crc = 0; chaining a previous result
 * continues the checksum: rpm_crc32c(rpm_crc32c(0, a), b) == crc of a+b. */
uint32_t rpm_crc32c(uint32_t crc, const void *buf, size_t len);

#endif
