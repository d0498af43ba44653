/*
 * call.h: one upstream call's plumbing, the same for every kind that talks to a network
 * upstream (src/upstream/call.c): the phase deadline, pause, retries before the first byte
 * across replicas, replica choice and affinity, passive health, and the guards that give
 * the caller exactly one of on_done or on_error, none after a cancel, never from inside
 * start (upstream.h states that contract).
 *
 * A kind (openai.c, ws.c) embeds a cg_call in its own call and supplies, in a cg_call_kind,
 * only what is its own: sending the request to a chosen replica, stopping an attempt, and
 * pausing its reading. It reports what its bytes said through cg_call_progress (bytes
 * came), cg_call_delta (reply text), cg_call_done and cg_call_fail; the core decides
 * whether a failure is retried on another replica or reaches the caller.
 *
 * Timers: one scheme. A cg_call_clock is one uv timer and a deadline; only the deadline
 * moves (cg_call_arm), and the timer is set again only when it would fire after the new
 * deadline; when it fires early it sets itself for the rest. A clock belongs to what lives
 * longest: openai's is its call's, ws's its connection's, lent to each call on it in turn.
 *
 * Ownership: the kind owns the memory of its call and of its clock; the core never frees.
 * After the core has ended a call (done, error, cancel) it calls kind->release once, and
 * touches the call no more, but for a clock that still fires in CG_CALL_DRAIN.
 */
#ifndef CHATGATE_UPSTREAM_CALL_H
#define CHATGATE_UPSTREAM_CALL_H

#include <stdarg.h>
#include <stdint.h>
#include <uv.h>

#include "chatgate/upstream/upstream.h"

/* The phase whose deadline runs; after a done, DRAIN reads the rest of a response (openai)
 * for at most idle_timeout_ms. */
typedef enum { CG_CALL_CONNECT, CG_CALL_FIRST_BYTE, CG_CALL_IDLE, CG_CALL_DRAIN, CG_CALL_NONE } cg_call_phase;

/* Why the kind is told to stop its current attempt (cg_call_kind.stop). */
typedef enum {
    CG_CALL_STOP_DONE,    /* the reply is complete: the caller has heard or is about to hear done */
    CG_CALL_STOP_RETRY,   /* the attempt failed before the first byte: another replica is tried next */
    CG_CALL_STOP_FAIL,    /* the call ends with an error the kind reported */
    CG_CALL_STOP_TIMEOUT, /* the call ends: its phase's deadline passed (c->phase says which) */
    CG_CALL_STOP_CANCEL,  /* the caller cancelled: the upstream is to stop generating */
    CG_CALL_STOP_DRAINED, /* done, and the rest of the response did not come within idle_timeout_ms */
} cg_call_stop;

typedef struct cg_call cg_call;

/* What a kind supplies. None of them may call back into the core's end functions. */
typedef struct cg_call_kind {
    /* Sends the call's request to replica r (opening a connection when it needs one) and
     * arms the phase it is in (cg_call_arm): 0, or -1 when it could not even start (the
     * core then tries the next replica, within max_attempts; when none starts, the call
     * fails). */
    int (*attempt)(cg_call *c, int r);
    /* Stops the current attempt, for why; c->phase says where it was. */
    void (*stop)(cg_call *c, cg_call_stop why);
    /* Stops reading the reply (1) or reads on (0). */
    void (*pause)(cg_call *c, int paused);
    /* The core is done with the call: the kind frees it when nothing of its own holds it. */
    void (*release)(cg_call *c);
    const char *idle_words; /* what the idle timeout's message says: "went quiet within" */
} cg_call_kind;

/* One upstream's replicas, kept between calls (in the kind's cg_upstream.state). */
typedef struct cg_replica_health {
    uint64_t out_until; /* uv_now() before which it is not picked: it failed (passive health) */
    int busy;           /* attempts on it now (balance least_busy), counted by the kind */
} cg_replica_health;

typedef struct cg_replicas {
    cg_replica_health r[CG_MAX_REPLICAS];
    int n;
} cg_replicas;

typedef struct cg_call_clock {
    uv_timer_t timer;  /* its data is the clock; the owner closes it */
    uint64_t deadline; /* uv_now() by which the call's phase must have moved on; 0: none due */
    cg_call *call;     /* whose deadline it is; NULL: none */
} cg_call_clock;

struct cg_call {
    cg_upstream *up;
    const cg_call_kind *kind;
    cg_replicas *replicas;        /* the upstream's */
    const cg_upstream_events *ev; /* NULL once the call has ended */
    void *ctx;
    cg_call_clock *clock; /* NULL while no attempt holds one */
    cg_call_phase phase;
    int paused;
    uint64_t key;         /* the dialog's hash (user, room): which replica it prefers */
    unsigned tried;       /* replicas tried, one bit each */
    int attempts;
    int replica;          /* the latest attempt's (the one that answered, after a done) */
    int attempting;       /* an attempt runs: the kind has not been told to stop it */
    long retry_after_ms;  /* the failed answer's Retry-After (a 429's or a 5xx's), 0 when none */
    int status;           /* the current attempt's HTTP status, 0: none (an error's "status") */
    size_t reply_bytes;   /* of delta text relayed: none, and a failure may be retried */
};

/* The clock on loop; its owner closes clock->timer (uv_close) when it goes. */
void cg_call_clock_init(cg_call_clock *k, uv_loop_t *loop);

/* Fills c for a call of up (whose replicas are replicas) by kind, for the dialog (user,
 * room), answering ev/ctx. */
void cg_call_init(cg_call *c, cg_upstream *up, const cg_call_kind *kind, cg_replicas *replicas,
                  const cg_upstream_events *ev, void *ctx, const char *user, const char *room);

/* The first attempt, on replica r, or (r < 0) the one the dialog prefers: 0, or -1 when
 * none could start (no callback will come; the kind frees what it made). */
int cg_call_start(cg_call *c, int r);

/* The phase the call is in now; its deadline starts afresh (a paused call runs only the
 * connect and drain deadlines). */
void cg_call_arm(cg_call *c, cg_call_phase phase);

/* Bytes of the reply came: the idle deadline starts afresh. */
static inline void cg_call_progress(cg_call *c)
{
    cg_call_arm(c, CG_CALL_IDLE);
}

/* Reply text for the caller (len > 0). */
void cg_call_delta(cg_call *c, const char *text, size_t len);

/* The reply is complete; usage and state borrowed (NULL: none). */
void cg_call_done(cg_call *c, json_t *usage, json_t *state);

/* How cg_call_fail treats a failure. */
typedef enum {
    CG_CALL_FINAL,   /* the upstream answered it (a mid-reply error, a bad frame): told as it is */
    CG_CALL_COUNTED, /* told with the attempts it took, when more than one ("(after 2 attempts)") */
    CG_CALL_RETRY,   /* no answer (not reached, closed, 5xx, 429): retried on another replica
                      * while nothing reached the caller and attempts remain; counted */
} cg_call_failure;

/*
 * The attempt failed. A CG_CALL_RETRY failure marks the replica out (passive health; why is
 * the log's word for it) and goes to the next replica when it can; else the caller hears
 * err with c->status, error (the upstream's own error object, borrowed, or NULL) and
 * "upstream 'NAME' " + fmt.
 */
void cg_call_fail(cg_call *c, cg_call_failure how, const char *why, int err, json_t *error, const char *fmt, ...)
    __attribute__((format(printf, 6, 7)));
void cg_call_vfail(cg_call *c, cg_call_failure how, const char *why, int err, json_t *error, const char *fmt,
                   va_list ap) __attribute__((format(printf, 6, 0)));

/* The caller cancels: no callback comes any more. */
void cg_call_cancel(cg_call *c);

/* The caller's send buffer is full (1) or has room again (0). */
void cg_call_pause(cg_call *c, int paused);

/* cg_upstream_ops.answered: the replica (-1: the upstream has one) and the attempts. */
void cg_call_answered(const cg_call *c, int *replica, int *attempts);

/* The clock is taken from the call (ws: the call leaves its connection): its deadline stops. */
void cg_call_clock_drop(cg_call *c);

#endif
