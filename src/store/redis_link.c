/*
 * redis_link.c: the store's Redis, whatever its topology (redis_link.h).
 *
 * Life: CLOSED (waiting for the backoff) -> ASKING (Sentinel: which node is the primary?)
 * -> RESOLVING -> CONNECTING -> PROBING (AUTH, SELECT, PING, and ROLE with Sentinel) -> UP;
 * a cluster goes from CONNECTING to UP when its router says so. Any failure goes back to
 * CLOSED: the connection (or the router) is closed, which answers every command in flight
 * with NULL, on_down says why, and a reconnect is due after 0.1, 0.2, 0.5, 1, 2, then 5 s
 * (0.5 s at most for a cluster), plus up to a quarter of jitter.
 *
 * Every command goes through the in-flight list, oldest first, with its time sent: the tick
 * fails the link when the oldest has waited command_timeout_ms (Redis stopped with SIGSTOP
 * keeps its socket open and answers nothing). A script command keeps its text until its
 * answer, for the one EVAL after NOSCRIPT (a restart, a failover, SCRIPT FLUSH, a new shard
 * behind twemproxy, another master of a cluster: each node loads scripts for itself).
 *
 * Ownership: the link owns its connection (or router), its Sentinel module, its timers and
 * the commands in flight; it is freed once its timers' handles have closed.
 */
#define _GNU_SOURCE /* asprintf */
#include "chatgate/core/alloc.h"
#include "chatgate/store/redis_link.h"

#include <hiredis/hiredis.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "chatgate/core/log.h"
#include "chatgate/core/net.h"
#include "chatgate/store/redis_cluster.h"
#include "chatgate/store/redis_sentinel.h"

typedef enum { L_CLOSED, L_ASKING, L_RESOLVING, L_CONNECTING, L_PROBING, L_UP } link_state;

typedef struct link_cmd {
    cg_redis_link *ln;
    cg_redis_reply_fn *cb; /* the caller's (or the probe's), NULL: none */
    void *priv;
    uint64_t sent_at;
    unsigned slot;
    const char *script;    /* a script command: its text for the EVAL after NOSCRIPT (static) */
    size_t len;            /* and the command itself, kept in cmd until the answer */
    struct link_cmd *prev, *next;
    char cmd[];
} link_cmd;

struct cg_redis_link {
    cg_redis_link_config cfg;
    link_state state;
    char *host;          /* the node connected to: the URL's, or the primary Sentinel named */
    int port;
    char name[300];      /* "host:port", for logs */
    char *address;       /* the address last connected to, for the log */
    int address_port;
    char *primary;       /* Sentinel: "host:port" of the last primary trusted */
    cg_resolve *resolve;
    cg_redis_conn *conn;
    cg_redis_cluster *cluster;
    cg_redis_sentinel *sentinel;
    const char *setup_failed; /* "AUTH" or "SELECT" failed on this connection */
    uv_timer_t timer;    /* the connect timeout, then the backoff; at close, the deadline */
    uv_timer_t tick;
    int backoff, ever_up;
    link_cmd *head, *tail;
    int pending;
    int closing, handles;
    void (*closed)(void *data);
};

static void link_connect(cg_redis_link *ln);
static void resolve_and_connect(cg_redis_link *ln);

static uint64_t now_ms(cg_redis_link *ln)
{
    return uv_now(ln->cfg.loop);
}

static void set_name(cg_redis_link *ln)
{
    snprintf(ln->name, sizeof(ln->name), "%s:%d", ln->host, ln->port);
}

const char *cg_redis_link_name(const cg_redis_link *ln)
{
    return ln->name;
}

int cg_redis_link_up(const cg_redis_link *ln)
{
    /* closing, an up link drains until its deadline: what requests in flight still send (a
     * save's merge, a lease let go) goes too; the store takes no new request meanwhile */
    return ln && ln->state == L_UP;
}

int cg_redis_link_connecting(const cg_redis_link *ln)
{
    return ln && ln->state != L_CLOSED && ln->state != L_UP;
}

int cg_redis_link_pending(const cg_redis_link *ln)
{
    return ln ? ln->pending : 0;
}

/* ---- commands and their in-flight list ------------------------------------------------- */

static void cmd_unlink(link_cmd *k)
{
    cg_redis_link *ln = k->ln;
    if (k->prev)
        k->prev->next = k->next;
    else
        ln->head = k->next;
    if (k->next)
        k->next->prev = k->prev;
    else
        ln->tail = k->prev;
    ln->pending--;
}

static void cmd_free(link_cmd *k)
{
    free(k);
}

static int send_on_wire(cg_redis_link *ln, link_cmd *k, const char *cmd, size_t len);

/* "EVALSHA <sha> rest" as "EVAL <text> rest": the command's first two arguments replaced. */
static char *as_eval(const link_cmd *k, size_t *len)
{
    const char *p = k->cmd, *end = k->cmd + k->len;
    for (int lines = 0; lines < 5 && p < end; p++) /* "*N", "$7", "EVALSHA", "$40", "<sha>" */
        if (*p == '\n')
            lines++;
    const char *count_end = memchr(k->cmd, '\n', k->len);
    if (!count_end || p >= end)
        return NULL;
    size_t tl = strlen(k->script), head = (size_t)(count_end + 1 - k->cmd);
    char *out = cg_malloc(head + 32 + tl + (size_t)(end - p));
    memcpy(out, k->cmd, head);
    int n = sprintf(out + head, "$4\r\nEVAL\r\n$%zu\r\n", tl);
    memcpy(out + head + (size_t)n, k->script, tl);
    memcpy(out + head + (size_t)n + tl, "\r\n", 2);
    memcpy(out + head + (size_t)n + tl + 2, p, (size_t)(end - p));
    *len = head + (size_t)n + tl + 2 + (size_t)(end - p);
    return out;
}

static void on_cmd_reply(cg_redis_conn *c, void *reply_, void *priv)
{
    link_cmd *k = priv;
    cg_redis_link *ln = k->ln;
    redisReply *reply = reply_;
    cmd_unlink(k);
    if (reply && reply->type == REDIS_REPLY_ERROR && k->script && strncmp(reply->str, "NOSCRIPT", 8) == 0 &&
        ln->state == L_UP) {
        /* the node that answered lacks the script: once more as EVAL, to the slot's node */
        size_t len;
        char *eval = as_eval(k, &len);
        k->script = NULL;
        if (eval && send_on_wire(ln, k, eval, len) == 0) {
            free(eval);
            return;
        }
        free(eval);
        reply = NULL;
    }
    if (k->cb)
        k->cb(c, reply, k->priv);
    cmd_free(k);
}

/* Puts k in flight (time sent: now) and on the wire; 0, or -1 (k not in flight) when the
 * connection refused it. k is in flight before it is handed over: a write that fails at once
 * (no flusher: at shutdown) answers it, NULL, from inside the send, and that answer takes k
 * out of flight and frees it. */
static int send_on_wire(cg_redis_link *ln, link_cmd *k, const char *cmd, size_t len)
{
    k->sent_at = now_ms(ln);
    k->prev = ln->tail;
    k->next = NULL;
    if (ln->tail)
        ln->tail->next = k;
    else
        ln->head = k;
    ln->tail = k;
    ln->pending++;
    int rc = ln->cluster ? cg_redis_cluster_send(ln->cluster, k->slot, cmd, len, on_cmd_reply, k)
             : ln->conn  ? cg_redis_conn_formatted(ln->conn, on_cmd_reply, k, cmd, len)
                         : -1;
    if (rc < 0) { /* refused before anything was queued: no answer came */
        cmd_unlink(k);
        return -1;
    }
    return 0;
}

static int link_send(cg_redis_link *ln, unsigned slot, const char *cmd, size_t len, const char *script,
                     cg_redis_reply_fn *cb, void *priv)
{
    link_cmd *k = cg_calloc(1, sizeof(*k) + (script ? len : 0)); /* a script's command kept in one piece */
    k->ln = ln;
    k->cb = cb;
    k->priv = priv;
    k->slot = slot;
    if (script) {
        k->script = script;
        memcpy(k->cmd, cmd, len);
        k->len = len;
    }
    if (send_on_wire(ln, k, cmd, len) < 0) {
        cmd_free(k);
        return -1;
    }
    return 0;
}

int cg_redis_link_send(cg_redis_link *ln, unsigned slot, const char *cmd, size_t len, cg_redis_reply_fn *cb,
                       void *priv)
{
    if (!cg_redis_link_up(ln))
        return -1;
    return link_send(ln, slot, cmd, len, NULL, cb, priv);
}

int cg_redis_link_script(cg_redis_link *ln, unsigned slot, const char *cmd, size_t len, const char *text,
                         cg_redis_reply_fn *cb, void *priv)
{
    if (!cg_redis_link_up(ln))
        return -1;
    return link_send(ln, slot, cmd, len, text, cb, priv);
}

cg_redis_conn *cg_redis_link_conn(cg_redis_link *ln, unsigned slot)
{
    if (!cg_redis_link_up(ln))
        return NULL;
    return ln->cluster ? cg_redis_cluster_conn(ln->cluster, slot) : ln->conn;
}

/* ---- up and down ------------------------------------------------------------------------ */

static void on_reconnect_timer(uv_timer_t *t)
{
    link_connect(t->data);
}

static void schedule_reconnect(cg_redis_link *ln)
{
    static const int delays_ms[] = {100, 200, 500, 1000, 2000, 5000};
    /* a cluster has other masters that answer, and its failover ends when a replica is
     * promoted, about a node timeout later: asked again every half second at most */
    int most = ln->cfg.n_seeds ? 2 : 5;
    int i = ln->backoff < most ? ln->backoff : most;
    ln->backoff++;
    uint64_t delay = (uint64_t)delays_ms[i];
    delay += (uint64_t)(rand() % (int)(delay / 4 + 1)); /* jitter, so gateways don't reconnect in step */
    if (!ln->closing)
        uv_timer_start(&ln->timer, on_reconnect_timer, delay, 0);
}

/* The backoff spares a Redis that is away the tries of every gateway; at shutdown, dialogs
 * held in memory for the write-back are lost unless Redis takes them before the exit, and
 * Redis is often back already (a deploy right after a Redis restart) while the backoff still
 * has up to 5 s to run: the store asks for the one try now. */
void cg_redis_link_connect_now(cg_redis_link *ln)
{
    if (!ln || ln->closing || ln->state != L_CLOSED)
        return;
    uv_timer_stop(&ln->timer);
    link_connect(ln);
}

/* Closes what there is (its commands get NULL), says down, and reconnects with the backoff.
 * Safe inside a reply callback (the connection frees after it returns). */
static void link_down(cg_redis_link *ln, const char *why)
{
    cg_redis_conn *c = ln->conn;
    cg_redis_cluster *cl = ln->cluster;
    ln->conn = NULL;
    ln->cluster = NULL;
    ln->state = L_CLOSED;
    if (ln->resolve) {
        cg_resolve_abandon(ln->resolve);
        ln->resolve = NULL;
    }
    cg_redis_sentinel_abort(ln->sentinel);
    uv_timer_stop(&ln->timer);
    cg_redis_cluster_close(cl);
    cg_redis_conn_close(c);
    if (ln->closing)
        return;
    ln->cfg.on_down(ln->cfg.data, why);
    schedule_reconnect(ln);
}

/* The probe passed. */
static void link_trusted(cg_redis_link *ln)
{
    ln->state = L_UP;
    ln->backoff = 0;
    if (ln->ever_up)
        ln->cfg.stats->reconnects++;
    ln->ever_up = 1;
    cg_info("redis %s: connected", ln->name);
    int moved = 0;
    if (ln->cfg.master) {
        if (ln->primary && strcmp(ln->primary, ln->name) != 0) {
            ln->cfg.stats->primary_switches++;
            cg_warn("redis: followed a failover of '%s': the primary is now %s (was %s)", ln->cfg.master, ln->name,
                    ln->primary);
            moved = 1;
        }
        free(ln->primary);
        ln->primary = cg_strdup(ln->name);
    }
    ln->cfg.on_up(ln->cfg.data, moved);
}

/* ---- the probe ---------------------------------------------------------------------------- */

static void on_role(cg_redis_conn *c, void *reply_, void *priv)
{
    cg_redis_link *ln = priv;
    redisReply *reply = reply_;
    if (c != ln->conn || !reply)
        return;
    if (reply->type == REDIS_REPLY_ERROR) {
        char why[200];
        snprintf(why, sizeof(why), "the connection's ROLE was answered '%.120s'", reply->str);
        ln->cfg.stats->errors++;
        link_down(ln, why);
        return;
    }
    const char *role = reply->type == REDIS_REPLY_ARRAY && reply->elements > 0 &&
                               reply->element[0]->type == REDIS_REPLY_STRING ? reply->element[0]->str : "?";
    if (strcmp(role, "master") != 0) {
        /* a Sentinel that has not seen the failover yet names the old primary, now a replica */
        ln->cfg.stats->replica_refused++;
        cg_warn("redis %s: the Sentinels named this node as the primary of '%s', but it is a %s now: asking them "
                "again",
                ln->name, ln->cfg.master, role);
        link_down(ln, "the node named as the primary is a replica");
        return;
    }
    link_trusted(ln);
}

/* Only a PING answered makes the link up (a stopped Redis accepts connections too). An error
 * answer (-LOADING after a restart, -NOAUTH, -MASTERDOWN), or a refused AUTH or SELECT
 * before it, fails it. */
static void on_ping(cg_redis_conn *c, void *reply_, void *priv)
{
    cg_redis_link *ln = priv;
    redisReply *reply = reply_;
    if (c != ln->conn || !reply)
        return; /* an older connection, or this one gone */
    if (reply->type == REDIS_REPLY_ERROR || ln->setup_failed) {
        char why[200];
        if (reply->type == REDIS_REPLY_ERROR)
            snprintf(why, sizeof(why), "the connection's PING was answered '%.120s'", reply->str);
        else
            snprintf(why, sizeof(why), "the connection's %s was refused (the line above says why)", ln->setup_failed);
        ln->cfg.stats->errors++;
        link_down(ln, why);
        return;
    }
    if (ln->cfg.master) {
        if (link_send(ln, 0, "*1\r\n$4\r\nROLE\r\n", 14, NULL, on_role, ln) < 0)
            link_down(ln, "could not send ROLE");
        return;
    }
    link_trusted(ln);
}

static void on_setup(cg_redis_conn *c, void *reply_, void *priv)
{
    cg_redis_link *ln = cg_redis_conn_data(c);
    redisReply *reply = reply_;
    if (!ln || c != ln->conn || !reply || reply->type != REDIS_REPLY_ERROR)
        return;
    cg_warn("redis %s: %s failed: %s", ln->name, (const char *)priv, reply->str);
    ln->setup_failed = priv; /* the PING's answer fails the connection: never the default user, never the wrong database */
}

static void on_conn_event(cg_redis_conn *c, int up, const char *why)
{
    cg_redis_link *ln = cg_redis_conn_data(c);
    if (c != ln->conn)
        return;
    if (!up) {
        ln->conn = NULL; /* it frees itself, not link_down */
        link_down(ln, why ? why : "connection closed");
        return;
    }
    uv_timer_stop(&ln->timer);
    /* connected (TCP and TLS); the PING decides, within the command timeout */
    ln->state = L_PROBING;
    if (link_send(ln, 0, "*1\r\n$4\r\nPING\r\n", 14, NULL, on_ping, ln) < 0)
        link_down(ln, "could not send PING");
}

/* Connects to a numeric address (resolved off the loop before). */
static void connect_to(cg_redis_link *ln, const char *address)
{
    if (!ln->address || strcmp(ln->address, address) != 0 || ln->address_port != ln->port) {
        cg_info("redis %s: connecting to %s", ln->name, address);
        free(ln->address);
        ln->address = cg_strdup(address);
        ln->address_port = ln->port;
    }
    char why[160];
    cg_redis_conn *c = cg_redis_conn_open(ln->cfg.loop, address, ln->port, ln->host, ln->cfg.tls, ln->cfg.flush, ln,
                                          on_conn_event, why, sizeof(why));
    if (!c) {
        link_down(ln, why);
        return;
    }
    ln->conn = c;
    ln->state = L_CONNECTING;
    ln->setup_failed = NULL;
    cg_redis_conn_take_readonly(c);
    if (ln->cfg.password)
        cg_redis_conn_auth(c, ln->cfg.user, ln->cfg.password, on_setup, (void *)"AUTH");
    if (ln->cfg.db)
        cg_redis_conn_cmd(c, on_setup, (void *)"SELECT", "SELECT %d", ln->cfg.db);
}

static void on_resolved(void *data, const char *address, const char *err)
{
    cg_redis_link *ln = data;
    ln->resolve = NULL;
    if (!address) {
        link_down(ln, err);
        return;
    }
    connect_to(ln, address);
}

static void on_connect_timeout(uv_timer_t *t)
{
    cg_redis_link *ln = t->data;
    link_down(ln, ln->state == L_RESOLVING ? "resolving the host timed out" : "connect timed out");
}

/* Every (re)connect resolves the host again, off the loop: its address may have moved. */
static void resolve_and_connect(cg_redis_link *ln)
{
    ln->state = L_RESOLVING;
    uv_update_time(ln->cfg.loop); /* at startup the loop's time is as old as the loop */
    uv_timer_start(&ln->timer, on_connect_timeout, (uint64_t)ln->cfg.connect_timeout_ms, 0);
    ln->resolve = cg_resolve_start(ln->cfg.loop, ln->host, on_resolved, ln);
    if (!ln->resolve)
        link_down(ln, "could not start resolving the host");
}

/* ---- Sentinel and cluster ------------------------------------------------------------------ */

static void on_sentinel_answer(void *data, const char *host, int port, const char *why)
{
    cg_redis_link *ln = data;
    if (!host) {
        link_down(ln, why);
        return;
    }
    if (strcmp(ln->host, host) != 0 || ln->port != port)
        cg_info("redis sentinel: the primary of '%s' is %s:%d", ln->cfg.master, host, port);
    free(ln->host);
    ln->host = cg_strdup(host);
    ln->port = port;
    set_name(ln);
    resolve_and_connect(ln); /* as a redis:// address from here; the probe adds ROLE */
}

/* Sentinel says the primary of our master moved: drop what points elsewhere. */
static void on_sentinel_switch(void *data, const char *host, int port, const char *sentinel)
{
    cg_redis_link *ln = data;
    if (ln->closing)
        return;
    if (strcmp(ln->host, host) == 0 && ln->port == port && ln->state != L_CLOSED)
        return; /* already connected or connecting there (a reconnect asked first) */
    cg_warn("redis sentinel %s: the primary of '%s' moved to %s:%d: reconnecting", sentinel, ln->cfg.master, host,
            port);
    ln->backoff = 0;
    if (ln->state == L_CLOSED) { /* waiting for the backoff: ask now */
        uv_timer_stop(&ln->timer);
        schedule_reconnect(ln);
    } else if (ln->state != L_ASKING) { /* a question under way is answered anew, or ROLE refuses */
        link_down(ln, "Sentinel switched the primary");
    }
}

static void on_cluster_state(void *data, int up, const char *why)
{
    cg_redis_link *ln = data;
    if (!up) {
        ln->cluster = NULL; /* closed by itself */
        link_down(ln, why);
        return;
    }
    uv_timer_stop(&ln->timer);
    link_trusted(ln);
}

static void on_cluster_failover(void *data, const unsigned char *slots)
{
    cg_redis_link *ln = data;
    ln->cfg.stats->primary_switches++;
    if (ln->cfg.on_failover)
        ln->cfg.on_failover(ln->cfg.data, slots);
}

static void cluster_connect(cg_redis_link *ln)
{
    ln->state = L_CONNECTING;
    uv_update_time(ln->cfg.loop);
    uv_timer_start(&ln->timer, on_connect_timeout, (uint64_t)ln->cfg.connect_timeout_ms, 0);
    cg_redis_cluster_config cc = {
        .loop = ln->cfg.loop,
        .flush = ln->cfg.flush,
        .tls = ln->cfg.tls,
        .user = ln->cfg.user,
        .password = ln->cfg.password,
        .seed_hosts = (const char *const *)ln->cfg.seed_hosts,
        .seed_ports = ln->cfg.seed_ports,
        .n_seeds = ln->cfg.n_seeds,
        .on_state = on_cluster_state,
        .on_failover = on_cluster_failover,
        .data = ln,
        .stats = &ln->cfg.stats->cluster,
    };
    if (!(ln->cluster = cg_redis_cluster_open(&cc)))
        link_down(ln, "out of memory");
}

static void link_connect(cg_redis_link *ln)
{
    if (ln->closing)
        return;
    if (ln->cfg.n_seeds) {
        cluster_connect(ln);
    } else if (ln->sentinel) {
        ln->state = L_ASKING;
        cg_redis_sentinel_ask(ln->sentinel, ln->ever_up || ln->backoff > 0);
    } else {
        resolve_and_connect(ln);
    }
}

/* Every 100 ms: has the oldest command waited too long? A -READONLY answer (a primary
 * demoted under our connection) makes the Sentinels be asked again. */
static void on_tick(uv_timer_t *t)
{
    cg_redis_link *ln = t->data;
    unsigned readonly = ln->cfg.master && ln->conn ? cg_redis_conn_take_readonly(ln->conn) : 0;
    if (readonly) {
        ln->cfg.stats->readonly_replies += readonly;
        cg_warn("redis %s: %u answers were -READONLY: this node is a replica now; asking the Sentinels for the "
                "primary of '%s'",
                ln->name, readonly, ln->cfg.master);
        ln->backoff = 0; /* the new primary is likely known already: ask at once */
        link_down(ln, "the node became a replica (-READONLY)");
        return;
    }
    if (ln->head && now_ms(ln) - ln->head->sent_at > (uint64_t)ln->cfg.command_timeout_ms) {
        ln->cfg.stats->errors++;
        char why[96];
        snprintf(why, sizeof(why), "no answer for %ld ms", ln->cfg.command_timeout_ms);
        /* a cluster: that command's master alone is lost (a master stopped is its slots'
         * outage, as a killed one is), unless it was lost already and still holds the line */
        link_cmd *oldest = ln->head;
        if (ln->cluster && cg_redis_cluster_stalled(ln->cluster, oldest->slot, why) == 0)
            return; /* its commands were answered NULL; the router may have ended (link down) */
        link_down(ln, why);
    }
}

/* ---- life ------------------------------------------------------------------------------------ */

static void on_start(uv_timer_t *t)
{
    link_connect(t->data);
}

cg_redis_link *cg_redis_link_open(const cg_redis_link_config *cfg)
{
    cg_redis_link *ln = cg_calloc(1, sizeof(*ln));
    ln->cfg = *cfg;
    ln->host = cg_strdup(cfg->host ? cfg->host : cfg->master ? cfg->master : "?");
    ln->port = cfg->port;
    set_name(ln);
    uv_timer_init(cfg->loop, &ln->timer);
    uv_timer_init(cfg->loop, &ln->tick);
    ln->timer.data = ln->tick.data = ln;
    ln->handles = 2;
    if (cfg->master) {
        cg_redis_sentinel_config sc = {
            .loop = cfg->loop,
            .flush = cfg->flush,
            .tls = cfg->tls,
            .master = cfg->master,
            .hosts = cfg->sentinel_hosts,
            .ports = cfg->sentinel_ports,
            .n = cfg->n_sentinels,
            .timeout_ms = cfg->connect_timeout_ms,
            .on_answer = on_sentinel_answer,
            .on_switch = on_sentinel_switch,
            .data = ln,
        };
        if (!(ln->sentinel = cg_redis_sentinel_open(&sc)))
            abort(); /* out of memory at startup */
    }
    uv_timer_start(&ln->tick, on_tick, 100, 100);
    uv_unref((uv_handle_t *)&ln->tick);
    /* the first connect from the loop: its timeout counts from there, not from a start that
     * still has rules to compile (seconds under a sanitizer) */
    uv_timer_start(&ln->timer, on_start, 0, 0);
    return ln;
}

static void on_handle_closed(uv_handle_t *h)
{
    cg_redis_link *ln = h->data;
    if (--ln->handles > 0)
        return;
    void (*closed)(void *) = ln->closed;
    void *data = ln->cfg.data;
    free(ln->host);
    free(ln->address);
    free(ln->primary);
    free(ln);
    if (closed)
        closed(data);
}

static void close_now(cg_redis_link *ln)
{
    if (uv_is_closing((uv_handle_t *)&ln->timer))
        return;
    if (ln->pending)
        cg_warn("redis %s: writes still unanswered at shutdown are lost", ln->name);
    link_down(ln, "closing"); /* no on_down while closing */
    cg_redis_sentinel_close(ln->sentinel);
    ln->sentinel = NULL;
    uv_close((uv_handle_t *)&ln->timer, on_handle_closed);
    uv_close((uv_handle_t *)&ln->tick, on_handle_closed);
}

static void on_close_wait(uv_timer_t *t)
{
    close_now(t->data); /* the deadline: what is still unanswered is lost */
}

static void on_close_poll(uv_timer_t *t)
{
    cg_redis_link *ln = t->data;
    if (!ln->pending)
        close_now(ln);
}

/*
 * Shutdown: the saves just made are still on their way, so a link that is up waits for its
 * commands in flight, for at most a second (the tick polls; the timer is the deadline).
 */
void cg_redis_link_close(cg_redis_link *ln, void (*closed)(void *data))
{
    if (!ln || ln->closing)
        return;
    ln->closing = 1;
    ln->closed = closed;
    if (ln->state == L_UP && ln->pending) {
        uv_timer_start(&ln->timer, on_close_wait, 1000, 0);
        uv_timer_start(&ln->tick, on_close_poll, 10, 10);
        return;
    }
    close_now(ln);
}
