/*
 * turn.h: one client message's whole life, written once for every way in (chatgate.v1
 * sessions and drop-in clients alike).
 *
 * A connection owns a cg_turns: its rate bucket, its bounded queue of requests and the one
 * in flight. A request (a chat message, or a context command) passes the arrival checks
 * (rate, queue bound, shutdown), waits its turn in the queue, takes its dialog's lock
 * (store/lock.h), loads the dialog, runs the pipeline, and then either calls an upstream
 * (cg_upstream, for chatgate.v1) or is handed to the adapter to forward over its own
 * connection (drop-in: the app). The reply streams back through the adapter; the turn keeps
 * its text (max_reply_bytes), applies a state directive, records the history, saves the
 * dialog, lets go of the lock, counts the turn in the metrics and starts the next request.
 *
 * The rules, once for all:
 *   - one request of a connection at a time, in arrival order; one turn of a dialog at a
 *     time across connections (the lock, waiters in arrival order);
 *   - a message a cancel rule matches stops the reply in flight of its room at once;
 *   - a chat message ends in exactly one terminal event: done, cancelled or error (for a
 *     forwarded turn, the app's own end; the adapter is told nothing more);
 *   - the user's message always joins the history; the reply joins it when done, or when
 *     cancelled or ended with some text (marked "cancelled" when cancelled);
 *   - a message refused on its way is never sent on: no upstream call. One refused by a
 *     user's limits, its dialog's load or the params cap hands an adapter that forwards
 *     itself (drop-in) its opaque back through unsent, to drop, never to send as it came;
 *     one refused on arrival (rate, queue bound, shutdown, an id in use: cg_turns_submit's
 *     error) leaves it the adapter's.
 *
 * Ownership: the adapter embeds cg_turns in its connection struct and calls cg_turns_close()
 * when the connection goes; the turns and their requests are the turn module's. Sink calls
 * may come from inside the adapter's own calls (a refusal's error from cg_turns_submit, the
 * cancelled or stop_forward of a reply a cancel phrase stops, the unsent of a request
 * dropped by cg_turns_close), so an adapter must not hold pointers into what they free.
 */
#ifndef CHATGATE_SERVER_TURN_H
#define CHATGATE_SERVER_TURN_H

#include <jansson.h>
#include <stdint.h>
#include <uv.h>

#include "chatgate/config/config.h"
#include "chatgate/core/metrics.h"
#include "chatgate/core/rate.h"
#include "chatgate/dialog/rules.h"
#include "chatgate/proto/protocol.h"
#include "chatgate/store/lock.h"
#include "chatgate/store/store.h"
#include "chatgate/upstream/upstream.h"

/*
 * What a turn needs, and nothing else: the narrow context every turn gets from the gateway
 * (which owns what the pointers point at). rules is the running set: a reload swaps it, and
 * each request keeps a reference to the set it started with.
 */
typedef struct cg_turn_env {
    const cg_config *cfg;
    uv_loop_t *loop;
    cg_store *store;
    cg_ruleset *rules;
    cg_ruleset *shadow;  /* --shadow-rules: evaluated beside rules on a copy of the state, never acting; or NULL */
    cg_upstream *upstreams;
    int n_upstreams;
    cg_metrics *metrics;
    json_t *locks;       /* dialog key -> lock (store/lock.h) */
    long inflight;       /* chat turns between their start and their end: a drain waits for them */
    int stopping;        /* draining: new requests are refused */
    /* the token counters' service slots (metrics.h): "none", the config's services, "other";
     * set once by cg_turn_env_services */
    const char *services[CG_METRIC_SERVICES];
    int n_services;      /* slots named from the config: 1 (none) + its services, up to the last but one */
    uint64_t limit_seq;  /* numbers the turns counted against limits per user (store.h, limit) */
    struct cg_exporter *exporter; /* each finished chat turn's record goes to it (export.h); NULL: none */
} cg_turn_env;

/* Names env's service slots from the config's "services" (at start; borrowed from cfg). */
void cg_turn_env_services(cg_turn_env *env);

typedef enum {
    CG_TURN_CHAT,
    CG_TURN_CONTEXT_GET,
    CG_TURN_CONTEXT_FORGET,
    CG_TURN_CONTEXT_CLEAR,
    CG_TURN_PROFILE_GET,    /* the user's profile, no dialog */
    CG_TURN_PROFILE_FORGET, /* names of it (keys), or all of it (keys NULL) */
} cg_turn_kind;

typedef struct cg_turn cg_turn;

/* One request as the adapter read it; cg_turns_submit() takes the strings and keys. */
typedef struct cg_turn_request {
    cg_turn_kind kind;
    char *id;     /* malloc'd; "" when the message had none (drop-in) */
    char *room;   /* malloc'd */
    char *text;   /* malloc'd; chat only */
    json_t *keys; /* context.forget: the keys to forget */
    int unique_id; /* chatgate.v1: refused (bad_frame) while a message with this id waits or runs */
    void *opaque; /* the adapter's, handed back in cg_turn_forward (drop-in: the frame's slot) */
} cg_turn_request;

/* What a forwarding adapter gets once the pipeline ran (all borrowed for the call). */
typedef struct cg_turn_forward {
    const char *id, *user, *room, *text;
    const char *service;  /* the active service, or NULL */
    json_t *params;       /* merged with the service's defaults */
    json_t *awaiting;     /* as it was before this message, or NULL */
    json_t *soft;
    json_t *tool_result; /* the last tool result (within tool_result_cap), or NULL */
    json_t *profile;     /* the user's profile (name -> value), or NULL */
    json_t *resolution;
    const char *enriched;
    json_t *rules, *annotations;
    void *opaque;
} cg_turn_forward;

/* How the adapter's protocol says what happens; NULL members are not said (drop-in). */
typedef struct cg_turn_sink {
    void (*ack)(void *conn, const cg_ack *ack);
    /* seq: the reply's bytes relayed so far, this text's included (a resume's "after") */
    void (*delta)(void *conn, const char *id, const char *text, size_t len, uint64_t seq);
    void (*done)(void *conn, const char *id, const char *reply, size_t len, json_t *usage, int truncated,
                 const cg_answer *who);
    void (*cancelled)(void *conn, const char *id);
    /* err is a CG_E_* code; detail (borrowed, may be NULL) is what an upstream said. Also a
     * request refused on arrival (rate, queue bound, shutdown): the adapter says it as it can. */
    void (*error)(void *conn, const char *id, int err, const char *message, json_t *detail);
    void (*warning)(void *conn, const char *id, const char *code, const char *message);
    void (*context)(void *conn, const char *room, json_t *state);
    void (*profile)(void *conn, json_t *profile); /* profile.get, profile.forget's answer */
    /* Set by adapters that forward the message over their own connection instead of an
     * upstream call: the message, pipeline run; 0, or -1 to end the turn with an error. The
     * reply then comes through cg_turn_reply() and ends with cg_turn_end(). */
    int (*forward)(void *conn, cg_turn *t, const cg_turn_forward *f);
    /* The user cancelled a forwarded reply: tell the app (client_said: the client's own
     * cancel frame is already on its way to it). The turn goes on until cg_turn_end(). */
    void (*stop_forward)(void *conn, cg_turn *t, int client_said);
    /* A forwarding adapter's request that ends before it was forwarded (refused by a limit,
     * its load or the params cap; cancelled; the connection went): its opaque goes back, and
     * the message must never reach the app. The opaque of an accepted request comes back
     * exactly once, through forward or unsent. */
    void (*unsent)(void *conn, void *opaque);
} cg_turn_sink;

/* A forwarding adapter's (drop-in's) turns: how a forwarded reply ends besides the app's
 * own end marker. */
typedef struct cg_turn_forwarding {
    int supersede;             /* the next chat message ends a forwarded turn in flight */
    uint64_t reply_timeout_ms; /* a forwarded turn whose app says nothing this long ends */
    uint64_t reply_gap_ms;     /* 0, or: a reply that has begun ends after this much silence */
} cg_turn_forwarding;

/* Where a connection's messages go after the pipeline (turn.c): an upstream call, or the
 * adapter's own connection. Chosen once, by cg_turns_init. */
typedef struct cg_turn_backend cg_turn_backend;

/* A connection's turns; embedded in the adapter's connection struct. */
typedef struct cg_turns {
    cg_turn_env *env;
    const cg_turn_sink *sink;
    void *conn;
    const char *user;  /* the connection's user (the adapter's buffer) */
    const char *name;  /* for the log: the session id */
    cg_rate rate;
    const cg_limits *limits; /* the user's plan (limits_config.h; the config's), or NULL: none */
    cg_turn *inflight, *head, *tail;
    long queued;
    int paused;        /* the client reads slowly: the upstream call is paused */
    const cg_turn_backend *backend; /* upstream calls, or forwarding (cg_turns_init) */
    cg_turn_forwarding fw;          /* forwarding's settings; zero for upstream calls */
    /* the backend's timer for the turn in flight (upstream calls: a blocked reply's end from
     * the loop; forwarding: the reply's silence bound); malloc'd at its first use, freed
     * when closed */
    uv_timer_t *timer;
    uint64_t timer_ms;    /* what it was last armed with */
    uint64_t quiet_until; /* forwarding: loop time the silence bound ends, later than the
                           * timer after a frame came, which moves this alone (forward_arm) */
    void *up_conns[CG_MAX_UPSTREAMS]; /* per-connection upstream connections (ws kind) */
} cg_turns;

/* fw: NULL for an adapter whose messages go to upstreams; a forwarding adapter's settings
 * (its sink then has forward, stop_forward and unsent). */
void cg_turns_init(cg_turns *q, cg_turn_env *env, const cg_turn_sink *sink, const cg_turn_forwarding *fw,
                   void *conn, const char *user, const char *name);
/* Holds the connection's chat messages to the limits of its user's plan (limits_config.h):
 * the one the config's limits.users gives the user, else plan (its token's; "" or NULL:
 * the default plan). Each message is counted in the store before its dialog is loaded and
 * refused with rate_limited and retry_after_ms when over. */
void cg_turns_set_plan(cg_turns *q, const char *plan);

/*
 * A request arrives: the arrival checks (rate, queue bound, shutdown, and with unique_id an
 * id still in use), a cancel phrase's effect on the reply in flight, then the queue. 0 when
 * accepted; else the CG_E_* code it was refused with (sink->error told, the metrics
 * counted). Takes r's strings either way; r->opaque stays the caller's when refused.
 */
int cg_turns_submit(cg_turns *q, cg_turn_request *r);

/* The rate and the queue bound alone, for a frame that is charged to the rate limit but is no
 * request (drop-in: a frame marked as chat that is not one): 0, or the CG_E_* code it was
 * refused with (said and counted). */
int cg_turns_admit(cg_turns *q, const char *id);
/* The rate alone (rate_limit): 0, or CG_E_RATE_LIMITED, said and counted. For a frame that
 * costs the gateway work but queues nothing (chatgate.v1's resume: Redis reads, a parked
 * reply's slot). */
int cg_turns_rate(cg_turns *q, const char *id);

/* The client's cancel of message id: the reply in flight (cancelled), or a message still
 * waiting (cancelled, never run); -1 when no chat message has this id. */
int cg_turns_cancel(cg_turns *q, const char *id);
/* The client's own cancel frame (drop-in): the reply in flight, when its id is id ("": any). */
void cg_turns_cancel_current(cg_turns *q, const char *id);

/* Stops the chat turn of the dialog (key: cg_store_dialog_key) that runs in this process,
 * if any: another gateway asked (the store's on_cancel). */
void cg_turns_cancel_dialog(cg_turn_env *env, const char *key);

/* The client reads slowly (1) or caught up (0): the upstream call in flight pauses. */
void cg_turns_pause(cg_turns *q, int paused);

/* The connection is gone: the request in flight stops (a chat turn is saved as cancelled),
 * the waiting ones are dropped, the per-connection upstream connections closed. */
void cg_turns_close(cg_turns *q);

/* The chat turn in flight on an upstream, still running: its id, room, the reply the client
 * got so far (up to max_reply_bytes; borrowed) and its seq (bytes relayed). -1: none. */
int cg_turns_reply(const cg_turns *q, const char **id, const char **room, const char **text, size_t *len,
                   uint64_t *seq);
/* The connection is gone but its reply in flight goes on (server/resume.h): the waiting
 * requests are dropped, the turn in flight reports to sink and conn from now on, for user
 * and name (which must outlive q), unpaused. */
void cg_turns_hand_over(cg_turns *q, const cg_turn_sink *sink, void *conn, const char *user, const char *name);

/* A forwarded turn in flight (drop-in), or NULL. */
cg_turn *cg_turns_forwarded(cg_turns *q);
/* The id of t's message ("" when it had none). */
const char *cg_turn_id(const cg_turn *t);

/* Forwarded turns: text of the reply (kept for the history; the app's frame itself is the
 * adapter's to relay); a state directive from source ("app", an upstream's name), refused
 * with a warning when it does not fit; the reply's end (cancelled: the app said so). */
void cg_turn_reply(cg_turn *t, const char *text, size_t len);
void cg_turn_state(cg_turn *t, json_t *state, const char *source);
void cg_turn_end(cg_turn *t, int cancelled);

/* Counts an error said to a client, by code (chatgate_errors_total, and the bad-frame and
 * rate-limit counters). */
void cg_turn_count_error(cg_metrics *m, int err);

#endif
