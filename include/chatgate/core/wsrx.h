#ifndef CHATGATE_CORE_WSRX_H
#define CHATGATE_CORE_WSRX_H
/*
 * wsrx.h: one WebSocket message put together from the fragments lws hands over (at most
 * the protocol's rx_buffer_size at a time: 2 KiB for clients, 4 KiB from apps), within a
 * bound.
 *
 * A message that comes in one piece, the common case, is used where lws has it: nothing is
 * copied and no buffer exists. Only a message in several pieces gets a buffer, grown by
 * doubling (O(n) copying for n bytes) and freed once the message is handled, so an idle
 * connection holds none; a buffer sized to the bound per connection would cost memory on
 * every connection that ever sent one message (docs/architecture.md, "Memory").
 */
#include <stddef.h>

typedef struct cg_wsrx {
    char *buf; /* the pieces so far; NULL while none is kept */
    size_t len, cap;
    int too_large; /* the message passed the bound: the rest is read and dropped */
} cg_wsrx;

/*
 * Takes one fragment. Returns 0 while more is to come; 1 when the message is whole, with
 * *msg and *msg_len set (the fragment itself, which need not be NUL-terminated, or the
 * buffer), or *msg NULL when it passed max bytes. Call cg_wsrx_done() after handling a
 * whole message.
 */
int cg_wsrx_feed(cg_wsrx *rx, int first, int final, const char *in, size_t len, size_t max, const char **msg,
                 size_t *msg_len);
/* Ends the message: the buffer, if any, goes. */
void cg_wsrx_done(cg_wsrx *rx);

#endif
