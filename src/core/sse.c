/*
 * sse.c: server-sent events, parsed a byte at a time so that any split of the stream gives
 * the same events and the same end (the unit test feeds a recorded stream split at every
 * offset; fuzz_sse compares a whole feed with a split one). A line is bounded by max_event
 * whether it arrived in one piece or several.
 */
#include <stdlib.h>
#include <string.h>

#include "chatgate/core/alloc.h"
#include "chatgate/core/sse.h"
#include "chatgate/core/swar.h"

void cg_sse_init(cg_sse *p, size_t max_event, cg_sse_event_fn on_event, void *ctx)
{
    memset(p, 0, sizeof(*p));
    p->max_event = max_event;
    p->on_event = on_event;
    p->ctx = ctx;
}

void cg_sse_free(cg_sse *p)
{
    free(p->line);
    free(p->data);
    p->line = p->data = NULL;
}

/* Appends n bytes to a growing buffer bounded by max; 0 or -1. */
static int append(char **buf, size_t *len, size_t *cap, const char *s, size_t n, size_t max)
{
    if (*len + n + 1 > max)
        return -1;
    if (*len + n + 1 > *cap) {
        size_t ncap = *cap ? *cap : 256;
        while (ncap < *len + n + 1)
            ncap *= 2;
        if (ncap > max)
            ncap = max;
        char *nb = cg_realloc(*buf, ncap);
        *buf = nb;
        *cap = ncap;
    }
    memcpy(*buf + *len, s, n);
    *len += n;
    (*buf)[*len] = 0;
    return 0;
}

static int dispatch(cg_sse *p)
{
    int rc = 0;
    if (p->has_data) {
        static const char empty[1] = "";
        rc = p->on_event(p->ctx, p->event[0] ? p->event : "message", p->data ? p->data : empty,
                         p->data_len) ? 1 : 0;
    }
    p->data_len = 0;
    if (p->data)
        p->data[0] = 0;
    p->has_data = 0;
    p->event[0] = 0;
    return rc;
}

/* Handles one complete line (without its end). */
static int process_line(cg_sse *p, const char *line, size_t len)
{
    if (len == 0)
        return dispatch(p);
    if (line[0] == ':')
        return 0; /* comment */
    const char *colon = memchr(line, ':', len);
    size_t name_len = colon ? (size_t)(colon - line) : len;
    const char *value = colon ? colon + 1 : line + len;
    size_t value_len = len - (size_t)(value - line);
    if (value_len > 0 && *value == ' ') {
        value++;
        value_len--;
    }
    if (name_len == 4 && memcmp(line, "data", 4) == 0) {
        if (p->has_data && append(&p->data, &p->data_len, &p->data_cap, "\n", 1, p->max_event) < 0)
            return -1;
        if (append(&p->data, &p->data_len, &p->data_cap, value, value_len, p->max_event) < 0)
            return -1;
        p->has_data = 1;
    } else if (name_len == 5 && memcmp(line, "event", 5) == 0) {
        size_t n = value_len < sizeof(p->event) - 1 ? value_len : sizeof(p->event) - 1;
        memcpy(p->event, value, n);
        p->event[n] = 0;
    }
    return 0; /* id, retry and unknown fields mean nothing to a chat completion */
}

int cg_sse_feed(cg_sse *p, const char *buf, size_t len)
{
    size_t start = 0;
    const unsigned char *u = (const unsigned char *)buf;
    for (size_t i = 0; i < len; i++) {
        /* eight bytes at once while no line ends among them: a streamed reply is mostly the
         * text of its "data:" lines (a byte at a time was an eighth of a delta's instructions) */
        if (i + 8 <= len) {
            uint64_t w = cg_swar_load(u + i);
            if (!cg_swar_has(w, '\n') && !cg_swar_has(w, '\r')) {
                p->after_cr = 0;
                i += 7;
                continue;
            }
        }
        char c = buf[i];
        if (c != '\n' && c != '\r') {
            p->after_cr = 0;
            continue;
        }
        if (c == '\n' && p->after_cr && i == start) {
            /* the LF of a CRLF whose CR ended the previous line */
            p->after_cr = 0;
            start = i + 1;
            continue;
        }
        p->after_cr = (c == '\r');
        int rc;
        if (p->line_len > 0) {
            if (append(&p->line, &p->line_len, &p->line_cap, buf + start, i - start, p->max_event) < 0)
                return -1;
            rc = process_line(p, p->line, p->line_len);
            p->line_len = 0;
        } else {
            if (i - start + 1 > p->max_event) /* the bound the line buffer has, whole or split */
                return -1;
            rc = process_line(p, buf + start, i - start);
        }
        start = i + 1;
        if (rc != 0)
            return rc;
    }
    if (start < len &&
        append(&p->line, &p->line_len, &p->line_cap, buf + start, len - start, p->max_event) < 0)
        return -1;
    return 0;
}
