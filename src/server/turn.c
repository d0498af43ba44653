/*
 * turn.c: one client message's whole life, for every way in (see turn.h).
 *
 * A request's stage is its state (turn_state), entered through turn_enter(), which checks
 * the transition against one table:
 *
 *   QUEUED -> LIMITING (a chat message of a user with limits) -> LOCKING (another connection
 *   holds the dialog) -> LOADING -> the pipeline, then, by the connection's backend:
 *     upstream calls:  CALLING -> STREAMING (the first text) [-> BLOCKED (a stop rule)]
 *     forwarding:      FORWARDED (the adapter's app answers; cg_turn_end)
 *   -> ENDED. A context command ends once loaded. Any stage may end early (a refusal, a
 *   cancel, the connection gone): stopping asks the state what is under way.
 *
 * Each stage hands on to the next from a callback of the one before (the lock's granted,
 * the store's loaded, the upstream's events), so nothing waits on the loop. Every way out of
 * a request goes through turn_finish(), which frees it and starts the next: that is what
 * makes "one at a time, in order, exactly one end" hold.
 *
 * What differs between an adapter whose messages go to an upstream (chatgate.v1) and one
 * that forwards them over its own connection (drop-in) is a backend (turn_backend), chosen
 * once in cg_turns_init: where the message goes after the pipeline, what a cancel does, and
 * the connection's timer (a blocked reply's end from the loop; a forwarded reply's silence
 * bound).
 */
#define _GNU_SOURCE /* asprintf */
#include <assert.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "chatgate/core/alloc.h"
#include "chatgate/core/buf.h"
#include "chatgate/core/error.h"
#include "chatgate/core/jsonout.h"
#include "chatgate/core/log.h"
#include "chatgate/core/num.h"
#include "chatgate/core/utf8.h"
#include "chatgate/dialog/dialog.h"
#include "chatgate/dialog/pipeline.h"
#include "chatgate/server/export.h"
#include "chatgate/store/profiles.h"
#include "chatgate/server/turn.h"

/* A request's stage (the header comment draws the transitions; turn_enter checks them). */
typedef enum {
    TURN_QUEUED,    /* in its connection's queue */
    TURN_LIMITING,  /* the store counts it against its user's limits (limit) */
    TURN_LOCKING,   /* waiting for its dialog's lock, held by another connection's turn */
    TURN_LOADING,   /* the store loads its dialog (load), and takes its lease */
    TURN_CALLING,   /* an upstream call in flight (call), no text yet: it may fall back */
    TURN_STREAMING, /* the call's text is coming */
    TURN_BLOCKED,   /* a stop rule matched the reply: it ends from the loop, blocked */
    TURN_FORWARDED, /* handed to the adapter (drop-in): it ends by cg_turn_end */
    TURN_ENDED,     /* said and saved, or dropped: freed now */
    TURN_STATES
} turn_state;

struct cg_turn {
    cg_turn *next;
    cg_turns *q;
    turn_state state;          /* turn_enter() alone changes it */
    cg_turn_kind kind;
    char *id, *room, *text;
    json_t *keys;              /* context.forget */
    void *opaque;              /* the adapter's (drop-in: the frame's slot) */
    cg_ruleset *rules;         /* the set this request started with (a reference) */
    cg_dialog_lock_waiter lock; /* its dialog's lock, held from load to end */
    int64_t arrived;           /* unix seconds, for the history */
    uint64_t t_arrived, t_load, t_upstream; /* uv_hrtime() of arrival, load, upstream start */
    int got_first;             /* the first text came (first-token latency; a forwarded reply's too) */
    int counted;               /* in env->inflight */
    char *enriched;            /* the pipeline's rewrite, kept for the history */
    cg_store_req *load;        /* while the dialog loads */
    cg_store_req *profile_load; /* while the user's profile loads (beside the dialog) */
    json_t *profile;           /* the user's profile, once loaded (a chat turn's) */
    json_t *from_profile;      /* names of the params it gave (turn_params), for the ack */
    int loaded;                /* the dialog came; the turn goes on once the profile has too */
    cg_store_req *limit;       /* while the store counts it against its user's limits */
    int limit_held;            /* counted (a turn at once, its tokens to come): limit_end at its end */
    int limit_local;           /* ... in this process's memory (store.h, limit_end) */
    uint64_t limit_turn;       /* its number there */
    int refused;               /* over a limit: never started, so not a turn in the figures */
    cg_dialog dialog;          /* once loaded */
    int has_dialog;            /* dialog is this turn's to free (and its lease to let go) */
    int saved;                 /* a save or remove ended its lease (store.h) */
    int route;                 /* the upstream's index */
    int first_route;           /* -1, or the upstream that failed when route is its fallback */
    cg_upstream_call *call;    /* while an upstream call is in flight */
    /* what the pipeline gave the upstream call, kept for a fallback's call (references) */
    json_t *awaiting_before, *resolution, *annotations, *fired;
    int cancel_requested;      /* a forwarded reply the user cancelled */
    long long tokens_in, tokens_out; /* as the upstream reported them; -1: it did not */
    long long spent;           /* tokens counted for the turn (count_usage), 0 before */
    size_t prompt_bytes;       /* what went to the upstream: text, history, state (estimates) */
    cg_reply_filter *filter;   /* the set's reply rules on this reply (rules.h), or NULL: none */
    char *reply;               /* the reply as the client got it, up to max_reply_bytes */
    size_t reply_len, reply_cap;
    int truncated;
    uint64_t sent;             /* bytes of reply text relayed: the seq of the last delta */
    /* for the export's record (export.h): the error it ended with (turn_fail), who answered
     * (on_upstream_done: attempts 0 when nobody did) and when its first text came */
    int end_err;
    int replica, attempts;
    uint64_t t_first;
    /* the debug trace (turn_trace): what the load found, and the rule and param names */
    const char *store_found;
    uint64_t t_loaded;
    char *trace;
};

/* The most tokens one turn is counted for, whatever its upstream reports (a billion: no
 * model's turn comes near), so that sums of turns stay far from overflowing. */
#define CG_MAX_TURN_TOKENS 1000000000LL

/* How a chat turn ended: what joins the history and which counter moves. */
typedef enum { END_DONE, END_ERROR, END_CANCELLED, END_ABSORBED, END_ENDED } turn_end_kind;

static void turns_pump(cg_turns *q);

/* A message's id for the log: drop-in messages may have none. */
static const char *id_of(const cg_turn *t)
{
    return t->id[0] ? t->id : "(no id)";
}

/* ---- the states ----------------------------------------------------------------------- */

#define S(x) (1u << (x))
/* Where each state may go. A fallback starts another call in CALLING; every state may end. */
static const unsigned turn_next[TURN_STATES] = {
    [TURN_QUEUED] = S(TURN_LIMITING) | S(TURN_LOCKING) | S(TURN_LOADING) | S(TURN_ENDED),
    [TURN_LIMITING] = S(TURN_LOCKING) | S(TURN_LOADING) | S(TURN_ENDED),
    [TURN_LOCKING] = S(TURN_LOADING) | S(TURN_ENDED),
    [TURN_LOADING] = S(TURN_CALLING) | S(TURN_FORWARDED) | S(TURN_ENDED),
    [TURN_CALLING] = S(TURN_CALLING) | S(TURN_STREAMING) | S(TURN_BLOCKED) | S(TURN_ENDED),
    [TURN_STREAMING] = S(TURN_BLOCKED) | S(TURN_ENDED),
    [TURN_BLOCKED] = S(TURN_ENDED),
    [TURN_FORWARDED] = S(TURN_ENDED),
    [TURN_ENDED] = 0,
};
#undef S

static const char *const turn_state_names[TURN_STATES] = {
    "queued", "limiting", "locking", "loading", "calling", "streaming", "blocked", "forwarded", "ended",
};

/* Moves t to state `to`. A move the table does not allow is a bug of this file: logged with
 * both states, and fatal in a debug build (the tests run one). */
static void turn_enter(cg_turn *t, turn_state to)
{
    if (!(turn_next[t->state] & (1u << to))) {
        cg_error("turn: message %s: %s -> %s is not a transition", t->id[0] ? t->id : "(no id)",
                 turn_state_names[t->state], turn_state_names[to]);
        assert(!"a turn's state moved where it may not");
    }
    t->state = to;
}

/* Before its dialog is loaded: nothing of it under way but the store's answer or the lock. */
static int turn_waiting(const cg_turn *t)
{
    return t->state == TURN_LIMITING || t->state == TURN_LOCKING || t->state == TURN_LOADING;
}

/* ---- the backends: what differs between an adapter of upstream calls and a forwarding one */

struct cg_turn_backend {
    /* The pipeline ran (res): the message goes on, with its merged params and the awaiting
     * state as it was before it. */
    void (*go)(cg_turn *t, const cg_pipeline_result *res, json_t *params, json_t *awaiting_before);
    /* A cancel of the chat turn in flight (client_said: the client's own cancel frame). */
    void (*cancel)(cg_turn *t, int client_said);
    /* A chat message arrived (before it is queued). NULL: nothing to do. */
    void (*arrived)(cg_turns *q);
    /* The connection's timer fired; t is the request in flight, or NULL. */
    void (*timer)(cg_turns *q, cg_turn *t);
};

static const cg_turn_backend upstream_backend, forward_backend;

static int64_t turn_now(const cg_turns *q)
{
    return q->env->store->now(q->env->store->clock_ctx);
}

void cg_turn_count_error(cg_metrics *m, int err)
{
    int slot = err - CG__ERR_FIRST - 1;
    if (slot >= 0 && slot < CG_ERR_COUNT)
        m->errors[slot]++;
    if (err == CG_E_BAD_FRAME || err == CG_E_TOO_LARGE)
        m->bad_frames++;
    else if (err == CG_E_RATE_LIMITED)
        m->rate_limited++;
}

static void say_error(cg_turns *q, const char *id, int err, const char *message, json_t *detail)
{
    cg_turn_count_error(q->env->metrics, err);
    if (q->sink->error)
        q->sink->error(q->conn, id, err, message, detail);
}

/* Counts what the pipeline decided for one message. */
static void count_pipeline(cg_metrics *mt, const cg_pipeline_result *res)
{
    const char *type = json_string_value(json_object_get(res->resolution, "type"));
    if (type && strcmp(type, "cancel") != 0)
        mt->awaiting_resolutions++;
    if (res->cancel)
        mt->cancels++;
    if (res->soft_context_hit)
        mt->soft_context_hits++;
    if (res->enriched)
        mt->enrichments++;
    mt->rules_fired += json_array_size(res->rules);
    mt->rules_limited += json_array_size(res->limited);
}

/* ---- a request's end ------------------------------------------------------------------ */

static void turn_free(cg_turn *t)
{
    cg_turns *q = t->q;
    if (t->counted)
        q->env->inflight--;
    if (t->opaque && q->sink->unsent) /* never forwarded: forwarding hands it over */
        q->sink->unsent(q->conn, t->opaque);
    if (t->limit_held) {
        q->env->store->ops->limits->end(q->env->store, q->user, q->limits, t->limit_turn, t->limit_local, t->spent);
    }
    if (t->has_dialog && !t->saved && q->env->store->ops->lease->release) /* a turn that saved nothing */
        q->env->store->ops->lease->release(q->env->store, q->user, t->room);
    cg_dialog_lock_release(q->env->locks, &t->lock);
    cg_ruleset_unref(t->rules);
    if (t->has_dialog)
        cg_dialog_free(&t->dialog);
    cg_store_abandon(t->profile_load);
    json_decref(t->profile);
    json_decref(t->from_profile);
    json_decref(t->keys);
    json_decref(t->awaiting_before);
    json_decref(t->resolution);
    json_decref(t->annotations);
    json_decref(t->fired);
    free(t->id);
    free(t->room);
    free(t->text);
    free(t->enriched);
    free(t->reply);
    free(t->trace);
    cg_reply_filter_free(t->filter);
    free(t);
}

/* The request in flight ended (its end is said): free it and start the next one. */
static void turn_finish(cg_turn *t)
{
    cg_turns *q = t->q;
    turn_enter(t, TURN_ENDED);
    if (q->inflight == t)
        q->inflight = NULL;
    if (q->timer)
        uv_timer_stop(q->timer);
    if (t->kind == CG_TURN_CHAT && !t->refused)
        cg_histogram_observe(&q->env->metrics->turn, (double)(uv_hrtime() - t->t_arrived) / 1e9);
    turn_free(t);
    turns_pump(q);
}

/*
 * Records the turn in the dialog and saves it (turn.h has the rules). The save needs no
 * answer: the store orders it before any later load of the same dialog.
 */
void cg_turn_env_services(cg_turn_env *env)
{
    const char *name;
    json_t *v;
    env->services[0] = "none";
    env->n_services = 1;
    json_object_foreach(env->cfg->services, name, v) {
        if (env->n_services == CG_METRIC_SERVICES - 1)
            break;
        env->services[env->n_services++] = name;
    }
    env->services[CG_METRIC_SERVICES - 1] = "other";
}

/* The slot of service among the token counters' (metrics.h, CG_METRIC_SERVICES). */
static int service_slot(const cg_turn_env *env, const char *service)
{
    for (int i = 1; service && i < env->n_services; i++)
        if (strcmp(env->services[i], service) == 0)
            return i;
    return service ? CG_METRIC_SERVICES - 1 : 0;
}

/*
 * The tokens of a turn that reached an upstream (count_usage, the export's record): as the
 * upstream reported them, else estimated at four bytes a token (the prompt from what was
 * sent; the reply from what streamed, so a cancelled reply counts what the user saw). 0: a
 * turn the upstream never answered spends nothing.
 */
static int turn_tokens(const cg_turn *t, turn_end_kind end, long long *in, long long *out)
{
    /* a reply stopped by a rule before any text went on still cost its prompt */
    if (!t->t_upstream || t->state == TURN_FORWARDED || end == END_ABSORBED ||
        (t->tokens_in < 0 && !t->reply_len && t->state != TURN_BLOCKED))
        return 0;
    *in = t->tokens_in >= 0 ? t->tokens_in : (long long)(t->prompt_bytes + 3) / 4;
    *out = t->tokens_out >= 0 ? t->tokens_out : (long long)(t->reply_len + 3) / 4;
    return 1;
}

/* The turn's tokens into its dialog (by upstream) and the metrics (by upstream and service). */
static void count_usage(cg_turn *t, turn_end_kind end)
{
    cg_turns *q = t->q;
    long long in, out;
    if (!turn_tokens(t, end, &in, &out))
        return;
    t->spent = cg_sat_add(in, out); /* what the turn's end counts against the token limits */
    cg_dialog_add_usage(&t->dialog, q->env->upstreams[t->route].cfg->name, in, out);
    unsigned long *slot = q->env->metrics->tokens[t->route][service_slot(q->env, t->dialog.service)];
    slot[0] += (unsigned long)in;
    slot[1] += (unsigned long)out;
}

/* The export's record of a chat turn that ends (export.h): what its client was told. */
static json_t *turn_params(cg_turn *t, json_t **from_profile);

static void export_turn(cg_turn *t, turn_end_kind end)
{
    static const char *const ends[] = {[END_DONE] = "done", [END_ERROR] = "error", [END_CANCELLED] = "cancelled",
                                       [END_ABSORBED] = "done", [END_ENDED] = "ended"};
    cg_turns *q = t->q;
    cg_turn_env *env = q->env;
    cg_dialog *d = &t->dialog;
    /* the ack named a route: an upstream was called, or a rule absorbed the message */
    int routed = q->backend == &upstream_backend && (t->t_upstream || end == END_ABSORBED);
    int first = t->first_route >= 0 ? t->first_route : t->route;
    json_t *params = turn_params(t, NULL);
    json_t *acted = t->filter ? cg_reply_filter_acted(t->filter) : NULL;
    cg_export_record r = {
        .id = t->id, .user = q->user, .room = t->room, .service = d->service, .params = params, .rules = t->fired,
        .reply_rules = json_array_size(acted) ? acted : NULL,
        .route = routed ? env->upstreams[first].cfg->name : NULL,
        .upstream = routed && end != END_ABSORBED ? env->upstreams[t->route].cfg->name : NULL,
        .fallback_from = t->first_route >= 0 ? env->upstreams[t->first_route].cfg->name : NULL,
        .replica = t->attempts > 0 ? t->replica : -1, .attempts = t->attempts,
        .end = ends[end], .code = end == END_ERROR ? cg_err_code(t->end_err) : NULL, .absorbed = end == END_ABSORBED,
        .truncated = t->truncated, .tokens_reported = t->tokens_in >= 0,
        .first_byte_ms = t->t_first ? (double)(t->t_first - t->t_upstream) / 1e6 : -1,
        .total_ms = (double)(uv_hrtime() - t->t_arrived) / 1e6,
        .text = t->text, .reply = t->reply, .reply_len = t->reply_len,
    };
    r.has_usage = turn_tokens(t, end, &r.tokens_in, &r.tokens_out);
    cg_export_turn(env->exporter, &r);
    json_decref(params);
    json_decref(acted);
}

/* The same for a chat turn that ends before it was saved (cancelled while it waited or
 * loaded, refused by a limit, its load failed): it has no dialog, so no service, params or
 * rules; refusals on arrival (rate, queue bound) are no turn and have no record. */
static void export_early(cg_turn *t, turn_end_kind end, int err)
{
    if (!t->q->env->exporter || t->kind != CG_TURN_CHAT || t->saved)
        return;
    t->end_err = err;
    export_turn(t, end);
}

/* An error that ends a chat turn before its dialog is loaded: said, and in the export. */
static void say_early_error(cg_turn *t, int err, const char *message, json_t *detail)
{
    say_error(t->q, t->kind == CG_TURN_CHAT ? t->id : NULL, err, message, detail);
    export_early(t, END_ERROR, err);
}

/*
 * The params of the dialog's service as they go upstream: configured defaults, under the
 * attributes of the user's profile the service defaults to (services.NAME.profile_defaults:
 * travel's from to home_city), under the dialog's own. *from_profile (may be NULL) gets the
 * names the profile gave, or NULL when none did. New reference.
 */
static json_t *turn_params(cg_turn *t, json_t **from_profile)
{
    const cg_config *cfg = t->q->env->cfg;
    cg_dialog *d = &t->dialog;
    json_t *params = cg_dialog_params_merged(d, d->service, cg_config_service_defaults(cfg, d->service));
    json_t *kept = d->service ? json_object_get(d->params, d->service) : NULL;
    json_t *names = NULL;
    const char *param;
    json_t *attr;
    json_object_foreach(cg_config_profile_defaults(cfg, d->service), param, attr) {
        json_t *v = json_object_get(t->profile, json_string_value(attr));
        if (!v || json_object_get(kept, param))
            continue; /* the dialog's own value wins */
        json_object_set(params, param, v);
        if (!names)
            names = json_array();
        json_array_append_new(names, json_string(param));
    }
    if (from_profile)
        *from_profile = names;
    else
        json_decref(names);
    return params;
}

/* The names in a JSON array of strings (rules) or of an object's keys (params), comma
 * separated, at most 32 of them; "-" for none. Names only: a param's value never goes to a
 * log. malloc'd. */
static char *names_of(json_t *v)
{
    char *out = NULL;
    size_t len = 0, cap = 0, n = 0;
    const char *key;
    json_t *item;
    size_t i;
    if (json_is_array(v)) {
        json_array_foreach(v, i, item) {
            if (n++ == 32 || !json_is_string(item))
                break;
            if (len)
                cg_buf_append(&out, &len, &cap, ",", 1, 128);
            cg_buf_append(&out, &len, &cap, json_string_value(item), json_string_length(item), 128);
        }
    } else if (json_is_object(v)) {
        json_object_foreach(v, key, item) {
            if (n++ == 32)
                break;
            if (len)
                cg_buf_append(&out, &len, &cap, ",", 1, 128);
            cg_buf_append(&out, &len, &cap, key, strlen(key), 128);
        }
    }
    if (!len)
        cg_buf_append(&out, &len, &cap, "-", 1, 8);
    cg_buf_append(&out, &len, &cap, "", 1, 8); /* its NUL */
    return out;
}

/* One line a chat turn at debug level (--log-level debug), when it ends: which rules fired
 * and which params it carried (names only), what the store's load found and took, the
 * upstream that answered and the times. The line is masked as every line is; the dialog is
 * a hash of its key, never the user's id. */
static void turn_trace(cg_turn *t, turn_end_kind end)
{
    static const char *const ends[] = {[END_DONE] = "done", [END_ERROR] = "error", [END_CANCELLED] = "cancelled",
                                       [END_ABSORBED] = "absorbed", [END_ENDED] = "ended"};
    if (!cg_log_enabled(CG_LOG_DEBUG))
        return;
    uint64_t now = uv_hrtime();
    /* the upstream called (a drop-in turn's reply comes from the adapter's app: none) */
    const cg_upstream *up = t->q->backend == &upstream_backend && t->t_upstream ? &t->q->env->upstreams[t->route] : NULL;
    cg_debug("turn %s: dialog #%08lx, %s, store %s in %.1f ms, upstream %s (replica %d, %d attempt(s)), first text "
             "at %.1f ms, %.1f ms in all, %s",
             t->id, t->lock.key ? cg_store_key_tag(t->lock.key) : 0ul, t->trace ? t->trace : "rules - params -",
             t->store_found ? t->store_found : "-", t->t_loaded > t->t_load ? (double)(t->t_loaded - t->t_load) / 1e6 : 0.0,
             up ? up->cfg->name : "-", t->replica, t->attempts,
             t->t_first > t->t_arrived ? (double)(t->t_first - t->t_arrived) / 1e6 : 0.0,
             (double)(now - t->t_arrived) / 1e6, ends[end]);
}

/* The history's new user message (the last) keeps the rules that fired on it and what they
 * annotated, bounded: 16 rule names, and annotations of at most 1 KiB as JSON. It is the
 * turn's own until saved, so it may change (nobody changes a message once saved). */
static void annotate_user_message(cg_turn *t)
{
    json_t *m = json_array_get(t->dialog.history, json_array_size(t->dialog.history) - 1);
    const char *role = json_string_value(json_object_get(m, "role"));
    if (!role || strcmp(role, "user") != 0)
        return;
    if (json_array_size(t->fired)) {
        json_t *names = json_array();
        for (size_t i = 0; i < json_array_size(t->fired) && i < 16; i++)
            json_array_append(names, json_array_get(t->fired, i));
        json_object_set_new(m, "rules", names);
    }
    if (json_object_size(t->annotations) && json_dumpb(t->annotations, NULL, 0, JSON_COMPACT) <= 1024)
        json_object_set(m, "annotations", t->annotations);
}

static void turn_save(cg_turn *t, turn_end_kind end)
{
    cg_turns *q = t->q;
    const cg_lifetimes *lt = &q->env->cfg->lifetimes;
    cg_metrics *m = q->env->metrics;
    int64_t now = turn_now(q);
    cg_dialog *d = &t->dialog;
    cg_pipeline_keep_user(d, t->text, t->enriched, t->arrived, lt);
    annotate_user_message(t);
    if (end == END_DONE || ((end == END_CANCELLED || end == END_ENDED) && t->reply_len > 0)) {
        json_t *reply = cg_dialog_push_history(d, "assistant", t->reply ? t->reply : "", now, lt);
        if (reply && end == END_CANCELLED)
            json_object_set_new_nocheck(reply, "cancelled", json_true());
        if (reply && q->backend == &upstream_backend && t->t_upstream) /* who answered (docs/state.md, History) */
            json_object_set_new_nocheck(reply, "upstream", cg_json_string(q->env->upstreams[t->route].cfg->name));
    }
    if (end == END_DONE || end == END_ABSORBED || end == END_ENDED) {
        d->turn_count++;
        m->turns_done++;
    } else if (end == END_ERROR) {
        if (t->state == TURN_BLOCKED)
            m->turns_blocked++;
        else
            m->turns_error++;
    } else {
        m->turns_cancelled++;
    }
    count_usage(t, end);
    d->last_activity = now;
    q->env->store->ops->dialogs->save(q->env->store, q->user, t->room, d, NULL, NULL);
    t->saved = 1;
    if (q->env->exporter)
        export_turn(t, end);
    turn_trace(t, end);
}

/* A chat turn ends with an error: said, saved, finished. */
static void turn_fail(cg_turn *t, int err, const char *message, json_t *detail)
{
    t->end_err = err;
    say_error(t->q, t->id, err, message, detail);
    turn_save(t, END_ERROR);
    turn_finish(t);
}

/*
 * Stops the request in flight without saying so (the caller does, or the client is gone):
 * its load is abandoned, or its upstream call cancelled and the turn saved as cancelled.
 */
static void turn_stop(cg_turn *t)
{
    cg_turns *q = t->q;
    switch (t->state) {
    case TURN_LIMITING:
        cg_store_abandon(t->limit);
        t->limit = NULL;
        break;
    case TURN_LOADING:
        cg_store_abandon(t->load);
        t->load = NULL;
        cg_store_abandon(t->profile_load);
        t->profile_load = NULL;
        break;
    case TURN_CALLING:
    case TURN_STREAMING:
    case TURN_BLOCKED:
        if (t->call)
            q->env->upstreams[t->route].ops->cancel(t->call);
        t->call = NULL;
        turn_save(t, END_CANCELLED);
        break;
    case TURN_FORWARDED: /* the app is told by the adapter (its connection goes) */
        turn_save(t, END_CANCELLED);
        break;
    case TURN_QUEUED:
    case TURN_LOCKING: /* its place in the lock's line goes with turn_free */
    case TURN_ENDED:
    case TURN_STATES:
        break;
    }
}

/* A cancel (the client's, or a cancel phrase) of the chat turn in flight. */
static void turn_cancel(cg_turn *t, int client_said)
{
    t->q->backend->cancel(t, client_said);
}

/* ---- the reply ------------------------------------------------------------------------ */

/* Keeps the reply for the done frame and the history, up to max_reply_bytes cut on a UTF-8
 * boundary. */
static void turn_keep_reply(cg_turn *t, const char *text, size_t len)
{
    if (!t->truncated)
        t->truncated = cg_buf_append_upto(&t->reply, &t->reply_len, &t->reply_cap, text, len,
                                          (size_t)t->q->env->cfg->max_reply_bytes);
}

static void turn_first_text(cg_turn *t)
{
    if (t->got_first)
        return;
    t->got_first = 1;
    t->t_first = uv_hrtime();
    if (t->state == TURN_CALLING)
        turn_enter(t, TURN_STREAMING);
    cg_histogram_observe(&t->q->env->metrics->first_token, (double)(uv_hrtime() - t->t_upstream) / 1e9);
}

static void on_turns_timer(uv_timer_t *timer)
{
    cg_turns *q = timer->data;
    if (q)
        q->backend->timer(q, q->inflight);
}

/* The connection's timer (made at its first use), for the turn in flight; what it means is
 * its backend's (the timer op). */
static void turns_timer_start(cg_turns *q, uint64_t ms)
{
    if (!q->timer) {
        q->timer = cg_malloc(sizeof(*q->timer));
        uv_timer_init(q->env->loop, q->timer);
        q->timer->data = q;
    }
    q->timer_ms = ms;
    uv_timer_start(q->timer, on_turns_timer, ms, 0);
}

/* A stop rule matched the reply: the upstream call is cancelled (never from inside its own
 * callback: the upstreams do not expect it there, hence the turn's timer) and the reply
 * ends with `blocked`, naming what acted. */
static void turn_block_end(cg_turn *t)
{
    cg_turns *q = t->q;
    if (t->call)
        q->env->upstreams[t->route].ops->cancel(t->call);
    t->call = NULL;
    json_t *detail = json_pack("{s:o}", "reply_rules", cg_reply_filter_acted(t->filter));
    cg_info("session %s: message %s: a reply rule stopped the reply after %zu bytes", q->name, id_of(t), t->reply_len);
    turn_fail(t, CG_E_BLOCKED, "a reply rule stopped the reply", detail);
    json_decref(detail);
}

/* Passes reply text on to the client and keeps it. */
static void turn_pass(cg_turn *t, const char *text, size_t len)
{
    if (!len)
        return;
    turn_keep_reply(t, text, len);
    t->sent += len;
    if (t->q->sink->delta)
        t->q->sink->delta(t->q->conn, t->id, text, len, t->sent);
}

/* The reply rules' filter: what may go now (all of it when final); 1 when a stop rule
 * matched (the turn is then blocked, its end scheduled). */
static int turn_filter(cg_turn *t, const char *text, size_t len, int final)
{
    const char *out;
    size_t n;
    int stop = cg_reply_filter_feed(t->filter, text, len, final, &out, &n);
    turn_pass(t, out, n);
    if (stop && t->state != TURN_BLOCKED) {
        turn_enter(t, TURN_BLOCKED);
        turns_timer_start(t->q, 0); /* its end from the loop, outside the upstream's callback */
    }
    return stop;
}

static void forward_arm(cg_turns *q, uint64_t ms);

void cg_turn_reply(cg_turn *t, const char *text, size_t len)
{
    forward_arm(t->q, t->q->fw.reply_gap_ms ? t->q->fw.reply_gap_ms : t->q->fw.reply_timeout_ms);
    if (len == 0)
        return;
    turn_first_text(t);
    turn_keep_reply(t, text, len);
}

/* A profile update the store refused after the turn's own check let it through (another
 * gateway wrote the profile meanwhile): said in the log, nobody waits for it. */
static void on_profile_written(void *ctx, json_t *profile, int err, const cg_store_status *status)
{
    (void)ctx, (void)profile, (void)status;
    if (err)
        cg_warn("a profile update was refused by the store (%s): the profile grew meanwhile", cg_err_code(err));
}

/* Changes to the user's profile (docs/state.md, "The user's profile"; a directive's
 * "profile", the rules' remember), checked: 0 with *next the profile they leave (NULL: no
 * changes), or a CG_E_* code with err. */
static int profile_check(cg_turn *t, json_t *changes, json_t **next, char *err, size_t errlen)
{
    const cg_lifetimes *lt = &t->q->env->cfg->lifetimes;
    *next = NULL;
    if (!changes)
        return 0;
    if (cg_profile_check(changes, err, errlen) < 0)
        return CG_E_BAD_FRAME;
    if (!(*next = cg_profile_apply(t->profile, changes))) {
        snprintf(err, errlen, "out of memory applying state.profile");
        return CG_E_INTERNAL;
    }
    size_t size = cg_profile_size(*next);
    if ((long)size > lt->profile_cap) {
        snprintf(err, errlen, "state.profile would take %zu bytes, over the %ld-byte profile_cap; nothing was changed",
                 size, lt->profile_cap);
        json_decref(*next);
        *next = NULL;
        return CG_E_TOO_LARGE;
    }
    return 0;
}

/* The checked changes (profile_check) go to the store; next, the profile they leave, is the
 * turn's now (taken). */
static void profile_commit(cg_turn *t, json_t *changes, json_t *next)
{
    cg_store *st = t->q->env->store;
    if (st->ops->profiles)
        st->ops->profiles->update(st, t->q->user, changes, on_profile_written, NULL);
    json_decref(t->profile);
    t->profile = next;
    t->dialog.profile = next;
}

void cg_turn_state(cg_turn *t, json_t *state, const char *source)
{
    cg_turns *q = t->q;
    char err[256];
    json_t *profile = NULL; /* checked first: a directive is applied whole or not at all */
    int rc = profile_check(t, json_object_get(state, "profile"), &profile, err, sizeof(err));
    if (rc == 0)
        rc = cg_dialog_apply_directive(&t->dialog, state, source, turn_now(q), &q->env->cfg->lifetimes, err,
                                       sizeof(err));
    if (rc >= 0 && profile)
        profile_commit(t, json_object_get(state, "profile"), profile);
    else
        json_decref(profile);
    if (rc >= 0)
        return;
    /* the reply itself is fine: a warning, and the reply goes on */
    cg_warn("session %s: message %s: state from '%s' refused: %s", q->name, id_of(t), source, err);
    if (q->sink->warning)
        q->sink->warning(q->conn, t->id, cg_err_code(rc), err);
}

void cg_turn_end(cg_turn *t, int cancelled)
{
    turn_save(t, cancelled || t->cancel_requested ? END_CANCELLED : END_ENDED);
    turn_finish(t);
}

const char *cg_turn_id(const cg_turn *t)
{
    return t->id;
}

static void on_upstream_delta(void *ctx, const char *text, size_t len)
{
    cg_turn *t = ctx;
    if (len == 0 || t->state == TURN_BLOCKED)
        return;
    turn_first_text(t);
    if (t->filter)
        turn_filter(t, text, len, 0);
    else
        turn_pass(t, text, len);
}

static void on_upstream_done(void *ctx, json_t *usage, json_t *state)
{
    cg_turn *t = ctx;
    cg_turns *q = t->q;
    const cg_upstream *up = &q->env->upstreams[t->route];
    cg_answer who = {.upstream = up->cfg->name, .replica = -1, .attempts = 1,
                     .fallback_from = t->first_route >= 0 ? q->env->upstreams[t->first_route].cfg->name : NULL};
    if (up->ops->answered)
        up->ops->answered(t->call, &who.replica, &who.attempts);
    t->replica = who.replica;
    t->attempts = who.attempts;
    t->call = NULL;
    if (t->state == TURN_BLOCKED || (t->filter && turn_filter(t, "", 0, 1))) {
        turn_block_end(t);
        return;
    }
    json_t *acted = NULL;
    if (t->filter) {
        cg_reply_filter_tags(t->filter, t->reply ? t->reply : "", t->reply_len);
        acted = cg_reply_filter_acted(t->filter);
        who.reply_rules = json_array_size(acted) ? acted : NULL;
    }
    json_t *pt = json_object_get(usage, "prompt_tokens"), *ct = json_object_get(usage, "completion_tokens");
    if (json_is_integer(pt) && json_is_integer(ct) && json_integer_value(pt) >= 0 && json_integer_value(ct) >= 0) {
        /* an upstream's count, bounded: a turn's spend never wraps a sum (dialog, limits) */
        t->tokens_in = cg_clamp(json_integer_value(pt), 0, CG_MAX_TURN_TOKENS);
        t->tokens_out = cg_clamp(json_integer_value(ct), 0, CG_MAX_TURN_TOKENS);
    }
    if (state)
        cg_turn_state(t, state, up->cfg->name);
    if (q->sink->done)
        q->sink->done(q->conn, t->id, t->reply ? t->reply : "", t->reply_len, usage, t->truncated, &who);
    json_decref(acted);
    turn_save(t, END_DONE);
    turn_finish(t);
}

static int turn_call_upstream(cg_turn *t, json_t *params);

/* May a failed call go on to its upstream's fallback? Once, before any reply text reached
 * the client, and for the failures a replica is marked out for: not reached, a timeout
 * before the first byte, HTTP 5xx or 429. A 4xx says the request itself is wrong: the
 * fallback would say the same. */
static int may_fall_back(const cg_turn *t, int err, json_t *detail)
{
    json_int_t status = json_integer_value(json_object_get(detail, "status"));
    return t->first_route < 0 && t->state == TURN_CALLING && t->reply_len == 0 &&
           t->q->env->upstreams[t->route].cfg->fallback_index >= 0 &&
           (err == CG_E_UPSTREAM_UNAVAILABLE || err == CG_E_UPSTREAM_TIMEOUT ||
            (err == CG_E_UPSTREAM_ERROR && (status >= 500 || status == 429)));
}

static void on_upstream_error(void *ctx, int err, const char *message, json_t *detail)
{
    cg_turn *t = ctx;
    cg_turns *q = t->q;
    t->call = NULL;
    if (t->state == TURN_BLOCKED || (t->filter && turn_filter(t, "", 0, 1))) {
        /* stopped (the stop is what the client hears), or the text held for the reply rules
         * went on, masked, before the error */
        turn_block_end(t);
        return;
    }
    q->env->metrics->upstream_errors[t->route]++;
    cg_info("session %s: message %s: %s: %s", q->name, id_of(t), cg_err_code(err), message);
    if (may_fall_back(t, err, detail)) {
        int to = q->env->upstreams[t->route].cfg->fallback_index;
        cg_info("session %s: message %s goes to the fallback upstream '%s'", q->name, id_of(t),
                q->env->upstreams[to].cfg->name);
        q->env->metrics->upstream_fallbacks[t->route]++;
        t->first_route = t->route;
        t->route = to;
        turn_enter(t, TURN_CALLING); /* another call: its text may come now */
        json_t *params = turn_params(t, NULL);
        int rc = turn_call_upstream(t, params);
        json_decref(params);
        if (rc == 0)
            return;
    }
    turn_fail(t, err, message, detail);
}

static const cg_upstream_events upstream_events = {
    .on_delta = on_upstream_delta,
    .on_done = on_upstream_done,
    .on_error = on_upstream_error,
};

/* ---- a chat turn ---------------------------------------------------------------------- */

/* forwarding's go: the message goes to the adapter's own connection (drop-in). */
static void turn_forward(cg_turn *t, const cg_pipeline_result *res, json_t *params, json_t *awaiting_before)
{
    cg_turns *q = t->q;
    cg_dialog *d = &t->dialog;
    cg_turn_forward f = {
        .id = t->id, .user = q->user, .room = t->room, .text = t->text, .service = d->service,
        .params = params, .awaiting = awaiting_before, .soft = d->soft,
        .tool_result = cg_dialog_tool_result(d, &q->env->cfg->lifetimes), .profile = t->profile,
        .resolution = res->resolution,
        .enriched = res->enriched, .rules = res->rules, .annotations = res->annotations, .opaque = t->opaque,
    };
    t->opaque = NULL; /* the adapter's again, whatever forward answers */
    t->t_upstream = uv_hrtime();
    if (q->sink->forward(q->conn, t, &f) < 0) {
        turn_fail(t, CG_E_INTERNAL, "the message could not be forwarded", NULL);
        return;
    }
    turn_enter(t, TURN_FORWARDED);
    forward_arm(q, q->fw.reply_timeout_ms);
    if (q->fw.supersede && q->head) /* the next message came while this one loaded */
        cg_turn_end(t, 0);
}

/* upstream calls' go: the message goes to its upstream: ack, then the call (or `cancel
 * absorb`: answered here). */
static void turn_call(cg_turn *t, const cg_pipeline_result *res, json_t *params, json_t *awaiting_before)
{
    cg_turns *q = t->q;
    cg_turn_env *env = q->env;
    cg_dialog *d = &t->dialog;
    cg_upstream *up = &env->upstreams[t->route];
    cg_ack ack = {
        .id = t->id, .room = t->room, .route = up->cfg->name, .service = d->service, .enriched = res->enriched,
        .params = params, .resolution = res->resolution, .rules = res->rules, .from_profile = t->from_profile,
    };
    if (q->sink->ack)
        q->sink->ack(q->conn, &ack);
    if (res->absorb) {
        if (q->sink->done)
            q->sink->done(q->conn, t->id, "", 0, NULL, 0, NULL);
        turn_save(t, END_ABSORBED);
        turn_finish(t);
        return;
    }
    t->awaiting_before = json_incref(awaiting_before);
    t->resolution = json_incref(res->resolution);
    t->annotations = json_incref(res->annotations);
    t->fired = json_incref(res->rules);
    env->metrics->routed[t->route]++;
    t->t_upstream = uv_hrtime();
    t->filter = cg_reply_filter_new(t->rules, (size_t)env->cfg->reply_window);
    turn_enter(t, TURN_CALLING);
    if (turn_call_upstream(t, params) < 0)
        turn_fail(t, CG_E_INTERNAL, "the upstream request could not be started", NULL);
}

/* Starts the call of t->route with the merged params and what the pipeline gave (kept on
 * the turn, so that a fallback makes the same call to another upstream); -1 when it could
 * not start. */
static int turn_call_upstream(cg_turn *t, json_t *params)
{
    cg_turns *q = t->q;
    cg_dialog *d = &t->dialog;
    cg_upstream *up = &q->env->upstreams[t->route];
    /* the state in a sentence, for an LLM's system message: built for a kind that reads it */
    json_t *tool = cg_dialog_tool_result(d, &q->env->cfg->lifetimes);
    /* an upstream may take fewer of the dialog's messages (a skill that wants the last 3) */
    size_t n_hist = json_array_size(d->history), want = (size_t)up->cfg->history_n;
    json_t *history = d->history;
    if (want < n_hist) {
        history = json_array();
        for (size_t i = n_hist - want; i < n_hist; i++)
            json_array_append(history, json_array_get(d->history, i));
    }
    char *summary =
        up->ops->reads_summary ? cg_dialog_summary(d, params, tool, t->profile, t->resolution, t->annotations) : NULL;
    cg_upstream_message um = {
        .id = t->id, .user = q->user, .room = t->room, .text = t->text, .route = up->cfg->name,
        .service = d->service, .params = params, .awaiting = t->awaiting_before, .soft = d->soft,
        .tool_result = tool, .profile = t->profile, .history = history, .summary = summary ? summary : "", .enriched = t->enriched,
        .resolution = t->resolution, .annotations = t->annotations, .rules = t->fired,
    };
    int rc = up->ops->start(up, &q->up_conns[t->route], &um, &upstream_events, t, &t->call);
    t->prompt_bytes = strlen(um.enriched ? um.enriched : t->text) + strlen(um.summary) + cg_dialog_history_text(d);
    if (history != d->history)
        json_decref(history);
    free(summary);
    if (rc == 0 && q->paused)
        up->ops->pause(t->call, 1);
    return rc < 0 ? -1 : 0;
}

/* ---- the two backends ------------------------------------------------------------------- */

/* upstream calls: a cancel stops the call, says cancelled, and ends the turn. */
static void upstream_cancel(cg_turn *t, int client_said)
{
    (void)client_said;
    cg_turns *q = t->q;
    turn_stop(t); /* saved as cancelled, and in the export, when its dialog was loaded */
    if (q->sink->cancelled)
        q->sink->cancelled(q->conn, t->id);
    export_early(t, END_CANCELLED, 0);
    turn_finish(t);
}

/* upstream calls: the timer ends a blocked reply, outside the upstream's callback. */
static void upstream_timer(cg_turns *q, cg_turn *t)
{
    (void)q;
    if (t && t->state == TURN_BLOCKED)
        turn_block_end(t);
}

static const cg_turn_backend upstream_backend = {
    .go = turn_call,
    .cancel = upstream_cancel,
    .timer = upstream_timer,
};

/* forwarding: a forwarded reply ends when the app says so; the app is told of the cancel,
 * and a reply not relayed ends within the gap. Before it is forwarded there is nothing to
 * stop (the message goes, then the adapter relays the client's cancel after it). */
static void forward_cancel(cg_turn *t, int client_said)
{
    cg_turns *q = t->q;
    if (t->state == TURN_FORWARDED && !t->cancel_requested) {
        t->cancel_requested = 1;
        q->sink->stop_forward(q->conn, t, client_said);
        forward_arm(q, q->fw.reply_gap_ms);
    }
}

/* forwarding with supersede: the next chat message ends the forwarded turn in flight. */
static void forward_arrived(cg_turns *q)
{
    if (q->fw.supersede && q->inflight && q->inflight->state == TURN_FORWARDED)
        cg_turn_end(q->inflight, 0);
}

/* forwarding: the app is still answering: its silence bound starts again, ms long. A bound
 * of the same length already running is only moved on (quiet_until), and the timer sets
 * itself again for what is left when it fires early: restarting a libuv timer takes it out
 * of the loop's heap and puts it back, which every frame of a reply did. */
static void forward_arm(cg_turns *q, uint64_t ms)
{
    if (!ms)
        return;
    uint64_t until = uv_now(q->env->loop) + ms;
    if (q->timer && q->timer_ms == ms && uv_is_active((uv_handle_t *)q->timer) && until >= q->quiet_until) {
        q->quiet_until = until;
        return;
    }
    turns_timer_start(q, ms);
    q->quiet_until = until;
}

/*
 * forwarding: a forwarded turn holds its dialog's lock until the app's end or cancelled
 * marker. An app that never sends one (a mapping without an end marker, an app stalled
 * mid-reply) must not hold the dialog for ever: the turn ends, saved as it stands, after
 * reply_timeout_ms with nothing from the app, or, once the reply has begun (or was
 * cancelled), reply_gap_ms of silence when the mapping sets one (its end by a quiet gap).
 */
static void forward_timer(cg_turns *q, cg_turn *t)
{
    if (!t || t->state != TURN_FORWARDED)
        return;
    uint64_t now = uv_now(q->env->loop);
    if (now < q->quiet_until) { /* a frame came since it was set: the rest of the bound */
        uv_timer_start(q->timer, on_turns_timer, q->quiet_until - now, 0);
        return;
    }
    if (q->timer_ms == q->fw.reply_gap_ms)
        cg_debug("session %s: the app's reply went quiet for %llu ms: it has ended", q->name,
                 (unsigned long long)q->fw.reply_gap_ms);
    else
        cg_info("session %s: the app sent nothing of the reply in flight for %llu ms: the turn ends, its dialog is "
                "free", q->name, (unsigned long long)q->fw.reply_timeout_ms);
    cg_turn_end(t, 0);
}

static const cg_turn_backend forward_backend = {
    .go = turn_forward,
    .cancel = forward_cancel,
    .arrived = forward_arrived,
    .timer = forward_timer,
};

/* ---- the shadow rule set ---------------------------------------------------------------- */

_Static_assert(CG_METRIC_SHADOW_FIELDS == CG_OUTCOME_FIELDS, "metrics.h counts the outcome's fields");
_Static_assert(CG_METRIC_LIMITS == CG_LIMIT_TURNS + 1, "metrics.h counts every limit (limits.h)");

/*
 * The shadow set (--shadow-rules) on copy, the dialog as it was before this message: what
 * it would have decided, beside what the live set did (res, d after), compared field by
 * field (cg_pipeline_outcome, the comparison `rules replay` makes too), counted and logged by
 * what differs. Never acts: the caller drops the copy. The log names the rules and the
 * fields, not the values (the message's words stay out of it), and the routes.
 */
static void shadow_compare(cg_turn *t, cg_dialog *copy, const cg_pipeline_result *res, const cg_dialog *d)
{
    cg_turns *q = t->q;
    cg_turn_env *env = q->env;
    cg_pipeline_result sres;
    cg_pipeline_run(env->cfg, env->shadow, copy, t->text, turn_now(q), &env->cfg->lifetimes, &sres);
    json_t *live = cg_pipeline_outcome(env->cfg, d, res), *shadow = cg_pipeline_outcome(env->cfg, copy, &sres);
    unsigned differs = live && shadow ? cg_pipeline_outcome_diff(live, shadow) : 0;
    char fields[128] = "";
    for (int i = 0; i < CG_OUTCOME_FIELDS; i++)
        if (differs & (1u << i)) {
            env->metrics->shadow_field[i]++;
            snprintf(fields + strlen(fields), sizeof(fields) - strlen(fields), "%s%s", fields[0] ? ", " : "",
                     cg_outcome_names[i]);
        }
    if (differs) {
        env->metrics->shadow_different++;
        char *lr = json_dumps(res->rules, JSON_COMPACT), *sr = json_dumps(sres.rules, JSON_COMPACT);
        int route = (differs >> CG_OUTCOME_ROUTE) & 1;
        cg_info("shadow rules: session %s message %s: the shadow set differs in %s; rules live %s, shadow %s%s%s%s%s",
                q->name, id_of(t), fields, lr ? lr : "?", sr ? sr : "?", route ? "; route live " : "",
                route ? json_string_value(json_object_get(live, "route")) : "", route ? ", shadow " : "",
                route ? json_string_value(json_object_get(shadow, "route")) : "");
        free(lr);
        free(sr);
    } else if (live && shadow) {
        env->metrics->shadow_same++;
    }
    json_decref(live);
    json_decref(shadow);
    cg_pipeline_result_free(&sres);
}

/* A chat message with its dialog loaded: the pipeline, then the upstream or the adapter. */
static void turn_start(cg_turn *t)
{
    cg_turns *q = t->q;
    cg_turn_env *env = q->env;
    cg_dialog *d = &t->dialog;
    json_t *awaiting_before = json_incref(d->awaiting); /* forwarded as it was */
    cg_dialog before; /* the shadow set's starting point */
    int shadow = env->shadow && cg_dialog_copy(&before, d) == 0;
    cg_pipeline_result res;
    uint64_t t0 = uv_hrtime();
    d->profile = t->profile; /* for the rules' `when profile` */
    cg_pipeline_begin(env->cfg, t->rules, d, t->text, turn_now(q), &env->cfg->lifetimes, &res);
    cg_histogram_observe(&env->metrics->rules, (double)(uv_hrtime() - t0) / 1e9);
    count_pipeline(env->metrics, &res);
    if (shadow) {
        shadow_compare(t, &before, &res, d);
        cg_dialog_free(&before);
    }
    if (res.error) { /* params over the cap: refused, nothing forwarded (drop-in: the frame is dropped) */
        json_decref(awaiting_before);
        turn_fail(t, res.error, res.error_message, NULL);
        cg_pipeline_result_free(&res);
        return;
    }
    t->route = res.route;
    if (res.enriched)
        t->enriched = cg_strdup(res.enriched);
    if (res.remember) { /* what the user said about themselves, before the params it may default */
        char err[256];
        json_t *next = NULL;
        int rc = profile_check(t, res.remember, &next, err, sizeof(err));
        if (rc == 0)
            profile_commit(t, res.remember, next);
        else if (q->sink->warning)
            q->sink->warning(q->conn, t->id, cg_err_code(rc), err);
    }
    json_t *params = turn_params(t, &t->from_profile);
    if (cg_log_enabled(CG_LOG_DEBUG)) { /* the trace's names, while the pipeline's result is here */
        char *rules = names_of(res.rules), *names = names_of(params);
        if (asprintf(&t->trace, "rules %s, service %s params %s", rules, d->service ? d->service : "-", names) < 0)
            t->trace = NULL;
        free(rules);
        free(names);
    }
    q->backend->go(t, &res, params, awaiting_before);
    json_decref(params);
    json_decref(awaiting_before);
    cg_pipeline_result_free(&res);
}

/* context.get, context.forget, context.clear: on the caller's own dialog only. */
static void turn_context(cg_turn *t)
{
    cg_turns *q = t->q;
    cg_store *st = q->env->store;
    if (t->kind == CG_TURN_CONTEXT_FORGET) {
        if (cg_dialog_forget(&t->dialog, t->keys) > 0) {
            st->ops->dialogs->save(st, q->user, t->room, &t->dialog, NULL, NULL);
            t->saved = 1;
        }
    } else if (t->kind == CG_TURN_CONTEXT_CLEAR) {
        st->ops->dialogs->remove(st, q->user, t->room, NULL, NULL); /* the lease stays: turn_free lets go */
        cg_dialog_free(&t->dialog);
        cg_dialog_init(&t->dialog, turn_now(q));
    }
    json_t *state = cg_dialog_context(&t->dialog);
    if (q->sink->context)
        q->sink->context(q->conn, t->room, state);
    json_decref(state);
    turn_finish(t);
}

/* ---- queue, lock, load ---------------------------------------------------------------- */

static void on_dialog_loaded(void *ctx, cg_dialog *d, const cg_store_status *status)
{
    cg_turn *t = ctx;
    cg_turns *q = t->q;
    cg_metrics *mt = q->env->metrics;
    t->load = NULL;
    t->dialog = *d; /* ours now */
    t->has_dialog = 1;
    t->store_found = status->degraded ? "answered from memory (Redis away)" : status->found ? "found the dialog" : "began it";
    t->t_loaded = uv_hrtime();
    cg_histogram_observe(&mt->store_load, (double)(uv_hrtime() - t->t_load) / 1e9);
    if (t->kind == CG_TURN_CHAT) {
        if (status->found)
            mt->cache_hits++;
        else
            mt->cache_misses++;
    }
    if (status->warn && q->sink->warning) {
        mt->degraded_warnings++;
        q->sink->warning(q->conn, t->kind == CG_TURN_CHAT ? t->id : NULL, "store_degraded",
                         "state kept in memory: Redis unreachable");
    }
    t->loaded = 1;
    if (t->profile_load) /* the profile's answer goes on with the turn */
        return;
    if (t->kind == CG_TURN_CHAT)
        turn_start(t);
    else
        turn_context(t);
}

/* The user's profile came (a chat turn loads it beside its dialog); the turn goes on when
 * both are there. */
static void on_profile_loaded(void *ctx, json_t *profile, int err, const cg_store_status *status)
{
    (void)err, (void)status;
    cg_turn *t = ctx;
    t->profile_load = NULL;
    t->profile = json_incref(profile);
    if (t->loaded)
        turn_start(t);
}

/* Starts loading t's dialog; -1 (said as an error) when the store refused. */
static int turn_load(cg_turn *t)
{
    cg_turns *q = t->q;
    cg_store *st = q->env->store;
    turn_enter(t, TURN_LOADING);
    t->t_load = uv_hrtime();
    t->load = st->ops->lease->acquire(st, q->user, t->room, on_dialog_loaded, t);
    if (t->load && t->kind == CG_TURN_CHAT && st->ops->profiles) /* pipelined with the load */
        t->profile_load = st->ops->profiles->get(st, q->user, on_profile_loaded, t);
    if (t->load)
        return 0;
    say_early_error(t, CG_E_INTERNAL, "the dialog could not be loaded", NULL);
    return -1;
}

/* The dialog's lock passed to t (another connection's turn of the dialog ended). */
static void on_lock_granted(cg_dialog_lock_waiter *w)
{
    cg_turn *t = w->owner;
    if (turn_load(t) < 0) /* cannot happen with the shipped stores; keep the line moving */
        turn_finish(t);
}

/* Takes the dialog's lock, then loads it: 0, or -1 (said) when the load could not start. */
static int turn_begin(cg_turn *t)
{
    t->lock.granted = on_lock_granted;
    t->lock.owner = t;
    if (!cg_dialog_lock_acquire(t->q->env->locks, &t->lock, t->q->user, t->room)) {
        turn_enter(t, TURN_LOCKING); /* another connection's turn of this dialog runs */
        return 0;                    /* on_lock_granted starts this one */
    }
    return turn_load(t);
}

/* The store counted the message against its user's limits: over one, it is refused
 * (rate_limited, saying which limit and when to try again) and never reaches its dialog. */
static void on_limit_verdict(void *ctx, const cg_limit_verdict *v, const cg_store_status *status)
{
    (void)status; /* Redis away: counted in this gateway's memory; the load will say so */
    cg_turn *t = ctx;
    cg_turns *q = t->q;
    t->limit = NULL;
    if (v->hit != CG_LIMIT_OK) {
        char msg[160];
        const char *name = cg_limit_name(v->hit);
        snprintf(msg, sizeof(msg), "over the user's %s limit: try again in %ld ms", name, v->retry_after_ms);
        q->env->metrics->limited[v->hit]++;
        json_t *detail = json_pack("{s:I,s:s}", "retry_after_ms", (json_int_t)v->retry_after_ms, "limit", name);
        t->refused = 1;
        say_early_error(t, CG_E_RATE_LIMITED, msg, detail);
        json_decref(detail);
        turn_finish(t);
        return;
    }
    t->limit_held = 1;
    t->limit_local = v->local;
    if (turn_begin(t) < 0)
        turn_finish(t);
}

/* Counts a chat message against its user's limits (the store answers later): 0, or -1
 * (said) when the store could not start. */
static int turn_limit(cg_turn *t)
{
    cg_turns *q = t->q;
    cg_store *st = q->env->store;
    t->limit_turn = ++q->env->limit_seq;
    turn_enter(t, TURN_LIMITING);
    t->limit = st->ops->limits->take(st, q->user, q->limits, t->limit_turn, on_limit_verdict, t);
    if (t->limit)
        return 0;
    say_early_error(t, CG_E_INTERNAL, "the user's limits could not be checked", NULL);
    return -1;
}

/* Runs the next waiting request, if none is in flight: a chat message's limits first (when
 * its user has any), then its dialog's lock, then its load. */
/* profile.get, profile.forget: the user's profile, said with a profile frame. A forget of
 * every name reads the names first. */
static void on_profile_answer(void *ctx, json_t *profile, int err, const cg_store_status *status)
{
    (void)status;
    cg_turn *t = ctx;
    cg_turns *q = t->q;
    cg_store *st = q->env->store;
    t->load = NULL;
    if (t->kind == CG_TURN_PROFILE_FORGET && !t->keys && json_object_size(profile)) {
        json_t *all = json_object();
        const char *name;
        json_t *v;
        json_object_foreach(profile, name, v) json_object_set_new(all, name, json_null());
        t->keys = json_array(); /* not NULL now: the second answer is the last */
        t->load = st->ops->profiles->update(st, q->user, all, on_profile_answer, t);
        json_decref(all);
        if (t->load)
            return;
    }
    if (err)
        say_error(q, t->id, err, "the profile could not be changed", NULL);
    else if (q->sink->profile)
        q->sink->profile(q->conn, profile);
    turn_finish(t);
}

/* Starts a profile command: 0, or -1 (said) when the store has no profiles or refused. */
static int turn_profile(cg_turn *t)
{
    cg_turns *q = t->q;
    cg_store *st = q->env->store;
    if (!st->ops->profiles) {
        say_error(q, t->id, CG_E_INTERNAL, "this store keeps no profiles", NULL);
        return -1;
    }
    turn_enter(t, TURN_LOADING);
    if (t->kind == CG_TURN_PROFILE_FORGET && t->keys) {
        json_t *names = json_object();
        size_t i;
        json_t *k;
        json_array_foreach(t->keys, i, k) json_object_set_new(names, json_string_value(k), json_null());
        char err[160];
        if (cg_profile_check(names, err, sizeof(err)) < 0) {
            json_decref(names);
            say_error(q, t->id, CG_E_BAD_FRAME, err, NULL);
            return -1;
        }
        t->load = st->ops->profiles->update(st, q->user, names, on_profile_answer, t);
        json_decref(names);
    } else {
        t->load = st->ops->profiles->get(st, q->user, on_profile_answer, t);
    }
    if (t->load)
        return 0;
    say_error(q, t->id, CG_E_INTERNAL, "the profile could not be read", NULL);
    return -1;
}

static void turns_pump(cg_turns *q)
{
    while (!q->inflight && q->head) {
        cg_turn *t = q->head;
        q->head = t->next;
        if (!q->head)
            q->tail = NULL;
        q->queued--;
        t->next = NULL;
        q->inflight = t;
        if (t->kind == CG_TURN_CHAT) {
            t->counted = 1;
            q->env->inflight++;
        }
        int limited = t->kind == CG_TURN_CHAT && q->limits;
        int profile = t->kind == CG_TURN_PROFILE_GET || t->kind == CG_TURN_PROFILE_FORGET;
        if ((profile ? turn_profile(t) : limited ? turn_limit(t) : turn_begin(t)) == 0)
            return;
        q->inflight = NULL;
        turn_free(t);
    }
}

/* ---- the connection's side ------------------------------------------------------------ */

void cg_turns_init(cg_turns *q, cg_turn_env *env, const cg_turn_sink *sink, const cg_turn_forwarding *fw,
                   void *conn, const char *user, const char *name)
{
    memset(q, 0, sizeof(*q));
    q->env = env;
    q->sink = sink;
    q->backend = fw ? &forward_backend : &upstream_backend;
    if (fw)
        q->fw = *fw;
    q->conn = conn;
    q->user = user;
    q->name = name;
    cg_rate_init(&q->rate, env->cfg->rate_burst, uv_now(env->loop));
}

void cg_turns_set_plan(cg_turns *q, const char *plan)
{
    int unknown = 0;
    q->limits = cg_limits_for(&q->env->cfg->limits, q->user, plan, &unknown);
    if (unknown)
        cg_warn("session %s: the plan '%.64s' its token names is not in limits.plans: the default limits hold",
                q->name, plan);
}

int cg_turns_rate(cg_turns *q, const char *id)
{
    const cg_config *cfg = q->env->cfg;
    if (cg_rate_take(&q->rate, cfg->rate_per_second, cfg->rate_burst, uv_now(q->env->loop)))
        return 0;
    char err[160];
    snprintf(err, sizeof(err), "over %ld messages a second", cfg->rate_per_second);
    say_error(q, id, CG_E_RATE_LIMITED, err, NULL);
    return CG_E_RATE_LIMITED;
}

int cg_turns_admit(cg_turns *q, const char *id)
{
    const cg_config *cfg = q->env->cfg;
    char err[160];
    if (cg_turns_rate(q, id))
        return CG_E_RATE_LIMITED;
    /* waiting: the queue, and a request in flight still waiting for its dialog (its lock or
     * its load), which has nothing under way yet either */
    cg_turn *t = q->inflight;
    long waiting = q->queued + (t && turn_waiting(t));
    if (waiting >= cfg->queue_limit) {
        snprintf(err, sizeof(err), "%ld messages wait already for the reply in flight or their dialog", waiting);
        say_error(q, id, CG_E_RATE_LIMITED, err, NULL);
        return CG_E_RATE_LIMITED;
    }
    return 0;
}

/* A chat message with this id is waiting or in flight. */
static int turns_id_in_use(const cg_turns *q, const char *id)
{
    if (q->inflight && q->inflight->kind == CG_TURN_CHAT && strcmp(q->inflight->id, id) == 0)
        return 1;
    for (const cg_turn *t = q->head; t; t = t->next)
        if (t->kind == CG_TURN_CHAT && strcmp(t->id, id) == 0)
            return 1;
    return 0;
}

/* Past the rate and the queue bound: a request is refused while draining, and a chat message
 * whose id names one not yet answered (when ids must be unique). 0, or the code (said). */
static int turns_accept(cg_turns *q, const cg_turn_request *r)
{
    int rc = cg_turns_admit(q, r->id);
    if (rc)
        return rc;
    if (q->env->stopping) {
        say_error(q, r->id, CG_E_INTERNAL, "the gateway is shutting down: reconnect", NULL);
        return CG_E_INTERNAL;
    }
    if (r->kind == CG_TURN_CHAT && r->unique_id && turns_id_in_use(q, r->id)) {
        char err[160];
        snprintf(err, sizeof(err), "id '%.64s' is already in use by a message not yet answered", r->id);
        say_error(q, r->id, CG_E_BAD_FRAME, err, NULL);
        return CG_E_BAD_FRAME;
    }
    return 0;
}

/* The chat turn of the dialog (key) that holds its lock in this process, or NULL. */
static cg_turn *dialog_turn(cg_turn_env *env, const char *key)
{
    cg_dialog_lock_waiter *w = cg_dialog_lock_holder(env->locks, key);
    cg_turn *t = w ? w->owner : NULL;
    return t && t->kind == CG_TURN_CHAT ? t : NULL;
}

void cg_turns_cancel_dialog(cg_turn_env *env, const char *key)
{
    cg_turn *t = dialog_turn(env, key);
    if (!t)
        return;
    cg_info("session %s: message %s stopped from another connection or gateway", t->q->name, id_of(t));
    turn_cancel(t, 0);
}

/* The chat turn of this user's dialog `room` running here: this connection's own, or another
 * connection's (another tab) that holds the dialog's lock; NULL when none. */
static cg_turn *room_turn(cg_turns *q, const char *room)
{
    cg_turn *t = q->inflight;
    if (t && t->kind == CG_TURN_CHAT && strcmp(t->room, room) == 0)
        return t;
    char *key = cg_store_dialog_key(q->user, room);
    t = dialog_turn(q->env, key);
    free(key);
    return t;
}

/*
 * Stops the reply in flight of the dialog (this user, room), wherever it runs: this
 * connection's (`own`: a cancel phrase; a context.clear waits its turn behind it instead),
 * another connection's here (another tab), or, through the store, another gateway's. A turn
 * here that has not loaded its dialog may be waiting for another gateway's lease: that
 * gateway is told too.
 */
static void cancel_dialog(cg_turns *q, const char *room, int own)
{
    cg_turn *t = room_turn(q, room);
    int remote = !t || turn_waiting(t);
    if (t && (own || t->q != q)) {
        cg_info("session %s: message %s stopped by a cancel %s", t->q->name, id_of(t),
                t->q == q ? "phrase" : "from another connection");
        turn_cancel(t, 0);
    }
    if (remote && q->env->store->ops->bus)
        q->env->store->ops->bus->cancel_remote(q->env->store, q->user, room);
}

/*
 * A message that a cancel rule matches acts at once on the reply in flight of its dialog:
 * that reply is cancelled; the message itself then waits its turn like any other and goes
 * through the pipeline, which clears awaiting. The rules run only when there may be a
 * reply to stop.
 */
static void cancel_on_arrival(cg_turns *q, const char *room, const char *text)
{
    if (!q->env->store->ops->bus && !room_turn(q, room))
        return;
    if (cg_rules_cancels(q->env->rules, text))
        cancel_dialog(q, room, 1);
}

static void request_clear(cg_turn_request *r)
{
    free(r->id);
    free(r->room);
    free(r->text);
    json_decref(r->keys);
    memset(r, 0, sizeof(*r));
}

int cg_turns_submit(cg_turns *q, cg_turn_request *r)
{
    int chat = r->kind == CG_TURN_CHAT;
    int rc = turns_accept(q, r);
    if (rc) {
        request_clear(r);
        return rc;
    }
    if (chat)
        cancel_on_arrival(q, r->room, r->text);
    else if (r->kind == CG_TURN_CONTEXT_CLEAR)
        cancel_dialog(q, r->room, 0); /* another tab's or gateway's reply; this one's comes first */
    if (chat && q->backend->arrived)
        q->backend->arrived(q);
    cg_turn *t = cg_calloc(1, sizeof(*t));
    t->first_route = -1;
    t->tokens_in = t->tokens_out = -1;
    t->q = q;
    t->kind = r->kind;
    t->id = r->id;
    t->room = r->room;
    t->text = r->text;
    t->keys = r->keys;
    t->opaque = r->opaque;
    memset(r, 0, sizeof(*r));
    t->arrived = turn_now(q);
    t->t_arrived = uv_hrtime();
    t->rules = cg_ruleset_ref(q->env->rules);
    if (chat)
        q->env->metrics->messages++;
    if (q->tail)
        q->tail->next = t;
    else
        q->head = t;
    q->tail = t;
    q->queued++;
    turns_pump(q);
    return 0;
}

int cg_turns_cancel(cg_turns *q, const char *id)
{
    cg_turn *t = q->inflight;
    if (t && t->kind == CG_TURN_CHAT && strcmp(t->id, id) == 0) {
        turn_cancel(t, 1);
        return 0;
    }
    for (cg_turn **pp = &q->head, *prev = NULL; *pp; prev = *pp, pp = &(*pp)->next) {
        if ((*pp)->kind != CG_TURN_CHAT || strcmp((*pp)->id, id) != 0)
            continue;
        t = *pp;
        *pp = t->next;
        if (q->tail == t)
            q->tail = prev;
        q->queued--;
        if (q->sink->cancelled)
            q->sink->cancelled(q->conn, id);
        export_early(t, END_CANCELLED, 0);
        turn_free(t);
        return 0;
    }
    return -1;
}

void cg_turns_cancel_current(cg_turns *q, const char *id)
{
    cg_turn *t = q->inflight;
    if (t && t->kind == CG_TURN_CHAT && (!id[0] || strcmp(cg_turn_id(t), id) == 0))
        turn_cancel(t, 1);
}

void cg_turns_pause(cg_turns *q, int paused)
{
    q->paused = paused;
    cg_turn *t = q->inflight;
    if (t && t->call)
        q->env->upstreams[t->route].ops->pause(t->call, paused);
}

int cg_turns_reply(const cg_turns *q, const char **id, const char **room, const char **text, size_t *len,
                   uint64_t *seq)
{
    const cg_turn *t = q->inflight;
    if (!t || t->kind != CG_TURN_CHAT || q->backend != &upstream_backend || t->state == TURN_BLOCKED ||
        t->state == TURN_ENDED)
        return -1;
    *id = t->id;
    *room = t->room;
    *text = t->reply ? t->reply : "";
    *len = t->reply_len;
    *seq = t->sent;
    return 0;
}

void cg_turns_hand_over(cg_turns *q, const cg_turn_sink *sink, void *conn, const char *user, const char *name)
{
    while (q->head) { /* what waited was the connection's: it goes with it */
        cg_turn *t = q->head;
        q->head = t->next;
        turn_free(t);
    }
    q->tail = NULL;
    q->queued = 0;
    q->sink = sink;
    q->conn = conn;
    q->user = user;
    q->name = name;
    cg_turns_pause(q, 0); /* nobody reads slowly now: the reply is kept, not sent */
}

cg_turn *cg_turns_forwarded(cg_turns *q)
{
    return q->inflight && q->inflight->state == TURN_FORWARDED ? q->inflight : NULL;
}

static void on_timer_closed(uv_handle_t *h)
{
    free(h);
}

void cg_turns_close(cg_turns *q)
{
    if (q->inflight) {
        turn_stop(q->inflight);
        turn_free(q->inflight);
        q->inflight = NULL;
    }
    while (q->head) {
        cg_turn *t = q->head;
        q->head = t->next;
        turn_free(t);
    }
    q->tail = NULL;
    q->queued = 0;
    for (int i = 0; i < q->env->n_upstreams; i++)
        if (q->up_conns[i] && q->env->upstreams[i].ops->close_conn) {
            q->env->upstreams[i].ops->close_conn(q->up_conns[i]);
            q->up_conns[i] = NULL;
        }
    if (q->timer) {
        q->timer->data = NULL;
        uv_close((uv_handle_t *)q->timer, on_timer_closed);
        q->timer = NULL;
    }
}
