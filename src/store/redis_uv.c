/*
 * redis_uv.c: hiredis's async connections on the gateway's libuv loop, with commands
 * written once per loop iteration.
 *
 * hiredis's own libuv adapter (hiredis/adapters/libuv.h) asks for POLLOUT on every command:
 * uv_poll_start() with UV_WRITABLE, which libuv turns into an epoll_ctl() at the next poll,
 * the write when that poll reports the socket writable (an iteration later), and another
 * epoll_ctl() to drop POLLOUT. A turn's load and save paid that twice, and every command
 * waited an iteration before it left. A connected socket almost always has room, so here a
 * command registers with the gateway's flusher (core/flush.h), at the end of the iteration
 * that queued it, ahead of the client frames of that iteration (a context answer says its
 * write was sent), and everything queued meanwhile goes with one write()
 * (redisAsyncHandleWrite). Only when the kernel does not take it all (hiredis asks for a
 * write again from inside that call), while the connection is still being made, or with no
 * flusher (a store opened outside a gateway), does the adapter poll for POLLOUT, as
 * hiredis's does.
 *
 * One cg_redis_uv per connection, freed once hiredis's cleanup has closed its poll handle.
 */
#include "chatgate/store/redis_internal.h"

#include <stddef.h>

#include "chatgate/core/flush.h"

typedef struct cg_redis_uv {
    redisAsyncContext *ac; /* NULL once hiredis cleaned up */
    uv_poll_t poll;
    cg_flusher *flusher;   /* NULL: poll for POLLOUT, as hiredis's adapter */
    cg_flush_item flush;   /* registered while a write is due at the end of the iteration */
    int events;            /* what the poll waits for */
    int in_write;          /* inside redisAsyncHandleWrite from the flush */
} cg_redis_uv;

static void on_poll(uv_poll_t *h, int status, int events)
{
    cg_redis_uv *u = h->data;
    if (status < 0) /* an error on the socket: let hiredis read or write it and see it */
        events = u->events;
    if (u->ac && (events & UV_READABLE)) {
        cg_flusher *f = u->flusher;
        redisAsyncHandleRead(u->ac); /* may free the context: cleanup clears u->ac */
        if (f) /* the messages whose loads were answered go to their apps now (core/flush.h) */
            cg_flush_event_end(f, u);
    }
    if (u->ac && (events & UV_WRITABLE))
        redisAsyncHandleWrite(u->ac);
}

static void poll_set(cg_redis_uv *u, int events)
{
    if (events == u->events)
        return;
    u->events = events;
    if (events)
        uv_poll_start(&u->poll, events, on_poll);
    else
        uv_poll_stop(&u->poll);
}

static void on_flush(cg_flush_item *item)
{
    cg_redis_uv *u = (cg_redis_uv *)((char *)item - offsetof(cg_redis_uv, flush));
    if (!u->ac)
        return;
    u->in_write = 1;
    redisAsyncHandleWrite(u->ac); /* may free the context: cleanup clears u->ac */
    u->in_write = 0;
}

static void add_read(void *p)
{
    cg_redis_uv *u = p;
    poll_set(u, u->events | UV_READABLE);
}

static void del_read(void *p)
{
    cg_redis_uv *u = p;
    poll_set(u, u->events & ~UV_READABLE);
}

static void add_write(void *p)
{
    cg_redis_uv *u = p;
    if (!u->ac)
        return;
    if (!u->flusher || u->in_write || !(u->ac->c.flags & REDIS_CONNECTED)) { /* kernel full, or connecting */
        poll_set(u, u->events | UV_WRITABLE);
        return;
    }
    if (!(u->events & UV_WRITABLE) && cg_flush_request_first(u->flusher, &u->flush, on_flush) < 0)
        poll_set(u, u->events | UV_WRITABLE); /* the gateway is closing: its flusher is gone */
}

static void del_write(void *p)
{
    cg_redis_uv *u = p;
    cg_flush_cancel(&u->flush);
    poll_set(u, u->events & ~UV_WRITABLE);
}

static void on_closed(uv_handle_t *h)
{
    free(h->data);
}

static void cleanup(void *p)
{
    cg_redis_uv *u = p;
    u->ac = NULL;
    cg_flush_cancel(&u->flush);
    uv_close((uv_handle_t *)&u->poll, on_closed);
}

int cg_redis_uv_attach(redisAsyncContext *ac, uv_loop_t *loop, cg_flusher *flusher)
{
    if (ac->ev.data)
        return -1;
    cg_redis_uv *u = calloc(1, sizeof(*u));
    if (!u)
        return -1;
    if (uv_poll_init(loop, &u->poll, ac->c.fd) != 0) {
        free(u);
        return -1;
    }
    u->poll.data = u;
    u->flusher = flusher;
    u->ac = ac;
    ac->ev.data = u;
    ac->ev.addRead = add_read;
    ac->ev.delRead = del_read;
    ac->ev.addWrite = add_write;
    ac->ev.delWrite = del_write;
    ac->ev.cleanup = cleanup;
    return 0;
}
