/*
 * redis_req.c: the Redis store's requests (redis_internal.h's redis_req): made, answered from
 * memory when Redis is away or failed them (through the fallback, fallback.c), and freed once
 * the replies still due to them have come; and the store's own end, when its last handle
 * and request are gone. Below the rest of the Redis store: it calls none of it.
 */
#include <stdlib.h>
#include <string.h>

#include "chatgate/core/alloc.h"
#include "chatgate/store/redis_internal.h"

static void req_closed(uv_handle_t *h)
{
    redis_req *r = h->data;
    redis_store *rs = r->rs;
    cg_redis_snapshot_free(r->snapshot);
    free(r->lease_value);
    free(r->merge_rev);
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
    size_t nu = strlen(eu), nr = strlen(er); /* "<eu>:<er>", twice a turn: no asprintf */
    r->key = cg_malloc(nu + nr + 2);
    memcpy(r->key, eu, nu);
    r->key[nu] = ':';
    memcpy(r->key + nu + 1, er, nr + 1);
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

/* Answers r from memory (Redis is away or failed it), then finishes it. */
void cg_redis_answer_from_memory(redis_req *r)
{
    cg_fallback_subject s = {
        .key = r->key,
        .eu = r->eu,
        .er = r->er,
        .user = r->user,
        .snapshot = r->snapshot,
        .version = r->version,
        .limits = &r->limits,
        .profile = r->profile,
        .profile_err = r->profile_err,
    };
    cg_fallback_answer_req(r->rs->fb, (cg_store_req *)r, &s, r->rs->closing);
    cg_redis_req_finish(r);
}

static void deferred_answer(uv_timer_t *t)
{
    cg_redis_answer_from_memory(t->data);
}

void cg_redis_answer_later_from_memory(redis_req *r)
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

