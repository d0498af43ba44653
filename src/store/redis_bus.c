/*
 * redis_bus.c: how gateways sharing a Redis store tell each other to stop a reply. A cancel
 * phrase or a context.clear can arrive on gateway B while the dialog's turn streams on
 * gateway A; the dialog's lease names A (its holder id), so B publishes the dialog's key on
 * A's channel, "<prefix>:bus:<holder>", and A stops that turn at once.
 *
 * Pub/sub goes to a Redis directly (twemproxy has no SUBSCRIBE): `redis.bus`, by default the
 * store's own redis:// URL. Two connections on the loop, as a subscribed connection can
 * send nothing else: one SUBSCRIBEd to this gateway's channel, one that PUBLISHes. Each
 * reconnects after a second when it is lost. A message lost meanwhile is not lost for good:
 * B also sets the dialog's cancel flag, which A's lease renewal reads (redis_dialog.c).
 */
#define _GNU_SOURCE /* asprintf */
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

struct cg_redis_bus {
    redis_store *rs;
    char *host, *user, *password;
    int port;
    char *channel;               /* this gateway's: "<prefix>:bus:<holder>" */
    cg_redis_conn *sub, *pub;
    cg_resolve *resolve;
    uv_timer_t retry;
    int failures; /* in a row, since the last subscription confirmed: the backoff, and one log */
    int closing;
};

static void bus_connect(cg_redis_bus *b);

static void on_retry(uv_timer_t *t)
{
    bus_connect(t->data);
}

/* A connection is gone or never came: once logged per run of failures (a twemproxy URL, which
 * closes a connection that subscribes, would fail every time), retried with a backoff. */
static void bus_lost(cg_redis_bus *b, cg_redis_conn **slot, const char *why)
{
    if (b->failures++ == 0)
        cg_warn("redis bus %s:%d: %s; cancels from other gateways come with the lease renewal meanwhile (is "
                "redis.bus a Redis, not twemproxy?)", b->host, b->port, why);
    *slot = NULL;
    uint64_t delay = (uint64_t)BUS_RETRY_MS << (b->failures < 7 ? b->failures - 1 : 6);
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
    if (!b || !r || r->type != REDIS_REPLY_ARRAY || r->elements != 3 || r->element[0]->type != REDIS_REPLY_STRING)
        return; /* the connection going */
    if (strcmp(r->element[0]->str, "subscribe") == 0) {
        if (b->failures)
            cg_info("redis bus %s:%d: listening again", b->host, b->port);
        b->failures = 0;
        return;
    }
    if (strcmp(r->element[0]->str, "message") != 0 || r->element[2]->type != REDIS_REPLY_STRING)
        return;
    cg_redis_cancel_turn(b->rs, r->element[2]->str); /* "<dialog key> <lease>" */
}

static cg_redis_conn *bus_open(cg_redis_bus *b, const char *address)
{
    char why[160];
    cg_redis_conn *ac = cg_redis_async_open(b->rs, address, b->port, b->host, b, on_bus_event, why,
                                            sizeof(why));
    if (ac && b->password)
        cg_redis_send_auth(ac, b->user, b->password, NULL, NULL);
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

static void bus_connect(cg_redis_bus *b)
{
    if (b->closing || b->resolve || (b->sub && b->pub))
        return;
    b->resolve = cg_resolve_start(b->rs->base.loop, b->host, on_resolved, b);
    if (!b->resolve)
        uv_timer_start(&b->retry, on_retry, BUS_RETRY_MS, 0);
}

/* The URL was checked at open (cg_redis_parse_url, the store's own parser): the database does
 * not matter to pub/sub. */
cg_redis_bus *cg_redis_bus_open(redis_store *rs, cg_redis_url *url)
{
    cg_redis_bus *b = calloc(1, sizeof(*b));
    if (!b)
        abort();
    b->rs = rs;
    b->host = url->host;
    b->user = url->user;
    b->password = url->password;
    b->port = url->port;
    url->host = url->user = url->password = NULL;
    if (asprintf(&b->channel, "%s:bus:%s", rs->base.cfg.prefix, rs->holder) < 0)
        abort(); /* out of memory at startup */
    uv_timer_init(rs->base.loop, &b->retry);
    b->retry.data = b;
    bus_connect(b);
    return b;
}

void cg_redis_bus_publish(cg_redis_bus *b, const char *holder, const char *key_and_lease)
{
    char *channel = NULL;
    if (!b || !b->pub || asprintf(&channel, "%s:bus:%s", b->rs->base.cfg.prefix, holder) < 0) {
        free(channel);
        return; /* the cancel flag still reaches the holder's renewal */
    }
    const char *argv[] = {"PUBLISH", channel, key_and_lease};
    size_t len[] = {7, strlen(channel), strlen(key_and_lease)};
    cg_redis_conn_argv(b->pub, NULL, NULL, 3, argv, len);
    free(channel);
}

static void on_retry_closed(uv_handle_t *h)
{
    cg_redis_bus *b = h->data;
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
}
