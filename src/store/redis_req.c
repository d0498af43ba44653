/*
 * redis_req.c: the Redis store's requests (redis_internal.h's redis_req): made, answered
 * "unavailable" when Redis is away or failed them (degraded mode, fallback.c, in front of
 * the store, then answers from memory), and freed once the replies still due to them have
 * come; and the store's own end, when its last handle and request are gone. Below the rest
 * of the Redis store: it calls none of it.
 */
#include <stdlib.h>
#include <string.h>

#include "chatgate/core/alloc.h"
#include "chatgate/core/log.h"
#include "chatgate/store/redis_internal.h"

static void req_closed(uv_handle_t *h)
{
    redis_req *r = h->data;
    redis_store *rs = r->rs;
    cg_redis_snapshot_free(r->snapshot);
    free(r->lease_value);
    free(r->merge_rev);
    free(r->base_rev);
    free(r->release_after);
    free(r->ticket);
    free(r->asked);
    free(r->rev);
    json_decref(r->changes);
    json_decref(r->profile);
    free(r->user);
    free(r->eu);
    free(r->er);
    free(r->key);
    free(r);
    cg_redis_store_unref(rs);
}

/* Frees r once the replies still due to it have come (they come, possibly NULL). */
void cg_redis_req_finish(redis_req *r)
{
    cg_redis_lease_unwait(r->rs, r);
    r->finished = 1;
    if (r->steps == 0)
        uv_close((uv_handle_t *)&r->defer, req_closed);
}

static redis_req *req_alloc(redis_store *rs, cg_store_op kind, char *eu, char *er, void *ctx)
{
    redis_req *r = cg_calloc(1, sizeof(*r));
    r->rs = rs;
    r->kind = kind;
    r->eu = eu;
    r->er = er;
    r->key = cg_store_key_join(eu, er);
    r->ctx = ctx;
    uv_timer_init(rs->base.loop, &r->defer);
    r->defer.data = r;
    rs->handles++;
    return r;
}

redis_req *cg_redis_req_new_escaped(redis_store *rs, cg_store_op kind, const char *eu, const char *er, void *ctx)
{
    return req_alloc(rs, kind, cg_strdup(eu), cg_strdup(er), ctx);
}

redis_req *cg_redis_req_new(redis_store *rs, cg_store_op kind, const char *user, const char *room, void *ctx)
{
    user = user ? user : "";
    redis_req *r = req_alloc(rs, kind, cg_store_escape(user), cg_store_escape(room ? room : ""), ctx);
    if (kind == CG_STORE_REMOVE_USER) /* its memory delete is by the user as given */
        r->user = cg_strdup(user);
    return r;
}

cg_dialog *cg_redis_snapshot(const cg_dialog *d)
{
    cg_dialog *s = cg_malloc(sizeof(*s));
    if (cg_dialog_share(s, d) < 0) {
        free(s);
        s = NULL;
    }
    return s;
}

void cg_redis_snapshot_free(cg_dialog *s)
{
    if (s) {
        cg_dialog_free(s);
        free(s);
    }
}

/*
 * Answers r "unavailable" (Redis is away or failed it: degraded mode, in front of the store,
 * answers from memory), then finishes it. A write-back's failure is the fallback's to know:
 * it goes again. A profile is answered from the store's own copy (redis_profile.c), degraded.
 * Called unless the caller left, closing or not: the caller is degraded mode, which keeps a
 * failed save even then.
 */
void cg_redis_answer_unavailable(redis_req *r)
{
    static const cg_store_status away = {.unavailable = 1};
    if (r->kind == CG_STORE_SAVE && r->version)
        cg_fallback_writeback_failed(r->rs->fb, r->key, r->version);
    else if (!r->abandoned && r->kind == CG_STORE_PROFILE && !r->rs->closing && r->cb.profile) {
        cg_store_status st = {.degraded = 1};
        json_t *p = r->profile ? json_incref(r->profile) : json_object();
        r->rs->base.stats.degraded_answers++;
        r->cb.profile(r->ctx, p, r->profile_err, &st);
        json_decref(p);
    } else if (!r->abandoned && r->kind == CG_STORE_LOAD)
        r->cb.load(r->ctx, NULL, &away);
    else if (!r->abandoned && r->kind == CG_STORE_ROOMS)
        r->cb.rooms(r->ctx, NULL, &away);
    else if (!r->abandoned && r->kind == CG_STORE_LIMIT)
        r->cb.limit(r->ctx, NULL, &away);
    else if (!r->abandoned && r->kind == CG_STORE_SAVE && r->cb.done) {
        cg_store_status st = away;
        st.unsaved = r->merges ? r->snapshot : NULL; /* a merge's: the other copy's turns too */
        r->cb.done(r->ctx, &st);
    } else if (!r->abandoned && r->kind != CG_STORE_PROFILE && r->cb.done)
        r->cb.done(r->ctx, &away);
    cg_redis_req_finish(r);
}

static void deferred_answer(uv_timer_t *t)
{
    cg_redis_answer_unavailable(t->data);
}

void cg_redis_answer_later_unavailable(redis_req *r)
{
    uv_timer_start(&r->defer, deferred_answer, 0, 0);
}
/* ---- the store's end ---------------------------------------------------------------- */

void cg_redis_handle_closed(uv_handle_t *h)
{
    cg_redis_store_unref(h->data);
}

/* Frees rs and what it owns (what open has not made yet is NULL: a bad URL's store too). */
void cg_redis_store_free(redis_store *rs)
{
    cg_fallback_free(rs->fb);
    cg_profiles_free(rs->profiles);
    /* the count at close (redis_store.c) may have changed since: an update answered while
     * the link drained, or one Redis failed then, kept again */
    if (rs->profile_pending && json_object_size(rs->profile_pending))
        cg_warn("redis %s:%d: %zu profile update(s) not written back are lost at exit", rs->host, rs->port,
                json_object_size(rs->profile_pending));
    json_decref(rs->profile_pending);
    for (int i = 0; i < rs->n_sentinels; i++)
        free(rs->sentinel_hosts[i]);
    free(rs->sentinel_hosts);
    free(rs->sentinel_ports);
    for (int i = 0; i < rs->n_seeds; i++)
        free(rs->seed_hosts[i]);
    free(rs->seed_hosts);
    free(rs->seed_ports);
    free(rs->master);
    json_decref(rs->leases);
    json_decref(rs->saving);
    json_decref(rs->save_next);
    json_decref(rs->wake_on_release);
    free(rs->host);
    free(rs->user);
    free(rs->password);
    cg_redis_tls_free(rs->tls);
    free(rs);
}

void cg_redis_store_unref(redis_store *rs)
{
    if (--rs->handles == 0 && rs->closing)
        cg_redis_store_free(rs);
}

