/*
 * flush.c: the once-per-iteration output flush (see flush.h for why).
 *
 * The check handle is started only while something is registered, so an idle gateway's loop
 * does no work for it and the handle never keeps the loop alive on its own. A flush function
 * may register its item again (more output came while it ran) or register others: the list
 * is taken whole before the calls, and anything registered during them waits for the next
 * iteration, which the still-running handle guarantees.
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

static void on_check(uv_check_t *h)
{
    cg_flusher *f = h->data;
    cg_flush_item *batch = f->head;
    f->head = NULL;
    if (batch)
        batch->pprev = &batch;
    while (batch) {
        cg_flush_item *it = batch;
        unlink_item(it); /* before the call: the flush may register it again */
        it->flush(it);
    }
    if (!f->head && f->started) {
        uv_check_stop(&f->check);
        f->started = 0;
    }
}

void cg_flusher_init(cg_flusher *f, uv_loop_t *loop)
{
    f->head = NULL;
    f->started = 0;
    uv_check_init(loop, &f->check);
    f->check.data = f;
}

void cg_flusher_close(cg_flusher *f)
{
    while (f->head)
        unlink_item(f->head);
    f->started = 0;
    uv_close((uv_handle_t *)&f->check, NULL);
}

void cg_flush_request(cg_flusher *f, cg_flush_item *item, void (*flush)(cg_flush_item *item))
{
    if (item->pprev)
        return;
    item->flush = flush;
    item->next = f->head;
    if (f->head)
        f->head->pprev = &item->next;
    f->head = item;
    item->pprev = &f->head;
    if (!f->started) {
        uv_check_start(&f->check, on_check);
        f->started = 1;
    }
}

void cg_flush_cancel(cg_flush_item *item)
{
    if (item->pprev)
        unlink_item(item);
}
