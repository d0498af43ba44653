/*
 * worker.c: a worker of --workers N (worker.h): the figures it copies into its slot of the
 * shared memory (master.h) for /metrics. Its listening sockets, shared with the other
 * workers through SO_REUSEPORT, are listener.c's.
 */
#include <uv.h>
#include <libwebsockets.h>

#include "chatgate/server/master.h"
#include "chatgate/server/worker.h"

static uv_timer_t publish_timer;
static int publishing;

void cg_worker_publish(const cg_server *srv)
{
    cg_worker_slot *slot = cg_worker_self();
    if (!slot)
        return;
    slot->metrics = srv->metrics;
    slot->connections = srv->n_sessions;
    if (srv->turn.store) {
        slot->store = srv->turn.store->stats;
        /* the outage going on counts too */
        slot->store.degraded_seconds = cg_store_degraded_seconds(&srv->turn.store->stats, uv_now(srv->net.loop));
    }
}

static void on_publish(uv_timer_t *t)
{
    cg_worker_publish(t->data);
}

void cg_worker_publish_start(const cg_server *srv)
{
    if (!cg_worker_self())
        return;
    uv_timer_init(srv->net.loop, &publish_timer);
    publish_timer.data = (void *)srv;
    uv_timer_start(&publish_timer, on_publish, CG_WORKER_PUBLISH_MS, CG_WORKER_PUBLISH_MS);
    publishing = 1;
}

void cg_worker_stop(const cg_server *srv)
{
    if (publishing) {
        cg_worker_publish(srv);
        uv_timer_stop(&publish_timer);
        uv_close((uv_handle_t *)&publish_timer, NULL);
        publishing = 0;
    }
}
