/*
 * worker.h: the worker side of --workers N (master.h): its own listening sockets, whose
 * accepted connections go to libwebsockets, and the figures it publishes for /metrics.
 *
 * Why not lws's listener: libwebsockets 4.1.6 as Debian ships it does not set SO_REUSEPORT
 * for LWS_SERVER_OPTION_ALLOW_LISTEN_SHARE (its issue 2470, fixed in 4.4), so a second
 * worker could not bind the port. Each worker binds the port itself with SO_REUSEPORT (the
 * kernel spreads new connections over the workers' sockets by their addresses), creates its
 * vhosts with CONTEXT_PORT_NO_LISTEN_SERVER, and hands every accepted socket to the vhost
 * with lws_adopt_socket_vhost(), which serves it as if lws had accepted it: HTTP (the
 * page, /healthz, /metrics, /admin) and WebSocket upgrades alike.
 */
#ifndef CHATGATE_SERVER_WORKER_H
#define CHATGATE_SERVER_WORKER_H

#include <uv.h>
#include <libwebsockets.h>

#include "chatgate/server/server.h"

/* Binds host:port (SO_REUSEPORT) and adopts its connections into vh; `what` names it in
 * logs. 0, or -1 (logged). At most two listeners (the main one and the admin one). */
int cg_worker_listen(uv_loop_t *loop, struct lws_vhost *vh, const char *host, int port, const char *what);

/* Copies the worker's figures into its slot now, and every CG_WORKER_PUBLISH_MS from start. */
void cg_worker_publish(const cg_server *srv);
void cg_worker_publish_start(const cg_server *srv);

/* The drain's end: the listeners and the publishing timer close (one last publish). */
void cg_worker_stop(const cg_server *srv);

#endif
