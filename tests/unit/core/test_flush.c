/*
 * test_flush.c: the once-per-iteration flusher (core/flush.h) on a real libuv loop: items
 * registered "first" are flushed before the others of the same iteration (a Redis command
 * before the frame that reports it), an item registered during the flush runs in the next
 * iteration without the loop blocking in its poll (the idle handle), an item registered to
 * be flushed later (cg_flush_later) runs once its time has passed and not when cancelled,
 * and closing flushes what was registered first and refuses later requests. At an event's
 * end (cg_flush_event_end), the answers run, then what they and the event registered for
 * the event (an item registered for the iteration moves over), in rounds, and nothing of
 * the iteration's; the connection served is known to the flushes; what is left runs at the
 * iteration's end, answers first. An event's end leaves for the iteration's end an item of
 * the served connection, and one that is to follow a first item still waiting.
 */
#include <string.h>
#include <uv.h>

#include "chatgate/core/flush.h"
#include "unit.h"

typedef struct {
    cg_flush_item item;
    char name;
    int again; /* registers itself again this many times */
} probe;

static char order[16];
static size_t n_order;
static cg_flusher flusher;
static int guard_fired;

static void flush_probe(cg_flush_item *item)
{
    probe *p = (probe *)item; /* item is the first member */
    if (n_order < sizeof(order) - 1)
        order[n_order++] = p->name;
    if (p->again > 0) {
        p->again--;
        cg_flush_request(&flusher, &p->item, flush_probe);
    }
}

static const void *served; /* cg_flush_serving() as the last probe saw it */
static probe *made_by_answer; /* registered for the event by answer_probe */

static void event_probe(cg_flush_item *item)
{
    served = cg_flush_serving(&flusher);
    flush_probe(item);
}

static void answer_probe(cg_flush_item *item)
{
    flush_probe(item);
    if (made_by_answer)
        cg_flush_request_event(&flusher, &made_by_answer->item, event_probe, NULL, 0);
}

static void on_guard(uv_timer_t *t)
{
    guard_fired = 1;
    uv_stop(t->loop);
}

int main(void)
{
    uv_loop_t loop;
    uv_loop_init(&loop);
    cg_flusher_init(&flusher, &loop);
    uv_timer_t guard; /* fires only if the loop blocked in its poll with an item waiting */
    uv_timer_init(&loop, &guard);
    uv_timer_start(&guard, on_guard, 5000, 0);
    uv_unref((uv_handle_t *)&guard);

    probe a = {.name = 'a'}, b = {.name = 'b'}, c = {.name = 'c', .again = 2};
    cg_flush_request(&flusher, &a.item, flush_probe);
    CHECK(cg_flush_request_first(&flusher, &b.item, flush_probe) == 0);
    cg_flush_request(&flusher, &c.item, flush_probe);
    cg_flush_request(&flusher, &a.item, flush_probe); /* already registered: once */
    uv_run(&loop, UV_RUN_ONCE);
    order[n_order] = 0;
    CHECK(order[0] == 'b');          /* first before the rest */
    CHECK(n_order == 3);             /* a and c once each */
    uv_run(&loop, UV_RUN_ONCE);      /* c registered itself again: runs without blocking */
    uv_run(&loop, UV_RUN_ONCE);
    order[n_order] = 0;
    CHECK(n_order == 5);
    CHECK(order[3] == 'c' && order[4] == 'c');
    CHECK(!guard_fired);

    /* later: due after its time (not before, not at the end of the iteration), a cancelled
     * one never; two at once, the sooner first */
    n_order = 0;
    probe d = {.name = 'd'}, e = {.name = 'e'}, g = {.name = 'g'};
    uv_update_time(&loop);
    uint64_t t0 = uv_now(&loop);
    cg_flush_later(&flusher, &e.item, flush_probe, 60);
    cg_flush_later(&flusher, &d.item, flush_probe, 30);
    cg_flush_later(&flusher, &g.item, flush_probe, 10);
    cg_flush_later(&flusher, &d.item, flush_probe, 1); /* already registered: kept as it was */
    cg_flush_cancel(&g.item);
    uv_run(&loop, UV_RUN_NOWAIT);
    CHECK(n_order == 0);
    while (n_order < 1 && !guard_fired)
        uv_run(&loop, UV_RUN_ONCE);
    CHECK(n_order == 1 && order[0] == 'd' && uv_now(&loop) - t0 >= 30);
    while (n_order < 2 && !guard_fired)
        uv_run(&loop, UV_RUN_ONCE);
    CHECK(n_order == 2 && order[1] == 'e' && uv_now(&loop) - t0 >= 60);
    CHECK(!guard_fired);

    /* an event's end: answers, then the event's items (one an answer made, one moved from the
     * iteration's list), not the iteration's; the served connection is known meanwhile */
    n_order = 0;
    int conn = 0;
    probe h = {.name = 'h'}, i = {.name = 'i'}, j = {.name = 'j'}, k = {.name = 'k'}, m = {.name = 'm'};
    made_by_answer = &j;
    cg_flush_request(&flusher, &h.item, flush_probe);            /* the iteration's */
    cg_flush_request(&flusher, &k.item, flush_probe);
    cg_flush_request_event(&flusher, &k.item, event_probe, NULL, 0); /* moved to the event's */
    CHECK(cg_flush_request_answer(&flusher, &i.item, answer_probe) == 0);
    cg_flush_event_end(&flusher, &conn);
    order[n_order] = 0;
    CHECK(strcmp(order, "ikj") == 0 || strcmp(order, "ijk") == 0); /* i first; h waits */
    CHECK(served == &conn && cg_flush_serving(&flusher) == NULL);
    made_by_answer = NULL;
    /* with no event end, the iteration's end runs them all, answers first */
    CHECK(cg_flush_request_answer(&flusher, &m.item, answer_probe) == 0);
    cg_flush_request_event(&flusher, &i.item, event_probe, NULL, 0);
    uv_run(&loop, UV_RUN_ONCE);
    order[n_order] = 0;
    CHECK(n_order == 6 && order[3] == 'm' && strchr(order + 4, 'h') && strchr(order + 4, 'i'));
    CHECK(served == NULL); /* no event was being ended */
    CHECK(!guard_fired);

    /* what waits at an event's end: the served connection's own item, and one registered
     * after_first while a first item waits; both run at the iteration's end, after it */
    n_order = 0;
    probe own = {.name = 'o'}, after = {.name = 'a'}, other = {.name = 'x'}, store = {.name = 's'};
    cg_flush_request_event(&flusher, &own.item, event_probe, &conn, 0);
    cg_flush_request_event(&flusher, &after.item, event_probe, NULL, 1);
    cg_flush_request_event(&flusher, &other.item, event_probe, NULL, 0);
    CHECK(cg_flush_request_first(&flusher, &store.item, flush_probe) == 0);
    cg_flush_event_end(&flusher, &conn);
    order[n_order] = 0;
    CHECK(strcmp(order, "x") == 0);
    uv_run(&loop, UV_RUN_ONCE);
    order[n_order] = 0;
    CHECK(n_order == 4 && order[1] == 's' && strchr(order + 2, 'o') && strchr(order + 2, 'a'));
    CHECK(!guard_fired);

    /* close: what is registered first is flushed, the rest dropped, later requests refused */
    n_order = 0;
    cg_flush_request(&flusher, &a.item, flush_probe);
    cg_flush_request_first(&flusher, &b.item, flush_probe);
    cg_flusher_close(&flusher);
    CHECK(n_order == 1 && order[0] == 'b');
    CHECK(cg_flush_request_first(&flusher, &b.item, flush_probe) == -1);
    uv_close((uv_handle_t *)&guard, NULL);
    uv_run(&loop, UV_RUN_DEFAULT);
    CHECK(uv_loop_close(&loop) == 0);
    return unit_done("flush");
}
