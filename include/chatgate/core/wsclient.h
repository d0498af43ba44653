#ifndef CHATGATE_CORE_WSCLIENT_H
#define CHATGATE_CORE_WSCLIENT_H
/*
 * wsclient.h: one WebSocket connection the gateway opens, written once for both that do:
 * the ws upstream's to a chat app (upstream/ws.c) and drop-in's to the app (server/dropin.c).
 *
 * It resolves the host off the loop (net.h), connects on the gateway's lws context, lets
 * its owner add the handshake's headers and read the app's answer, writes and reads frames
 * through its cg_wsconn (wsconn.h: the queue, the marks, the close), checks the app's close
 * frame, and ends exactly once, with what its owner needs to say why: the host that did not
 * resolve, the connection refused, the TLS certificate refused, the HTTP status that refused
 * the handshake, or, once open, the app's close code and reason (checked), or none.
 *
 * The owner embeds it and keeps itself alive until `ended`: that is the last callback, and
 * the socket is gone by then. One lws protocol callback serves every such connection
 * (cg_wsclient_callback); the wsi's opaque user data is the cg_wsclient.
 */
#include <stddef.h>

#include "chatgate/core/keepalive.h"
#include "chatgate/core/net.h"
#include "chatgate/core/wsconn.h"

typedef struct cg_wsclient cg_wsclient;

/* How the connection ended (cg_wsclient_ops.ended). */
typedef struct cg_wsclient_end {
    int opened;      /* it had been open */
    /* never opened: */
    unsigned status; /* the HTTP status that refused the handshake; 0 when none came */
    const char *why; /* what failed, to follow the app's name: "could not resolve the host: ...",
                        "could not be reached: ...", "could not be reached: its TLS certificate was
                        refused: ...", "refused the connection with HTTP 403" */
    /* opened: */
    int code;           /* the app's close code; 1005 when its close frame had none, 0 when it
                           sent no close frame (the connection was lost) */
    const char *reason; /* its reason, "" when none (never text that is not UTF-8) */
    int invalid;        /* its close frame broke RFC 6455 (code and reason are then 0 and "") */
} cg_wsclient_end;

/* The owner's side; any member may be NULL. */
typedef struct cg_wsclient_ops {
    /* CLIENT_APPEND_HANDSHAKE_HEADER: adds headers at *p (below end); -1 fails the connection */
    int (*headers)(cg_wsclient *w, unsigned char **p, unsigned char *end);
    /* the app accepted the handshake; its response headers can still be read from wsi */
    void (*accepted)(cg_wsclient *w, struct lws *wsi);
    /* open: what is queued goes now */
    void (*opened)(cg_wsclient *w);
    /* a whole message; msg NULL when it passed max_message */
    void (*message)(cg_wsclient *w, const char *msg, size_t len, int binary);
    /* the end, once, last */
    void (*ended)(cg_wsclient *w, const cg_wsclient_end *end);
} cg_wsclient_ops;

typedef enum {
    CG_WSCLIENT_IDLE,
    CG_WSCLIENT_RESOLVING,
    CG_WSCLIENT_CONNECTING,
    CG_WSCLIENT_OPEN,
    CG_WSCLIENT_ENDED,
} cg_wsclient_state;

struct cg_wsclient {
    cg_wsconn conn;   /* the frames, both ways (conn.owner is the owner too) */
    cg_keepalive_item ka; /* its pings while open (keepalive.h) */
    const cg_wsclient_ops *ops;
    void *owner;
    cg_wsclient_state state;
    size_t max_message;  /* a message's bound, bytes */
    cg_resolve *resolve;
    cg_connect_spec spec; /* its strings are the owner's, kept until the connection is open */
    const char *host;     /* the name to resolve */
    int close_code;       /* the app's close frame, as cg_wsclient_end says */
    int close_invalid;
    char close_reason[124];
};

/* Sets w up (IDLE) with its queue's ops (wsconn.h) and its own. */
void cg_wsclient_init(cg_wsclient *w, const cg_net *net, const cg_wsconn_ops *conn_ops,
                      const cg_wsclient_ops *ops, void *owner);

/* Resolves host, then connects as spec says (spec.address is filled then); ended comes
 * when that fails. -1 when the lookup could not even start (nothing will come). */
int cg_wsclient_connect(cg_wsclient *w, const char *host, const cg_connect_spec *spec);

/* The owner is done with it: what was queued is dropped; an open connection gets a close
 * frame (code, reason) and goes, one still connecting goes at once, and resolving stops.
 * ended still comes, possibly from inside this call (when there was no socket). */
void cg_wsclient_close(cg_wsclient *w, int code, const char *reason);

/* The same, but an open connection is first written what was queued (frames its owner
 * already let through), then the close frame: within CG_WSCONN_CLOSE_WAIT_S (wsconn.h). A
 * proxy's peer that left after sending expects what it sent to arrive. */
void cg_wsclient_finish(cg_wsclient *w, int code, const char *reason);

/* The lws protocol callback of every such connection. */
int cg_wsclient_callback(struct lws *wsi, enum lws_callback_reasons reason, void *user, void *in, size_t len);

#endif
