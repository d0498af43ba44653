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

#include "chatgate/config.h"
#include "chatgate/upstream.h"

struct cg_gateway {
    const cg_config *cfg;
    uv_loop_t *loop;
    struct lws_context *lws;
    struct lws_vhost *vhost;
    cg_upstream upstreams[CG_MAX_UPSTREAMS];
    int n_upstreams;
    long n_sessions;            /* WebSocket clients connected now */
    unsigned long session_seq; /* for session ids */
    uv_signal_t sig_term, sig_int;
    struct lws_http_mount mount;
};

/* Sets up the listener, mounts and upstreams on loop; 0, or -1 with a logged reason. */
int cg_gateway_start(cg_gateway *gw, const cg_config *cfg, uv_loop_t *loop);
/* Runs until SIGTERM or SIGINT, then tears down; returns the exit status. */
int cg_gateway_run(cg_gateway *gw);

/* The gateway a wsi belongs to. */
cg_gateway *cg_gateway_of(struct lws *wsi);

#endif
