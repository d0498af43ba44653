/*
 * redis_sentinel.h: Redis Sentinel, the second of the three topologies under the store
 * (beside one node and the cluster, redis_cluster.h). It knows nothing of dialogs: it asks
 * the Sentinels which node is the primary of a master, and follows +switch-master.
 *
 * Asking: SENTINEL get-master-addr-by-name on a short connection to each Sentinel in turn,
 * each within the timeout, until one names the primary; the answer (or why none did) comes
 * to on_answer. Following: a second connection, to one Sentinel, SUBSCRIBEd to
 * +switch-master; a message naming our master comes to on_switch; lost, the subscription
 * moves to the next Sentinel a second later. Connections go through redis_client.h (TLS for
 * rediss-sentinel://).
 */
#ifndef CHATGATE_STORE_REDIS_SENTINEL_H
#define CHATGATE_STORE_REDIS_SENTINEL_H

#include <uv.h>

#include "chatgate/store/redis_client.h"

struct cg_flusher;

typedef struct cg_redis_sentinel cg_redis_sentinel;

typedef struct cg_redis_sentinel_config {
    uv_loop_t *loop;
    struct cg_flusher *flush;
    cg_redis_tls *tls;     /* NULL: plain TCP */
    const char *master;    /* the master's name at the Sentinels (copied) */
    char **hosts;          /* the Sentinels, as in the URL: taken (freed with the module) */
    int *ports;            /* taken too */
    int n;
    long timeout_ms;       /* each question, and the subscription's connect */
    /* the primary's host and port, or host NULL and why: none of the Sentinels named it */
    void (*on_answer)(void *data, const char *host, int port, const char *why);
    /* +switch-master for our master: its new primary, and the Sentinel that said so */
    void (*on_switch)(void *data, const char *host, int port, const char *sentinel);
    void *data;
} cg_redis_sentinel_config;

/* Starts following +switch-master; NULL out of memory. */
cg_redis_sentinel *cg_redis_sentinel_open(const cg_redis_sentinel_config *cfg);
/* Asks the Sentinels, starting with the last that answered; quiet: their failures are logged
 * at debug (the store is degraded already). The answer comes from the loop, never inside. */
void cg_redis_sentinel_ask(cg_redis_sentinel *sn, int quiet);
/* Gives up the question under way, if any: on_answer is not called for it. */
void cg_redis_sentinel_abort(cg_redis_sentinel *sn);
/* Closes its connections and timers; frees it once they are closed. No more callbacks. */
void cg_redis_sentinel_close(cg_redis_sentinel *sn);

#endif
