/*
 * keepalive.c: pings of quiet WebSocket connections and the hang-up of silent ones (see
 * keepalive.h for why not lws's).
 *
 * Both lists are in the order of seen_ms: an item enters the quiet one at its tail with the
 * loop's time, which never goes back, and enters the pinged one from the quiet one's head.
 * So the earliest deadline of each list is at its head, and the timer is armed for the
 * earlier of the two.
 */
#include "chatgate/core/keepalive.h"

#include "chatgate/core/net.h"

static void on_tick(uv_timer_t *t);

static void lws_want_writable(struct lws *wsi)
{
    lws_callback_on_writable(wsi);
}

static int lws_partial(struct lws *wsi)
{
    return lws_partial_buffered(wsi);
}

/* A ping with a payload: lws 4.1 tells the protocol of no pong that comes back empty. */
static int lws_ping(struct lws *wsi)
{
    unsigned char buf[LWS_PRE + 2] = {[LWS_PRE] = 'c', [LWS_PRE + 1] = 'g'};
    return lws_write(wsi, buf + LWS_PRE, 2, LWS_WRITE_PING) < 2 ? -1 : 0;
}

/* Abrupt, as a peer that answers nothing would not read a close frame: the owner hears of
 * it from lws's close callback, and removes its item (a no-op by then). */
static void lws_hang_up(const cg_net *net, struct lws *wsi)
{
    cg_net_kill_async(net, wsi, PENDING_TIMEOUT_USER_OK);
}

const cg_keepalive_io cg_keepalive_lws_io = {
    .want_writable = lws_want_writable,
    .partial = lws_partial,
    .ping = lws_ping,
    .hang_up = lws_hang_up,
};

void cg_keepalive_init(cg_keepalive *k, const cg_net *net, unsigned ping_s, unsigned idle_s,
                       cg_metrics *metrics)
{
    k->io = &cg_keepalive_lws_io;
    k->net = net;
    k->metrics = metrics;
    k->ping_ms = (uint64_t)ping_s * 1000;
    k->idle_ms = (uint64_t)idle_s * 1000;
    TAILQ_INIT(&k->quiet);
    TAILQ_INIT(&k->pinged);
    k->closed = 0;
    uv_timer_init(net->loop, &k->timer);
    k->timer.data = k;
    uv_unref((uv_handle_t *)&k->timer); /* never what keeps the loop running */
}

static void unlink_item(cg_keepalive *k, cg_keepalive_item *it)
{
    if (it->state == CG_KEEPALIVE_QUIET)
        TAILQ_REMOVE(&k->quiet, it, link);
    else if (it->state == CG_KEEPALIVE_PINGED)
        TAILQ_REMOVE(&k->pinged, it, link);
    it->state = CG_KEEPALIVE_OFF;
}

void cg_keepalive_close(cg_keepalive *k)
{
    cg_keepalive_item *it;
    while ((it = TAILQ_FIRST(&k->quiet)))
        unlink_item(k, it);
    while ((it = TAILQ_FIRST(&k->pinged)))
        unlink_item(k, it);
    k->closed = 1;
    uv_close((uv_handle_t *)&k->timer, NULL);
}

/* The timer for the earliest deadline of the two heads; stopped when both lists are empty. */
static void arm(cg_keepalive *k)
{
    cg_keepalive_item *q = TAILQ_FIRST(&k->quiet), *p = TAILQ_FIRST(&k->pinged);
    if (!q && !p) {
        uv_timer_stop(&k->timer);
        return;
    }
    uint64_t due = UINT64_MAX;
    if (q)
        due = q->seen_ms + k->ping_ms;
    if (p && p->seen_ms + k->idle_ms < due)
        due = p->seen_ms + k->idle_ms;
    uint64_t now = uv_now(k->timer.loop);
    uv_timer_start(&k->timer, on_tick, due > now ? due - now : 0, 0);
}

static void on_tick(uv_timer_t *t)
{
    cg_keepalive *k = t->data;
    uint64_t now = uv_now(t->loop);
    cg_keepalive_item *it;
    while ((it = TAILQ_FIRST(&k->quiet)) && it->seen_ms + k->ping_ms <= now) {
        TAILQ_REMOVE(&k->quiet, it, link);
        TAILQ_INSERT_TAIL(&k->pinged, it, link);
        it->state = CG_KEEPALIVE_PINGED;
        it->ping_due = 1;
        k->io->want_writable(it->wsi);
    }
    while ((it = TAILQ_FIRST(&k->pinged)) && it->seen_ms + k->idle_ms <= now) {
        unlink_item(k, it);
        if (k->metrics)
            k->metrics->ws_idle_hangups++;
        k->io->hang_up(k->net, it->wsi);
    }
    arm(k);
}

void cg_keepalive_add(cg_keepalive *k, cg_keepalive_item *it, struct lws *wsi)
{
    if (!k)
        return;
    it->wsi = wsi;
    it->state = CG_KEEPALIVE_OFF;
    it->ping_due = 0;
    cg_keepalive_seen(k, it);
}

void cg_keepalive_seen(cg_keepalive *k, cg_keepalive_item *it)
{
    if (!k || k->closed || !it->wsi)
        return;
    unlink_item(k, it);
    it->seen_ms = uv_now(k->timer.loop);
    TAILQ_INSERT_TAIL(&k->quiet, it, link);
    it->state = CG_KEEPALIVE_QUIET;
    /* a tail's deadline is the latest: the timer, running while any item is watched, moves
     * only for a first one */
    if (!uv_is_active((uv_handle_t *)&k->timer))
        arm(k);
}

void cg_keepalive_remove(cg_keepalive *k, cg_keepalive_item *it)
{
    if (k)
        unlink_item(k, it);
    it->wsi = NULL;
    it->ping_due = 0;
}

int cg_keepalive_writable(cg_keepalive *k, cg_keepalive_item *it)
{
    if (!k || !it->ping_due || !it->wsi)
        return 0;
    if (k->io->partial(it->wsi)) { /* a frame is half out: the ping goes after it */
        k->io->want_writable(it->wsi);
        return 0;
    }
    it->ping_due = 0;
    if (k->io->ping(it->wsi) < 0)
        return -1;
    if (k->metrics)
        k->metrics->ws_pings++;
    return 0;
}
