#ifndef CHATGATE_CORE_KEEPALIVE_H
#define CHATGATE_CORE_KEEPALIVE_H
/*
 * keepalive.h: the WebSocket pings of quiet connections, and the hang-up of silent ones,
 * for every WebSocket connection of a process, either end (src/core/keepalive.c).
 *
 * A connection that received nothing for ping_interval_s gets a ping; one that then still
 * receives nothing until idle_timeout_s after its last frame is closed. Any frame counts:
 * a message (any fragment of one) or a pong.
 *
 * Why not lws's own (a retry policy's secs_since_valid_ping and _hangup): lws 4.1.6 keeps
 * each connection's timer in one list sorted by time, and inserts by walking it from its
 * head, so every ping and every pong walked every connection's timer. With thousands of
 * connections that was most of an idle gateway's CPU (docs/architecture.md, "Many
 * connections in lws 4.1.6": with lws's descriptor walk, server/gateway.c's set_fd_limit,
 * 8,000 idle connections pinged every 2 s took 951 ms of CPU a second, and 102 without
 * either). Here a connection's deadline is always its last frame plus one of two fixed
 * intervals, so two lists in arrival order stay sorted by themselves: a frame moves its
 * connection to the tail of the first, a ping to the tail of the second, each in constant
 * time, and one timer looks at the two heads.
 *
 * One thread: the loop's. A connection's item is its owner's (the session, the client
 * connection); the owner calls cg_keepalive_seen for every frame it receives and
 * cg_keepalive_writable first in its writable callback, which writes a ping that is due.
 * add, seen, remove and writable take k NULL (a cg_net without one: a unit test's) as a
 * no-op. The socket is reached through a table (cg_keepalive_io): lws's, or a unit test's
 * fake.
 */
#include <stdint.h>
#include <sys/queue.h>

#include <libwebsockets.h>
#include <uv.h>

#include "chatgate/core/metrics.h"

struct cg_net;
typedef struct cg_keepalive cg_keepalive;

typedef enum {
    CG_KEEPALIVE_OFF,    /* not watched: before it opened, after it closed */
    CG_KEEPALIVE_QUIET,  /* in the first list: pinged at seen + ping interval */
    CG_KEEPALIVE_PINGED, /* in the second: closed at seen + idle timeout */
} cg_keepalive_state;

typedef struct cg_keepalive_item {
    TAILQ_ENTRY(cg_keepalive_item) link;
    struct lws *wsi;
    uint64_t seen_ms;         /* the loop's time of its last frame, or of its opening */
    cg_keepalive_state state;
    int ping_due;             /* to be written at its next writable */
} cg_keepalive_item;

TAILQ_HEAD(cg_keepalive_list, cg_keepalive_item);

/* The socket: lws's (cg_keepalive_lws_io), or a test's. */
typedef struct cg_keepalive_io {
    void (*want_writable)(struct lws *wsi);
    int (*partial)(struct lws *wsi); /* bytes of an earlier write still wait in lws */
    int (*ping)(struct lws *wsi);    /* writes a ping: 0, or -1 when the write failed */
    void (*hang_up)(const struct cg_net *net, struct lws *wsi); /* closes it from the loop */
} cg_keepalive_io;
extern const cg_keepalive_io cg_keepalive_lws_io;

struct cg_keepalive {
    const cg_keepalive_io *io; /* cg_keepalive_lws_io, set by init */
    const struct cg_net *net; /* the loop, and lws for a hang-up */
    uv_timer_t timer;
    uint64_t ping_ms, idle_ms;
    struct cg_keepalive_list quiet, pinged;
    cg_metrics *metrics; /* ws_pings, ws_idle_hangups; or NULL */
    int closed;
};

/* Sets k up on net's loop: pings after ping_s of silence, a hang-up after idle_s (over
 * ping_s), each counted in metrics (may be NULL). */
void cg_keepalive_init(cg_keepalive *k, const struct cg_net *net, unsigned ping_s, unsigned idle_s,
                       cg_metrics *metrics);
/* Closes the timer; the items are let go (their connections are closing). */
void cg_keepalive_close(cg_keepalive *k);

/* Watches the connection wsi from now (it opened). */
void cg_keepalive_add(cg_keepalive *k, cg_keepalive_item *it, struct lws *wsi);
/* A frame came: the silence starts again. */
void cg_keepalive_seen(cg_keepalive *k, cg_keepalive_item *it);
/* The connection is gone: no longer watched. A no-op for an item not added. */
void cg_keepalive_remove(cg_keepalive *k, cg_keepalive_item *it);

/* From the connection's writable callback, before its own frames: writes a ping that is
 * due. -1 when the write failed (the callback returns -1: lws closes the connection). */
int cg_keepalive_writable(cg_keepalive *k, cg_keepalive_item *it);

#endif
