/*
 * redis_link.h: the store's Redis, whatever its topology, up or down. It knows nothing of
 * dialogs (the way h2o's lib/common/redis.c sits under its users):
 *   - one node (redis[s]://): resolve off the loop, connect (redis_client.c), AUTH and
 *     SELECT, the PING probe;
 *   - Sentinel (redis[s]-sentinel://): the primary asked of the Sentinels
 *     (redis_sentinel.c) before each connect, ROLE added to the probe, +switch-master and
 *     -READONLY followed;
 *   - Cluster (redis[s]-cluster://): the router (redis_cluster.c), up once every master
 *     answered.
 * A connect is bounded by the connect timeout, every command by the command timeout (the
 * link's in-flight list, oldest first, watched by a 100 ms tick); a failure closes the
 * connection (its commands get NULL), says down, and reconnects with backoff and jitter.
 * Scripts go by SHA; a NOSCRIPT answer sends the same command once more as EVAL with the
 * script's text, to the node that lacked it.
 */
#ifndef CHATGATE_STORE_REDIS_LINK_H
#define CHATGATE_STORE_REDIS_LINK_H

#include <stddef.h>
#include <uv.h>

#include "chatgate/store/redis_client.h"
#include "chatgate/store/store.h"

struct cg_flusher;

typedef struct cg_redis_link cg_redis_link;

typedef struct cg_redis_link_config {
    uv_loop_t *loop;
    struct cg_flusher *flush;
    cg_redis_tls *tls;
    /* one node: its host (resolved before each connect), port, database */
    const char *host;
    int port, db;
    /* Sentinel: the master's name and the Sentinels (taken: freed with the link) */
    const char *master;
    char **sentinel_hosts;
    int *sentinel_ports;
    int n_sentinels;
    /* Cluster: the seeds (copied) */
    char **seed_hosts;
    int *seed_ports;
    int n_seeds;
    const char *user, *password; /* AUTH on every connection; NULL: none */
    long connect_timeout_ms, command_timeout_ms;
    /* up: commands can go (primary_moved: Sentinel named another primary than the last
     * one trusted); down: why (each failure, the first of an outage and the retries) */
    void (*on_up)(void *data, int primary_moved);
    void (*on_down)(void *data, const char *why);
    /* Cluster: slots (a bitmap, as cg_redis_cluster_config's on_failover) went from a lost
     * master to a replica promoted, while the link stayed up */
    void (*on_failover)(void *data, const unsigned char *slots);
    void *data;
    cg_store_stats *stats; /* errors, reconnects, primary_switches, not-primary and cluster counts */
} cg_redis_link_config;

/* Starts connecting (from the loop); NULL out of memory. */
cg_redis_link *cg_redis_link_open(const cg_redis_link_config *cfg);
/* Commands can go now: connected, and not closed (a link closing drains its commands in
 * flight for up to a second, and takes theirs meanwhile: a save's merge, a lease let go). */
int cg_redis_link_up(const cg_redis_link *ln);
/* Sends a whole RESP command whose keys are in slot; 0, or -1 when the link is down (cb is
 * then never called). cb gets the answer, or NULL when the link went down first. */
int cg_redis_link_send(cg_redis_link *ln, unsigned slot, const char *cmd, size_t len, cg_redis_reply_fn *cb,
                       void *priv);
/* The same for a script command, EVALSHA <sha> ...: on NOSCRIPT it goes once more as EVAL
 * with text (not copied: it must live as long as the link, as the scripts' static texts do). */
int cg_redis_link_script(cg_redis_link *ln, unsigned slot, const char *cmd, size_t len, const char *text,
                         cg_redis_reply_fn *cb, void *priv);
/* The connection to the master of slot (a cluster's; the one node's otherwise), or NULL. */
cg_redis_conn *cg_redis_link_conn(cg_redis_link *ln, unsigned slot);
/* A connect is under way (resolving, asking the Sentinels, connecting, probing). */
int cg_redis_link_connecting(const cg_redis_link *ln);
/* Waiting for the backoff: connects now instead (nothing when up, connecting or closing); a
 * try that fails goes back to the backoff, on_down said. */
void cg_redis_link_connect_now(cg_redis_link *ln);
/* Commands in flight. */
int cg_redis_link_pending(const cg_redis_link *ln);
/* "host:port" the link is about, for logs. */
const char *cg_redis_link_name(const cg_redis_link *ln);
/* Closes: at once, or once the commands in flight are answered (at most a second). closed is
 * called when done; no on_up or on_down after this call. */
void cg_redis_link_close(cg_redis_link *ln, void (*closed)(void *data));

#endif
