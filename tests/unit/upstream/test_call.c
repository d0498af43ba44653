/*
 * test_call.c: the call core (upstream/call.c) driven through a fake kind, on a real uv loop,
 * with no socket: the kind writes down every attempt, stop, pause and release it is asked
 * for, and the caller's events every delta, done and error they hear. Deadlines are real uv
 * timers of tens of milliseconds; every run of the loop is bounded by a guard timer of ours,
 * so a deadline that never fires fails a CHECK instead of hanging the test.
 *
 * What each case checks: exactly one of done or error per call that started, none after a
 * cancel or the end, none from inside start; release once, after the caller heard the end;
 * the replica each attempt goes to (the dialog's, another one after a failure, never one
 * already tried); which failures are retried (before any reply text, while attempts are
 * left) and which are not; how long a failed replica stays out; and which deadline ends a
 * call, when, and with what message.
 */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "chatgate/core/error.h"
#include "chatgate/core/log.h"
#include "chatgate/upstream/call.h"
#include "unit.h"

#define T_MS 30       /* every phase's deadline in these cases */
#define OUT_MS 1000   /* a failed replica's time out */
#define GUARD_MS 2000 /* the longest any wait for an event may take */

/* ---- the world: a loop, an upstream "llm" of n replicas, its metrics ---------------------- */

typedef struct world {
    uv_loop_t loop;
    uv_timer_t guard; /* ends each run_for */
    int guard_fired;
    cg_upstream_config cfg;
    cg_net net;
    cg_metrics metrics;
    cg_upstream up;
    cg_replicas reps;
} world;

static world W; /* cg_metrics is large: not on the stack */

static void guard_cb(uv_timer_t *t)
{
    ((world *)t->data)->guard_fired = 1;
}

static world *world_open(int n_replicas, int max_attempts)
{
    world *w = &W;
    memset(w, 0, sizeof(*w));
    if (uv_loop_init(&w->loop) != 0)
        abort();
    uv_timer_init(&w->loop, &w->guard);
    w->guard.data = w;
    w->cfg.name = "llm";
    w->cfg.connect_timeout_ms = T_MS;
    w->cfg.first_byte_timeout_ms = T_MS;
    w->cfg.idle_timeout_ms = T_MS;
    w->cfg.max_attempts = max_attempts;
    w->cfg.out_ms = OUT_MS;
    w->cfg.n_replicas = n_replicas > 1 ? n_replicas : 0;
    w->net.loop = &w->loop;
    w->up.cfg = &w->cfg;
    w->up.net = &w->net;
    w->up.metrics = &w->metrics;
    w->up.index = 0;
    w->reps.n = n_replicas;
    return w;
}

static void world_close(world *w)
{
    uv_close((uv_handle_t *)&w->guard, NULL);
    uv_run(&w->loop, UV_RUN_NOWAIT);
    CHECK(uv_loop_close(&w->loop) == 0); /* every fake's clock was closed */
}

/* Runs the loop until *until is nonzero (NULL: never) or ms of loop time have passed. 1 when
 * it stopped for *until. */
static int run_for(world *w, uint64_t ms, const int *until)
{
    uv_update_time(&w->loop);
    w->guard_fired = 0;
    uv_timer_start(&w->guard, guard_cb, ms, 0);
    while (!w->guard_fired && !(until && *until))
        uv_run(&w->loop, UV_RUN_ONCE);
    uv_timer_stop(&w->guard);
    return until && *until;
}

static uint64_t now(world *w)
{
    return uv_now(&w->loop);
}

/* ---- the fake kind, and the caller's events, one record per call -------------------------- */

typedef struct fake {
    cg_call core; /* first: the core's call is this */
    cg_call_clock clock;
    world *w;
    /* how the kind behaves */
    cg_call_phase arm;   /* what attempt arms: CONNECT (a new connection), FIRST_BYTE (one open) */
    unsigned fail_mask;  /* replicas whose attempt cannot start (-1) */
    int drain_on_done;   /* stop(DONE) arms CG_CALL_DRAIN, as openai does */
    /* what the kind was asked */
    int attempts[16], n_attempts;
    cg_call_stop stops[16];
    cg_call_phase stop_phase[16];
    int n_stops;
    int pauses;
    int releases;
    /* what the caller heard */
    char said[256];
    int deltas, dones, errors;
    int err, status;
    char message[256];
    uint64_t ended_at;             /* uv_now() at the done or error */
    int released_at_end;           /* release had come before the done or error */
    int ans_replica, ans_attempts; /* answered() inside on_done */
    int cancelled;                 /* the test cancelled the call */
    int late;                      /* events after the end, a cancel or release */
    int from_start;                /* events from inside cg_call_start */
    char log[512];                 /* "a2 delta s:done done rel" */
} fake;

static int in_start;

static void note(fake *f, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void note(fake *f, const char *fmt, ...)
{
    size_t used = strlen(f->log);
    if (used && used + 1 < sizeof(f->log))
        f->log[used++] = ' ', f->log[used] = '\0';
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(f->log + used, sizeof(f->log) - used, fmt, ap);
    va_end(ap);
}

static const char *stop_word(cg_call_stop why)
{
    static const char *const words[] = {"done", "retry", "fail", "timeout", "cancel", "drained"};
    return (unsigned)why < sizeof(words) / sizeof(words[0]) ? words[why] : "?";
}

static int fk_attempt(cg_call *c, int r)
{
    fake *f = (fake *)c;
    note(f, "a%d", r);
    if (f->n_attempts < 16)
        f->attempts[f->n_attempts++] = r;
    if (f->arm != CG_CALL_NONE)
        cg_call_arm(c, f->arm); /* before it knows it failed, as openai arms CONNECT first */
    return f->fail_mask & (1u << r) ? -1 : 0;
}

static void fk_stop(cg_call *c, cg_call_stop why)
{
    fake *f = (fake *)c;
    note(f, "s:%s", stop_word(why));
    if (f->n_stops < 16) {
        f->stops[f->n_stops] = why;
        f->stop_phase[f->n_stops++] = c->phase;
    }
    if (why == CG_CALL_STOP_DONE && f->drain_on_done)
        cg_call_arm(c, CG_CALL_DRAIN);
}

static void fk_pause(cg_call *c, int paused)
{
    fake *f = (fake *)c;
    note(f, "p%d", paused);
    f->pauses++;
}

static void fk_release(cg_call *c)
{
    fake *f = (fake *)c;
    note(f, "rel");
    CHECK(c->ev == NULL); /* the call has ended when it is released */
    f->releases++;
}

static const cg_call_kind fake_kind = {
    .attempt = fk_attempt,
    .stop = fk_stop,
    .pause = fk_pause,
    .release = fk_release,
    .idle_words = "went quiet within",
};

/* Whatever an event finds wrong about when it came. */
static void event_came(fake *f)
{
    if (in_start)
        f->from_start++;
    if (f->dones || f->errors || f->cancelled || f->releases)
        f->late++;
}

static void ev_delta(void *ctx, const char *text, size_t len)
{
    fake *f = ctx;
    event_came(f);
    note(f, "delta");
    f->deltas++;
    size_t used = strlen(f->said);
    snprintf(f->said + used, sizeof(f->said) - used, "%.*s", (int)len, text);
}

static void ev_done(void *ctx, json_t *usage, json_t *state)
{
    (void)usage;
    (void)state;
    fake *f = ctx;
    event_came(f);
    note(f, "done");
    f->dones++;
    f->ended_at = now(f->w);
    f->released_at_end = f->releases;
    cg_call_answered(&f->core, &f->ans_replica, &f->ans_attempts); /* the call lives until release */
}

static void ev_error(void *ctx, int err, const char *message, json_t *detail)
{
    fake *f = ctx;
    event_came(f);
    note(f, "error");
    f->errors++;
    f->err = err;
    f->status = (int)json_integer_value(json_object_get(detail, "status"));
    snprintf(f->message, sizeof(f->message), "%s", message ? message : "(null)");
    f->ended_at = now(f->w);
    f->released_at_end = f->releases;
}

static const cg_upstream_events events = {.on_delta = ev_delta, .on_done = ev_done, .on_error = ev_error};

static void fake_open(world *w, fake *f, const char *user, const char *room)
{
    memset(f, 0, sizeof(*f));
    f->w = w;
    f->arm = CG_CALL_CONNECT;
    f->ans_replica = f->ans_attempts = -99;
    cg_call_init(&f->core, &w->up, &fake_kind, &w->reps, &events, f, user, room);
    cg_call_clock_init(&f->clock, &w->loop);
    f->core.clock = &f->clock;
}

static int fake_start(fake *f, int r)
{
    uv_update_time(&f->w->loop);
    in_start = 1;
    int rc = cg_call_start(&f->core, r);
    in_start = 0;
    return rc;
}

static void fake_cancel(fake *f)
{
    f->cancelled = 1;
    cg_call_cancel(&f->core);
}

/* What must hold of every call at its end: at most one terminal event, none late or from
 * inside start, release as many times as expected (1 once it ended, 0 when start failed),
 * and never before the caller heard the end. Then its clock goes. */
static void fake_close(fake *f, int releases)
{
    CHECK(f->dones + f->errors <= 1);
    CHECK(f->late == 0);
    CHECK(f->from_start == 0);
    CHECK(f->releases == releases);
    CHECK(f->released_at_end == 0);
    uv_close((uv_handle_t *)&f->clock.timer, NULL);
    uv_run(&f->w->loop, UV_RUN_NOWAIT); /* the close completes: f may go */
}

static int ends_with(const char *s, const char *tail)
{
    size_t n = strlen(s), t = strlen(tail);
    return n >= t && strcmp(s + n - t, tail) == 0;
}

/* The replica a call of the dialog goes to first now (the replicas' health as it is). */
static int first_replica(world *w, const char *user, const char *room)
{
    fake f;
    fake_open(w, &f, user, room);
    f.arm = CG_CALL_NONE;
    int r = fake_start(&f, -1) == 0 ? f.attempts[0] : -1;
    fake_cancel(&f);
    fake_close(&f, 1);
    return r;
}

/* Sends the end functions to a call that has ended: none of them may reach anyone. */
static void poke_ended(fake *f)
{
    char before[sizeof(f->log)];
    snprintf(before, sizeof(before), "%s", f->log);
    int attempts = f->core.attempts;
    cg_call_delta(&f->core, "late", 4);
    cg_call_done(&f->core, NULL, NULL);
    cg_call_fail(&f->core, CG_CALL_RETRY, "late", CG_E_UPSTREAM_UNAVAILABLE, NULL, "late");
    cg_call_fail(&f->core, CG_CALL_FINAL, NULL, CG_E_UPSTREAM_ERROR, NULL, "late");
    cg_call_pause(&f->core, 1);
    cg_call_pause(&f->core, 0);
    CHECK_STR(f->log, before);
    CHECK(f->core.attempts == attempts);
}

/* ---- 1. done ------------------------------------------------------------------------------- */

static void test_done(void)
{
    world *w = world_open(3, 3);
    int home = first_replica(w, "alice", "r1");
    CHECK(home >= 0 && home < 3);

    fake f;
    fake_open(w, &f, "alice", "r1");
    f.drain_on_done = 1;
    CHECK(fake_start(&f, -1) == 0);
    CHECK(f.n_attempts == 1 && f.attempts[0] == home);
    CHECK(f.core.phase == CG_CALL_CONNECT);
    cg_call_arm(&f.core, CG_CALL_FIRST_BYTE); /* the request went */
    cg_call_progress(&f.core);
    CHECK(f.core.phase == CG_CALL_IDLE);
    cg_call_delta(&f.core, "Hel", 3);
    cg_call_delta(&f.core, "lo", 2);
    CHECK(f.core.reply_bytes == 5);
    cg_call_done(&f.core, NULL, NULL);
    CHECK(f.dones == 1 && f.errors == 0 && f.releases == 1);
    CHECK_STR(f.said, "Hello");
    CHECK(f.ans_replica == home && f.ans_attempts == 1); /* answered() from inside on_done */
    char want[64];
    snprintf(want, sizeof(want), "a%d delta delta s:done done rel", home);
    CHECK_STR(f.log, want);
    CHECK(f.n_stops == 1 && f.stops[0] == CG_CALL_STOP_DONE);

    poke_ended(&f);
    /* the drain that openai's stop(DONE) armed still runs, for the kind alone */
    CHECK(f.core.phase == CG_CALL_DRAIN);
    uint64_t done_at = now(w);
    f.n_stops = 0; /* (to wait for the next stop) */
    CHECK(run_for(w, GUARD_MS, &f.n_stops) == 1);
    CHECK(f.stops[0] == CG_CALL_STOP_DRAINED && now(w) - done_at >= T_MS);
    run_for(w, 2 * T_MS, NULL);
    snprintf(want, sizeof(want), "a%d delta delta s:done done rel s:drained", home);
    CHECK_STR(f.log, want);
    CHECK(f.dones == 1 && f.errors == 0);
    CHECK(w->metrics.upstream_retries[0] == 0 && w->metrics.upstream_replica_outs[0] == 0);
    fake_close(&f, 1);

    /* one replica: answered() says the upstream has one (-1) */
    world_close(w);
    w = world_open(1, 3);
    fake_open(w, &f, "alice", "r1");
    CHECK(fake_start(&f, -1) == 0);
    CHECK(f.attempts[0] == 0);
    cg_call_done(&f.core, NULL, NULL);
    CHECK(f.dones == 1 && f.ans_replica == -1 && f.ans_attempts == 1);
    CHECK_STR(f.log, "a0 s:done done rel");
    run_for(w, 2 * T_MS, NULL); /* the connect deadline left armed finds the call ended */
    CHECK_STR(f.log, "a0 s:done done rel");
    fake_close(&f, 1);
    world_close(w);
}

/* ---- 2. cancel ----------------------------------------------------------------------------- */

static void test_cancel(void)
{
    world *w = world_open(3, 3);
    fake f;

    /* before any byte: the kind stops, releases, the caller hears nothing, ever */
    fake_open(w, &f, "bob", "r1");
    CHECK(fake_start(&f, -1) == 0);
    int r = f.attempts[0];
    fake_cancel(&f);
    char want[64];
    snprintf(want, sizeof(want), "a%d s:cancel rel", r);
    CHECK_STR(f.log, want);
    CHECK(f.n_stops == 1 && f.stops[0] == CG_CALL_STOP_CANCEL && f.stop_phase[0] == CG_CALL_CONNECT);
    poke_ended(&f);
    run_for(w, 3 * T_MS, NULL); /* past the connect deadline: nothing fires for it */
    CHECK_STR(f.log, want);
    CHECK(f.dones == 0 && f.errors == 0 && f.deltas == 0);
    CHECK(w->reps.r[r].out_until == 0); /* a cancel is no failure of the replica */
    CHECK(w->metrics.upstream_replica_outs[0] == 0);
    fake_close(&f, 1);

    /* mid-reply, while paused: the same */
    fake_open(w, &f, "bob", "r2");
    f.arm = CG_CALL_FIRST_BYTE;
    CHECK(fake_start(&f, -1) == 0);
    r = f.attempts[0];
    cg_call_progress(&f.core);
    cg_call_delta(&f.core, "par", 3);
    cg_call_pause(&f.core, 1);
    fake_cancel(&f);
    snprintf(want, sizeof(want), "a%d delta p1 s:cancel rel", r);
    CHECK_STR(f.log, want);
    poke_ended(&f);
    run_for(w, 3 * T_MS, NULL);
    CHECK_STR(f.log, want);
    CHECK(f.deltas == 1 && f.dones == 0 && f.errors == 0);
    fake_close(&f, 1);
    world_close(w);
}

/* ---- 3. retries before the first byte ------------------------------------------------------ */

static void test_retry(void)
{
    world *w = world_open(3, 3);
    fake f;
    fake_open(w, &f, "carol", "r1");
    CHECK(fake_start(&f, -1) == 0);
    int r0 = f.attempts[0];
    uint64_t t = now(w); /* the loop does not run below: its time stays */

    f.core.status = 503;
    cg_call_fail(&f.core, CG_CALL_RETRY, "503", CG_E_UPSTREAM_ERROR, NULL, "answered HTTP %d", 503);
    CHECK(f.n_attempts == 2);
    int r1 = f.attempts[1];
    CHECK(r1 != r0 && r1 >= 0 && r1 < 3);
    CHECK(w->reps.r[r0].out_until == t + OUT_MS && w->reps.r[r0].out_until > now(w));
    CHECK(f.core.status == 0 && f.core.replica == r1 && f.core.attempts == 2);
    CHECK(w->metrics.upstream_retries[0] == 1 && w->metrics.upstream_replica_outs[0] == 1);
    CHECK(f.errors == 0 && f.dones == 0 && f.releases == 0);

    cg_call_fail(&f.core, CG_CALL_RETRY, "refused", CG_E_UPSTREAM_UNAVAILABLE, NULL, "could not be reached: %s",
                 "refused");
    CHECK(f.n_attempts == 3);
    int r2 = f.attempts[2];
    CHECK(r2 != r0 && r2 != r1 && r2 >= 0 && r2 < 3);
    CHECK(w->reps.r[r1].out_until == t + OUT_MS);
    CHECK(w->metrics.upstream_retries[0] == 2 && w->metrics.upstream_replica_outs[0] == 2);
    CHECK(f.errors == 0 && f.releases == 0);
    CHECK(f.n_stops == 2 && f.stops[0] == CG_CALL_STOP_RETRY && f.stops[1] == CG_CALL_STOP_RETRY);

    /* the third: attempts are spent; the caller hears it once, with the attempts counted */
    cg_call_fail(&f.core, CG_CALL_RETRY, "refused", CG_E_UPSTREAM_UNAVAILABLE, NULL, "could not be reached: %s",
                 "refused");
    CHECK(f.n_attempts == 3);
    CHECK(f.errors == 1 && f.dones == 0 && f.releases == 1);
    CHECK(f.err == CG_E_UPSTREAM_UNAVAILABLE);
    CHECK(ends_with(f.message, " (after 3 attempts)"));
    CHECK_STR(f.message, "upstream 'llm' could not be reached: refused (after 3 attempts)");
    char want[96];
    snprintf(want, sizeof(want), "a%d s:retry a%d s:retry a%d s:fail error rel", r0, r1, r2);
    CHECK_STR(f.log, want);
    CHECK(w->metrics.upstream_retries[0] == 2);
    CHECK(w->metrics.upstream_replica_outs[0] == 3); /* the last replica failed too: it is out */
    CHECK(w->reps.r[r2].out_until == t + OUT_MS);
    poke_ended(&f);
    run_for(w, 3 * T_MS, NULL);
    CHECK_STR(f.log, want);
    fake_close(&f, 1);
    world_close(w);

    /* a failure told as it is (FINAL) is not retried, and says nothing of attempts */
    w = world_open(3, 3);
    fake_open(w, &f, "carol", "r1");
    CHECK(fake_start(&f, -1) == 0);
    cg_call_fail(&f.core, CG_CALL_FINAL, NULL, CG_E_UPSTREAM_ERROR, NULL, "sent a bad frame");
    CHECK(f.n_attempts == 1 && f.errors == 1 && f.err == CG_E_UPSTREAM_ERROR);
    CHECK_STR(f.message, "upstream 'llm' sent a bad frame");
    CHECK(w->metrics.upstream_retries[0] == 0 && w->metrics.upstream_replica_outs[0] == 0);
    fake_close(&f, 1);

    /* max_attempts 2 of 3 replicas: the second failure ends the call */
    world_close(w);
    w = world_open(3, 2);
    fake_open(w, &f, "carol", "r1");
    CHECK(fake_start(&f, -1) == 0);
    cg_call_fail(&f.core, CG_CALL_RETRY, "x", CG_E_UPSTREAM_UNAVAILABLE, NULL, "closed");
    cg_call_fail(&f.core, CG_CALL_RETRY, "x", CG_E_UPSTREAM_UNAVAILABLE, NULL, "closed");
    CHECK(f.n_attempts == 2 && f.errors == 1);
    CHECK_STR(f.message, "upstream 'llm' closed (after 2 attempts)");
    CHECK(w->metrics.upstream_retries[0] == 1);
    fake_close(&f, 1);
    world_close(w);

    /* after a retry, mid-reply: a COUNTED failure says the attempts, a FINAL one does not */
    w = world_open(3, 3);
    fake_open(w, &f, "carol", "r2");
    CHECK(fake_start(&f, -1) == 0);
    cg_call_fail(&f.core, CG_CALL_RETRY, "x", CG_E_UPSTREAM_UNAVAILABLE, NULL, "closed");
    cg_call_progress(&f.core);
    cg_call_delta(&f.core, "Hi", 2);
    cg_call_fail(&f.core, CG_CALL_COUNTED, NULL, CG_E_UPSTREAM_UNAVAILABLE, NULL, "cut mid-reply");
    CHECK(f.n_attempts == 2 && f.errors == 1);
    CHECK_STR(f.message, "upstream 'llm' cut mid-reply (after 2 attempts)");
    fake_close(&f, 1);
    for (int i = 0; i < 3; i++)
        w->reps.r[i].out_until = 0; /* (the failed one is back) */
    fake_open(w, &f, "carol", "r3");
    CHECK(fake_start(&f, -1) == 0);
    cg_call_fail(&f.core, CG_CALL_RETRY, "x", CG_E_UPSTREAM_UNAVAILABLE, NULL, "closed");
    cg_call_progress(&f.core);
    cg_call_delta(&f.core, "Hi", 2);
    cg_call_fail(&f.core, CG_CALL_FINAL, NULL, CG_E_UPSTREAM_ERROR, NULL, "sent an error event");
    CHECK(f.n_attempts == 2 && f.errors == 1);
    CHECK_STR(f.message, "upstream 'llm' sent an error event");
    fake_close(&f, 1);
    world_close(w);
}

/* ---- 4. no retry once reply text reached the caller ---------------------------------------- */

static void test_no_retry_after_text(void)
{
    world *w = world_open(3, 3);
    fake f;
    fake_open(w, &f, "dave", "r1");
    f.arm = CG_CALL_FIRST_BYTE;
    CHECK(fake_start(&f, -1) == 0);
    int r = f.attempts[0];
    cg_call_progress(&f.core);
    cg_call_delta(&f.core, "The answer is", 13);
    cg_call_fail(&f.core, CG_CALL_RETRY, "closed", CG_E_UPSTREAM_UNAVAILABLE, NULL, "closed mid-reply");
    CHECK(f.n_attempts == 1); /* the client must not see a reply start twice */
    CHECK(f.errors == 1 && f.dones == 0 && f.releases == 1);
    CHECK(f.err == CG_E_UPSTREAM_UNAVAILABLE);
    CHECK_STR(f.message, "upstream 'llm' closed mid-reply");
    char want[64];
    snprintf(want, sizeof(want), "a%d delta s:fail error rel", r);
    CHECK_STR(f.log, want);
    CHECK(w->metrics.upstream_retries[0] == 0);
    poke_ended(&f);
    run_for(w, 3 * T_MS, NULL); /* the idle deadline left armed finds the call ended */
    CHECK_STR(f.log, want);
    fake_close(&f, 1);
    world_close(w);
}

/* ---- 5. replica choice ---------------------------------------------------------------------- */

static void test_affinity(void)
{
    world *w = world_open(4, 3);
    /* the same dialog, the same replica, call after call */
    int home = first_replica(w, "erin", "trip");
    CHECK(home >= 0 && home < 4);
    for (int i = 0; i < 3; i++)
        CHECK(first_replica(w, "erin", "trip") == home);

    /* dialogs spread */
    int per[4] = {0}, used = 0;
    for (int i = 0; i < 50; i++) {
        char user[16];
        snprintf(user, sizeof(user), "u%d", i);
        int r = first_replica(w, user, "room");
        CHECK(r >= 0 && r < 4);
        if (r >= 0 && r < 4 && per[r]++ == 0)
            used++;
    }
    CHECK(used >= 2);

    /* its replica out: the dialog moves, always to the same next one; others' health does
     * not move it; back when its own is back */
    uint64_t t = now(w);
    w->reps.r[home].out_until = t + 10000;
    int next = first_replica(w, "erin", "trip");
    CHECK(next >= 0 && next != home);
    CHECK(first_replica(w, "erin", "trip") == next);
    w->reps.r[home].out_until = 0;
    CHECK(first_replica(w, "erin", "trip") == home);
    for (int i = 0; i < 4; i++)
        if (i != home)
            w->reps.r[i].out_until = t + 10000;
    CHECK(first_replica(w, "erin", "trip") == home);
    for (int i = 0; i < 4; i++)
        w->reps.r[i].out_until = 0;
    w->reps.r[home].out_until = t; /* out until now: back */
    CHECK(first_replica(w, "erin", "trip") == home);

    /* every replica out: the first attempt still goes to the dialog's own; a retry goes
     * nowhere, and the call ends at once */
    for (int i = 0; i < 4; i++)
        w->reps.r[i].out_until = t + 10000;
    fake f;
    fake_open(w, &f, "erin", "trip");
    CHECK(fake_start(&f, -1) == 0);
    CHECK(f.attempts[0] == home);
    cg_call_fail(&f.core, CG_CALL_RETRY, "x", CG_E_UPSTREAM_UNAVAILABLE, NULL, "closed");
    CHECK(f.n_attempts == 1 && f.errors == 1);
    CHECK_STR(f.message, "upstream 'llm' closed");
    fake_close(&f, 1);
    for (int i = 0; i < 4; i++)
        w->reps.r[i].out_until = 0;

    /* a replica given (a kept connection's) is used as it is */
    fake_open(w, &f, "erin", "trip");
    CHECK(fake_start(&f, (home + 1) % 4) == 0);
    CHECK(f.attempts[0] == (home + 1) % 4);
    fake_cancel(&f);
    fake_close(&f, 1);

    /* a retry follows the dialog's own order: the replica it moves to when its own is out */
    fake_open(w, &f, "erin", "trip");
    CHECK(fake_start(&f, -1) == 0);
    cg_call_fail(&f.core, CG_CALL_RETRY, "x", CG_E_UPSTREAM_UNAVAILABLE, NULL, "closed");
    CHECK(f.n_attempts == 2 && f.attempts[0] == home && f.attempts[1] == next);
    fake_cancel(&f);
    fake_close(&f, 1);
    for (int i = 0; i < 4; i++)
        w->reps.r[i].out_until = 0;

    /* least_busy: the fewest attempts running; ties go by the dialog's order; out is out */
    w->cfg.least_busy = 1;
    int busy[4] = {3, 1, 2, 5};
    for (int i = 0; i < 4; i++)
        w->reps.r[i].busy = busy[i];
    CHECK(first_replica(w, "erin", "trip") == 1);
    CHECK(first_replica(w, "frank", "x") == 1);
    w->reps.r[1].out_until = t + 10000;
    CHECK(first_replica(w, "erin", "trip") == 2);
    w->reps.r[1].out_until = 0;
    for (int i = 0; i < 4; i++)
        w->reps.r[i].busy = 2;
    CHECK(first_replica(w, "erin", "trip") == home);
    world_close(w);
}

/* ---- 6. deadlines and pause ------------------------------------------------------------------ */

typedef struct ticker {
    uv_timer_t timer;
    fake *f;
    int ticks, max, finished;
    uint64_t last; /* uv_now() of the latest progress */
} ticker;

static void tick(uv_timer_t *t)
{
    ticker *k = t->data;
    cg_call_progress(&k->f->core);
    k->last = uv_now(t->loop);
    if (++k->ticks == k->max) {
        uv_timer_stop(t);
        k->finished = 1;
    }
}

static void test_deadlines(void)
{
    world *w = world_open(2, 3);
    fake f;
    char want[128];

    /* connect: retried on the other replica, then (both tried) the caller hears it */
    fake_open(w, &f, "gina", "r1");
    CHECK(fake_start(&f, -1) == 0);
    uint64_t t0 = now(w);
    int r0 = f.attempts[0];
    CHECK(run_for(w, GUARD_MS, &f.errors) == 1);
    CHECK(f.n_attempts == 2 && f.attempts[1] == 1 - r0);
    CHECK(f.errors == 1 && f.err == CG_E_UPSTREAM_TIMEOUT);
    CHECK_STR(f.message, "upstream 'llm' did not connect within 30 ms (connect_timeout_ms) (after 2 attempts)");
    CHECK(f.ended_at - t0 >= 2 * T_MS);
    CHECK(f.n_stops == 2 && f.stops[0] == CG_CALL_STOP_RETRY && f.stops[1] == CG_CALL_STOP_TIMEOUT &&
          f.stop_phase[1] == CG_CALL_CONNECT);
    CHECK(w->reps.r[r0].out_until > now(w) && w->reps.r[1 - r0].out_until > now(w));
    CHECK(w->metrics.upstream_retries[0] == 1 && w->metrics.upstream_replica_outs[0] == 2);
    snprintf(want, sizeof(want), "a%d s:retry a%d s:timeout error rel", r0, 1 - r0);
    CHECK_STR(f.log, want);
    fake_close(&f, 1);
    world_close(w);

    /* first byte, on one replica: no retry, the caller hears it after first_byte_timeout_ms */
    w = world_open(1, 3);
    fake_open(w, &f, "gina", "r1");
    f.arm = CG_CALL_FIRST_BYTE;
    CHECK(fake_start(&f, -1) == 0);
    t0 = now(w);
    CHECK(run_for(w, GUARD_MS, &f.errors) == 1);
    CHECK(f.n_attempts == 1 && f.err == CG_E_UPSTREAM_TIMEOUT);
    CHECK_STR(f.message, "upstream 'llm' sent nothing within 30 ms (first_byte_timeout_ms)");
    CHECK(f.ended_at - t0 >= T_MS);
    CHECK(f.n_stops == 1 && f.stops[0] == CG_CALL_STOP_TIMEOUT && f.stop_phase[0] == CG_CALL_FIRST_BYTE);
    CHECK(w->reps.r[0].out_until == 0 && w->metrics.upstream_replica_outs[0] == 0); /* one replica: never out */
    CHECK_STR(f.log, "a0 s:timeout error rel");
    fake_close(&f, 1);
    world_close(w);

    /* first byte on two replicas: retried once, then the caller hears it */
    w = world_open(2, 3);
    fake_open(w, &f, "gina", "r1");
    f.arm = CG_CALL_FIRST_BYTE;
    CHECK(fake_start(&f, -1) == 0);
    CHECK(run_for(w, GUARD_MS, &f.errors) == 1);
    CHECK(f.n_attempts == 2 && f.attempts[1] == 1 - f.attempts[0]);
    CHECK_STR(f.message, "upstream 'llm' sent nothing within 30 ms (first_byte_timeout_ms) (after 2 attempts)");
    fake_close(&f, 1);
    world_close(w);

    /* idle after a delta: no retry, though a replica and attempts are left */
    w = world_open(3, 3);
    fake_open(w, &f, "gina", "r1");
    f.arm = CG_CALL_FIRST_BYTE;
    CHECK(fake_start(&f, -1) == 0);
    cg_call_progress(&f.core);
    cg_call_delta(&f.core, "Hi", 2);
    t0 = now(w);
    CHECK(run_for(w, GUARD_MS, &f.errors) == 1);
    CHECK(f.n_attempts == 1 && f.err == CG_E_UPSTREAM_TIMEOUT);
    CHECK_STR(f.message, "upstream 'llm' went quiet within 30 ms (idle_timeout_ms)");
    CHECK(f.ended_at - t0 >= T_MS);
    CHECK(f.n_stops == 1 && f.stops[0] == CG_CALL_STOP_TIMEOUT && f.stop_phase[0] == CG_CALL_IDLE);
    CHECK(w->metrics.upstream_retries[0] == 0);
    fake_close(&f, 1);

    /* progress every 10 ms for 60 ms keeps a 30 ms idle deadline away; then silence ends it */
    fake_open(w, &f, "gina", "r2");
    f.arm = CG_CALL_FIRST_BYTE;
    CHECK(fake_start(&f, -1) == 0);
    cg_call_progress(&f.core);
    cg_call_delta(&f.core, "Hi", 2);
    ticker k = {.f = &f, .max = 6};
    uv_timer_init(&w->loop, &k.timer);
    k.timer.data = &k;
    t0 = now(w);
    uv_timer_start(&k.timer, tick, 10, 10);
    CHECK(run_for(w, GUARD_MS, &k.finished) == 1);
    CHECK(k.ticks == 6 && f.errors == 0);
    CHECK(k.last - t0 >= 2 * T_MS); /* longer than the idle deadline: it did move */
    CHECK(run_for(w, GUARD_MS, &f.errors) == 1);
    CHECK(f.err == CG_E_UPSTREAM_TIMEOUT && f.ended_at - k.last >= T_MS);
    CHECK_STR(f.message, "upstream 'llm' went quiet within 30 ms (idle_timeout_ms)");
    uv_close((uv_handle_t *)&k.timer, NULL);
    fake_close(&f, 1);

    /* paused while waiting for the first byte: no deadline for 3x its time; resumed, the
     * full deadline runs again */
    fake_open(w, &f, "gina", "r3");
    f.arm = CG_CALL_FIRST_BYTE;
    CHECK(fake_start(&f, -1) == 0);
    run_for(w, T_MS / 2, NULL);
    cg_call_pause(&f.core, 1);
    cg_call_pause(&f.core, 1); /* once is enough for the kind */
    CHECK(f.pauses == 1 && f.core.paused == 1);
    run_for(w, 3 * T_MS, NULL);
    CHECK(f.errors == 0 && f.n_attempts == 1 && f.n_stops == 0);
    uv_update_time(&w->loop);
    uint64_t resumed = now(w);
    cg_call_pause(&f.core, 0);
    CHECK(f.pauses == 2 && f.core.paused == 0);
    CHECK(run_for(w, GUARD_MS, &f.errors) == 1);
    /* resumed: the full deadline, then retries on the other two replicas with their own */
    CHECK(f.n_attempts == 3 && f.ended_at - resumed >= 3 * T_MS);
    CHECK_STR(f.message, "upstream 'llm' sent nothing within 30 ms (first_byte_timeout_ms) (after 3 attempts)");
    fake_close(&f, 1);

    /* the same on one replica, so the first deadline after the resume is the end */
    world_close(w);
    w = world_open(1, 3);
    fake_open(w, &f, "gina", "r3");
    f.arm = CG_CALL_FIRST_BYTE;
    CHECK(fake_start(&f, -1) == 0);
    run_for(w, T_MS / 2, NULL);
    cg_call_pause(&f.core, 1);
    run_for(w, 3 * T_MS, NULL);
    CHECK(f.errors == 0 && f.n_stops == 0);
    uv_update_time(&w->loop);
    resumed = now(w);
    cg_call_pause(&f.core, 0);
    run_for(w, T_MS / 2, NULL);
    CHECK(f.errors == 0); /* not the rest of the old deadline: a full one */
    CHECK(run_for(w, GUARD_MS, &f.errors) == 1);
    CHECK(f.ended_at - resumed >= T_MS);
    CHECK_STR(f.message, "upstream 'llm' sent nothing within 30 ms (first_byte_timeout_ms)");
    CHECK_STR(f.log, "a0 p1 p0 s:timeout error rel");
    fake_close(&f, 1);

    /* paused mid-reply: no idle deadline; resumed, a full one */
    fake_open(w, &f, "gina", "r4");
    f.arm = CG_CALL_FIRST_BYTE;
    CHECK(fake_start(&f, -1) == 0);
    cg_call_progress(&f.core);
    cg_call_delta(&f.core, "Hi", 2);
    cg_call_pause(&f.core, 1);
    run_for(w, 3 * T_MS, NULL);
    CHECK(f.errors == 0 && f.n_stops == 0);
    cg_call_progress(&f.core); /* bytes read before the pause took hold: still no deadline */
    run_for(w, 2 * T_MS, NULL);
    CHECK(f.errors == 0);
    uv_update_time(&w->loop);
    resumed = now(w);
    cg_call_pause(&f.core, 0);
    CHECK(run_for(w, GUARD_MS, &f.errors) == 1);
    CHECK(f.ended_at - resumed >= T_MS);
    CHECK_STR(f.message, "upstream 'llm' went quiet within 30 ms (idle_timeout_ms)");
    CHECK_STR(f.log, "a0 delta p1 p0 s:timeout error rel");
    fake_close(&f, 1);

    /* paused while connecting: the connect deadline runs all the same */
    fake_open(w, &f, "gina", "r5");
    CHECK(fake_start(&f, -1) == 0);
    t0 = now(w);
    cg_call_pause(&f.core, 1);
    CHECK(run_for(w, GUARD_MS, &f.errors) == 1);
    CHECK(f.ended_at - t0 >= T_MS && f.ended_at - t0 < 3 * T_MS + 500);
    CHECK_STR(f.message, "upstream 'llm' did not connect within 30 ms (connect_timeout_ms)");
    fake_close(&f, 1);
    world_close(w);
}

/* ---- 7. start that cannot start --------------------------------------------------------------- */

static void test_start_fails(void)
{
    world *w = world_open(3, 3);
    fake f;
    fake_open(w, &f, "hank", "r1");
    f.fail_mask = 0x7; /* every replica */
    CHECK(fake_start(&f, -1) == -1);
    CHECK(f.n_attempts >= 1);
    run_for(w, 4 * T_MS, NULL); /* the connect deadline the attempt armed: it must find nothing */
    CHECK(f.deltas == 0 && f.dones == 0 && f.errors == 0);
    CHECK(f.n_stops == 0);
    CHECK(w->metrics.upstream_retries[0] == 0);
    fake_close(&f, 0); /* no release: the kind frees what it made (call.h) */

    /* and with a replica given: it first, then the others */
    fake_open(w, &f, "hank", "r1");
    f.fail_mask = 0x7;
    CHECK(fake_start(&f, 2) == -1);
    CHECK(f.n_attempts == 3 && f.attempts[0] == 2);
    run_for(w, 2 * T_MS, NULL);
    CHECK(f.dones == 0 && f.errors == 0 && f.n_stops == 0);
    fake_close(&f, 0);

    /* the given replica cannot start it, another can: the call runs there */
    fake_open(w, &f, "hank", "r1");
    f.fail_mask = 1u << 2;
    CHECK(fake_start(&f, 2) == 0);
    CHECK(f.n_attempts == 2 && f.attempts[0] == 2 && f.attempts[1] != 2);
    CHECK(f.core.attempts == 1 && f.core.replica == f.attempts[1]);
    fake_cancel(&f);
    cg_call_cancel(&f.core); /* again, after the end: nothing (it was released once) */
    fake_close(&f, 1);
    world_close(w);
}

/* ---- 8. a 429's Retry-After ------------------------------------------------------------------- */

static void test_retry_after(void)
{
    world *w = world_open(3, 3);
    fake f;
    fake_open(w, &f, "ivy", "r1");
    CHECK(fake_start(&f, -1) == 0);
    uint64_t t = now(w);
    int r0 = f.attempts[0];

    f.core.status = 429; /* as openai's header callback sets them */
    f.core.retry_after_ms = 120000;
    cg_call_fail(&f.core, CG_CALL_RETRY, "429", CG_E_UPSTREAM_ERROR, NULL, "answered HTTP 429");
    CHECK(w->reps.r[r0].out_until == t + 120000);
    CHECK(f.n_attempts == 2 && f.core.retry_after_ms == 0); /* the next attempt's own */
    int r1 = f.attempts[1];

    /* no Retry-After: out_ms */
    f.core.status = 503;
    cg_call_fail(&f.core, CG_CALL_RETRY, "503", CG_E_UPSTREAM_ERROR, NULL, "answered HTTP 503");
    CHECK(w->reps.r[r1].out_until == t + OUT_MS);
    CHECK(f.n_attempts == 3);
    int r2 = f.attempts[2];

    /* two hours: an hour at most */
    f.core.status = 429;
    f.core.retry_after_ms = 7200000;
    cg_call_fail(&f.core, CG_CALL_RETRY, "429", CG_E_UPSTREAM_ERROR, NULL, "answered HTTP 429");
    CHECK(w->reps.r[r2].out_until == t + 3600000);
    CHECK(f.errors == 1 && f.err == CG_E_UPSTREAM_ERROR && f.status == 429);
    CHECK_STR(f.message, "upstream 'llm' answered HTTP 429 (after 3 attempts)");
    CHECK(w->metrics.upstream_retries[0] == 2 && w->metrics.upstream_replica_outs[0] == 3);
    fake_close(&f, 1);

    /* the dialog's next call keeps off the replicas still out: r1 back, r0 and r2 not */
    w->reps.r[r1].out_until = 0;
    CHECK(first_replica(w, "ivy", "r1") == r1);
    world_close(w);
}

int main(void)
{
    cg_log_set_level(CG_LOG_ERROR); /* the replicas' "out for" warnings are expected here */
    test_done();
    test_cancel();
    test_retry();
    test_no_retry_after_text();
    test_affinity();
    test_deadlines();
    test_start_fails();
    test_retry_after();
    return unit_done("call");
}
