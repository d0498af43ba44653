/*
 * sse.h: an incremental parser of server-sent events (the WHATWG event-stream format).
 *
 * Bytes go in as they arrive, split anywhere (mid-line, mid-CRLF, mid-UTF-8); each complete
 * event comes out through the callback with its `data` lines joined by '\n'. Lines may end
 * in LF, CRLF or CR; comment lines (":...") and fields other than data and event are
 * skipped. A line or event over max_event bytes is an error, so a hostile upstream cannot
 * grow the buffer without bound.
 */
#ifndef CHATGATE_SSE_H
#define CHATGATE_SSE_H

#include <stddef.h>

/* Called once per event; data is NUL-terminated. Return non-zero to stop parsing. */
typedef int (*cg_sse_event_fn)(void *ctx, const char *event, const char *data, size_t len);

typedef struct cg_sse {
    char *line; /* the line being read */
    size_t line_len, line_cap;
    char *data; /* data of the event being read */
    size_t data_len, data_cap;
    int has_data;
    char event[64];
    int after_cr; /* the last byte was CR: a following LF belongs to the same line end */
    size_t max_event;
    cg_sse_event_fn on_event;
    void *ctx;
} cg_sse;

void cg_sse_init(cg_sse *p, size_t max_event, cg_sse_event_fn on_event, void *ctx);
/*
 * Feeds len bytes. Returns 0; 1 when the callback asked to stop; -1 when a line or event
 * grew over max_event (the parser is then unusable).
 */
int cg_sse_feed(cg_sse *p, const char *buf, size_t len);
void cg_sse_free(cg_sse *p);

#endif
