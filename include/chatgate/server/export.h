/*
 * export.h: the turn export (issue 38): one record a finished chat turn, done, cancelled or
 * failed, to a Redis Stream in the store's Redis (export.to redis) or to a file of JSON
 * lines (export.to file); docs/operations.md, "The turn export", says what a record holds.
 *
 * What must always hold: a turn never waits for the export. A record is made where the turn
 * ends (turn.c fills a cg_export_record) and queued; the sink is handed it at once when it
 * has room (an XADD through the store's link, a write through libuv's thread pool), and
 * its answer comes later. The queue is bounded (export.max_queue, records queued and on
 * their way together): while the sink is slow or away, a record past the bound is dropped
 * and counted (chatgate_export_dropped_total), and what is held goes once the sink is back. A record the sink failed on its way is queued
 * again at the front: Redis may have taken it before the failure, so a consumer may see a
 * record twice (gateway and seq name it).
 *
 * Ownership: the gateway owns the exporter (cg_export_open, cg_export_close); the record is
 * the caller's, borrowed for the call.
 */
#ifndef CHATGATE_SERVER_EXPORT_H
#define CHATGATE_SERVER_EXPORT_H

#include <jansson.h>
#include <stddef.h>
#include <uv.h>

#include "chatgate/config/config.h"
#include "chatgate/core/metrics.h"
#include "chatgate/store/store.h"

typedef struct cg_exporter cg_exporter;

/* One finished turn, as turn.c saw it end (all borrowed; NULL where there is nothing). */
typedef struct cg_export_record {
    const char *id, *user, *room;
    const char *service;         /* the dialog's after the turn */
    json_t *params;              /* after the turn, merged with the service's defaults */
    json_t *rules;               /* the rules that fired (the ack's "rules") */
    json_t *reply_rules;         /* what rules on replies did (the done frame's), or NULL */
    const char *route;           /* the upstream the pipeline chose (the ack's "route"); NULL: none called */
    const char *upstream;        /* the one that answered or failed last (a fallback's) */
    const char *fallback_from;   /* the upstream that failed before, or NULL */
    int replica, attempts;       /* of the upstream that answered; -1 and 0 when not said */
    const char *end;             /* "done", "cancelled", "error", "ended" (drop-in: the app's end) */
    const char *code;            /* end "error": the error frame's code; else NULL */
    int absorbed;                /* done without an upstream call (a rule's `cancel absorb`) */
    int truncated;               /* the reply was cut at max_reply_bytes */
    int has_usage;               /* the turn spent tokens: tokens_in, tokens_out */
    long long tokens_in, tokens_out;
    int tokens_reported;         /* as the upstream reported them (else estimated) */
    double first_byte_ms;        /* from the upstream call to its first text; < 0: none came */
    double total_ms;             /* from the message's arrival to the turn's end */
    const char *text;            /* the user's message */
    const char *reply;           /* the reply as the client got it (reply_len bytes) */
    size_t reply_len;
} cg_export_record;

/* Starts the export cfg asks for (export.*): *out NULL when it asks none. 0, or -1 with err
 * naming the key and the file (export.path cannot be opened for appending). store: the
 * gateway's (export.to redis appends through its stream table); metrics: where the counts go. */
int cg_export_open(cg_exporter **out, uv_loop_t *loop, const cg_config *cfg, cg_store *store, cg_metrics *metrics,
                   char *err, size_t errlen);

/* Queues r's record (made and masked now); never waits. ex may be NULL: no export. */
void cg_export_turn(cg_exporter *ex, const cg_export_record *r);

/* SIGHUP: the file is closed and opened again at export.path (the operator moved it:
 * logrotate). Nothing for a stream. */
void cg_export_reopen(cg_exporter *ex);

/* The gateway stops: what is queued goes to the sink once more (the store must still be
 * open: close the exporter first), and the exporter frees itself once its last write or
 * XADD answered. What the sink does not take is dropped. ex may be NULL. */
void cg_export_close(cg_exporter *ex);

/* What forgetting a user (DELETE /admin/users/{user}) cannot take back from the export cfg
 * configures, as a sentence for the admin's answer; NULL when there is no export. */
const char *cg_export_kept_after_forget(const cg_config *cfg);

#endif
