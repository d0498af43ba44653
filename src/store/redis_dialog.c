/*
 * redis_dialog.c: the Redis store's dialog operations (load, save, remove, forget a user)
 * and its ops table: the keys, the scripts and their arguments, and reading the replies.
 * The connection they travel over, and the answers from memory when it is away, are in
 * redis_conn.c; what the two share is in chatgate/store/redis_internal.h.
 *
 * Layout (docs/state.md), one hash tag per dialog so a dialog lives on one shard:
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
 */
#define _GNU_SOURCE /* asprintf */
#include <hiredis/async.h>
#include <hiredis/hiredis.h>

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "chatgate/core/log.h"
#include "chatgate/store/store.h"
#include "chatgate/store/redis_internal.h"

static void on_rooms_reply(redisAsyncContext *ac, void *reply_, void *priv);

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
    arg_own(a, s ? s : cg_redis_xstrdup("null"));
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
        cg_redis_req_finish(r);
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
        cg_redis_answer_later_from_memory(r);
        return;
    }
    cg_redis_inflight_add(rs, r);
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
int cg_redis_reply_failed(redis_store *rs, redisReply *reply, size_t want_elements, const char *what)
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
    cg_redis_inflight_remove(rs, r);
    json_t *j = NULL;
    if (cg_redis_reply_failed(rs, reply, 5, "load") || !(j = dialog_from_replies(reply->element))) {
        rs->base.stats.errors++;
        cg_redis_answer_from_memory(r);
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
    cg_redis_req_finish(r);
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
    cg_redis_inflight_remove(rs, r);
    if (cg_redis_reply_failed(rs, reply, 0, "save") || r->step_failed || reply->type != REDIS_REPLY_INTEGER) {
        rs->base.stats.errors++;
        cg_redis_answer_from_memory(r); /* keeps it in memory, dirty, for the write-back */
        return;
    }
    json_t *entry = r->version ? json_object_get(rs->dirty, r->key) : NULL;
    if (entry && json_integer_value(json_object_get(entry, "v")) == r->version) {
        cg_redis_dirty_del(rs, r->key); /* a write-back: done */
        if (reply->integer == 1)
            rs->base.stats.flushed++;
    } else if (entry && reply->integer == 1 && rs->state == R_CONNECTED) {
        /* changed meanwhile: its newer version, now; Redis holds this dialog's copy now, so
         * the newer one is an update, not a create-only (that would be refused) */
        json_object_set_new(entry, "n", json_false());
        json_object_del(rs->unknown, r->key);
        cg_redis_flush_one(rs, r->key, entry);
    }
    if (reply->integer == 1)
        json_object_del(rs->unknown, r->key); /* written: Redis's copy is ours, known */
    if (reply->integer != 1) {
        save_refused(rs, r, reply->integer);
        if (entry && json_object_get(rs->dirty, r->key) == entry)
            cg_redis_dirty_del(rs, r->key); /* a newer outage write of the same copy: refused too */
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
    cg_redis_req_finish(r);
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

void cg_redis_send_save(redis_store *rs, cg_store_req *r)
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
    cg_redis_inflight_remove(rs, r);
    if (cg_redis_reply_failed(rs, reply_, 0, "delete") || r->step_failed) {
        rs->base.stats.errors++;
        cg_redis_answer_from_memory(r);
        return;
    }
    if (r->kind == OP_REMOVE)
        cg_memstore_del(rs->mem, r->key);
    static const cg_store_status ok = {0, 0, 0};
    if (!r->abandoned && !rs->closing && r->done_cb)
        r->done_cb(r->ctx, &ok);
    cg_redis_req_finish(r);
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
        cg_redis_send_save(rs, r);
    } else if (r->kind == OP_SAVE && r->snapshot) {
        /* written to memory now, so a load queued after this save sees it */
        int64_t now = rs->base.now(rs->base.clock_ctx);
        cg_dialog d;
        cg_dialog_from_json(&d, r->snapshot, now);
        cg_memstore_put(rs->mem, r->key, &d, now);
        cg_dialog_free(&d);
        cg_redis_mark_dirty(rs, r);
        json_decref(r->snapshot); /* held in memory now: cg_redis_answer_from_memory only answers it */
        r->snapshot = NULL;
        cg_redis_answer_later_from_memory(r);
    } else if (r->kind == OP_REMOVE && connected) {
        send_remove(rs, r);
    } else if (r->kind == OP_REMOVE_USER && connected) {
        argv_buf a = {0};
        arg_str(&a, "SMEMBERS");
        arg_own(&a, rooms_key(rs, r->eu));
        send_last(rs, &a, on_rooms_reply, r);
        argv_free(&a);
    } else {
        cg_redis_answer_later_from_memory(r); /* a delete while degraded: the caller is told (503 at the admin API) */
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

void cg_redis_drain_waiting(redis_store *rs)
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
    cg_store_req *r = cg_redis_req_new(rs, OP_LOAD, user, room, ctx);
    r->load_cb = cb;
    start_or_wait(rs, r);
    return r;
}

static cg_store_req *rs_save(cg_store *st, const char *user, const char *room, const cg_dialog *d,
                             cg_store_done_fn cb, void *ctx)
{
    redis_store *rs = (redis_store *)st;
    st->stats.saves++;
    cg_store_req *r = cg_redis_req_new(rs, OP_SAVE, user, room, ctx);
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
    cg_store_req *r = cg_redis_req_new(rs, OP_REMOVE, user, room, ctx);
    r->done_cb = cb;
    cg_redis_dirty_del(rs, r->key);
    start_or_wait(rs, r);
    return r;
}

/* Last step of remove_user: every dialog is gone; now the rooms set. */
static void on_forget_dialogs_reply(redisAsyncContext *ac, void *reply_, void *priv)
{
    (void)ac;
    cg_store_req *r = priv;
    redis_store *rs = r->rs;
    cg_redis_inflight_remove(rs, r);
    if (cg_redis_reply_failed(rs, reply_, 0, "forget user (DEL)") || r->step_failed || !rs->ac) {
        rs->base.stats.errors++;
        cg_redis_answer_from_memory(r); /* the rooms set stays, so a retry finds them */
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
    cg_redis_inflight_remove(rs, r);
    if (cg_redis_reply_failed(rs, reply, 0, "forget user (SMEMBERS)") || reply->type != REDIS_REPLY_ARRAY || !rs->ac) {
        rs->base.stats.errors++;
        cg_redis_answer_from_memory(r);
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
    cg_store_req *r = cg_redis_req_new(rs, OP_REMOVE_USER, user, "", ctx);
    r->done_cb = cb;
    cg_memstore_del_user(rs->mem, user);
    cg_redis_forget_dirty(rs, r);
    start_or_wait(rs, r);
    return r;
}

static void rs_abandon(cg_store_req *r)
{
    r->abandoned = 1;
}

const cg_store_ops cg_redis_ops = {
    .name = "redis",
    .load = rs_load,
    .save = rs_save,
    .remove = rs_remove,
    .remove_user = rs_remove_user,
    .abandon = rs_abandon,
    .close = cg_redis_close,
};
