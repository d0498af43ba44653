/*
 * test_netframe.c: the client frames chatgate writes to an app itself (net.h,
 * cg_net_client_frame). Each is decoded here as RFC 6455 section 5.2 reads it: FIN and the
 * opcode, the MASK bit, the length in its three encodings (7 bits, 16, 64) at their edges,
 * the key, and the payload unmasked back to what was given, at every length around the
 * eight-byte steps of the masking loop. Keys must not repeat within a run, and a forked
 * child (--workers) must not draw the keys its parent draws next. And the server frames of a
 * batch (cg_net_batch: several frames for one send), text and binary, read back in order.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "chatgate/core/net.h"
#include "unit.h"

/* Frames len bytes of a pattern, decodes the frame, checks it; returns the key. */
static uint32_t frame_and_check(size_t len, int binary)
{
    unsigned char *buf = malloc(CG_NET_CLIENT_HEAD + len + 1);
    if (!buf)
        abort();
    unsigned char *payload = buf + CG_NET_CLIENT_HEAD;
    for (size_t i = 0; i < len; i++)
        payload[i] = (unsigned char)(i * 7 + 3);
    size_t head = cg_net_client_frame(payload, len, binary);
    CHECK(head >= 6 && head <= CG_NET_CLIENT_HEAD);
    const unsigned char *f = payload - head;
    CHECK(f[0] == (binary ? 0x82 : 0x81)); /* FIN, opcode */
    CHECK(f[1] & 0x80);                    /* MASK */
    size_t n = f[1] & 0x7f, at = 2;
    if (n == 126) {
        n = (size_t)f[2] << 8 | f[3];
        at = 4;
        CHECK(len >= 126 && len <= 0xffff);
    } else if (n == 127) {
        n = 0;
        for (int i = 0; i < 8; i++)
            n = n << 8 | f[2 + i];
        at = 10;
        CHECK(len > 0xffff);
    } else {
        CHECK(len < 126);
    }
    CHECK(n == len);
    CHECK(at + 4 == head);
    const unsigned char *key = f + at;
    int same = 1;
    for (size_t i = 0; i < len; i++)
        same &= (payload[i] ^ key[i % 4]) == (unsigned char)(i * 7 + 3);
    CHECK(same);
    uint32_t k;
    memcpy(&k, key, 4);
    free(buf);
    return k;
}

/* A batch of text and binary frames of lengths at the three encodings' edges, read back
 * frame by frame: FIN and the opcode, no MASK, the length, the payload. */
static void batch_reads_back(void)
{
    static const size_t lens[] = {0, 5, 125, 126, 200, 65535, 65536, 70000};
    enum { N = sizeof(lens) / sizeof(lens[0]) };
    cg_net_batch b = {0};
    char *payload = malloc(70000);
    if (!payload)
        abort();
    for (size_t i = 0; i < 70000; i++)
        payload[i] = (char)(i * 13 + 1);
    for (size_t i = 0; i < N; i++)
        cg_net_batch_add(&b, payload, lens[i], (int)(i & 1));
    const unsigned char *p = (const unsigned char *)b.buf, *end = p + b.len;
    for (size_t i = 0; i < N; i++) {
        CHECK(end - p >= 2);
        CHECK(p[0] == ((i & 1) ? 0x82 : 0x81));
        CHECK(!(p[1] & 0x80)); /* a server's frames are not masked */
        size_t n = p[1] & 0x7f, at = 2;
        if (n == 126) {
            n = (size_t)p[2] << 8 | p[3];
            at = 4;
        } else if (n == 127) {
            n = 0;
            for (int k = 0; k < 8; k++)
                n = n << 8 | p[2 + k];
            at = 10;
        }
        CHECK(n == lens[i]);
        CHECK((size_t)(end - p) >= at + n && memcmp(p + at, payload, n) == 0);
        p += at + n;
    }
    CHECK(p == end);
    cg_net_batch_free(&b);
    free(payload);
}

int main(void)
{
    batch_reads_back();
    static const size_t lens[] = {0, 1, 3, 4, 5, 7, 8, 9, 15, 16, 17, 125, 126, 127, 1000, 65535, 65536, 70001};
    for (size_t i = 0; i < sizeof(lens) / sizeof(lens[0]); i++) {
        frame_and_check(lens[i], 0);
        frame_and_check(lens[i], 1);
    }
    for (size_t len = 0; len < 40; len++) /* every tail length of the 8-byte loop */
        frame_and_check(len, len & 1);

    /* keys: 3,000 draws (three pools' worth) hold no repeat of a neighbour, and most differ */
    enum { N = 3000 };
    static uint32_t keys[N];
    int repeats = 0;
    for (int i = 0; i < N; i++) {
        keys[i] = frame_and_check(10, 0);
        repeats += i > 0 && keys[i] == keys[i - 1];
    }
    CHECK(repeats == 0);
    int distinct = 0;
    for (int i = 0; i < N; i++) {
        int seen = 0;
        for (int j = 0; j < i && !seen; j++)
            seen = keys[j] == keys[i];
        distinct += !seen;
    }
    CHECK(distinct > N - 5);

    /* a child does not draw its parent's next keys */
    int fds[2];
    CHECK(pipe(fds) == 0);
    pid_t pid = fork();
    if (pid == 0) {
        uint32_t k = frame_and_check(10, 0);
        ssize_t w = write(fds[1], &k, sizeof(k));
        _exit(w == sizeof(k) ? 0 : 1);
    }
    uint32_t parent = frame_and_check(10, 0), child = 0;
    CHECK(read(fds[0], &child, sizeof(child)) == sizeof(child));
    int status = 0;
    CHECK(waitpid(pid, &status, 0) == pid && WIFEXITED(status) && WEXITSTATUS(status) == 0);
    CHECK(parent != child);
    close(fds[0]);
    close(fds[1]);
    return unit_done("unit_netframe");
}
