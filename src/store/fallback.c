/*
 * fallback.c: degraded mode for any dialog store that can be away (fallback.h): the
 * gateway's copy, the dirty set and the write-back, and the wrapper's tables in front of the
 * store's dialogs, lease and limits.
 *
 * Four sets, each a JSON object used as an ordered map (jansson keeps insertion order, so
 * the first key is the oldest):
 *   dirty   key -> {"u","r","v","b","n","fv"}: written to memory only; user and room
 *           (escaped), the write's version, its bytes, whether the store's copy was unknown
 *           when it began, and the version whose write-back is in flight, if any (kept
 *           when a newer write replaces the entry: one write-back of a dialog at a time);
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
 * a move, the ones saved in the SWITCH_REWRITE_MS before the store lost the old primary (or
 * before the move, when it never lost it) go through the write-back (which merges, never
 * writing over a newer copy another gateway wrote since). Counted from the move, a primary
 * that died was forgotten with what it lacked whenever the Sentinels took longer than that
 * to promote another: their stock down-after time is 30 s.
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

typedef struct fb_req fb_req;

struct cg_fallback {
    cg_store *st;      /* its loop, clock, cfg and stats */
    char name[96];     /* in logs: "redis host:port" */
    cg_fallback_inner inner; /* the store it stands in front of */
    const cg_fallback_backend_ops *ops;
    void *backend;
    fb_req *live;      /* the requests not yet finished, doubly linked: freed at the end */
    fb_req *queue, **queue_tail; /* answered from memory at the next turn of the loop */
    uv_timer_t answer; /* runs the queue */
    int closing;
    void (*closed)(void *arg);
    void *closed_arg;
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

static void on_answer(uv_timer_t *t);

cg_fallback *cg_fallback_new(cg_store *st, const char *name, const cg_fallback_inner *inner,
                             const cg_fallback_backend_ops *ops, void *backend)
{
    cg_fallback *fb = cg_calloc(1, sizeof(*fb));
    const cg_store_config *cfg = &st->cfg;
    fb->st = st;
    st->fallback = fb;
    snprintf(fb->name, sizeof(fb->name), "%s", name);
    fb->inner = *inner;
    fb->queue_tail = &fb->queue;
    uv_timer_init(st->loop, &fb->answer);
    fb->answer.data = fb;
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

static void req_free(fb_req *w);

void cg_fallback_free(cg_fallback *fb)
{
    if (!fb)
        return;
    while (fb->live) /* what the inner store will not answer now: the store is gone */
        req_free(fb->live);
    /* the count at stopping (cg_fallback_stop_writeback) may have changed since: a write-back
     * still in flight then was answered while the link drained, or its newer version was
     * marked, which the closing link no longer sends */
    if (json_object_size(fb->dirty))
        cg_warn("%s: %zu dialogs not written back are lost at exit", fb->name, json_object_size(fb->dirty));
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
    cg_memstore_pin(fb->mem, key, CG_MEMSTORE_UNPIN); /* Redis has its turns now, or they are given up */
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
        const char *key = json_object_iter_key(json_object_iter(fb->dirty));
        cg_memstore_pin(fb->mem, key, CG_MEMSTORE_UNPIN_OLDEST); /* the least recently written */
        dirty_del(fb, key);
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
    json_t *in_flight = json_incref(json_object_get(old, "fv"));
    dirty_del(fb, key); /* re-added at the end: the set runs from least to most recent */
    json_t *entry = json_pack("{s:s, s:s, s:I, s:I, s:b}", "u", eu, "r", er, "v", (json_int_t)++fb->dirty_seq, "b",
                              (json_int_t)bytes, "n", base_unknown);
    if (entry && in_flight)
        json_object_set(entry, "fv", in_flight); /* the older write-back still runs: this one waits */
    json_decref(in_flight);
    if (!entry || json_object_set_new(fb->dirty, key, entry) < 0) {
        cg_error("%s: out of memory: a dialog will not be written back", fb->name);
        fb->st->stats.writeback_dropped_bound++;
        return;
    }
    fb->dirty_bytes += (long)bytes;
    /* the memory copy is the only one of its turns until the write-back: not evicted (the
     * dirty set's own bounds, below, bound these) */
    cg_memstore_pin(fb->mem, key, CG_MEMSTORE_PIN);
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

/* 1 while a write-back of the dialog (this version or an older one) is in flight. */
static int in_flight(json_t *entry)
{
    return json_object_get(entry, "fv") != NULL;
}

/* Hands one dirty dialog, as memory holds it, to the backend; 0, or -1 when memory no longer
 * holds it (expired, or memory ran out): it is dropped then, never written blank over the store's. */
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
    json_object_set_new(entry, "fv", json_integer((json_int_t)item.version)); /* its write-back is in flight */
    if (fb->ops->writeback(fb->backend, &item, &d) < 0) {
        json_object_del(entry, "fv"); /* still dirty: tried again at the next tick or reconnect */
        return 0;
    }
    /* the store runs this write-back before any save sent after it: those are updates of
     * this copy, not create-only */
    json_object_del(fb->unknown, key);
    return 0;
}

/* Hands every dirty dialog not already in flight to the backend; `tell` logs how many went
 * (a reconnect's round, not the tick's). Those memory no longer holds are dropped, and said. */
static void flush_dirty(cg_fallback *fb, int tell)
{
    const char *key;
    json_t *entry;
    void *tmp;
    long gone = 0;
    size_t sent = 0;
    json_object_foreach_safe(fb->dirty, tmp, key, entry) {
        if (in_flight(entry))
            continue; /* its answer sends the newer version (cg_fallback_written) */
        if (flush_one(fb, key, entry) < 0)
            gone++;
        else
            sent++;
    }
    if (gone)
        cg_warn("%s: %ld dialogs written during the outage are no longer held in memory (expired): not "
                "written back, the store keeps its copy",
                fb->name, gone);
    if (sent && tell)
        cg_info("%s: writing back %zu dialogs held in memory", fb->name, sent);
}

void cg_fallback_tick(cg_fallback *fb, uint64_t now)
{
    if (!json_object_size(fb->dirty) || fb->st->stats.degraded || now - fb->flushed_at < FLUSH_AGAIN_MS)
        return;
    fb->flushed_at = now;
    flush_dirty(fb, 0);
}

void cg_fallback_written(cg_fallback *fb, const char *key, long version, int written)
{
    json_t *entry = version ? json_object_get(fb->dirty, key) : NULL;
    if (entry && json_integer_value(json_object_get(entry, "v")) == version) {
        dirty_del(fb, key); /* the write-back of what memory holds: done */
        if (written)
            fb->st->stats.flushed++;
        entry = NULL;
    } else if (entry && json_integer_value(json_object_get(entry, "fv")) == version) {
        json_object_del(entry, "fv"); /* the newer version's turn: sent below, or by the tick */
    }
    if (entry && written && !fb->st->stats.degraded && !in_flight(entry)) {
        /* changed meanwhile: its newer version, now; the store holds this dialog's copy now,
         * so the newer one is an update, not a create-only (that would be refused) */
        json_object_set_new(entry, "n", json_false());
        json_object_del(fb->unknown, key);
        flush_one(fb, key, entry);
    }
    /* written: the store's copy is ours, known. Not written: a newer version of the copy
     * (turns answered since) stays dirty; its own write-back merges with the store's copy,
     * so dropping it with this one's refusal would lose them */
    if (written)
        json_object_del(fb->unknown, key);
}

void cg_fallback_writeback_failed(cg_fallback *fb, const char *key, long version)
{
    fb->st->stats.writeback_failed++;
    json_t *entry = json_object_get(fb->dirty, key);
    if (entry && json_integer_value(json_object_get(entry, "fv")) == version)
        json_object_del(entry, "fv"); /* this version, or a newer one written meanwhile: the tick sends it */
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
    /* the last moment the old copy took writes: when the store lost it, if it did */
    uint64_t now = fb->st->stats.degraded ? fb->st->stats.degraded_since_ms : now_ms(fb);
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
        if (eu && er && (t >= now || now - t <= SWITCH_REWRITE_MS) && !json_object_get(fb->dirty, key)) {
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
        cg_info("%s: writing %ld dialogs saved in the last %d s before the switch again: the old primary may have "
                "taken them after this one was promoted",
                fb->name, n, SWITCH_REWRITE_MS / 1000);
}

void cg_fallback_moved(cg_fallback *fb, int (*pick)(void *ctx, const char *eu), void *ctx)
{
    rewrite_recent(fb, pick, ctx);
    if (!fb->st->stats.degraded)
        flush_dirty(fb, 1);
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
    flush_dirty(fb, 1);
}

static void on_answer_closed(uv_handle_t *h)
{
    cg_fallback *fb = h->data;
    if (fb->closed)
        fb->closed(fb->closed_arg);
}

void cg_fallback_closing(cg_fallback *fb, void (*closed)(void *arg), void *arg)
{
    fb->closing = 1;
    fb->closed = closed;
    fb->closed_arg = arg;
    uv_close((uv_handle_t *)&fb->answer, on_answer_closed); /* the queue goes with the fallback */
    if (fb->st->stats.degraded || !json_object_size(fb->dirty))
        return;
    /* memory holds the only copy of these turns, and their clients were answered: what waits
     * for the tick's next round (a write-back refused, a save failed while up) goes now; what
     * is in flight goes on, a newer version after it (cg_fallback_written). The store waits
     * for them (cg_fallback_dirty_count), then calls cg_fallback_stop_writeback */
    fb->flushed_at = now_ms(fb); /* the tick, while the store waits, sends a refused one again a second on */
    flush_dirty(fb, 1);
}

void cg_fallback_stop_writeback(cg_fallback *fb, const char *why)
{
    if (json_object_size(fb->dirty))
        cg_warn("%s: stopping with %zu dialogs not yet written back (%s)", fb->name, json_object_size(fb->dirty), why);
}

/* ---- what the inner store's answers mean here ------------------------------------------ */

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

static void fallback_save(cg_fallback *fb, const char *key, const char *eu, const char *er, const cg_dialog *d)
{
    cg_memstore_view held;
    if (cg_fallback_is_dirty(fb, key) && !cg_memstore_view_of(fb->mem, key, now_s(fb), &held)) {
        /* its copy written during the outage lapsed before its write-back (or memory ran
         * out): this save's copy replaces it, without its turns. Not the bounds: a dirty
         * dialog is pinned in memory (cg_memstore_pin) */
        fb->st->stats.writeback_dropped_gone++;
        cg_warn("%s: dialog #%08lx written during the outage was no longer held in memory (expired) when "
                "it was saved again: the turns before are not written back",
                fb->name, cg_store_key_tag(key));
    }
    cg_memstore_keep(fb->mem, key, d, now_s(fb), NULL, 0);
    mark_dirty(fb, key, eu, er, d);
}

void cg_fallback_remove(cg_fallback *fb, const char *key)
{
    cg_memstore_del(fb->mem, key);
    dirty_del(fb, key);
}

static void fallback_remove_user(cg_fallback *fb, const char *user, const char *eu)
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

/* ---- the wrapper: where each request goes ------------------------------------------------ */

/*
 * A request of the wrapper's: cg_store_req's fields first (store.h), then what it needs to
 * be answered from memory. It goes to the inner store (inner, until that answers) unless
 * memory answers it at once: the store is away, or the dialog is dirty. The inner store's
 * answer is passed on, unless it was status.unavailable (or the dialog went dirty
 * meanwhile): memory answers then. A save keeps its own share of the dialog, so that memory
 * can keep it if the inner store fails it.
 */
struct fb_req {
    CG_STORE_REQ_FIELDS
    cg_fallback *fb;
    fb_req *prev, *next; /* in fb->live */
    fb_req *queued;      /* in fb->queue */
    cg_store_req *inner; /* in flight at the inner store, or NULL */
    char *eu, *er;       /* user and room, escaped */
    char *key;           /* "<eu>:<er>"; the rooms' and remove_user's: "<eu>:" */
    char *user;          /* remove_user: the user as given */
    cg_dialog *snapshot; /* save: the dialog (parts shared), until the inner store took it */
    cg_limits limits;    /* limit: what the message is held to */
    int lease;           /* load: a turn's, which took the dialog's lease at the inner store */
};

static fb_req *req_new(cg_fallback *fb, cg_store_op kind, const char *user, const char *room, void *ctx)
{
    fb_req *w = cg_calloc(1, sizeof(*w));
    w->fb = fb;
    w->kind = kind;
    w->ctx = ctx;
    w->eu = cg_store_escape(user ? user : "");
    w->er = cg_store_escape(room ? room : "");
    w->key = cg_store_key_join(w->eu, w->er);
    w->next = fb->live;
    if (fb->live)
        fb->live->prev = w;
    fb->live = w;
    return w;
}

static void req_free(fb_req *w)
{
    cg_fallback *fb = w->fb;
    if (w->prev)
        w->prev->next = w->next;
    else
        fb->live = w->next;
    if (w->next)
        w->next->prev = w->prev;
    if (w->snapshot) {
        cg_dialog_free(w->snapshot);
        free(w->snapshot);
    }
    free(w->eu);
    free(w->er);
    free(w->key);
    free(w->user);
    free(w);
}

/* Does memory answer requests about key now? */
static int answers_here(const cg_fallback *fb, const char *key)
{
    return fb->st->stats.degraded || fb->closing || json_object_get(fb->dirty, key) != NULL;
}

/* Is anyone still waiting for w's answer? */
static int wanted(const fb_req *w)
{
    return !w->abandoned && !w->fb->closing;
}

static cg_store_status answer_status(cg_fallback *fb, const char *key, int load)
{
    cg_store_status st = {.degraded = 1};
    if (load && !json_object_get(fb->warned, key)) {
        if (json_object_size(fb->warned) > WARNED_MAX)
            json_object_clear(fb->warned);
        st.warn = json_object_set_new(fb->warned, key, json_true()) == 0;
    }
    fb->st->stats.degraded_answers++;
    return st;
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

/*
 * Answers w from memory (the store is away, failed it, or the dialog is dirty), then frees
 * it: a load from the gateway's copy (degraded, found, and warn on the dialog's first such
 * load in this outage: a save's answer reaches nobody, so it must not use up the warning); a
 * save kept and marked for the write-back (one kept at its call has no snapshot left); the
 * rooms memory holds; a limit counted by this gateway alone (a turn gone is not counted); a
 * delete, done here at its call, done again.
 */
static void answer_here(fb_req *w)
{
    cg_fallback *fb = w->fb;
    int want = wanted(w);
    cg_store_status st = answer_status(fb, w->key, w->kind == CG_STORE_LOAD);
    switch (w->kind) {
    case CG_STORE_LOAD: {
        cg_dialog d;
        st.found = load_from_memory(fb, w->key, &d);
        if (want)
            w->cb.load(w->ctx, &d, &st);
        else
            cg_dialog_free(&d);
        break;
    }
    case CG_STORE_ROOMS: {
        json_t *rooms = want ? cg_memstore_rooms(fb->mem, w->key) : NULL;
        if (want)
            w->cb.rooms(w->ctx, rooms, &st);
        json_decref(rooms);
        break;
    }
    case CG_STORE_LIMIT:
        if (want) {
            cg_limit_verdict v;
            cg_limiter_take(fb->limits, w->eu, &w->limits, cg_store_now_ms(fb->st), &v);
            w->cb.limit(w->ctx, &v, &st);
        }
        break;
    case CG_STORE_SAVE:
        if (w->snapshot) /* failed by the store: kept for the write-back */
            fallback_save(fb, w->key, w->eu, w->er, w->snapshot);
        /* fall through */
    default: /* save, remove, remove_user */
        /* a delete the store failed is done here again: a save of the dialog it waited behind
         * at the store may have failed first, and been kept (it would be written back) */
        if (w->kind == CG_STORE_REMOVE)
            cg_fallback_remove(fb, w->key);
        else if (w->kind == CG_STORE_REMOVE_USER)
            fallback_remove_user(fb, w->user, w->eu);
        if (want && w->cb.done)
            w->cb.done(w->ctx, &st);
        break;
    }
    req_free(w);
}

/* The queue: the answers from memory due, in the order they were asked. */
static void on_answer(uv_timer_t *t)
{
    cg_fallback *fb = t->data;
    fb_req *w = fb->queue;
    fb->queue = NULL;
    fb->queue_tail = &fb->queue;
    while (w) {
        fb_req *next = w->queued;
        answer_here(w);
        w = next;
    }
}

/* Answers w from memory from the loop, never inside the call that made it (store.h). */
static cg_store_req *answer_later(fb_req *w)
{
    *w->fb->queue_tail = w;
    w->fb->queue_tail = &w->queued;
    if (!w->fb->closing)
        uv_timer_start(&w->fb->answer, on_answer, 0, 0);
    return (cg_store_req *)w;
}

/* The caller of a load, a rooms' read or a limit went: its inner request goes with it (a
 * turn's load gives up its place in the lease's line; a limit taken is ended). */
static void abandon_inner(cg_store_req *req)
{
    fb_req *w = (fb_req *)req;
    if (!w->inner || w->fb->closing)
        return; /* in the queue, or being answered: it ends there; closing, the inner store
                 * may have dropped its request unanswered: cg_fallback_free frees w */
    cg_store_abandon(w->inner);
    req_free(w);
}

/* w goes on at the inner store (inner), or, when the store could not even take it, memory
 * answers it from the loop; a request whose answer carries nothing to keep (a load, the
 * rooms, a limit) goes with its caller at the inner store too. */
static cg_store_req *sent(fb_req *w, int abandonable)
{
    if (!w->inner)
        return answer_later(w);
    if (abandonable)
        w->on_abandon = abandon_inner;
    return (cg_store_req *)w;
}

/* The inner store answered w: 1 when it could not, and memory answered (w is gone), else 0. */
static int answered_here(fb_req *w, const cg_store_status *status)
{
    w->inner = NULL;
    if (!status->unavailable)
        return 0;
    answer_here(w);
    return 1;
}

/* Is the store there to ask? */
static int store_up(const cg_fallback *fb)
{
    return !fb->st->stats.degraded && !fb->closing;
}

/* The inner store's answer to a load: passed on, or memory answers. A lease taken for a
 * dialog that went dirty meanwhile (its save failed while the load waited behind it) is let
 * go: its turn runs on memory's copy. */
static void inner_loaded(void *ctx, cg_dialog *d, const cg_store_status *status)
{
    fb_req *w = ctx;
    cg_fallback *fb = w->fb;
    w->inner = NULL;
    if (status->unavailable || json_object_get(fb->dirty, w->key)) {
        if (d) {
            cg_dialog_free(d);
            if (w->lease && fb->inner.lease->release) {
                char *user = cg_store_unescape(w->eu, strlen(w->eu)), *room = cg_store_unescape(w->er, strlen(w->er));
                fb->inner.lease->release(fb->st, user, room);
                free(user);
                free(room);
            }
        }
        answer_here(w);
        return;
    }
    if (wanted(w))
        w->cb.load(w->ctx, d, status);
    else
        cg_dialog_free(d);
    req_free(w);
}

static cg_store_req *load(cg_store *st, const char *user, const char *room, int lease, cg_store_load_fn cb,
                          void *ctx)
{
    cg_fallback *fb = st->fallback;
    st->stats.loads++;
    fb_req *w = req_new(fb, CG_STORE_LOAD, user, room, ctx);
    w->cb.load = cb;
    w->lease = lease;
    if (answers_here(fb, w->key))
        return answer_later(w);
    w->inner = lease ? fb->inner.lease->acquire(st, user, room, inner_loaded, w)
                     : fb->inner.dialogs->load(st, user, room, inner_loaded, w);
    return sent(w, 1);
}

static cg_store_req *fb_load(cg_store *st, const char *user, const char *room, cg_store_load_fn cb, void *ctx)
{
    return load(st, user, room, 0, cb, ctx);
}

static cg_store_req *fb_acquire(cg_store *st, const char *user, const char *room, cg_store_load_fn cb, void *ctx)
{
    return load(st, user, room, 1, cb, ctx);
}

static void fb_release(cg_store *st, const char *user, const char *room)
{
    if (st->fallback->inner.lease->release)
        st->fallback->inner.lease->release(st, user, room);
}

/* The inner store's answer to a save, a delete or forgetting a user: passed on, or (it could
 * not) memory answers, keeping a save for the write-back. Never abandoned at the inner
 * store: a save it failed must still be kept. */
static void inner_done(void *ctx, const cg_store_status *status)
{
    fb_req *w = ctx;
    cg_dialog merged;
    if (status->unavailable && status->unsaved && w->snapshot && cg_dialog_share(&merged, status->unsaved) == 0) {
        /* the store had merged it with its own copy: memory keeps that, the newer */
        cg_dialog_free(w->snapshot);
        *w->snapshot = merged;
    }
    if (answered_here(w, status))
        return;
    if (wanted(w) && w->cb.done)
        w->cb.done(w->ctx, status);
    req_free(w);
}

static cg_store_req *fb_save(cg_store *st, const char *user, const char *room, const cg_dialog *d, cg_store_done_fn cb,
                             void *ctx)
{
    cg_fallback *fb = st->fallback;
    st->stats.saves++;
    fb_req *w = req_new(fb, CG_STORE_SAVE, user, room, ctx);
    w->cb.done = cb;
    if (answers_here(fb, w->key)) {
        fallback_save(fb, w->key, w->eu, w->er, d); /* now: a load asked after this save sees it */
        /* the save ends its turn's lease (store.h): one the store gave the turn's load before
         * it went away, or before the dialog was marked, is let go, never renewed on */
        if (fb->inner.lease->release)
            fb->inner.lease->release(st, user, room);
        return answer_later(w);
    }
    w->snapshot = cg_malloc(sizeof(*w->snapshot));
    if (cg_dialog_share(w->snapshot, d) < 0) { /* out of memory: not kept here if the store fails it */
        free(w->snapshot);
        w->snapshot = NULL;
    }
    w->inner = fb->inner.dialogs->save(st, user, room, d, inner_done, w);
    return sent(w, 0);
}

/* At closing, the store waits for these too: one the inner store fails is kept and marked
 * only when its answer comes, after the store decided what to wait for. Walked, not counted:
 * a close polls it for a few seconds at most. */
size_t cg_fallback_saves_in_flight(const cg_fallback *fb)
{
    size_t n = 0;
    for (const fb_req *w = fb->live; w; w = w->next)
        n += w->kind == CG_STORE_SAVE && w->inner;
    return n;
}

/* A delete is done here at once, whatever the store says, and always handed to the store
 * too (away, it answers "unavailable": the caller is told, 503 at the admin API), so that
 * what it keeps of its own here (the Redis store's copies of profiles) goes as well. */
static cg_store_req *fb_remove(cg_store *st, const char *user, const char *room, cg_store_done_fn cb, void *ctx)
{
    cg_fallback *fb = st->fallback;
    st->stats.deletes++;
    fb_req *w = req_new(fb, CG_STORE_REMOVE, user, room, ctx);
    w->cb.done = cb;
    cg_fallback_remove(fb, w->key);
    if (!fb->closing)
        w->inner = fb->inner.dialogs->remove(st, user, room, inner_done, w);
    return sent(w, 0);
}

static cg_store_req *fb_remove_user(cg_store *st, const char *user, cg_store_done_fn cb, void *ctx)
{
    cg_fallback *fb = st->fallback;
    st->stats.deletes++;
    fb_req *w = req_new(fb, CG_STORE_REMOVE_USER, user, "", ctx);
    w->cb.done = cb;
    w->user = cg_strdup(user ? user : "");
    fallback_remove_user(fb, w->user, w->eu); /* memory, write-back and the counts kept here */
    if (!fb->closing)
        w->inner = fb->inner.dialogs->remove_user(st, user, inner_done, w);
    return sent(w, 0);
}

static void inner_rooms(void *ctx, json_t *rooms, const cg_store_status *status)
{
    fb_req *w = ctx;
    if (answered_here(w, status))
        return;
    if (wanted(w))
        w->cb.rooms(w->ctx, rooms, status);
    req_free(w);
}

static cg_store_req *fb_rooms(cg_store *st, const char *user, cg_store_rooms_fn cb, void *ctx)
{
    cg_fallback *fb = st->fallback;
    fb_req *w = req_new(fb, CG_STORE_ROOMS, user, "", ctx);
    w->cb.rooms = cb;
    if (store_up(fb))
        w->inner = fb->inner.dialogs->rooms(st, user, inner_rooms, w);
    return sent(w, 1);
}

static void inner_limited(void *ctx, const cg_limit_verdict *v, const cg_store_status *status)
{
    fb_req *w = ctx;
    if (answered_here(w, status))
        return;
    if (wanted(w))
        w->cb.limit(w->ctx, v, status);
    req_free(w);
}

static cg_store_req *fb_take(cg_store *st, const char *user, const cg_limits *lim, uint64_t turn, cg_store_limit_fn cb,
                             void *ctx)
{
    cg_fallback *fb = st->fallback;
    fb_req *w = req_new(fb, CG_STORE_LIMIT, user, "", ctx);
    w->cb.limit = cb;
    w->limits = *lim;
    if (store_up(fb))
        w->inner = fb->inner.limits->take(st, user, lim, turn, inner_limited, w);
    return sent(w, 1);
}

/* A turn counted here (its verdict says local), or ending while the store is away, ends
 * here; its tokens count here then, this gateway's own. */
static void fb_end(cg_store *st, const char *user, const cg_limits *lim, uint64_t turn, int local, long long tokens)
{
    cg_fallback *fb = st->fallback;
    if (!local && store_up(fb)) {
        fb->inner.limits->end(st, user, lim, turn, local, tokens);
        return;
    }
    char *eu = cg_store_escape(user ? user : "");
    cg_limiter_end(fb->limits, eu, lim, tokens, cg_store_now_ms(st));
    free(eu);
}

const cg_store_dialog_ops cg_fallback_dialog_ops = {
    .load = fb_load,
    .save = fb_save,
    .remove = fb_remove,
    .remove_user = fb_remove_user,
    .rooms = fb_rooms,
};

const cg_store_lease_ops cg_fallback_lease_ops = {.acquire = fb_acquire, .release = fb_release};

const cg_store_limit_ops cg_fallback_limit_ops = {.take = fb_take, .end = fb_end};
