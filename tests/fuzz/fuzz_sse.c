/*
 * fuzz_sse.c: libFuzzer target for the server-sent events parser (sse.c): any bytes, as an
 * upstream could send them, must give the same events and the same end however they are
 * split (sse.h promises it), never crash, leak or read outside the input. The input is fed
 * whole, then in pieces whose sizes come from its first byte; the bound is small so that
 * the over-long line and event paths are reached.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "chatgate/core/sse.h"

#define MAX_EVENT 512

typedef struct record {
    char *log; /* every event as "name\0len\0data" appended */
    size_t len, cap;
    int events, stop_after; /* stop_after events the callback asks to stop (0: never) */
} record;

static void put(record *r, const void *s, size_t n)
{
    if (r->len + n > r->cap) {
        r->cap = (r->len + n) * 2;
        r->log = realloc(r->log, r->cap);
        if (!r->log)
            abort();
    }
    memcpy(r->log + r->len, s, n);
    r->len += n;
}

static int on_event(void *ctx, const char *event, const char *data, size_t len)
{
    record *r = ctx;
    if (len > MAX_EVENT || data[len] != 0 || strlen(event) >= 64)
        __builtin_trap();
    put(r, event, strlen(event) + 1);
    put(r, &len, sizeof(len));
    put(r, data, len);
    r->events++;
    return r->stop_after && r->events >= r->stop_after;
}

/* Feeds data in pieces of `step` bytes (0: whole); the first non-zero result ends it. */
static int run(const uint8_t *data, size_t size, size_t step, record *r)
{
    cg_sse p;
    cg_sse_init(&p, MAX_EVENT, on_event, r);
    int rc = 0;
    for (size_t off = 0; off < size && rc == 0;) {
        size_t n = step && size - off > step ? step : size - off;
        rc = cg_sse_feed(&p, (const char *)data + off, n);
        off += n;
    }
    cg_sse_free(&p);
    return rc;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 1)
        return 0;
    size_t step = (data[0] & 0x0f) + 1;
    int stop_after = data[0] >> 4;
    data++;
    size--;
    record whole = {.stop_after = stop_after}, split = {.stop_after = stop_after};
    int rc_whole = run(data, size, 0, &whole);
    int rc_split = run(data, size, step, &split);
    if (rc_whole != rc_split || whole.len != split.len || (whole.len && memcmp(whole.log, split.log, whole.len) != 0))
        __builtin_trap(); /* a split changed what came out */
    free(whole.log);
    free(split.log);
    return 0;
}
