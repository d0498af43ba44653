/*
 * redis_bus.c: how gateways sharing a Redis store tell each other to stop a reply. A cancel
 * phrase or a context.clear can arrive on gateway B while the dialog's turn streams on
 * gateway A; the dialog's lease names A (its holder id), so B publishes the dialog's key on
 * A's channel, "<prefix>:bus:<holder>", and A stops that turn at once.
 *
 * Pub/sub goes to a Redis directly (twemproxy has no SUBSCRIBE): `redis.bus`, by default the
 * store's own redis:// URL. Two connections on the loop, as a subscribed connection can
 * send nothing else: one SUBSCRIBEd to this gateway's channel, one that PUBLISHes. Each
 * reconnects after a second when it is lost (doubling while it fails, with jitter, so that
 * gateways do not come back in step), and each is probed: a PING every BUS_PROBE_MS, and a
 * connection that leaves one unanswered for redis.command_timeout_ms (a Redis stopped or cut
 * off: the socket stays open) is dropped and made again. A message lost meanwhile is not
 * lost for good: B also sets the dialog's cancel flag, which A's lease renewal reads
 * (redis_dialog.c).
 *
 * In a Redis Cluster (redis-cluster://) the bus is sharded pub/sub, Redis 7's: a channel lives
 * on the master of its slot, so A SSUBSCRIBEs on its own connection to that master (found in
 * the router's map), and B SPUBLISHes through the router, which follows MOVED like any
 * command. A slot that moves unsubscribes A ("sunsubscribe"): A subscribes again where the
 * map now says.
 */
#define _GNU_SOURCE /* asprintf */
#include "chatgate/core/alloc.h"
#include "chatgate/store/redis_client.h"
#include <hiredis/hiredis.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "chatgate/core/log.h"
#include "chatgate/core/net.h"
#include "chatgate/store/redis_internal.h"

#define BUS_RETRY_MS 1000      /* the first retry; doubling to BUS_RETRY_MAX_MS while it fails */
#define BUS_RETRY_MAX_MS 60000
#define BUS_PROBE_MS 5000 /* a PING on each connection this often */
#define BUS_PROBE_TICK_MS 1000 /* how often the answers are looked at */

struct cg_redis_bus {
    redis_store *rs;
    char *host, *user, *password;
    int port;
    char *channel;               /* this gateway's: "<prefix>:bus:<holder>" */
    int sharded;                 /* a cluster's: SSUBSCRIBE at the channel's master, SPUBLISH via the router */
    cg_redis_bus_message_fn *to_store; /* a message for this gateway: the store reads it */
    cg_redis_redirect moved; /* sharded: where a MOVED answer to SSUBSCRIBE said the channel is */
    cg_redis_conn *sub, *pub;
    cg_resolve *resolve;
    uv_timer_t retry;
    uv_timer_t probe;
    uint64_t sub_ping, pub_ping; /* loop ms of the PING each waits for the answer of; 0: none */
    uint64_t pinged;             /* loop ms of the last PINGs sent */
    int handles;  /* the timers not yet closed: freed at 0 */
    int failures; /* in a row, since the last subscription confirmed: the backoff, and one log */
    int closing;
};

static void bus_connect(cg_redis_bus *b);
static void on_message(cg_redis_conn *ac, void *reply_, void *priv);

static void on_retry(uv_timer_t *t)
{
    bus_connect(t->data);
}

/* A connection is gone or never came: once logged per run of failures (a twemproxy URL, which
 * closes a connection that subscribes, would fail every time), retried with a backoff. */
static void bus_lost(cg_redis_bus *b, cg_redis_conn **slot, const char *why)
{
    if (b->failures++ == 0)
        cg_warn("redis bus %s:%d: %s; cancels from other gateways come with the lease renewal meanwhile%s", b->host,
                b->port, why,
                !b->sharded && strcmp(why, "the server closed the connection") == 0
                    ? " (is redis.bus a Redis, not twemproxy, which closes a connection that subscribes?)"
                    : "");
    *slot = NULL;
    uint64_t delay = (uint64_t)BUS_RETRY_MS << (b->failures < 7 ? b->failures - 1 : 6);
    if (b->sharded) /* the cluster's map decides where: it is back as soon as the store is */
        delay = BUS_RETRY_MS;
    delay += (uint64_t)(rand() % (int)(delay / 4 + 1)); /* jitter, so gateways don't reconnect in step */
    if (!b->closing && !uv_is_active((uv_handle_t *)&b->retry))
        uv_timer_start(&b->retry, on_retry, delay < BUS_RETRY_MAX_MS ? delay : BUS_RETRY_MAX_MS, 0);
}

static void on_bus_event(cg_redis_conn *ac, int up, const char *why)
{
    cg_redis_bus *b = cg_redis_conn_data(ac);
    if (up || !b)
        return;
    bus_lost(b, ac == b->sub ? &b->sub : &b->pub, why ? why : "connection lost");
}

/* A message on this gateway's channel: the dialog whose turn must stop, and its lease. */
static void on_message(cg_redis_conn *ac, void *reply_, void *priv)
{
    (void)priv;
    cg_redis_bus *b = cg_redis_conn_data(ac);
    redisReply *r = reply_;
    if (b && r && r->type == REDIS_REPLY_ERROR && ac == b->sub) {
        /* SSUBSCRIBE at a master the map named before the channel's slot moved: -MOVED says
         * where it is now (the router's map may not know yet); anything else, try again */
        if (cg_redis_parse_redirect(r->str, r->len, &b->moved) != CG_REDIRECT_MOVED)
            b->moved.kind = CG_REDIRECT_NONE;
        b->sub = NULL;
        cg_redis_conn_close(ac);
        char why[200];
        snprintf(why, sizeof(why), "subscribing was answered '%.120s'", r->str);
        bus_lost(b, &b->sub, why);
        return;
    }
    if (b && r && ac == b->sub && r->type == REDIS_REPLY_ARRAY && r->elements == 2 &&
        r->element[0]->type == REDIS_REPLY_STRING && strcmp(r->element[0]->str, "pong") == 0) {
        b->sub_ping = 0; /* the probe's PING, answered in the subscribed state */
        return;
    }
    if (!b || !r || r->type != REDIS_REPLY_ARRAY || r->elements != 3 || r->element[0]->type != REDIS_REPLY_STRING)
        return; /* the connection going */
    const char *kind = r->element[0]->str;
    if (strcmp(kind, "subscribe") == 0 || strcmp(kind, "ssubscribe") == 0) {
        if (b->failures)
            cg_info("redis bus %s:%d: listening again", b->host, b->port);
        b->failures = 0;
        return;
    }
    if (strcmp(kind, "sunsubscribe") == 0 && ac == b->sub) { /* its slot moved to another master */
        b->sub = NULL;
        cg_redis_conn_close(ac);
        b->failures = 0;
        bus_lost(b, &b->sub, "the channel's slot moved: subscribing where it is now");
        return;
    }
    if ((strcmp(kind, "message") != 0 && strcmp(kind, "smessage") != 0) || r->element[2]->type != REDIS_REPLY_STRING)
        return;
    b->to_store(b->rs, r->element[2]->str); /* a cancel, a wait or a wake */
}

static cg_redis_conn *bus_open(cg_redis_bus *b, const char *address)
{
    char why[160];
    cg_redis_conn *ac = cg_redis_async_open(b->rs, address, b->port, b->host, b, on_bus_event, why,
                                            sizeof(why));
    if (ac && b->password)
        cg_redis_conn_auth(ac, b->user, b->password, NULL, NULL);
    return ac;
}

static void on_resolved(void *data, const char *address, const char *err)
{
    cg_redis_bus *b = data;
    b->resolve = NULL;
    if (!address) {
        bus_lost(b, &b->sub, err);
        return;
    }
    if (b->sharded) { /* SSUBSCRIBE alone: SPUBLISH goes through the router */
        if ((b->sub = bus_open(b, address))) {
            const char *argv[] = {"SSUBSCRIBE", b->channel};
            size_t len[] = {10, strlen(b->channel)};
            cg_redis_conn_argv(b->sub, on_message, NULL, 2, argv, len);
        } else {
            bus_lost(b, &b->sub, "could not connect");
        }
        return;
    }
    if (!b->sub && (b->sub = bus_open(b, address))) {
        const char *argv[] = {"SUBSCRIBE", b->channel};
        size_t len[] = {9, strlen(b->channel)};
        cg_redis_conn_argv(b->sub, on_message, NULL, 2, argv, len);
    }
    if (!b->pub)
        b->pub = bus_open(b, address);
    if (!b->sub || !b->pub)
        bus_lost(b, b->sub ? &b->pub : &b->sub, "could not connect");
}

/* A cluster's: where the channel's slot lives (its master as the map names it, an address or
 * a host name, or where a MOVED answer to the last SSUBSCRIBE said), for a connection of its
 * own (the router must be up: else the retry comes back later). 0, or -1 (b->host unset). */
static int sharded_target(cg_redis_bus *b)
{
    cg_redis_conn *data = cg_redis_link_conn(b->rs->link, cg_redis_key_slot(b->channel, strlen(b->channel)));
    const char *peer = data ? cg_redis_conn_peer(data) : NULL;
    const char *colon = peer ? strrchr(peer, ':') : NULL;
    const char *host;
    int port;
    if (b->moved.kind == CG_REDIRECT_MOVED) {
        host = b->moved.host;
        port = b->moved.port;
        b->moved.kind = CG_REDIRECT_NONE;
    } else if (colon) {
        host = cg_redis_conn_host(data);
        port = (int)strtol(colon + 1, NULL, 10); /* written by the client: "addr:port" */
    } else {
        return -1;
    }
    char *copy = cg_strdup(host); /* host may be b->host's own text */
    free(b->host);
    b->host = copy;
    b->port = port;
    return 0;
}

static void on_pub_pong(cg_redis_conn *ac, void *reply, void *priv)
{
    (void)priv;
    cg_redis_bus *b = cg_redis_conn_data(ac);
    if (b && reply && ac == b->pub)
        b->pub_ping = 0;
}

/* Each connection's last PING answered within the command timeout, or the connection goes
 * (its event says lost, and it is made again); then a new PING on each. */
static void on_probe(uv_timer_t *t)
{
    cg_redis_bus *b = t->data;
    uint64_t now = uv_now(b->rs->base.loop), limit = (uint64_t)b->rs->base.cfg.command_timeout_ms;
    struct {
        cg_redis_conn **conn;
        uint64_t *ping;
    } each[] = {{&b->sub, &b->sub_ping}, {&b->pub, &b->pub_ping}};
    for (int i = 0; i < 2; i++) {
        cg_redis_conn *c = *each[i].conn;
        if (!c) {
            *each[i].ping = 0;
            continue;
        }
        if (*each[i].ping && now - *each[i].ping > limit) {
            char why[96];
            snprintf(why, sizeof(why), "no answer to PING within %llu ms", (unsigned long long)limit);
            *each[i].conn = NULL;
            *each[i].ping = 0;
            cg_redis_conn_set_data(c, NULL); /* its close calls back no bus */
            cg_redis_conn_close(c);
            bus_lost(b, each[i].conn, why);
            continue;
        }
        if (!*each[i].ping && now - b->pinged >= BUS_PROBE_MS) {
            *each[i].ping = now ? now : 1;
            cg_redis_conn_cmd(c, c == b->sub ? on_message : on_pub_pong, NULL, "PING");
        }
    }
    if (now - b->pinged >= BUS_PROBE_MS)
        b->pinged = now;
}

static void probe_start(cg_redis_bus *b)
{
    uv_timer_init(b->rs->base.loop, &b->probe);
    b->probe.data = b;
    b->handles = 2;
    b->pinged = uv_now(b->rs->base.loop);
    uv_timer_start(&b->probe, on_probe, BUS_PROBE_TICK_MS, BUS_PROBE_TICK_MS);
    uv_unref((uv_handle_t *)&b->probe);
}

static void bus_connect(cg_redis_bus *b)
{
    if (b->closing || b->resolve || (b->sub && (b->pub || b->sharded)))
        return;
    if (b->sharded && sharded_target(b) < 0) {
        bus_lost(b, &b->sub, "the cluster is not connected");
        return;
    }
    b->resolve = cg_resolve_start(b->rs->base.loop, b->host, on_resolved, b);
    if (!b->resolve)
        uv_timer_start(&b->retry, on_retry, BUS_RETRY_MS, 0);
}

/* The URL was checked at open (cg_redis_parse_url, the store's own parser): the database does
 * not matter to pub/sub. */
cg_redis_bus *cg_redis_bus_open(redis_store *rs, cg_redis_url *url, cg_redis_bus_message_fn *to_store)
{
    cg_redis_bus *b = cg_calloc(1, sizeof(*b));
    b->rs = rs;
    b->to_store = to_store;
    b->host = url->host;
    b->user = url->user;
    b->password = url->password;
    b->port = url->port;
    url->host = url->user = url->password = NULL;
    if (asprintf(&b->channel, "%s:bus:%s", rs->base.cfg.prefix, rs->holder) < 0)
        abort(); /* out of memory at startup */
    uv_timer_init(rs->base.loop, &b->retry);
    b->retry.data = b;
    probe_start(b);
    bus_connect(b);
    return b;
}

cg_redis_bus *cg_redis_bus_open_sharded(redis_store *rs, cg_redis_bus_message_fn *to_store)
{
    cg_redis_bus *b = cg_calloc(1, sizeof(*b));
    b->rs = rs;
    b->to_store = to_store;
    b->sharded = 1;
    b->host = cg_strdup(rs->host);
    b->port = rs->port;
    b->user = rs->user ? cg_strdup(rs->user) : NULL; /* AUTH as the store's connections */
    b->password = rs->password ? cg_strdup(rs->password) : NULL;
    if (asprintf(&b->channel, "%s:bus:%s", rs->base.cfg.prefix, rs->holder) < 0)
        abort(); /* out of memory at startup */
    uv_timer_init(rs->base.loop, &b->retry);
    b->retry.data = b;
    probe_start(b);
    uv_timer_start(&b->retry, on_retry, BUS_RETRY_MS, 0); /* once the router is likely up */
    return b;
}

void cg_redis_bus_publish(cg_redis_bus *b, const char *holder, const char *key_and_lease)
{
    char *channel = NULL;
    if (!b || (!b->pub && !b->sharded) || asprintf(&channel, "%s:bus:%s", b->rs->base.cfg.prefix, holder) < 0) {
        free(channel);
        return; /* the cancel flag still reaches the holder's renewal */
    }
    if (b->sharded) { /* through the router, to the channel's master */
        char *cmd = NULL;
        const char *argv[] = {"SPUBLISH", channel, key_and_lease};
        size_t len[] = {8, strlen(channel), strlen(key_and_lease)};
        int n = redisFormatCommandArgv(&cmd, 3, argv, len);
        if (n > 0)
            cg_redis_link_send(b->rs->link, cg_redis_key_slot(channel, len[1]), cmd, (size_t)n, NULL, NULL);
        free(cmd);
        free(channel);
        return;
    }
    const char *argv[] = {"PUBLISH", channel, key_and_lease};
    size_t len[] = {7, strlen(channel), strlen(key_and_lease)};
    cg_redis_conn_argv(b->pub, NULL, NULL, 3, argv, len);
    free(channel);
}

static void on_retry_closed(uv_handle_t *h)
{
    cg_redis_bus *b = h->data;
    if (--b->handles > 0)
        return;
    free(b->host);
    free(b->user);
    free(b->password);
    free(b->channel);
    free(b);
}

void cg_redis_bus_close(cg_redis_bus *b)
{
    if (!b)
        return;
    b->closing = 1;
    if (b->resolve)
        cg_resolve_abandon(b->resolve);
    cg_redis_conn *contexts[] = {b->sub, b->pub};
    b->sub = b->pub = NULL;
    for (int i = 0; i < 2; i++)
        if (contexts[i]) {
            cg_redis_conn_set_data(contexts[i], NULL); /* its callbacks, called from the close, find no bus */
            cg_redis_conn_close(contexts[i]);
        }
    uv_close((uv_handle_t *)&b->retry, on_retry_closed);
    uv_close((uv_handle_t *)&b->probe, on_retry_closed);
}
