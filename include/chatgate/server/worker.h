/*
 * worker.h: the worker side of --workers N (master.h): the figures it publishes for
 * /metrics. A worker binds the port itself with SO_REUSEPORT (listener.h: the kernel spreads
 * new connections over the workers' sockets by their addresses).
 */
#ifndef CHATGATE_SERVER_WORKER_H
#define CHATGATE_SERVER_WORKER_H

#include <uv.h>
#include <libwebsockets.h>

#include "chatgate/server/server.h"

/* Copies the worker's figures into its slot now, and every CG_WORKER_PUBLISH_MS from start. */
void cg_worker_publish(const cg_server *srv);
void cg_worker_publish_start(const cg_server *srv);

/* The drain's end: the publishing timer closes (one last publish). */
void cg_worker_stop(const cg_server *srv);

#endif
