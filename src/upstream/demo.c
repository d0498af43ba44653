/*
 * demo.c: the built-in upstream. It answers without any network, streaming word by
 * word (one word every delay_ms) what the gateway understood of the message, so the quick
 * start and the demo page work with no LLM. A uv timer drives each reply.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "chatgate/core/alloc.h"
#include "chatgate/upstream/upstream.h"

struct cg_upstream_call {
    uv_timer_t timer;
    const cg_upstream_events *ev; /* NULL once cancelled or finished */
    void *ctx;
    char *reply;
    size_t pos, len;
    uint64_t delay_ms;
    int paused;
};

static void demo_closed(uv_handle_t *h)
{
    cg_upstream_call *c = h->data;
    free(c->reply);
    free(c);
}

static void demo_end(cg_upstream_call *c)
{
    c->ev = NULL;
    uv_timer_stop(&c->timer);
    uv_close((uv_handle_t *)&c->timer, demo_closed);
}

/* Sends the next word with the spaces that follow it; with delay_ms 0, every word now. */
static void demo_tick(uv_timer_t *t)
{
    cg_upstream_call *c = t->data;
    while (c->ev && !c->paused) {
        size_t start = c->pos;
        size_t end = start;
        while (end < c->len && c->reply[end] != ' ')
            end++;
        while (end < c->len && c->reply[end] == ' ')
            end++;
        c->pos = end;
        const cg_upstream_events *ev = c->ev;
        void *ctx = c->ctx;
        int last = c->pos >= c->len;
        if (last)
            demo_end(c); /* before the callbacks: they may start the next call */
        ev->on_delta(ctx, c->reply + start, end - start);
        if (last) {
            ev->on_done(ctx, NULL, NULL);
            return;
        }
        if (c->delay_ms)
            return;
    }
}

static int demo_start(cg_upstream *up, void **conn_slot, const cg_upstream_message *m,
                      const cg_upstream_events *ev, void *ctx, cg_upstream_call **out)
{
    (void)conn_slot;
    cg_upstream_call *c = cg_calloc(1, sizeof(*c));
    char *params = m->params ? json_dumps(m->params, JSON_COMPACT) : NULL;
    char *resolution = m->resolution ? json_dumps(m->resolution, JSON_COMPACT) : NULL;
    const char *fmt = "This is chatgate's demo upstream '%s'. Route: %s. Room: %s. Service: %s. Params: %s. "
                      "Resolution: %s. Enriched: %s. History: %zu earlier messages. You said: \"%s\".";
#define DEMO_ARGS                                                                                               \
    up->cfg->name, m->route, m->room, m->service ? m->service : "none", params ? params : "{}",                 \
        resolution ? resolution : "none", m->enriched ? m->enriched : "none", json_array_size(m->history), m->text
    int n = snprintf(NULL, 0, fmt, DEMO_ARGS);
    c->reply = cg_malloc((size_t)n + 1);
    snprintf(c->reply, (size_t)n + 1, fmt, DEMO_ARGS);
#undef DEMO_ARGS
    free(params);
    free(resolution);
    c->len = (size_t)n;
    c->ev = ev;
    c->ctx = ctx;
    c->delay_ms = (uint64_t)up->cfg->delay_ms;
    uv_timer_init(up->net->loop, &c->timer);
    c->timer.data = c;
    uv_timer_start(&c->timer, demo_tick, c->delay_ms, c->delay_ms ? c->delay_ms : 1);
    *out = c;
    return 0;
}

static void demo_cancel(cg_upstream_call *c)
{
    demo_end(c);
}

static void demo_pause(cg_upstream_call *c, int paused)
{
    c->paused = paused;
}

const cg_upstream_ops cg_upstream_demo_ops = {
    .kind = "demo",
    .start = demo_start,
    .cancel = demo_cancel,
    .pause = demo_pause,
    .close_conn = NULL,
};
