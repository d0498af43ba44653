/*
 * master.h: --workers N: N worker processes serving one port under a small master process
 * (src/server/master.c), and the memory they share for /metrics and /healthz.
 *
 * The master forks the workers, starts again one that dies (after a pause when it keeps
 * dying at once), passes SIGHUP and SIGTERM/SIGINT on to all of them and exits when they
 * have gone after a SIGTERM. It never runs the gateway itself. Each worker is an ordinary
 * gateway (gateway.c) that opens its own listening socket with SO_REUSEPORT, so the kernel
 * spreads connections over the workers, and hands each accepted socket to libwebsockets.
 *
 * Shared figures: the master maps one MAP_SHARED area before the first fork. Worker i
 * copies its counters, its store's figures and its connection count into slots[i] every
 * CG_WORKER_PUBLISH_MS (and before answering /metrics itself); whichever worker answers
 * /metrics sums the slots. Each slot has one writer (its worker; the master only after the
 * worker is gone), so no lock: a reader may see a figure a publish period old. When a
 * worker dies the master adds its slot's counters to `retired`, so the sums never go back
 * when a worker starts again from zero.
 *
 * With --workers 1 (the default) there is no master and no shared area: cg_worker_self()
 * is NULL and the gateway listens and counts as it always did.
 */
#ifndef CHATGATE_SERVER_MASTER_H
#define CHATGATE_SERVER_MASTER_H

#include <sys/types.h>

#include "chatgate/config/config.h"
#include "chatgate/core/metrics.h"
#include "chatgate/store/store.h"

#define CG_WORKER_PUBLISH_MS 200

/* What one worker publishes; written by that worker only while it runs. */
typedef struct cg_worker_slot {
    cg_metrics metrics;
    cg_store_stats store;  /* degraded_seconds includes the outage going on */
    long connections;      /* WebSocket clients connected to this worker now */
    int listening;         /* it has started and listens (cg_worker_ready) */
} cg_worker_slot;

typedef struct cg_workers {
    int n;                          /* --workers */
    unsigned long restarts;         /* workers started again after one died (the master's) */
    cg_metrics retired;             /* the counters of workers that have died */
    cg_store_stats retired_store;   /* their store's counters (not its gauges) */
    /* the resume secret when CHATGATE_RESUME_SECRET is unset: random, but one for all the
     * workers, so a resume token works whichever worker the client reconnects to */
    unsigned char resume_secret[32];
    cg_worker_slot slots[];         /* n of them */
} cg_workers;

/*
 * Runs the master (cfg->workers > 1). Returns 1 in each worker process, which then starts
 * its gateway as usual, and calls cg_worker_ready() once listening. Returns 0 in the master
 * when it is done, with *exit_status: 0 after a SIGTERM/SIGINT drained every worker, the
 * status of a worker that could not start (1, or 2 for a bad setting), or 1 when the
 * master itself could not start.
 */
int cg_master_run(const cg_config *cfg, int *exit_status);

/* In a worker: it listens now (the master counts the start done, and passes signals on). */
void cg_worker_ready(void);

/* The shared area and this worker's slot; NULL without --workers (one process). */
cg_workers *cg_workers_shared(void);
cg_worker_slot *cg_worker_self(void);
int cg_worker_index(void); /* -1 without --workers */
/* A worker's master (0 without --workers): compared with getppid() before it is signalled,
 * as a worker whose master died has another parent. */
pid_t cg_worker_master(void);

#endif
