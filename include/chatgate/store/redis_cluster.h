/*
 * redis_cluster.h: Redis Cluster, natively (redis-cluster://SEED[,SEED...]).
 *
 * The cluster spec's client rules, in two parts:
 *   - pure functions (redis_slots.c): a key's slot (CRC16 of its hash tag, mod 16384), the
 *     slot map read from CLUSTER SLOTS, and the redirects a node answers (MOVED, ASK,
 *     TRYAGAIN, CLUSTERDOWN); unit-tested without a server (tests/unit/test_redis_slots.c);
 *   - the router (redis_cluster.c): one connection per master (redis_client.h), every command
 *     sent to the master of its slot, MOVED followed (the slot's owner updated, the map read
 *     again), ASK followed (ASKING, then the command, at the target), TRYAGAIN and
 *     CLUSTERDOWN retried with a backoff, a bounded number of times.
 *
 * To the store the cluster is one connection: up once the map is read and every master
 * answered PING; down (and reconnected with the store's backoff) when no master answers.
 * One master lost is its slots' outage only: their commands fail at once (send returns -1,
 * or the answer is NULL) while the map is read again until a master answers for them.
 * Writes go to masters only: the map names a slot's master first, and replicas are never
 * connected to.
 */
#ifndef CHATGATE_STORE_REDIS_CLUSTER_H
#define CHATGATE_STORE_REDIS_CLUSTER_H

#include <hiredis/hiredis.h>
#include <stddef.h>
#include <stdint.h>
#include <uv.h>

#include "chatgate/store/redis_client.h"
#include "chatgate/store/store.h"

#define CG_REDIS_SLOTS 16384
#define CG_REDIS_CLUSTER_MAX_NODES 256 /* masters a map may name */

/* CRC16-CCITT (XMODEM), the cluster's: "123456789" gives 0x31C3. */
unsigned cg_redis_crc16(const char *buf, size_t len);
/* The slot of a key: of its hash tag (what is between the first '{' and the next '}', when
 * not empty), else of the whole key. */
unsigned cg_redis_key_slot(const char *key, size_t len);

typedef enum {
    CG_REDIRECT_NONE,
    CG_REDIRECT_MOVED,      /* the slot lives elsewhere now: update the map */
    CG_REDIRECT_ASK,        /* the slot is migrating: this key is at the target, once */
    CG_REDIRECT_TRYAGAIN,   /* a multi-key command during a migration: retry a little later */
    CG_REDIRECT_CLUSTERDOWN /* the cluster cannot serve (a failover under way) */
} cg_redis_redirect_kind;

typedef struct cg_redis_redirect {
    cg_redis_redirect_kind kind;
    int slot;       /* MOVED and ASK */
    char host[64];  /* MOVED and ASK: an IP address (or a name, IPv6 without brackets) */
    int port;
} cg_redis_redirect;

/* Reads an error reply's text (len bytes); the kind (NONE: an error of another kind). A
 * MOVED or ASK whose slot, host or port is malformed is NONE: it is passed on as an error. */
cg_redis_redirect_kind cg_redis_parse_redirect(const char *err, size_t len, cg_redis_redirect *out);

typedef struct cg_redis_node_addr {
    char host[64];
    int port;
} cg_redis_node_addr;

/* The slot map: which master serves each slot. */
typedef struct cg_redis_slot_map {
    int n_nodes;
    cg_redis_node_addr nodes[CG_REDIS_CLUSTER_MAX_NODES];
    int16_t owner[CG_REDIS_SLOTS]; /* index into nodes, or -1: no master (the cluster is down there) */
} cg_redis_slot_map;

/* Fills m from a CLUSTER SLOTS reply; 0, or -1 with err saying what is malformed. A node
 * given with an empty host ("" or "?": the node answering) takes seed_host. */
int cg_redis_slot_map_read(const redisReply *r, const char *seed_host, cg_redis_slot_map *m, char *err,
                           size_t errlen);
/* The node index of host:port in m, added when new; -1 when the table is full. */
int cg_redis_slot_map_node(cg_redis_slot_map *m, const char *host, int port);

/* ---- the router ------------------------------------------------------------------------ */

typedef struct cg_redis_cluster cg_redis_cluster;

typedef cg_store_cluster_stats cg_redis_cluster_stats; /* store.h: what the metrics show */

typedef struct cg_redis_cluster_config {
    uv_loop_t *loop;
    struct cg_flusher *flush;
    cg_redis_tls *tls;
    const char *user, *password; /* AUTH on every node; NULL: none */
    const char *const *seed_hosts; /* numeric addresses, resolved by the caller */
    const int *seed_ports;
    int n_seeds;
    /* up: the map is read and every master answered; 0: lost (why: no master answers, or
     * one was lost before up), the router is closed and must not be used after this call
     * returns */
    void (*on_state)(void *data, int up, const char *why);
    /* a map read again names another master for slots of a lost one (a replica promoted):
     * slots is a bitmap of those (bit s % 8 of byte s / 8); what the lost master took last
     * may not have reached its replica. May be NULL. */
    void (*on_failover)(void *data, const unsigned char *slots);
    void *data;
    cg_redis_cluster_stats *stats; /* counted into; may be NULL */
} cg_redis_cluster_config;

/* Starts: asks the seeds in turn for the map, connects every master. NULL out of memory. */
cg_redis_cluster *cg_redis_cluster_open(const cg_redis_cluster_config *cfg);
/* Sends a whole RESP command for slot (copied, for redirects); 0, or -1 when the router is
 * not up or is closing (cb is then never called). cb gets the final reply, after redirects,
 * with the connection that gave it, or NULL when the router went down first. */
int cg_redis_cluster_send(cg_redis_cluster *cl, unsigned slot, const char *cmd, size_t len, cg_redis_reply_fn *cb,
                          void *priv);
/* The connection to the master of slot now (pub/sub asks it), or NULL. */
cg_redis_conn *cg_redis_cluster_conn(cg_redis_cluster *cl, unsigned slot);
/* The master of slot left a command unanswered too long (why): stopped, or cut off. Its
 * connection is dropped (its commands get NULL now) and it is lost as a closed one is: its
 * slots' outage, the map read again, or the router's end when no master answers. 0, or -1
 * when the slot has no connected master (nothing done). */
int cg_redis_cluster_stalled(cg_redis_cluster *cl, unsigned slot, const char *why);
/* Closes every connection: commands waiting get NULL; on_state is not called. */
void cg_redis_cluster_close(cg_redis_cluster *cl);

#endif
