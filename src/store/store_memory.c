/*
 * store_memory.c: dialogs in this process, with the same lifetimes the Redis layout gets
 * from key expiry, and two bounds on what is held: a number of dialogs and a number of bytes.
 *
 * The table is a jansson object, whose keys keep insertion order: a dialog used is deleted
 * and set again, so it moves to the end, and the first key is always the least recently
 * used, the one to evict. Each entry is {"d": dialog JSON, "dialog_exp", "params_exp",
 * "history_exp", "bytes"}: parts past their time read as empty, as Redis keys would have
 * expired. "bytes" is what the entry counts against the byte bound: the length of its key
 * and of its dialog as compact JSON, so a few dialogs of 1 MiB replies weigh what they are.
 *
 * Eviction takes the oldest entry by its own key (no copy into a buffer, so keys of any
 * length go) and stops when an eviction frees nothing, so the loop cannot spin. The entry
 * just written is never evicted: a dialog larger than the byte bound alone is still kept,
 * until the next write pushes it out.
 *
 * The store's ops answer on the next loop iteration (a zero timer), never from inside the
 * call, as store.h promises.
 */
#include <stdlib.h>
#include <string.h>

#include "chatgate/core/log.h"
#include "chatgate/store/store.h"

struct cg_memstore {
    json_t *entries;
    long max_dialogs;
    size_t max_bytes;
    size_t bytes; /* the sum of the entries' "bytes" */
    cg_lifetimes lt;
    cg_store_stats *stats;
};

cg_memstore *cg_memstore_new(long max_dialogs, const cg_lifetimes *lt, cg_store_stats *stats)
{
    cg_memstore *m = calloc(1, sizeof(*m));
    if (!m)
        return NULL;
    m->entries = json_object();
    if (!m->entries) {
        free(m);
        return NULL;
    }
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

size_t cg_memstore_bytes(cg_memstore *m)
{
    return m->bytes;
}

void cg_memstore_free(cg_memstore *m)
{
    if (!m)
        return;
    json_decref(m->entries);
    free(m);
}

static int64_t exp_of(json_t *entry, const char *key)
{
    json_t *v = json_object_get(entry, key);
    return json_is_integer(v) ? (int64_t)json_integer_value(v) : 0;
}

static size_t bytes_of(json_t *entry)
{
    json_t *v = json_object_get(entry, "bytes");
    return json_is_integer(v) && json_integer_value(v) > 0 ? (size_t)json_integer_value(v) : 0;
}

static void publish_bytes(cg_memstore *m)
{
    if (m->stats)
        m->stats->memory_bytes = m->bytes;
}

/* Deletes key's entry, if any, and takes its bytes off the total. */
static void entry_drop(cg_memstore *m, const char *key)
{
    json_t *entry = json_object_get(m->entries, key);
    if (!entry)
        return;
    size_t n = bytes_of(entry);
    m->bytes -= n < m->bytes ? n : m->bytes;
    json_object_del(m->entries, key);
    publish_bytes(m);
}

/* Which bound is passed, if any: "count", "bytes" or NULL. */
static const char *over_bound(const cg_memstore *m)
{
    if ((long)json_object_size(m->entries) > m->max_dialogs)
        return "count";
    if (m->bytes > m->max_bytes)
        return "bytes";
    return NULL;
}

/*
 * Evicts least recently used entries until both bounds hold, keeping the newest one.
 * Every turn removes an entry or stops: a key that cannot be deleted ends the loop with
 * an error instead of spinning on it.
 */
static void evict(cg_memstore *m)
{
    const char *reason;
    while ((reason = over_bound(m)) != NULL && json_object_size(m->entries) > 1) {
        size_t before = json_object_size(m->entries);
        const char *oldest = json_object_iter_key(json_object_iter(m->entries));
        char *key = oldest ? strdup(oldest) : NULL; /* its own copy: the entry's key dies with it */
        if (key)
            entry_drop(m, key);
        free(key);
        if (json_object_size(m->entries) >= before) {
            cg_error("memory store: could not evict the least recently used dialog; %zu held, %zu bytes",
                     before, m->bytes);
            return;
        }
        if (m->stats) {
            if (strcmp(reason, "bytes") == 0)
                m->stats->evictions_bytes++;
            else
                m->stats->evictions++;
        }
    }
}

int cg_memstore_get(cg_memstore *m, const char *key, int64_t now, cg_dialog *d)
{
    json_t *entry = json_object_get(m->entries, key);
    if (!entry || exp_of(entry, "dialog_exp") <= now) {
        entry_drop(m, key);
        cg_dialog_init(d, now);
        return 0;
    }
    cg_dialog_from_json(d, json_object_get(entry, "d"), now);
    if (exp_of(entry, "params_exp") <= now) {
        json_decref(d->params);
        d->params = json_object();
    }
    if (exp_of(entry, "history_exp") <= now) {
        json_decref(d->history);
        d->history = json_array();
    }
    /* most recently used: to the end of the order */
    size_t n = bytes_of(entry); /* read first: a failed set below frees the entry */
    json_incref(entry);
    json_object_del(m->entries, key);
    if (json_object_set_new(m->entries, key, entry) < 0) { /* out of memory: the entry is gone */
        m->bytes -= n < m->bytes ? n : m->bytes;
        publish_bytes(m);
    }
    return 1;
}

/* The entry kept for d: its dialog, lifetimes and weight; NULL when out of memory. */
static json_t *entry_new(const cg_memstore *m, const char *key, const cg_dialog *d, int64_t now)
{
    json_t *dj = cg_dialog_to_json(d);
    if (!dj)
        return NULL;
    size_t bytes = strlen(key) + json_dumpb(dj, NULL, 0, JSON_COMPACT);
    return json_pack("{s:o, s:I, s:I, s:I, s:I}", "d", dj, "dialog_exp", (json_int_t)(now + m->lt.dialog_s),
                     "params_exp", (json_int_t)(now + m->lt.params_s), "history_exp",
                     (json_int_t)(now + m->lt.history_s), "bytes", (json_int_t)bytes);
}

void cg_memstore_put(cg_memstore *m, const char *key, const cg_dialog *d, int64_t now)
{
    json_t *entry = entry_new(m, key, d, now);
    entry_drop(m, key);
    if (!entry || json_object_set_new(m->entries, key, entry) < 0) {
        /* what was held is older than what the caller has: better none than a stale one */
        cg_error("memory store: out of memory keeping a dialog; it was dropped");
        return;
    }
    m->bytes += bytes_of(entry);
    publish_bytes(m);
    evict(m);
}

void cg_memstore_del(cg_memstore *m, const char *key)
{
    entry_drop(m, key);
}

int cg_memstore_del_user(cg_memstore *m, const char *user)
{
    char *prefix = cg_store_dialog_key(user, ""); /* "<user>:" */
    size_t n = strlen(prefix);
    int deleted = 0;
    const char *key;
    json_t *v;
    void *tmp;
    json_object_foreach_safe(m->entries, tmp, key, v) {
        if (strncmp(key, prefix, n) == 0) {
            entry_drop(m, key);
            deleted++;
        }
    }
    free(prefix);
    return deleted;
}

long cg_memstore_count(cg_memstore *m)
{
    return (long)json_object_size(m->entries);
}

json_t *cg_memstore_entries(cg_memstore *m)
{
    return m->entries;
}

/* ---- the store ops: the table above, answering from the loop ------------------------- */

typedef struct memory_store {
    cg_store base;
    cg_memstore *mem;
    int pending; /* requests whose timer has not closed yet */
    int closing; /* close() was called: free when pending reaches 0 */
} memory_store;

static void memory_store_free(memory_store *ms)
{
    cg_memstore_free(ms->mem);
    free(ms);
}

typedef enum { OP_LOAD, OP_SAVE, OP_REMOVE, OP_REMOVE_USER } op_kind;

struct cg_store_req {
    uv_timer_t timer;
    memory_store *ms;
    op_kind kind;
    char *key;
    cg_store_load_fn load_cb;
    cg_store_done_fn done_cb;
    void *ctx;
    int abandoned;
};

static void req_closed(uv_handle_t *h)
{
    cg_store_req *r = h->data;
    memory_store *ms = r->ms;
    free(r->key);
    free(r);
    if (--ms->pending == 0 && ms->closing)
        memory_store_free(ms);
}

static void req_run(uv_timer_t *t)
{
    cg_store_req *r = t->data;
    static const cg_store_status ok = {0, 0, 0};
    if (r->ms->closing) {
        /* shutting down: nobody waits */
    } else if (!r->abandoned && r->kind == OP_LOAD) {
        cg_dialog d;
        cg_store_status st = {0, 0, 0};
        st.found = cg_memstore_get(r->ms->mem, r->key, r->ms->base.now(r->ms->base.clock_ctx), &d);
        r->load_cb(r->ctx, &d, &st);
    } else if (!r->abandoned && r->done_cb) {
        r->done_cb(r->ctx, &ok);
    }
    uv_close((uv_handle_t *)&r->timer, req_closed);
}

static cg_store_req *req_new(memory_store *ms, op_kind kind, const char *user, const char *room, void *ctx)
{
    cg_store_req *r = calloc(1, sizeof(*r));
    if (!r)
        return NULL;
    r->ms = ms;
    r->kind = kind;
    r->key = cg_store_dialog_key(user, room);
    r->ctx = ctx;
    ms->pending++;
    uv_timer_init(ms->base.loop, &r->timer);
    r->timer.data = r;
    uv_timer_start(&r->timer, req_run, 0, 0);
    return r;
}

static cg_store_req *mem_load(cg_store *st, const char *user, const char *room, cg_store_load_fn cb, void *ctx)
{
    st->stats.loads++;
    cg_store_req *r = req_new((memory_store *)st, OP_LOAD, user, room, ctx);
    if (r)
        r->load_cb = cb;
    return r;
}

static cg_store_req *mem_save(cg_store *st, const char *user, const char *room, const cg_dialog *d,
                              cg_store_done_fn cb, void *ctx)
{
    memory_store *ms = (memory_store *)st;
    st->stats.saves++;
    cg_store_req *r = req_new(ms, OP_SAVE, user, room, ctx);
    if (!r)
        return NULL;
    r->done_cb = cb;
    /* written now, so a load queued after this save sees it */
    cg_memstore_put(ms->mem, r->key, d, st->now(st->clock_ctx));
    return r;
}

static cg_store_req *mem_remove(cg_store *st, const char *user, const char *room, cg_store_done_fn cb, void *ctx)
{
    memory_store *ms = (memory_store *)st;
    st->stats.deletes++;
    cg_store_req *r = req_new(ms, OP_REMOVE, user, room, ctx);
    if (!r)
        return NULL;
    r->done_cb = cb;
    cg_memstore_del(ms->mem, r->key);
    return r;
}

static cg_store_req *mem_remove_user(cg_store *st, const char *user, cg_store_done_fn cb, void *ctx)
{
    memory_store *ms = (memory_store *)st;
    st->stats.deletes++;
    cg_store_req *r = req_new(ms, OP_REMOVE_USER, user, "", ctx);
    if (!r)
        return NULL;
    r->done_cb = cb;
    cg_memstore_del_user(ms->mem, user);
    return r;
}

static void mem_abandon(cg_store_req *r)
{
    r->abandoned = 1;
}

static void mem_close(cg_store *st)
{
    memory_store *ms = (memory_store *)st;
    if (ms->pending == 0)
        memory_store_free(ms);
    else
        ms->closing = 1;
}

static const cg_store_ops memory_ops = {
    .name = "memory",
    .load = mem_load,
    .lease = mem_load, /* one process: the in-process dialog lock is the whole story */
    .save = mem_save,
    .remove = mem_remove,
    .remove_user = mem_remove_user,
    .abandon = mem_abandon,
    .close = mem_close,
};

cg_store *cg_store_memory_open(uv_loop_t *loop, const cg_store_config *cfg)
{
    memory_store *ms = calloc(1, sizeof(*ms));
    if (!ms)
        return NULL;
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
    return &ms->base;
}
