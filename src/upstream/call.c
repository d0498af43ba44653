/*
 * call.c: the call core (call.h), the part of an upstream call that does not depend on the
 * kind: deadlines, pause, replica choice and health, retries before the first byte, and
 * the guards on the caller's callbacks.
 *
 * What must always hold: a call that start() accepted ends exactly once, by done, error or
 * cancel; c->ev is NULL from that moment, so that nothing reaches the caller after; the
 * kind's release comes once, after the caller has heard the end (on_done may still ask
 * answered()). A retry happens only while no reply text reached the caller (the client
 * must not see a reply start twice) and while max_attempts allows.
 */
#define _GNU_SOURCE /* vasprintf */
#include <stdio.h>
#include <stdlib.h>

#include "chatgate/core/error.h"
#include "chatgate/core/log.h"
#include "chatgate/upstream/call.h"

/* ---- deadlines ------------------------------------------------------------------------ */

static void on_deadline(cg_call *c);

/* The timer fired: the deadline may have moved on since it was set (then it is set for the
 * rest), or gone (nothing is due). */
static void clock_fired(uv_timer_t *t)
{
    cg_call_clock *k = t->data;
    uint64_t now = uv_now(t->loop);
    if (!k->deadline || !k->call)
        return;
    if (now < k->deadline) {
        uv_timer_start(t, clock_fired, k->deadline - now, 0);
        return;
    }
    k->deadline = 0;
    on_deadline(k->call);
}

void cg_call_clock_init(cg_call_clock *k, uv_loop_t *loop)
{
    uv_timer_init(loop, &k->timer);
    k->timer.data = k;
    k->deadline = 0;
    k->call = NULL;
}

static int phase_ms(const cg_call *c, cg_call_phase phase)
{
    const cg_upstream_config *cfg = c->up->cfg;
    return phase == CG_CALL_CONNECT ? cfg->connect_timeout_ms
           : phase == CG_CALL_FIRST_BYTE ? cfg->first_byte_timeout_ms : cfg->idle_timeout_ms;
}

/*
 * Only the deadline moves: the timer is set again only when it would fire after it, and
 * clock_fired sets it again for the rest of a deadline that moved on meanwhile (the way
 * nginx keeps its timers). Moving the timer in libuv's heap at every read of every reply
 * was a fiftieth of a turn (issue 12). A paused call waits for no first byte and no read:
 * the upstream's silence is ours.
 */
void cg_call_arm(cg_call *c, cg_call_phase phase)
{
    cg_call_clock *k = c->clock;
    c->phase = phase;
    if (!k || (!c->ev && phase != CG_CALL_DRAIN))
        return;
    k->call = c;
    if (phase == CG_CALL_NONE || (c->paused && phase != CG_CALL_CONNECT && phase != CG_CALL_DRAIN)) {
        k->deadline = 0; /* the timer may still run: when it fires, nothing is due */
        return;
    }
    uint64_t ms = (uint64_t)phase_ms(c, phase);
    k->deadline = uv_now(k->timer.loop) + ms;
    if (!uv_is_active((uv_handle_t *)&k->timer) || uv_timer_get_due_in(&k->timer) > ms)
        uv_timer_start(&k->timer, clock_fired, ms, 0);
}

void cg_call_clock_drop(cg_call *c)
{
    cg_call_clock *k = c->clock;
    if (k && k->call == c) {
        k->call = NULL;
        k->deadline = 0;
    }
    c->clock = NULL;
}

/* ---- replicas --------------------------------------------------------------------------- */

/* splitmix64's finaliser: a well-spread 64-bit hash of x. */
static uint64_t mix(uint64_t x)
{
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
    return x ^ (x >> 31);
}

/* FNV-1a of the dialog (user, room): the same for every turn of it, on every gateway. */
static uint64_t dialog_key(const char *user, const char *room)
{
    uint64_t h = 0xcbf29ce484222325ULL;
    for (const char *p = user ? user : ""; *p; p++)
        h = (h ^ (unsigned char)*p) * 0x100000001b3ULL;
    h = (h ^ 0x1f) * 0x100000001b3ULL; /* the unit separator: ("ab","c") is not ("a","bc") */
    for (const char *p = room ? room : ""; *p; p++)
        h = (h ^ (unsigned char)*p) * 0x100000001b3ULL;
    return h;
}

/*
 * The replica for the call's next attempt: among those it has not tried and that are not
 * out, by dialog the one whose hash with the dialog's key is highest (rendezvous hashing: a
 * dialog stays on its replica, and moves only when that one is out, to the one next in its
 * own order), or the least busy (ties by the same order). When every replica is out, the
 * first attempt still goes to the dialog's own (it may be back; failing at once would not
 * help the user), a retry goes nowhere. -1: none.
 */
static int pick(const cg_call *c, uint64_t now)
{
    const cg_replicas *rs = c->replicas;
    if (rs->n == 1) /* one URL: nothing to choose (and no dialog key was made) */
        return c->tried & 1u ? -1 : 0;
    int best = -1, any = -1;
    uint64_t best_score = 0, any_score = 0;
    for (int i = 0; i < rs->n; i++) {
        if (c->tried & (1u << i))
            continue;
        uint64_t score = mix(c->key ^ mix((uint64_t)i + 1));
        if (any < 0 || score > any_score) {
            any = i;
            any_score = score;
        }
        if (rs->r[i].out_until > now)
            continue;
        int better = best < 0 || (c->up->cfg->least_busy && rs->r[i].busy != rs->r[best].busy
                                      ? rs->r[i].busy < rs->r[best].busy
                                      : score > best_score);
        if (better) {
            best = i;
            best_score = score;
        }
    }
    return best >= 0 ? best : c->attempts == 0 ? any : -1;
}

/* Sends the call to replica r: 0, or -1 when the kind could not start it (r counts as
 * tried either way). */
static int attempt_on(cg_call *c, int r)
{
    c->status = 0;
    c->retry_after_ms = 0;
    c->tried |= 1u << r;
    if (c->kind->attempt(c, r) < 0)
        return -1;
    c->attempts++;
    c->replica = r;
    c->attempting = 1;
    return 0;
}

/* Sends the call to r, or, when r cannot start it, to the next replica the dialog would
 * go to (pick), within max_attempts: 0, or -1 when none started. */
static int attempt_from(cg_call *c, int r)
{
    while (r >= 0 && c->attempts < c->up->cfg->max_attempts) {
        if (attempt_on(c, r) == 0)
            return 0;
        r = pick(c, uv_now(c->up->net->loop));
    }
    return -1;
}

/* The kind stops the attempt running, if one is (each attempt is stopped once). */
static void stop_attempt(cg_call *c, cg_call_stop why)
{
    if (!c->attempting)
        return;
    c->attempting = 0;
    c->kind->stop(c, why);
}

/*
 * The current attempt failed for want of an answer (it refused, closed, timed out before
 * its first byte, or answered 5xx or 429): its replica is out for out_ms (or the 429's
 * Retry-After, up to an hour), mid-reply too. The message goes to the next replica while
 * nothing reached the client and the call has attempts left. 1 when it was retried; 0: the
 * caller fails the call.
 */
static int retry(cg_call *c, const char *why)
{
    cg_upstream *up = c->up;
    const cg_upstream_config *cfg = up->cfg;
    uint64_t now = uv_now(up->net->loop);
    long out = c->retry_after_ms > 0 ? (c->retry_after_ms < 3600000 ? c->retry_after_ms : 3600000) : cfg->out_ms;
    if (c->replicas->n > 1) {
        c->replicas->r[c->replica].out_until = now + (uint64_t)out;
        cg_warn("upstream '%s': replica %d %s: out for %ld ms", cfg->name, c->replica, why, out);
        if (up->metrics)
            up->metrics->upstream_replica_outs[up->index]++;
    }
    int next = c->reply_bytes || c->attempts >= cfg->max_attempts ? -1 : pick(c, now);
    if (next < 0)
        return 0;
    stop_attempt(c, CG_CALL_STOP_RETRY);
    if (attempt_from(c, next) < 0)
        return 0;
    if (up->metrics)
        up->metrics->upstream_retries[up->index]++;
    return 1;
}

/* ---- the call --------------------------------------------------------------------------- */

void cg_call_init(cg_call *c, cg_upstream *up, const cg_call_kind *kind, cg_replicas *replicas,
                  const cg_upstream_events *ev, void *ctx, const char *user, const char *room)
{
    *c = (cg_call){.up = up, .kind = kind, .replicas = replicas, .ev = ev, .ctx = ctx, .phase = CG_CALL_NONE,
                   .key = replicas->n > 1 ? dialog_key(user, room) : 0, .replica = -1};
}

int cg_call_start(cg_call *c, int r)
{
    if (r < 0)
        r = pick(c, uv_now(c->up->net->loop));
    if (attempt_from(c, r) < 0) {
        c->ev = NULL; /* the caller hears nothing: start() failed */
        return -1;
    }
    return 0;
}

void cg_call_delta(cg_call *c, const char *text, size_t len)
{
    if (!c->ev)
        return;
    c->reply_bytes += len;
    c->ev->on_delta(c->ctx, text, len);
}

void cg_call_done(cg_call *c, json_t *usage, json_t *state)
{
    const cg_upstream_events *ev = c->ev;
    if (!ev)
        return;
    c->ev = NULL;
    stop_attempt(c, CG_CALL_STOP_DONE);
    ev->on_done(c->ctx, usage, state); /* may ask answered(): the call lives until release */
    c->kind->release(c);
}

/* Calls ev->on_error with a message made of fmt's arguments. */
static void tell_error(const cg_upstream_events *ev, void *ctx, const cg_upstream_config *cfg, int err, int status,
                       json_t *error, const char *fmt, ...) __attribute__((format(printf, 7, 8)));
static void tell_error(const cg_upstream_events *ev, void *ctx, const cg_upstream_config *cfg, int err, int status,
                       json_t *error, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    cg_upstream_fail(ev, ctx, cfg, err, status, error, fmt, ap);
    va_end(ap);
}

/* Ends the call with an error (after stopping the attempt, for stop); the caller's message
 * is fmt's, and the attempts the call took when counted and more than one. */
static void end_failed(cg_call *c, cg_call_failure how, cg_call_stop stop, int err, json_t *error, const char *fmt,
                       va_list ap)
{
    const cg_upstream_events *ev = c->ev;
    char note[48] = "";
    if (how != CG_CALL_FINAL && c->attempts > 1)
        snprintf(note, sizeof(note), " (after %d attempts)", c->attempts);
    char *what = NULL;
    if (vasprintf(&what, fmt, ap) < 0)
        what = NULL;
    c->ev = NULL;
    stop_attempt(c, stop);
    tell_error(ev, c->ctx, c->up->cfg, err, c->status, error, "%s%s", what ? what : "failed", note);
    free(what);
    c->kind->release(c);
}

void cg_call_vfail(cg_call *c, cg_call_failure how, const char *why, int err, json_t *error, const char *fmt,
                   va_list ap)
{
    if (!c->ev || (how == CG_CALL_RETRY && retry(c, why)))
        return;
    end_failed(c, how, CG_CALL_STOP_FAIL, err, error, fmt, ap);
}

void cg_call_fail(cg_call *c, cg_call_failure how, const char *why, int err, json_t *error, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    cg_call_vfail(c, how, why, err, error, fmt, ap);
    va_end(ap);
}

static void fail_timeout(cg_call *c, cg_call_failure how, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static void fail_timeout(cg_call *c, cg_call_failure how, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    end_failed(c, how, CG_CALL_STOP_TIMEOUT, CG_E_UPSTREAM_TIMEOUT, NULL, fmt, ap);
    va_end(ap);
}

/* The phase's deadline passed. Before the first byte the replica is taken as down (retried
 * on the next); a silence mid-reply, or a drain that does not end, is not retried. */
static void on_deadline(cg_call *c)
{
    static const char *const what[] = {"did not connect", "sent nothing"};
    static const char *const key[] = {"connect_timeout_ms", "first_byte_timeout_ms"};
    cg_call_phase phase = c->phase;
    if (phase == CG_CALL_DRAIN) {
        c->kind->stop(c, CG_CALL_STOP_DRAINED);
        return;
    }
    if (!c->ev || phase == CG_CALL_NONE)
        return;
    if (phase == CG_CALL_IDLE) {
        fail_timeout(c, CG_CALL_COUNTED, "%s %d ms (idle_timeout_ms)", c->kind->idle_words, phase_ms(c, phase));
        return;
    }
    if (retry(c, what[phase]))
        return;
    fail_timeout(c, CG_CALL_RETRY, "%s within %d ms (%s)", what[phase], phase_ms(c, phase), key[phase]);
}

void cg_call_cancel(cg_call *c)
{
    if (!c->ev)
        return; /* it has ended, and been released, already */
    c->ev = NULL;
    stop_attempt(c, CG_CALL_STOP_CANCEL);
    c->kind->release(c);
}

void cg_call_pause(cg_call *c, int paused)
{
    paused = !!paused;
    if (!c->ev || c->paused == paused)
        return;
    c->paused = paused;
    c->kind->pause(c, paused);
    if (c->phase != CG_CALL_CONNECT) /* connecting goes on, paused or not: its deadline stays */
        cg_call_arm(c, c->phase);    /* stops the first-byte or idle deadline, or starts it afresh */
}

void cg_call_answered(const cg_call *c, int *replica, int *attempts)
{
    *replica = c->replicas->n > 1 ? c->replica : -1;
    *attempts = c->attempts;
}
