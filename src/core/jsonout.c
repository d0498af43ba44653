/*
 * jsonout.c: compact JSON dumped into a buffer with headroom (see jsonout.h).
 */
#include "chatgate/core/jsonout.h"

#include <stdlib.h>
#include <string.h>

typedef struct {
    char *buf;
    size_t used, cap; /* used counts the headroom */
} out_buf;

static int append(const char *text, size_t size, void *data)
{
    out_buf *o = data;
    if (o->used + size + 1 > o->cap) {
        size_t cap = o->cap * 2;
        while (cap < o->used + size + 1)
            cap *= 2;
        char *n = realloc(o->buf, cap);
        if (!n)
            abort();
        o->buf = n;
        o->cap = cap;
    }
    memcpy(o->buf + o->used, text, size);
    o->used += size;
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
