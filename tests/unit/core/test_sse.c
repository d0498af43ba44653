/*
 * test_sse.c: the server-sent events parser fed a recorded OpenAI-style stream in every
 * split: whole, byte by byte, and cut in two at every offset. Each must give the same events.
 */
#include <stdlib.h>

#include "chatgate/core/sse.h"
#include "unit.h"

/* A stream as llama.cpp / OpenAI send it, with CRLF, a comment, an event name, a
 * multi-line data field and a lone CR line end mixed in. */
static const char stream[] =
    ": keep-alive\r\n"
    "\r\n"
    "data: {\"choices\":[{\"delta\":{\"content\":\"Hel\"}}]}\r\n"
    "\r\n"
    "data: {\"choices\":[{\"delta\":{\"content\":\"lo \\u00e9\"}}]}\n"
    "\n"
    "event: note\n"
    "data: line one\n"
    "data: line two\n"
    "id: 7\n"
    "\n"
    "data:no-space\r\r"
    "retry: 10\n"
    "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":5}}\n\n"
    "data: [DONE]\n\n";

static const char *const expected[] = {
    "message|{\"choices\":[{\"delta\":{\"content\":\"Hel\"}}]}",
    "message|{\"choices\":[{\"delta\":{\"content\":\"lo \\u00e9\"}}]}",
    "note|line one\nline two",
    "message|no-space",
    "message|{\"choices\":[],\"usage\":{\"prompt_tokens\":5}}",
    "message|[DONE]",
};
#define N_EXPECTED (sizeof(expected) / sizeof(expected[0]))

typedef struct {
    char got[16][256];
    size_t n;
} events;

static int on_event(void *ctx, const char *event, const char *data, size_t len)
{
    events *e = ctx;
    if (e->n < 16)
        snprintf(e->got[e->n], sizeof(e->got[0]), "%s|%.*s", event, (int)len, data);
    e->n++;
    return 0;
}

/* Feeds the stream in pieces cut at the given offsets; returns 1 when the events match. */
static int run_split(const size_t *cuts, size_t n_cuts)
{
    events e = {.n = 0};
    cg_sse p;
    cg_sse_init(&p, 4096, on_event, &e);
    size_t len = sizeof(stream) - 1, pos = 0;
    for (size_t i = 0; i <= n_cuts; i++) {
        size_t end = i < n_cuts ? cuts[i] : len;
        if (cg_sse_feed(&p, stream + pos, end - pos) != 0) {
            cg_sse_free(&p);
            return 0;
        }
        pos = end;
    }
    cg_sse_free(&p);
    if (e.n != N_EXPECTED)
        return 0;
    for (size_t i = 0; i < N_EXPECTED; i++)
        if (strcmp(e.got[i], expected[i]) != 0) {
            fprintf(stderr, "event %zu: got \"%s\", expected \"%s\"\n", i, e.got[i], expected[i]);
            return 0;
        }
    return 1;
}

static void test_splits(void)
{
    size_t len = sizeof(stream) - 1;
    CHECK(run_split(NULL, 0));
    int all_two = 1;
    for (size_t cut = 0; cut <= len; cut++) {
        size_t cuts[1] = {cut};
        if (!run_split(cuts, 1)) {
            fprintf(stderr, "split at offset %zu gives other events\n", cut);
            all_two = 0;
        }
    }
    CHECK(all_two);
    size_t *every = malloc(len * sizeof(size_t));
    for (size_t i = 0; i < len; i++)
        every[i] = i;
    CHECK(run_split(every, len)); /* one byte at a time */
    free(every);
}

static int stop_at_first(void *ctx, const char *event, const char *data, size_t len)
{
    (void)event, (void)data, (void)len;
    ++*(int *)ctx;
    return 1;
}

static void test_limits_and_stop(void)
{
    cg_sse p;
    int seen = 0;
    cg_sse_init(&p, 64, stop_at_first, &seen);
    CHECK(cg_sse_feed(&p, "data: a\n\ndata: b\n\n", 18) == 1);
    CHECK(seen == 1);
    cg_sse_free(&p);

    cg_sse_init(&p, 64, stop_at_first, &seen);
    char big[200];
    memset(big, 'x', sizeof(big));
    CHECK(cg_sse_feed(&p, "data: ", 6) == 0);
    CHECK(cg_sse_feed(&p, big, sizeof(big)) == -1); /* a line over the bound */
    cg_sse_free(&p);

    /* many short data lines that add up past the bound */
    cg_sse_init(&p, 64, stop_at_first, &seen);
    int rc = 0;
    for (int i = 0; i < 40 && rc == 0; i++)
        rc = cg_sse_feed(&p, "data: 0123456789\n", 17);
    CHECK(rc == -1);
    cg_sse_free(&p);

    /* a long comment or event line is over the bound whether it comes whole or split
     * (found by fuzz_sse: whole, it used to pass, split it was refused) */
    char line[100];
    memset(line, 'x', sizeof(line));
    line[0] = ':';
    line[sizeof(line) - 1] = '\n';
    cg_sse_init(&p, 64, stop_at_first, &seen);
    CHECK(cg_sse_feed(&p, line, sizeof(line)) == -1);
    cg_sse_free(&p);
    cg_sse_init(&p, 64, stop_at_first, &seen);
    CHECK(cg_sse_feed(&p, line, 50) == 0);
    CHECK(cg_sse_feed(&p, line + 50, sizeof(line) - 50) == -1);
    cg_sse_free(&p);
}

int main(void)
{
    test_splits();
    test_limits_and_stop();
    return unit_done("test_sse");
}
