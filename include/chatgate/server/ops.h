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

#endif
