/*
 * test_keepalive.c: the pings of quiet WebSocket connections and the hang-up of silent ones
 * (core/keepalive.h) on a real libuv loop, with a fake socket (its io table) that records
 * what is asked of it. Connections are pinged in the order they fell quiet, once the ping
 * interval has passed since their last frame; a ping goes from the writable callback, not
 * behind a frame half out; a frame puts a connection back at the end of the quiet ones; a
 * pinged one that stays silent is hung up at its idle timeout, counted, and one that spoke is
 * not; a removed one is never touched again; the timer stops when nothing is watched; a
 * failed ping is the callback's error; a NULL keepalive does nothing.
 */
#include <string.h>
#include <uv.h>

#include "chatgate/core/keepalive.h"
#include "chatgate/core/net.h"
#include "unit.h"

static uv_loop_t loop;
static cg_net net;
static cg_keepalive ka;
static cg_metrics metrics;

/* ---- the fake socket --------------------------------------------------------------------- */

/* Three connections: the fake's wsi are the addresses of these bytes. */
static char socks[3];
#define WSI(i) ((struct lws *)&socks[(i)-1])

static char log_[1024]; /* "W:n|" writable asked, "P:n|" a ping written, "H:n|" hung up */
static int partial, fail_ping;

static void note(char what, struct lws *wsi)
{
    size_t used = strlen(log_);
    snprintf(log_ + used, sizeof(log_) - used, "%c:%d|", what, (int)((char *)wsi - socks) + 1);
}

static void fake_want_writable(struct lws *wsi)
{
    note('W', wsi);
}

static int fake_partial(struct lws *wsi)
{
    (void)wsi;
    return partial;
}

static int fake_ping(struct lws *wsi)
{
    if (fail_ping)
        return -1;
    note('P', wsi);
    return 0;
}

static void fake_hang_up(const cg_net *n, struct lws *wsi)
{
    CHECK(n == &net);
    note('H', wsi);
}

static const cg_keepalive_io fake_io = {
    .want_writable = fake_want_writable,
    .partial = fake_partial,
    .ping = fake_ping,
    .hang_up = fake_hang_up,
};

/* The keepalive's timer does not keep a loop alive (it is unref'd): this one does while a
 * case waits. */
static uv_timer_t keeper;

static void on_keeper(uv_timer_t *t)
{
    (void)t;
}

/* Runs the loop until done() (or 2 s pass): 1 when it is. */
static int run_while(int (*done)(void))
{
    uint64_t deadline = uv_now(&loop) + 2000;
    uv_timer_start(&keeper, on_keeper, 5, 5);
    while (!done() && uv_now(&loop) < deadline)
        uv_run(&loop, UV_RUN_ONCE);
    uv_timer_stop(&keeper);
    return done();
}

static const char *wanted;

static int log_has_wanted(void)
{
    return strstr(log_, wanted) != NULL;
}

/* Runs the loop until the log holds want (or 2 s pass): 1 when it does. */
static int run_until(const char *want)
{
    wanted = want;
    return run_while(log_has_wanted);
}

static int timer_stopped(void)
{
    return !uv_is_active((uv_handle_t *)&ka.timer);
}

/* ---- the cases --------------------------------------------------------------------------- */

/* Far apart, and b's frame comes at SPOKE_MS, between them: a stall of a slow machine of
 * up to 300 ms anywhere does not change which connection is hung up. */
#define PING_MS 100
#define SPOKE_MS 300
#define IDLE_MS 600

static uint64_t spoke_at;

static int spoke_due(void)
{
    return uv_now(&loop) >= spoke_at;
}

static void test_pings_and_hang_ups(void)
{
    cg_keepalive_item a, b, c;
    uint64_t start = uv_now(&loop);
    cg_keepalive_add(&ka, &a, WSI(1));
    cg_keepalive_add(&ka, &b, WSI(2));
    cg_keepalive_add(&ka, &c, WSI(3));
    CHECK(uv_is_active((uv_handle_t *)&ka.timer));
    CHECK(cg_keepalive_writable(&ka, &a) == 0); /* nothing due yet: nothing written */
    CHECK_STR(log_, "");

    /* quiet for the ping interval: each asks for its writable, in the order they came */
    CHECK(run_until("W:3|"));
    CHECK_STR(log_, "W:1|W:2|W:3|");
    CHECK(uv_now(&loop) - start >= PING_MS);

    /* the ping goes from the writable callback, once */
    CHECK(cg_keepalive_writable(&ka, &a) == 0);
    CHECK(cg_keepalive_writable(&ka, &a) == 0);
    CHECK(metrics.ws_pings == 1);
    /* not behind a frame half out: the writable is asked for again */
    partial = 1;
    CHECK(cg_keepalive_writable(&ka, &b) == 0);
    partial = 0;
    CHECK(cg_keepalive_writable(&ka, &b) == 0);
    CHECK_STR(log_, "W:1|W:2|W:3|P:1|W:2|P:2|");

    /* b speaks: quiet again, at the end of the list; a and c stay silent */
    spoke_at = start + SPOKE_MS;
    CHECK(run_while(spoke_due));
    CHECK(strstr(log_, "H:") == NULL);
    cg_keepalive_seen(&ka, &b);
    log_[0] = 0;
    CHECK(run_until("H:3|"));
    CHECK(uv_now(&loop) - start >= IDLE_MS);
    /* a and c hung up at their idle timeout, in order, b pinged again (its own interval
     * from its frame) and not hung up */
    CHECK(strstr(log_, "H:1|H:3|") != NULL);
    CHECK(strstr(log_, "W:2|") != NULL);
    CHECK(strstr(log_, "H:2|") == NULL);
    CHECK(metrics.ws_idle_hangups == 2);
    CHECK(a.state == CG_KEEPALIVE_OFF && c.state == CG_KEEPALIVE_OFF);
    CHECK(b.state == CG_KEEPALIVE_PINGED);

    /* the owner's close callback removes them (a no-op for the two hung up) */
    cg_keepalive_remove(&ka, &a);
    cg_keepalive_remove(&ka, &c);
    cg_keepalive_remove(&ka, &b);
    CHECK(b.state == CG_KEEPALIVE_OFF);
    CHECK(cg_keepalive_writable(&ka, &b) == 0); /* its due ping is gone with it */
    log_[0] = 0;
    CHECK(run_while(timer_stopped)); /* nothing watched: no timer */
    CHECK_STR(log_, "");
    CHECK(metrics.ws_idle_hangups == 2);
}

static void test_failed_ping(void)
{
    cg_keepalive_item a;
    log_[0] = 0;
    cg_keepalive_add(&ka, &a, WSI(1));
    CHECK(run_until("W:1|"));
    fail_ping = 1;
    CHECK(cg_keepalive_writable(&ka, &a) == -1); /* the callback returns -1: lws closes it */
    fail_ping = 0;
    cg_keepalive_remove(&ka, &a);
}

static void test_null(void)
{
    cg_keepalive_item a;
    memset(&a, 0, sizeof(a));
    cg_keepalive_add(NULL, &a, WSI(1));
    cg_keepalive_seen(NULL, &a);
    CHECK(cg_keepalive_writable(NULL, &a) == 0);
    cg_keepalive_remove(NULL, &a);
    CHECK(a.wsi == NULL);
}

static void test_close(void)
{
    cg_keepalive_item a, b;
    cg_keepalive_add(&ka, &a, WSI(1));
    cg_keepalive_add(&ka, &b, WSI(2));
    cg_keepalive_close(&ka);
    CHECK(a.state == CG_KEEPALIVE_OFF && b.state == CG_KEEPALIVE_OFF);
    cg_keepalive_seen(&ka, &a); /* closed: watches nothing more */
    CHECK(a.state == CG_KEEPALIVE_OFF);
    uv_run(&loop, UV_RUN_DEFAULT); /* the timer's close */
}

int main(void)
{
    uv_loop_init(&loop);
    uv_timer_init(&loop, &keeper);
    net.loop = &loop;
    cg_keepalive_init(&ka, &net, 1, 2, &metrics);
    ka.io = &fake_io;
    ka.ping_ms = PING_MS; /* the intervals a test can wait for */
    ka.idle_ms = IDLE_MS;
    test_pings_and_hang_ups();
    test_failed_ping();
    test_null();
    test_close();
    uv_close((uv_handle_t *)&keeper, NULL);
    uv_run(&loop, UV_RUN_DEFAULT);
    CHECK(uv_loop_close(&loop) == 0);
    return unit_done("keepalive");
}
