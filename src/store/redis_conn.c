/*
 * redis_conn.c: the Redis store's connection, through the hiredis async API on the
 * gateway's loop, and what the store does while it has none. The dialog operations that
 * travel over it (keys, scripts, load, save, remove) are in redis_dialog.c; what the two
 * share is in chatgate/store/redis_internal.h.
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
 *
 * The requests live here too: their in-flight list is what the command timeout watches,
 * and their answers from memory are the degraded mode's.
 */
#define _GNU_SOURCE /* asprintf */
#include <hiredis/async.h>
#include <hiredis/hiredis.h>
#include <hiredis/adapters/libuv.h>

#include <openssl/rand.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "chatgate/core/log.h"
#include "chatgate/store/store.h"
#include "chatgate/core/net.h"
#include "chatgate/store/redis_internal.h"

/* The default of redis.writeback_max_bytes, for callers that leave it 0. */
#define WRITEBACK_MAX_BYTES_DEFAULT (64L << 20)

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
    cg_redis_drain_waiting(rs); /* from memory now */
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

void cg_redis_dirty_del(redis_store *rs, const char *key)
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
        cg_redis_dirty_del(rs, json_object_iter_key(it));
        rs->base.stats.writeback_dropped_bound++;
        dropped++;
    }
    if (dropped)
        cg_warn("redis %s:%d: %ld dialogs held for the write-back dropped to stay within %ld dialogs and %ld bytes",
                rs->host, rs->port, dropped, rs->base.cfg.max_dialogs, rs->dirty_max_bytes);
}

/* Marks r's dialog (its snapshot) as written to memory only; the newest goes last. */
void cg_redis_mark_dirty(redis_store *rs, cg_store_req *r)
{
    size_t bytes = json_dumpb(r->snapshot, NULL, 0, JSON_COMPACT) + strlen(r->key) + 64;
    json_t *old = json_object_get(rs->dirty, r->key);
    int base_unknown = json_object_get(rs->unknown, r->key) || json_is_true(json_object_get(old, "n"));
    cg_redis_dirty_del(rs, r->key); /* re-added at the end: the set runs from least to most recent */
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
    free(r->lease_value);
    free(r->user);
    free(r->eu);
    free(r->er);
    free(r->key);
    free(r);
    rs->handles--;
    store_free_if_done(rs);
}

/* Frees r once the replies still due to it have come (they come, possibly NULL). */
void cg_redis_req_finish(cg_store_req *r)
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

cg_store_req *cg_redis_req_new(redis_store *rs, op_kind kind, const char *user, const char *room, void *ctx)
{
    user = user ? user : "";
    cg_store_req *r = req_alloc(rs, kind, cg_store_escape(user), cg_store_escape(room ? room : ""), ctx);
    r->user = cg_redis_xstrdup(user);
    return r;
}

void cg_redis_inflight_add(redis_store *rs, cg_store_req *r)
{
    r->sent_at = now_ms(rs);
    r->prev = rs->tail;
    if (rs->tail)
        rs->tail->next = r;
    else
        rs->head = r;
    rs->tail = r;
}

void cg_redis_inflight_remove(redis_store *rs, cg_store_req *r)
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
void cg_redis_forget_dirty(redis_store *rs, cg_store_req *r)
{
    if (r->kind != OP_REMOVE_USER) {
        cg_redis_dirty_del(rs, r->key);
        return;
    }
    const char *key;
    json_t *entry;
    void *tmp;
    json_object_foreach_safe(rs->dirty, tmp, key, entry) {
        const char *u = json_string_value(json_object_get(entry, "u"));
        if (u && strcmp(u, r->eu) == 0)
            cg_redis_dirty_del(rs, key);
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
void cg_redis_answer_from_memory(cg_store_req *r)
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
            cg_redis_mark_dirty(rs, r);
        }
        if (!r->abandoned && !rs->closing && r->done_cb)
            r->done_cb(r->ctx, &st);
    } else if (r->kind == OP_REMOVE || r->kind == OP_REMOVE_USER) {
        if (r->kind == OP_REMOVE)
            cg_memstore_del(rs->mem, r->key);
        else
            cg_memstore_del_user(rs->mem, r->user);
        cg_redis_forget_dirty(rs, r);
        if (!r->abandoned && !rs->closing && r->done_cb)
            r->done_cb(r->ctx, &st);
    }
    cg_redis_req_finish(r);
}

static void deferred_answer(uv_timer_t *t)
{
    cg_redis_answer_from_memory(t->data);
}

void cg_redis_answer_later_from_memory(cg_store_req *r)
{
    uv_timer_start(&r->defer, deferred_answer, 0, 0);
}
/* ---- the connection -------------------------------------------------------------------- */

/* Writes back one dirty dialog as memory holds it; returns 0, or -1 when memory no longer
 * holds it (evicted or expired): it is dropped then, never written blank over Redis's copy. */
int cg_redis_flush_one(redis_store *rs, const char *key, json_t *entry)
{
    const char *eu = json_string_value(json_object_get(entry, "u"));
    const char *er = json_string_value(json_object_get(entry, "r"));
    cg_dialog d;
    if (!eu || !er || !cg_memstore_get(rs->mem, key, rs->base.now(rs->base.clock_ctx), &d)) {
        if (eu && er)
            cg_dialog_free(&d);
        cg_redis_dirty_del(rs, key);
        rs->base.stats.writeback_dropped_gone++;
        return -1;
    }
    cg_store_req *r = req_alloc(rs, OP_SAVE, cg_redis_xstrdup(eu), cg_redis_xstrdup(er), NULL);
    r->user = cg_redis_xstrdup("");
    r->snapshot = cg_dialog_to_json(&d);
    cg_dialog_free(&d);
    r->version = (long)json_integer_value(json_object_get(entry, "v"));
    r->base_unknown = json_is_true(json_object_get(entry, "n"));
    if (r->snapshot) {
        cg_redis_send_save(rs, r);
        /* Redis runs this write-back before any save sent after it on the connection: those
         * are updates of this copy (created_at still guards them), not create-only */
        json_object_del(rs->unknown, key);
    } else
        cg_redis_req_finish(r); /* out of memory: still dirty, tried again at the next reconnect */
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
        if (cg_redis_flush_one(rs, key, entry) < 0)
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
    cg_redis_inflight_remove(rs, r);
    cg_redis_req_finish(r);
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
    cg_redis_drain_waiting(rs);
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
    cg_store_req *r = cg_redis_req_new(rs, OP_PING, "", "", NULL);
    if (redisAsyncCommand(rs->ac, on_ping, r, "PING") == REDIS_OK)
        cg_redis_inflight_add(rs, r);
    else
        cg_redis_req_finish(r);
}

static void on_disconnect(const redisAsyncContext *ac, int status)
{
    redis_store *rs = ac->data;
    (void)status;
    if (ac != rs->ac)
        return; /* we freed it ourselves */
    rs->ac = NULL;
    if (rs->closing) { /* the graceful close of cg_redis_close is complete */
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
    cg_redis_reply_failed(rs, reply, 0, "AUTH"); /* logged; a server that needs it answers the PING -NOAUTH */
}

static void on_select(redisAsyncContext *ac, void *reply, void *priv)
{
    (void)priv;
    redis_store *rs = ac->data;
    if (ac == rs->ac && reply && cg_redis_reply_failed(rs, reply, 0, "SELECT"))
        rs->setup_failed = 1; /* the PING's answer drops the connection: never the wrong database */
}

/* Connects to a numeric address (hiredis's own getaddrinfo then never waits on DNS). */
static void connect_to(redis_store *rs, const char *address)
{
    if (!rs->address || strcmp(rs->address, address) != 0) {
        cg_info("redis %s:%d: connecting to %s", rs->host, rs->port, address);
        free(rs->address);
        rs->address = cg_redis_xstrdup(address);
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
    if (rs->state == R_CONNECTED && rs->ac)
        cg_redis_renew_leases(rs);
}

/* ---- close -------------------------------------------------------------------------- */

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
    json_decref(rs->leases);
    json_decref(rs->saving);
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
void cg_redis_close(cg_store *st)
{
    redis_store *rs = (redis_store *)st;
    rs->closing = 1;
    cg_redis_drain_waiting(rs); /* answered from memory: their callers are told nothing while closing */
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

/* ---- open --------------------------------------------------------------------------- */

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

/* Who holds a lease this store takes: the host, the process and a random part (a process
 * restarted with the same pid is another holder). Shown to whoever waits for the lease. */
static void lease_holder_id(redis_store *rs)
{
    char host[24] = "";
    unsigned char rnd[4] = {0};
    gethostname(host, sizeof(host) - 1);
    for (char *p = host; *p; p++) /* one word: the lease value is "holder fence" */
        if (*p == ' ')
            *p = '_';
    if (RAND_bytes(rnd, sizeof(rnd)) != 1)
        abort();
    snprintf(rs->holder, sizeof(rs->holder), "%s:%ld:%02x%02x%02x%02x", host[0] ? host : "gw", (long)getpid(), rnd[0],
             rnd[1], rnd[2], rnd[3]);
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
    rs->base.ops = &cg_redis_ops;
    rs->base.loop = loop;
    rs->base.cfg = *cfg;
    rs->base.now = cg_store_default_now;
    rs->dirty_max_bytes = cfg->writeback_max_bytes > 0 ? cfg->writeback_max_bytes : WRITEBACK_MAX_BYTES_DEFAULT;
    rs->mem = cg_memstore_new(cfg->max_dialogs, &cfg->lifetimes, &rs->base.stats);
    rs->dirty = json_object();
    rs->warned = json_object();
    rs->unknown = json_object();
    rs->leases = json_object();
    rs->saving = json_object();
    cg_redis_scripts_init();
    lease_holder_id(rs);
    if (!rs->mem || !rs->dirty || !rs->warned || !rs->unknown || !rs->leases || !rs->saving)
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
