/*
 * store.h: where dialogs live between messages, behind one table of operations.
 *
 * Two stores: in memory (one process, TTLs and bounds on dialogs and bytes held, least
 * recently used going first) and Redis (any number of gateways; docs/state.md's key layout,
 * one pipelined read and one pipelined write per message, on the gateway's loop). When
 * Redis fails, degraded mode (fallback.h, no Redis code: a wrapper whose tables stand in
 * front of the store's dialogs, lease and limits) answers from memory, says so
 * (status.degraded, status.warn once per dialog), and writes what it held back to Redis
 * when it returns.
 *
 * Calls never call back from inside themselves: the answer comes later from the loop.
 * A caller that goes away before the answer abandons its request; the callback is then
 * never called.
 */
#ifndef CHATGATE_STORE_H
#define CHATGATE_STORE_H

#include <uv.h>
#include <jansson.h>
#include <stddef.h>
#include <stdint.h>

#include "chatgate/dialog/dialog.h"
#include "chatgate/store/limits.h"

typedef struct cg_store cg_store;
typedef struct cg_store_req cg_store_req;

typedef struct cg_store_status {
    int degraded; /* answered from memory: Redis is away */
    int warn;     /* the first such answer for this dialog: tell the client */
    int found;    /* load: the dialog existed (a cache hit) */
    int unavailable; /* an inner store's answer to degraded mode (fallback.h), never the
                      * gateway's: it could not do it (away, or it failed the request),
                      * and a load's dialog, a limit's verdict, the rooms are NULL */
    const cg_dialog *unsaved; /* with unavailable, a save's: the dialog as the store last
                               * had it (merged with its own copy), for degraded mode to keep;
                               * NULL: the one it was given. Borrowed for the call. */
} cg_store_status;

/* d is the caller's to keep (cg_dialog_free) */
typedef void (*cg_store_load_fn)(void *ctx, cg_dialog *d, const cg_store_status *status);
typedef void (*cg_store_done_fn)(void *ctx, const cg_store_status *status);
/* rooms: the names of the rooms (a JSON array of strings, borrowed for the call) */
typedef void (*cg_store_rooms_fn)(void *ctx, json_t *rooms, const cg_store_status *status);
/* limit: may the message go (limits.h)? */
typedef void (*cg_store_limit_fn)(void *ctx, const cg_limit_verdict *v, const cg_store_status *status);
/* profile: the user's profile (borrowed for the call; an empty object when none); err 0, or
 * a CG_E_* code when an update was refused (CG_E_TOO_LARGE: over profile_cap, nothing
 * written) and profile is the one kept. */
typedef void (*cg_store_profile_fn)(void *ctx, json_t *profile, int err, const cg_store_status *status);

/* What a request asks of a store. */
typedef enum {
    CG_STORE_LOAD,
    CG_STORE_SAVE,
    CG_STORE_REMOVE,
    CG_STORE_REMOVE_USER,
    CG_STORE_ROOMS,
    CG_STORE_LIMIT,
    CG_STORE_PROFILE, /* a profile's read, or its update */
} cg_store_op;

/*
 * What every request of every store begins with (as libuv's UV_REQ_FIELDS): what it asks,
 * the caller's callback for the answer and its context, and whether the caller still wants
 * it. Each store's own request type (memory_req, redis_req, degraded mode's) starts with
 * these fields, so a cg_store_req * is a pointer to any of them: cg_store_abandon works on
 * all.
 */
#define CG_STORE_REQ_FIELDS                                                                   \
    void *ctx;     /* the caller's, handed to its callback */                                 \
    int abandoned; /* the caller is gone: its callback will not be called */                  \
    void (*on_abandon)(cg_store_req *req); /* NULL, or what the store does at once when the  \
                                            * caller goes (degraded mode: its inner request) */ \
    cg_store_op kind;                                                                         \
    union {                                                                                   \
        cg_store_load_fn load;   /* CG_STORE_LOAD (and a lease's acquire) */                   \
        cg_store_done_fn done;   /* SAVE, REMOVE, REMOVE_USER; may be NULL */                 \
        cg_store_rooms_fn rooms; /* ROOMS */                                                  \
        cg_store_limit_fn limit; /* LIMIT */                                                  \
        cg_store_profile_fn profile; /* PROFILE */                                            \
    } cb;

struct cg_store_req {
    CG_STORE_REQ_FIELDS
};

/* Redis Cluster (redis-cluster://): the redirects met and followed, the map read. */
typedef struct cg_store_cluster_stats {
    unsigned long moved, ask, tryagain, clusterdown;
    unsigned long map_reads; /* CLUSTER SLOTS read */
} cg_store_cluster_stats;

typedef struct cg_store_stats {
    unsigned long loads, saves, deletes;
    unsigned long errors;            /* commands that failed or timed out */
    unsigned long degraded_answers;  /* loads and saves served from memory */
    unsigned long reconnects;        /* successful connects after the first */
    unsigned long flushed;           /* dialogs written back to Redis after an outage */
    unsigned long evictions;         /* dialogs dropped by the memory store's count bound */
    unsigned long evictions_bytes;   /* dialogs dropped by its byte bound */
    unsigned long evictions_rooms;   /* dialogs dropped by max_rooms_per_user (a user's oldest room) */
    size_t memory_bytes;             /* what the memory store holds now (its byte measure) */
    long memory_dialogs;             /* ... and how many dialogs (a Redis store's: its copies) */
    /* Redis: the write-back after an outage */
    long writeback_pending, writeback_pending_bytes; /* dialogs written to memory only, now */
    unsigned long writeback_dropped_bound; /* dropped by the bound on those */
    unsigned long writeback_dropped_gone;  /* no longer in memory at the write-back: not written */
    unsigned long writeback_failed;        /* write-backs the store failed (an error answer, the link
                                            * lost): each goes again, so a count that keeps
                                            * growing is a store that keeps refusing */
    unsigned long save_conflicts;          /* saves refused: Redis held another or a newer copy */
    unsigned long merges;                  /* saves that met another copy and merged with it */
    unsigned long merged_messages;         /* history messages those merges added to Redis's copy */
    unsigned long lease_waits;             /* turns that found their dialog's lease held elsewhere */
    unsigned long lease_wakes;             /* waiting turns woken by the holder's message */
    unsigned long lease_lost;              /* turns' saves refused: their lease had passed on */
    unsigned long remote_cancels;          /* turns stopped at another gateway's request */
    unsigned long loads_cached;            /* loads answered "unchanged": the gateway's copy was Redis's */
    unsigned long loads_pipelined;         /* loads sent behind their dialog's save in flight */
    unsigned long loads_pipelined_again;   /* of those, sent again: the save was not answered first */
    unsigned long saves_appended;          /* saves that sent only the history's new messages */
    /* Redis Sentinel (redis-sentinel://) */
    unsigned long primary_switches;  /* connections trusted to a primary other than the last one */
    unsigned long readonly_replies;  /* -READONLY answers: the node had become a replica */
    unsigned long replica_refused;   /* connects dropped because ROLE did not say master */
    cg_store_cluster_stats cluster;
    double degraded_seconds;         /* time spent with Redis away, up to the last recovery */
    uint64_t degraded_since_ms;      /* uv_now() when the current outage began */
    int degraded;                    /* Redis is away now */
} cg_store_stats;

/*
 * A store is seven narrow interfaces, one a job, each with a memory and a Redis
 * implementation (but the bus, the replies and the stream: Redis only), and what every
 * request shares (abandon) and the store's end (close). Callers call through the table of the job they need: the
 * dialogs (an admin's read or delete), the lease (a turn), the limiter (a chat message with
 * limits), the bus (a cancel for another gateway), the replies (a resume through another
 * gateway), the profiles (a user's attributes), and a stream (the turn export's records).
 */

/* Dialogs: where a dialog's state lives between messages. */
typedef struct cg_store_dialog_ops {
    /* Loads (user, room), a fresh dialog when there is none. NULL on failure to start. */
    cg_store_req *(*load)(cg_store *st, const char *user, const char *room, cg_store_load_fn cb, void *ctx);
    /* Saves d; cb may be NULL. A save after a lease's load ends the lease. The store may keep
     * references to d's parts instead of copies: d is not changed after its save (the
     * caller reads it, and frees it). */
    cg_store_req *(*save)(cg_store *st, const char *user, const char *room, const cg_dialog *d,
                          cg_store_done_fn cb, void *ctx);
    /* Deletes (user, room); cb may be NULL. */
    cg_store_req *(*remove)(cg_store *st, const char *user, const char *room, cg_store_done_fn cb, void *ctx);
    /* Deletes every dialog of user (the right to be forgotten), through the user's room set,
     * never a key scan; cb may be NULL. */
    cg_store_req *(*remove_user)(cg_store *st, const char *user, cg_store_done_fn cb, void *ctx);
    /* The rooms user has a dialog in, through the user's room set (as remove_user). */
    cg_store_req *(*rooms)(cg_store *st, const char *user, cg_store_rooms_fn cb, void *ctx);
} cg_store_dialog_ops;

/* The dialog lease: one turn of a dialog at a time, across every gateway sharing the store. */
typedef struct cg_store_lease_ops {
    /* A turn's load: as load, and the dialog is this turn's until its save (which writes only
     * while that still holds) or release(). Redis: a lease across every gateway, waited for in
     * line when another holds it; memory: the load itself (the in-process lock is enough). */
    cg_store_req *(*acquire)(cg_store *st, const char *user, const char *room, cg_store_load_fn cb, void *ctx);
    /* A turn that saves nothing lets go of its lease; NULL when the store has none. */
    void (*release)(cg_store *st, const char *user, const char *room);
} cg_store_lease_ops;

/* Limits per user (limits.h), counted across every gateway sharing the store. */
typedef struct cg_store_limit_ops {
    /* Takes one chat message of user's against lim (copied); the verdict comes to cb. turn is
     * a number this process gives the turn, handed back to end. */
    cg_store_req *(*take)(cg_store *st, const char *user, const cg_limits *lim, uint64_t turn, cg_store_limit_fn cb,
                          void *ctx);
    /* The turn take() let through ended having spent tokens (counted against the token
     * limits); local: its verdict's. No answer. */
    void (*end)(cg_store *st, const char *user, const cg_limits *lim, uint64_t turn, int local, long long tokens);
} cg_store_limit_ops;

/* The cancel bus between gateways; a store with no other gateways has none (NULL table). A
 * cancel that arrives for this gateway comes to cg_store's on_cancel. */
typedef struct cg_store_bus_ops {
    /* Asks whoever holds the dialog's lease (another gateway) to stop its reply in flight: a
     * cancel phrase or context.clear that arrived here. */
    void (*cancel_remote)(cg_store *st, const char *user, const char *room);
} cg_store_bus_ops;

/* One piece of a reply published for another gateway (server/resume.h): text, the reply's
 * bytes up to its end (seq), and on the first the dialog's room, on the last the terminal
 * frame. Borrowed for the call. */
typedef struct cg_reply_entry {
    const char *entry;       /* read: the stream's id of the entry ("1700000000000-0") */
    uint64_t seq;
    const char *text;
    size_t len;
    const char *room;        /* or NULL */
    const char *end;         /* the terminal frame's JSON, or NULL */
    size_t end_len;
} cg_reply_entry;

/* The entries read (n of them, after the one asked for); failed: the store did not answer. */
typedef void (*cg_store_entries_fn)(void *ctx, const cg_reply_entry *e, size_t n, int failed);
/* Whether another gateway listens to the reply (cg_store_reply_ops.listen). */
typedef void (*cg_store_listened_fn)(void *ctx, int listened);

/* Replies of gone clients, for a resume through another gateway; a store with no other
 * gateways has none (NULL table). The callbacks come once, from the loop, never from inside
 * the call; a call that returns -1 (the store is away) calls nothing. */
typedef struct cg_store_reply_ops {
    /* Appends e to the reply of (user, id), which lives ttl_ms from now. No answer; -1 when
     * it could not be sent (the store is away: the caller keeps it for later). */
    int (*append)(cg_store *st, const char *user, const char *id, const cg_reply_entry *e, long ttl_ms);
    /* The entries after entry `after` (NULL: from the first), at most a few hundred. */
    int (*read)(cg_store *st, const char *user, const char *id, const char *after, cg_store_entries_fn cb,
                void *ctx);
    /* A gateway serves a resume of the reply, for ms from now: its holder goes on past its grace. */
    void (*listen)(cg_store *st, const char *user, const char *id, long ms);
    int (*listened)(cg_store *st, const char *user, const char *id, cg_store_listened_fn cb, void *ctx);
} cg_store_reply_ops;

/* ok: 1 the store took the record; 0 it failed (an error answer, or Redis went away first). */
typedef void (*cg_store_appended_fn)(void *ctx, int ok);

/* An append-only stream of records that others read (the turn export, server/export.h);
 * a store with nowhere to keep one has none (NULL table: the memory store). */
typedef struct cg_store_stream_ops {
    /* Appends one record, the pair (field, value: len bytes, copied), to the stream `name`
     * (a key under the store's prefix), trimmed to about max_len records (0: never
     * trimmed). 0: cb is called once, later; -1 at once when the store cannot send now
     * (Redis away): cb is never called. Never queued in the store: the caller bounds what
     * it keeps while Redis is away. */
    int (*append)(cg_store *st, const char *name, const char *field, const char *value, size_t len, long max_len,
                  cg_store_appended_fn cb, void *ctx);
} cg_store_stream_ops;

/* Profiles: what a user said about themselves, shared by every room of theirs
 * (profiles.h, docs/state.md "The user's profile"), living lifetimes.profile_s after its
 * last use, at most lifetimes.profile_cap bytes. remove_user forgets it too. */
typedef struct cg_store_profile_ops {
    /* user's profile, its lifetime renewed. */
    cg_store_req *(*get)(cg_store *st, const char *user, cg_store_profile_fn cb, void *ctx);
    /* Applies changes (name -> value, null forgets; checked by the caller with
     * cg_profile_check) as one step, within the cap; the profile it leaves comes to cb (may
     * be NULL). */
    cg_store_req *(*update)(cg_store *st, const char *user, json_t *changes, cg_store_profile_fn cb, void *ctx);
} cg_store_profile_ops;

typedef struct cg_store_ops {
    const char *name;
    const cg_store_dialog_ops *dialogs;
    const cg_store_lease_ops *lease;
    const cg_store_limit_ops *limits;
    const cg_store_profile_ops *profiles;
    const cg_store_bus_ops *bus; /* NULL: no other gateways to tell */
    const cg_store_reply_ops *replies; /* NULL: no other gateway resumes a reply */
    const cg_store_stream_ops *stream; /* NULL: no streams (the export cannot go there) */
    /* Stops timers and connections; frees the store once its handles have closed. */
    void (*close)(cg_store *st);
} cg_store_ops;

/* TLS to Redis (rediss://, rediss-sentinel://, rediss-cluster://) */
typedef struct cg_store_tls {
    const char *ca_file, *cert_file, *key_file; /* NULL: the system's CAs; no client certificate */
    const char *server_name; /* the name certificates must be for; NULL: each node's host */
    int no_verify;           /* 1: no certificate or name check (tests, never production) */
} cg_store_tls;

typedef struct cg_store_config {
    const char *url; /* "memory", "redis://[:password@]host:port[/db]",
                      * "redis-sentinel://[:password@]host:port[,host:port...]/master[/db]" or
                      * "redis-cluster://host:port[,...]"; rediss for each over TLS */
    const char *prefix; /* key prefix, "chatgate" */
    cg_lifetimes lifetimes;
    long max_dialogs;        /* memory store bound */
    long max_rooms_per_user; /* a user's dialogs kept; past it, their least recently used goes */
    size_t max_bytes;        /* memory store byte bound; 0: CG_MEMSTORE_DEFAULT_MAX_BYTES */
    long command_timeout_ms; /* Redis: a command unanswered this long fails the connection */
    long connect_timeout_ms;
    long writeback_max_bytes; /* Redis: bound on dialogs held for the write-back; 0 = 64 MiB */
    long lease_ms;            /* Redis: a dialog lease's lifetime, renewed while its turn runs */
    struct cg_flusher *flush; /* Redis: commands are written through it, before the frames
                               * of the same loop iteration (core/flush.h); NULL: when the
                               * socket is writable */
    const char *bus_url;      /* Redis: where gateways tell each other to cancel (redis.bus);
                               * NULL: the store's own URL when it is redis:// or rediss://,
                               * a cluster's sharded pub/sub, else none */
    cg_store_tls tls;
} cg_store_config;

struct cg_store {
    const cg_store_ops *ops;
    uv_loop_t *loop;
    cg_store_config cfg;
    cg_store_stats stats;
    int64_t (*now)(void *clock_ctx); /* unix seconds; injectable for tests */
    void *clock_ctx;
    /* Set by the server: another gateway asked to stop the reply in flight of the dialog
     * whose key (cg_store_dialog_key) is given, which this process holds. */
    void (*on_cancel)(void *cancel_ctx, const char *key);
    void *cancel_ctx;
    /* Degraded mode in front of this store's dialogs, lease and limits (fallback.h), or
     * NULL: a store that cannot be away (memory). Its tables find it here. */
    struct cg_fallback *fallback;
};

/* The caller of req (any request of any store, NULL too) is gone: its callback will not be
 * called; the store frees the request when its work is done. */
static inline void cg_store_abandon(cg_store_req *req)
{
    if (!req)
        return;
    req->abandoned = 1;
    if (req->on_abandon)
        req->on_abandon(req);
}

/* Creates the store cfg->url names; NULL with err on a bad URL. */
cg_store *cg_store_open(uv_loop_t *loop, const cg_store_config *cfg, char *err, size_t errlen);

/*
 * The dialog's key part "<user>:<room>", each id percent-encoded outside [A-Za-z0-9_.@|-]
 * (docs/state.md, "Keys"), so no id can reach another dialog's keys or break a hash tag.
 * Returns a malloc'd string.
 */
char *cg_store_dialog_key(const char *user, const char *room);
/* The same key from ids already escaped (cg_store_escape): "<eu>:<er>", malloc'd. */
char *cg_store_key_join(const char *eu, const char *er);
/* What a log line may say of a dialog's key: a hash, never the user's id (an e-mail, a
 * phone number), printed "dialog #%08lx". */
unsigned long cg_store_key_tag(const char *key);
/* Percent-encodes one id; malloc'd. */
char *cg_store_escape(const char *id);
/* The id cg_store_escape made s (n bytes) from; malloc'd. */
char *cg_store_unescape(const char *s, size_t n);

/* ---- the in-memory store, also degraded mode's copy (fallback.h) ---------------------- */

typedef struct cg_memstore cg_memstore;
/* The byte bound a new memory store starts with: 256 MiB. */
cg_memstore *cg_memstore_new(long max_dialogs, const cg_lifetimes *lt, cg_store_stats *stats);
/* Bounds the store in bytes as well (its key and about its dialog as compact JSON count for
 * each entry, cg_dialog_weight); least recently used entries go first, the one just written never. */
void cg_memstore_set_max_bytes(cg_memstore *m, size_t max_bytes);
/* A user's entries kept at most (0: no bound): past it, their least recently used goes,
 * counted in stats->evictions_rooms. The memory store's; Redis keeps its own. */
void cg_memstore_set_max_rooms(cg_memstore *m, long max_rooms);
/* The bytes held now, by that measure. */
size_t cg_memstore_bytes(cg_memstore *m);
void cg_memstore_free(cg_memstore *m);
/* Fills d from the entry for key (a fresh dialog when none or expired); 1 if it existed. */
int cg_memstore_get(cg_memstore *m, const char *key, int64_t now, cg_dialog *d);
/*
 * Puts a copy of d under key. The entry remembers rev (or NULL): the Redis store's name for
 * the version of Redis's copy this one equals (docs/state.md, "The gateway's copy"), and
 * renewed: when a save last set the lifetimes of Redis's keys of that copy (0: not known).
 */
void cg_memstore_put_rev(cg_memstore *m, const char *key, const cg_dialog *d, int64_t now, const char *rev,
                         int64_t renewed);
/* The same, keeping d's own parts (cg_dialog_share) instead of copies: for a dialog nobody
 * changes after its put (a saved one, store.h), which saves copying it at every save. */
void cg_memstore_keep(cg_memstore *m, const char *key, const cg_dialog *d, int64_t now, const char *rev,
                      int64_t renewed);
/* The rev of key's live entry, or NULL (none, or put without one). Owned by the entry. */
const char *cg_memstore_rev(cg_memstore *m, const char *key, int64_t now);
/* What a Redis save reads of the gateway's copy, in one lookup: all shared with the entry
 * (only read, valid until its next put), NULL or 0 where there is none. */
typedef struct cg_memstore_view {
    const char *rev;  /* as cg_memstore_rev */
    json_t *history;  /* the history items; NULL when their time is up */
    json_t *params;   /* the params; NULL when their time is up */
    int64_t renewed;  /* as given to the put */
} cg_memstore_view;
/* Fills v from key's live entry; 0 when there is none (v all NULL and 0). */
int cg_memstore_view_of(cg_memstore *m, const char *key, int64_t now, cg_memstore_view *v);
void cg_memstore_del(cg_memstore *m, const char *key);
/* How cg_memstore_pin moves an entry. */
typedef enum cg_memstore_pinning {
    CG_MEMSTORE_PIN,          /* never evicted, nor counted by the bounds (it still lapses
                               * with its lifetime, and goes with a delete) */
    CG_MEMSTORE_UNPIN,        /* back in the use order, as if just used */
    CG_MEMSTORE_UNPIN_OLDEST, /* back in the use order, the first to evict */
} cg_memstore_pinning;
/* Pins key's entry, or lets it go back to the use order: for dialogs whose only copy is this
 * one (the write-back's), whose owner bounds them. */
void cg_memstore_pin(cg_memstore *m, const char *key, cg_memstore_pinning how);
/* Deletes every dialog of user (keys "<escaped user>:..."); returns how many. */
int cg_memstore_del_user(cg_memstore *m, const char *user);
/* The rooms (names as given) of the dialogs whose key starts with prefix ("<escaped user>:"). */
json_t *cg_memstore_rooms(cg_memstore *m, const char *prefix);
long cg_memstore_count(cg_memstore *m);

cg_store *cg_store_memory_open(uv_loop_t *loop, const cg_store_config *cfg);
cg_store *cg_store_redis_open(uv_loop_t *loop, const cg_store_config *cfg, char *err, size_t errlen);

/* The store's clock in milliseconds (its now(), in whole seconds), for the limits' windows. */
int64_t cg_store_now_ms(cg_store *st);

/* Wall-clock seconds, or CHATGATE_NOW's when set (tests and demos). */
int64_t cg_store_default_now(void *unused);
/* The same clock in milliseconds, from one reading: ordered across a second's turn. */
int64_t cg_store_default_now_ms(void);

/* Seconds with Redis away so far: degraded_seconds plus the outage going on, if any (now
 * is uv_now(), as degraded_since_ms is). */
double cg_store_degraded_seconds(const cg_store_stats *st, uint64_t now);
/* dst += src: the counters of a store's figures; with gauges too when `gauges` (--workers:
 * the figures of the process group, as cg_metrics_add for the gateway's). */
void cg_store_stats_add(cg_store_stats *dst, const cg_store_stats *src, int gauges);

#endif
