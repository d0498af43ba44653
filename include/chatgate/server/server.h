/*
 * server.h: what the server's connection handlers share (chatgate.v1 sessions, drop-in
 * clients, /healthz and /metrics, the admin API), instead of the whole gateway.
 *
 * The gateway (gateway.c) owns one cg_server, fills it at start and hands it to lws as the
 * context's user data: a handler finds it with cg_server_of(wsi). A turn gets less still:
 * only `turn` (turn.h), the config, store, rule set, upstreams, metrics and dialog locks.
 * Only gateway.c and main.c know the gateway struct itself (its loop handles, signals,
 * mounts and drain timer).
 */
#ifndef CHATGATE_SERVER_SERVER_H
#define CHATGATE_SERVER_SERVER_H

#include <libwebsockets.h>
#include <stddef.h>

#include "chatgate/config/config.h"
#include "chatgate/core/flush.h"
#include "chatgate/core/keepalive.h"
#include "chatgate/core/metrics.h"
#include "chatgate/core/net.h"
#include "chatgate/server/resume.h"
#include "chatgate/server/turn.h"
#include "chatgate/upstream/upstream.h"

typedef struct cg_server {
    const cg_config *cfg;
    cg_net net;                /* the loop, lws context, vhost and flusher */
    cg_flusher flusher;        /* net.flush */
    cg_keepalive keepalive;    /* net.keepalive: pings of quiet WebSocket connections */
    cg_net_batch batch;        /* frames written together (session.c); one loop, one at a time */
    cg_turn_env turn;          /* what every turn gets; points into the members below */
    cg_resume resume;          /* replies of clients gone mid-reply (resume.h) */
    cg_metrics metrics;
    cg_upstream upstreams[CG_MAX_UPSTREAMS];
    long n_sessions;           /* WebSocket clients connected now */
    long n_held;               /* drop-in clients waiting for their app's handshake (dropin.c) */
    unsigned long session_seq; /* for session ids */
    int closing_all;           /* shutdown: clients are being sent close frames */
    unsigned char *resume_secret; /* CHATGATE_RESUME_SECRET, or random per process; owned */
    size_t resume_secret_len;
    unsigned char *jwt_secret;    /* CHATGATE_JWT_SECRET with --auth jwt ("" otherwise); owned */
    size_t jwt_secret_len;
    /* Loads the rules again (POST /admin/reload): 0, or -1 with err; set by the gateway,
     * the only one that swaps the running set. */
    int (*reload_rules)(struct cg_server *srv, char *err, size_t errlen);
} cg_server;

/* The server a wsi belongs to (the lws context's user data). */
cg_server *cg_server_of(struct lws *wsi);

#endif
