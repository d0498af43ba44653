/*
 * flush.c: the once-per-iteration output flush (see flush.h for why).
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

/* Calls the flush of each item on *list, as the list was when called. */
static void run_list(cg_flush_item **list)
{
    cg_flush_item *batch = *list;
    *list = NULL;
    if (batch)
        batch->pprev = &batch;
    while (batch) {
        cg_flush_item *it = batch;
        unlink_item(it); /* before the call: the flush may register it again */
        it->flush(it);
    }
}

static void on_check(uv_check_t *h)
{
    cg_flusher *f = h->data;
    run_list(&f->first);
    run_list(&f->head);
    if (!f->head && !f->first) {
        uv_check_stop(&f->check);
        uv_idle_stop(&f->idle);
    }
}

static void on_idle(uv_idle_t *h)
{
    (void)h;
}

void cg_flusher_init(cg_flusher *f, uv_loop_t *loop)
{
    f->head = NULL;
    f->first = NULL;
    f->closed = 0;
    uv_check_init(loop, &f->check);
    f->check.data = f;
    uv_idle_init(loop, &f->idle);
}

void cg_flusher_close(cg_flusher *f)
{
    f->closed = 1; /* before the flushes: what they register again is written another way */
    run_list(&f->first);
    while (f->head)
        unlink_item(f->head);
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

void cg_flush_cancel(cg_flush_item *item)
{
    if (item->pprev)
        unlink_item(item);
}
