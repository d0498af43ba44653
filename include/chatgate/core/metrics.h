/*
 * metrics.h: the gateway's counters (cg_metrics, the registry every layer above counts into)
 * and latency histograms in Prometheus' shape (cumulative buckets, sum, count). One worker
 * thread, so plain counters. server/ops.c renders them as /metrics.
 */
#ifndef CHATGATE_METRICS_H
#define CHATGATE_METRICS_H

#include <stddef.h>

#include "chatgate/core/error.h"

#define CG_HISTOGRAM_BUCKETS 15

typedef struct cg_histogram {
    unsigned long counts[CG_HISTOGRAM_BUCKETS + 1]; /* the last one is +Inf */
    double sum_s;
    unsigned long count;
} cg_histogram;

/* Records one observation of `seconds`. */
void cg_histogram_observe(cg_histogram *h, double seconds);

/* Appends "name_bucket{stage=...,le=...}" lines, _sum and _count to buf; returns the bytes
 * written (0 when buf is too small, so the caller can stop). */
size_t cg_histogram_format(const cg_histogram *h, const char *name, const char *label, char *buf, size_t len);

/* Counters of the whole gateway; one thread, so plain integers. Every member before the
 * histograms is an unsigned long counter (or an array of them): cg_metrics_add sums them
 * word by word, so a new counter must keep to that, and the histograms stay last. */
/* Service slots of the token counters: "none", up to CG_METRIC_SERVICES - 2 services named
 * in the config's "services" (in its order), and "other" for every other. */
#define CG_METRIC_SERVICES 10
/* Rules counted one by one in /metrics (by their place in the running set), and rule files
 * timed one by one: a set's rules and files past these are not. */
#define CG_METRIC_RULES 1024
#define CG_METRIC_RULE_FILES 32
/* The fields a shadow rule set's decision is compared in: dialog/pipeline.h's
 * CG_OUTCOME_FIELDS (core cannot see it; server/turn.c checks they agree). */
#define CG_METRIC_SHADOW_FIELDS 7
/* Upstreams counted by index: config.h's CG_MAX_UPSTREAMS (server/ops.c checks they agree). */
#define CG_METRIC_UPSTREAMS 32
/* The limits a message can meet, by store/limits.h's cg_limit_hit (slot 0, none, unused;
 * server/turn.c checks they agree). */
#define CG_METRIC_LIMITS 5

typedef struct cg_metrics {
    unsigned long messages;     /* chat messages accepted into a queue */
    unsigned long turns_done;   /* messages answered with done */
    unsigned long turns_error;  /* ... with error */
    unsigned long turns_cancelled;
    unsigned long turns_blocked; /* ... stopped by a rule on replies (error blocked): policy, not failure */
    unsigned long frames_in, frames_out;
    unsigned long bad_frames;
    unsigned long rate_limited;
    unsigned long refused_connections;
    unsigned long unauthorized;
    unsigned long ws_pings;        /* pings of quiet WebSocket connections, either end (keepalive.h) */
    unsigned long ws_idle_hangups; /* connections closed for idle_timeout_s of silence */
    unsigned long degraded_warnings; /* store_degraded sent to clients */
    /* what the pipeline decided (docs/architecture.md, "Operations") */
    unsigned long awaiting_resolutions;
    unsigned long cancels;
    unsigned long soft_context_hits;
    unsigned long enrichments;
    unsigned long rules_fired, rules_limited;
    unsigned long routed[CG_METRIC_UPSTREAMS]; /* per upstream, by index */
    unsigned long reloads, reload_failures;
    unsigned long cache_hits, cache_misses; /* dialog loads that found a dialog, or not */
    unsigned long errors[CG_ERR_COUNT];     /* error frames by code, slot code - CG__ERR_FIRST - 1 */
    unsigned long upstream_errors[CG_METRIC_UPSTREAMS];      /* by upstream index */
    /* an OpenAI-compatible upstream's kept-alive connections, by upstream index: TCP
     * connections opened, requests sent on a kept one, new TLS connections that resumed a
     * session, and held idle now (a gauge; summed over the workers it is the group's) */
    unsigned long upstream_conns_opened[CG_METRIC_UPSTREAMS], upstream_conns_reused[CG_METRIC_UPSTREAMS], upstream_tls_resumed[CG_METRIC_UPSTREAMS];
    unsigned long upstream_conns_idle[CG_METRIC_UPSTREAMS];
    /* replicas (upstreams.NAME.urls): attempts retried on another replica, replicas marked
     * out after a failure, and messages that went on to the upstream's fallback, by index */
    unsigned long upstream_retries[CG_METRIC_UPSTREAMS], upstream_replica_outs[CG_METRIC_UPSTREAMS], upstream_fallbacks[CG_METRIC_UPSTREAMS];
    /* tokens spent (docs/configuration.md, "Usage"), by upstream index, service slot (cg_metrics_service:
     * 0 none, then the config's services in order, the last one every other) and direction
     * (0 in, 1 out) */
    unsigned long tokens[CG_METRIC_UPSTREAMS][CG_METRIC_SERVICES][2];
    /* messages refused by a limit per user (docs/configuration.md, "Limits per user"), by the limit met:
     * limits.h's cg_limit_hit, slot 0 unused */
    unsigned long limited[CG_METRIC_LIMITS];
    /* the running rule set's rules (rules.h, cg_rules_counts), by index: hits, and match-limit
     * cut-offs; started again at each reload, as the indices change */
    unsigned long rule_hits[CG_METRIC_RULES], rule_limited[CG_METRIC_RULES];
    /* the shadow rule set (--shadow-rules): messages it decided the same as the live set,
     * and differently, and by what differed */
    unsigned long shadow_same, shadow_different;
    unsigned long shadow_field[CG_METRIC_SHADOW_FIELDS]; /* by cg_outcome_field (dialog/pipeline.h) */
    /* the turn export (server/export.h): records its sink took, records dropped (the queue
     * was full, or the sink failed them at the end), and records held now (a gauge) */
    unsigned long export_records, export_dropped, export_queued;
    cg_histogram store_load, rules, first_token, turn; /* seconds per stage */
    cg_histogram rule_file_time[CG_METRIC_RULE_FILES]; /* seconds per message in each file's rules */
} cg_metrics;

/* dst += src, every counter and histogram (--workers: the figures of the process group). */
void cg_metrics_add(cg_metrics *dst, const cg_metrics *src);

#endif
