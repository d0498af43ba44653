/*
 * redis_store.c: the Redis store's life over its link (redis_link.c: the connection, whatever
 * the topology, its probe, timeouts and reconnects): open (the URL) and close, and what the
 * link's going and coming mean to the store. The dialog operations that travel
 * over it (keys, scripts, load, save, remove) are in redis_dialog.c; what the two share is in
 * chatgate/store/redis_internal.h.
 *
 * While Redis is away (the link says down) the store answers "unavailable", and degraded
 * mode (fallback.c, a wrapper in front of any store's dialogs, lease and limits) answers
 * from memory: this file tells it when the link goes and comes. The fallback writes back what it
 * held through the store's merging write-back (cg_redis_send_writeback). What a failover
 * can lose is in docs/state.md.
 */
#define _GNU_SOURCE /* asprintf */
#include <ctype.h>
#include <hiredis/hiredis.h>

#include <openssl/rand.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "chatgate/core/alloc.h"
#include "chatgate/core/log.h"
#include "chatgate/store/store.h"
#include "chatgate/core/net.h"
#include "chatgate/store/redis_internal.h"

/* ---- the link ------------------------------------------------------------------------- */

/* The fallback's write-back of d (a dialog written to memory only): a save, merged with
 * Redis's copy first (another gateway may have written it). */
static int writeback(void *backend, const cg_fallback_dirty *item, cg_dialog *d)
{
    redis_store *rs = backend;
    redis_req *r = cg_redis_req_new_escaped(rs, CG_STORE_SAVE, item->eu, item->er, NULL);
    r->snapshot = cg_malloc(sizeof(*r->snapshot));
    *r->snapshot = *d; /* moved: the request owns it now */
    r->version = item->version;
    r->base_unknown = item->base_unknown;
    cg_redis_send_writeback(rs, r);
    return 0;
}

static const cg_fallback_backend_ops redis_backend = {.writeback = writeback};

/* The link is up: the store uses it, and writes back what it held (moved: Sentinel named
 * another primary, which may lack what the old one took last: those dialogs go again). */
static void on_link_up(void *data, int moved)
{
    redis_store *rs = data;
    cg_fallback_up(rs->fb, moved);
    cg_redis_profiles_writeback(rs); /* during close too (its connect at shutdown): close waits */
    cg_redis_drain_waiting(rs);
}

int cg_redis_send_argv(redis_store *rs, cg_argv *a, cg_redis_reply_fn *fn, void *priv)
{
    size_t len;
    const char *cmd = cg_argv_framed(a, &len);
    int rc = cmd ? cg_redis_link_send(rs->link, a->slot, cmd, len, fn, priv) : -1;
    cg_argv_clear(a);
    return rc == REDIS_OK ? 0 : -1;
}

/* Is the user (escaped) in one of the slots (a bitmap) that failed over? */
static int in_slots(void *ctx, const char *eu)
{
    const unsigned char *slots = ctx;
    unsigned s = cg_redis_key_slot(eu, strlen(eu)); /* the hash tag of every key of the user */
    return slots[s / 8] >> (s % 8) & 1;
}

/* A cluster master's slots went to its promoted replica, which may lack what the old master
 * took last (replication is asynchronous): the dialogs saved in them lately go again. */
static void on_link_failover(void *data, const unsigned char *slots)
{
    redis_store *rs = data;
    cg_fallback_moved(rs->fb, in_slots, (void *)slots);
}

/* The link is down (it reconnects by itself): degraded mode answers from memory meanwhile. */
static void on_link_down(void *data, const char *why)
{
    redis_store *rs = data;
    cg_fallback_down(rs->fb, why);
    cg_redis_drain_waiting(rs); /* "unavailable": from memory now */
}

/* Every 100 ms: the leases held renewed, the dialogs marked while connected sent again. */
static void on_tick(uv_timer_t *t)
{
    redis_store *rs = t->data;
    if (cg_redis_linked(rs)) {
        cg_redis_renew_leases(rs);
        cg_fallback_tick(rs->fb, uv_now(rs->base.loop));
    }
}

/* ---- close -------------------------------------------------------------------------- */

/*
 * How long shutdown waits for the write-back of the dialogs still marked (their turns were
 * answered, and memory holds their only copy) and for the turns' saves in flight (one Redis
 * fails is marked then), Redis down at first included (its connect, redis.connect_timeout_ms
 * at most): each write-back is two round trips (Redis's copy read, the merge written), a
 * newer version goes after the one in flight, one that met another copy merges again, and
 * one Redis refused goes again a second later. Without this wait only the commands in flight
 * had the link's second, and what waited behind them (or for the tick) was lost at exit. 5 s
 * is many rounds at any Redis's pace; with the link's second after it and the drain of
 * replies (shutdown_timeout_s, 10 s), it stays within what the master (shutdown_timeout_s +
 * 10 s) and the systemd unit (TimeoutStopSec=30) give.
 */
#define CLOSE_WRITEBACK_MS 5000
#define CLOSE_POLL_MS 10
/* A profile update Redis failed while close waits goes again at this pace, as a dialog's. */
#define CLOSE_RESEND_MS 1000

/* The last step of close, once the link has closed: the tick goes, and the store with it. */
static void on_link_closed(void *data)
{
    redis_store *rs = data;
    rs->link = NULL;
    uv_close((uv_handle_t *)&rs->tick, cg_redis_handle_closed);
}

static void fallback_closed(void *data)
{
    cg_redis_store_unref(data);
}

/* The write-back is over (why: for the log of what is left): the link closes, waiting for its
 * commands in flight for at most a second (redis_link.c). */
static void close_link(redis_store *rs, const char *why)
{
    uv_timer_stop(&rs->tick);
    cg_fallback_stop_writeback(rs->fb, why);
    if (cg_redis_profiles_unwritten(rs))
        cg_warn("redis %s:%d: stopping with %zu profile update(s) not yet written back (%s)", rs->host, rs->port,
                cg_redis_profiles_unwritten(rs), why);
    if (rs->link)
        cg_redis_link_close(rs->link, on_link_closed);
    else
        on_link_closed(rs);
}

/* What close waits for: the dialogs marked, and the turns' saves in flight (one that fails
 * is marked only when its answer comes, and its turn was answered); the profile updates made
 * while Redis was away, and those sent (memory holds their only copy, as the dialogs'). */
static size_t close_work(redis_store *rs)
{
    return cg_fallback_dirty_count(rs->fb) + cg_fallback_saves_in_flight(rs->fb) + cg_redis_profiles_unwritten(rs);
}

/* Closing, Redis up: the profile updates kept (made while it was away, or failed by it since)
 * go, one round at a time, a second apart (the link's coming up sent the first). */
static void close_send_profiles(redis_store *rs, uint64_t now)
{
    if (rs->profile_updates_sent || !json_object_size(rs->profile_pending) ||
        now < rs->close_profiles_at + CLOSE_RESEND_MS)
        return;
    rs->close_profiles_at = now;
    cg_redis_profiles_writeback(rs);
}

/*
 * Is Redis there for close to wait on (close has work): up, or a connect under way? Down, the
 * link waits out its backoff (up to 5 s), while Redis is often back already (a deploy right
 * after a Redis restart): the marked dialogs were lost at exit then. So the first time close
 * finds it down it asks for a connect at once; coming up, the link writes them back
 * (cg_fallback_up), and close waits on. Once only: a Redis still away (the try failed, or it
 * went away again) ends the wait, as before, rather than retrying until the deadline.
 * Called from the tick only, never from cg_redis_close: lws, destroyed just before the store
 * closes, closes one of its sockets twice (in lws_context_destroy, and again from a handle's
 * close callback at the end of that loop iteration), so a socket opened in between got that
 * number and was closed under the link (libuv aborts on the EBADF).
 */
static int close_reaches_redis(redis_store *rs)
{
    if (cg_redis_linked(rs) || cg_redis_link_connecting(rs->link))
        return 1;
    if (rs->close_tried)
        return 0;
    rs->close_tried = 1;
    cg_info("redis %s:%d: down at shutdown with %zu dialogs and profile updates to write back: connecting now, "
            "not after the backoff",
            rs->host, rs->port, close_work(rs));
    cg_redis_link_connect_now(rs->link);
    return cg_redis_linked(rs) || cg_redis_link_connecting(rs->link);
}

/* The tick while close waits: until nothing is marked or saving, Redis is away, or the
 * deadline. A write-back Redis refused goes again meanwhile, a second after its round. */
static void on_close_tick(uv_timer_t *t)
{
    redis_store *rs = t->data;
    uint64_t now = uv_now(rs->base.loop);
    char why[80];
    if (!close_work(rs)) {
        close_link(rs, "all written back");
    } else if (!close_reaches_redis(rs)) {
        close_link(rs, "Redis is away, tried once more at shutdown");
    } else if (now >= rs->close_deadline) {
        snprintf(why, sizeof(why), "their write-back was not answered within %d s", CLOSE_WRITEBACK_MS / 1000);
        close_link(rs, why);
    } else if (cg_redis_linked(rs)) {
        cg_fallback_tick(rs->fb, now);
        close_send_profiles(rs, now);
    }
}

/*
 * Shutdown: the saves the sessions just made are still on their way, and the dialogs still
 * marked for the write-back go now (cg_fallback_closing; Redis down, once the connect its
 * first tick asks for is up): close waits for both, at most CLOSE_WRITEBACK_MS, on the tick
 * (held by the loop meanwhile, never blocking it); then the link waits for the commands in
 * flight, for at most a second. Redis away (that connect failed), nothing waits: what is
 * marked is lost at exit, and said.
 */
void cg_redis_close(cg_store *st)
{
    redis_store *rs = (redis_store *)st;
    rs->closing = 1;
    cg_redis_drain_waiting(rs); /* "unavailable": their callers are told nothing while closing */
    uv_timer_stop(&rs->tick);
    cg_redis_bus_close(rs->bus);
    rs->bus = NULL;
    cg_fallback_closing(rs->fb, fallback_closed, rs);
    if (!close_work(rs)) {
        close_link(rs, "all written back");
        return;
    }
    rs->close_deadline = uv_now(rs->base.loop) + CLOSE_WRITEBACK_MS;
    uv_ref((uv_handle_t *)&rs->tick); /* the loop runs on for it now */
    uv_timer_start(&rs->tick, on_close_tick, CLOSE_POLL_MS, CLOSE_POLL_MS);
}

/* ---- the store ---------------------------------------------------------------------------- */

/* The jobs' tables are redis_dialog.c's, but for the dialogs, the lease and the limits:
 * degraded mode (fallback.c) stands in front of those, and calls redis_dialog.c's; the
 * store's life is this file's. */
static const cg_store_ops redis_ops = {
    .name = "redis",
    .dialogs = &cg_fallback_dialog_ops,
    .lease = &cg_fallback_lease_ops,
    .limits = &cg_fallback_limit_ops,
    .profiles = &cg_redis_profile_ops,
    .bus = &cg_redis_bus_ops,
    .replies = &cg_redis_reply_ops,
    .stream = &cg_redis_stream_ops,
    .close = cg_redis_close,
};

/* ---- open --------------------------------------------------------------------------- */

/* The percent-decoded copy of [s, end) ("%40" for '@'), malloc'd; *len its length. */
static char *url_decode(const char *s, const char *end, size_t *len)
{
    char *out = cg_malloc((size_t)(end - s) + 1), *p = out;
    for (const char *c = s; c < end; c++) {
        unsigned int byte;
        if (*c == '%' && end - c > 2 && sscanf(c + 1, "%2x", &byte) == 1) {
            *p++ = (char)byte;
            c += 2;
        } else {
            *p++ = *c;
        }
    }
    *p = 0;
    *len = (size_t)(p - out);
    return out;
}

/* The "[[USER]:PASSWORD@]" after the scheme at p: sets *user and *password (NULL: none) and
 * returns where the hosts begin (NULL with err on a bad one); *shown is what errors may quote
 * (never the user or the password). A user is an ACL user (AUTH USER PASSWORD, Redis 6). */
static const char *parse_userinfo(char **user, char **password, const char *url, const char *p, const char **shown,
                                  char *err, size_t errlen)
{
    const char *at = strchr(p, '@');
    *shown = at ? at + 1 : url;
    if (!at)
        return p;
    const char *colon = memchr(p, ':', (size_t)(at - p));
    const char *pw = colon ? colon + 1 : p;
    size_t len;
    if (colon && colon > p) {
        *user = url_decode(p, colon, &len);
        if (strlen(*user) != len || strpbrk(*user, " \r\n")) {
            snprintf(err, errlen, "'...@%s': the user holds %%00, a space or a line break", *shown);
            return NULL;
        }
    }
    *password = url_decode(pw, at, &len);
    if (strlen(*password) != len) {
        snprintf(err, errlen, "'...@%s': the password holds %%00", *shown);
        return NULL;
    }
    if (!len) {
        free(*password);
        *password = NULL;
        if (*user) {
            snprintf(err, errlen, "'...@%s': an ACL user needs its password (USER:PASSWORD@)", *shown);
            return NULL;
        }
    }
    return at + 1;
}

/* "/DB" or "": 0 to 15, into *db. */
static int parse_db(int *db_out, const char *s, const char *shown, char *err, size_t errlen)
{
    if (!*s)
        return 0;
    char *e;
    long db = strtol(s, &e, 10);
    if (*e || db < 0 || db > 15 || e == s) {
        snprintf(err, errlen, "'%s': the database must be a number from 0 to 15", shown);
        return -1;
    }
    *db_out = (int)db;
    return 0;
}

#define SENTINEL_USAGE "(redis[s]-sentinel://[[USER]:PASSWORD@]HOST:PORT[,HOST:PORT...]/MASTER[/DB])"
#define SENTINELS_MAX 16

/* "HOST[:PORT][,HOST[:PORT]...]" in [p, end): at most SENTINELS_MAX, each port default_port
 * unless given; what names one in errors ("Sentinel 2: no host"). */
static int parse_hosts(const char *p, const char *end_all, char ***hosts, int **ports, int *n_out, int default_port,
                       const char *what, const char *usage, const char *shown, char *err, size_t errlen)
{
    *hosts = cg_calloc(SENTINELS_MAX, sizeof(char *));
    *ports = cg_calloc(SENTINELS_MAX, sizeof(int));
    for (const char *h = p; h < end_all;) {
        const char *comma = memchr(h, ',', (size_t)(end_all - h));
        const char *end = comma ? comma : end_all;
        const char *colon = memchr(h, ':', (size_t)(end - h));
        const char *host_end = colon ? colon : end;
        int n = *n_out + 1;
        if (n > SENTINELS_MAX) {
            snprintf(err, errlen, "'%s': more than %d %s hosts", shown, SENTINELS_MAX, what);
            return -1;
        }
        if (host_end == h || host_end - h > 253) {
            snprintf(err, errlen, "'%s': %s %d: %s %s", shown, what, n,
                     host_end == h ? "no host" : "the host is longer than 253 bytes", usage);
            return -1;
        }
        long port = default_port;
        if (colon) {
            char *e;
            port = strtol(colon + 1, &e, 10);
            if (e != end || e == colon + 1 || port < 1 || port > 65535) {
                snprintf(err, errlen, "'%s': %s %d: the port must be 1 to 65535", shown, what, n);
                return -1;
            }
        }
        if (asprintf(&(*hosts)[*n_out], "%.*s", (int)(host_end - h), h) < 0)
            abort();
        (*ports)[(*n_out)++] = (int)port;
        if (comma && comma + 1 == end_all) {
            snprintf(err, errlen, "'%s': %s %d: no host %s", shown, what, n + 1, usage);
            return -1;
        }
        h = comma ? comma + 1 : end_all;
    }
    return 0;
}

#define CLUSTER_USAGE "(redis[s]-cluster://[[USER]:PASSWORD@]HOST:PORT[,HOST:PORT...])"

/*
 * redis-cluster://[[user]:password@]host[:port][,host[:port]...]: seeds, any nodes of the
 * cluster (port 6379 unless given), asked in turn for the slot map. A cluster has only
 * database 0: no path.
 */
static int parse_cluster_url(redis_store *rs, const char *url, char *err, size_t errlen)
{
    const char *shown;
    const char *p = parse_userinfo(&rs->user, &rs->password, url, strstr(url, "://") + 3, &shown, err, errlen);
    if (!p)
        return -1;
    const char *end = p + strcspn(p, "/?");
    if (*end) {
        snprintf(err, errlen, "'%s': a cluster has no database or options in its URL %s", shown, CLUSTER_USAGE);
        return -1;
    }
    if (end == p) {
        snprintf(err, errlen, "'%s': no seed host %s", shown, CLUSTER_USAGE);
        return -1;
    }
    if (parse_hosts(p, end, &rs->seed_hosts, &rs->seed_ports, &rs->n_seeds, 6379, "seed", CLUSTER_USAGE, shown, err,
                    errlen) < 0)
        return -1;
    rs->host = cg_strdup(rs->seed_hosts[0]); /* in the log: the first seed */
    rs->port = rs->seed_ports[0];
    return 0;
}

/*
 * redis-sentinel://[:password@]host[:port][,host[:port]...]/master[/db]: the Sentinels
 * (port 26379 unless given), the master's name as they monitor it, the database. The
 * password is the data nodes' (AUTH); the Sentinels are asked without one.
 */
static int parse_sentinel_url(redis_store *rs, const char *url, char *err, size_t errlen)
{
    const char *shown;
    const char *p = parse_userinfo(&rs->user, &rs->password, url, strstr(url, "://") + 3, &shown, err, errlen);
    if (!p)
        return -1;
    const char *slash = strchr(p, '/');
    const char *hosts_end = slash ? slash : p + strlen(p);
    if (hosts_end == p) {
        snprintf(err, errlen, "'%s': no Sentinel host %s", shown, SENTINEL_USAGE);
        return -1;
    }
    if (parse_hosts(p, hosts_end, &rs->sentinel_hosts, &rs->sentinel_ports, &rs->n_sentinels, 26379, "Sentinel",
                    SENTINEL_USAGE, shown, err, errlen) < 0)
        return -1;
    const char *name = slash ? slash + 1 : hosts_end;
    const char *name_end = name + strcspn(name, "/");
    if (name_end == name) {
        snprintf(err, errlen, "'%s': no master name %s", shown, SENTINEL_USAGE);
        return -1;
    }
    /* the name travels in +switch-master's space-separated text, and in logs */
    if (name_end - name > 128 || strspn(name, "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789._-") <
                                     (size_t)(name_end - name)) {
        snprintf(err, errlen, "'%s': the master name must be 1 to 128 of A-Z a-z 0-9 . _ -", shown);
        return -1;
    }
    if (asprintf(&rs->master, "%.*s", (int)(name_end - name), name) < 0)
        abort();
    if (parse_db(&rs->db, *name_end ? name_end + 1 : "", shown, err, errlen) < 0)
        return -1;
    rs->host = cg_strdup(rs->master); /* in the log until a Sentinel names the primary */
    rs->port = 0;
    return 0;
}

int cg_redis_parse_url(const char *url, cg_redis_url *u, char *err, size_t errlen)
{
    memset(u, 0, sizeof(*u));
    if (strncmp(url, "redis://", 8) != 0 && strncmp(url, "rediss://", 9) != 0) {
        snprintf(err, errlen, "must be redis[s]://[[USER]:PASSWORD@]HOST[:PORT][/DB]");
        return -1;
    }
    u->tls = url[5] == 's';
    const char *shown;
    const char *p = parse_userinfo(&u->user, &u->password, url, strstr(url, "://") + 3, &shown, err, errlen);
    if (!p)
        return -1;
    const char *slash = strchr(p, '/');
    const char *end = slash ? slash : p + strlen(p);
    const char *colon = memchr(p, ':', (size_t)(end - p));
    const char *host_end = colon ? colon : end;
    if (host_end == p || host_end - p > 253) {
        snprintf(err, errlen, "'%s': %s (redis://HOST:PORT[/DB])", shown,
                 host_end == p ? "no host" : "the host is longer than 253 bytes");
        return -1;
    }
    if (asprintf(&u->host, "%.*s", (int)(host_end - p), p) < 0)
        abort();
    u->port = 6379;
    if (colon) {
        char *e;
        long port = strtol(colon + 1, &e, 10);
        if (e != end || port < 1 || port > 65535) {
            snprintf(err, errlen, "'%s': the port must be 1 to 65535", shown);
            return -1;
        }
        u->port = (int)port;
    }
    return parse_db(&u->db, slash ? slash + 1 : "", shown, err, errlen);
}

/* The store's URL: redis[s]-sentinel:// or redis[s]:// (errors never quote the user or the
 * password); what it parsed is rs's either way, freed with it. */
static int parse_url(redis_store *rs, const char *url, char *err, size_t errlen)
{
    if (strncmp(url, "redis-sentinel://", 17) == 0 || strncmp(url, "rediss-sentinel://", 18) == 0)
        return parse_sentinel_url(rs, url, err, errlen);
    if (strncmp(url, "redis-cluster://", 16) == 0 || strncmp(url, "rediss-cluster://", 17) == 0)
        return parse_cluster_url(rs, url, err, errlen);
    cg_redis_url u;
    int rc = cg_redis_parse_url(url, &u, err, errlen);
    rs->host = u.host;
    rs->user = u.user;
    rs->password = u.password;
    rs->port = u.port;
    rs->db = u.db;
    return rc;
}

/* Who holds a lease this store takes: the host, the process and a random part (a process
 * restarted with the same pid is another holder). Shown to whoever waits for the lease. */
static void lease_holder_id(redis_store *rs)
{
    char host[24] = "";
    unsigned char rnd[4] = {0};
    gethostname(host, sizeof(host) - 1);
    /* letters, digits, '.', ':', '-' and '_' only: one word of UTF-8 with no '#' (a lock is
     * the ticket "<holder>#<n>", "-" before it once let go), which no '-' begins */
    for (char *p = host; *p; p++)
        if (!(isalnum((unsigned char)*p) || strchr(".:_-", *p)) || (p == host && *p == '-'))
            *p = '_';
    if (RAND_bytes(rnd, sizeof(rnd)) != 1)
        abort();
    snprintf(rs->holder, sizeof(rs->holder), "%s:%ld:%02x%02x%02x%02x", host[0] ? host : "gw", (long)getpid(), rnd[0],
             rnd[1], rnd[2], rnd[3]);
}

cg_store *cg_store_redis_open(uv_loop_t *loop, const cg_store_config *cfg, char *err, size_t errlen)
{
    redis_store *rs = cg_calloc(1, sizeof(*rs));
    /* the bus: redis.bus, else the store's own URL when it is a Redis (not Sentinel's) */
    const char *bus_url = cfg->bus_url && *cfg->bus_url                                          ? cfg->bus_url
                          : strncmp(cfg->url, "redis://", 8) == 0 || strncmp(cfg->url, "rediss://", 9) == 0 ? cfg->url
                                                                                                            : NULL;
    cg_redis_url bus = {0};
    char why[200] = "";
    if (parse_url(rs, cfg->url, err, errlen) < 0 ||
        (bus_url && cg_redis_parse_url(bus_url, &bus, why, sizeof(why)) < 0)) {
        if (why[0])
            snprintf(err, errlen, "redis.bus: %s", why);
        free(bus.host);
        free(bus.user);
        free(bus.password);
        cg_redis_store_free(rs);
        return NULL;
    }
    /* one TLS context for both, each using it when its own URL asks for TLS */
    int store_tls = strncmp(cfg->url, "rediss", 6) == 0;
    rs->bus_tls = bus_url ? bus.tls : store_tls;
    if (store_tls || rs->bus_tls) {
        cg_redis_tls_config tc = {cfg->tls.ca_file, cfg->tls.cert_file, cfg->tls.key_file, cfg->tls.server_name,
                                  !cfg->tls.no_verify};
        if (!(rs->tls = cg_redis_tls_new(&tc, err, errlen))) {
            free(bus.host);
            free(bus.user);
            free(bus.password);
            cg_redis_store_free(rs);
            return NULL;
        }
    }
    rs->base.ops = &redis_ops;
    rs->base.loop = loop;
    rs->base.cfg = *cfg;
    rs->base.now = cg_store_default_now;
    char name[96];
    snprintf(name, sizeof(name), "redis %s:%d", rs->host, rs->port);
    static const cg_fallback_inner inner = {&cg_redis_dialog_ops, &cg_redis_lease_ops, &cg_redis_limit_ops};
    rs->fb = cg_fallback_new(&rs->base, name, &inner, &redis_backend, rs);
    rs->leases = json_object();
    rs->saving = json_object();
    rs->save_next = json_object();
    rs->wake_on_release = json_object();
    rs->profiles = cg_profiles_new(cfg->max_dialogs);
    rs->profile_pending = json_object();
    cg_redis_scripts_init();
    lease_holder_id(rs);
    if (!rs->leases || !rs->saving || !rs->save_next || !rs->wake_on_release)
        abort(); /* out of memory at startup */
    uv_timer_init(loop, &rs->tick);
    rs->tick.data = rs;
    rs->handles = 2; /* the tick, and the fallback's timer */
    uv_timer_start(&rs->tick, on_tick, 100, 100);
    uv_unref((uv_handle_t *)&rs->tick);
    cg_redis_link_config lc = {
        .loop = loop,
        .flush = cfg->flush,
        .tls = store_tls ? rs->tls : NULL,
        .host = rs->master ? NULL : rs->host,
        .port = rs->port,
        .db = rs->db,
        .master = rs->master,
        .sentinel_hosts = rs->sentinel_hosts, /* the link's now */
        .sentinel_ports = rs->sentinel_ports,
        .n_sentinels = rs->n_sentinels,
        .seed_hosts = rs->seed_hosts,
        .seed_ports = rs->seed_ports,
        .n_seeds = rs->n_seeds,
        .user = rs->user,
        .password = rs->password,
        .connect_timeout_ms = cfg->connect_timeout_ms,
        .command_timeout_ms = cfg->command_timeout_ms,
        .on_up = on_link_up,
        .on_down = on_link_down,
        .on_failover = on_link_failover,
        .data = rs,
        .stats = &rs->base.stats,
    };
    rs->sentinel_hosts = NULL;
    rs->sentinel_ports = NULL;
    rs->n_sentinels = 0;
    if (!(rs->link = cg_redis_link_open(&lc)))
        abort(); /* out of memory at startup */
    if (bus_url)
        rs->bus = cg_redis_bus_open(rs, &bus, cg_redis_bus_message);
    else if (rs->n_seeds)
        rs->bus = cg_redis_bus_open_sharded(rs, cg_redis_bus_message);
    else
        cg_info("redis: no redis.bus for a Sentinel store: cancels between gateways come with the lease renewal");
    return &rs->base;
}
