/*
 * ops.h: the operator's HTTP endpoints: GET /healthz and GET /metrics (Prometheus text).
 *
 * /healthz is 200 while serving, "degraded" when the store is away (a load balancer must
 * not drop every gateway because Redis is), 503 only while shutting down (docs/architecture.md,
 * "Operations"). /metrics shows the gateway's counters and the store's.
 */
#ifndef CHATGATE_OPS_H
#define CHATGATE_OPS_H

#include <uv.h>
#include <libwebsockets.h>

#include "chatgate/core/metrics.h"

#define CG_LWS_PROTOCOL_OPS "cg-ops"

int cg_ops_callback(struct lws *wsi, enum lws_callback_reasons reason, void *user, void *in, size_t len);

struct cg_server;
struct cg_store_stats;
/* The figures /metrics shows: this process's, or with --workers the group's (summed into a
 * static copy, valid until the next call); the store's and the connections with them. */
const cg_metrics *cg_ops_metrics(const struct cg_server *srv, const struct cg_store_stats **store, long *connections);

#endif
