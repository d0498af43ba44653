#ifndef CHATGATE_CORE_FLUSH_H
#define CHATGATE_CORE_FLUSH_H
/*
 * flush.h: connection output written once per turn of the event loop.
 *
 * A frame queued for a WebSocket used to wait for that connection's writable callback, and
 * lws, on libuv, turns each lws_callback_on_writable() into a poll change: uv_poll_start()
 * removes and re-adds the descriptor (two epoll_ctl calls to arm POLLOUT, two more to drop
 * it), about four system calls for every frame sent (docs/architecture.md, "Writing"). A
 * socket with room needs none of that. So a connection with output pending registers here,
 * and one uv_check handle, which runs once per loop iteration after the I/O callbacks, calls
 * each registered connection's flush function: it writes what it has while the socket takes
 * it (lws_partial_buffered() false), and asks for a writable callback only when the kernel's
 * buffer is full. Frames produced together (the deltas and the done read from one upstream
 * packet) go out together, and a delta still pending when more text comes grows instead of
 * adding a frame.
 *
 * Items are intrusive (the connection's own struct holds one), so registering allocates
 * nothing; an item must be cancelled before its owner is freed. One flusher per loop, on
 * the loop's thread only.
 */
#include <stdint.h>
#include <uv.h>

typedef struct cg_flush_item {
    struct cg_flush_item *next;
    struct cg_flush_item **pprev; /* NULL while not registered */
    void (*flush)(struct cg_flush_item *item);
    uint64_t due; /* cg_flush_later: the loop time (ms) it is due at */
} cg_flush_item;

typedef struct cg_flusher {
    uv_check_t check;
    uv_idle_t idle; /* keeps the poll from blocking while items wait (flush.c) */
    uv_timer_t timer; /* for the items of cg_flush_later */
    cg_flush_item *head;
    cg_flush_item *first; /* flushed before head's: commands to a store, before the frames
                           * that report their outcome (cg_flush_request_first) */
    cg_flush_item *later; /* cg_flush_later's, in no order */
    int closed;
} cg_flusher;

void cg_flusher_init(cg_flusher *f, uv_loop_t *loop);
/* Closes the handle (the loop must still run for it): what is registered first
 * (cg_flush_request_first) is flushed now, the rest dropped. */
void cg_flusher_close(cg_flusher *f);

/* Registers item (its flush runs at the end of this loop iteration); a no-op if it already is. */
void cg_flush_request(cg_flusher *f, cg_flush_item *item, void (*flush)(cg_flush_item *item));
/* The same, for output that must leave before any registered with cg_flush_request in
 * the same iteration: a Redis command goes out before the client frame that reports it
 * was sent (docs/protocol.md: context answers go out as the store write is sent).
 * Returns -1, registering nothing, once the flusher is closed: the caller writes another
 * way. */
int cg_flush_request_first(cg_flusher *f, cg_flush_item *item, void (*flush)(cg_flush_item *item));
/* Calls item's flush (from a timer, not at the end of an iteration) once ms milliseconds
 * of loop time have passed, unless it is cancelled before: for output that may wait a
 * little for company (session.c's ack). A no-op if item is registered already. */
void cg_flush_later(cg_flusher *f, cg_flush_item *item, void (*flush)(cg_flush_item *item), unsigned ms);
/* Unregisters item if it is registered (by any of the three). */
void cg_flush_cancel(cg_flush_item *item);

#endif
