/*
 * wsrx.c: reassembly of one WebSocket message within a bound (see wsrx.h).
 */
#include "chatgate/core/wsrx.h"

#include <stdlib.h>
#include <string.h>

/* Appends len bytes, growing by doubling; aborts when out of memory, as the rest of the
 * gateway does for buffers it cannot work without. */
static void append(cg_wsrx *rx, const char *in, size_t len)
{
    if (rx->len + len + 1 > rx->cap) {
        size_t cap = rx->cap ? rx->cap : 4096;
        while (cap < rx->len + len + 1)
            cap *= 2;
        char *n = realloc(rx->buf, cap);
        if (!n)
            abort();
        rx->buf = n;
        rx->cap = cap;
    }
    memcpy(rx->buf + rx->len, in, len);
    rx->len += len;
    rx->buf[rx->len] = 0;
}

int cg_wsrx_feed(cg_wsrx *rx, int first, int final, const char *in, size_t len, size_t max, const char **msg,
                 size_t *msg_len)
{
    if (first) {
        rx->len = 0;
        rx->too_large = 0;
    }
    if (first && final) { /* whole: no copy */
        rx->too_large = len > max;
        *msg = rx->too_large ? NULL : in;
        *msg_len = rx->too_large ? 0 : len;
        return 1;
    }
    if (!rx->too_large) {
        if (rx->len + len > max)
            rx->too_large = 1;
        else
            append(rx, in, len);
    }
    if (!final)
        return 0;
    *msg = rx->too_large ? NULL : rx->buf ? rx->buf : "";
    *msg_len = rx->too_large ? 0 : rx->len;
    return 1;
}

void cg_wsrx_done(cg_wsrx *rx)
{
    free(rx->buf);
    rx->buf = NULL;
    rx->len = rx->cap = 0;
    rx->too_large = 0;
}
