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
 * A load is one MULTI/EXEC of five reads; a save one MULTI/EXEC that rewrites the dialog's
 * keys with their lifetimes: one round trip each. (The gateway holds the whole dialog for
 * the turn, so rewriting is simpler than HSET/HDEL deltas and gives the same keys.)
 *
 * Faults. hiredis 0.14 has no connect or command timeout, so this file keeps its own
 * (h2o's lib/common/redis.c does the same): a connect timer, and a 100 ms tick that fails
 * the connection when the oldest command has waited command_timeout_ms (Redis stopped with
 * SIGSTOP keeps its socket open and answers nothing). Failing means redisAsyncFree, after
 * which hiredis calls every pending callback with a NULL reply. While Redis is away the
 * store answers from an in-memory store (a write-through copy of what it last read or
 * wrote, so a conversation keeps its context), marks what it wrote there dirty, and writes
 * the dirty dialogs back when a reconnect (with backoff and jitter) answers a PING.
 */
#define _GNU_SOURCE /* asprintf */
#include <hiredis/async.h>
#include <hiredis/hiredis.h>
#include <hiredis/adapters/libuv.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "chatgate/log.h"
#include "chatgate/store.h"

typedef enum { R_CLOSED, R_CONNECTING, R_PROBING, R_CONNECTED } redis_state;
typedef enum { OP_LOAD, OP_SAVE, OP_REMOVE, OP_REMOVE_USER, OP_PING } op_kind;

typedef struct redis_store redis_store;

struct cg_store_req {
    redis_store *rs;
    op_kind kind;
    char *user, *room, *key;
    json_t *snapshot; /* save: the dialog as written */
    long version;     /* save of a dirty dialog: the dirty version it writes back */
    cg_store_load_fn load_cb;
    cg_store_done_fn done_cb;
    void *ctx;
    int abandoned;
    uint64_t sent_at;
    cg_store_req *prev, *next; /* in flight, oldest first */
    uv_timer_t defer;          /* answers from memory come through this */
};

struct redis_store {
    cg_store base;
    char host[256];
    int port, db;
    char password[256];
    redisAsyncContext *ac;
    redis_state state;
    uv_timer_t connect_timer; /* connect timeout, then reconnect backoff */
    uv_timer_t tick;          /* command timeouts */
    int backoff;
    int ever_connected;
    cg_memstore *mem;
    json_t *dirty;  /* key -> {"user","room","v"}: written to memory only */
    json_t *warned; /* keys told "store_degraded" in this outage */
    long dirty_seq;
    cg_store_req *head, *tail;
    int handles; /* open uv handles + requests: freed when 0 after close */
    int closing;
};

static void redis_connect(redis_store *rs);
static void store_free_if_done(redis_store *rs);
static void finish_close(redis_store *rs);

static uint64_t now_ms(redis_store *rs)
{
    return uv_now(rs->base.loop);
}

/* ---- degraded mode --------------------------------------------------------------------- */

static void enter_degraded(redis_store *rs, const char *why)
{
    if (rs->base.stats.degraded)
        return;
    rs->base.stats.degraded = 1;
    rs->base.stats.degraded_since_ms = now_ms(rs);
    cg_warn("redis %s:%d: %s; serving dialogs from memory until it is back", rs->host, rs->port, why);
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
        json_object_set_new(rs->warned, key, json_true());
        st.warn = 1;
    }
    rs->base.stats.degraded_answers++;
    return st;
}

static void mark_dirty(redis_store *rs, cg_store_req *r)
{
    json_object_set_new(rs->dirty, r->key, json_pack("{s:s, s:s, s:I}", "user", r->user, "room", r->room, "v",
                                                     (json_int_t)++rs->dirty_seq));
}

/* ---- requests -------------------------------------------------------------------------- */

static void req_closed(uv_handle_t *h)
{
    cg_store_req *r = h->data;
    redis_store *rs = r->rs;
    json_decref(r->snapshot);
    free(r->user);
    free(r->room);
    free(r->key);
    free(r);
    rs->handles--;
    store_free_if_done(rs);
}

static void req_finish(cg_store_req *r)
{
    uv_close((uv_handle_t *)&r->defer, req_closed);
}

static cg_store_req *req_new(redis_store *rs, op_kind kind, const char *user, const char *room, void *ctx)
{
    cg_store_req *r = calloc(1, sizeof(*r));
    if (!r)
        abort();
    r->rs = rs;
    r->kind = kind;
    r->user = strdup(user ? user : "");
    r->room = strdup(room ? room : "");
    r->key = cg_store_dialog_key(r->user, r->room);
    r->ctx = ctx;
    uv_timer_init(rs->base.loop, &r->defer);
    r->defer.data = r;
    rs->handles++;
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
        json_object_del(rs->dirty, r->key);
        return;
    }
    const char *key;
    json_t *entry;
    void *tmp;
    json_object_foreach_safe(rs->dirty, tmp, key, entry) {
        if (strcmp(json_string_value(json_object_get(entry, "user")), r->user) == 0)
            json_object_del(rs->dirty, key);
    }
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
        if (!r->abandoned && !rs->closing)
            r->load_cb(r->ctx, &d, &st);
        else
            cg_dialog_free(&d);
    } else if (r->kind == OP_SAVE) {
        cg_dialog d;
        cg_dialog_from_json(&d, r->snapshot, now);
        cg_memstore_put(rs->mem, r->key, &d, now);
        cg_dialog_free(&d);
        mark_dirty(rs, r);
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

typedef struct argv_buf {
    const char *argv[256];
    size_t len[256];
    char *owned[256];
    int argc, n_owned;
} argv_buf;

static void arg(argv_buf *a, const char *s, size_t n)
{
    if (a->argc < 256) {
        a->argv[a->argc] = s;
        a->len[a->argc++] = n;
    }
}

static void arg_str(argv_buf *a, const char *s)
{
    arg(a, s, strlen(s));
}

/* An argument the buffer owns (freed by argv_clear). */
static void arg_own(argv_buf *a, char *s)
{
    if (a->n_owned < 256)
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

static void argv_clear(argv_buf *a)
{
    for (int i = 0; i < a->n_owned; i++)
        free(a->owned[i]);
    a->argc = a->n_owned = 0;
}

/* Returns 0, or -1 when hiredis refused the command (its context is being freed). */
static int send_argv(redis_store *rs, argv_buf *a, redisCallbackFn *fn, void *priv)
{
    int rc = redisAsyncCommandArgv(rs->ac, fn, priv, a->argc, a->argv, a->len);
    argv_clear(a);
    return rc == REDIS_OK ? 0 : -1;
}

/* Sends the EXEC that ends r's transaction; r is answered from memory if that fails. */
static void send_exec(redis_store *rs, argv_buf *a, redisCallbackFn *fn, cg_store_req *r)
{
    arg_str(a, "EXEC");
    if (send_argv(rs, a, fn, r) < 0) {
        rs->base.stats.errors++;
        answer_later_from_memory(r);
        return;
    }
    inflight_add(rs, r);
}

static char *dialog_key(redis_store *rs, const char *key, const char *part)
{
    char *s;
    if (asprintf(&s, "%s:{%s}:%s", rs->base.cfg.prefix, key, part) < 0)
        abort();
    return s;
}

static char *rooms_key(redis_store *rs, const char *user)
{
    char *u = cg_store_escape(user), *s;
    if (asprintf(&s, "%s:user:{%s}:rooms", rs->base.cfg.prefix, u) < 0)
        abort();
    free(u);
    return s;
}

/* ---- load ------------------------------------------------------------------------------ */

static json_t *parse_json_reply(redisReply *r)
{
    return r && r->type == REDIS_REPLY_STRING ? json_loadb(r->str, r->len, JSON_DECODE_ANY | JSON_ALLOW_NUL, NULL) : NULL;
}

/* Turns the five replies of a load into the JSON cg_dialog_from_json reads. */
static json_t *dialog_from_replies(redisReply **rep)
{
    json_t *j = json_object();
    json_t *params = json_object();
    for (size_t i = 0; rep[0]->type == REDIS_REPLY_ARRAY && i + 1 < rep[0]->elements; i += 2) {
        redisReply *f = rep[0]->element[i];
        const char *dot = f->type == REDIS_REPLY_STRING ? memchr(f->str, '.', f->len) : NULL;
        json_t *v = parse_json_reply(rep[0]->element[i + 1]);
        if (!dot || !v) {
            json_decref(v);
            continue;
        }
        char service[128], name[256];
        snprintf(service, sizeof(service), "%.*s", (int)(dot - f->str), f->str);
        snprintf(name, sizeof(name), "%.*s", (int)(f->len - (size_t)(dot - f->str) - 1), dot + 1);
        json_t *svc = json_object_get(params, service);
        if (!svc)
            json_object_set_new(params, service, svc = json_object());
        json_object_set_new(svc, name, v);
    }
    json_object_set_new(j, "params", params);
    json_t *meta = json_object();
    for (size_t i = 0; rep[1]->type == REDIS_REPLY_ARRAY && i + 1 < rep[1]->elements; i += 2) {
        redisReply *f = rep[1]->element[i], *v = rep[1]->element[i + 1];
        if (f->type != REDIS_REPLY_STRING || v->type != REDIS_REPLY_STRING)
            continue;
        if (strcmp(f->str, "service") == 0)
            json_object_set_new(j, "service", json_stringn(v->str, v->len));
        else if (strcmp(f->str, "last_tool_result") == 0)
            json_object_set_new(j, "last_tool_result", parse_json_reply(v));
        else
            json_object_set_new(meta, f->str, json_integer(strtoll(v->str, NULL, 10)));
    }
    json_object_set_new(j, "meta", meta);
    json_t *awaiting = parse_json_reply(rep[2]);
    if (json_is_object(awaiting)) {
        json_object_set(j, "awaiting_expires", json_object_get(awaiting, "expires_at"));
        json_object_del(awaiting, "expires_at");
        json_object_set_new(j, "awaiting", awaiting);
    } else {
        json_decref(awaiting);
    }
    json_t *soft = parse_json_reply(rep[3]);
    if (json_is_object(soft)) {
        json_object_set(j, "soft_expires", json_object_get(soft, "expires_at"));
        json_object_del(soft, "expires_at");
        json_object_set_new(j, "soft_context", soft);
    } else {
        json_decref(soft);
    }
    json_t *history = json_array();
    for (size_t i = 0; rep[4]->type == REDIS_REPLY_ARRAY && i < rep[4]->elements; i++) {
        json_t *m = parse_json_reply(rep[4]->element[i]);
        if (json_is_object(m))
            json_array_append_new(history, m);
        else
            json_decref(m);
    }
    json_object_set_new(j, "history", history);
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
    if (reply_failed(rs, reply, 5, "load")) {
        rs->base.stats.errors++;
        answer_from_memory(r);
        return;
    }
    int64_t now = rs->base.now(rs->base.clock_ctx);
    json_t *j = dialog_from_replies(reply->element);
    cg_dialog d;
    cg_dialog_from_json(&d, j, now);
    json_decref(j);
    cg_memstore_put(rs->mem, r->key, &d, now); /* the copy that survives an outage */
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
    arg_str(&a, "MULTI");
    send_argv(rs, &a, NULL, NULL);
    static const char *const reads[][2] = {
        {"HGETALL", "params"}, {"HGETALL", "dialog"}, {"GET", "awaiting"}, {"GET", "soft"}, {"LRANGE", "history"}};
    for (int i = 0; i < 5; i++) {
        arg_str(&a, reads[i][0]);
        arg_own(&a, dialog_key(rs, r->key, reads[i][1]));
        if (i == 4) {
            arg_str(&a, "0");
            arg_str(&a, "-1");
        }
        send_argv(rs, &a, NULL, NULL);
    }
    send_exec(rs, &a, on_load_reply, r);
}

/* ---- save ------------------------------------------------------------------------------ */

static void on_save_reply(redisAsyncContext *ac, void *reply_, void *priv)
{
    (void)ac;
    cg_store_req *r = priv;
    redis_store *rs = r->rs;
    inflight_remove(rs, r);
    if (reply_failed(rs, reply_, 0, "save")) {
        rs->base.stats.errors++;
        answer_from_memory(r); /* keeps it in memory, dirty, for the write-back */
        return;
    }
    if (r->version) { /* a write-back: done, unless the dialog changed meanwhile */
        json_t *entry = json_object_get(rs->dirty, r->key);
        if (entry && json_integer_value(json_object_get(entry, "v")) == r->version) {
            json_object_del(rs->dirty, r->key);
            rs->base.stats.flushed++;
        }
    } else {
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

static void set_with_expiry(redis_store *rs, argv_buf *a, const char *key, const char *part, json_t *value,
                            int64_t expires, int64_t now)
{
    if (value && expires > now) {
        json_t *copy = json_deep_copy(value);
        json_object_set_new(copy, "expires_at", json_integer(expires));
        arg_str(a, "SET");
        arg_own(a, dialog_key(rs, key, part));
        arg_own(a, json_dumps(copy, JSON_COMPACT));
        arg_str(a, "EX");
        arg_fmt(a, "%lld", (long long)(expires - now));
        json_decref(copy);
    } else {
        arg_str(a, "DEL");
        arg_own(a, dialog_key(rs, key, part));
    }
    send_argv(rs, a, NULL, NULL);
}

static void send_save(redis_store *rs, cg_store_req *r)
{
    const cg_lifetimes *lt = &rs->base.cfg.lifetimes;
    int64_t now = rs->base.now(rs->base.clock_ctx);
    cg_dialog d;
    cg_dialog_from_json(&d, r->snapshot, now);
    argv_buf a = {0};
    arg_str(&a, "MULTI");
    send_argv(rs, &a, NULL, NULL);

    /* params: "<service>.<name>" -> JSON */
    arg_str(&a, "DEL");
    arg_own(&a, dialog_key(rs, r->key, "params"));
    send_argv(rs, &a, NULL, NULL);
    if (json_object_size(d.params)) {
        /* one HSET per 100 fields, so any number of params fits the argument buffer */
        const char *service, *name;
        json_t *names, *value;
        json_object_foreach(d.params, service, names) {
            json_object_foreach(names, name, value) {
                if (a.argc == 0) {
                    arg_str(&a, "HSET");
                    arg_own(&a, dialog_key(rs, r->key, "params"));
                }
                arg_fmt(&a, "%s.%s", service, name);
                arg_own(&a, json_dumps(value, JSON_COMPACT | JSON_ENCODE_ANY));
                if (a.argc >= 202)
                    send_argv(rs, &a, NULL, NULL);
            }
        }
        if (a.argc)
            send_argv(rs, &a, NULL, NULL);
        arg_str(&a, "EXPIRE");
        arg_own(&a, dialog_key(rs, r->key, "params"));
        arg_fmt(&a, "%ld", lt->params_s);
        send_argv(rs, &a, NULL, NULL);
    }

    arg_str(&a, "HSET");
    arg_own(&a, dialog_key(rs, r->key, "dialog"));
    arg_str(&a, "created_at");
    arg_fmt(&a, "%lld", (long long)d.created_at);
    arg_str(&a, "last_activity");
    arg_fmt(&a, "%lld", (long long)d.last_activity);
    arg_str(&a, "turn_count");
    arg_fmt(&a, "%ld", d.turn_count);
    arg_str(&a, "message_count");
    arg_fmt(&a, "%ld", d.message_count);
    arg_str(&a, "service");
    arg_str(&a, d.service ? d.service : "");
    arg_str(&a, "last_tool_result");
    arg_own(&a, json_dumps(d.last_tool_result ? d.last_tool_result : json_null(), JSON_COMPACT | JSON_ENCODE_ANY));
    send_argv(rs, &a, NULL, NULL);
    if (!d.service) {
        arg_str(&a, "HDEL");
        arg_own(&a, dialog_key(rs, r->key, "dialog"));
        arg_str(&a, "service");
        send_argv(rs, &a, NULL, NULL);
    }
    arg_str(&a, "EXPIRE");
    arg_own(&a, dialog_key(rs, r->key, "dialog"));
    arg_fmt(&a, "%ld", lt->dialog_s);
    send_argv(rs, &a, NULL, NULL);

    set_with_expiry(rs, &a, r->key, "awaiting", d.awaiting, d.awaiting_expires, now);
    set_with_expiry(rs, &a, r->key, "soft", d.soft, d.soft_expires, now);

    arg_str(&a, "DEL");
    arg_own(&a, dialog_key(rs, r->key, "history"));
    send_argv(rs, &a, NULL, NULL);
    if (json_array_size(d.history)) {
        arg_str(&a, "RPUSH");
        arg_own(&a, dialog_key(rs, r->key, "history"));
        size_t i;
        json_t *m;
        json_array_foreach(d.history, i, m) arg_own(&a, json_dumps(m, JSON_COMPACT));
        send_argv(rs, &a, NULL, NULL);
        arg_str(&a, "EXPIRE");
        arg_own(&a, dialog_key(rs, r->key, "history"));
        arg_fmt(&a, "%ld", lt->history_s);
        send_argv(rs, &a, NULL, NULL);
    }

    char *rooms = rooms_key(rs, r->user);
    arg_str(&a, "SADD");
    arg_str(&a, rooms);
    arg_own(&a, cg_store_escape(r->room));
    send_argv(rs, &a, NULL, NULL);
    arg_str(&a, "EXPIRE");
    arg_own(&a, rooms);
    arg_fmt(&a, "%ld", lt->dialog_s);
    send_argv(rs, &a, NULL, NULL);

    send_exec(rs, &a, on_save_reply, r);
    cg_dialog_free(&d);
}

/* ---- remove ---------------------------------------------------------------------------- */

static void on_remove_reply(redisAsyncContext *ac, void *reply_, void *priv)
{
    (void)ac;
    cg_store_req *r = priv;
    redis_store *rs = r->rs;
    inflight_remove(rs, r);
    if (reply_failed(rs, reply_, 0, "delete")) {
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

static void send_remove(redis_store *rs, cg_store_req *r)
{
    argv_buf a = {0};
    arg_str(&a, "MULTI");
    send_argv(rs, &a, NULL, NULL);
    arg_str(&a, "DEL");
    static const char *const parts[] = {"params", "dialog", "awaiting", "soft", "history"};
    for (int i = 0; i < 5; i++)
        arg_own(&a, dialog_key(rs, r->key, parts[i]));
    send_argv(rs, &a, NULL, NULL);
    arg_str(&a, "SREM");
    arg_own(&a, rooms_key(rs, r->user));
    arg_own(&a, cg_store_escape(r->room));
    send_argv(rs, &a, NULL, NULL);
    send_exec(rs, &a, on_remove_reply, r);
}

/* ---- the connection -------------------------------------------------------------------- */

static void flush_dirty(redis_store *rs)
{
    const char *key;
    json_t *entry;
    int64_t now = rs->base.now(rs->base.clock_ctx);
    json_object_foreach(rs->dirty, key, entry) {
        cg_store_req *r = req_new(rs, OP_SAVE, json_string_value(json_object_get(entry, "user")),
                                  json_string_value(json_object_get(entry, "room")), NULL);
        cg_dialog d;
        cg_memstore_get(rs->mem, key, now, &d);
        r->snapshot = cg_dialog_to_json(&d);
        cg_dialog_free(&d);
        r->version = (long)json_integer_value(json_object_get(entry, "v"));
        send_save(rs, r);
    }
    if (json_object_size(rs->dirty))
        cg_info("redis %s:%d: writing back %zu dialogs held in memory", rs->host, rs->port,
                json_object_size(rs->dirty));
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

/* Drops the connection (a timeout, or close): every pending callback gets a NULL reply. */
static void drop_connection(redis_store *rs, const char *why)
{
    redisAsyncContext *ac = rs->ac;
    rs->ac = NULL;
    rs->state = R_CLOSED;
    uv_timer_stop(&rs->connect_timer);
    enter_degraded(rs, why);
    if (ac)
        redisAsyncFree(ac);
    schedule_reconnect(rs);
}

static void on_ping(redisAsyncContext *ac, void *reply, void *priv)
{
    cg_store_req *r = priv;
    redis_store *rs = r->rs;
    inflight_remove(rs, r);
    req_finish(r);
    if (ac != rs->ac || reply_failed(rs, reply, 0, "PING"))
        return;
    rs->state = R_CONNECTED;
    rs->backoff = 0;
    if (rs->ever_connected)
        rs->base.stats.reconnects++;
    rs->ever_connected = 1;
    cg_info("redis %s:%d: connected", rs->host, rs->port);
    leave_degraded(rs);
    flush_dirty(rs);
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
    /* Connected at the TCP level; a stopped Redis accepts too, so only a PING answered
     * makes the store use it again. */
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
    drop_connection(rs, "connect timed out");
}

static void on_auth(redisAsyncContext *ac, void *reply, void *priv)
{
    (void)priv;
    redis_store *rs = ac->data;
    reply_failed(rs, reply, 0, "AUTH/SELECT");
}

static void redis_connect(redis_store *rs)
{
    if (rs->closing)
        return;
    redisAsyncContext *ac = redisAsyncConnect(rs->host, rs->port);
    if (!ac || ac->err) {
        enter_degraded(rs, ac ? ac->errstr : "out of memory");
        if (ac)
            redisAsyncFree(ac);
        schedule_reconnect(rs);
        return;
    }
    ac->data = rs;
    rs->ac = ac;
    rs->state = R_CONNECTING;
    redisLibuvAttach(ac, rs->base.loop);
    redisAsyncSetConnectCallback(ac, on_connect);
    redisAsyncSetDisconnectCallback(ac, on_disconnect);
    if (rs->password[0])
        redisAsyncCommand(ac, on_auth, NULL, "AUTH %s", rs->password);
    if (rs->db)
        redisAsyncCommand(ac, on_auth, NULL, "SELECT %d", rs->db);
    uv_timer_start(&rs->connect_timer, on_connect_timeout, (uint64_t)rs->base.cfg.connect_timeout_ms, 0);
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

static cg_store_req *rs_load(cg_store *st, const char *user, const char *room, cg_store_load_fn cb, void *ctx)
{
    redis_store *rs = (redis_store *)st;
    st->stats.loads++;
    cg_store_req *r = req_new(rs, OP_LOAD, user, room, ctx);
    r->load_cb = cb;
    if (usable(rs, r->key))
        send_load(rs, r);
    else
        answer_later_from_memory(r);
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
    if (usable(rs, r->key)) {
        send_save(rs, r);
    } else {
        /* written to memory now, so a load queued after this save sees it */
        cg_memstore_put(rs->mem, r->key, d, st->now(st->clock_ctx));
        mark_dirty(rs, r);
        answer_later_from_memory(r);
    }
    return r;
}

static cg_store_req *rs_remove(cg_store *st, const char *user, const char *room, cg_store_done_fn cb, void *ctx)
{
    redis_store *rs = (redis_store *)st;
    st->stats.deletes++;
    cg_store_req *r = req_new(rs, OP_REMOVE, user, room, ctx);
    r->done_cb = cb;
    json_object_del(rs->dirty, r->key);
    if (rs->state == R_CONNECTED && rs->ac)
        send_remove(rs, r);
    else
        answer_later_from_memory(r);
    return r;
}

/* Second step of remove_user: the rooms are known; one transaction deletes them all. */
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
    arg_str(&a, "MULTI");
    send_argv(rs, &a, NULL, NULL);
    char *u = cg_store_escape(r->user);
    static const char *const parts[] = {"params", "dialog", "awaiting", "soft", "history"};
    for (size_t i = 0; i < reply->elements; i++) {
        redisReply *room = reply->element[i];
        if (room->type != REDIS_REPLY_STRING)
            continue;
        char key[1024];
        snprintf(key, sizeof(key), "%s:%.*s", u, (int)room->len, room->str); /* the room is stored escaped */
        arg_str(&a, "DEL");
        for (int p = 0; p < 5; p++)
            arg_own(&a, dialog_key(rs, key, parts[p]));
        send_argv(rs, &a, NULL, NULL);
    }
    free(u);
    arg_str(&a, "DEL");
    arg_own(&a, rooms_key(rs, r->user));
    send_argv(rs, &a, NULL, NULL);
    send_exec(rs, &a, on_remove_reply, r);
}

static cg_store_req *rs_remove_user(cg_store *st, const char *user, cg_store_done_fn cb, void *ctx)
{
    redis_store *rs = (redis_store *)st;
    st->stats.deletes++;
    cg_store_req *r = req_new(rs, OP_REMOVE_USER, user, "", ctx);
    r->done_cb = cb;
    cg_memstore_del_user(rs->mem, user);
    forget_dirty(rs, r);
    if (rs->state != R_CONNECTED || !rs->ac) {
        answer_later_from_memory(r); /* degraded: the caller is told (503 at the admin API) */
        return r;
    }
    argv_buf a = {0};
    arg_str(&a, "SMEMBERS");
    arg_own(&a, rooms_key(rs, user));
    if (send_argv(rs, &a, on_rooms_reply, r) == 0)
        inflight_add(rs, r);
    else
        answer_later_from_memory(r);
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
    uv_timer_stop(&rs->tick);
    uv_timer_stop(&rs->connect_timer);
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

/* redis://[:password@]host[:port][/db] */
static int parse_url(redis_store *rs, const char *url, char *err, size_t errlen)
{
    const char *p = url + strlen("redis://");
    const char *at = strchr(p, '@');
    if (at) {
        const char *colon = memchr(p, ':', (size_t)(at - p));
        const char *pw = colon ? colon + 1 : p;
        /* the password is percent-encoded in a URL ("%40" for '@') */
        size_t n = 0;
        for (const char *c = pw; c < at && n < sizeof(rs->password) - 1; c++) {
            unsigned int byte;
            if (*c == '%' && c + 2 < at && sscanf(c + 1, "%2x", &byte) == 1) {
                rs->password[n++] = (char)byte;
                c += 2;
            } else {
                rs->password[n++] = *c;
            }
        }
        rs->password[n] = 0;
        p = at + 1;
    }
    const char *slash = strchr(p, '/');
    const char *end = slash ? slash : p + strlen(p);
    const char *colon = memchr(p, ':', (size_t)(end - p));
    const char *host_end = colon ? colon : end;
    if (host_end == p || (size_t)(host_end - p) >= sizeof(rs->host)) {
        snprintf(err, errlen, "'%s': no host (redis://HOST:PORT[/DB])", url);
        return -1;
    }
    snprintf(rs->host, sizeof(rs->host), "%.*s", (int)(host_end - p), p);
    rs->port = 6379;
    if (colon) {
        char *e;
        long port = strtol(colon + 1, &e, 10);
        if (e != end || port < 1 || port > 65535) {
            snprintf(err, errlen, "'%s': the port must be 1 to 65535", url);
            return -1;
        }
        rs->port = (int)port;
    }
    if (slash && slash[1]) {
        char *e;
        long db = strtol(slash + 1, &e, 10);
        if (*e || db < 0 || db > 15) {
            snprintf(err, errlen, "'%s': the database must be a number from 0 to 15", url);
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
        free(rs);
        return NULL;
    }
    rs->base.ops = &redis_ops;
    rs->base.loop = loop;
    rs->base.cfg = *cfg;
    rs->base.now = cg_store_default_now;
    rs->mem = cg_memstore_new(cfg->max_dialogs, &cfg->lifetimes, &rs->base.stats);
    rs->dirty = json_object();
    rs->warned = json_object();
    uv_timer_init(loop, &rs->connect_timer);
    uv_timer_init(loop, &rs->tick);
    rs->connect_timer.data = rs->tick.data = rs;
    rs->handles = 2;
    uv_timer_start(&rs->tick, on_tick, 100, 100);
    uv_unref((uv_handle_t *)&rs->tick);
    redis_connect(rs);
    return &rs->base;
}
