/*
 * flush.c: output written once per loop iteration, or at the end of the event that made it
 * (see flush.h for why).
 *
 * The check handle is started only while something is registered, so an idle gateway's loop
 * does no work for it and the handle never keeps the loop alive on its own. A flush function
 * may register its item again (more output came while it ran) or register others: the list
 * is taken whole before the calls, and anything registered during them waits for the next
 * iteration. A check handle does not stop the loop from blocking in its poll, so while
 * anything is registered an idle handle (which does) runs too: an item registered during
 * the calls, or from another check handle after this one ran, would otherwise wait for some
 * unrelated event. The check stops it in the iteration that started it, so in the common
 * case it never runs.
 */
#include "chatgate/core/flush.h"

#include <stddef.h>

static void unlink_item(cg_flush_item *it)
{
    *it->pprev = it->next;
    if (it->next)
        it->next->pprev = it->pprev;
    it->next = NULL;
    it->pprev = NULL;
}

/* Calls the item's flush; at an event's end, an item that waits for the iteration's end
 * (cg_flush_request_event) is registered for it instead. */
static void call(cg_flusher *f, cg_flush_item *it)
{
    if (f->serving && (it->owner == f->serving || (it->after_first && f->first)))
        cg_flush_request(f, it, it->flush);
    else
        it->flush(it);
}

/* Calls the flush of each item on *list, as the list was when called; at an event's end,
 * an item that waits goes to the iteration's list instead. */
static void run_list(cg_flusher *f, cg_flush_item **list)
{
    cg_flush_item *batch = *list;
    *list = NULL;
    if (batch)
        batch->pprev = &batch;
    while (batch) {
        cg_flush_item *it = batch;
        unlink_item(it); /* before the call: the flush may register it again */
        call(f, it);
    }
}

static void on_check(uv_check_t *h)
{
    cg_flusher *f = h->data;
    run_list(f, &f->answers);
    run_list(f, &f->first);
    run_list(f, &f->event);
    run_list(f, &f->head);
    if (!f->head && !f->first && !f->event && !f->answers) {
        uv_check_stop(&f->check);
        uv_idle_stop(&f->idle);
    }
}

static void on_idle(uv_idle_t *h)
{
    (void)h;
}

/* The items of cg_flush_later that are due, called; the timer again for the rest. */
static void on_timer(uv_timer_t *h)
{
    cg_flusher *f = h->data;
    uint64_t now = uv_now(h->loop), next = 0;
    cg_flush_item *due = NULL;
    for (cg_flush_item *it = f->later, *following; it; it = following) {
        following = it->next;
        if (it->due > now)
            continue;
        unlink_item(it); /* onto a list of their own, so a flush may register anything */
        it->next = due;
        if (due)
            due->pprev = &it->next;
        due = it;
        it->pprev = &due;
    }
    run_list(f, &due);
    /* the soonest of the rest, those the flushes added (which may have started the timer)
     * included */
    for (cg_flush_item *it = f->later; it; it = it->next)
        if (!next || it->due < next)
            next = it->due;
    if (next && (!uv_is_active((uv_handle_t *)&f->timer) || uv_timer_get_due_in(&f->timer) > next - now))
        uv_timer_start(&f->timer, on_timer, next - now, 0);
}

void cg_flusher_init(cg_flusher *f, uv_loop_t *loop)
{
    f->head = NULL;
    f->first = NULL;
    f->closed = 0;
    uv_check_init(loop, &f->check);
    f->check.data = f;
    uv_idle_init(loop, &f->idle);
    f->later = NULL;
    f->event = NULL;
    f->answers = NULL;
    f->serving = NULL;
    uv_timer_init(loop, &f->timer);
    f->timer.data = f;
}

void cg_flusher_close(cg_flusher *f)
{
    f->closed = 1; /* before the flushes: what they register again is written another way */
    run_list(f, &f->first);
    while (f->head)
        unlink_item(f->head);
    while (f->event)
        unlink_item(f->event);
    while (f->answers) /* dropped too: a store asked again answers from its own timer */
        unlink_item(f->answers);
    while (f->later)
        unlink_item(f->later);
    uv_close((uv_handle_t *)&f->timer, NULL);
    uv_close((uv_handle_t *)&f->check, NULL);
    uv_close((uv_handle_t *)&f->idle, NULL);
}

static int request(cg_flusher *f, cg_flush_item **list, cg_flush_item *item, void (*flush)(cg_flush_item *item))
{
    if (f->closed)
        return -1;
    if (item->pprev)
        return 0;
    item->flush = flush;
    item->next = *list;
    if (*list)
        (*list)->pprev = &item->next;
    *list = item;
    item->pprev = list;
    uv_check_start(&f->check, on_check); /* both no-ops when already started */
    uv_idle_start(&f->idle, on_idle);
    return 0;
}

void cg_flush_request(cg_flusher *f, cg_flush_item *item, void (*flush)(cg_flush_item *item))
{
    (void)request(f, &f->head, item, flush);
}

int cg_flush_request_first(cg_flusher *f, cg_flush_item *item, void (*flush)(cg_flush_item *item))
{
    return request(f, &f->first, item, flush);
}

void cg_flush_later(cg_flusher *f, cg_flush_item *item, void (*flush)(cg_flush_item *item), unsigned ms)
{
    if (f->closed || item->pprev)
        return;
    item->flush = flush;
    item->due = uv_now(f->timer.loop) + ms;
    item->next = f->later;
    if (f->later)
        f->later->pprev = &item->next;
    f->later = item;
    item->pprev = &f->later;
    if (!uv_is_active((uv_handle_t *)&f->timer) || uv_timer_get_due_in(&f->timer) > ms)
        uv_timer_start(&f->timer, on_timer, ms, 0); /* the soonest's time */
}

void cg_flush_request_event(cg_flusher *f, cg_flush_item *item, void (*flush)(cg_flush_item *item),
                            const void *owner, int after_first)
{
    cg_flush_cancel(item); /* from whichever list it was on */
    item->owner = owner;
    item->after_first = after_first;
    (void)request(f, &f->event, item, flush);
}

int cg_flush_request_answer(cg_flusher *f, cg_flush_item *item, void (*flush)(cg_flush_item *item))
{
    return request(f, &f->answers, item, flush);
}

void cg_flush_event_end(cg_flusher *f, const void *serving)
{
    /* a few rounds: an answer makes an app frame, the app frame goes; what is made after
     * that waits for the iteration's end */
    f->serving = serving;
    for (int round = 0; round < 4 && (f->answers || f->event); round++) {
        run_list(f, &f->answers);
        run_list(f, &f->event);
    }
    f->serving = NULL;
}

void cg_flush_cancel(cg_flush_item *item)
{
    if (item->pprev)
        unlink_item(item);
}
