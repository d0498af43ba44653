/*
 * redis_cluster.c: the Redis Cluster router (redis_cluster.h).
 *
 * Life: ASKING (a seed is resolved, connected and asked CLUSTER SLOTS; the next seed when it
 * fails) -> CONNECTING (a connection per master, each AUTHed and PINGed) -> UP -> CLOSED.
 * Every seed failing, or a master lost before UP, is the router's end: on_state(0), and the
 * store reconnects with its backoff, reading the map anew. Once UP, a master lost is only
 * its slots' outage: their commands fail at once (the store answers those dialogs from
 * memory and writes them back later) while the map is asked of the masters that answer,
 * every MAP_REFRESH_MS, until each master it names answers again (the node back, or its
 * replica promoted). The router ends only when no master answers.
 *
 * Each command keeps its RESP text until its final answer, for the redirects:
 *   MOVED slot host:port  the slot's owner becomes that node (connected when new), the
 *                         command goes there, and the whole map is read again (one
 *                         resharding moves many slots: the first MOVED finds them all);
 *   ASK slot host:port    ASKING, then the command, at that node, this once;
 *   TRYAGAIN/CLUSTERDOWN  the command waits (20 ms, doubling) and goes again.
 * At most REDIRECTS_MAX of these a command; past it, the last error is its answer.
 *
 * Ownership: the router owns its connections and the commands in flight; a command's
 * callback is called exactly once (its answer, or NULL when the router closed first). The
 * router is freed when its timer's handle has closed, after every callback of its
 * connections has run.
 */
#define _GNU_SOURCE
#include "chatgate/core/alloc.h"
#include "chatgate/store/redis_cluster.h"

#include <arpa/inet.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "chatgate/core/log.h"
#include "chatgate/core/net.h"

#define REDIRECTS_MAX 8
#define RETRY_FIRST_MS 20
#define RETRY_MAX_MS 100 /* 8 retries end within the store's command timeout (1 s by default) */
#define MAP_READ_GAP_MS 100 /* at most one CLUSTER SLOTS in flight, and none closer than this */
#define MAP_REFRESH_MS 250  /* a master lost: the map asked again this often until all answer */

typedef enum { CL_ASKING, CL_CONNECTING, CL_UP, CL_CLOSED } cl_state;

typedef struct cl_node {
    cg_redis_cluster *cl;
    cg_redis_node_addr addr;
    cg_redis_conn *conn; /* NULL: not connected (yet) */
    cg_resolve *resolve; /* a node named by a host name (cluster-preferred-endpoint-type
                          * hostname): its address being looked up, off the loop */
    int answered;        /* its PING came back */
    int lost;            /* lost while the router was up, and not answering since (logged once) */
} cl_node;

typedef struct cl_cmd {
    cg_redis_cluster *cl;
    unsigned slot;
    char *text;
    size_t len;
    cg_redis_reply_fn *cb;
    void *priv;
    int redirects;
    uint64_t due;               /* parked: when it goes again */
    struct cl_cmd *parked_next;
} cl_cmd;

struct cg_redis_cluster {
    cg_redis_cluster_config cfg;
    char **seed_hosts;
    int *seed_ports;
    int seed_at, seeds_tried;
    cg_resolve *resolve;
    cg_redis_conn *seed;
    char seed_address[64];
    cl_state state;
    cg_redis_slot_map map;
    int map_node[CG_REDIS_CLUSTER_MAX_NODES]; /* map.nodes[i] is nodes[map_node[i]] */
    cl_node nodes[CG_REDIS_CLUSTER_MAX_NODES];
    int n_nodes;
    int map_reading;      /* a CLUSTER SLOTS is in flight (after a MOVED) */
    uint64_t map_read_at; /* loop time of the last */
    cl_cmd *parked;       /* waiting for a retry (TRYAGAIN, CLUSTERDOWN) */
    uv_timer_t timer;     /* the parked commands' */
    uv_timer_t refresh;   /* a master lost: the map asked again (node_lost) */
    int handles;          /* the timers not yet closed: freed at 0 */
    char *user, *password;
};

static void ask_seed(cg_redis_cluster *cl);
static void deliver(cl_cmd *k, cg_redis_conn *c, void *reply);

static cg_redis_cluster_stats *stats(cg_redis_cluster *cl)
{
    static cg_redis_cluster_stats none; /* counted into when the caller keeps none */
    return cl->cfg.stats ? cl->cfg.stats : &none;
}

/* ---- the end ---------------------------------------------------------------------------- */

static void on_timer_closed(uv_handle_t *h)
{
    cg_redis_cluster *cl = h->data;
    if (--cl->handles > 0)
        return;
    for (int i = 0; i < cl->cfg.n_seeds; i++)
        free(cl->seed_hosts[i]);
    free(cl->seed_hosts);
    free(cl->seed_ports);
    free(cl->user);
    free(cl->password);
    free(cl);
}

void cg_redis_cluster_close(cg_redis_cluster *cl)
{
    if (!cl || cl->state == CL_CLOSED)
        return;
    cl->state = CL_CLOSED;
    if (cl->resolve)
        cg_resolve_abandon(cl->resolve);
    cl->resolve = NULL;
    cg_redis_conn *seed = cl->seed;
    cl->seed = NULL;
    cg_redis_conn_close(seed);
    for (int i = 0; i < cl->n_nodes; i++) { /* their commands get NULL, and are freed */
        if (cl->nodes[i].resolve)
            cg_resolve_abandon(cl->nodes[i].resolve);
        cl->nodes[i].resolve = NULL;
        cg_redis_conn *c = cl->nodes[i].conn;
        cl->nodes[i].conn = NULL;
        cg_redis_conn_close(c);
    }
    while (cl->parked) {
        cl_cmd *k = cl->parked;
        cl->parked = k->parked_next;
        deliver(k, NULL, NULL);
    }
    uv_close((uv_handle_t *)&cl->timer, on_timer_closed);
    uv_close((uv_handle_t *)&cl->refresh, on_timer_closed);
}

/* The router cannot go on: the store is told (and closes it). */
static void cl_lost(cg_redis_cluster *cl, const char *why)
{
    if (cl->state == CL_CLOSED)
        return;
    void (*on_state)(void *, int, const char *) = cl->cfg.on_state;
    void *data = cl->cfg.data;
    cg_redis_cluster_close(cl);
    on_state(data, 0, why);
}

/* ---- nodes ------------------------------------------------------------------------------ */

static void send_auth(cg_redis_cluster *cl, cg_redis_conn *c)
{
    if (cl->password) /* refused, it fails the connection (its close event says why) */
        cg_redis_conn_auth(c, cl->user, cl->password, NULL, NULL);
}

static void on_refresh(uv_timer_t *t);

/* A master of the map whose connection answers, or NULL. */
static cl_node *node_answering(cg_redis_cluster *cl)
{
    for (int i = 0; i < cl->map.n_nodes; i++) {
        cl_node *n = &cl->nodes[cl->map_node[i]];
        if (n->conn && n->answered)
            return n;
    }
    return NULL;
}

/*
 * n's connection is gone (closed, refused, or it answered PING with an error), why says how.
 * Before the router is up that is its end. After, only n's slots fail until the map names a
 * master for them that answers: the map is asked again (on_refresh), and the router ends
 * only when no master answers.
 */
static void node_lost(cl_node *n, const char *why)
{
    cg_redis_cluster *cl = n->cl;
    char msg[300];
    snprintf(msg, sizeof(msg), "cluster node %s:%d: %s", n->addr.host, n->addr.port, why);
    n->answered = 0;
    if (cl->state != CL_UP) {
        cl_lost(cl, msg);
        return;
    }
    if (!node_answering(cl)) {
        cl_lost(cl, msg);
        return;
    }
    if (!n->lost) {
        n->lost = 1;
        cg_warn("redis %s; the dialogs in its slots are served from memory until it, or a replica promoted in its "
                "place, answers",
                msg);
    }
    if (!uv_is_active((uv_handle_t *)&cl->refresh))
        uv_timer_start(&cl->refresh, on_refresh, MAP_REFRESH_MS, 0);
}

static void on_node_event(cg_redis_conn *c, int up, const char *why)
{
    cl_node *n = cg_redis_conn_data(c);
    if (up || !n || n->conn != c)
        return;
    n->conn = NULL;
    node_lost(n, why ? why : "closed");
}

static void on_node_ping(cg_redis_conn *c, void *reply_, void *priv)
{
    cl_node *n = priv;
    redisReply *reply = reply_;
    cg_redis_cluster *cl = n->cl;
    if (!reply || n->conn != c || cl->state == CL_CLOSED)
        return; /* the node's event says why */
    if (reply->type == REDIS_REPLY_ERROR) { /* -LOADING, -NOAUTH, ...: not a node to use */
        char msg[200];
        snprintf(msg, sizeof(msg), "answered PING '%.120s'", reply->str);
        n->conn = NULL;
        cg_redis_conn_close(c); /* from inside its callback: closed when this returns */
        node_lost(n, msg);
        return;
    }
    n->answered = 1;
    if (n->lost) {
        n->lost = 0;
        cg_info("redis cluster node %s:%d: answers again", n->addr.host, n->addr.port);
    }
    if (cl->state != CL_CONNECTING)
        return;
    for (int i = 0; i < cl->map.n_nodes; i++)
        if (!cl->nodes[cl->map_node[i]].answered)
            return;
    cl->state = CL_UP;
    cl->cfg.on_state(cl->cfg.data, 1, NULL);
}

/* Connects n to address (AUTH and PING queued); 0, or -1 when the connection could not
 * even start: n is lost (node_lost). */
static int node_connect(cl_node *n, const char *address)
{
    cg_redis_cluster *cl = n->cl;
    char why[200];
    /* the map names nodes by address or host name: the certificate is checked against
     * redis.tls_server_name when set, else against that */
    n->conn = cg_redis_conn_open(cl->cfg.loop, address, n->addr.port, n->addr.host, cl->cfg.tls, cl->cfg.flush, n,
                                 on_node_event, why, sizeof(why));
    if (!n->conn) {
        node_lost(n, why);
        return -1;
    }
    n->answered = 0;
    send_auth(cl, n->conn);
    cg_redis_conn_cmd(n->conn, on_node_ping, n, "PING");
    return 0;
}

static void on_node_resolved(void *data, const char *address, const char *err)
{
    cl_node *n = data;
    n->resolve = NULL;
    if (!address) {
        char why[200];
        snprintf(why, sizeof(why), "resolving its host name: %.150s", err ? err : "failed");
        node_lost(n, why);
        return;
    }
    node_connect(n, address);
}

/* Is host an IP address (not a name to look up)? */
static int numeric_host(const char *host)
{
    unsigned char buf[sizeof(struct in6_addr)];
    return inet_pton(AF_INET, host, buf) == 1 || inet_pton(AF_INET6, host, buf) == 1;
}

/* The node at host:port, connected (AUTH and PING queued) when it was not, or its host name
 * looked up first; NULL when the table is full (the router is then lost). A connection that
 * cannot even start is the router's end before it is up, and that node's loss after
 * (node_lost). */
static cl_node *node_get(cg_redis_cluster *cl, const char *host, int port)
{
    cl_node *n = NULL;
    for (int i = 0; i < cl->n_nodes && !n; i++)
        if (cl->nodes[i].addr.port == port && strcmp(cl->nodes[i].addr.host, host) == 0)
            n = &cl->nodes[i];
    if (!n) {
        if (cl->n_nodes == CG_REDIS_CLUSTER_MAX_NODES) {
            cl_lost(cl, "more cluster nodes than chatgate keeps connections to");
            return NULL;
        }
        n = &cl->nodes[cl->n_nodes++];
        memset(n, 0, sizeof(*n));
        n->cl = cl;
        n->addr.port = port;
        snprintf(n->addr.host, sizeof(n->addr.host), "%s", host);
    }
    if (n->conn || n->resolve)
        return n;
    int up = cl->state == CL_UP;
    if (!numeric_host(host)) {
        if ((n->resolve = cg_resolve_start(cl->cfg.loop, host, on_node_resolved, n)))
            return n;
        node_lost(n, "could not start resolving its host name");
    } else if (node_connect(n, host) == 0) {
        return n;
    }
    return up && cl->state == CL_UP ? n : NULL;
}

/* The slots that the map now in force gives a lost master and map m (its node i being
 * nodes[node_of[i]]) another: a bitmap (cg_calloc'd, the caller's to free), or NULL. */
static unsigned char *failed_over(const cg_redis_cluster *cl, const cg_redis_slot_map *m, const int *node_of,
                                  int *count)
{
    unsigned char *slots = NULL;
    *count = 0;
    for (int s = 0; s < CG_REDIS_SLOTS; s++) {
        int was = cl->map.owner[s], now = m->owner[s];
        if (was < 0 || now < 0 || !cl->nodes[cl->map_node[was]].lost || node_of[now] == cl->map_node[was])
            continue;
        if (!slots)
            slots = cg_calloc(1, CG_REDIS_SLOTS / 8);
        slots[s / 8] |= (unsigned char)(1u << (s % 8));
        (*count)++;
    }
    return slots;
}

/* Takes map m as the cluster's: every master in it connected. -1 when the router was lost.
 * Slots of a lost master that m gives another (a replica promoted) are told (on_failover)
 * once m is in force. */
static int map_apply(cg_redis_cluster *cl, const cg_redis_slot_map *m)
{
    int node_of[CG_REDIS_CLUSTER_MAX_NODES];
    for (int i = 0; i < m->n_nodes; i++) {
        cl_node *n = node_get(cl, m->nodes[i].host, m->nodes[i].port);
        if (!n)
            return -1;
        node_of[i] = (int)(n - cl->nodes);
    }
    int count = 0;
    unsigned char *slots = cl->state == CL_UP && cl->cfg.on_failover ? failed_over(cl, m, node_of, &count) : NULL;
    cl->map = *m;
    memcpy(cl->map_node, node_of, sizeof(node_of[0]) * (size_t)m->n_nodes);
    if (slots) {
        cg_warn("redis cluster: %d slots of a lost master have another now (a replica promoted)", count);
        cl->cfg.on_failover(cl->cfg.data, slots);
        free(slots);
    }
    return 0;
}

/* ---- reading the map -------------------------------------------------------------------- */

static void seed_failed(cg_redis_cluster *cl, const char *why)
{
    cg_redis_conn *seed = cl->seed;
    cl->seed = NULL;
    cg_redis_conn_close(seed);
    cg_debug("redis cluster seed %s:%d: %s", cl->seed_hosts[cl->seed_at], cl->seed_ports[cl->seed_at], why);
    cl->seed_at = (cl->seed_at + 1) % cl->cfg.n_seeds;
    if (++cl->seeds_tried < cl->cfg.n_seeds) {
        ask_seed(cl);
        return;
    }
    char msg[300];
    snprintf(msg, sizeof(msg), "none of the %d cluster seeds gave the slot map (the last: %.200s)", cl->cfg.n_seeds,
             why);
    cl_lost(cl, msg);
}

static void on_seed_slots(cg_redis_conn *c, void *reply, void *priv)
{
    cg_redis_cluster *cl = priv;
    if (c != cl->seed || cl->state != CL_ASKING)
        return;
    if (!reply) {
        seed_failed(cl, cg_redis_conn_error(c));
        return;
    }
    cg_redis_slot_map *m = cg_malloc(sizeof(*m));
    char err[200];
    if (cg_redis_slot_map_read(reply, cl->seed_address, m, err, sizeof(err)) < 0) {
        free(m);
        seed_failed(cl, err);
        return;
    }
    stats(cl)->map_reads++;
    cl->seed = NULL;
    cg_redis_conn_close(c); /* from inside its callback: closed when this returns */
    cl->state = CL_CONNECTING;
    map_apply(cl, m);
    free(m);
}

static void on_seed_event(cg_redis_conn *c, int up, const char *why)
{
    cg_redis_cluster *cl = cg_redis_conn_data(c);
    if (up || c != cl->seed)
        return;
    cl->seed = NULL; /* it frees itself */
    seed_failed(cl, why ? why : "closed");
}

static void on_seed_resolved(void *data, const char *address, const char *err)
{
    cg_redis_cluster *cl = data;
    cl->resolve = NULL;
    char why[200];
    if (!address) {
        seed_failed(cl, err);
        return;
    }
    snprintf(cl->seed_address, sizeof(cl->seed_address), "%s", address);
    cl->seed = cg_redis_conn_open(cl->cfg.loop, address, cl->seed_ports[cl->seed_at], cl->seed_hosts[cl->seed_at],
                                  cl->cfg.tls, cl->cfg.flush, cl, on_seed_event, why, sizeof(why));
    if (!cl->seed) {
        seed_failed(cl, why);
        return;
    }
    send_auth(cl, cl->seed);
    cg_redis_conn_cmd(cl->seed, on_seed_slots, cl, "CLUSTER SLOTS");
}

static void ask_seed(cg_redis_cluster *cl)
{
    cl->resolve = cg_resolve_start(cl->cfg.loop, cl->seed_hosts[cl->seed_at], on_seed_resolved, cl);
    if (!cl->resolve)
        seed_failed(cl, "could not start resolving the host");
}

/* A MOVED said the map is stale: it is read again from the node that said so. */
static void on_map_reread(cg_redis_conn *c, void *reply, void *priv)
{
    cl_node *n = priv;
    cg_redis_cluster *cl = n->cl;
    if (cl->state == CL_CLOSED)
        return;
    cl->map_reading = 0;
    if (!reply || n->conn != c)
        return; /* the node's event deals with it */
    cg_redis_slot_map *m = cg_malloc(sizeof(*m));
    char err[200];
    if (cg_redis_slot_map_read(reply, n->addr.host, m, err, sizeof(err)) < 0) {
        cg_warn("redis cluster: reading the slot map again from %s:%d: %s", n->addr.host, n->addr.port, err);
        free(m);
        return; /* the MOVED answers still lead each command */
    }
    stats(cl)->map_reads++;
    map_apply(cl, m);
    free(m);
}

static void map_reread(cg_redis_cluster *cl, cl_node *from)
{
    uint64_t now = uv_now(cl->cfg.loop);
    if (cl->map_reading || (cl->map_read_at && now - cl->map_read_at < MAP_READ_GAP_MS) || !from->conn)
        return;
    cl->map_reading = 1;
    cl->map_read_at = now;
    cg_redis_conn_cmd(from->conn, on_map_reread, from, "CLUSTER SLOTS");
}

/* A master was lost: until every master the map names answers, the map is asked again of one
 * that answers (the lost one's replica is found there once promoted), and the masters it
 * names that are not connected are connected again (node_get: the lost one, if back). */
static void on_refresh(uv_timer_t *t)
{
    cg_redis_cluster *cl = t->data;
    if (cl->state != CL_UP)
        return;
    int whole = 1;
    for (int i = 0; i < cl->map.n_nodes && whole; i++)
        whole = cl->nodes[cl->map_node[i]].answered;
    if (whole)
        return;
    cl_node *from = node_answering(cl);
    if (from)
        map_reread(cl, from);
    uv_timer_start(&cl->refresh, on_refresh, MAP_REFRESH_MS, 0);
}

/* ---- commands --------------------------------------------------------------------------- */

static void deliver(cl_cmd *k, cg_redis_conn *c, void *reply)
{
    if (k->cb)
        k->cb(c, reply, k->priv);
    free(k->text);
    free(k);
}

static void on_cmd_reply(cg_redis_conn *c, void *reply_, void *priv);

/* Can n take commands? Connected, and not a master lost and not answering again yet (a
 * stopped one accepts a connection and says nothing): its slots fail at once instead. */
static int node_usable(const cl_node *n)
{
    return n && n->conn && !(n->lost && !n->answered);
}

/* Sends k to node n (after ASKING when asking); -1 when n cannot take it (node_usable) or its
 * connection refused it. */
static int send_to(cl_node *n, cl_cmd *k, int asking)
{
    if (!node_usable(n))
        return -1;
    if (asking && cg_redis_conn_cmd(n->conn, NULL, NULL, "ASKING") < 0)
        return -1;
    return cg_redis_conn_formatted(n->conn, on_cmd_reply, k, k->text, k->len);
}

static cl_node *slot_node(cg_redis_cluster *cl, unsigned slot)
{
    int i = cl->map.owner[slot & (CG_REDIS_SLOTS - 1)];
    return i < 0 ? NULL : &cl->nodes[cl->map_node[i]];
}

static void on_timer(uv_timer_t *t)
{
    cg_redis_cluster *cl = t->data;
    uint64_t now = uv_now(cl->cfg.loop), next = 0;
    cl_cmd *due = NULL, **pp = &cl->parked;
    while (*pp) { /* unhook the due ones first: sending may park again */
        cl_cmd *k = *pp;
        if (k->due <= now) {
            *pp = k->parked_next;
            k->parked_next = due;
            due = k;
        } else {
            if (!next || k->due < next)
                next = k->due;
            pp = &k->parked_next;
        }
    }
    while (due && cl->state != CL_CLOSED) {
        cl_cmd *k = due;
        due = k->parked_next;
        if (send_to(slot_node(cl, k->slot), k, 0) < 0)
            deliver(k, NULL, NULL);
    }
    while (due) { /* the router closed under a callback */
        cl_cmd *k = due;
        due = k->parked_next;
        deliver(k, NULL, NULL);
    }
    if (next && cl->state != CL_CLOSED)
        uv_timer_start(&cl->timer, on_timer, next - now, 0);
}

static void park(cg_redis_cluster *cl, cl_cmd *k)
{
    uint64_t delay = (uint64_t)RETRY_FIRST_MS << (k->redirects < 6 ? k->redirects : 6);
    if (delay > RETRY_MAX_MS)
        delay = RETRY_MAX_MS;
    k->due = uv_now(cl->cfg.loop) + delay;
    k->parked_next = cl->parked;
    cl->parked = k;
    if (!uv_is_active((uv_handle_t *)&cl->timer) || uv_timer_get_due_in(&cl->timer) > delay)
        uv_timer_start(&cl->timer, on_timer, delay, 0);
}

static void on_cmd_reply(cg_redis_conn *c, void *reply_, void *priv)
{
    cl_cmd *k = priv;
    cg_redis_cluster *cl = k->cl;
    redisReply *reply = reply_;
    cg_redis_redirect rd;
    if (!reply || cl->state == CL_CLOSED || reply->type != REDIS_REPLY_ERROR ||
        cg_redis_parse_redirect(reply->str, reply->len, &rd) == CG_REDIRECT_NONE || k->redirects >= REDIRECTS_MAX) {
        deliver(k, c, reply);
        return;
    }
    k->redirects++;
    cl_node *from = cg_redis_conn_data(c);
    switch (rd.kind) {
    case CG_REDIRECT_MOVED: {
        stats(cl)->moved++;
        cl_node *to = node_get(cl, rd.host, rd.port);
        if (!to) {
            deliver(k, NULL, NULL);
            return;
        }
        int idx = cg_redis_slot_map_node(&cl->map, rd.host, rd.port);
        if (idx >= 0) {
            cl->map.owner[rd.slot] = (int16_t)idx;
            cl->map_node[idx] = (int)(to - cl->nodes);
        }
        if (from)
            map_reread(cl, from);
        if (send_to(to, k, 0) < 0)
            deliver(k, NULL, NULL);
        return;
    }
    case CG_REDIRECT_ASK: {
        stats(cl)->ask++;
        cl_node *to = node_get(cl, rd.host, rd.port);
        if (send_to(to, k, 1) < 0)
            deliver(k, NULL, NULL);
        return;
    }
    default:
        if (rd.kind == CG_REDIRECT_TRYAGAIN)
            stats(cl)->tryagain++;
        else
            stats(cl)->clusterdown++;
        park(cl, k);
        return;
    }
}

int cg_redis_cluster_send(cg_redis_cluster *cl, unsigned slot, const char *cmd, size_t len, cg_redis_reply_fn *cb,
                          void *priv)
{
    if (!cl || cl->state != CL_UP)
        return -1;
    cl_node *n = slot_node(cl, slot);
    if (!node_usable(n))
        return -1;
    cl_cmd *k = cg_calloc(1, sizeof(*k));
    k->text = cg_malloc(len);
    memcpy(k->text, cmd, len);
    k->len = len;
    k->cl = cl;
    k->slot = slot & (CG_REDIS_SLOTS - 1);
    k->cb = cb;
    k->priv = priv;
    if (send_to(n, k, 0) < 0) {
        free(k->text);
        free(k);
        return -1;
    }
    return 0;
}

cg_redis_conn *cg_redis_cluster_conn(cg_redis_cluster *cl, unsigned slot)
{
    if (!cl || cl->state != CL_UP)
        return NULL;
    cl_node *n = slot_node(cl, slot);
    return n ? n->conn : NULL;
}

int cg_redis_cluster_stalled(cg_redis_cluster *cl, unsigned slot, const char *why)
{
    if (!cl || cl->state != CL_UP)
        return -1;
    cl_node *n = slot_node(cl, slot);
    if (!n || !n->conn)
        return -1;
    cg_redis_conn *c = n->conn;
    n->conn = NULL; /* its close event is then no news */
    cg_redis_conn_close(c);
    node_lost(n, why);
    return 0;
}

static void on_start(uv_timer_t *t)
{
    ask_seed(t->data);
}

cg_redis_cluster *cg_redis_cluster_open(const cg_redis_cluster_config *cfg)
{
    cg_redis_cluster *cl = cg_calloc(1, sizeof(*cl));
    cl->cfg = *cfg;
    cl->seed_hosts = cg_calloc((size_t)cfg->n_seeds, sizeof(char *));
    cl->seed_ports = cg_calloc((size_t)cfg->n_seeds, sizeof(int));
    for (int i = 0; i < cfg->n_seeds; i++) {
        cl->seed_hosts[i] = cg_strdup(cfg->seed_hosts[i]);
        cl->seed_ports[i] = cfg->seed_ports[i];
    }
    cl->user = cfg->user ? cg_strdup(cfg->user) : NULL;
    cl->password = cfg->password ? cg_strdup(cfg->password) : NULL;
    uv_timer_init(cfg->loop, &cl->timer);
    cl->timer.data = cl;
    uv_timer_init(cfg->loop, &cl->refresh);
    cl->refresh.data = cl;
    cl->handles = 2;
    cl->state = CL_ASKING;
    uv_timer_start(&cl->timer, on_start, 0, 0); /* from the loop: never a callback inside open */
    return cl;
}
