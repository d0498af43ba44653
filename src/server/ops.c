/*
 * ops.c: GET /healthz and GET /metrics (see ops.h), served by lws callback mounts on the
 * same listener as the demo page. Each answer is small and written at once.
 *
 * With --workers N (master.h) whichever worker takes the request answers for them all: it
 * sums every worker's slot of the shared memory (and what workers that died had counted),
 * adds per-worker figures with a `worker` label where one worker's number matters
 * (connections, up), and says "degraded" when any worker's store is.
 */
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <string.h>

#include "chatgate/core/error.h"
#include "chatgate/server/master.h"
#include "chatgate/server/server.h"
#include "chatgate/server/ops.h"
#include "chatgate/core/log.h"
#include "chatgate/server/worker.h"
#include "chatgate/dialog/pipeline.h"

/* Appends one printf piece at buf + *used. 0; -1 when it does not fit whole (nothing is
 * counted then, so the text stays cut at the last whole piece). */
static int put(char *buf, size_t len, size_t *used, const char *fmt, ...) __attribute__((format(printf, 4, 5)));
static int put(char *buf, size_t len, size_t *used, const char *fmt, ...)
{
    if (*used >= len)
        return -1;
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(buf + *used, len - *used, fmt, ap);
    va_end(ap);
    if (n < 0 || (size_t)n >= len - *used)
        return -1;
    *used += (size_t)n;
    return 0;
}

_Static_assert(CG_METRIC_UPSTREAMS == CG_MAX_UPSTREAMS, "metrics.h counts every upstream");

/* The families counted by upstream index (cg_metrics arrays of 32), in the order written:
 * the line per upstream of every upstream (kinds ALL_KINDS), or only of those kinds. */
#define KIND(k) (1u << (k))
#define ALL_KINDS (~0u)
static const struct upstream_family {
    const char *name, *type, *help; /* help NULL: none */
    size_t offset;                  /* of the array in cg_metrics */
    unsigned kinds;                 /* KIND(cg_upstream_kind) of the upstreams with a line */
} upstream_families[] = {
    {"chatgate_routed_total", "counter", NULL, offsetof(cg_metrics, routed), ALL_KINDS},
    {"chatgate_upstream_errors_total", "counter", NULL, offsetof(cg_metrics, upstream_errors), ALL_KINDS},
    /* the connection pools of the OpenAI-compatible upstreams (upstream/http_pool.h) */
    {"chatgate_upstream_connections_opened_total", "counter",
     "TCP connections opened to an OpenAI-compatible upstream.", offsetof(cg_metrics, upstream_conns_opened),
     KIND(CG_UPSTREAM_OPENAI)},
    {"chatgate_upstream_connections_reused_total", "counter",
     "Requests sent on a kept-alive connection instead of a new one.", offsetof(cg_metrics, upstream_conns_reused),
     KIND(CG_UPSTREAM_OPENAI)},
    {"chatgate_upstream_tls_resumed_total", "counter",
     "New TLS connections to an OpenAI-compatible upstream that resumed an earlier TLS session (no full handshake).",
     offsetof(cg_metrics, upstream_tls_resumed), KIND(CG_UPSTREAM_OPENAI)},
    {"chatgate_upstream_connections_idle", "gauge", "Kept-alive connections idle now, waiting for the next request.",
     offsetof(cg_metrics, upstream_conns_idle), KIND(CG_UPSTREAM_OPENAI)},
    /* replicas and fallback (docs/configuration.md, "Replicas, retries and fallback") */
    {"chatgate_upstream_retries_total", "counter",
     "Messages sent again to another replica after one failed before any reply text.",
     offsetof(cg_metrics, upstream_retries), KIND(CG_UPSTREAM_OPENAI) | KIND(CG_UPSTREAM_WS)},
    {"chatgate_upstream_replica_outs_total", "counter", "Times a replica was marked out after a failure.",
     offsetof(cg_metrics, upstream_replica_outs), KIND(CG_UPSTREAM_OPENAI) | KIND(CG_UPSTREAM_WS)},
    {"chatgate_upstream_fallbacks_total", "counter", "Messages that went on to the upstream's fallback.",
     offsetof(cg_metrics, upstream_fallbacks), ALL_KINDS},
};

/* Every family of upstream_families: its HELP and TYPE, then a line per upstream. */
static int per_upstream(const cg_server *srv, const cg_metrics *m, char *buf, size_t len, size_t *used)
{
    for (size_t f = 0; f < sizeof(upstream_families) / sizeof(upstream_families[0]); f++) {
        const struct upstream_family *fam = &upstream_families[f];
        const unsigned long *values = (const unsigned long *)((const char *)m + fam->offset);
        if ((fam->help && put(buf, len, used, "# HELP %s %s\n", fam->name, fam->help) < 0) ||
            put(buf, len, used, "# TYPE %s %s\n", fam->name, fam->type) < 0)
            return -1;
        for (int i = 0; i < srv->turn.n_upstreams; i++)
            if ((fam->kinds & KIND(srv->upstreams[i].cfg->kind)) &&
                put(buf, len, used, "%s{upstream=\"%s\"} %lu\n", fam->name, srv->upstreams[i].cfg->name,
                    values[i]) < 0)
                return -1;
    }
    return 0;
}

/* chatgate_tokens_total by upstream, service (turn.c's slots: none, the config's services,
 * other) and direction: bounded by the config, never by users. */
static int token_lines(const cg_server *srv, const cg_metrics *m, char *buf, size_t len, size_t *used)
{
    const char *const *names = srv->turn.services;
    int n = srv->turn.n_services;
    if (put(buf, len, used,
            "# HELP chatgate_tokens_total Tokens spent, as upstreams reported them or estimated (4 bytes a "
            "token), by upstream, service and direction.\n# TYPE chatgate_tokens_total counter\n") < 0)
        return -1;
    for (int u = 0; u < srv->turn.n_upstreams; u++)
        for (int i = 0; i < CG_METRIC_SERVICES; i++)
            for (int dir = 0; dir < 2 && (i < n || i == CG_METRIC_SERVICES - 1); dir++)
                if (put(buf, len, used, "chatgate_tokens_total{upstream=\"%s\",service=\"%s\",direction=\"%s\"} %lu\n",
                        srv->upstreams[u].cfg->name, names[i], dir ? "out" : "in", m->tokens[u][i][dir]) < 0)
                    return -1;
    return 0;
}

/* chatgate_limited_total by the limit per user that refused a message (bounded: four). */
static int limited_lines(const cg_metrics *m, char *buf, size_t len, size_t *used)
{
    if (put(buf, len, used,
            "# HELP chatgate_limited_total Messages refused by a limit per user (rate_limited), by limit.\n"
            "# TYPE chatgate_limited_total counter\n") < 0)
        return -1;
    for (int hit = CG_LIMIT_TOKENS_DAY; hit <= CG_LIMIT_TURNS; hit++)
        if (put(buf, len, used, "chatgate_limited_total{limit=\"%s\"} %lu\n", cg_limit_name((cg_limit_hit)hit),
                m->limited[hit]) < 0)
            return -1;
    return 0;
}

/* --workers: the lines of one worker each (after chatgate_connections' total, in its family). */
static int worker_lines(const cg_workers *w, char *buf, size_t len, size_t *used)
{
    for (int i = 0; i < w->n; i++)
        if (put(buf, len, used, "chatgate_connections{worker=\"%d\"} %ld\n", i, w->slots[i].connections) < 0)
            return -1;
    if (put(buf, len, used,
            "# HELP chatgate_workers Worker processes (--workers).\n# TYPE chatgate_workers gauge\n"
            "chatgate_workers %d\n"
            "# HELP chatgate_worker_up 1 while the worker listens, 0 while the master starts it (again).\n"
            "# TYPE chatgate_worker_up gauge\n",
            w->n) < 0)
        return -1;
    for (int i = 0; i < w->n; i++)
        if (put(buf, len, used, "chatgate_worker_up{worker=\"%d\"} %d\n", i, w->slots[i].listening) < 0)
            return -1;
    return put(buf, len, used,
               "# HELP chatgate_worker_restarts_total Workers the master started again after one died.\n"
               "# TYPE chatgate_worker_restarts_total counter\nchatgate_worker_restarts_total %lu\n",
               w->restarts);
}

/* A rule file's name as a label value: with '\\', '"' and line ends escaped as the text
 * format wants, cut at about 200 bytes. */
static const char *file_label(const char *name, char *out, size_t outlen)
{
    const char *s = name;
    size_t n = 0;
    for (; *s && n + 3 < outlen && n < 200; s++) {
        if (*s == '\\' || *s == '"' || *s == '\n')
            out[n++] = '\\';
        out[n++] = *s == '\n' ? 'n' : *s;
    }
    out[n] = 0;
    return out;
}

/* Each rule of the running set: hits and cut-offs by rule and file (bounded by the set's
 * rules, up to CG_METRIC_RULES), the time per file; then the shadow set's comparisons. */
static int rule_lines(const cg_server *srv, const cg_metrics *m, char *buf, size_t len, size_t *used)
{
    const cg_ruleset *rs = srv->turn.rules;
    static const struct { const char *name, *help; size_t offset; } families[] = {
        {"chatgate_rule_hits_total", "Messages each rule fired on, by rule and file (the running set; started again "
                                     "at a reload).", offsetof(cg_metrics, rule_hits)},
        {"chatgate_rule_limited_total", "Messages on which a rule was cut off by a match limit (counted as no match).",
         offsetof(cg_metrics, rule_limited)},
    };
    for (size_t f = 0; f < 2; f++) {
        const unsigned long *v = (const unsigned long *)((const char *)m + families[f].offset);
        if (put(buf, len, used, "# HELP %s %s\n# TYPE %s counter\n", families[f].name, families[f].help,
                families[f].name) < 0)
            return -1;
        size_t file;
        int line;
        const char *name;
        char label[256];
        /* rule names are letters, digits, '_', '.', '-' (rules_parse.c): nothing to escape */
        for (size_t i = 0; i < CG_METRIC_RULES && (name = cg_ruleset_rule(rs, i, &file, &line)); i++)
            if (put(buf, len, used, "%s{file=\"%s\",rule=\"%s\"} %lu\n", families[f].name,
                    file_label(cg_ruleset_file_name(rs, file), label, sizeof(label)), name, v[i]) < 0)
                return -1;
    }
    if (put(buf, len, used,
            "# HELP chatgate_rule_file_seconds Time a message spent in each rule file's rules.\n"
            "# TYPE chatgate_rule_file_seconds histogram\n") < 0)
        return -1;
    for (size_t i = 0; i < cg_ruleset_files(rs) && i < CG_METRIC_RULE_FILES; i++) {
        char name[256], label[300];
        snprintf(label, sizeof(label), "file=\"%s\"", file_label(cg_ruleset_file_name(rs, i), name, sizeof(name)));
        size_t n = cg_histogram_format(&m->rule_file_time[i], "chatgate_rule_file_seconds", label, buf + *used,
                                       len - *used);
        if (!n)
            return -1;
        *used += n;
    }
    if (put(buf, len, used,
            "# HELP chatgate_shadow_rules_total Messages the shadow rule set (--shadow-rules) decided the same as the "
            "live set, or differently.\n# TYPE chatgate_shadow_rules_total counter\n"
            "chatgate_shadow_rules_total{outcome=\"same\"} %lu\nchatgate_shadow_rules_total{outcome=\"different\"} %lu\n"
            "# HELP chatgate_shadow_rules_differences_total What differed, by field.\n"
            "# TYPE chatgate_shadow_rules_differences_total counter\n",
            m->shadow_same, m->shadow_different) < 0)
        return -1;
    for (int i = 0; i < CG_OUTCOME_FIELDS; i++)
        if (put(buf, len, used, "chatgate_shadow_rules_differences_total{field=\"%s\"} %lu\n", cg_outcome_names[i],
                m->shadow_field[i]) < 0)
            return -1;
    return 0;
}

const cg_metrics *cg_ops_metrics(const cg_server *srv, const cg_store_stats **store, long *connections)
{
    const cg_workers *w = cg_workers_shared();
    static cg_metrics sum; /* --workers: the group's figures (static: large, one thread) */
    static cg_store_stats sum_st;
    *store = &srv->turn.store->stats;
    *connections = srv->n_sessions;
    if (!w)
        return &srv->metrics;
    cg_worker_publish(srv); /* this worker's own figures, fresh */
    sum = w->retired;
    sum_st = w->retired_store;
    *connections = 0;
    for (int i = 0; i < w->n; i++) {
        cg_metrics_add(&sum, &w->slots[i].metrics);
        cg_store_stats_add(&sum_st, &w->slots[i].store, 1);
        *connections += w->slots[i].connections;
    }
    *store = &sum_st;
    return &sum;
}

/*
 * The gateway's and the store's single figures, one row each, in the order written. A row
 * whose name differs from the row before opens its family: "# HELP" (when help is given)
 * and "# TYPE" lines first. A value is a member of cg_metrics or cg_store_stats (by its
 * offset and C type), or one worked out when written.
 */
typedef enum { FROM_GATEWAY, FROM_STORE, FROM_WORKED_OUT } figure_source;
typedef enum { AS_ULONG, AS_LONG, AS_INT, AS_SIZE } figure_ctype;
typedef enum { WORKED_DEGRADED_SECONDS, WORKED_RULES_LOADED } worked_out;

typedef struct figure_row {
    const char *name;
    const char *labels; /* "end=\"done\"", or NULL */
    const char *type;   /* "counter" or "gauge" */
    const char *help;   /* NULL: none */
    figure_source from;
    size_t offset;      /* FROM_WORKED_OUT: a worked_out */
    figure_ctype ctype;
} figure_row;

#define GW(field) FROM_GATEWAY, offsetof(cg_metrics, field), AS_ULONG
#define ST(field, ctype) FROM_STORE, offsetof(cg_store_stats, field), ctype
#define WORKED(what) FROM_WORKED_OUT, what, AS_ULONG

static const figure_row figures[] = {
    {"chatgate_messages_total", NULL, "counter", NULL, GW(messages)},
    {"chatgate_turns_total", "end=\"done\"", "counter", NULL, GW(turns_done)},
    {"chatgate_turns_total", "end=\"error\"", "counter", NULL, GW(turns_error)},
    {"chatgate_turns_total", "end=\"cancelled\"", "counter", NULL, GW(turns_cancelled)},
    {"chatgate_turns_total", "end=\"blocked\"", "counter", NULL, GW(turns_blocked)},
    {"chatgate_frames_in_total", NULL, "counter", NULL, GW(frames_in)},
    {"chatgate_frames_out_total", NULL, "counter", NULL, GW(frames_out)},
    {"chatgate_bad_frames_total", NULL, "counter", NULL, GW(bad_frames)},
    {"chatgate_rate_limited_total", NULL, "counter", NULL, GW(rate_limited)},
    {"chatgate_refused_connections_total", NULL, "counter", NULL, GW(refused_connections)},
    {"chatgate_unauthorized_total", NULL, "counter", NULL, GW(unauthorized)},
    {"chatgate_ws_pings_total", NULL, "counter", "WebSocket pings of connections quiet for ping_interval_s.",
     GW(ws_pings)},
    {"chatgate_ws_idle_hangups_total", NULL, "counter",
     "WebSocket connections closed after idle_timeout_s with nothing received, not even a pong.",
     GW(ws_idle_hangups)},
    {"chatgate_store_degraded", NULL, "gauge", "1 while Redis is away and dialogs are served from memory.",
     ST(degraded, AS_INT)},
    {"chatgate_store_degraded_seconds_total", NULL, "counter", NULL, WORKED(WORKED_DEGRADED_SECONDS)},
    {"chatgate_store_degraded_warnings_total", NULL, "counter", NULL, GW(degraded_warnings)},
    {"chatgate_store_operations_total", "op=\"load\"", "counter", NULL, ST(loads, AS_ULONG)},
    {"chatgate_store_operations_total", "op=\"save\"", "counter", NULL, ST(saves, AS_ULONG)},
    {"chatgate_store_operations_total", "op=\"delete\"", "counter", NULL, ST(deletes, AS_ULONG)},
    {"chatgate_store_errors_total", NULL, "counter", NULL, ST(errors, AS_ULONG)},
    {"chatgate_store_memory_answers_total", NULL, "counter", NULL, ST(degraded_answers, AS_ULONG)},
    {"chatgate_store_reconnects_total", NULL, "counter", NULL, ST(reconnects, AS_ULONG)},
    {"chatgate_store_written_back_total", NULL, "counter", NULL, ST(flushed, AS_ULONG)},
    {"chatgate_store_evictions_total", "reason=\"count\"", "counter",
     "Dialogs dropped by max_dialogs (count), max_store_bytes (bytes) or max_rooms_per_user (rooms).",
     ST(evictions, AS_ULONG)},
    {"chatgate_store_evictions_total", "reason=\"bytes\"", "counter", NULL, ST(evictions_bytes, AS_ULONG)},
    {"chatgate_store_evictions_total", "reason=\"rooms\"", "counter", NULL, ST(evictions_rooms, AS_ULONG)},
    {"chatgate_store_memory_bytes", NULL, "gauge", "Dialog state held in memory (its keys and compact JSON).",
     ST(memory_bytes, AS_SIZE)},
    {"chatgate_store_dialogs_held", NULL, "gauge",
     "Dialogs held in memory: the memory store's, or a Redis store's copies of the dialogs it served.",
     ST(memory_dialogs, AS_LONG)},
    {"chatgate_store_writeback_pending", NULL, "gauge", "Dialogs (and bytes) held in memory for Redis's write-back.",
     ST(writeback_pending, AS_LONG)},
    {"chatgate_store_writeback_pending_bytes", NULL, "gauge", NULL, ST(writeback_pending_bytes, AS_LONG)},
    {"chatgate_store_writeback_dropped_total", "reason=\"bound\"", "counter",
     "Dialogs never written back: over the bound, or gone from memory.", ST(writeback_dropped_bound, AS_ULONG)},
    {"chatgate_store_writeback_dropped_total", "reason=\"gone\"", "counter", NULL,
     ST(writeback_dropped_gone, AS_ULONG)},
    {"chatgate_store_writeback_failures_total", NULL, "counter",
     "Write-backs the store failed (an error answer, the link lost); each goes again.", ST(writeback_failed, AS_ULONG)},
    {"chatgate_store_save_conflicts_total", NULL, "counter", "Saves refused: Redis held another or a newer copy.",
     ST(save_conflicts, AS_ULONG)},
    {"chatgate_store_primary_switches_total", NULL, "counter",
     "Redis failovers followed: a new Sentinel primary, or a lost cluster master's slots given to another.",
     ST(primary_switches, AS_ULONG)},
    {"chatgate_store_not_primary_total", "seen=\"readonly\"", "counter",
     "Redis Sentinel: -READONLY answers, and connects whose ROLE was not master; each time the connection is "
     "dropped to ask the Sentinels again.",
     ST(readonly_replies, AS_ULONG)},
    {"chatgate_store_not_primary_total", "seen=\"role\"", "counter", NULL, ST(replica_refused, AS_ULONG)},
    {"chatgate_store_lease_waits_total", NULL, "counter",
     "Turns that found their dialog's lease held by another gateway and waited for it.", ST(lease_waits, AS_ULONG)},
    {"chatgate_store_lease_wakes_total", NULL, "counter",
     "Waiting turns woken at once when the gateway holding their dialog's lease let it go (the bus).",
     ST(lease_wakes, AS_ULONG)},
    {"chatgate_store_lease_lost_total", NULL, "counter",
     "Turns whose save found their dialog's lease passed to another gateway (this one was away past "
     "redis.lease_ms); merged with that gateway's copy.",
     ST(lease_lost, AS_ULONG)},
    {"chatgate_store_remote_cancels_total", NULL, "counter",
     "Turns stopped because another gateway asked (a cancel phrase or context.clear that arrived there).",
     ST(remote_cancels, AS_ULONG)},
    {"chatgate_store_loads_cached_total", NULL, "counter",
     "Redis loads that Redis answered \"unchanged\": the dialog was read from this gateway's copy.",
     ST(loads_cached, AS_ULONG)},
    {"chatgate_store_loads_pipelined_total", NULL, "counter",
     "Redis loads sent behind their dialog's save still in flight (one round trip for both).",
     ST(loads_pipelined, AS_ULONG)},
    {"chatgate_store_loads_pipelined_again_total", NULL, "counter",
     "Of those, loads sent again because their answer came before the save's (NOSCRIPT, a merge).",
     ST(loads_pipelined_again, AS_ULONG)},
    {"chatgate_store_saves_appended_total", NULL, "counter", "Redis saves that sent only the history's new messages.",
     ST(saves_appended, AS_ULONG)},
    {"chatgate_store_merges_total", NULL, "counter",
     "Saves that met another copy of their dialog in Redis (two gateways served it while the store switched, or a "
     "write-back met a newer copy) and merged with it; messages: what the merges added to Redis's copy.",
     ST(merges, AS_ULONG)},
    {"chatgate_store_merged_messages_total", NULL, "counter", NULL, ST(merged_messages, AS_ULONG)},
    {"chatgate_store_cluster_redirects_total", "kind=\"moved\"", "counter",
     "Redis Cluster: answers that sent a command elsewhere (moved, ask) or asked it again later (tryagain, "
     "clusterdown), each followed.",
     ST(cluster.moved, AS_ULONG)},
    {"chatgate_store_cluster_redirects_total", "kind=\"ask\"", "counter", NULL, ST(cluster.ask, AS_ULONG)},
    {"chatgate_store_cluster_redirects_total", "kind=\"tryagain\"", "counter", NULL, ST(cluster.tryagain, AS_ULONG)},
    {"chatgate_store_cluster_redirects_total", "kind=\"clusterdown\"", "counter", NULL,
     ST(cluster.clusterdown, AS_ULONG)},
    {"chatgate_store_cluster_map_reads_total", NULL, "counter",
     "Redis Cluster: slot maps read (at each connect, and after a MOVED).", ST(cluster.map_reads, AS_ULONG)},
    {"chatgate_awaiting_resolutions_total", NULL, "counter", "Messages that resolved an awaiting state.",
     GW(awaiting_resolutions)},
    {"chatgate_cancels_total", NULL, "counter", NULL, GW(cancels)},
    {"chatgate_soft_context_hits_total", NULL, "counter", NULL, GW(soft_context_hits)},
    {"chatgate_enrichments_total", NULL, "counter", NULL, GW(enrichments)},
    {"chatgate_rules_fired_total", NULL, "counter", NULL, GW(rules_fired)},
    {"chatgate_rules_limited_total", NULL, "counter", "Rules cut off by a match limit (counted as no match).",
     GW(rules_limited)},
    {"chatgate_rules_loaded", NULL, "gauge", NULL, WORKED(WORKED_RULES_LOADED)},
    {"chatgate_rules_reloads_total", "result=\"ok\"", "counter", NULL, GW(reloads)},
    {"chatgate_rules_reloads_total", "result=\"refused\"", "counter", NULL, GW(reload_failures)},
    {"chatgate_export_records_total", NULL, "counter",
     "Turn records the export's sink (export.to) took: appended to the Redis stream or written to the file.",
     GW(export_records)},
    {"chatgate_export_dropped_total", NULL, "counter",
     "Turn records dropped: export.max_queue were held already while the sink was slow or away.",
     GW(export_dropped)},
    {"chatgate_export_queued", NULL, "gauge", "Turn records held in memory for the export's sink.",
     GW(export_queued)},
};

static const figure_row cache_figures[] = {
    {"chatgate_cache_total", "result=\"hit\"", "counter", NULL, GW(cache_hits)},
    {"chatgate_cache_total", "result=\"miss\"", "counter", NULL, GW(cache_misses)},
};

#undef GW
#undef ST
#undef WORKED

/* What the rows are read from, at one moment. */
typedef struct figure_sources {
    const cg_metrics *m;
    const cg_store_stats *st;
    double degraded_seconds;
    size_t rules_loaded;
} figure_sources;

static int put_row(const figure_row *r, const figure_row *prev, const figure_sources *src, char *buf, size_t len,
                   size_t *used)
{
    if (!prev || strcmp(prev->name, r->name) != 0) {
        if (r->help && put(buf, len, used, "# HELP %s %s\n", r->name, r->help) < 0)
            return -1;
        if (put(buf, len, used, "# TYPE %s %s\n", r->name, r->type) < 0)
            return -1;
    }
    char value[48];
    if (r->from == FROM_WORKED_OUT) {
        if (r->offset == WORKED_DEGRADED_SECONDS)
            snprintf(value, sizeof(value), "%.3f", src->degraded_seconds);
        else
            snprintf(value, sizeof(value), "%zu", src->rules_loaded);
    } else {
        const char *base = r->from == FROM_GATEWAY ? (const char *)src->m : (const char *)src->st;
        const void *at = base + r->offset;
        switch (r->ctype) {
        case AS_ULONG:
            snprintf(value, sizeof(value), "%lu", *(const unsigned long *)at);
            break;
        case AS_LONG:
            snprintf(value, sizeof(value), "%ld", *(const long *)at);
            break;
        case AS_INT:
            snprintf(value, sizeof(value), "%d", *(const int *)at);
            break;
        case AS_SIZE:
            snprintf(value, sizeof(value), "%zu", *(const size_t *)at);
            break;
        }
    }
    return r->labels ? put(buf, len, used, "%s{%s} %s\n", r->name, r->labels, value)
                     : put(buf, len, used, "%s %s\n", r->name, value);
}

static int put_rows(const figure_row *rows, size_t n, const figure_sources *src, char *buf, size_t len, size_t *used)
{
    for (size_t i = 0; i < n; i++)
        if (put_row(&rows[i], i ? &rows[i - 1] : NULL, src, buf, len, used) < 0)
            return -1;
    return 0;
}

/* The whole text into buf; its length (cut at the last piece that fit when buf is short). */
static size_t metrics_text(const cg_server *srv, char *buf, size_t len)
{
    const cg_store_stats *st;
    long connections;
    const cg_metrics *m = cg_ops_metrics(srv, &st, &connections);
    const cg_workers *w = cg_workers_shared();
    figure_sources src = {
        .m = m,
        .st = st,
        /* --workers: each worker's includes its outage going on */
        .degraded_seconds = w ? st->degraded_seconds : cg_store_degraded_seconds(st, uv_now(srv->net.loop)),
        .rules_loaded = cg_ruleset_count(srv->turn.rules),
    };
    size_t used = 0;
    if (put(buf, len, &used,
            "# HELP chatgate_connections WebSocket clients connected now%s.\n"
            "# TYPE chatgate_connections gauge\nchatgate_connections %ld\n",
            w ? " (all workers; each worker's with its worker label)" : "", connections) < 0 ||
        (w && worker_lines(w, buf, len, &used) < 0))
        return used;
    if (put(buf, len, &used,
            "# HELP chatgate_build_info The running version (always 1).\n# TYPE chatgate_build_info gauge\n"
            "chatgate_build_info{version=\"%s\"} 1\n",
            CG_VERSION) < 0 ||
        put_rows(figures, sizeof(figures) / sizeof(figures[0]), &src, buf, len, &used) < 0 ||
        per_upstream(srv, m, buf, len, &used) < 0 || token_lines(srv, m, buf, len, &used) < 0 ||
        limited_lines(m, buf, len, &used) < 0 || rule_lines(srv, m, buf, len, &used) < 0)
        return used;
    if (put(buf, len, &used,
            "# HELP chatgate_errors_total Error frames sent, by code.\n# TYPE chatgate_errors_total counter\n") < 0)
        return used;
    for (int code = CG__ERR_FIRST + 1; code < CG__ERR_END; code++) {
        if (put(buf, len, &used, "chatgate_errors_total{code=\"%s\"} %lu\n", cg_err_code(code),
                m->errors[code - CG__ERR_FIRST - 1]) < 0)
            return used;
    }
    if (put_rows(cache_figures, sizeof(cache_figures) / sizeof(cache_figures[0]), &src, buf, len, &used) < 0 ||
        put(buf, len, &used,
            "# HELP chatgate_stage_seconds Latency per stage: store load, rules (the pipeline), first "
            "token (upstream start to first delta), turn (arrival to the terminal frame).\n"
            "# TYPE chatgate_stage_seconds histogram\n") < 0)
        return used;
    static const struct { const char *label; size_t offset; } stages[] = {
        {"stage=\"store_load\"", offsetof(cg_metrics, store_load)},
        {"stage=\"rules\"", offsetof(cg_metrics, rules)},
        {"stage=\"first_token\"", offsetof(cg_metrics, first_token)},
        {"stage=\"turn\"", offsetof(cg_metrics, turn)},
    };
    for (size_t i = 0; i < sizeof(stages) / sizeof(stages[0]); i++)
        used += cg_histogram_format((const cg_histogram *)((const char *)m + stages[i].offset),
                                    "chatgate_stage_seconds", stages[i].label, buf + used, len - used);
    return used;
}

static int respond(struct lws *wsi, int status, const char *type, const char *body, size_t len)
{
    unsigned char buf[LWS_PRE + 1024];
    unsigned char *start = buf + LWS_PRE, *p = start, *end = buf + sizeof(buf);
    if (lws_add_http_common_headers(wsi, (unsigned int)status, type, (lws_filepos_t)len, &p, end) ||
        lws_add_http_header_by_token(wsi, WSI_TOKEN_HTTP_CACHE_CONTROL, (const unsigned char *)"no-store", 8, &p,
                                     end) ||
        lws_finalize_write_http_header(wsi, start, &p, end))
        return -1;
    if (lws_write(wsi, (unsigned char *)body, len, LWS_WRITE_HTTP_FINAL) < (int)len)
        return -1;
    return lws_http_transaction_completed(wsi) ? -1 : 0;
}

int cg_ops_callback(struct lws *wsi, enum lws_callback_reasons reason, void *user, void *in, size_t len)
{
    if (reason != LWS_CALLBACK_HTTP)
        return lws_callback_http_dummy(wsi, reason, user, in, len);
    cg_server *srv = cg_server_of(wsi);
    char uri[64];
    static char body[LWS_PRE + (1 << 20)]; /* per worker, per upstream, per rule: bounded by the config */
    char *text = body + LWS_PRE;
    size_t cap = sizeof(body) - LWS_PRE;
    lws_hdr_copy(wsi, uri, sizeof(uri), WSI_TOKEN_GET_URI);
    if (strcmp(uri, "/metrics") == 0) {
        size_t n = metrics_text(srv, text, cap);
        static int warned;
        if (n + 8192 > cap && !warned) { /* its families are bounded by the config: one that grew past it */
            warned = 1;
            cg_warn("/metrics: the text reached %zu of its %zu bytes: the last families may be cut off", n, cap);
        }
        return respond(wsi, 200, "text/plain; version=0.0.4", text, n);
    }
    if (strcmp(uri, "/healthz") == 0) {
        if (srv->turn.stopping) {
            int n = snprintf(text, cap, "{\"status\":\"stopping\"}\n");
            return respond(wsi, 503, "application/json", text, (size_t)n);
        }
        int degraded = srv->turn.store->stats.degraded;
        const cg_workers *w = cg_workers_shared();
        if (w) {
            /* the group: degraded when any worker's store is; how many workers run */
            int up = 0;
            for (int i = 0; i < w->n; i++) {
                up += w->slots[i].listening;
                degraded |= w->slots[i].listening && w->slots[i].store.degraded;
            }
            int n = snprintf(text, cap, "{\"status\":\"%s\",%s\"workers\":%d,\"workers_up\":%d}\n",
                             degraded ? "degraded" : "ok",
                             degraded ? "\"store\":\"redis unreachable: serving from memory\"," : "", w->n, up);
            return respond(wsi, 200, "application/json", text, (size_t)n);
        }
        int n = snprintf(text, cap, degraded ? "{\"status\":\"degraded\",\"store\":\"redis unreachable: serving from memory\"}\n"
                                             : "{\"status\":\"ok\"}\n");
        return respond(wsi, 200, "application/json", text, (size_t)n);
    }
    int n = snprintf(text, cap, "not found\n");
    return respond(wsi, 404, "text/plain", text, (size_t)n);
}
