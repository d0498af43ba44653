/*
 * test_wsrx.c: putting a WebSocket message together from lws's fragments (wsrx.h). A
 * message in one piece is handed back where it is, with no buffer kept; one in pieces is
 * joined, whatever the sizes of the pieces, and its buffer goes with cg_wsrx_done(); a
 * message over the bound, in one piece or several, is reported (msg NULL) once, at its end,
 * and the next message is read normally.
 */
#include <stdlib.h>
#include <string.h>

#include "chatgate/core/wsrx.h"
#include "unit.h"

static void test_whole(void)
{
    cg_wsrx rx = {0};
    const char *msg = NULL;
    size_t len = 0;
    const char text[] = "{\"type\":\"message\"}";
    CHECK(cg_wsrx_feed(&rx, 1, 1, text, sizeof(text) - 1, 100, &msg, &len) == 1);
    CHECK(msg == text); /* not copied */
    CHECK(len == sizeof(text) - 1);
    CHECK(rx.buf == NULL);
    cg_wsrx_done(&rx);
}

static void test_pieces(void)
{
    /* 20,000 bytes in pieces of every size from 1 to 7, as one message */
    size_t total = 20000;
    char *text = malloc(total);
    for (size_t i = 0; i < total; i++)
        text[i] = (char)('a' + i % 26);
    cg_wsrx rx = {0};
    const char *msg = NULL;
    size_t len = 0, off = 0, piece = 1;
    int whole = 0, early = 0;
    while (off < total) {
        size_t n = off + piece > total ? total - off : piece;
        int r = cg_wsrx_feed(&rx, off == 0, off + n == total, text + off, n, total, &msg, &len);
        if (off + n < total)
            early += r;
        else
            whole = r;
        off += n;
        piece = piece % 7 + 1;
    }
    CHECK(early == 0);
    CHECK(whole == 1);
    CHECK(msg && len == total && memcmp(msg, text, total) == 0);
    cg_wsrx_done(&rx);
    CHECK(rx.buf == NULL && rx.cap == 0);
    free(text);
}

static void test_too_large(void)
{
    cg_wsrx rx = {0};
    const char *msg = "x";
    size_t len = 1;
    /* in one piece */
    CHECK(cg_wsrx_feed(&rx, 1, 1, "0123456789", 10, 9, &msg, &len) == 1);
    CHECK(msg == NULL && len == 0);
    cg_wsrx_done(&rx);
    /* in pieces: nothing reported until the end, nothing kept past the bound */
    CHECK(cg_wsrx_feed(&rx, 1, 0, "01234", 5, 9, &msg, &len) == 0);
    CHECK(cg_wsrx_feed(&rx, 0, 0, "56789", 5, 9, &msg, &len) == 0);
    CHECK(rx.len <= 9);
    CHECK(cg_wsrx_feed(&rx, 0, 1, "ab", 2, 9, &msg, &len) == 1);
    CHECK(msg == NULL);
    cg_wsrx_done(&rx);
    /* the next message is fine */
    CHECK(cg_wsrx_feed(&rx, 1, 0, "ab", 2, 9, &msg, &len) == 0);
    CHECK(cg_wsrx_feed(&rx, 0, 1, "cd", 2, 9, &msg, &len) == 1);
    CHECK(msg && len == 4 && memcmp(msg, "abcd", 4) == 0);
    cg_wsrx_done(&rx);
    /* exactly the bound is allowed */
    CHECK(cg_wsrx_feed(&rx, 1, 0, "01234", 5, 9, &msg, &len) == 0);
    CHECK(cg_wsrx_feed(&rx, 0, 1, "5678", 4, 9, &msg, &len) == 1);
    CHECK(msg && len == 9);
    cg_wsrx_done(&rx);
}

int main(void)
{
    test_whole();
    test_pieces();
    test_too_large();
    return unit_done("test_wsrx");
}
