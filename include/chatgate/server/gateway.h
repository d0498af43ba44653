/*
 * gateway.h: the process's one server: the libuv loop, the libwebsockets context on it,
 * the configured upstreams and the counters shared by every session.
 *
 * DESIGN.md section 10: we create the uv loop and hand it to libwebsockets as a foreign
 * loop, so hiredis, upstream clients and timers all run on the same thread.
 */
#ifndef CHATGATE_GATEWAY_H
#define CHATGATE_GATEWAY_H

#include <uv.h>
#include <libwebsockets.h>

#include "chatgate/config/config.h"
#include "chatgate/dialog/dialog.h"
#include "chatgate/server/ops.h"
#include "chatgate/dialog/rules.h"
#include "chatgate/store/store.h"
#include "chatgate/upstream/upstream.h"

typedef struct cg_gateway cg_gateway;

struct cg_gateway {
    const cg_config *cfg;
    uv_loop_t *loop;
    struct lws_context *lws;
    struct lws_vhost *vhost;
    cg_net net; /* loop, lws and vhost: what the network clients get */
    cg_upstream upstreams[CG_MAX_UPSTREAMS];
    int n_upstreams;
    long n_sessions;            /* WebSocket clients connected now */
    unsigned long session_seq; /* for session ids */
    uv_signal_t sig_term, sig_int;
    struct lws_http_mount mount, mount_metrics, mount_healthz, mount_admin;
    cg_metrics metrics;
    cg_store *store;
    cg_ruleset *rules; /* the running set; messages hold references */
    json_t *dialog_locks; /* dialog key -> lock (admission.c): one turn at a time per dialog */
    uv_signal_t sig_hup;
    int stopping;            /* SIGTERM came: draining */
    uv_timer_t drain;
    uint64_t drain_deadline; /* uv_now() */
    long inflight_turns;     /* chat messages between load and terminal frame */
    int closing_all;         /* shutdown: clients are being sent close frames */
    lws_retry_bo_t retry;    /* ping and idle policy */
    cg_upstream_config dropin_app;  /* the app of drop-in mode, from dropin.app */
    struct lws_protocols *protocols; /* built at start: the app's subprotocols are in it */
    unsigned char *resume_secret; /* CHATGATE_RESUME_SECRET, or random per process; owned */
    size_t resume_secret_len;
    unsigned char *jwt_secret;    /* CHATGATE_JWT_SECRET with --auth jwt ("" otherwise); owned */
    size_t jwt_secret_len;
    struct lws_token_limits token_limits; /* each header's bound: max_header_bytes */
};

/*
 * Sets up the store, listener, mounts and upstreams on loop. 0; -1 when the server cannot
 * start (logged); CG_GATEWAY_BAD_CONFIG when the store URL is wrong (err says why).
 */
#define CG_GATEWAY_BAD_CONFIG (-2)
int cg_gateway_start(cg_gateway *gw, const cg_config *cfg, uv_loop_t *loop, char *err, size_t errlen);
/* After a failed start: frees what start made (the process is about to exit). */
void cg_gateway_abort(cg_gateway *gw);
/* Loads the rules again (SIGHUP, POST /admin/reload): 0, or -1 with err; the running set
 * stays on failure. */
int cg_gateway_reload_rules(cg_gateway *gw, char *err, size_t errlen);

/* Runs until SIGTERM or SIGINT, then tears down; returns the exit status. */
int cg_gateway_run(cg_gateway *gw);

/*
 * When the request's headers pass max_header_bytes, answers 431 and returns 1; else 0.
 * For the callbacks that see a request before it is routed (the admin listener's).
 */
int cg_gateway_refuse_large_headers(struct lws *wsi);
/* Writes a whole HTTP answer (status, reason, a text body, connection: close); returns 1. */
int cg_gateway_http_refuse(struct lws *wsi, int status, const char *reason, const char *body);

/* The gateway a wsi belongs to. */
cg_gateway *cg_gateway_of(struct lws *wsi);

#endif
