#ifndef CHATGATE_CORE_WSCONN_H
#define CHATGATE_CORE_WSCONN_H
/*
 * wsconn.h: one WebSocket connection's plumbing, written once for every connection of the
 * gateway, either end: the chat client's (session.c), drop-in's client and app (dropin.c),
 * and a chat app's as an upstream (upstream/ws.c).
 *
 * What it owns:
 *   - the frame queue, in order, with its bytes and frames counted. A frame may be held
 *     (drop-in's chat message waiting for its pipeline: it and the frames behind it wait),
 *     lazy (made only when it is written, from what its owner kept growing: the session's
 *     deltas of one message coalesce into one frame), or a close frame, which ends the
 *     queue: nothing queued after it is kept.
 *   - the write: at the end of the loop iteration (flush.h), or when the event that made
 *     the frames ends (cg_wsconn_soon), as many frames as the socket takes; several in one
 *     send on the server side (net.h, cg_net_batch), each masked here on the client side
 *     (cg_net_client_frame); the writable callback only when the socket is full. A close
 *     frame goes from the writable callback, and the connection at the writable after it;
 *     a peer that does not read gets CG_WSCONN_CLOSE_WAIT_S from when the close was asked.
 *   - the water marks: past `high` bytes (each frame counted with CG_WSFRAME_COST more) the
 *     queue is "full" until it is under a quarter of it, past twice `high` "overfull" until
 *     the same; the owner's flow() hears each change and pauses what fills the queue.
 *   - reading: a message reassembled from its fragments within a bound (wsrx.h), and
 *     pausing the socket's reading (lws rx flow control), kept while not open.
 *
 * The socket is reached through a table (cg_wsconn_io): lws's by default, a fake in the
 * unit test (tests/unit/core/test_wsconn.c). One thread: the loop's.
 */
#include <stddef.h>

#include "chatgate/core/flush.h"
#include "chatgate/core/net.h"
#include "chatgate/core/wsrx.h"

/* The headroom in front of a frame's bytes: lws's LWS_PRE, or a client frame's header. */
#define CG_WS_PRE 16

/* How long a peer has to read what is queued once its connection is to close. */
#define CG_WSCONN_CLOSE_WAIT_S 30

typedef struct cg_wsconn cg_wsconn;

typedef enum {
    CG_WS_SERVER, /* we accepted it: frames unmasked, batched */
    CG_WS_CLIENT, /* we opened it: frames masked */
} cg_ws_role;

typedef enum {
    CG_WSCONN_WAITING,    /* no socket yet (connecting, a handshake held): frames queue */
    CG_WSCONN_OPEN,       /* frames are written */
    CG_WSCONN_CLOSING,    /* a close frame is queued: nothing more is taken */
    CG_WSCONN_CLOSE_SENT, /* the close frame is out: the connection goes at the next writable */
} cg_wsconn_state;

typedef struct cg_wsframe {
    struct cg_wsframe *next;
    char *buf;    /* CG_WS_PRE bytes of headroom, then len bytes; NULL while lazy */
    size_t len;   /* the bytes it counts for (a lazy frame: what its owner has so far) */
    size_t cap;   /* buf's size when it may be kept as the spare (cg_wsconn_spare); else 0 */
    int binary;
    int held;     /* not to be written yet (cg_wsconn_release) */
    int close;    /* a close frame with this code; its reason is buf's text */
    /* frees a frame of its owner's making (a struct with a cg_wsframe first); NULL: buf and
     * the frame are freed */
    void (*destroy)(struct cg_wsframe *f);
} cg_wsframe;

/* What a queued frame costs beyond its bytes. The water marks count it with them, so that a
 * peer sending empty frames (lws hands them over) fills a queue too: counted by their bytes
 * alone, they grew one without bound. */
#define CG_WSFRAME_COST (sizeof(cg_wsframe) + CG_WS_PRE)

/* The owner's side; any member may be NULL. */
typedef struct cg_wsconn_ops {
    /* the queue became full or not, overfull or not (see above) */
    void (*flow)(cg_wsconn *c, int full, int overfull);
    /* makes a lazy frame's buf and len, as it is written */
    void (*finish)(cg_wsconn *c, cg_wsframe *f);
    /* a write failed outside the connection's callbacks (NULL: lws closes it soon) */
    void (*lost)(cg_wsconn *c);
} cg_wsconn_ops;

/* The socket: lws's (cg_wsconn_lws_io), or a test's. */
typedef struct cg_wsconn_io {
    /* writes len bytes at data (CG_WS_PRE bytes of headroom before it): a frame of lws's
     * kind (LWS_WRITE_TEXT, _BINARY, or _HTTP for bytes made here); what lws_write returns */
    int (*write)(cg_wsconn *c, unsigned char *data, size_t len, int kind);
    int (*write_close)(cg_wsconn *c, int code, const char *reason);
    int (*partial)(cg_wsconn *c); /* bytes of an earlier write still wait in lws */
    void (*want_writable)(cg_wsconn *c);
    void (*rx_flow)(cg_wsconn *c, int enable);
    void (*close_within)(cg_wsconn *c, int secs);
} cg_wsconn_io;
extern const cg_wsconn_io cg_wsconn_lws_io;

struct cg_wsconn {
    const cg_wsconn_ops *ops;
    const cg_wsconn_io *io;
    void *owner;
    struct lws *wsi;
    const cg_net *net;    /* the flusher, and the loop for a kill */
    cg_net_batch *batch;  /* server side: the process's batch buffer (net.h) */
    unsigned long *frames_out; /* counted here when not NULL */
    cg_ws_role role;
    cg_wsconn_state state;
    size_t high;          /* the water mark, bytes; 0: none */
    int max_frames;       /* frames the queue takes; 0: no bound but the marks */
    cg_wsframe *head, *tail;
    size_t bytes;
    int n;
    int full, overfull;
    int rx_paused;
    cg_flush_item flush;  /* registered while frames wait for the iteration's end */
    cg_wsframe *lone;     /* a frame alone in the queue, waiting for company (cg_wsconn_wait) */
    cg_flush_item lone_item;
    char *spare;          /* the last written frame's buffer, when its frame allowed it */
    size_t spare_cap;
    cg_wsrx rx;
};

/* Sets c up, empty, WAITING; owner is the ops' (c->owner). */
void cg_wsconn_init(cg_wsconn *c, cg_ws_role role, const cg_net *net, const cg_wsconn_ops *ops, void *owner);
/* The socket is open (established): what is queued is written. */
void cg_wsconn_open(cg_wsconn *c, struct lws *wsi);
/* Frees every frame, the spare and the receive buffer, and cancels the flushes; c may be
 * set up again. The socket is left as it is. */
void cg_wsconn_clear(cg_wsconn *c);
/* The socket is gone: nothing more is written or taken (as after a close frame). The frames
 * queued stay until cg_wsconn_clear: a held one may still be referred to by its owner. */
void cg_wsconn_gone(cg_wsconn *c);

/* A frame of len bytes copied from data (len may be 0; a NUL follows the bytes). */
cg_wsframe *cg_wsframe_new(const void *data, size_t len, int binary);
/* A frame adopting buf (CG_WS_PRE headroom, then len bytes, malloc'd, cap bytes in all:
 * 0 when it is not to be kept as the spare). */
cg_wsframe *cg_wsframe_adopt(char *buf, size_t len, size_t cap, int binary);
void cg_wsframe_free(cg_wsframe *f);

/* Queues f, taking it. -1 (f freed) when the queue takes nothing more: closing, or at
 * max_frames. */
int cg_wsconn_push(cg_wsconn *c, cg_wsframe *f);
int cg_wsconn_send(cg_wsconn *c, const void *data, size_t len, int binary);
/* A lazy frame at the tail grew by n bytes. */
void cg_wsconn_grew(cg_wsconn *c, size_t n);
/* The frame just pushed, alone in the queue, may wait up to ms for company: it goes with
 * the next frame pushed, or when ms have passed. */
void cg_wsconn_wait(cg_wsconn *c, unsigned ms);
/* Queues a close frame after what is queued (the reason is cut to what one holds); a no-op
 * when one is queued or sent already. */
void cg_wsconn_close(cg_wsconn *c, int code, const char *reason);
/* 1 once a close frame is queued or out: nothing more may be written but it. */
int cg_wsconn_closing(const cg_wsconn *c);
/* Writes a close frame now, from the connection's own callback: the answer to a peer's bad
 * close frame. What is queued is not written. */
void cg_wsconn_close_now(cg_wsconn *c, int code, const char *reason);

/* A held frame takes buf (as cg_wsframe_adopt's; NULL: keeps its own) and may go. */
void cg_wsconn_release(cg_wsconn *c, cg_wsframe *f, char *buf, size_t len);
/* Takes f out of the queue (it need not be in it: a frame not queued yet) and frees it. */
void cg_wsconn_remove(cg_wsconn *c, cg_wsframe *f);

/* What waits goes when the event being handled ends (flush.h, cg_flush_request_event),
 * not at the end of the iteration; after_first as there. Only while it waits for the
 * iteration's end (not for a writable callback). */
void cg_wsconn_soon(cg_wsconn *c, int after_first);

/* The writable callback: writes what the socket takes, the close frame included. -1: the
 * connection is to close (the close frame is out, or the socket failed). */
int cg_wsconn_writable(cg_wsconn *c);

/* The spare buffer (the last frame's written, of cap bytes), handed over; NULL when none. */
char *cg_wsconn_spare(cg_wsconn *c, size_t *cap);

/* Pauses or resumes reading from the socket (kept and applied at open while WAITING). */
void cg_wsconn_pause_rx(cg_wsconn *c, int paused);

/*
 * Takes one received fragment (first and final as lws says). 0 while more is to come; 1
 * when the message is whole: *msg and *len set, *msg NULL when it passed max bytes. Call
 * cg_wsconn_received() after handling a whole message.
 */
int cg_wsconn_receive(cg_wsconn *c, int first, int final, const void *in, size_t len, size_t max,
                      const char **msg, size_t *msg_len);
void cg_wsconn_received(cg_wsconn *c);

/*
 * A peer's close frame payload (RFC 6455 5.5.1, 7.4): empty, or a status code of 1000-4999
 * that may be sent (not 1004, 1005, 1006, 1015, nor 1016-2999) followed by a UTF-8 reason.
 * 0 when valid (it may be answered as it came, or sent on), else the code to answer it
 * with: 1002 (protocol error) or 1007 (a reason not UTF-8).
 */
int cg_ws_close_check(const void *payload, size_t len);

#endif
