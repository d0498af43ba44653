/*
 * redis_profile.c: the Redis store's profiles (store.h, cg_store_profile_ops; docs/state.md,
 * "The user's profile"). A user's profile is one HASH beside the user's rooms set, under the
 * user's hash tag (so one shard, one cluster slot, twemproxy's hash_tag too):
 *   <prefix>:{<user>}:profile   HASH  name -> the value as compact JSON, PX profile_s
 * A read is a plain HGETALL, in the round trip of the turn's load (no script: every chat turn
 * reads the profile, most users have none, and a script costs Redis several times a command);
 * a profile it finds is renewed after the answer (PEXPIRE, nobody waits). An update is one
 * script that applies the changes only when the profile stays within profile_cap bytes, as
 * one step, so two gateways writing one user's profile cannot pass the bound together. It
 * goes as EVAL, with its text, never EVALSHA: a NOSCRIPT answer would send it again behind
 * the next turn's HGETALL, which would then read the profile without it (an update is rare,
 * and Redis hashing its 700 bytes is cheaper than a gate like the dialogs' saves).
 *
 * What Redis answers is copied into rs->profiles, which answers while Redis is away. An update
 * made meanwhile changes that copy, and its changes wait in rs->profile_pending: the link's
 * coming back writes them to Redis (cg_redis_profiles_writeback), through the same script,
 * so a profile is not lost to an outage (nor passes the cap: a change refused then is logged).
 * Shutdown waits for them too (redis_store.c, close_work): the updates sent are counted
 * until answered, and those still pending are sent when the link is up while closing.
 */
#include <hiredis/hiredis.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "chatgate/core/alloc.h"
#include "chatgate/core/error.h"
#include "chatgate/core/log.h"
#include "chatgate/store/redis_internal.h"

/*
 * KEYS[1] the profile; ARGV[1] its lifetime (ms), ARGV[2] the cap (bytes), then name, value
 * pairs (value "" forgets the name: no JSON text is empty). The size is the profile's as
 * compact JSON, {"name":value,...}: names need no escaping (profiles.h). Answers {1, the
 * profile} when written, {0, the profile as it stays} when the cap refused it.
 */
static const char update_script[] =
    "local cur = redis.call('HGETALL', KEYS[1])\n"
    "local t = {}\n"
    "for i = 1, #cur, 2 do t[cur[i]] = cur[i + 1] end\n"
    "for i = 3, #ARGV, 2 do if ARGV[i + 1] == '' then t[ARGV[i]] = nil else t[ARGV[i]] = ARGV[i + 1] end end\n"
    "local size, n = 2, 0\n"
    "for k, v in pairs(t) do size = size + #k + #v + 3; n = n + 1 end\n"
    "if n > 1 then size = size + n - 1 end\n"
    "if size > tonumber(ARGV[2]) then return {0, cur} end\n"
    "for i = 3, #ARGV, 2 do\n"
    "  if ARGV[i + 1] == '' then redis.call('HDEL', KEYS[1], ARGV[i])\n"
    "  else redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1]) end\n"
    "end\n"
    "if n > 0 then redis.call('PEXPIRE', KEYS[1], ARGV[1]) end\n"
    "return {1, redis.call('HGETALL', KEYS[1])}\n";

void cg_redis_profile_key(redis_store *rs, cg_argv *a, const char *eu)
{
    cg_argv_key(a, rs->base.cfg.prefix, eu, NULL, "profile");
}

/* A HGETALL's answer as a profile: each value read as JSON; one that is not (written by
 * something else) is left out, said once a read. NULL when the answer is not a hash's. */
static json_t *profile_of(redisReply *rep)
{
    if (!rep || rep->type != REDIS_REPLY_ARRAY || rep->elements % 2)
        return NULL;
    json_t *p = json_object();
    int left_out = 0;
    for (size_t i = 0; p && i < rep->elements; i += 2) {
        redisReply *k = rep->element[i], *v = rep->element[i + 1];
        json_t *value = v->type == REDIS_REPLY_STRING ? json_loadb(v->str, v->len, JSON_DECODE_ANY, NULL) : NULL;
        char *name = k->type == REDIS_REPLY_STRING ? cg_strndup(k->str, k->len) : NULL;
        if (value && name && strlen(name) == k->len)
            json_object_set_new(p, name, value);
        else {
            json_decref(value);
            left_out++;
        }
        free(name);
    }
    if (left_out)
        cg_warn("redis: a profile held %d field(s) chatgate does not write (not JSON): left out", left_out);
    return p;
}

/* Answers r with r->profile (an empty one when none) and finishes it. */
static void answer(redis_req *r, const cg_store_status *st)
{
    json_t *p = r->profile ? r->profile : json_object();
    if (!r->abandoned && !r->rs->closing && r->cb.profile)
        r->cb.profile(r->ctx, p, r->profile_err, st);
    if (!r->profile)
        json_decref(p);
    cg_redis_req_finish(r);
}

/* An update made while Redis is away (or that it failed): its changes wait for the link to
 * come back, merged with the user's earlier ones (a later value of a name wins). */
static void keep_for_writeback(redis_store *rs, const char *eu, json_t *changes)
{
    json_t *had = json_object_get(rs->profile_pending, eu);
    if (!had && (long)json_object_size(rs->profile_pending) >= rs->base.cfg.max_dialogs) {
        cg_warn("redis %s:%d: away: %ld profiles wait for the write-back already: this update is kept in this "
                "gateway's memory only",
                rs->host, rs->port, (long)json_object_size(rs->profile_pending));
        return;
    }
    if (!had)
        json_object_set_new(rs->profile_pending, eu, had = json_object());
    json_object_update(had, changes);
}

static void send_profile(redis_store *rs, redis_req *r);

size_t cg_redis_profiles_unwritten(const redis_store *rs)
{
    return json_object_size(rs->profile_pending) + (size_t)rs->profile_updates_sent;
}

void cg_redis_profiles_writeback(redis_store *rs)
{
    json_t *pending = rs->profile_pending;
    if (!json_object_size(pending))
        return;
    rs->profile_pending = json_object();
    cg_info("redis %s:%d: back: writing %ld profile update(s) made while it was away", rs->host, rs->port,
            (long)json_object_size(pending));
    const char *eu;
    json_t *changes;
    json_object_foreach(pending, eu, changes) {
        redis_req *r = cg_redis_req_new_escaped(rs, CG_STORE_PROFILE, eu, "", NULL);
        r->changes = json_incref(changes); /* nobody waits: no callback */
        send_profile(rs, r);
    }
    json_decref(pending);
}

/* Redis is away, or failed r: the copy answers (and an update changes it alone). */
static void from_copy(redis_req *r)
{
    redis_store *rs = r->rs;
    int64_t now = rs->base.now(rs->base.clock_ctx);
    const cg_lifetimes *lt = &rs->base.cfg.lifetimes;
    json_decref(r->profile);
    r->profile = NULL;
    if (!r->changes) {
        json_t *had = cg_profiles_get(rs->profiles, r->eu, now, lt->profile_s);
        r->profile = had ? json_incref(had) : NULL;
    } else if (!(r->profile_err = cg_profiles_update(rs->profiles, r->eu, r->changes, now, lt->profile_s,
                                                     lt->profile_cap, &r->profile))) {
        keep_for_writeback(rs, r->eu, r->changes);
    }
    cg_redis_answer_later_unavailable(r); /* from the loop, degraded, with the copy kept here */
}

/* A profile found is used: its lifetime starts again (nobody waits for the answer). */
static void renew(redis_store *rs, const char *eu)
{
    cg_argv a = {0};
    cg_argv_str(&a, "PEXPIRE");
    cg_redis_profile_key(rs, &a, eu);
    cg_argv_int(&a, (long long)rs->base.cfg.lifetimes.profile_s * 1000);
    cg_redis_send_argv(rs, &a, NULL, NULL);
    cg_argv_free(&a);
}

static void on_reply(cg_redis_conn *ac, void *reply_, void *priv)
{
    (void)ac;
    redis_req *r = priv;
    redis_store *rs = r->rs;
    redisReply *reply = reply_;
    redisReply *hash = reply;
    int written = 1;
    if (r->changes) { /* {1|0, the profile} */
        rs->profile_updates_sent--;
        if (!reply || reply->type != REDIS_REPLY_ARRAY || reply->elements != 2 ||
            reply->element[0]->type != REDIS_REPLY_INTEGER) {
            hash = NULL;
        } else {
            written = reply->element[0]->integer == 1;
            hash = reply->element[1];
        }
    }
    json_t *p = cg_redis_reply_failed(rs, reply, 0, "profile") ? NULL : profile_of(hash);
    if (!p) {
        rs->base.stats.errors++;
        from_copy(r);
        return;
    }
    int64_t now = rs->base.now(rs->base.clock_ctx);
    cg_profiles_put(rs->profiles, r->eu, p, now, rs->base.cfg.lifetimes.profile_s);
    if (!r->changes && json_object_size(p) && cg_redis_linked(rs))
        renew(rs, r->eu);
    r->profile = p;
    r->profile_err = written ? 0 : CG_E_TOO_LARGE;
    if (!written && !r->cb.profile) /* a write-back: nobody else hears it */
        cg_warn("redis %s:%d: a profile update made while Redis was away would pass profile_cap now: not written",
                rs->host, rs->port);
    static const cg_store_status ok = {0};
    answer(r, &ok);
}

/* Sends r's command (a read) or script (an update), or answers it from the copy when Redis
 * is away. Closing, an update still goes (its changes would be lost at exit otherwise: close
 * waits for its answer); a read has nobody to tell. */
static void send_profile(redis_store *rs, redis_req *r)
{
    if (!cg_redis_linked(rs) || (rs->closing && !r->changes)) {
        from_copy(r);
        return;
    }
    cg_argv a = {0};
    if (!r->changes) {
        cg_argv_str(&a, "HGETALL");
        cg_redis_profile_key(rs, &a, r->eu);
    } else {
        cg_argv_str(&a, "EVAL"); /* not EVALSHA: see the top of this file */
        cg_argv_str(&a, update_script);
        cg_argv_str(&a, "1");
        cg_redis_profile_key(rs, &a, r->eu);
        cg_argv_int(&a, (long long)rs->base.cfg.lifetimes.profile_s * 1000);
        cg_argv_int(&a, (long long)rs->base.cfg.lifetimes.profile_cap);
        const char *name;
        json_t *v;
        json_object_foreach(r->changes, name, v) {
            cg_argv_str(&a, name);
            if (json_is_null(v))
                cg_argv_str(&a, "");
            else
                cg_argv_json(&a, v);
        }
    }
    int rc = cg_redis_send_argv(rs, &a, on_reply, r);
    cg_argv_free(&a);
    if (rc < 0) {
        rs->base.stats.errors++;
        from_copy(r);
    } else if (r->changes) {
        rs->profile_updates_sent++;
    }
}

static cg_store_req *rs_profile(cg_store *st, const char *user, json_t *changes, cg_store_profile_fn cb, void *ctx)
{
    redis_store *rs = (redis_store *)st;
    redis_req *r = cg_redis_req_new(rs, CG_STORE_PROFILE, user, "", ctx);
    r->cb.profile = cb;
    r->changes = json_incref(changes);
    send_profile(rs, r);
    return (cg_store_req *)r; /* its first fields are cg_store_req's */
}

static cg_store_req *rs_profile_get(cg_store *st, const char *user, cg_store_profile_fn cb, void *ctx)
{
    return rs_profile(st, user, NULL, cb, ctx);
}

static cg_store_req *rs_profile_update(cg_store *st, const char *user, json_t *changes, cg_store_profile_fn cb,
                                       void *ctx)
{
    return rs_profile(st, user, changes, cb, ctx);
}

const cg_store_profile_ops cg_redis_profile_ops = {.get = rs_profile_get, .update = rs_profile_update};
