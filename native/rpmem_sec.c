/* rpmemfs wire protection: the AEAD record layer of a protected TCP connection (docs/wire.md,
 * "Protected traffic"). One implementation for both ends and both languages: the target's
 * C lane loop and the initiator's C barrier builder call it directly, Python calls it
 * through cffi (rpmemfs/transport/sockio.py).
 *
 * After the handshake, each direction of the byte stream is cut into records:
 *
 *     u32 length L (little endian, 1..RPM_WIRE_RECORD_MAX) | L bytes of ciphertext | 16-byte tag
 *
 * sealed with AES-256-GCM, or ChaCha20-Poly1305 where the CPU has no AES instructions, under
 * the direction's own key. The nonce is the record's sequence number in that direction (a
 * 64-bit counter, little endian, then four zero bytes); the length is the associated data.
 * A record dropped, replayed, reordered or changed in transit therefore fails its tag, and
 * the connection is done: the failure is sticky, and nothing of that record or anything
 * after it is ever handed out. Records are opened into a buffer of their own and copied
 * to the caller only once the tag verified, so unverified bytes never reach a pool.
 *
 * Records are cut from the stream, not per frame: a barrier that fits one record costs one
 * seal and one open, whatever its number of frames. Buffers are fixed at creation; a
 * record's length is checked against them before anything is read into them.
 */
#define _GNU_SOURCE
#include "rpmem_native.h"

#include <cpuid.h>
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

#include <openssl/evp.h>

#define LEN_SIZE RPM_WIRE_RECORD_LEN_SIZE
#define NONCE_SIZE 12u
#define OBUF_SIZE (4u * (RPM_WIRE_RECORD_MAX + RPM_WIRE_RECORD_OVERHEAD))

struct rpm_sec {
    EVP_CIPHER_CTX *tx, *rx;
    uint64_t tx_seq, rx_seq;
    int failed; /* -errno of the first failure: every later call returns it */
    /* received ciphertext, at most one record plus the start of the next ones */
    uint8_t rbuf[LEN_SIZE + RPM_WIRE_RECORD_MAX + RPM_WIRE_RECORD_TAG_SIZE];
    uint32_t rlen;
    /* the plaintext of the last record opened, [pstart, pend) not yet handed out */
    uint8_t pbuf[RPM_WIRE_RECORD_MAX];
    uint32_t pstart, pend;
    /* sealed records the socket has not taken yet: [ostart, oend) */
    uint32_t ostart, oend;
    uint8_t obuf[OBUF_SIZE];
};

int rpm_sec_has_aes(void)
{
    unsigned a, b, c, d;
    /* AES-NI (bit 25) and PCLMULQDQ (bit 1): what makes GCM fast. */
    return __get_cpuid(1, &a, &b, &c, &d) && (c & (1u << 25)) && (c & (1u << 1));
}

static const EVP_CIPHER *cipher_of(int cipher)
{
    switch (cipher) {
    case RPM_WIRE_CIPHER_AES_256_GCM:
        return EVP_aes_256_gcm();
    case RPM_WIRE_CIPHER_CHACHA20_POLY1305:
        return EVP_chacha20_poly1305();
    default:
        return NULL;
    }
}

static EVP_CIPHER_CTX *new_ctx(const EVP_CIPHER *c, const uint8_t *key, int enc)
{
    EVP_CIPHER_CTX *ctx = EVP_CIPHER_CTX_new();
    if (!ctx)
        return NULL;
    if (EVP_CipherInit_ex(ctx, c, NULL, NULL, NULL, enc) != 1 ||
        EVP_CIPHER_CTX_ctrl(ctx, EVP_CTRL_AEAD_SET_IVLEN, NONCE_SIZE, NULL) != 1 ||
        EVP_CipherInit_ex(ctx, NULL, NULL, key, NULL, enc) != 1) {
        EVP_CIPHER_CTX_free(ctx);
        return NULL;
    }
    return ctx;
}

struct rpm_sec *rpm_sec_new(int cipher, const uint8_t *tx_key, const uint8_t *rx_key)
{
    const EVP_CIPHER *c = cipher_of(cipher);
    if (!c)
        return NULL;
    struct rpm_sec *s = calloc(1, sizeof *s);
    if (!s)
        return NULL;
    s->tx = new_ctx(c, tx_key, 1);
    s->rx = new_ctx(c, rx_key, 0);
    if (!s->tx || !s->rx) {
        rpm_sec_free(s);
        return NULL;
    }
    return s;
}

void rpm_sec_free(struct rpm_sec *s)
{
    if (!s)
        return;
    EVP_CIPHER_CTX_free(s->tx);
    EVP_CIPHER_CTX_free(s->rx);
    free(s);
}

static void nonce_of(uint64_t seq, uint8_t *nonce)
{
    memset(nonce, 0, NONCE_SIZE);
    memcpy(nonce, &seq, sizeof seq); /* little endian: the wire's byte order is the host's */
}

static int fail(struct rpm_sec *s, int err)
{
    if (!s->failed)
        s->failed = err;
    return s->failed;
}

/* ---- sending ----------------------------------------------------------------------- */

/* Seal len bytes of the buffers (from buffer *i, offset *skip on) as one record at the end
 * of obuf, advancing *i and *skip past them. */
static int seal(struct rpm_sec *s, const struct rpm_buf *bufs, int cnt, int *i, size_t *skip,
                uint32_t len)
{
    if (s->tx_seq == UINT64_MAX)
        return -EOVERFLOW; /* never reached: the connection would close first */
    uint8_t nonce[NONCE_SIZE];
    nonce_of(s->tx_seq, nonce);
    uint8_t *out = s->obuf + s->oend;
    memcpy(out, &len, LEN_SIZE);
    int n;
    if (EVP_EncryptInit_ex(s->tx, NULL, NULL, NULL, nonce) != 1 ||
        EVP_EncryptUpdate(s->tx, NULL, &n, out, LEN_SIZE) != 1)
        return -EIO;
    uint8_t *ct = out + LEN_SIZE;
    uint32_t left = len;
    while (left) {
        if (*i >= cnt)
            return -EINVAL;
        size_t avail = bufs[*i].len - *skip;
        uint32_t take = avail < left ? (uint32_t)avail : left;
        if (take && EVP_EncryptUpdate(s->tx, ct, &n, (const uint8_t *)bufs[*i].base + *skip,
                                      (int)take) != 1)
            return -EIO;
        ct += take;
        left -= take;
        *skip += take;
        if (*skip == bufs[*i].len) {
            (*i)++;
            *skip = 0;
        }
    }
    if (EVP_EncryptFinal_ex(s->tx, ct, &n) != 1 ||
        EVP_CIPHER_CTX_ctrl(s->tx, EVP_CTRL_AEAD_GET_TAG, RPM_WIRE_RECORD_TAG_SIZE, ct) != 1)
        return -EIO;
    s->tx_seq++;
    s->oend += LEN_SIZE + len + RPM_WIRE_RECORD_TAG_SIZE;
    return 0;
}

long rpm_sec_flush(struct rpm_sec *s, int fd)
{
    if (s->failed)
        return s->failed;
    while (s->ostart < s->oend) {
        ssize_t n = send(fd, s->obuf + s->ostart, s->oend - s->ostart, MSG_DONTWAIT | MSG_NOSIGNAL);
        if (n < 0) {
            if (errno == EINTR)
                continue;
            if (errno == EAGAIN || errno == EWOULDBLOCK)
                break;
            return fail(s, -errno);
        }
        s->ostart += (uint32_t)n;
    }
    if (s->ostart == s->oend)
        s->ostart = s->oend = 0;
    return s->oend - s->ostart;
}

long rpm_sec_sendv(struct rpm_sec *s, int fd, const struct rpm_buf *bufs, int cnt)
{
    if (s->failed)
        return s->failed;
    uint64_t total = 0, consumed = 0;
    for (int k = 0; k < cnt; k++)
        total += bufs[k].len;
    int i = 0;
    size_t skip = 0;
    for (;;) {
        long pending = rpm_sec_flush(s, fd);
        if (pending < 0)
            return pending;
        if (consumed == total)
            break;
        if (pending && s->ostart) { /* make room behind what is still to go out */
            memmove(s->obuf, s->obuf + s->ostart, (size_t)pending);
            s->ostart = 0;
            s->oend = (uint32_t)pending;
        }
        uint32_t room = OBUF_SIZE - s->oend;
        if (room <= RPM_WIRE_RECORD_OVERHEAD)
            break; /* the socket and our buffer are full: the caller waits */
        uint64_t want = total - consumed;
        uint32_t len = room - RPM_WIRE_RECORD_OVERHEAD;
        if (len > RPM_WIRE_RECORD_MAX)
            len = RPM_WIRE_RECORD_MAX;
        if (want < len)
            len = (uint32_t)want;
        int rc = seal(s, bufs, cnt, &i, &skip, len);
        if (rc)
            return fail(s, rc);
        consumed += len;
    }
    if (!consumed && total)
        return -EAGAIN;
    return (long)consumed;
}

uint32_t rpm_sec_pending(const struct rpm_sec *s)
{
    return s->oend - s->ostart;
}

/* ---- receiving --------------------------------------------------------------------- */

/* Open the record at the start of rbuf if it is all there: 1 opened, 0 not whole yet. */
static int open_record(struct rpm_sec *s)
{
    if (s->rlen < LEN_SIZE)
        return 0;
    uint32_t len;
    memcpy(&len, s->rbuf, LEN_SIZE);
    if (!len || len > RPM_WIRE_RECORD_MAX)
        return fail(s, -EPROTO); /* not a record of ours: checked before waiting for it */
    uint32_t whole = LEN_SIZE + len + RPM_WIRE_RECORD_TAG_SIZE;
    if (s->rlen < whole)
        return 0;
    uint8_t nonce[NONCE_SIZE];
    nonce_of(s->rx_seq, nonce);
    int n, m;
    uint8_t *tag = s->rbuf + LEN_SIZE + len;
    if (EVP_DecryptInit_ex(s->rx, NULL, NULL, NULL, nonce) != 1 ||
        EVP_DecryptUpdate(s->rx, NULL, &n, s->rbuf, LEN_SIZE) != 1 ||
        EVP_DecryptUpdate(s->rx, s->pbuf, &n, s->rbuf + LEN_SIZE, (int)len) != 1 ||
        EVP_CIPHER_CTX_ctrl(s->rx, EVP_CTRL_AEAD_SET_TAG, RPM_WIRE_RECORD_TAG_SIZE, tag) != 1 ||
        EVP_DecryptFinal_ex(s->rx, s->pbuf + n, &m) != 1) {
        memset(s->pbuf, 0, len); /* nothing unverified stays readable */
        return fail(s, -EBADMSG);
    }
    if (++s->rx_seq == UINT64_MAX)
        return fail(s, -EOVERFLOW);
    s->pstart = 0;
    s->pend = len;
    s->rlen -= whole;
    memmove(s->rbuf, s->rbuf + whole, s->rlen);
    return 1;
}

long rpm_sec_recv(struct rpm_sec *s, int fd, char *dst, size_t cap)
{
    if (s->failed)
        return s->failed;
    while (s->pstart == s->pend) {
        int rc = open_record(s);
        if (rc < 0)
            return rc;
        if (rc)
            break;
        ssize_t n = recv(fd, s->rbuf + s->rlen, sizeof s->rbuf - s->rlen, MSG_DONTWAIT);
        if (n < 0) {
            if (errno == EINTR)
                continue;
            if (errno == EAGAIN || errno == EWOULDBLOCK)
                return -EAGAIN;
            return fail(s, -errno);
        }
        if (!n) /* the end of the stream: clean only between records */
            return s->rlen ? fail(s, -EPIPE) : 0;
        s->rlen += (uint32_t)n;
    }
    size_t have = s->pend - s->pstart;
    size_t take = have < cap ? have : cap;
    memcpy(dst, s->pbuf + s->pstart, take);
    s->pstart += (uint32_t)take;
    return (long)take;
}

uint32_t rpm_sec_buffered(const struct rpm_sec *s)
{
    return s->pend - s->pstart;
}

int rpm_sec_failed(const struct rpm_sec *s)
{
    return s->failed;
}
