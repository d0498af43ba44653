/*
 * store_memory.c: dialogs in this process, with the same lifetimes the Redis layout gets
 * from key expiry, and two bounds on what is held: a number of dialogs and a number of bytes.
 *
 * The table is an index of entries by key (core/addrmap.h) and a list of the same entries
 * (sys/queue.h's TAILQ) in order of use, least recent first: the one to evict. An entry
 * holds a dialog whose parts it shares with the turns that load it (cg_dialog_copy: parts
 * are values, never changed in place; the history array is each load's own), its lifetimes
 * and its weight, so a turn's load and save cost a few references and no JSON text: parts
 * past their time read as empty, as Redis keys would have expired. The weight is what the
 * entry counts against the byte bound: its key and its dialog about as compact JSON
 * (cg_dialog_weight), so a few dialogs of 1 MiB replies weigh what they are.
 *
 * Eviction takes the oldest entry and stops when an eviction frees nothing, so the loop
 * cannot spin. The entry just written is never evicted: a dialog larger than the byte
 * bound alone is still kept, until the next write pushes it out. Nor is a pinned one
 * (cg_memstore_pin): the Redis store's dialogs written while Redis was away, whose memory
 * copy is the only one of their turns until the write-back. Those wait in a list of their
 * own, out of eviction's way, and are bounded by the write-back set's bounds instead: the
 * bounds count the rest, which the table holds beside them (pinned_count, pinned_bytes).
 *
 * The store's ops answer on the next loop iteration (a zero timer), never from inside the
 * call, as store.h promises.
 */
#include <sys/queue.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#include "chatgate/core/alloc.h"
#include "chatgate/core/addrmap.h"
#include "chatgate/core/flush.h"
#include "chatgate/core/log.h"
#include "chatgate/core/error.h"
#include "chatgate/store/profiles.h"
#include "chatgate/store/store.h"

typedef struct mem_entry {
    TAILQ_ENTRY(mem_entry) order; /* in the use order, least recent first, or the pinned list */
    int pinned;                   /* in m->pinned: never evicted */
    cg_dialog d;
    int64_t dialog_exp, params_exp, history_exp;
    size_t bytes;    /* the key's length and the dialog's weight */
    size_t hist_w;   /* the history's share of that weight */
    size_t part_w[CG_DIALOG_PARTS]; /* the other parts' shares (cg_dialog_weight_parts) */
    char *rev;       /* the Redis store's: the version of Redis's copy this one equals, or NULL */
    int64_t renewed; /* the Redis store's: when a save last set the lifetimes of that copy's keys */
    const char *key; /* stored right after the entry */
} mem_entry;

struct cg_memstore {
    json_t *index; /* key -> the entry (core/addrmap.h); a lookup was a tenth of a put's
                    * time as a binary tree of string compares (tsearch) */
    TAILQ_HEAD(mem_list, mem_entry) order;
    struct mem_list pinned; /* entries not to evict, in the order they were pinned */
    long count;
    long pinned_count;   /* of count, the pinned entries, which the bounds do not count */
    size_t pinned_bytes; /* of bytes, theirs */
    long max_dialogs;
    size_t max_bytes;
    size_t bytes; /* the sum of the entries' bytes */
    long max_rooms;     /* a user's entries at most (0: no bound) */
    json_t *user_count; /* "<user>:" -> how many entries the user has (only with max_rooms) */
    cg_lifetimes lt;
    cg_store_stats *stats;
};

cg_memstore *cg_memstore_new(long max_dialogs, const cg_lifetimes *lt, cg_store_stats *stats)
{
    cg_memstore *m = cg_calloc(1, sizeof(*m));
    m->index = json_object();
    TAILQ_INIT(&m->order);
    TAILQ_INIT(&m->pinned);
    m->max_dialogs = max_dialogs;
    m->max_bytes = CG_MEMSTORE_DEFAULT_MAX_BYTES;
    m->lt = *lt;
    m->stats = stats;
    return m;
}

void cg_memstore_set_max_bytes(cg_memstore *m, size_t max_bytes)
{
    m->max_bytes = max_bytes;
}

void cg_memstore_set_max_rooms(cg_memstore *m, long max_rooms)
{
    m->max_rooms = max_rooms;
    if (max_rooms > 0 && !m->user_count && !(m->user_count = json_object()))
        abort();
}

/* A key's user part, escaped (3 bytes a byte at most) and its ':': user ids are at most 256
 * bytes (protocol.h). */
#define USER_PART_MAX (256 * 3 + 2)

/* The user's part of a key ("<user>:", users escaped: no ':' in them), its length. */
static size_t user_part(const char *key)
{
    const char *colon = strchr(key, ':');
    return colon ? (size_t)(colon - key) + 1 : strlen(key);
}

/* The user of key has one entry more (by +1) or less (-1); how many now. */
static long user_count_add(cg_memstore *m, const char *key, int by)
{
    if (!m->user_count)
        return 0;
    char user[USER_PART_MAX];
    snprintf(user, sizeof(user), "%.*s", (int)user_part(key), key);
    long n = (long)json_integer_value(json_object_get(m->user_count, user)) + by;
    if (n <= 0)
        json_object_del(m->user_count, user);
    else if (json_object_set_new(m->user_count, user, json_integer(n)) < 0)
        abort();
    return n;
}

size_t cg_memstore_bytes(cg_memstore *m)
{
    return m->bytes;
}

static void publish_bytes(cg_memstore *m)
{
    if (m->stats) {
        m->stats->memory_bytes = m->bytes;
        m->stats->memory_dialogs = m->count;
    }
}

static mem_entry *entry_find(cg_memstore *m, const char *key)
{
    return cg_addrmap_get(m->index, key);
}

/* The list e is on: the use order, or the pinned list. */
static struct mem_list *list_of(cg_memstore *m, const mem_entry *e)
{
    return e->pinned ? &m->pinned : &m->order;
}

/* e was just used: to the end of its list. */
static void entry_touch(cg_memstore *m, mem_entry *e)
{
    TAILQ_REMOVE(list_of(m, e), e, order);
    TAILQ_INSERT_TAIL(list_of(m, e), e, order);
}

/* *total less n, never below 0. */
static void bytes_less(size_t *total, size_t n)
{
    *total -= n < *total ? n : *total;
}

/* e (pinned) comes (by +1) to the pinned share of the totals, or goes (-1). */
static void pinned_add(cg_memstore *m, const mem_entry *e, int by)
{
    if (!e->pinned)
        return;
    m->pinned_count += by;
    if (by > 0)
        m->pinned_bytes += e->bytes;
    else
        bytes_less(&m->pinned_bytes, e->bytes);
}

/* Removes e from the table and frees it, taking its bytes off the total. */
static void entry_drop(cg_memstore *m, mem_entry *e)
{
    user_count_add(m, e->key, -1);
    json_object_del(m->index, e->key);
    TAILQ_REMOVE(list_of(m, e), e, order);
    pinned_add(m, e, -1);
    m->count--;
    bytes_less(&m->bytes, e->bytes);
    publish_bytes(m);
    cg_dialog_free(&e->d);
    free(e->rev);
    free(e);
}

void cg_memstore_free(cg_memstore *m)
{
    if (!m)
        return;
    while (!TAILQ_EMPTY(&m->order))
        entry_drop(m, TAILQ_FIRST(&m->order));
    while (!TAILQ_EMPTY(&m->pinned))
        entry_drop(m, TAILQ_FIRST(&m->pinned));
    json_decref(m->index);
    json_decref(m->user_count);
    free(m);
}

/* Which bound the entries not pinned pass, if any: "count", "bytes" or NULL. */
static const char *over_bound(const cg_memstore *m)
{
    if (m->count - m->pinned_count > m->max_dialogs)
        return "count";
    if (m->bytes - m->pinned_bytes > m->max_bytes)
        return "bytes";
    return NULL;
}

/* Evicts least recently used entries until both bounds hold, never keep (the entry just
 * written; it alone may pass them) nor a pinned one (not counted: their owner bounds them). */
static void evict(cg_memstore *m, const mem_entry *keep)
{
    const char *reason;
    mem_entry *e;
    while ((reason = over_bound(m)) != NULL && (e = TAILQ_FIRST(&m->order)) != NULL && e != keep) {
        entry_drop(m, e);
        if (m->stats) {
            if (strcmp(reason, "bytes") == 0)
                m->stats->evictions_bytes++;
            else
                m->stats->evictions++;
        }
    }
}

/* The live entry for key: NULL when none, or when its time is up (it is dropped then). */
static mem_entry *entry_live(cg_memstore *m, const char *key, int64_t now)
{
    mem_entry *e = entry_find(m, key);
    if (e && e->dialog_exp <= now) {
        entry_drop(m, e);
        e = NULL;
    }
    return e;
}

int cg_memstore_get(cg_memstore *m, const char *key, int64_t now, cg_dialog *d)
{
    mem_entry *e = entry_live(m, key, now);
    if (!e || cg_dialog_copy(d, &e->d) < 0) {
        cg_dialog_init(d, now);
        return 0;
    }
    cg_dialog_lapse(d, now, e->params_exp, e->history_exp);
    entry_touch(m, e); /* most recently used */
    return 1;
}

const char *cg_memstore_rev(cg_memstore *m, const char *key, int64_t now)
{
    mem_entry *e = entry_live(m, key, now);
    return e ? e->rev : NULL;
}

int cg_memstore_view_of(cg_memstore *m, const char *key, int64_t now, cg_memstore_view *v)
{
    mem_entry *e = entry_live(m, key, now);
    memset(v, 0, sizeof(*v));
    if (!e)
        return 0;
    v->rev = e->rev;
    v->history = e->history_exp > now ? e->d.history : NULL;
    v->params = e->params_exp > now ? e->d.params : NULL;
    v->renewed = e->renewed;
    return 1;
}

/*
 * What d's history weighs (cg_dialog_weight), from old's when d's goes on from it (a turn
 * adds a message or two and the window drops as many): weighing every message of every
 * dialog again at every put was a twentieth of a turn's CPU on the memory store.
 */
static size_t history_weight(const mem_entry *old, const cg_dialog *d)
{
    long kept = old ? cg_dialog_history_kept(old->d.history, d->history) : -1;
    size_t n_had = old ? json_array_size(old->d.history) : 0, n = json_array_size(d->history), w = 2;
    if (kept < 0) {
        kept = 0;
        n_had = 0;
    } else {
        w = old->hist_w;
    }
    for (size_t i = 0; i < n_had - (size_t)kept; i++) /* gone from the front */
        w -= cg_dialog_history_item_weight(json_array_get(old->d.history, i));
    for (size_t i = (size_t)kept; i < n; i++)
        w += cg_dialog_history_item_weight(json_array_get(d->history, i));
    return w;
}

/* e's dialog, lifetimes and weight become d's (shared or copied) as of now; -1 out of
 * memory, e unchanged. When e had a copy (had), the weights go on from it (history_weight,
 * cg_dialog_weight_parts) before it is let go. The total (m->bytes) is the caller's. */
static int entry_set(cg_memstore *m, mem_entry *e, int had, const cg_dialog *d, int64_t now, const char *rev,
                     int64_t renewed, int shared)
{
    cg_dialog fresh;
    if ((shared ? cg_dialog_share(&fresh, d) : cg_dialog_copy(&fresh, d)) < 0)
        return -1;
    char *fresh_rev = rev ? cg_strdup(rev) : NULL;
    size_t hist_w = history_weight(had ? e : NULL, d), part_w[CG_DIALOG_PARTS];
    size_t rest = cg_dialog_weight_parts(d, had ? &e->d : NULL, had ? e->part_w : NULL, part_w);
    cg_dialog_free(&e->d);
    free(e->rev);
    e->d = fresh;
    e->rev = fresh_rev;
    e->renewed = renewed;
    e->dialog_exp = now + m->lt.dialog_s;
    e->params_exp = now + m->lt.params_s;
    e->history_exp = now + m->lt.history_s;
    e->hist_w = hist_w;
    memcpy(e->part_w, part_w, sizeof(part_w));
    e->bytes = strlen(e->key) + rest + hist_w;
    return 0;
}

/* A new entry for key, in the index and at the end of the list, with no dialog yet (no
 * bytes); NULL when memory ran out. */
static mem_entry *entry_new(cg_memstore *m, const char *key)
{
    size_t n = strlen(key);
    mem_entry *e = cg_calloc(1, sizeof(*e) + n + 1);
    memcpy(e + 1, key, n + 1);
    e->key = (const char *)(e + 1);
    if (cg_addrmap_set(m->index, e->key, e) < 0) {
        free(e);
        return NULL;
    }
    TAILQ_INSERT_TAIL(&m->order, e, order);
    m->count++;
    user_count_add(m, key, +1);
    return e;
}

/* A user past max_rooms (a new entry, e, made it so): their least recently used entry goes,
 * never e. The walk from the list's oldest end is only for a user past the bound. */
static void rooms_bound(cg_memstore *m, mem_entry *e)
{
    size_t n = user_part(e->key);
    char user[USER_PART_MAX];
    snprintf(user, sizeof(user), "%.*s", (int)n, e->key);
    if (!m->max_rooms || json_integer_value(json_object_get(m->user_count, user)) <= m->max_rooms)
        return;
    for (mem_entry *o = TAILQ_FIRST(&m->order); o; o = TAILQ_NEXT(o, order))
        if (o != e && strncmp(o->key, e->key, n) == 0) {
            entry_drop(m, o);
            if (m->stats)
                m->stats->evictions_rooms++;
            return;
        }
}

/*
 * Puts d under key, a copy of it or (shared) d's own parts; rev as cg_memstore_put_rev. A
 * key held already keeps its entry, whose copy is replaced (one lookup, and the weights of
 * what the two copies share are not measured again: a turn's save of the Redis store).
 */
static void put(cg_memstore *m, const char *key, const cg_dialog *d, int64_t now, const char *rev, int64_t renewed,
                int shared)
{
    mem_entry *e = entry_find(m, key);
    int had = e != NULL;
    if (!e && !(e = entry_new(m, key))) {
        cg_error("memory store: out of memory keeping a dialog; it was dropped");
        return;
    }
    size_t before = e->bytes;
    if (entry_set(m, e, had, d, now, rev, renewed, shared) < 0) {
        /* what was held is older than what the caller has: better none than a stale one */
        entry_drop(m, e);
        cg_error("memory store: out of memory keeping a dialog; it was dropped");
        return;
    }
    bytes_less(&m->bytes, before); /* its new weight, in the total (and the pinned share) */
    m->bytes += e->bytes;
    if (e->pinned) {
        bytes_less(&m->pinned_bytes, before);
        m->pinned_bytes += e->bytes;
    }
    entry_touch(m, e); /* most recently used */
    if (!had)
        rooms_bound(m, e);
    publish_bytes(m);
    evict(m, e);
}

void cg_memstore_put_rev(cg_memstore *m, const char *key, const cg_dialog *d, int64_t now, const char *rev,
                         int64_t renewed)
{
    put(m, key, d, now, rev, renewed, 0);
}

void cg_memstore_keep(cg_memstore *m, const char *key, const cg_dialog *d, int64_t now, const char *rev,
                      int64_t renewed)
{
    put(m, key, d, now, rev, renewed, 1);
}

void cg_memstore_del(cg_memstore *m, const char *key)
{
    mem_entry *e = entry_find(m, key);
    if (e)
        entry_drop(m, e);
}

void cg_memstore_pin(cg_memstore *m, const char *key, cg_memstore_pinning how)
{
    mem_entry *e = entry_find(m, key);
    int pinned = how == CG_MEMSTORE_PIN;
    if (!e || e->pinned == pinned)
        return;
    TAILQ_REMOVE(list_of(m, e), e, order);
    pinned_add(m, e, -1);
    e->pinned = pinned;
    pinned_add(m, e, +1);
    if (how == CG_MEMSTORE_UNPIN_OLDEST)
        TAILQ_INSERT_HEAD(list_of(m, e), e, order);
    else
        TAILQ_INSERT_TAIL(list_of(m, e), e, order);
}

/* Drops list's entries whose key starts with prefix (n bytes); how many. */
static int user_drop(cg_memstore *m, struct mem_list *list, const char *prefix, size_t n)
{
    int deleted = 0;
    for (mem_entry *e = TAILQ_FIRST(list), *next; e; e = next) {
        next = TAILQ_NEXT(e, order);
        if (strncmp(e->key, prefix, n) == 0) {
            entry_drop(m, e);
            deleted++;
        }
    }
    return deleted;
}

int cg_memstore_del_user(cg_memstore *m, const char *user)
{
    char *prefix = cg_store_dialog_key(user, ""); /* "<user>:" */
    size_t n = strlen(prefix);
    int deleted = user_drop(m, &m->order, prefix, n) + user_drop(m, &m->pinned, prefix, n);
    free(prefix);
    return deleted;
}

/* Appends to rooms the rooms of list's entries whose key starts with prefix (n bytes). */
static void rooms_of(json_t *rooms, struct mem_list *list, const char *prefix, size_t n)
{
    mem_entry *e;
    TAILQ_FOREACH(e, list, order) {
        if (rooms && strncmp(e->key, prefix, n) == 0) {
            char *room = cg_store_unescape(e->key + n, strlen(e->key + n));
            json_array_append_new(rooms, json_string(room)); /* a name that is not UTF-8 is left out */
            free(room);
        }
    }
}

json_t *cg_memstore_rooms(cg_memstore *m, const char *prefix)
{
    json_t *rooms = json_array();
    size_t n = strlen(prefix);
    rooms_of(rooms, &m->order, prefix, n);
    rooms_of(rooms, &m->pinned, prefix, n);
    return rooms;
}

long cg_memstore_count(cg_memstore *m)
{
    return m->count;
}

/* ---- the store ops: the table above, answering from the loop ------------------------- */

/*
 * Requests are answered from the loop, never inside the call that made them (store.h), in
 * the order they came: at the end of the event that made them (core/flush.h's answers: a
 * message's load is answered, and the message goes to its app, before the gateway handles
 * the next event), else at the end of the loop iteration; a store opened without a flusher
 * answers from a timer. A timer per request (made, run and closed for every load and save)
 * answered in the next iteration, after the gateway had read every socket ready in it.
 */
typedef struct memory_req memory_req; /* a request of this store (cg_store_req's fields first) */

typedef struct memory_store {
    cg_store base;
    cg_memstore *mem;
    cg_limiter *limits; /* limits per user: the counts of this process, which is all of them */
    cg_profiles *profiles;
    memory_req *queue, **queue_tail; /* to be answered, oldest first */
    cg_flush_item answer;              /* registered while the queue holds any (answer_all) */
    uv_timer_t timer;                  /* the same for a store without a flusher */
    int timer_made;
} memory_store;

static void memory_store_free(memory_store *ms)
{
    cg_memstore_free(ms->mem);
    cg_limiter_free(ms->limits);
    cg_profiles_free(ms->profiles);
    free(ms);
}

struct memory_req {
    CG_STORE_REQ_FIELDS
    memory_req *next; /* in the store's queue */
    memory_store *ms;
    char *key; /* rooms: "<escaped user>:", the prefix of the user's keys */
    cg_limit_verdict verdict; /* limit: decided at the call, told from the loop */
    cg_limits limits;         /* limit: what it was held to */
    json_t *profile;          /* profile: what it is after the call (decided at the call) */
    int err;                  /* profile: an update refused (CG_E_TOO_LARGE) */
};

static void req_free(memory_req *r)
{
    json_decref(r->profile);
    free(r->key);
    free(r);
}

/* Answers r (unless it was abandoned) and frees it. */
static void req_run(memory_req *r)
{
    static const cg_store_status ok = {0};
    if (!r->abandoned && r->kind == CG_STORE_LOAD) {
        cg_dialog d;
        cg_store_status st = {0};
        st.found = cg_memstore_get(r->ms->mem, r->key, r->ms->base.now(r->ms->base.clock_ctx), &d);
        r->cb.load(r->ctx, &d, &st);
    } else if (!r->abandoned && r->kind == CG_STORE_ROOMS) {
        json_t *rooms = cg_memstore_rooms(r->ms->mem, r->key);
        r->cb.rooms(r->ctx, rooms, &ok);
        json_decref(rooms);
    } else if (r->kind == CG_STORE_LIMIT && r->abandoned && r->verdict.hit == CG_LIMIT_OK) {
        /* counted for a turn that is gone: its end is now */
        cg_limiter_end(r->ms->limits, r->key, &r->limits, 0, cg_store_now_ms(&r->ms->base));
    } else if (!r->abandoned && r->kind == CG_STORE_LIMIT) {
        r->cb.limit(r->ctx, &r->verdict, &ok);
    } else if (!r->abandoned && r->kind == CG_STORE_PROFILE) {
        if (r->cb.profile)
            r->cb.profile(r->ctx, r->profile, r->err, &ok);
    } else if (!r->abandoned && r->cb.done) {
        r->cb.done(r->ctx, &ok);
    }
    req_free(r);
}

/* The queue as it is now, in order; what its answers ask for waits for the next round. */
static void answer_all(memory_store *ms)
{
    memory_req *r = ms->queue;
    ms->queue = NULL;
    ms->queue_tail = &ms->queue;
    while (r) {
        memory_req *next = r->next;
        req_run(r);
        r = next;
    }
}

static void on_answer(cg_flush_item *item)
{
    answer_all((memory_store *)((char *)item - offsetof(memory_store, answer)));
}

static void on_timer(uv_timer_t *t)
{
    answer_all(t->data);
}

/* The queue's answers are due: at the current event's end, else from the timer. */
static void schedule(memory_store *ms)
{
    if (ms->base.cfg.flush && cg_flush_request_answer(ms->base.cfg.flush, &ms->answer, on_answer) == 0)
        return;
    if (!ms->timer_made) {
        uv_timer_init(ms->base.loop, &ms->timer);
        ms->timer.data = ms;
        ms->timer_made = 1;
    }
    uv_timer_start(&ms->timer, on_timer, 0, 0);
}

static memory_req *req_new(memory_store *ms, cg_store_op kind, const char *user, const char *room, void *ctx)
{
    memory_req *r = cg_calloc(1, sizeof(*r));
    r->ms = ms;
    r->kind = kind;
    r->key = cg_store_dialog_key(user, room);
    r->ctx = ctx;
    *ms->queue_tail = r;
    ms->queue_tail = &r->next;
    if (!ms->answer.pprev && !(ms->timer_made && uv_is_active((uv_handle_t *)&ms->timer)))
        schedule(ms); /* nothing is due to answer it yet (a closed flusher drops its items) */
    return r;
}

static cg_store_req *mem_load(cg_store *st, const char *user, const char *room, cg_store_load_fn cb, void *ctx)
{
    st->stats.loads++;
    memory_req *r = req_new((memory_store *)st, CG_STORE_LOAD, user, room, ctx);
    if (r)
        r->cb.load = cb;
    return (cg_store_req *)r; /* its first fields are cg_store_req's */
}

static cg_store_req *mem_save(cg_store *st, const char *user, const char *room, const cg_dialog *d,
                              cg_store_done_fn cb, void *ctx)
{
    memory_store *ms = (memory_store *)st;
    st->stats.saves++;
    memory_req *r = req_new(ms, CG_STORE_SAVE, user, room, ctx);
    if (!r)
        return NULL;
    r->cb.done = cb;
    /* written now, so a load queued after this save sees it; d's parts are kept, not copied
     * (a saved dialog is not changed again: store.h) */
    cg_memstore_keep(ms->mem, r->key, d, st->now(st->clock_ctx), NULL, 0);
    return (cg_store_req *)r; /* its first fields are cg_store_req's */
}

static cg_store_req *mem_remove(cg_store *st, const char *user, const char *room, cg_store_done_fn cb, void *ctx)
{
    memory_store *ms = (memory_store *)st;
    st->stats.deletes++;
    memory_req *r = req_new(ms, CG_STORE_REMOVE, user, room, ctx);
    if (!r)
        return NULL;
    r->cb.done = cb;
    cg_memstore_del(ms->mem, r->key);
    return (cg_store_req *)r; /* its first fields are cg_store_req's */
}

static cg_store_req *mem_remove_user(cg_store *st, const char *user, cg_store_done_fn cb, void *ctx)
{
    memory_store *ms = (memory_store *)st;
    st->stats.deletes++;
    memory_req *r = req_new(ms, CG_STORE_REMOVE_USER, user, "", ctx);
    if (!r)
        return NULL;
    r->cb.done = cb;
    cg_memstore_del_user(ms->mem, user);
    cg_limiter_forget(ms->limits, r->key); /* the key its limits are counted under (mem_limit) */
    cg_profiles_remove(ms->profiles, r->key);
    return (cg_store_req *)r; /* its first fields are cg_store_req's */
}

static cg_store_req *mem_rooms(cg_store *st, const char *user, cg_store_rooms_fn cb, void *ctx)
{
    memory_req *r = req_new((memory_store *)st, CG_STORE_ROOMS, user, "", ctx);
    if (r)
        r->cb.rooms = cb;
    return (cg_store_req *)r; /* its first fields are cg_store_req's */
}

/* Counted now, in call order, as the Redis script counts in the order it runs. */
static cg_store_req *mem_limit(cg_store *st, const char *user, const cg_limits *lim, uint64_t turn,
                               cg_store_limit_fn cb, void *ctx)
{
    (void)turn;
    memory_store *ms = (memory_store *)st;
    memory_req *r = req_new(ms, CG_STORE_LIMIT, user, "", ctx);
    if (!r)
        return NULL;
    r->cb.limit = cb;
    r->limits = *lim;
    cg_limiter_take(ms->limits, r->key, lim, cg_store_now_ms(st), &r->verdict);
    return (cg_store_req *)r; /* its first fields are cg_store_req's */
}

static void mem_limit_end(cg_store *st, const char *user, const cg_limits *lim, uint64_t turn, int local,
                          long long tokens)
{
    (void)turn;
    (void)local;
    char *key = cg_store_dialog_key(user, "");
    cg_limiter_end(((memory_store *)st)->limits, key, lim, tokens, cg_store_now_ms(st));
    free(key);
}

/* The profile is read, or changed, at the call (in call order, as Redis runs them), and
 * told from the loop. */
static memory_req *profile_req(memory_store *ms, const char *user, cg_store_profile_fn cb, void *ctx)
{
    memory_req *r = req_new(ms, CG_STORE_PROFILE, user, "", ctx);
    if (r)
        r->cb.profile = cb;
    return r;
}

static cg_store_req *mem_profile_get(cg_store *st, const char *user, cg_store_profile_fn cb, void *ctx)
{
    memory_store *ms = (memory_store *)st;
    memory_req *r = profile_req(ms, user, cb, ctx);
    if (!r)
        return NULL;
    json_t *p = cg_profiles_get(ms->profiles, r->key, st->now(st->clock_ctx), st->cfg.lifetimes.profile_s);
    r->profile = p ? json_incref(p) : json_object();
    return (cg_store_req *)r; /* its first fields are cg_store_req's */
}

static cg_store_req *mem_profile_update(cg_store *st, const char *user, json_t *changes, cg_store_profile_fn cb,
                                        void *ctx)
{
    memory_store *ms = (memory_store *)st;
    memory_req *r = profile_req(ms, user, cb, ctx);
    if (!r)
        return NULL;
    const cg_lifetimes *lt = &st->cfg.lifetimes;
    r->err = cg_profiles_update(ms->profiles, r->key, changes, st->now(st->clock_ctx), lt->profile_s, lt->profile_cap,
                                &r->profile);
    if (!r->profile)
        r->profile = json_object();
    return (cg_store_req *)r; /* its first fields are cg_store_req's */
}

static void timer_closed(uv_handle_t *h)
{
    memory_store_free(h->data);
}

/* Shutting down: what is queued is dropped unanswered (nobody waits), as abandoned limits
 * are not ended (the process ends with its counts). */
static void mem_close(cg_store *st)
{
    memory_store *ms = (memory_store *)st;
    cg_flush_cancel(&ms->answer);
    for (memory_req *r = ms->queue, *next; r; r = next) {
        next = r->next;
        req_free(r);
    }
    ms->queue = NULL;
    if (ms->timer_made)
        uv_close((uv_handle_t *)&ms->timer, timer_closed);
    else
        memory_store_free(ms);
}

static const cg_store_dialog_ops memory_dialogs = {
    .load = mem_load,
    .save = mem_save,
    .remove = mem_remove,
    .remove_user = mem_remove_user,
    .rooms = mem_rooms,
};

/* one process: the in-process dialog lock is the whole lease */
static const cg_store_lease_ops memory_lease = {.acquire = mem_load};

static const cg_store_limit_ops memory_limits = {.take = mem_limit, .end = mem_limit_end};

static const cg_store_profile_ops memory_profiles = {.get = mem_profile_get, .update = mem_profile_update};

static const cg_store_ops memory_ops = {
    .name = "memory",
    .dialogs = &memory_dialogs,
    .lease = &memory_lease,
    .limits = &memory_limits,
    .profiles = &memory_profiles,
    .bus = NULL,     /* no other gateway */
    .replies = NULL, /* no other gateway */
    .close = mem_close,
};

cg_store *cg_store_memory_open(uv_loop_t *loop, const cg_store_config *cfg)
{
    memory_store *ms = cg_calloc(1, sizeof(*ms));
    ms->base.ops = &memory_ops;
    ms->base.loop = loop;
    ms->base.cfg = *cfg;
    ms->base.now = cg_store_default_now;
    ms->mem = cg_memstore_new(cfg->max_dialogs, &cfg->lifetimes, &ms->base.stats);
    if (!ms->mem) {
        free(ms);
        return NULL;
    }
    if (cfg->max_bytes > 0)
        cg_memstore_set_max_bytes(ms->mem, cfg->max_bytes);
    cg_memstore_set_max_rooms(ms->mem, cfg->max_rooms_per_user);
    ms->limits = cg_limiter_new(cfg->max_dialogs);
    ms->profiles = cg_profiles_new(cfg->max_dialogs);
    ms->queue_tail = &ms->queue;
    return &ms->base;
}
