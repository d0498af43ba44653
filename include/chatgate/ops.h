/*
 * ops.h: the operator's HTTP endpoints: GET /healthz and GET /metrics (Prometheus text).
 *
 * /healthz is 200 while serving, "degraded" when the store is away (a load balancer must
 * not drop every gateway because Redis is), 503 only while shutting down (DESIGN.md
 * section 8). /metrics shows the gateway's counters and the store's.
 */
#ifndef CHATGATE_OPS_H
#define CHATGATE_OPS_H

#include <uv.h>
#include <libwebsockets.h>

#include "chatgate/metrics.h"

#define CG_LWS_PROTOCOL_OPS "cg-ops"

/* Counters of the whole gateway; one worker, so plain integers. */
typedef struct cg_metrics {
    unsigned long messages;     /* chat messages accepted into a queue */
    unsigned long turns_done;   /* messages answered with done */
    unsigned long turns_error;  /* ... with error */
    unsigned long turns_cancelled;
    unsigned long frames_in, frames_out;
    unsigned long bad_frames;
    unsigned long rate_limited;
    unsigned long refused_connections;
    unsigned long unauthorized;
    unsigned long degraded_warnings; /* store_degraded sent to clients */
    /* reference 001's */
    unsigned long awaiting_resolutions;
    unsigned long cancels;
    unsigned long soft_context_hits;
    unsigned long enrichments;
    unsigned long rules_fired, rules_limited;
    unsigned long routed[32]; /* per upstream, by index (CG_MAX_UPSTREAMS) */
    unsigned long reloads, reload_failures;
    unsigned long cache_hits, cache_misses; /* dialog loads that found a dialog, or not */
    unsigned long errors[16];               /* error frames by code, index -code - CG__ERR_FIRST - 1 */
    unsigned long upstream_errors[32];      /* by upstream index */
    cg_histogram store_load, rules, first_token, turn; /* seconds per stage */
} cg_metrics;

typedef struct cg_pipeline_result cg_pipeline_result;
/* Counts what the pipeline decided for one message (reference 001's counters). */
void cg_metrics_count_pipeline(cg_metrics *m, const cg_pipeline_result *res);

int cg_ops_callback(struct lws *wsi, enum lws_callback_reasons reason, void *user, void *in, size_t len);

#endif
