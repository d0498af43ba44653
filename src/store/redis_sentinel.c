/*
 * redis_sentinel.c: asking Redis Sentinel for the primary, and following its failovers
 * (redis_sentinel.h).
 *
 * A question goes to one Sentinel at a time: resolve its host off the loop, connect, send
 * SENTINEL get-master-addr-by-name, all within the timeout (ask_timer). A Sentinel that
 * fails (no answer, an error, "no such master", a malformed answer) passes the question to
 * the next; when each has failed in this round, on_answer says why the last did. The
 * subscription to +switch-master is a connection of its own, on one Sentinel, moved to the
 * next a second after it is lost (sub_timer bounds its connect too).
 *
 * Ownership: the module owns its connections, timers and host list; close gives up both
 * connections at once (their callbacks see another connection, and do nothing) and frees
 * the module when the two timers' handles have closed.
 */
#define _GNU_SOURCE /* asprintf */
#include "chatgate/core/alloc.h"
#include "chatgate/store/redis_sentinel.h"

#include <hiredis/hiredis.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "chatgate/core/log.h"
#include "chatgate/core/net.h"

#define SUB_RETRY_MS 1000

struct cg_redis_sentinel {
    cg_redis_sentinel_config cfg; /* its master a copy of ours */
    int at, tries;                /* the Sentinel asked now (the last that answered), and how many this round */
    int quiet;
    cg_resolve *resolve;          /* the question's */
    cg_redis_conn *ask;
    uv_timer_t ask_timer;         /* the question's start (0 ms: from the loop) and its timeout */
    int sub_at, sub_ok;
    cg_resolve *sub_resolve;
    cg_redis_conn *sub;
    uv_timer_t sub_timer;         /* the subscription's connect timeout, then its retry */
    int closing, handles;
};

static void ask_next(cg_redis_sentinel *sn);
static void sub_start(cg_redis_sentinel *sn);

/* Gives up a side connection's name lookup and connection, whichever exist (its callbacks
 * then see another connection). */
static void side_abandon(cg_resolve **resolve, cg_redis_conn **c)
{
    if (*resolve) {
        cg_resolve_abandon(*resolve);
        *resolve = NULL;
    }
    if (*c) {
        cg_redis_conn *conn = *c;
        *c = NULL;
        cg_redis_conn_close(conn); /* deferred when inside one of its reply callbacks */
    }
}

/* A connection to Sentinel i at its resolved address, with the module as its data; NULL with
 * why filled when it could not start. */
static cg_redis_conn *sentinel_conn(cg_redis_sentinel *sn, int i, const char *address, cg_redis_event_fn *on_event,
                                    char *why, size_t whylen)
{
    return cg_redis_conn_open(sn->cfg.loop, address, sn->cfg.ports[i], sn->cfg.hosts[i], sn->cfg.tls, sn->cfg.flush, sn,
                              on_event, why, whylen);
}

/* ---- asking for the primary ------------------------------------------------------------ */

void cg_redis_sentinel_abort(cg_redis_sentinel *sn)
{
    if (!sn)
        return;
    side_abandon(&sn->resolve, &sn->ask);
    uv_timer_stop(&sn->ask_timer);
}

/* The Sentinel asked did not name the primary: the next one is asked; when each has failed
 * in this round, on_answer says so. */
static void ask_failed(cg_redis_sentinel *sn, const char *why)
{
    int i = sn->at;
    if (sn->quiet)
        cg_debug("redis sentinel %s:%d: %s", sn->cfg.hosts[i], sn->cfg.ports[i], why);
    else
        cg_warn("redis sentinel %s:%d: %s", sn->cfg.hosts[i], sn->cfg.ports[i], why);
    cg_redis_sentinel_abort(sn);
    sn->at = (i + 1) % sn->cfg.n;
    if (++sn->tries < sn->cfg.n) {
        ask_next(sn);
        return;
    }
    char msg[300];
    snprintf(msg, sizeof(msg), "none of the %d Sentinels named the primary of '%s' (the last: %.150s)", sn->cfg.n,
             sn->cfg.master, why);
    sn->cfg.on_answer(sn->cfg.data, NULL, 0, msg);
}

static void on_ask_reply(cg_redis_conn *c, void *reply_, void *priv)
{
    cg_redis_sentinel *sn = priv;
    redisReply *reply = reply_;
    if (c != sn->ask)
        return; /* given up */
    if (!reply) {
        sn->ask = NULL; /* it is closing: the connection failed or closed */
        ask_failed(sn, cg_redis_conn_error(c));
        return;
    }
    char why[200];
    if (reply->type == REDIS_REPLY_ERROR) {
        snprintf(why, sizeof(why), "SENTINEL get-master-addr-by-name was answered '%.120s'", reply->str);
        ask_failed(sn, why);
        return;
    }
    if (reply->type == REDIS_REPLY_NIL) {
        snprintf(why, sizeof(why), "it does not monitor a master named '%.100s'", sn->cfg.master);
        ask_failed(sn, why);
        return;
    }
    char *end = NULL;
    long port = 0;
    if (reply->type == REDIS_REPLY_ARRAY && reply->elements == 2 && reply->element[0]->type == REDIS_REPLY_STRING &&
        reply->element[1]->type == REDIS_REPLY_STRING && reply->element[0]->len > 0 &&
        reply->element[0]->len <= 253)
        port = strtol(reply->element[1]->str, &end, 10);
    if (!end || *end || port < 1 || port > 65535) {
        ask_failed(sn, "SENTINEL get-master-addr-by-name: unexpected answer");
        return;
    }
    char *host = cg_strdup(reply->element[0]->str);
    cg_redis_sentinel_abort(sn); /* the connection closes after this callback */
    sn->cfg.on_answer(sn->cfg.data, host, (int)port, NULL);
    free(host);
}

static void on_ask_event(cg_redis_conn *c, int up, const char *why)
{
    cg_redis_sentinel *sn = cg_redis_conn_data(c);
    if (c != sn->ask || up)
        return;
    sn->ask = NULL; /* it frees itself after this callback */
    ask_failed(sn, why ? why : "the connection closed before the answer");
}

static void on_ask_resolved(void *data, const char *address, const char *err)
{
    cg_redis_sentinel *sn = data;
    sn->resolve = NULL;
    char why[160];
    cg_redis_conn *c = address ? sentinel_conn(sn, sn->at, address, on_ask_event, why, sizeof(why)) : NULL;
    if (!c) {
        ask_failed(sn, address ? why : err);
        return;
    }
    sn->ask = c;
    /* queued until the connection is up; the question's timer bounds connect and answer */
    cg_redis_conn_cmd(c, on_ask_reply, sn, "SENTINEL get-master-addr-by-name %s", sn->cfg.master);
}

static void on_ask_timeout(uv_timer_t *t)
{
    ask_failed(t->data, "no answer within redis.connect_timeout_ms");
}

/* Asks sn->at, within the timeout. */
static void ask_next(cg_redis_sentinel *sn)
{
    uv_update_time(sn->cfg.loop);
    uv_timer_start(&sn->ask_timer, on_ask_timeout, (uint64_t)sn->cfg.timeout_ms, 0);
    sn->resolve = cg_resolve_start(sn->cfg.loop, sn->cfg.hosts[sn->at], on_ask_resolved, sn);
    if (!sn->resolve)
        ask_failed(sn, "could not start resolving the host");
}

static void on_ask_start(uv_timer_t *t)
{
    ask_next(t->data);
}

void cg_redis_sentinel_ask(cg_redis_sentinel *sn, int quiet)
{
    if (sn->closing)
        return;
    cg_redis_sentinel_abort(sn);
    sn->quiet = quiet;
    sn->tries = 0;
    uv_timer_start(&sn->ask_timer, on_ask_start, 0, 0); /* from the loop: never an answer inside ask */
}

/* ---- following a failover (+switch-master) --------------------------------------------- */

static void on_sub_timer(uv_timer_t *t);

/* The subscription is gone (or never came): the next Sentinel is tried in a second. A
 * failover meanwhile is still followed by the store: the old primary closes its connection
 * or answers -READONLY, and the probe's ROLE refuses it. */
static void sub_lost(cg_redis_sentinel *sn, const char *why)
{
    int i = sn->sub_at;
    if (sn->sub_ok)
        cg_warn("redis sentinel %s:%d: the +switch-master subscription was lost (%s); trying the next Sentinel",
                sn->cfg.hosts[i], sn->cfg.ports[i], why);
    else
        cg_debug("redis sentinel %s:%d: could not subscribe to +switch-master: %s", sn->cfg.hosts[i], sn->cfg.ports[i],
                 why);
    sn->sub_ok = 0;
    side_abandon(&sn->sub_resolve, &sn->sub);
    sn->sub_at = (i + 1) % sn->cfg.n;
    if (!sn->closing)
        uv_timer_start(&sn->sub_timer, on_sub_timer, SUB_RETRY_MS, 0);
}

static void on_sub_timer(uv_timer_t *t)
{
    cg_redis_sentinel *sn = t->data;
    if (sn->sub || sn->sub_resolve) { /* the connect timeout: not subscribed in time */
        sub_lost(sn, "no answer to SUBSCRIBE within redis.connect_timeout_ms");
        return;
    }
    sub_start(sn);
}

static void on_sub_message(cg_redis_conn *c, void *reply_, void *priv)
{
    cg_redis_sentinel *sn = priv;
    redisReply *reply = reply_;
    if (c != sn->sub || !reply)
        return; /* given up, or closing (on_sub_event follows) */
    if (reply->type != REDIS_REPLY_ARRAY || reply->elements != 3 || reply->element[0]->type != REDIS_REPLY_STRING)
        return;
    if (strcmp(reply->element[0]->str, "subscribe") == 0) {
        sn->sub_ok = 1;
        uv_timer_stop(&sn->sub_timer);
        cg_info("redis sentinel %s:%d: following failovers of '%s' (+switch-master)", sn->cfg.hosts[sn->sub_at],
                sn->cfg.ports[sn->sub_at], sn->cfg.master);
        return;
    }
    if (strcmp(reply->element[0]->str, "message") != 0 || reply->element[2]->type != REDIS_REPLY_STRING)
        return;
    /* "<master> <old ip> <old port> <new ip> <new port>" */
    char name[256], old_host[256], new_host[256];
    int old_port, new_port;
    if (sscanf(reply->element[2]->str, "%255s %255s %5d %255s %5d", name, old_host, &old_port, new_host, &new_port) != 5 ||
        new_port < 1 || new_port > 65535 || strcmp(name, sn->cfg.master) != 0)
        return;
    char said[300];
    snprintf(said, sizeof(said), "%s:%d", sn->cfg.hosts[sn->sub_at], sn->cfg.ports[sn->sub_at]);
    sn->cfg.on_switch(sn->cfg.data, new_host, new_port, said);
}

static void on_sub_event(cg_redis_conn *c, int up, const char *why)
{
    cg_redis_sentinel *sn = cg_redis_conn_data(c);
    if (c != sn->sub || up)
        return;
    sn->sub = NULL; /* it frees itself after this callback */
    sub_lost(sn, why ? why : "the connection closed");
}

static void on_sub_resolved(void *data, const char *address, const char *err)
{
    cg_redis_sentinel *sn = data;
    sn->sub_resolve = NULL;
    char why[160];
    cg_redis_conn *c = address ? sentinel_conn(sn, sn->sub_at, address, on_sub_event, why, sizeof(why)) : NULL;
    if (!c) {
        sub_lost(sn, address ? why : err);
        return;
    }
    sn->sub = c;
    cg_redis_conn_cmd(c, on_sub_message, sn, "SUBSCRIBE +switch-master");
}

/* Subscribes on sn->sub_at, within the timeout (sub_timer). */
static void sub_start(cg_redis_sentinel *sn)
{
    if (sn->closing)
        return;
    uv_update_time(sn->cfg.loop);
    uv_timer_start(&sn->sub_timer, on_sub_timer, (uint64_t)sn->cfg.timeout_ms, 0);
    sn->sub_resolve = cg_resolve_start(sn->cfg.loop, sn->cfg.hosts[sn->sub_at], on_sub_resolved, sn);
    if (!sn->sub_resolve)
        sub_lost(sn, "could not start resolving the host");
}

/* ---- life -------------------------------------------------------------------------------- */

cg_redis_sentinel *cg_redis_sentinel_open(const cg_redis_sentinel_config *cfg)
{
    cg_redis_sentinel *sn = cg_calloc(1, sizeof(*sn));
    sn->cfg = *cfg;
    sn->cfg.master = cg_strdup(cfg->master);
    uv_timer_init(cfg->loop, &sn->ask_timer);
    uv_timer_init(cfg->loop, &sn->sub_timer);
    sn->ask_timer.data = sn->sub_timer.data = sn;
    sn->handles = 2;
    sub_start(sn);
    return sn;
}

static void on_timer_closed(uv_handle_t *h)
{
    cg_redis_sentinel *sn = h->data;
    if (--sn->handles > 0)
        return;
    for (int i = 0; i < sn->cfg.n; i++)
        free(sn->cfg.hosts[i]);
    free(sn->cfg.hosts);
    free(sn->cfg.ports);
    free((char *)sn->cfg.master);
    free(sn);
}

void cg_redis_sentinel_close(cg_redis_sentinel *sn)
{
    if (!sn || sn->closing)
        return;
    sn->closing = 1;
    cg_redis_sentinel_abort(sn);
    side_abandon(&sn->sub_resolve, &sn->sub);
    uv_close((uv_handle_t *)&sn->ask_timer, on_timer_closed);
    uv_close((uv_handle_t *)&sn->sub_timer, on_timer_closed);
}
