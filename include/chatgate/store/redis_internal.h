/*
 * redis_internal.h: what the parts of the Redis store share. Private: only
 * src/store/redis_*.c include it; the rest of the gateway knows the Redis store through
 * store.h alone (cg_store_redis_open and the ops tables).
 *
 * Under the store, knowing nothing of dialogs: redis_link.c (the store's Redis, whatever
 * the topology: connect, AUTH/SELECT, the PING probe (and ROLE with Sentinel), command
 * timeouts over its in-flight list, reconnect with backoff and jitter, scripts by SHA with
 * NOSCRIPT recovery), over redis_client.c (one connection to one node, TCP or TLS),
 * redis_sentinel.c (Sentinel), redis_slots.c and redis_cluster.c (Redis Cluster). The store
 * itself is split along its seams, each calling only the ones below it:
 *   redis_store.c   open (the URL) and close; what the link's going and coming mean to the
 *                   store (the fallback told, the waiting requests started); the tick;
 *   redis_dialog.c  the dialog operations: the keys, the scripts (EVALSHA) and their
 *                   arguments, load, save, remove, forget a user, the dialog leases and their
 *                   line, merging two copies, reading the replies; the four jobs' tables;
 *   redis_bus.c     the pub/sub connections that carry cancels between gateways (sharded
 *                   in a cluster), handing each to the store's callback;
 *   redis_req.c     the requests, their "unavailable" answers, and the store's end;
 *   redis_stream.c  the stream a record is appended to (XADD: the turn export).
 * Degraded mode (the gateway's copy of the dialogs, what was written while Redis was away,
 * the write-back) is no Redis code: fallback.c, a wrapper whose tables stand in the store's
 * table in front of redis_dialog.c's dialogs, lease and limits; the store tells it when the
 * link goes and comes, answers it "unavailable" where it could not do a request, and keeps
 * its copy of each dialog's rev in the fallback's copy.
 */
#ifndef CHATGATE_STORE_REDIS_INTERNAL_H
#define CHATGATE_STORE_REDIS_INTERNAL_H

#include "chatgate/store/redis_client.h"
#include "chatgate/store/redis_cluster.h"
#include "chatgate/store/redis_link.h"
#include "chatgate/store/redis_sentinel.h"
#include <hiredis/hiredis.h>

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "chatgate/core/net.h"
#include "chatgate/store/fallback.h"
#include "chatgate/store/profiles.h"
#include "chatgate/store/redis_argv.h"
#include "chatgate/store/store.h"


typedef struct redis_store redis_store;
typedef struct redis_req redis_req;
typedef struct cg_redis_bus cg_redis_bus;

/* A request of the Redis store: cg_store_req's fields first (store.h), then its own. */
struct redis_req {
    CG_STORE_REQ_FIELDS
    redis_store *rs;
    char *user;      /* remove_user only: the user as given, for its memory delete */
    char *eu, *er;   /* user and room, escaped (cg_store_escape) */
    char *key;       /* "<eu>:<er>": the dialog's hash tag and memory key */
    cg_dialog *snapshot; /* save: the dialog as written, its parts shared with the saver's
                          * (cg_dialog_share: store.h, a dialog is not changed after its save) */
    long version;     /* save of a dirty dialog: the dirty version it writes back */
    cg_limits limits; /* limit: what the message is held to */
    uint64_t turn;    /* limit: the turn's number, its slot among the user's turns at once */
    int steps;        /* replies due to on_step_reply: r lives until they came */
    int step_failed;  /* one of them was an error or never came */
    int finished;     /* cg_redis_req_finish was called while steps were due */
    int base_unknown; /* save: the dialog began from nothing while Redis was away */
    int lease;        /* load: takes the dialog's lease (a turn's load) */
    int lease_waits;  /* load: how often the lease was found held (the backoff grows) */
    char *lease_value; /* save: the lease this save must still hold (its ticket, "<holder>#<n>"), or NULL */
    char *rev;         /* load: the rev of the gateway's copy it asked Redis about, or NULL;
                        * save: the rev it writes (docs/state.md, "The gateway's copy") */
    size_t copy_params, copy_history; /* load: what that copy held when asked about (its
                                       * params, its history messages) */
    int full;          /* load: reads everything, whatever the gateway holds; save: rewrites
                        * the whole history (its append was refused) */
    int pipelined;     /* load: sent behind a save of its dialog still in flight, asking about
                        * the rev that save writes (redis_dialog.c, "gate") */
    int plain;         /* load: how it goes in (redis_dialog.c, "The plain way in"): PLAIN_*
                        * flags, the plain commands' answers so far */
    int plain_due;     /* load: plain commands sent and not answered yet */
    int appended;      /* save: sent only the history's new messages */
    int merges;        /* save: how often Redis's copy was read and merged with this one */
    int lease_lost;    /* save: refused for a lease another gateway took (-2): its turn began
                        * before that gateway's, so Redis's copy counts as the newer one */
    char *merge_rev;   /* save of a merge: the rev of Redis's copy it merged with ("" none) */
    char *base_rev;    /* load: the rev of Redis's copy it read (or found the same), NULL for
                        * none; save: the rev the turn's load read, kept with its lease, which
                        * a rewrite under that lease must still find (save mode 4) */
    char *release_after; /* save of a merge: the turn's lease, which the merge's write does not
                          * carry; let go once that is answered, so no one waits for it to lapse */
    char *ticket;      /* a turn's load: its place in the line for the lease, "<holder>#<n>" */
    char *asked;       /* a turn's load waiting: the holder asked to wake it (redis_dialog.c) */
    redis_req *lw_next; /* in rs->lease_waiting, while its retry waits */
    int lw_listed;
    int64_t renewed;   /* save: when the lifetimes of the keys it writes were last set, this
                        * save's time when it sets them (docs/state.md, "Lifetimes in Redis") */
    json_t *changes;   /* profile: an update's (NULL: a read) */
    json_t *profile;   /* profile: the answer, once there */
    int profile_err;   /* profile: an update refused (CG_E_TOO_LARGE) */
    redis_req *wait_next; /* waiting for the first connection's verdict */
    uv_timer_t defer;          /* "unavailable" answers come through this, and lease retries */
};

struct redis_store {
    cg_store base;
    /* the URL, parsed: the link (redis_link.c) connects with it; host and port name the
     * store in logs (a cluster's first seed, Sentinel's master name) */
    char *host;
    int port, db;
    char *user;     /* an ACL user (AUTH USER PASSWORD), or NULL */
    char *password; /* NULL: none */
    char *master;   /* redis-sentinel:// only: the master's name at the Sentinels */
    char **sentinel_hosts; /* parsed, then the link's */
    int *sentinel_ports;
    int n_sentinels;
    char **seed_hosts;     /* redis-cluster:// only: the seeds (the link copies them) */
    int *seed_ports;
    int n_seeds;
    cg_redis_tls *tls;     /* the TLS context (redis.tls_*) when the store's URL or redis.bus
                            * is rediss, else NULL */
    int bus_tls;           /* the bus's connections are TLS: redis.bus is rediss (or, without
                            * it, the store's URL is) */
    cg_redis_link *link;   /* the store's Redis, up or down */
    uv_timer_t tick;       /* lease renewals, the write-back of dialogs marked while connected */
    cg_fallback *fb; /* degraded mode (fallback.c), in front of this store: the gateway's
                      * copy of the dialogs (this store's rev cache too), what it wrote
                      * while Redis was away, the limits counted meanwhile */
    cg_profiles *profiles; /* the copies of the profiles Redis answered (redis_profile.c) */
    json_t *profile_pending; /* eu -> the changes made while Redis was away, written back when
                              * it is up again (at most max_dialogs users) */
    int profile_updates_sent; /* profile updates sent and not answered yet: close waits for them
                               * (one Redis fails goes back to profile_pending) */
    redis_req *waiting, *waiting_tail; /* before the first connection is decided */
    json_t *leases;  /* key -> {"v": the lease ("<holder>#<n>"), "t": ms renewed}: dialog leases held */
    json_t *saving;  /* key -> saves in flight: later loads of that dialog wait (rs->gated) */
    json_t *save_next; /* key -> {rev, p, h}: the one plain save in flight of that dialog, what
                        * the gateway's copy will be once it is answered (a load goes behind it) */
    redis_req *gated; /* loads held for a save of their dialog, in order (via wait_next) */
    redis_req *lease_waiting; /* turns' loads waiting to ask for a lease again (via lw_next) */
    json_t *wake_on_release; /* key -> [holder, ...]: gateways waiting for a lease of ours, told
                              * on the bus when it is let go */
    char holder[48]; /* this store's lease holder id: host, pid and a random part */
    cg_redis_bus *bus; /* cancels between gateways (redis_bus.c), or NULL */
    unsigned long long rev_seq; /* the last rev this store wrote: revs are "<holder>#<seq>" */
    unsigned long long ticket_seq; /* the last ticket a turn of this store took */
    int handles; /* open uv handles + requests: freed when 0 after close */
    int closing;
    uint64_t close_deadline; /* closing: until when the write-back is waited for (uv_now, ms) */
    int close_tried; /* closing: the connect at once was asked for (redis_store.c, once) */
    uint64_t close_profiles_at; /* closing: when profile_pending was last sent (uv_now, ms) */
};

/* The store can send commands: its link is up. */
static inline int cg_redis_linked(const redis_store *rs)
{
    return cg_redis_link_up(rs->link);
}

/* A connection of the bus to a resolved address on the store's loop (redis_client.h), TLS
 * when the bus's is (host: the name its certificate must be for), with data and its event
 * callback (the link opens its own); NULL with why filled when it could not even start. */
static inline cg_redis_conn *cg_redis_async_open(redis_store *rs, const char *address, int port, const char *host,
                                                 void *data, cg_redis_event_fn *on_event, char *why, size_t whylen)
{
    return cg_redis_conn_open(rs->base.loop, address, port, host, rs->bus_tls ? rs->tls : NULL, rs->base.cfg.flush,
                              data, on_event, why, whylen);
}

/* ---- redis_req.c: the requests, and the store's end ------------------------------------ */

/* Requests: a new one for (user, room), escaped (or already escaped: eu, er); freed by
 * cg_redis_req_finish once the replies still due to it have come. */
redis_req *cg_redis_req_new(redis_store *rs, cg_store_op kind, const char *user, const char *room, void *ctx);
redis_req *cg_redis_req_new_escaped(redis_store *rs, cg_store_op kind, const char *eu, const char *er, void *ctx);
void cg_redis_req_finish(redis_req *r);
/* A save's snapshot of d (its parts shared), or NULL out of memory; and its end. */
cg_dialog *cg_redis_snapshot(const cg_dialog *d);
void cg_redis_snapshot_free(cg_dialog *s);
/* Answers r "unavailable" (Redis is away or failed it: degraded mode in front of the store
 * answers from memory), now or from the loop; finishes it. */
void cg_redis_answer_unavailable(redis_req *r);
void cg_redis_answer_later_unavailable(redis_req *r);
/* A handle or request of the store's is gone (the close callback of its handles); the store
 * is freed with its last one once it is closing. */
void cg_redis_handle_closed(uv_handle_t *h);
void cg_redis_store_unref(redis_store *rs);
/* Frees rs and what it owns (what open has not made yet is NULL: a bad URL's store too). */
void cg_redis_store_free(redis_store *rs);
/* Sends a's command on the store's link and empties a; 0, or -1 when the link refused it
 * (it is down). (redis_store.c) */
int cg_redis_send_argv(redis_store *rs, cg_argv *a, cg_redis_reply_fn *fn, void *priv);

/* ---- redis_store.c: open (the URL) and close, the link's going and coming -------------- */

/* A redis:// URL, parsed: host and password (NULL: none) malloc'd. */
typedef struct cg_redis_url {
    char *host;
    int port, db;
    char *user;     /* an ACL user, or NULL (the default user) */
    char *password;
    int tls;        /* rediss:// */
} cg_redis_url;

/* Parses redis://[:password@]host[:port][/db] (the password percent-decoded, port 1 to 65535,
 * db 0 to 15) into u: 0, or -1 with err saying what is wrong (never quoting the password).
 * The strings u holds then are the caller's to free either way. */
int cg_redis_parse_url(const char *url, cg_redis_url *u, char *err, size_t errlen);

/* ---- redis_dialog.c -------------------------------------------------------------------- */

/* The four jobs' tables (store.h); redis_store.c makes the store's table of them. */
extern const cg_store_dialog_ops cg_redis_dialog_ops;
extern const cg_store_lease_ops cg_redis_lease_ops;
extern const cg_store_limit_ops cg_redis_limit_ops;
extern const cg_store_bus_ops cg_redis_bus_ops;
extern const cg_store_reply_ops cg_redis_reply_ops; /* redis_reply.c */
extern const cg_store_profile_ops cg_redis_profile_ops; /* redis_profile.c */
/* The user's profile key: "<prefix>:{<eu>}:profile" (redis_profile.c), for forget-user's DEL. */
void cg_redis_profile_key(redis_store *rs, cg_argv *a, const char *eu);
/* The link is up: the profile changes made while Redis was away go to it (redis_profile.c). */
void cg_redis_profiles_writeback(redis_store *rs);
/* The profile updates not in Redis yet: waiting for the write-back, or sent and not answered
 * (redis_profile.c; shutdown waits for them). */
size_t cg_redis_profiles_unwritten(const redis_store *rs);
/* redis_stream.c: the stream (the turn export's XADD). */
extern const cg_store_stream_ops cg_redis_stream_ops;
/* Sends r's save (its snapshot): one conditional script (S_SAVE) that writes the dialog and
 * the rooms set. */
void cg_redis_send_save(redis_store *rs, redis_req *r);
/* Sends r's write-back (a dirty dialog, its snapshot): Redis's copy is read and merged with it
 * first (another gateway may have written the dialog meanwhile), then written over that copy
 * only. */
void cg_redis_send_writeback(redis_store *rs, redis_req *r);
/* Starts the requests that waited for the first connection's verdict. */
void cg_redis_drain_waiting(redis_store *rs);
/* A reply that failed: NULL (connection gone) or an error; logs the error's text. */
int cg_redis_reply_failed(redis_store *rs, redisReply *reply, size_t want_elements, const char *what);
/* The tick: renews the leases held that are a third through their lifetime. */
void cg_redis_renew_leases(redis_store *rs);
/* A message on this gateway's bus channel: a cancel, "<dialog key> <lease>" (the turn stops
 * if the lease is still this gateway's, else it is a late one and nothing happens); "wait
 * <dialog key> <holder>", another gateway waiting for a lease of ours; "wake <dialog key>",
 * a lease we wait for let go. */
void cg_redis_bus_message(redis_store *rs, const char *text);
/* r no longer waits to ask for its lease again (finished). */
void cg_redis_lease_unwait(redis_store *rs, redis_req *r);
/* Computes the scripts' SHA1s (once, at open). */
void cg_redis_scripts_init(void);

/* ---- redis_bus.c ----------------------------------------------------------------------- */

/* What the bus hands a message for this gateway to (cg_redis_bus_message): the bus knows
 * nothing of dialogs. */
typedef void cg_redis_bus_message_fn(redis_store *rs, const char *text);
/* Subscribes to this gateway's channel at url (redis://, a Redis itself, not twemproxy,
 * parsed by cg_redis_parse_url): the bus takes its host and password. */
cg_redis_bus *cg_redis_bus_open(redis_store *rs, cg_redis_url *url, cg_redis_bus_message_fn *to_store);
/* A cluster's bus (redis-cluster:// without redis.bus): sharded pub/sub through the store's
 * router. */
cg_redis_bus *cg_redis_bus_open_sharded(redis_store *rs, cg_redis_bus_message_fn *to_store);
/* Publishes text on the channel of the gateway `holder` (a cancel: "<dialog key> <lease>";
 * cg_redis_bus_message's others); nothing when the bus is down. */
void cg_redis_bus_publish(cg_redis_bus *b, const char *holder, const char *key_and_lease);
void cg_redis_bus_close(cg_redis_bus *b);

#endif
