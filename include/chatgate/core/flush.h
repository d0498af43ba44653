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
 *
 * Output that completes a step of a turn need not wait for the iteration's end: a message
 * frame for the app, and a client's frames once its reply is done (the ack and deltas go
 * along). Those go out when the event that made them has been handled (cg_flush_request_event):
 * each I/O callback that reads a client's or an app's frame, or Redis's replies, calls
 * cg_flush_event_end when it is done. Written at the iteration's end, the frames read in one
 * iteration left together in a burst: the app, or the client, had nothing to do until the
 * gateway had been through every event of the iteration, and then all of it at once. With
 * everything on two cores, bursts left a core idle a fifth of the time (issue 12: 7 to 10%
 * more turns a second with no rules). Nothing more is written than before: the frames that
 * wait are the ones that could still gain company (deltas, and Redis commands, which go
 * pipelined at the iteration's end).
 */
#include <stdint.h>
#include <uv.h>

typedef struct cg_flush_item {
    struct cg_flush_item *next;
    struct cg_flush_item **pprev; /* NULL while not registered */
    void (*flush)(struct cg_flush_item *item);
    uint64_t due; /* cg_flush_later: the loop time (ms) it is due at */
    const void *owner; /* cg_flush_request_event: the connection it writes to */
    int after_first;   /* cg_flush_request_event: not before what waits with _first */
} cg_flush_item;

typedef struct cg_flusher {
    uv_check_t check;
    uv_idle_t idle; /* keeps the poll from blocking while items wait (flush.c) */
    uv_timer_t timer; /* for the items of cg_flush_later */
    cg_flush_item *head;
    cg_flush_item *first; /* flushed before head's: commands to a store, before the frames
                           * that report their outcome (cg_flush_request_first) */
    cg_flush_item *later; /* cg_flush_later's, in no order */
    cg_flush_item *event; /* cg_flush_request_event's */
    cg_flush_item *answers; /* cg_flush_request_answer's: run before event's */
    const void *serving; /* cg_flush_event_end's: the connection whose event it ends */
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
/* Registers item to run when the event being handled ends (cg_flush_event_end), or at the
 * end of this loop iteration when no event end comes first; an item registered with
 * cg_flush_request moves over. owner is the connection it writes to: an event end never
 * writes from inside that connection's own callback, and leaves the item for the
 * iteration's end, as it leaves an item registered after_first while output registered
 * with cg_flush_request_first waits (a client frame that reports a store write). */
void cg_flush_request_event(cg_flusher *f, cg_flush_item *item, void (*flush)(cg_flush_item *item),
                            const void *owner, int after_first);
/* An answer from memory (a store's): run at the event's end before the event's output, so
 * that what it makes goes with that output; else at the iteration's end, before the rest.
 * Returns -1, registering nothing, once the flusher is closed. */
int cg_flush_request_answer(cg_flusher *f, cg_flush_item *item, void (*flush)(cg_flush_item *item));
/* The end of an I/O event that serving (a wsi, a Redis context) was read for: runs the
 * answers, then the event's items, for up to four rounds; what is left goes at the loop
 * iteration's end. */
void cg_flush_event_end(cg_flusher *f, const void *serving);
/* The connection whose event is being ended, or NULL. */
static inline const void *cg_flush_serving(const cg_flusher *f)
{
    return f->serving;
}
/* Unregisters item if it is registered (by any of them). */
void cg_flush_cancel(cg_flush_item *item);

#endif
