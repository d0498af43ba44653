/*
 * fallback.c: degraded mode for any dialog store that can be away (fallback.h).
 *
 * Three sets, each a JSON object used as an ordered map (jansson keeps insertion order, so
 * the first key is the oldest):
 *   dirty   key -> {"u","r","v","b","n","f"}: written to memory only; user and room
 *           (escaped), the write's version, its bytes, whether the store's copy was unknown
 *           when it began, and whether its write-back is in flight;
 *   unknown keys served fresh from memory while away: a save of them only creates;
 *   recent  key -> {"u","r","t"}: saves the store took in the last SWITCH_REWRITE_MS;
 *   warned  keys told "store_degraded" in this outage.
 * Each is bounded by max_dialogs; dirty also by bytes (redis.writeback_max_bytes).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "chatgate/core/alloc.h"
#include "chatgate/core/log.h"
#include "chatgate/store/fallback.h"

/* The default of redis.writeback_max_bytes, for callers that leave it 0. */
#define WRITEBACK_MAX_BYTES_DEFAULT (64L << 20)

/*
 * A failover loses the writes the old primary took after the new one was promoted (from
 * SENTINEL's REPLICAOF NO ONE to the +switch-master the store acts on: about a second when
 * Sentinel runs the failover, the down-after time and more when the old primary died).
 * The gateway holds what it wrote in memory, so the store notes each dialog it saves and, on
 * a move, the ones saved in the last SWITCH_REWRITE_MS go through the write-back (which
 * merges, never writing over a newer copy another gateway wrote since).
 */
#define SWITCH_REWRITE_MS 30000

/*
 * A dialog can be marked for the write-back while the store is up: its save failed with an
 * error answer (a cluster's slot migrating past the retries, -OOM, ...). Nothing reconnects
 * then, so the tick sends the marked dialogs whose write-back is not in flight again, once a
 * second; until then they are served from memory, as in an outage.
 */
#define FLUSH_AGAIN_MS 1000

/* The warned set is only a courtesy (one warning per dialog and outage): past this, it
 * starts again rather than grow. */
#define WARNED_MAX 100000

struct cg_fallback {
    cg_store *st;      /* its loop, clock, cfg and stats */
    char name[96];     /* in logs: "redis host:port" */
    const cg_fallback_backend_ops *ops;
    void *backend;
    cg_memstore *mem;  /* the gateway's copy */
    cg_limiter *limits; /* limits per user while away (this gateway's counts only) */
    json_t *dirty, *unknown, *recent, *warned;
    long dirty_bytes, dirty_max_bytes;
    long dirty_seq;     /* the last version given to a dirty write */
    uint64_t flushed_at; /* when the tick last sent the marked dialogs again (ms) */
    char away_why[160]; /* why the store is away, as last logged (each new reason once) */
};

static uint64_t now_ms(const cg_fallback *fb)
{
    return uv_now(fb->st->loop);
}

static int64_t now_s(const cg_fallback *fb)
{
    return fb->st->now(fb->st->clock_ctx);
}

cg_fallback *cg_fallback_new(cg_store *st, const char *name, const cg_fallback_backend_ops *ops, void *backend)
{
    cg_fallback *fb = cg_calloc(1, sizeof(*fb));
    const cg_store_config *cfg = &st->cfg;
    fb->st = st;
    snprintf(fb->name, sizeof(fb->name), "%s", name);
    fb->ops = ops;
    fb->backend = backend;
    fb->mem = cg_memstore_new(cfg->max_dialogs, &cfg->lifetimes, &st->stats);
    fb->limits = cg_limiter_new(cfg->max_dialogs);
    fb->dirty = json_object();
    fb->unknown = json_object();
    fb->recent = json_object();
    fb->warned = json_object();
    if (!fb->mem || !fb->limits || !fb->dirty || !fb->unknown || !fb->recent || !fb->warned)
        abort();
    if (cfg->max_bytes > 0)
        cg_memstore_set_max_bytes(fb->mem, cfg->max_bytes);
    fb->dirty_max_bytes = cfg->writeback_max_bytes > 0 ? cfg->writeback_max_bytes : WRITEBACK_MAX_BYTES_DEFAULT;
    return fb;
}

void cg_fallback_free(cg_fallback *fb)
{
    if (!fb)
        return;
    cg_memstore_free(fb->mem);
    cg_limiter_free(fb->limits);
    json_decref(fb->dirty);
    json_decref(fb->unknown);
    json_decref(fb->recent);
    json_decref(fb->warned);
    free(fb);
}

cg_memstore *cg_fallback_copy(cg_fallback *fb)
{
    return fb->mem;
}

/* ---- the dirty set -------------------------------------------------------------------- */

static void dirty_gauges(cg_fallback *fb)
{
    fb->st->stats.writeback_pending = (long)json_object_size(fb->dirty);
    fb->st->stats.writeback_pending_bytes = fb->dirty_bytes;
}

static void dirty_del(cg_fallback *fb, const char *key)
{
    json_t *entry = json_object_get(fb->dirty, key);
    if (!entry)
        return;
    fb->dirty_bytes -= (long)json_integer_value(json_object_get(entry, "b"));
    json_object_del(fb->dirty, key);
    dirty_gauges(fb);
}

/* Keeps the dirty set within max_dialogs and writeback_max_bytes: the least recently written
 * dialogs lose their write-back (the memory copy keeps serving them while it holds them). */
static void dirty_bound(cg_fallback *fb)
{
    long max_dialogs = fb->st->cfg.max_dialogs, dropped = 0;
    while (json_object_size(fb->dirty) > 0 &&
           ((long)json_object_size(fb->dirty) > max_dialogs || fb->dirty_bytes > fb->dirty_max_bytes)) {
        dirty_del(fb, json_object_iter_key(json_object_iter(fb->dirty)));
        fb->st->stats.writeback_dropped_bound++;
        dropped++;
    }
    if (dropped)
        cg_warn("%s: %ld dialogs held for the write-back dropped to stay within %ld dialogs and %ld bytes", fb->name,
                dropped, max_dialogs, fb->dirty_max_bytes);
}

/* Marks d (key's dialog) as written to memory only; the newest goes last. */
static void mark_dirty(cg_fallback *fb, const char *key, const char *eu, const char *er, const cg_dialog *d)
{
    size_t bytes = cg_dialog_weight(d) + strlen(key) + 64; /* about its JSON */
    json_t *old = json_object_get(fb->dirty, key);
    int base_unknown = json_object_get(fb->unknown, key) || json_is_true(json_object_get(old, "n"));
    dirty_del(fb, key); /* re-added at the end: the set runs from least to most recent */
    json_t *entry = json_pack("{s:s, s:s, s:I, s:I, s:b}", "u", eu, "r", er, "v", (json_int_t)++fb->dirty_seq, "b",
                              (json_int_t)bytes, "n", base_unknown);
    if (!entry || json_object_set_new(fb->dirty, key, entry) < 0) {
        cg_error("%s: out of memory: a dialog will not be written back", fb->name);
        fb->st->stats.writeback_dropped_bound++;
        return;
    }
    fb->dirty_bytes += (long)bytes;
    dirty_bound(fb);
    dirty_gauges(fb);
}

int cg_fallback_is_dirty(const cg_fallback *fb, const char *key)
{
    return json_object_get(fb->dirty, key) != NULL;
}

size_t cg_fallback_dirty_count(const cg_fallback *fb)
{
    return json_object_size(fb->dirty);
}

/* ---- the write-back ------------------------------------------------------------------- */

/* Hands one dirty dialog, as memory holds it, to the backend; 0, or -1 when memory no longer
 * holds it (evicted or expired): it is dropped then, never written blank over the store's. */
static int flush_one(cg_fallback *fb, const char *key, json_t *entry)
{
    const char *eu = json_string_value(json_object_get(entry, "u"));
    const char *er = json_string_value(json_object_get(entry, "r"));
    cg_dialog d;
    if (!eu || !er || !cg_memstore_get(fb->mem, key, now_s(fb), &d)) {
        if (eu && er)
            cg_dialog_free(&d);
        dirty_del(fb, key);
        fb->st->stats.writeback_dropped_gone++;
        return -1;
    }
    cg_fallback_dirty item = {
        .key = key,
        .eu = eu,
        .er = er,
        .version = (long)json_integer_value(json_object_get(entry, "v")),
        .base_unknown = json_is_true(json_object_get(entry, "n")),
    };
    json_object_set_new(entry, "f", json_true()); /* its write-back is in flight */
    if (fb->ops->writeback(fb->backend, &item, &d) < 0) {
        json_object_del(entry, "f"); /* still dirty: tried again at the next tick or reconnect */
        return 0;
    }
    /* the store runs this write-back before any save sent after it: those are updates of
     * this copy, not create-only */
    json_object_del(fb->unknown, key);
    return 0;
}

static void flush_dirty(cg_fallback *fb)
{
    const char *key;
    json_t *entry;
    void *tmp;
    long gone = 0;
    size_t sent = 0;
    json_object_foreach_safe(fb->dirty, tmp, key, entry) {
        if (flush_one(fb, key, entry) < 0)
            gone++;
        else
            sent++;
    }
    if (gone)
        cg_warn("%s: %ld dialogs written during the outage are no longer held in memory (evicted or expired): not "
                "written back, the store keeps its copy",
                fb->name, gone);
    if (sent)
        cg_info("%s: writing back %zu dialogs held in memory", fb->name, sent);
}

void cg_fallback_tick(cg_fallback *fb, uint64_t now)
{
    if (!json_object_size(fb->dirty) || fb->st->stats.degraded || now - fb->flushed_at < FLUSH_AGAIN_MS)
        return;
    fb->flushed_at = now;
    const char *key;
    json_t *entry;
    void *tmp;
    json_object_foreach_safe(fb->dirty, tmp, key, entry) {
        if (!json_is_true(json_object_get(entry, "f")))
            flush_one(fb, key, entry);
    }
}

void cg_fallback_written(cg_fallback *fb, const char *key, long version, int written)
{
    json_t *entry = version ? json_object_get(fb->dirty, key) : NULL;
    if (entry && json_integer_value(json_object_get(entry, "v")) == version) {
        dirty_del(fb, key); /* the write-back of what memory holds: done */
        if (written)
            fb->st->stats.flushed++;
        entry = NULL;
    } else if (entry && written && !fb->st->stats.degraded) {
        /* changed meanwhile: its newer version, now; the store holds this dialog's copy now,
         * so the newer one is an update, not a create-only (that would be refused) */
        json_object_set_new(entry, "n", json_false());
        json_object_del(fb->unknown, key);
        flush_one(fb, key, entry);
    }
    if (written) {
        json_object_del(fb->unknown, key); /* written: the store's copy is ours, known */
    } else if (entry) {
        dirty_del(fb, key); /* a newer outage write of the copy refused: refused too */
    }
}

void cg_fallback_writeback_failed(cg_fallback *fb, const char *key, long version)
{
    json_t *entry = json_object_get(fb->dirty, key);
    if (entry && json_integer_value(json_object_get(entry, "v")) == version)
        json_object_del(entry, "f");
}

/* ---- the store going and coming ------------------------------------------------------- */

void cg_fallback_down(cg_fallback *fb, const char *why)
{
    cg_store_stats *s = &fb->st->stats;
    if (s->degraded) {
        /* each new reason once: the first (a timeout at a slow start, say) may not be the one
         * that keeps the store away (a refused certificate, a wrong password) */
        if (strncmp(fb->away_why, why, sizeof(fb->away_why) - 1) != 0) {
            snprintf(fb->away_why, sizeof(fb->away_why), "%s", why);
            cg_warn("%s: still away: %s", fb->name, why);
        }
        return;
    }
    snprintf(fb->away_why, sizeof(fb->away_why), "%s", why);
    s->degraded = 1;
    s->degraded_since_ms = now_ms(fb);
    cg_warn("%s: %s; serving dialogs from memory until it is back", fb->name, why);
}

int cg_fallback_degraded(const cg_fallback *fb)
{
    return fb->st->stats.degraded;
}

void cg_fallback_note_saved(cg_fallback *fb, const char *key, const char *eu, const char *er)
{
    uint64_t now = now_ms(fb);
    json_object_del(fb->recent, key); /* re-added at the end: the set runs oldest first */
    while (json_object_size(fb->recent) > 0) {
        void *it = json_object_iter(fb->recent);
        uint64_t t = (uint64_t)json_integer_value(json_object_get(json_object_iter_value(it), "t"));
        if (now - t <= SWITCH_REWRITE_MS && (long)json_object_size(fb->recent) < fb->st->cfg.max_dialogs)
            break;
        json_object_del(fb->recent, json_object_iter_key(it));
    }
    json_object_set_new(fb->recent, key, json_pack("{s:s, s:s, s:I}", "u", eu, "r", er, "t", (json_int_t)now));
}

/* The store moved to another copy (of the users pick takes; every user when pick is NULL):
 * the dialogs saved lately join the write-back. */
static void rewrite_recent(cg_fallback *fb, int (*pick)(void *ctx, const char *eu), void *ctx)
{
    uint64_t now = now_ms(fb);
    const char *key;
    json_t *entry;
    void *tmp;
    long n = 0;
    json_object_foreach_safe(fb->recent, tmp, key, entry) {
        const char *eu = json_string_value(json_object_get(entry, "u"));
        const char *er = json_string_value(json_object_get(entry, "r"));
        uint64_t t = (uint64_t)json_integer_value(json_object_get(entry, "t"));
        if (eu && pick && !pick(ctx, eu))
            continue; /* on a copy that did not move: still recent for a later move */
        if (eu && er && now - t <= SWITCH_REWRITE_MS && !json_object_get(fb->dirty, key)) {
            cg_dialog d;
            if (cg_memstore_get(fb->mem, key, now_s(fb), &d)) { /* else the store keeps what it has */
                mark_dirty(fb, key, eu, er, &d);
                n++;
            }
            cg_dialog_free(&d);
        }
        json_object_del(fb->recent, key); /* last: key, eu and er are the entry's */
    }
    if (n)
        cg_info("%s: writing %ld dialogs saved in the last %d s again: the old primary may have taken them after this "
                "one was promoted",
                fb->name, n, SWITCH_REWRITE_MS / 1000);
}

void cg_fallback_moved(cg_fallback *fb, int (*pick)(void *ctx, const char *eu), void *ctx)
{
    rewrite_recent(fb, pick, ctx);
    if (!fb->st->stats.degraded)
        flush_dirty(fb);
}

void cg_fallback_up(cg_fallback *fb, int moved)
{
    cg_store_stats *s = &fb->st->stats;
    if (moved)
        rewrite_recent(fb, NULL, NULL);
    if (s->degraded) {
        s->degraded = 0;
        s->degraded_seconds += (double)(now_ms(fb) - s->degraded_since_ms) / 1000.0;
        json_object_clear(fb->warned);
    }
    flush_dirty(fb);
}

void cg_fallback_closing(cg_fallback *fb)
{
    if (json_object_size(fb->dirty))
        cg_warn("%s: stopping with %zu dialogs not yet written back", fb->name, json_object_size(fb->dirty));
}

/* ---- answers from memory --------------------------------------------------------------- */

static cg_store_status answer_status(cg_fallback *fb, const char *key, int load)
{
    cg_store_status st = {1, 0, 0};
    if (load && !json_object_get(fb->warned, key)) {
        if (json_object_size(fb->warned) > WARNED_MAX)
            json_object_clear(fb->warned);
        st.warn = json_object_set_new(fb->warned, key, json_true()) == 0;
    }
    fb->st->stats.degraded_answers++;
    return st;
}

int cg_fallback_base_unknown(const cg_fallback *fb, const char *key)
{
    return json_object_get(fb->unknown, key) != NULL;
}

void cg_fallback_known(cg_fallback *fb, const char *key)
{
    json_object_del(fb->unknown, key);
}

void cg_fallback_forget(cg_fallback *fb, const char *key)
{
    cg_memstore_del(fb->mem, key);
    json_object_del(fb->unknown, key);
}

static int load_from_memory(cg_fallback *fb, const char *key, cg_dialog *d)
{
    int found = cg_memstore_get(fb->mem, key, now_s(fb), d);
    if (!found) { /* the store's copy is unknown: until it is read or written, a save only creates */
        while ((long)json_object_size(fb->unknown) >= fb->st->cfg.max_dialogs && json_object_size(fb->unknown))
            json_object_del(fb->unknown, json_object_iter_key(json_object_iter(fb->unknown)));
        json_object_set_new(fb->unknown, key, json_true()); /* out of memory: created_at still guards */
    }
    return found;
}

void cg_fallback_save(cg_fallback *fb, const char *key, const char *eu, const char *er, const cg_dialog *d)
{
    cg_memstore_keep(fb->mem, key, d, now_s(fb), NULL, 0);
    mark_dirty(fb, key, eu, er, d);
}

void cg_fallback_remove(cg_fallback *fb, const char *key)
{
    cg_memstore_del(fb->mem, key);
    dirty_del(fb, key);
}

void cg_fallback_remove_user(cg_fallback *fb, const char *user, const char *eu)
{
    cg_memstore_del_user(fb->mem, user);
    cg_limiter_forget(fb->limits, eu);
    const char *key;
    json_t *entry;
    void *tmp;
    json_object_foreach_safe(fb->dirty, tmp, key, entry) {
        const char *u = json_string_value(json_object_get(entry, "u"));
        if (u && strcmp(u, eu) == 0)
            dirty_del(fb, key);
    }
}

void cg_fallback_answer_req(cg_fallback *fb, cg_store_req *req, const cg_fallback_subject *s, int closing)
{
    int wanted = !req->abandoned && !closing;
    cg_store_status st = answer_status(fb, s->key, req->kind == CG_STORE_LOAD);
    switch (req->kind) {
    case CG_STORE_LOAD: {
        cg_dialog d;
        st.found = load_from_memory(fb, s->key, &d);
        if (wanted)
            req->cb.load(req->ctx, &d, &st);
        else
            cg_dialog_free(&d);
        return;
    }
    case CG_STORE_SAVE:
        if (s->version) /* a write-back that failed: it goes again (the tick, a reconnect) */
            cg_fallback_writeback_failed(fb, s->key, s->version);
        else if (s->snapshot)
            cg_fallback_save(fb, s->key, s->eu, s->er, s->snapshot);
        break;
    case CG_STORE_REMOVE:
        cg_fallback_remove(fb, s->key);
        break;
    case CG_STORE_REMOVE_USER:
        cg_fallback_remove_user(fb, s->user, s->eu);
        break;
    case CG_STORE_ROOMS: {
        json_t *rooms = cg_memstore_rooms(fb->mem, s->key);
        if (wanted)
            req->cb.rooms(req->ctx, rooms, &st);
        json_decref(rooms);
        return;
    }
    case CG_STORE_PROFILE:
        if (wanted && req->cb.profile) {
            json_t *p = s->profile ? json_incref(s->profile) : json_object();
            req->cb.profile(req->ctx, p, s->profile_err, &st);
            json_decref(p);
        }
        return;
    case CG_STORE_LIMIT:
        if (wanted) { /* a turn gone is not counted */
            cg_limit_verdict v;
            cg_limiter_take(fb->limits, s->eu, s->limits, cg_store_now_ms(fb->st), &v);
            req->cb.limit(req->ctx, &v, &st);
        }
        return;
    }
    if (wanted && req->cb.done) /* save, remove, remove_user */
        req->cb.done(req->ctx, &st);
}

void cg_fallback_limit_end(cg_fallback *fb, const char *eu, const cg_limits *lim, long long tokens, int64_t now)
{
    cg_limiter_end(fb->limits, eu, lim, tokens, now);
}
