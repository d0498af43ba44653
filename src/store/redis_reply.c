/*
 * redis_reply.c: replies of gone clients in Redis, for a resume through another gateway
 * (store.h, cg_store_reply_ops; server/resume.h).
 *
 * The gateway that holds a parked reply appends it to a Redis Stream, a piece at a time:
 *   P:{U}:I:reply         STREAM  entries {seq, text[, room][, end]}; MAXLEN ~ 16384; it lives
 *                                 a while after its last entry (the caller's ttl)
 *   P:{U}:I:reply-listen  STRING  set by a gateway that serves a resume of it, for a moment
 * U the escaped user, I the escaped message id: a user's keys share its hash tag, so they
 * live on one shard (Cluster) as its dialogs do. A dialog part never ends in "reply", so the
 * keys do not meet a room's (P:{U}:ROOM:params ...). A reader reads the entries after the last
 * one it had (XRANGE with an exclusive start, Redis 6.2), so each piece is read once.
 */
#include <hiredis/hiredis.h>

#include <stdlib.h>
#include <string.h>

#include "chatgate/core/alloc.h"
#include "chatgate/core/log.h"
#include "chatgate/store/redis_argv.h"
#include "chatgate/store/redis_internal.h"
#include "chatgate/store/store.h"

#define REPLY_MAXLEN "16384" /* entries a reply's stream keeps (approximately: ~): 13 minutes of
                              * pieces at one per 50 ms; a longer reply's start goes, and a reader
                              * that comes that late sees the seq jump */
#define READ_COUNT "256"    /* entries one read takes */

/* The reply's key, or its listen key (part), as one argument. */
static void arg_reply_key(redis_store *rs, cg_argv *a, const char *user, const char *id, const char *part)
{
    char *eu = cg_store_escape(user), *ei = cg_store_escape(id);
    cg_argv_key(a, rs->base.cfg.prefix, eu, ei, part);
    free(eu);
    free(ei);
}

static void on_quiet_reply(cg_redis_conn *ac, void *reply_, void *priv)
{
    (void)ac;
    const char *what = priv;
    redisReply *reply = reply_;
    if (reply && reply->type == REDIS_REPLY_ERROR)
        cg_warn("redis: a reply kept for a resume elsewhere: %s failed: %s", what, reply->str);
}

static int rr_append(cg_store *st, const char *user, const char *id, const cg_reply_entry *e, long ttl_ms)
{
    redis_store *rs = (redis_store *)st;
    if (!cg_redis_linked(rs))
        return -1; /* kept by the caller, sent when Redis is back */
    cg_argv a = {0};
    cg_argv_str(&a, "XADD");
    arg_reply_key(rs, &a, user, id, "reply");
    cg_argv_str(&a, "MAXLEN");
    cg_argv_str(&a, "~");
    cg_argv_str(&a, REPLY_MAXLEN);
    cg_argv_str(&a, "*");
    cg_argv_str(&a, "seq");
    cg_argv_int(&a, (long long)e->seq);
    cg_argv_str(&a, "text");
    cg_argv_arg(&a, e->text ? e->text : "", e->text ? e->len : 0);
    if (e->room) {
        cg_argv_str(&a, "room");
        cg_argv_str(&a, e->room);
    }
    if (e->end) {
        cg_argv_str(&a, "end");
        cg_argv_arg(&a, e->end, e->end_len);
    }
    int rc = cg_redis_send_argv(rs, &a, on_quiet_reply, "XADD");
    cg_argv_str(&a, "PEXPIRE");
    arg_reply_key(rs, &a, user, id, "reply");
    cg_argv_int(&a, ttl_ms);
    if (rc == 0)
        cg_redis_send_argv(rs, &a, on_quiet_reply, "PEXPIRE");
    cg_argv_free(&a);
    return rc;
}

typedef struct reply_read {
    cg_store_entries_fn cb;
    cg_store_listened_fn listened;
    void *ctx;
} reply_read;

/* A field's value among an entry's [field, value, ...], or NULL. */
static const redisReply *field(const redisReply *fields, const char *name)
{
    for (size_t i = 0; i + 1 < fields->elements; i += 2) {
        const redisReply *k = fields->element[i];
        if (k->type == REDIS_REPLY_STRING && k->len == strlen(name) && memcmp(k->str, name, k->len) == 0)
            return fields->element[i + 1]->type == REDIS_REPLY_STRING ? fields->element[i + 1] : NULL;
    }
    return NULL;
}

/* One entry of XRANGE's answer, [id, [field, value, ...]], into e; -1 when it has another
 * shape (an answer from outside is read as hostile: it is not ours, or it is damaged). */
static int read_entry(const redisReply *r, cg_reply_entry *e)
{
    if (r->type != REDIS_REPLY_ARRAY || r->elements != 2 || r->element[0]->type != REDIS_REPLY_STRING ||
        r->element[1]->type != REDIS_REPLY_ARRAY)
        return -1;
    const redisReply *f = r->element[1], *seq = field(f, "seq"), *text = field(f, "text"), *room = field(f, "room"),
                     *end = field(f, "end");
    char *stop = NULL;
    unsigned long long n = seq ? strtoull(seq->str, &stop, 10) : 0;
    if (!seq || !text || stop == seq->str || *stop || n < text->len)
        return -1;
    *e = (cg_reply_entry){.entry = r->element[0]->str, .seq = n, .text = text->str, .len = text->len,
                          .room = room ? room->str : NULL, .end = end ? end->str : NULL,
                          .end_len = end ? end->len : 0};
    return 0;
}

static void on_read_reply(cg_redis_conn *ac, void *reply_, void *priv)
{
    (void)ac;
    reply_read *rd = priv;
    redisReply *reply = reply_;
    if (!reply || reply->type != REDIS_REPLY_ARRAY) {
        if (reply && reply->type == REDIS_REPLY_ERROR)
            cg_warn("redis: reading a reply for a resume: %s", reply->str);
        rd->cb(rd->ctx, NULL, 0, 1);
        free(rd);
        return;
    }
    cg_reply_entry *e = reply->elements ? cg_calloc(reply->elements, sizeof(*e)) : NULL;
    size_t n = 0;
    for (size_t i = 0; i < reply->elements; i++)
        if (read_entry(reply->element[i], &e[n]) == 0)
            n++;
        else
            cg_warn("redis: an entry of a reply kept for a resume is not one of ours: left out");
    rd->cb(rd->ctx, e, n, 0);
    free(e);
    free(rd);
}

static int rr_read(cg_store *st, const char *user, const char *id, const char *after, cg_store_entries_fn cb,
                   void *ctx)
{
    redis_store *rs = (redis_store *)st;
    if (!cg_redis_linked(rs))
        return -1;
    cg_argv a = {0};
    cg_argv_str(&a, "XRANGE");
    arg_reply_key(rs, &a, user, id, "reply");
    if (after) { /* the entries after it: an exclusive start */
        size_t n = strlen(after);
        cg_argv_known(&a, n + 1);
        CG_JSONW_LIT(&a.w, "(");
        cg_jsonw_raw(&a.w, after, n);
        cg_argv_done(&a);
    } else {
        cg_argv_str(&a, "-");
    }
    cg_argv_str(&a, "+");
    cg_argv_str(&a, "COUNT");
    cg_argv_str(&a, READ_COUNT);
    reply_read *rd = cg_calloc(1, sizeof(*rd));
    rd->cb = cb;
    rd->ctx = ctx;
    int rc = cg_redis_send_argv(rs, &a, on_read_reply, rd);
    cg_argv_free(&a);
    if (rc < 0)
        free(rd);
    return rc;
}

static void rr_listen(cg_store *st, const char *user, const char *id, long ms)
{
    redis_store *rs = (redis_store *)st;
    if (!cg_redis_linked(rs))
        return;
    cg_argv a = {0};
    cg_argv_str(&a, "SET");
    arg_reply_key(rs, &a, user, id, "reply-listen");
    cg_argv_str(&a, "1");
    cg_argv_str(&a, "PX");
    cg_argv_int(&a, ms);
    cg_redis_send_argv(rs, &a, on_quiet_reply, "SET");
    cg_argv_free(&a);
}

static void on_exists_reply(cg_redis_conn *ac, void *reply_, void *priv)
{
    (void)ac;
    reply_read *rd = priv;
    redisReply *reply = reply_;
    rd->listened(rd->ctx, reply && reply->type == REDIS_REPLY_INTEGER && reply->integer > 0);
    free(rd);
}

static int rr_listened(cg_store *st, const char *user, const char *id, cg_store_listened_fn cb, void *ctx)
{
    redis_store *rs = (redis_store *)st;
    if (!cg_redis_linked(rs))
        return -1;
    cg_argv a = {0};
    cg_argv_str(&a, "EXISTS");
    arg_reply_key(rs, &a, user, id, "reply-listen");
    reply_read *rd = cg_calloc(1, sizeof(*rd));
    rd->listened = cb;
    rd->ctx = ctx;
    int rc = cg_redis_send_argv(rs, &a, on_exists_reply, rd);
    cg_argv_free(&a);
    if (rc < 0)
        free(rd);
    return rc;
}

const cg_store_reply_ops cg_redis_reply_ops = {
    .append = rr_append,
    .read = rr_read,
    .listen = rr_listen,
    .listened = rr_listened,
};
