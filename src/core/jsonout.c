/*
 * jsonout.c: compact JSON dumped into a buffer with headroom (see jsonout.h).
 */
#include "chatgate/core/jsonout.h"

#include <stdlib.h>

#include "chatgate/core/buf.h"

typedef struct {
    char *buf;
    size_t used, cap; /* used counts the headroom */
} out_buf;

static int append(const char *text, size_t size, void *data)
{
    out_buf *o = data;
    cg_buf_append(&o->buf, &o->used, &o->cap, text, size, 64);
    return 0;
}

char *cg_json_dump_pre(json_t *j, size_t pre, size_t hint, size_t *len)
{
    out_buf o = {.used = pre, .cap = pre + (hint < 64 ? 64 : hint) + 1};
    o.buf = malloc(o.cap);
    if (!o.buf)
        abort();
    if (!j || json_dump_callback(j, append, &o, JSON_COMPACT) < 0) {
        free(o.buf);
        return NULL;
    }
    o.buf[o.used] = 0;
    *len = o.used - pre;
    return o.buf;
}
