/*
 * store_redis.c: dialogs in Redis, through the hiredis async API on the gateway's loop.
 *
 * Layout (DESIGN.md section 5), one hash tag per dialog so a dialog lives on one shard:
 *   P:{U:R}:params    HASH  "<service>.<name>" -> JSON value
 *   P:{U:R}:dialog    HASH  service, created_at, last_activity, turn_count, message_count,
 *                           last_tool_result
 *   P:{U:R}:awaiting  STRING JSON, EX its lifetime
 *   P:{U:R}:soft      STRING JSON, EX its lifetime
 *   P:{U:R}:history   LIST  JSON messages, oldest first, EXPIRE 30 min
 *   P:user:{U}:rooms  SET   the user's rooms, for "forget this user" without SCAN
 * Every atomic step touches one hash tag only, so it runs on a single Redis, behind
 * twemproxy (which refuses MULTI) and on one cluster slot: a load is one EVAL of five reads
 * of the dialog's keys; a save is SADD+EXPIRE of the rooms set (first, so "forget this user"
 * always finds a room that has data), then one EVAL that rewrites the dialog's keys with
 * their lifetimes; a delete is one DEL of the dialog's keys, then SREM. All pipelined: one
 * round trip each. (The gateway holds the whole dialog for the turn, so rewriting is simpler
 * than HSET/HDEL deltas and gives the same keys.)
 *
 * A save is conditional, inside its EVAL: Redis's copy is kept when it is another
 * incarnation of the dialog (its created_at differs: this gateway loaded a fresh dialog
 * while Redis was away, and Redis still has the real one), and a write-back after an outage
 * is also refused when Redis's copy is newer (last_activity). A refused save drops the
 * memory copy, so the next load reads Redis's.
 *
 * Faults. hiredis 0.14 has no connect or command timeout, so this file keeps its own
 * (h2o's lib/common/redis.c does the same): a connect timer (covering the name's
 * resolution too), and a 100 ms tick that fails the connection when the oldest command has
 * waited command_timeout_ms (Redis stopped with SIGSTOP keeps its socket open and answers
 * nothing). Failing means redisAsyncFree, after which hiredis calls every pending callback
 * with a NULL reply. The host name is resolved off the loop (cg_resolve_start) before each
 * connect, since hiredis would call a blocking getaddrinfo. A connection is trusted once its
 * PING is answered; an error instead (-LOADING, -NOAUTH, -MASTERDOWN) or a failed SELECT
 * drops it and reconnects with the backoff, degraded meanwhile.
 *
 * While Redis is away the store answers from an in-memory store (a write-through copy of
 * what it last read or wrote, so a conversation keeps its context), marks what it wrote
 * there dirty, and writes the dirty dialogs back when a reconnect (with backoff and jitter)
 * answers a PING. The dirty set is bounded in dialogs (max_dialogs) and in bytes
 * (redis.writeback_max_bytes), least recently written going first; a dirty dialog the
 * memory copy no longer holds is never written back (that would write a blank dialog).
 */
#define _GNU_SOURCE /* asprintf */
#include <hiredis/async.h>
#include <hiredis/hiredis.h>
#include <hiredis/adapters/libuv.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "chatgate/core/log.h"
#include "chatgate/store/store.h"
#include "chatgate/core/net.h"

typedef enum { R_CLOSED, R_RESOLVING, R_CONNECTING, R_PROBING, R_CONNECTED } redis_state;
typedef enum { OP_LOAD, OP_SAVE, OP_REMOVE, OP_REMOVE_USER, OP_PING } op_kind;

/* The default of redis.writeback_max_bytes, for callers that leave it 0. */
#define WRITEBACK_MAX_BYTES_DEFAULT (64L << 20)

typedef struct redis_store redis_store;

struct cg_store_req {
    redis_store *rs;
    op_kind kind;
    char *user;      /* as given (remove_user's memory delete); "" for a write-back */
    char *eu, *er;   /* user and room, escaped (cg_store_escape) */
    char *key;       /* "<eu>:<er>": the dialog's hash tag and memory key */
    json_t *snapshot; /* save: the dialog as written */
    long version;     /* save of a dirty dialog: the dirty version it writes back */
    cg_store_load_fn load_cb;
    cg_store_done_fn done_cb;
    void *ctx;
    int abandoned;
    int steps;        /* replies due to on_step_reply: r lives until they came */
    int step_failed;  /* one of them was an error or never came */
    int finished;     /* req_finish was called while steps were due */
    int base_unknown; /* save: the dialog began from nothing while Redis was away */
    cg_store_req *wait_next; /* waiting for the first connection's verdict */
    uint64_t sent_at;
    cg_store_req *prev, *next; /* in flight, oldest first */
    uv_timer_t defer;          /* answers from memory come through this */
};

struct redis_store {
    cg_store base;
    char *host; /* as in the URL; resolved before each connect */
    int port, db;
    char *password; /* NULL: none */
    char *address;  /* the last address connected to, for the log */
    cg_resolve *resolve;
    redisAsyncContext *ac;
    redis_state state;
    int setup_failed; /* SELECT failed on this connection */
    uv_timer_t connect_timer; /* connect timeout, then reconnect backoff */
    uv_timer_t tick;          /* command timeouts */
    int backoff;
    int ever_connected;
    cg_memstore *mem;
    json_t *dirty;  /* key -> {"u","r","v","b"}: written to memory only; oldest write first */
    long dirty_bytes;
    long dirty_max_bytes;
    json_t *warned; /* keys told "store_degraded" in this outage */
    json_t *unknown; /* keys loaded from memory, not found, while Redis was away: Redis's copy
                      * is unknown, so a save of them only creates (oldest first, bounded) */
    cg_store_req *waiting, *waiting_tail; /* before the first connection is decided */
    long dirty_seq;
    cg_store_req *head, *tail;
    int handles; /* open uv handles + requests: freed when 0 after close */
    int closing;
};

static void redis_connect(redis_store *rs);
static void store_free_if_done(redis_store *rs);
static void finish_close(redis_store *rs);
static int flush_one(redis_store *rs, const char *key, json_t *entry);
static void drain_waiting(redis_store *rs);
static void on_rooms_reply(redisAsyncContext *ac, void *reply_, void *priv);

static uint64_t now_ms(redis_store *rs)
{
    return uv_now(rs->base.loop);
}

static char *xstrdup(const char *s)
{
    char *d = strdup(s);
    if (!d)
        abort();
    return d;
}

/* ---- degraded mode --------------------------------------------------------------------- */

static void enter_degraded(redis_store *rs, const char *why)
{
    if (rs->base.stats.degraded)
        return;
    rs->base.stats.degraded = 1;
    rs->base.stats.degraded_since_ms = now_ms(rs);
    cg_warn("redis %s:%d: %s; serving dialogs from memory until it is back", rs->host, rs->port, why);
    drain_waiting(rs); /* from memory now */
}

static void leave_degraded(redis_store *rs)
{
    if (!rs->base.stats.degraded)
        return;
    rs->base.stats.degraded = 0;
    rs->base.stats.degraded_seconds += (double)(now_ms(rs) - rs->base.stats.degraded_since_ms) / 1000.0;
    json_object_clear(rs->warned);
}

/* The warning goes with the answer to a load, the one that reaches the client before its
 * ack; a save's answer reaches nobody, so it must not use up the dialog's warning. */
static cg_store_status degraded_status(redis_store *rs, const char *key, int load)
{
    cg_store_status st = {1, 0, 0};
    if (load && !json_object_get(rs->warned, key)) {
        if (json_object_size(rs->warned) > 100000)
            json_object_clear(rs->warned);
        st.warn = json_object_set_new(rs->warned, key, json_true()) == 0;
    }
    rs->base.stats.degraded_answers++;
    return st;
}

/* ---- the dirty set: dialogs written to memory only, waiting for the write-back ---------- */

static void dirty_gauges(redis_store *rs)
{
    rs->base.stats.writeback_pending = (long)json_object_size(rs->dirty);
    rs->base.stats.writeback_pending_bytes = rs->dirty_bytes;
}

static void dirty_del(redis_store *rs, const char *key)
{
    json_t *entry = json_object_get(rs->dirty, key);
    if (!entry)
        return;
    rs->dirty_bytes -= (long)json_integer_value(json_object_get(entry, "b"));
    json_object_del(rs->dirty, key);
    dirty_gauges(rs);
}

/* Keeps the dirty set within max_dialogs and writeback_max_bytes: the least recently written
 * dialogs lose their write-back (the memory copy keeps serving them while it holds them). */
static void dirty_bound(redis_store *rs)
{
    long dropped = 0;
    while (json_object_size(rs->dirty) > 0 &&
           ((long)json_object_size(rs->dirty) > rs->base.cfg.max_dialogs || rs->dirty_bytes > rs->dirty_max_bytes)) {
        void *it = json_object_iter(rs->dirty);
        dirty_del(rs, json_object_iter_key(it));
        rs->base.stats.writeback_dropped_bound++;
        dropped++;
    }
    if (dropped)
        cg_warn("redis %s:%d: %ld dialogs held for the write-back dropped to stay within %ld dialogs and %ld bytes",
                rs->host, rs->port, dropped, rs->base.cfg.max_dialogs, rs->dirty_max_bytes);
}

/* Marks r's dialog (its snapshot) as written to memory only; the newest goes last. */
static void mark_dirty(redis_store *rs, cg_store_req *r)
{
    size_t bytes = json_dumpb(r->snapshot, NULL, 0, JSON_COMPACT) + strlen(r->key) + 64;
    json_t *old = json_object_get(rs->dirty, r->key);
    int base_unknown = json_object_get(rs->unknown, r->key) || json_is_true(json_object_get(old, "n"));
    dirty_del(rs, r->key); /* re-added at the end: the set runs from least to most recent */
    json_t *entry = json_pack("{s:s, s:s, s:I, s:I, s:b}", "u", r->eu, "r", r->er, "v", (json_int_t)++rs->dirty_seq,
                              "b", (json_int_t)bytes, "n", base_unknown);
    if (!entry || json_object_set_new(rs->dirty, r->key, entry) < 0) {
        cg_error("redis %s:%d: out of memory: a dialog will not be written back", rs->host, rs->port);
        rs->base.stats.writeback_dropped_bound++;
        return;
    }
    rs->dirty_bytes += (long)bytes;
    dirty_bound(rs);
    dirty_gauges(rs);
}

/* ---- requests -------------------------------------------------------------------------- */

static void req_closed(uv_handle_t *h)
{
    cg_store_req *r = h->data;
    redis_store *rs = r->rs;
    json_decref(r->snapshot);
    free(r->user);
    free(r->eu);
    free(r->er);
    free(r->key);
    free(r);
    rs->handles--;
    store_free_if_done(rs);
}

/* Frees r once the replies still due to it have come (they come, possibly NULL). */
static void req_finish(cg_store_req *r)
{
    r->finished = 1;
    if (r->steps == 0)
        uv_close((uv_handle_t *)&r->defer, req_closed);
}

static cg_store_req *req_alloc(redis_store *rs, op_kind kind, char *eu, char *er, void *ctx)
{
    cg_store_req *r = calloc(1, sizeof(*r));
    if (!r)
        abort();
    r->rs = rs;
    r->kind = kind;
    r->eu = eu;
    r->er = er;
    if (asprintf(&r->key, "%s:%s", eu, er) < 0)
        abort();
    r->ctx = ctx;
    uv_timer_init(rs->base.loop, &r->defer);
    r->defer.data = r;
    rs->handles++;
    return r;
}

static cg_store_req *req_new(redis_store *rs, op_kind kind, const char *user, const char *room, void *ctx)
{
    user = user ? user : "";
    cg_store_req *r = req_alloc(rs, kind, cg_store_escape(user), cg_store_escape(room ? room : ""), ctx);
    r->user = xstrdup(user);
    return r;
}

static void inflight_add(redis_store *rs, cg_store_req *r)
{
    r->sent_at = now_ms(rs);
    r->prev = rs->tail;
    if (rs->tail)
        rs->tail->next = r;
    else
        rs->head = r;
    rs->tail = r;
}

static void inflight_remove(redis_store *rs, cg_store_req *r)
{
    if (r->prev)
        r->prev->next = r->next;
    else
        rs->head = r->next;
    if (r->next)
        r->next->prev = r->prev;
    else
        rs->tail = r->prev;
    r->prev = r->next = NULL;
}

/* Drops r's dialog (or, for remove_user, every dialog of its user) from the write-back. */
static void forget_dirty(redis_store *rs, cg_store_req *r)
{
    if (r->kind != OP_REMOVE_USER) {
        dirty_del(rs, r->key);
        return;
    }
    const char *key;
    json_t *entry;
    void *tmp;
    json_object_foreach_safe(rs->dirty, tmp, key, entry) {
        const char *u = json_string_value(json_object_get(entry, "u"));
        if (u && strcmp(u, r->eu) == 0)
            dirty_del(rs, key);
    }
}

/* key was served fresh from memory while Redis was away: until Redis is read or written
 * for it, a save of it must not replace a copy Redis may hold. */
static void unknown_add(redis_store *rs, const char *key)
{
    while ((long)json_object_size(rs->unknown) >= rs->base.cfg.max_dialogs && json_object_size(rs->unknown))
        json_object_del(rs->unknown, json_object_iter_key(json_object_iter(rs->unknown)));
    json_object_set_new(rs->unknown, key, json_true()); /* out of memory: created_at still guards */
}

/* Answers r from memory (Redis is away or failed it), then finishes it. */
static void answer_from_memory(cg_store_req *r)
{
    redis_store *rs = r->rs;
    int64_t now = rs->base.now(rs->base.clock_ctx);
    cg_store_status st = degraded_status(rs, r->key, r->kind == OP_LOAD);
    if (r->kind == OP_LOAD) {
        cg_dialog d;
        st.found = cg_memstore_get(rs->mem, r->key, now, &d);
        if (!st.found)
            unknown_add(rs, r->key);
        if (!r->abandoned && !rs->closing)
            r->load_cb(r->ctx, &d, &st);
        else
            cg_dialog_free(&d);
    } else if (r->kind == OP_SAVE) {
        if (!r->version && r->snapshot) { /* a write-back that failed stays as it is: dirty, in memory */
            cg_dialog d;
            cg_dialog_from_json(&d, r->snapshot, now);
            cg_memstore_put(rs->mem, r->key, &d, now);
            cg_dialog_free(&d);
            mark_dirty(rs, r);
        }
        if (!r->abandoned && !rs->closing && r->done_cb)
            r->done_cb(r->ctx, &st);
    } else if (r->kind == OP_REMOVE || r->kind == OP_REMOVE_USER) {
        if (r->kind == OP_REMOVE)
            cg_memstore_del(rs->mem, r->key);
        else
            cg_memstore_del_user(rs->mem, r->user);
        forget_dirty(rs, r);
        if (!r->abandoned && !rs->closing && r->done_cb)
            r->done_cb(r->ctx, &st);
    }
    req_finish(r);
}

static void deferred_answer(uv_timer_t *t)
{
    answer_from_memory(t->data);
}

static void answer_later_from_memory(cg_store_req *r)
{
    uv_timer_start(&r->defer, deferred_answer, 0, 0);
}

/* ---- building commands ----------------------------------------------------------------- */

/* One command's arguments; grows as needed (a save's EVAL carries the whole dialog). */
typedef struct argv_buf {
    const char **argv;
    size_t *len;
    char **owned;
    int argc, n_owned, cap;
} argv_buf;

static void argv_grow(argv_buf *a)
{
    if (a->argc < a->cap && a->n_owned < a->cap)
        return;
    int cap = a->cap ? a->cap * 2 : 32;
    a->argv = realloc(a->argv, sizeof(*a->argv) * (size_t)cap);
    a->len = realloc(a->len, sizeof(*a->len) * (size_t)cap);
    a->owned = realloc(a->owned, sizeof(*a->owned) * (size_t)cap);
    if (!a->argv || !a->len || !a->owned)
        abort();
    a->cap = cap;
}

static void arg(argv_buf *a, const char *s, size_t n)
{
    argv_grow(a);
    a->argv[a->argc] = s;
    a->len[a->argc++] = n;
}

static void arg_str(argv_buf *a, const char *s)
{
    arg(a, s, strlen(s));
}

/* An argument the buffer owns (freed by argv_clear); s NULL (jansson out of memory) aborts. */
static void arg_own(argv_buf *a, char *s)
{
    if (!s)
        abort();
    argv_grow(a);
    a->owned[a->n_owned++] = s;
    arg_str(a, s);
}

static void arg_fmt(argv_buf *a, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void arg_fmt(argv_buf *a, const char *fmt, ...)
{
    char *s;
    va_list ap;
    va_start(ap, fmt);
    if (vasprintf(&s, fmt, ap) < 0)
        abort();
    va_end(ap);
    arg_own(a, s);
}

/* A JSON value as an argument; jansson fails only on memory, or on a value it cannot
 * encode, which the dialog never holds: "null" then, not a crash. */
static void arg_json(argv_buf *a, const json_t *v)
{
    char *s = json_dumps(v ? v : json_null(), JSON_COMPACT | JSON_ENCODE_ANY);
    arg_own(a, s ? s : xstrdup("null"));
}

static void argv_clear(argv_buf *a)
{
    for (int i = 0; i < a->n_owned; i++)
        free(a->owned[i]);
    a->argc = a->n_owned = 0;
}

static void argv_free(argv_buf *a)
{
    argv_clear(a);
    free(a->argv);
    free(a->len);
    free(a->owned);
}

/* Returns 0, or -1 when hiredis refused the command (its context is being freed). */
static int send_argv(redis_store *rs, argv_buf *a, redisCallbackFn *fn, void *priv)
{
    int rc = rs->ac ? redisAsyncCommandArgv(rs->ac, fn, priv, a->argc, a->argv, a->len) : REDIS_ERR;
    argv_clear(a);
    return rc == REDIS_OK ? 0 : -1;
}

/* A command before r's last: its reply only says whether it failed. */
static void on_step_reply(redisAsyncContext *ac, void *reply_, void *priv)
{
    (void)ac;
    cg_store_req *r = priv;
    redisReply *reply = reply_;
    if (!reply || reply->type == REDIS_REPLY_ERROR) {
        if (reply)
            cg_warn("redis %s:%d: %s", r->rs->host, r->rs->port, reply->str);
        r->step_failed = 1;
    }
    r->steps--;
    if (r->finished && r->steps == 0)
        req_finish(r);
}

static void send_step(redis_store *rs, argv_buf *a, cg_store_req *r)
{
    if (send_argv(rs, a, on_step_reply, r) == 0)
        r->steps++;
    else
        r->step_failed = 1;
}

/* Sends r's last command; r is answered from memory if that fails. */
static void send_last(redis_store *rs, argv_buf *a, redisCallbackFn *fn, cg_store_req *r)
{
    if (send_argv(rs, a, fn, r) < 0) {
        rs->base.stats.errors++;
        answer_later_from_memory(r);
        return;
    }
    inflight_add(rs, r);
}

/* One key of the dialog whose key part is key ("<eu>:<er>"): the one builder of every
 * dialog key, with its real length. */
static char *dialog_key(redis_store *rs, const char *key, const char *part)
{
    char *s;
    if (asprintf(&s, "%s:{%s}:%s", rs->base.cfg.prefix, key, part) < 0)
        abort();
    return s;
}

static char *rooms_key(redis_store *rs, const char *eu)
{
    char *s;
    if (asprintf(&s, "%s:user:{%s}:rooms", rs->base.cfg.prefix, eu) < 0)
        abort();
    return s;
}

static const char *const parts[] = {"params", "dialog", "awaiting", "soft", "history"};

/* EVAL <script> 5 <the dialog's five keys> */
static void arg_eval(redis_store *rs, argv_buf *a, const char *script, const char *key)
{
    arg_str(a, "EVAL");
    arg_str(a, script);
    arg_str(a, "5");
    for (int i = 0; i < 5; i++)
        arg_own(a, dialog_key(rs, key, parts[i]));
}

/* ---- load ------------------------------------------------------------------------------ */

/* The five reads in one atomic step (GET's nil comes back as nil: false in a Lua table). */
static const char load_script[] =
    "return {redis.call('HGETALL', KEYS[1]), redis.call('HGETALL', KEYS[2]), redis.call('GET', KEYS[3]),"
    " redis.call('GET', KEYS[4]), redis.call('LRANGE', KEYS[5], 0, -1)}";

static json_t *parse_json_reply(redisReply *r)
{
    return r && r->type == REDIS_REPLY_STRING ? json_loadb(r->str, r->len, JSON_DECODE_ANY | JSON_ALLOW_NUL, NULL) : NULL;
}

/* Sets key in obj to v (stolen); a failure (out of memory, a key jansson refuses) is logged. */
static void set_checked(json_t *obj, const char *key, size_t key_len, json_t *v)
{
    if (!v || json_object_setn_new(obj, key, key_len, v) < 0)
        cg_warn("redis: dropped the field '%.*s' of a dialog read back (not valid UTF-8, or out of memory)",
                (int)(key_len > 64 ? 64 : key_len), key);
}

/* params: fields "<service>.<name>" -> JSON, into {service: {name: value}} */
static json_t *params_from_reply(redisReply *rep)
{
    json_t *params = json_object();
    for (size_t i = 0; params && rep->type == REDIS_REPLY_ARRAY && i + 1 < rep->elements; i += 2) {
        redisReply *f = rep->element[i];
        const char *dot = f->type == REDIS_REPLY_STRING ? memchr(f->str, '.', f->len) : NULL;
        json_t *v = parse_json_reply(rep->element[i + 1]);
        if (!dot || !v) {
            json_decref(v);
            continue;
        }
        size_t service_len = (size_t)(dot - f->str);
        json_t *svc = json_object_getn(params, f->str, service_len);
        if (!svc) {
            svc = json_object();
            if (!svc || json_object_setn_new(params, f->str, service_len, svc) < 0) {
                set_checked(params, f->str, service_len, NULL);
                json_decref(v);
                continue;
            }
        }
        set_checked(svc, dot + 1, f->len - service_len - 1, v);
    }
    return params;
}

/* An expiring part ({...,"expires_at":N}) into j's `name` and `name_expires`. */
static void expiring_from_reply(json_t *j, redisReply *rep, const char *name, const char *expires_name)
{
    json_t *v = parse_json_reply(rep);
    if (!json_is_object(v)) {
        json_decref(v);
        return;
    }
    json_t *expires = json_object_get(v, "expires_at");
    if (expires)
        json_object_set(j, expires_name, expires);
    json_object_del(v, "expires_at");
    set_checked(j, name, strlen(name), v);
}

/* Turns the five replies of a load into the JSON cg_dialog_from_json reads; NULL when out
 * of memory. */
static json_t *dialog_from_replies(redisReply **rep)
{
    json_t *j = json_object(), *meta = json_object(), *history = json_array();
    if (!j || !meta || !history) {
        json_decref(j);
        json_decref(meta);
        json_decref(history);
        return NULL;
    }
    set_checked(j, "params", 6, params_from_reply(rep[0]));
    for (size_t i = 0; rep[1]->type == REDIS_REPLY_ARRAY && i + 1 < rep[1]->elements; i += 2) {
        redisReply *f = rep[1]->element[i], *v = rep[1]->element[i + 1];
        if (f->type != REDIS_REPLY_STRING || v->type != REDIS_REPLY_STRING)
            continue;
        if (strcmp(f->str, "service") == 0)
            set_checked(j, "service", 7, json_stringn(v->str, v->len));
        else if (strcmp(f->str, "last_tool_result") == 0)
            set_checked(j, "last_tool_result", 16, parse_json_reply(v));
        else
            set_checked(meta, f->str, f->len, json_integer(strtoll(v->str, NULL, 10)));
    }
    set_checked(j, "meta", 4, meta);
    expiring_from_reply(j, rep[2], "awaiting", "awaiting_expires");
    expiring_from_reply(j, rep[3], "soft_context", "soft_expires");
    for (size_t i = 0; rep[4]->type == REDIS_REPLY_ARRAY && i < rep[4]->elements; i++) {
        json_t *m = parse_json_reply(rep[4]->element[i]);
        if (!json_is_object(m) || json_array_append_new(history, m) < 0)
            json_decref(json_is_object(m) ? NULL : m);
    }
    set_checked(j, "history", 7, history);
    return j;
}

/* A reply that failed: NULL (connection gone) or an error; logs the error's text. */
static int reply_failed(redis_store *rs, redisReply *reply, size_t want_elements, const char *what)
{
    if (!reply)
        return 1;
    if (reply->type == REDIS_REPLY_ERROR) {
        cg_warn("redis %s:%d: %s failed: %s", rs->host, rs->port, what, reply->str);
        return 1;
    }
    if (want_elements && (reply->type != REDIS_REPLY_ARRAY || reply->elements != want_elements)) {
        cg_warn("redis %s:%d: %s: unexpected answer (type %d)", rs->host, rs->port, what, reply->type);
        return 1;
    }
    return 0;
}

static void on_load_reply(redisAsyncContext *ac, void *reply_, void *priv)
{
    (void)ac;
    cg_store_req *r = priv;
    redis_store *rs = r->rs;
    redisReply *reply = reply_;
    inflight_remove(rs, r);
    json_t *j = NULL;
    if (reply_failed(rs, reply, 5, "load") || !(j = dialog_from_replies(reply->element))) {
        rs->base.stats.errors++;
        answer_from_memory(r);
        return;
    }
    int64_t now = rs->base.now(rs->base.clock_ctx);
    cg_dialog d;
    cg_dialog_from_json(&d, j, now);
    json_decref(j);
    cg_memstore_put(rs->mem, r->key, &d, now); /* the copy that survives an outage */
    json_object_del(rs->unknown, r->key);      /* Redis's copy is known now */
    cg_store_status st = {0, 0, 0};
    for (size_t i = 0; i < reply->elements; i++) /* any of the five keys there */
        st.found |= reply->element[i]->type == REDIS_REPLY_STRING ||
                    (reply->element[i]->type == REDIS_REPLY_ARRAY && reply->element[i]->elements > 0);
    if (!r->abandoned && !rs->closing)
        r->load_cb(r->ctx, &d, &st);
    else
        cg_dialog_free(&d);
    req_finish(r);
}

static void send_load(redis_store *rs, cg_store_req *r)
{
    argv_buf a = {0};
    arg_eval(rs, &a, load_script, r->key);
    send_last(rs, &a, on_load_reply, r);
    argv_free(&a);
}

/* ---- save ------------------------------------------------------------------------------ */

/*
 * The save, one atomic step on the dialog's five keys. ARGV: 1 created_at, 2 last_activity,
 * 3 the mode: "0" a save, "1" a write-back (also refused when Redis's copy is newer), "2" a
 * dialog that began from nothing while Redis was away (written only if Redis has none), 4-6 params_s, dialog_s,
 * history_s, 7 turn_count, 8 message_count, 9 service, 10 "1" when there is a service,
 * 11 last_tool_result, 12-13 awaiting and its EX (0: none), 14-15 soft and its EX,
 * 16 the number of params, then the params' field-value pairs, then the history.
 * Returns 1 when written, 0 when Redis holds another incarnation, -1 a newer copy.
 */
static const char save_script[] =
    "if ARGV[3] == '2' and redis.call('EXISTS', KEYS[1], KEYS[2], KEYS[5]) > 0 then return 0 end\n"
    "local have = redis.call('HMGET', KEYS[2], 'created_at', 'last_activity')\n"
    "if have[1] and have[1] ~= ARGV[1] then return 0 end\n"
    "if ARGV[3] == '1' and have[2] and tonumber(have[2]) > tonumber(ARGV[2]) then return -1 end\n"
    "local function chunks(cmd, key, from, to, step)\n"
    "  for i = from, to, step do\n"
    "    redis.call(cmd, key, unpack(ARGV, i, math.min(i + step - 1, to)))\n"
    "  end\n"
    "end\n"
    "local np = tonumber(ARGV[16])\n"
    "redis.call('DEL', KEYS[1])\n"
    "if np > 0 then\n"
    "  chunks('HSET', KEYS[1], 17, 16 + 2 * np, 200)\n"
    "  redis.call('EXPIRE', KEYS[1], ARGV[4])\n"
    "end\n"
    "redis.call('HSET', KEYS[2], 'created_at', ARGV[1], 'last_activity', ARGV[2], 'turn_count', ARGV[7],\n"
    "           'message_count', ARGV[8], 'last_tool_result', ARGV[11])\n"
    "if ARGV[10] == '1' then redis.call('HSET', KEYS[2], 'service', ARGV[9])\n"
    "else redis.call('HDEL', KEYS[2], 'service') end\n"
    "redis.call('EXPIRE', KEYS[2], ARGV[5])\n"
    "if ARGV[13] ~= '0' then redis.call('SET', KEYS[3], ARGV[12], 'EX', ARGV[13])\n"
    "else redis.call('DEL', KEYS[3]) end\n"
    "if ARGV[15] ~= '0' then redis.call('SET', KEYS[4], ARGV[14], 'EX', ARGV[15])\n"
    "else redis.call('DEL', KEYS[4]) end\n"
    "redis.call('DEL', KEYS[5])\n"
    "if #ARGV > 16 + 2 * np then\n"
    "  chunks('RPUSH', KEYS[5], 17 + 2 * np, #ARGV, 200)\n"
    "  redis.call('EXPIRE', KEYS[5], ARGV[6])\n"
    "end\n"
    "return 1\n";

/* Redis kept its own copy (save_script's 0 or -1): this one is dropped, from memory too, so
 * the next load reads Redis's. */
static void save_refused(redis_store *rs, cg_store_req *r, long long why)
{
    rs->base.stats.save_conflicts++;
    cg_warn("redis %s:%d: a %s of a dialog was not written: Redis holds %s; its copy is kept", rs->host, rs->port,
            r->version ? "write-back" : "save",
            why == 0 ? "another copy (this one began while Redis was away)" : "a newer copy");
    cg_memstore_del(rs->mem, r->key);
    json_object_del(rs->unknown, r->key); /* the next load reads Redis's copy */
}

static void on_save_reply(redisAsyncContext *ac, void *reply_, void *priv)
{
    (void)ac;
    cg_store_req *r = priv;
    redis_store *rs = r->rs;
    redisReply *reply = reply_;
    inflight_remove(rs, r);
    if (reply_failed(rs, reply, 0, "save") || r->step_failed || reply->type != REDIS_REPLY_INTEGER) {
        rs->base.stats.errors++;
        answer_from_memory(r); /* keeps it in memory, dirty, for the write-back */
        return;
    }
    json_t *entry = r->version ? json_object_get(rs->dirty, r->key) : NULL;
    if (entry && json_integer_value(json_object_get(entry, "v")) == r->version) {
        dirty_del(rs, r->key); /* a write-back: done */
        if (reply->integer == 1)
            rs->base.stats.flushed++;
    } else if (entry && reply->integer == 1 && rs->state == R_CONNECTED) {
        /* changed meanwhile: its newer version, now; Redis holds this dialog's copy now, so
         * the newer one is an update, not a create-only (that would be refused) */
        json_object_set_new(entry, "n", json_false());
        json_object_del(rs->unknown, r->key);
        flush_one(rs, r->key, entry);
    }
    if (reply->integer == 1)
        json_object_del(rs->unknown, r->key); /* written: Redis's copy is ours, known */
    if (reply->integer != 1) {
        save_refused(rs, r, reply->integer);
        if (entry && json_object_get(rs->dirty, r->key) == entry)
            dirty_del(rs, r->key); /* a newer outage write of the same copy: refused too */
    } else if (!r->version) {
        int64_t now = rs->base.now(rs->base.clock_ctx);
        cg_dialog d;
        cg_dialog_from_json(&d, r->snapshot, now);
        cg_memstore_put(rs->mem, r->key, &d, now);
        cg_dialog_free(&d);
    }
    static const cg_store_status ok = {0, 0, 0};
    if (!r->abandoned && !rs->closing && r->done_cb)
        r->done_cb(r->ctx, &ok);
    req_finish(r);
}

/* An expiring part and its EX: "0" when it is absent or already expired. */
static void arg_expiring(argv_buf *a, json_t *value, int64_t expires, int64_t now, int64_t *longest)
{
    if (!value || expires <= now) {
        arg_str(a, "");
        arg_str(a, "0");
        return;
    }
    json_t *copy = json_deep_copy(value);
    if (!copy || json_object_set_new(copy, "expires_at", json_integer(expires)) < 0)
        abort(); /* out of memory */
    arg_json(a, copy);
    json_decref(copy);
    arg_fmt(a, "%lld", (long long)(expires - now));
    if (expires - now > *longest)
        *longest = expires - now;
}

static void send_save(redis_store *rs, cg_store_req *r)
{
    const cg_lifetimes *lt = &rs->base.cfg.lifetimes;
    int64_t now = rs->base.now(rs->base.clock_ctx);
    cg_dialog d;
    cg_dialog_from_json(&d, r->snapshot, now);
    argv_buf a = {0};
    int64_t longest = lt->dialog_s; /* how long the rooms set must outlive this save */
    if (lt->params_s > longest)
        longest = lt->params_s;
    if (lt->history_s > longest)
        longest = lt->history_s;

    arg_eval(rs, &a, save_script, r->key);
    arg_fmt(&a, "%lld", (long long)d.created_at);
    arg_fmt(&a, "%lld", (long long)d.last_activity);
    arg_str(&a, r->base_unknown || json_object_get(rs->unknown, r->key) ? "2" : r->version ? "1" : "0");
    arg_fmt(&a, "%ld", lt->params_s);
    arg_fmt(&a, "%ld", lt->dialog_s);
    arg_fmt(&a, "%ld", lt->history_s);
    arg_fmt(&a, "%ld", d.turn_count);
    arg_fmt(&a, "%ld", d.message_count);
    arg_str(&a, d.service ? d.service : "");
    arg_str(&a, d.service ? "1" : "0");
    arg_json(&a, d.last_tool_result);
    arg_expiring(&a, d.awaiting, d.awaiting_expires, now, &longest);
    arg_expiring(&a, d.soft, d.soft_expires, now, &longest);
    const char *service, *name;
    json_t *names, *value;
    size_t n_params = 0;
    json_object_foreach(d.params, service, names) n_params += json_object_size(names);
    arg_fmt(&a, "%zu", n_params);
    json_object_foreach(d.params, service, names) {
        json_object_foreach(names, name, value) {
            arg_fmt(&a, "%s.%s", service, name);
            arg_json(&a, value);
        }
    }
    size_t i;
    json_t *m;
    json_array_foreach(d.history, i, m) arg_json(&a, m);

    /* the rooms set first, outside the dialog's step (another hash tag) */
    argv_buf rooms = {0};
    arg_str(&rooms, "SADD");
    arg_own(&rooms, rooms_key(rs, r->eu));
    arg_str(&rooms, r->er);
    send_step(rs, &rooms, r);
    arg_str(&rooms, "EXPIRE");
    arg_own(&rooms, rooms_key(rs, r->eu));
    arg_fmt(&rooms, "%lld", (long long)longest);
    send_step(rs, &rooms, r);
    argv_free(&rooms);

    send_last(rs, &a, on_save_reply, r);
    argv_free(&a);
    cg_dialog_free(&d); /* after the send: the arguments borrow d.service */
}

/* ---- remove ---------------------------------------------------------------------------- */

static void on_remove_reply(redisAsyncContext *ac, void *reply_, void *priv)
{
    (void)ac;
    cg_store_req *r = priv;
    redis_store *rs = r->rs;
    inflight_remove(rs, r);
    if (reply_failed(rs, reply_, 0, "delete") || r->step_failed) {
        rs->base.stats.errors++;
        answer_from_memory(r);
        return;
    }
    if (r->kind == OP_REMOVE)
        cg_memstore_del(rs->mem, r->key);
    static const cg_store_status ok = {0, 0, 0};
    if (!r->abandoned && !rs->closing && r->done_cb)
        r->done_cb(r->ctx, &ok);
    req_finish(r);
}

/* DEL of the five keys of the dialog whose key part is key: one hash tag, one step. */
static void arg_del_dialog(redis_store *rs, argv_buf *a, const char *key)
{
    arg_str(a, "DEL");
    for (int i = 0; i < 5; i++)
        arg_own(a, dialog_key(rs, key, parts[i]));
}

static void send_remove(redis_store *rs, cg_store_req *r)
{
    argv_buf a = {0};
    arg_del_dialog(rs, &a, r->key);
    send_step(rs, &a, r);
    arg_str(&a, "SREM"); /* after the data: forget-user must find a room as long as it has data */
    arg_own(&a, rooms_key(rs, r->eu));
    arg_str(&a, r->er);
    send_last(rs, &a, on_remove_reply, r);
    argv_free(&a);
}

/* ---- the connection -------------------------------------------------------------------- */

/* Writes back one dirty dialog as memory holds it; returns 0, or -1 when memory no longer
 * holds it (evicted or expired): it is dropped then, never written blank over Redis's copy. */
static int flush_one(redis_store *rs, const char *key, json_t *entry)
{
    const char *eu = json_string_value(json_object_get(entry, "u"));
    const char *er = json_string_value(json_object_get(entry, "r"));
    cg_dialog d;
    if (!eu || !er || !cg_memstore_get(rs->mem, key, rs->base.now(rs->base.clock_ctx), &d)) {
        if (eu && er)
            cg_dialog_free(&d);
        dirty_del(rs, key);
        rs->base.stats.writeback_dropped_gone++;
        return -1;
    }
    cg_store_req *r = req_alloc(rs, OP_SAVE, xstrdup(eu), xstrdup(er), NULL);
    r->user = xstrdup("");
    r->snapshot = cg_dialog_to_json(&d);
    cg_dialog_free(&d);
    r->version = (long)json_integer_value(json_object_get(entry, "v"));
    r->base_unknown = json_is_true(json_object_get(entry, "n"));
    if (r->snapshot) {
        send_save(rs, r);
        /* Redis runs this write-back before any save sent after it on the connection: those
         * are updates of this copy (created_at still guards them), not create-only */
        json_object_del(rs->unknown, key);
    } else
        req_finish(r); /* out of memory: still dirty, tried again at the next reconnect */
    return 0;
}

static void flush_dirty(redis_store *rs)
{
    const char *key;
    json_t *entry;
    void *tmp;
    long gone = 0;
    size_t sent = 0;
    json_object_foreach_safe(rs->dirty, tmp, key, entry) {
        if (flush_one(rs, key, entry) < 0)
            gone++;
        else
            sent++;
    }
    if (gone)
        cg_warn("redis %s:%d: %ld dialogs written during the outage are no longer held in memory (evicted or "
                "expired): not written back, Redis keeps its copy",
                rs->host, rs->port, gone);
    if (sent)
        cg_info("redis %s:%d: writing back %zu dialogs held in memory", rs->host, rs->port, sent);
}

static void on_reconnect_timer(uv_timer_t *t)
{
    redis_connect(t->data);
}

static void schedule_reconnect(redis_store *rs)
{
    static const int delays_ms[] = {100, 200, 500, 1000, 2000, 5000};
    int i = rs->backoff < 5 ? rs->backoff : 5;
    rs->backoff++;
    uint64_t delay = (uint64_t)delays_ms[i];
    delay += (uint64_t)(rand() % (int)(delay / 4 + 1)); /* jitter, so gateways don't reconnect in step */
    if (!rs->closing)
        uv_timer_start(&rs->connect_timer, on_reconnect_timer, delay, 0);
}

/* Drops the connection (a timeout, a failed probe, or close): every pending callback gets a
 * NULL reply. Safe inside a hiredis reply callback (hiredis frees after it returns). */
static void drop_connection(redis_store *rs, const char *why)
{
    redisAsyncContext *ac = rs->ac;
    rs->ac = NULL;
    rs->state = R_CLOSED;
    if (rs->resolve) {
        cg_resolve_abandon(rs->resolve);
        rs->resolve = NULL;
    }
    uv_timer_stop(&rs->connect_timer);
    enter_degraded(rs, why);
    if (ac)
        redisAsyncFree(ac);
    schedule_reconnect(rs);
}

/* The probe: only a PING answered makes the store use a connection (a stopped Redis
 * accepts too). An error answer (-LOADING after a restart, -NOAUTH for a wrong password,
 * -MASTERDOWN) drops it, to try again with the backoff. */
static void on_ping(redisAsyncContext *ac, void *reply_, void *priv)
{
    cg_store_req *r = priv;
    redis_store *rs = r->rs;
    redisReply *reply = reply_;
    inflight_remove(rs, r);
    req_finish(r);
    if (ac != rs->ac || !reply)
        return; /* an older connection, or this one gone (on_disconnect or a timeout saw to it) */
    if (reply->type == REDIS_REPLY_ERROR || rs->setup_failed) {
        char why[200];
        snprintf(why, sizeof(why), "the connection's PING was answered '%.120s'",
                 reply->type == REDIS_REPLY_ERROR ? reply->str : "after a failed SELECT");
        rs->base.stats.errors++;
        drop_connection(rs, why);
        return;
    }
    rs->state = R_CONNECTED;
    rs->backoff = 0;
    if (rs->ever_connected)
        rs->base.stats.reconnects++;
    rs->ever_connected = 1;
    cg_info("redis %s:%d: connected", rs->host, rs->port);
    leave_degraded(rs);
    flush_dirty(rs);
    drain_waiting(rs);
}

static void on_connect(const redisAsyncContext *ac, int status)
{
    redis_store *rs = ac->data;
    if (ac != rs->ac)
        return;
    uv_timer_stop(&rs->connect_timer);
    if (status != REDIS_OK) {
        /* hiredis frees the context after this callback */
        rs->ac = NULL;
        rs->state = R_CLOSED;
        enter_degraded(rs, ac->errstr[0] ? ac->errstr : "connection failed");
        schedule_reconnect(rs);
        return;
    }
    /* Connected at the TCP level; the PING decides (on_ping), within the command timeout. */
    rs->state = R_PROBING;
    cg_store_req *r = req_new(rs, OP_PING, "", "", NULL);
    if (redisAsyncCommand(rs->ac, on_ping, r, "PING") == REDIS_OK)
        inflight_add(rs, r);
    else
        req_finish(r);
}

static void on_disconnect(const redisAsyncContext *ac, int status)
{
    redis_store *rs = ac->data;
    (void)status;
    if (ac != rs->ac)
        return; /* we freed it ourselves */
    rs->ac = NULL;
    if (rs->closing) { /* the graceful close of rs_close is complete */
        uv_timer_stop(&rs->connect_timer);
        finish_close(rs);
        return;
    }
    rs->state = R_CLOSED;
    enter_degraded(rs, ac->errstr[0] ? ac->errstr : "connection closed");
    schedule_reconnect(rs);
}

static void on_connect_timeout(uv_timer_t *t)
{
    redis_store *rs = t->data;
    drop_connection(rs, rs->state == R_RESOLVING ? "resolving the host timed out" : "connect timed out");
}

static void on_auth(redisAsyncContext *ac, void *reply, void *priv)
{
    (void)priv;
    redis_store *rs = ac->data;
    reply_failed(rs, reply, 0, "AUTH"); /* logged; a server that needs it answers the PING -NOAUTH */
}

static void on_select(redisAsyncContext *ac, void *reply, void *priv)
{
    (void)priv;
    redis_store *rs = ac->data;
    if (ac == rs->ac && reply && reply_failed(rs, reply, 0, "SELECT"))
        rs->setup_failed = 1; /* the PING's answer drops the connection: never the wrong database */
}

/* Connects to a numeric address (hiredis's own getaddrinfo then never waits on DNS). */
static void connect_to(redis_store *rs, const char *address)
{
    if (!rs->address || strcmp(rs->address, address) != 0) {
        cg_info("redis %s:%d: connecting to %s", rs->host, rs->port, address);
        free(rs->address);
        rs->address = xstrdup(address);
    }
    redisAsyncContext *ac = redisAsyncConnect(address, rs->port);
    if (!ac || ac->err) {
        uv_timer_stop(&rs->connect_timer);
        rs->state = R_CLOSED;
        enter_degraded(rs, ac ? ac->errstr : "out of memory");
        if (ac)
            redisAsyncFree(ac);
        schedule_reconnect(rs);
        return;
    }
    ac->data = rs;
    rs->ac = ac;
    rs->state = R_CONNECTING;
    rs->setup_failed = 0;
    redisLibuvAttach(ac, rs->base.loop);
    redisAsyncSetConnectCallback(ac, on_connect);
    redisAsyncSetDisconnectCallback(ac, on_disconnect);
    if (rs->password) {
        const char *argv[] = {"AUTH", rs->password};
        size_t len[] = {4, strlen(rs->password)};
        redisAsyncCommandArgv(ac, on_auth, NULL, 2, argv, len);
    }
    if (rs->db)
        redisAsyncCommand(ac, on_select, NULL, "SELECT %d", rs->db);
}

static void on_resolved(void *data, const char *address, const char *err)
{
    redis_store *rs = data;
    rs->resolve = NULL;
    if (!address) {
        uv_timer_stop(&rs->connect_timer);
        rs->state = R_CLOSED;
        enter_degraded(rs, err);
        schedule_reconnect(rs);
        return;
    }
    connect_to(rs, address);
}

/* Every (re)connect resolves the host again, off the loop: its address may have moved. */
static void redis_connect(redis_store *rs)
{
    if (rs->closing)
        return;
    rs->state = R_RESOLVING;
    uv_update_time(rs->base.loop); /* at startup the loop's time is as old as the loop */
    uv_timer_start(&rs->connect_timer, on_connect_timeout, (uint64_t)rs->base.cfg.connect_timeout_ms, 0);
    rs->resolve = cg_resolve_start(rs->base.loop, rs->host, on_resolved, rs);
    if (!rs->resolve)
        drop_connection(rs, "could not start resolving the host");
}

/* Every 100 ms: has the oldest command waited too long? */
static void on_tick(uv_timer_t *t)
{
    redis_store *rs = t->data;
    if (rs->head && now_ms(rs) - rs->head->sent_at > (uint64_t)rs->base.cfg.command_timeout_ms) {
        rs->base.stats.errors++;
        char why[96];
        snprintf(why, sizeof(why), "no answer for %ld ms", rs->base.cfg.command_timeout_ms);
        drop_connection(rs, why);
    }
}

/* ---- the ops --------------------------------------------------------------------------- */

static int usable(redis_store *rs, const char *key)
{
    return rs->state == R_CONNECTED && rs->ac && !json_object_get(rs->dirty, key);
}

/* Starts r on Redis or answers it from memory, as the connection stands now. */
static void dispatch(redis_store *rs, cg_store_req *r)
{
    int connected = rs->state == R_CONNECTED && rs->ac && !rs->closing;
    if (r->kind == OP_LOAD && usable(rs, r->key) && !rs->closing) {
        send_load(rs, r);
    } else if (r->kind == OP_SAVE && r->snapshot && usable(rs, r->key) && !rs->closing) {
        send_save(rs, r);
    } else if (r->kind == OP_SAVE && r->snapshot) {
        /* written to memory now, so a load queued after this save sees it */
        int64_t now = rs->base.now(rs->base.clock_ctx);
        cg_dialog d;
        cg_dialog_from_json(&d, r->snapshot, now);
        cg_memstore_put(rs->mem, r->key, &d, now);
        cg_dialog_free(&d);
        mark_dirty(rs, r);
        json_decref(r->snapshot); /* held in memory now: answer_from_memory only answers it */
        r->snapshot = NULL;
        answer_later_from_memory(r);
    } else if (r->kind == OP_REMOVE && connected) {
        send_remove(rs, r);
    } else if (r->kind == OP_REMOVE_USER && connected) {
        argv_buf a = {0};
        arg_str(&a, "SMEMBERS");
        arg_own(&a, rooms_key(rs, r->eu));
        send_last(rs, &a, on_rooms_reply, r);
        argv_free(&a);
    } else {
        answer_later_from_memory(r); /* a delete while degraded: the caller is told (503 at the admin API) */
    }
}

/* Requests made before the first connection is decided wait for it (a gateway just started
 * has not had its PING answered yet), rather than being served from an empty memory. */
static void start_or_wait(redis_store *rs, cg_store_req *r)
{
    if (rs->state == R_CONNECTED || rs->base.stats.degraded || rs->closing) {
        dispatch(rs, r);
        return;
    }
    if (rs->waiting_tail)
        rs->waiting_tail->wait_next = r;
    else
        rs->waiting = r;
    rs->waiting_tail = r;
}

static void drain_waiting(redis_store *rs)
{
    cg_store_req *r = rs->waiting;
    rs->waiting = rs->waiting_tail = NULL;
    while (r) {
        cg_store_req *next = r->wait_next;
        r->wait_next = NULL;
        dispatch(rs, r);
        r = next;
    }
}

static cg_store_req *rs_load(cg_store *st, const char *user, const char *room, cg_store_load_fn cb, void *ctx)
{
    redis_store *rs = (redis_store *)st;
    st->stats.loads++;
    cg_store_req *r = req_new(rs, OP_LOAD, user, room, ctx);
    r->load_cb = cb;
    start_or_wait(rs, r);
    return r;
}

static cg_store_req *rs_save(cg_store *st, const char *user, const char *room, const cg_dialog *d,
                             cg_store_done_fn cb, void *ctx)
{
    redis_store *rs = (redis_store *)st;
    st->stats.saves++;
    cg_store_req *r = req_new(rs, OP_SAVE, user, room, ctx);
    r->done_cb = cb;
    r->snapshot = cg_dialog_to_json(d);
    if (!r->snapshot) /* out of memory: nothing written, nothing overwritten */
        cg_error("redis %s:%d: out of memory: a dialog was not saved", rs->host, rs->port);
    start_or_wait(rs, r);
    return r;
}

static cg_store_req *rs_remove(cg_store *st, const char *user, const char *room, cg_store_done_fn cb, void *ctx)
{
    redis_store *rs = (redis_store *)st;
    st->stats.deletes++;
    cg_store_req *r = req_new(rs, OP_REMOVE, user, room, ctx);
    r->done_cb = cb;
    dirty_del(rs, r->key);
    start_or_wait(rs, r);
    return r;
}

/* Last step of remove_user: every dialog is gone; now the rooms set. */
static void on_forget_dialogs_reply(redisAsyncContext *ac, void *reply_, void *priv)
{
    (void)ac;
    cg_store_req *r = priv;
    redis_store *rs = r->rs;
    inflight_remove(rs, r);
    if (reply_failed(rs, reply_, 0, "forget user (DEL)") || r->step_failed || !rs->ac) {
        rs->base.stats.errors++;
        answer_from_memory(r); /* the rooms set stays, so a retry finds them */
        return;
    }
    argv_buf a = {0};
    arg_str(&a, "DEL");
    arg_own(&a, rooms_key(rs, r->eu));
    send_last(rs, &a, on_remove_reply, r);
    argv_free(&a);
}

/* Second step of remove_user: the rooms are known; each dialog's keys go in one DEL of its
 * own hash tag, and the rooms set only once they all went. */
static void on_rooms_reply(redisAsyncContext *ac, void *reply_, void *priv)
{
    (void)ac;
    cg_store_req *r = priv;
    redis_store *rs = r->rs;
    redisReply *reply = reply_;
    inflight_remove(rs, r);
    if (reply_failed(rs, reply, 0, "forget user (SMEMBERS)") || reply->type != REDIS_REPLY_ARRAY || !rs->ac) {
        rs->base.stats.errors++;
        answer_from_memory(r);
        return;
    }
    argv_buf a = {0};
    size_t n = 0;
    for (size_t i = 0; i < reply->elements; i++) {
        redisReply *room = reply->element[i];
        if (room->type != REDIS_REPLY_STRING)
            continue;
        char *key; /* the room is stored escaped: "<eu>:<er>", as cg_store_dialog_key builds it */
        if (asprintf(&key, "%s:%.*s", r->eu, (int)room->len, room->str) < 0)
            abort();
        if (n++)
            send_step(rs, &a, r); /* the previous room's DEL */
        arg_del_dialog(rs, &a, key);
        free(key);
    }
    if (n) {
        send_last(rs, &a, on_forget_dialogs_reply, r);
    } else {
        arg_str(&a, "DEL");
        arg_own(&a, rooms_key(rs, r->eu));
        send_last(rs, &a, on_remove_reply, r);
    }
    argv_free(&a);
}

static cg_store_req *rs_remove_user(cg_store *st, const char *user, cg_store_done_fn cb, void *ctx)
{
    redis_store *rs = (redis_store *)st;
    st->stats.deletes++;
    cg_store_req *r = req_new(rs, OP_REMOVE_USER, user, "", ctx);
    r->done_cb = cb;
    cg_memstore_del_user(rs->mem, user);
    forget_dirty(rs, r);
    start_or_wait(rs, r);
    return r;
}

static void rs_abandon(cg_store_req *r)
{
    r->abandoned = 1;
}

static void handle_closed(uv_handle_t *h)
{
    redis_store *rs = h->data;
    rs->handles--;
    store_free_if_done(rs);
}

static void store_free_if_done(redis_store *rs)
{
    if (!rs->closing || rs->handles > 0)
        return;
    cg_memstore_free(rs->mem);
    json_decref(rs->dirty);
    json_decref(rs->warned);
    json_decref(rs->unknown);
    free(rs->host);
    free(rs->password);
    free(rs->address);
    free(rs);
}

/* The last step of close: the timers go, and the store with the last handle. */
static void finish_close(redis_store *rs)
{
    if (uv_is_closing((uv_handle_t *)&rs->connect_timer))
        return;
    uv_close((uv_handle_t *)&rs->connect_timer, handle_closed);
    uv_close((uv_handle_t *)&rs->tick, handle_closed);
}

static void on_close_deadline(uv_timer_t *t)
{
    redis_store *rs = t->data;
    if (rs->ac) {
        redisAsyncContext *ac = rs->ac;
        rs->ac = NULL;
        if (rs->head)
            cg_warn("redis %s:%d: writes still unanswered at shutdown are lost", rs->host, rs->port);
        redisAsyncFree(ac);
    }
    finish_close(rs);
}

/*
 * Shutdown: the saves the sessions just made are still on their way, so the connection is
 * closed gracefully (hiredis waits for pending replies), for at most a second.
 */
static void rs_close(cg_store *st)
{
    redis_store *rs = (redis_store *)st;
    rs->closing = 1;
    drain_waiting(rs); /* answered from memory: their callers are told nothing while closing */
    uv_timer_stop(&rs->tick);
    uv_timer_stop(&rs->connect_timer);
    if (rs->resolve) { /* it frees itself; its answer never comes */
        cg_resolve_abandon(rs->resolve);
        rs->resolve = NULL;
    }
    if (json_object_size(rs->dirty))
        cg_warn("redis %s:%d: stopping with %zu dialogs not yet written back", rs->host, rs->port,
                json_object_size(rs->dirty));
    if (rs->ac && rs->state == R_CONNECTED && rs->head) {
        redisAsyncDisconnect(rs->ac);
        uv_timer_start(&rs->connect_timer, on_close_deadline, 1000, 0);
        return;
    }
    on_close_deadline(&rs->connect_timer);
}

static const cg_store_ops redis_ops = {
    .name = "redis",
    .load = rs_load,
    .save = rs_save,
    .remove = rs_remove,
    .remove_user = rs_remove_user,
    .abandon = rs_abandon,
    .close = rs_close,
};

/* The percent-decoded copy of [s, end) ("%40" for '@'), malloc'd; *len its length. */
static char *url_decode(const char *s, const char *end, size_t *len)
{
    char *out = malloc((size_t)(end - s) + 1), *p = out;
    if (!out)
        abort();
    for (const char *c = s; c < end; c++) {
        unsigned int byte;
        if (*c == '%' && end - c > 2 && sscanf(c + 1, "%2x", &byte) == 1) {
            *p++ = (char)byte;
            c += 2;
        } else {
            *p++ = *c;
        }
    }
    *p = 0;
    *len = (size_t)(p - out);
    return out;
}

/* redis://[:password@]host[:port][/db]; errors never quote the password. */
static int parse_url(redis_store *rs, const char *url, char *err, size_t errlen)
{
    const char *p = url + strlen("redis://");
    const char *at = strchr(p, '@');
    const char *shown = at ? at + 1 : url;
    if (at) {
        const char *colon = memchr(p, ':', (size_t)(at - p));
        const char *pw = colon ? colon + 1 : p;
        size_t len;
        rs->password = url_decode(pw, at, &len);
        if (strlen(rs->password) != len) {
            snprintf(err, errlen, "'...@%s': the password holds %%00", shown);
            return -1;
        }
        if (!len) {
            free(rs->password);
            rs->password = NULL;
        }
        p = at + 1;
    }
    const char *slash = strchr(p, '/');
    const char *end = slash ? slash : p + strlen(p);
    const char *colon = memchr(p, ':', (size_t)(end - p));
    const char *host_end = colon ? colon : end;
    if (host_end == p || host_end - p > 253) {
        snprintf(err, errlen, "'%s': %s (redis://HOST:PORT[/DB])", shown,
                 host_end == p ? "no host" : "the host is longer than 253 bytes");
        return -1;
    }
    if (asprintf(&rs->host, "%.*s", (int)(host_end - p), p) < 0)
        abort();
    rs->port = 6379;
    if (colon) {
        char *e;
        long port = strtol(colon + 1, &e, 10);
        if (e != end || port < 1 || port > 65535) {
            snprintf(err, errlen, "'%s': the port must be 1 to 65535", shown);
            return -1;
        }
        rs->port = (int)port;
    }
    if (slash && slash[1]) {
        char *e;
        long db = strtol(slash + 1, &e, 10);
        if (*e || db < 0 || db > 15) {
            snprintf(err, errlen, "'%s': the database must be a number from 0 to 15", shown);
            return -1;
        }
        rs->db = (int)db;
    }
    return 0;
}

cg_store *cg_store_redis_open(uv_loop_t *loop, const cg_store_config *cfg, char *err, size_t errlen)
{
    redis_store *rs = calloc(1, sizeof(*rs));
    if (!rs)
        return NULL;
    if (parse_url(rs, cfg->url, err, errlen) < 0) {
        free(rs->host);
        free(rs->password);
        free(rs);
        return NULL;
    }
    rs->base.ops = &redis_ops;
    rs->base.loop = loop;
    rs->base.cfg = *cfg;
    rs->base.now = cg_store_default_now;
    rs->dirty_max_bytes = cfg->writeback_max_bytes > 0 ? cfg->writeback_max_bytes : WRITEBACK_MAX_BYTES_DEFAULT;
    rs->mem = cg_memstore_new(cfg->max_dialogs, &cfg->lifetimes, &rs->base.stats);
    rs->dirty = json_object();
    rs->warned = json_object();
    rs->unknown = json_object();
    if (!rs->mem || !rs->dirty || !rs->warned || !rs->unknown)
        abort(); /* out of memory at startup */
    if (cfg->max_bytes > 0)
        cg_memstore_set_max_bytes(rs->mem, cfg->max_bytes);
    uv_timer_init(loop, &rs->connect_timer);
    uv_timer_init(loop, &rs->tick);
    rs->connect_timer.data = rs->tick.data = rs;
    rs->handles = 2;
    uv_timer_start(&rs->tick, on_tick, 100, 100);
    uv_unref((uv_handle_t *)&rs->tick);
    redis_connect(rs);
    return &rs->base;
}
