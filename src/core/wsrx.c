/*
 * wsrx.c: reassembly of one WebSocket message within a bound (see wsrx.h).
 */
#include "chatgate/core/wsrx.h"

#include <stdlib.h>

#include "chatgate/core/buf.h"

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
            cg_buf_append(&rx->buf, &rx->len, &rx->cap, in, len, 4096);
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
