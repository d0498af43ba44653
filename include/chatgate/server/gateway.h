/*
 * gateway.h: the process's one server: the libuv loop, the libwebsockets context on it, the
 * signals and the drain, and the cg_server the handlers share (server.h). Only gateway.c and
 * main.c know this struct.
 *
 * docs/architecture.md, "Threading": we create the uv loop and hand it to libwebsockets as a foreign
 * loop, so hiredis, upstream clients and timers all run on the same thread.
 */
#ifndef CHATGATE_GATEWAY_H
#define CHATGATE_GATEWAY_H

#include <uv.h>
#include <libwebsockets.h>

#include "chatgate/config/config.h"
#include "chatgate/server/server.h"

typedef struct cg_gateway cg_gateway;

struct cg_gateway {
    cg_server srv; /* first: what the handlers share; the lws context's user data */
    uv_loop_t *loop;
    struct lws_context *lws;
    struct lws_vhost *vhost;
    uv_signal_t sig_term, sig_int, sig_hup;
    struct lws_http_mount mount, mount_metrics, mount_healthz, mount_admin;
    uv_timer_t drain;
    uint64_t drain_deadline; /* uv_now() */
    struct lws_protocols *protocols; /* built at start: the app's subprotocols are in it */
    struct lws_token_limits token_limits; /* each header's bound: max_header_bytes */
};

/*
 * Sets up the store, listener, mounts and upstreams on loop. 0; -1 when the server cannot
 * start (logged); CG_GATEWAY_BAD_CONFIG for a bad store URL, rule set or export setting
 * (err says why).
 */
#define CG_GATEWAY_BAD_CONFIG (-2)
int cg_gateway_start(cg_gateway *gw, const cg_config *cfg, uv_loop_t *loop, char *err, size_t errlen);
/* After a failed start: closes and frees what start made, running the loop until its
 * handles are gone, so that the caller can close the loop. */
void cg_gateway_abort(cg_gateway *gw);
/* Runs until SIGTERM or SIGINT, then tears down; returns 0. */
int cg_gateway_run(cg_gateway *gw);

#endif
