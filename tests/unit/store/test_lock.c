/*
 * test_lock.c: the per-dialog lock (lock.h), as the turns use it (server/session.c and
 * server/dropin.c: the waiter zeroed with its request, granted and owner set, acquire before
 * the dialog's load, release when the request is freed, whether it held, waited or never
 * asked). The first to ask holds it; the others wait, and are handed the lock one at a time
 * in arrival order, each by a call of its `granted` from inside the release that lets go;
 * never from inside acquire. A waiter may leave the line; dialogs do not share a lock; a
 * release by one that neither holds nor waits does nothing.
 */
#include <jansson.h>
#include <stdlib.h>
#include <string.h>

#include "chatgate/store/lock.h"
#include "unit.h"

/* A request of the test: which turn it is and the order its grants came in. */
static char granted_log[64];
static size_t granted_n;

typedef struct req {
    char name;
    int release_on_grant; /* its turn fails at once (the load could not start): lets go */
    int free_on_grant;    /* ... and frees the request the waiter is embedded in */
    json_t *locks;
    cg_dialog_lock_waiter lock;
} req;

static void on_granted(cg_dialog_lock_waiter *w)
{
    req *r = w->owner;
    CHECK(w == &r->lock);
    CHECK(w->state == CG_LOCK_HELD); /* it holds the lock when told */
    if (granted_n < sizeof(granted_log) - 1)
        granted_log[granted_n++] = r->name;
    if (r->release_on_grant)
        cg_dialog_lock_release(r->locks, w);
    if (r->free_on_grant)
        free(r);
}

static void reset_log(void)
{
    granted_n = 0;
    memset(granted_log, 0, sizeof(granted_log));
}

static void req_init(req *r, char name, json_t *locks)
{
    memset(r, 0, sizeof(*r)); /* as the turns do: zeroed with the request */
    r->name = name;
    r->locks = locks;
    r->lock.granted = on_granted;
    r->lock.owner = r;
}

static void test_acquire_wait_release(void)
{
    json_t *locks = json_object();
    req a, b, c;
    req_init(&a, 'a', locks);
    req_init(&b, 'b', locks);
    req_init(&c, 'c', locks);
    reset_log();

    CHECK(cg_dialog_lock_acquire(locks, &a.lock, "ann", "travel") == 1);
    CHECK(a.lock.state == CG_LOCK_HELD);
    /* the same dialog from two more connections: they wait, and are not told yet */
    CHECK(cg_dialog_lock_acquire(locks, &b.lock, "ann", "travel") == 0);
    CHECK(cg_dialog_lock_acquire(locks, &c.lock, "ann", "travel") == 0);
    CHECK(b.lock.state == CG_LOCK_WAITING);
    CHECK(c.lock.state == CG_LOCK_WAITING);
    CHECK(granted_n == 0);

    /* the holder lets go: the first in line is told, and holds; the other still waits */
    cg_dialog_lock_release(locks, &a.lock);
    CHECK(a.lock.state == CG_LOCK_NONE);
    CHECK_STR(granted_log, "b");
    CHECK(b.lock.state == CG_LOCK_HELD);
    CHECK(c.lock.state == CG_LOCK_WAITING);
    /* one who arrives now waits behind c */
    CHECK(cg_dialog_lock_acquire(locks, &a.lock, "ann", "travel") == 0);
    cg_dialog_lock_release(locks, &b.lock);
    CHECK_STR(granted_log, "bc");
    cg_dialog_lock_release(locks, &c.lock);
    CHECK_STR(granted_log, "bca");
    CHECK(a.lock.state == CG_LOCK_HELD);
    cg_dialog_lock_release(locks, &a.lock);
    CHECK_STR(granted_log, "bca");

    /* the last holder gone and nobody waiting, the lock is gone: the next one holds at once */
    CHECK(json_object_size(locks) == 0);
    CHECK(cg_dialog_lock_acquire(locks, &b.lock, "ann", "travel") == 1);
    cg_dialog_lock_release(locks, &b.lock);
    CHECK(json_object_size(locks) == 0);

    /* handed on to the only waiter, the line is empty; one who comes after that waits for
     * the new holder and is handed the lock in turn */
    reset_log();
    CHECK(cg_dialog_lock_acquire(locks, &a.lock, "ann", "travel") == 1);
    CHECK(cg_dialog_lock_acquire(locks, &b.lock, "ann", "travel") == 0);
    cg_dialog_lock_release(locks, &a.lock);
    CHECK_STR(granted_log, "b");
    CHECK(cg_dialog_lock_acquire(locks, &c.lock, "ann", "travel") == 0);
    cg_dialog_lock_release(locks, &b.lock);
    CHECK_STR(granted_log, "bc");
    CHECK(c.lock.state == CG_LOCK_HELD);
    cg_dialog_lock_release(locks, &c.lock);
    CHECK(json_object_size(locks) == 0);
    json_decref(locks);
}

static void test_leave_line(void)
{
    json_t *locks = json_object();
    req a, b, c, d, e;
    req_init(&a, 'a', locks);
    req_init(&b, 'b', locks);
    req_init(&c, 'c', locks);
    req_init(&d, 'd', locks);
    req_init(&e, 'e', locks);
    reset_log();

    /* a holds; b, c, d wait; c leaves from the middle (its connection closed) */
    CHECK(cg_dialog_lock_acquire(locks, &a.lock, "u", "r") == 1);
    CHECK(cg_dialog_lock_acquire(locks, &b.lock, "u", "r") == 0);
    CHECK(cg_dialog_lock_acquire(locks, &c.lock, "u", "r") == 0);
    CHECK(cg_dialog_lock_acquire(locks, &d.lock, "u", "r") == 0);
    cg_dialog_lock_release(locks, &c.lock);
    CHECK(c.lock.state == CG_LOCK_NONE);
    CHECK(granted_n == 0);                    /* leaving passes nothing on */
    CHECK(a.lock.state == CG_LOCK_HELD);      /* and the holder still holds */
    /* d, now last, leaves; e arrives and must queue behind b, not behind the gone d */
    cg_dialog_lock_release(locks, &d.lock);
    CHECK(granted_n == 0);
    CHECK(cg_dialog_lock_acquire(locks, &e.lock, "u", "r") == 0);
    cg_dialog_lock_release(locks, &a.lock);
    CHECK_STR(granted_log, "b");
    cg_dialog_lock_release(locks, &b.lock);
    CHECK_STR(granted_log, "be");
    cg_dialog_lock_release(locks, &e.lock);
    CHECK_STR(granted_log, "be");
    CHECK(json_object_size(locks) == 0);

    /* the only waiter leaves; one who comes next waits, and is the one handed the lock */
    reset_log();
    CHECK(cg_dialog_lock_acquire(locks, &a.lock, "u", "r") == 1);
    CHECK(cg_dialog_lock_acquire(locks, &b.lock, "u", "r") == 0);
    cg_dialog_lock_release(locks, &b.lock);
    CHECK(cg_dialog_lock_acquire(locks, &c.lock, "u", "r") == 0);
    cg_dialog_lock_release(locks, &a.lock);
    CHECK_STR(granted_log, "c");
    cg_dialog_lock_release(locks, &c.lock);
    CHECK(json_object_size(locks) == 0);

    /* the first waiter leaves: the second is next */
    reset_log();
    CHECK(cg_dialog_lock_acquire(locks, &a.lock, "u", "r") == 1);
    CHECK(cg_dialog_lock_acquire(locks, &b.lock, "u", "r") == 0);
    CHECK(cg_dialog_lock_acquire(locks, &c.lock, "u", "r") == 0);
    cg_dialog_lock_release(locks, &b.lock);
    cg_dialog_lock_release(locks, &a.lock);
    CHECK_STR(granted_log, "c");
    cg_dialog_lock_release(locks, &c.lock);
    CHECK(json_object_size(locks) == 0);
    json_decref(locks);
}

static void test_dialogs_independent(void)
{
    json_t *locks = json_object();
    req a, b, c, d, e;
    req_init(&a, 'a', locks);
    req_init(&b, 'b', locks);
    req_init(&c, 'c', locks);
    req_init(&d, 'd', locks);
    req_init(&e, 'e', locks);
    reset_log();

    /* another room of the user, the same room of another user: each its own lock */
    CHECK(cg_dialog_lock_acquire(locks, &a.lock, "ann", "travel") == 1);
    CHECK(cg_dialog_lock_acquire(locks, &b.lock, "ann", "weather") == 1);
    CHECK(cg_dialog_lock_acquire(locks, &c.lock, "bob", "travel") == 1);
    /* names that would meet if the key were joined naively ("a:b" + "c" and "a" + "b:c") */
    CHECK(cg_dialog_lock_acquire(locks, &d.lock, "x:y", "z") == 1);
    CHECK(cg_dialog_lock_acquire(locks, &e.lock, "x", "y:z") == 1);
    CHECK(json_object_size(locks) == 5);
    /* letting one go passes nothing to the others */
    cg_dialog_lock_release(locks, &a.lock);
    cg_dialog_lock_release(locks, &d.lock);
    CHECK(granted_n == 0);
    CHECK(b.lock.state == CG_LOCK_HELD && c.lock.state == CG_LOCK_HELD && e.lock.state == CG_LOCK_HELD);
    /* a waiter of one dialog is handed its own dialog's lock only */
    CHECK(cg_dialog_lock_acquire(locks, &a.lock, "ann", "weather") == 0);
    cg_dialog_lock_release(locks, &c.lock);
    CHECK(granted_n == 0);
    cg_dialog_lock_release(locks, &b.lock);
    CHECK_STR(granted_log, "a");
    cg_dialog_lock_release(locks, &a.lock);
    cg_dialog_lock_release(locks, &e.lock);
    CHECK(json_object_size(locks) == 0);
    json_decref(locks);
}

static void test_release_non_holder(void)
{
    json_t *locks = json_object();
    req a, b, never;
    req_init(&a, 'a', locks);
    req_init(&b, 'b', locks);
    req_init(&never, 'n', locks);
    reset_log();

    /* a request freed before it asked (queued, then its connection closed) */
    cg_dialog_lock_release(locks, &never.lock);
    CHECK(never.lock.state == CG_LOCK_NONE);
    CHECK(json_object_size(locks) == 0);

    CHECK(cg_dialog_lock_acquire(locks, &a.lock, "ann", "travel") == 1);
    CHECK(cg_dialog_lock_acquire(locks, &b.lock, "ann", "travel") == 0);
    /* one that never asked lets go: the holder keeps it, the waiter still waits */
    cg_dialog_lock_release(locks, &never.lock);
    CHECK(granted_n == 0);
    CHECK(a.lock.state == CG_LOCK_HELD);
    CHECK(b.lock.state == CG_LOCK_WAITING);
    /* a holder that let go once and lets go again (freed after its turn) changes nothing:
     * b, handed the lock by the first release, keeps it */
    cg_dialog_lock_release(locks, &a.lock);
    CHECK_STR(granted_log, "b");
    cg_dialog_lock_release(locks, &a.lock);
    CHECK_STR(granted_log, "b");
    CHECK(b.lock.state == CG_LOCK_HELD);
    CHECK(cg_dialog_lock_acquire(locks, &never.lock, "ann", "travel") == 0); /* still held */
    cg_dialog_lock_release(locks, &never.lock);
    cg_dialog_lock_release(locks, &b.lock);
    cg_dialog_lock_release(locks, &b.lock);
    CHECK_STR(granted_log, "b");
    CHECK(json_object_size(locks) == 0);
    json_decref(locks);
}

/* A turn handed the lock may fail at once (session.c on_lock_granted: the load cannot start)
 * and let go from inside its granted, and free itself: the lock goes on down the line. */
static void test_release_from_granted(void)
{
    json_t *locks = json_object();
    req a, c;
    req_init(&a, 'a', locks);
    req_init(&c, 'c', locks);
    req *b = malloc(sizeof(*b));
    if (!b)
        abort();
    req_init(b, 'b', locks);
    b->release_on_grant = 1;
    b->free_on_grant = 1;
    reset_log();

    CHECK(cg_dialog_lock_acquire(locks, &a.lock, "ann", "travel") == 1);
    CHECK(cg_dialog_lock_acquire(locks, &b->lock, "ann", "travel") == 0);
    CHECK(cg_dialog_lock_acquire(locks, &c.lock, "ann", "travel") == 0);
    cg_dialog_lock_release(locks, &a.lock); /* b is handed it, lets go and is freed; c holds */
    CHECK_STR(granted_log, "bc");
    CHECK(c.lock.state == CG_LOCK_HELD);
    cg_dialog_lock_release(locks, &c.lock);
    CHECK(json_object_size(locks) == 0);

    /* the last in line does the same: the lock is gone after it */
    reset_log();
    req_init(&c, 'c', locks);
    c.release_on_grant = 1;
    CHECK(cg_dialog_lock_acquire(locks, &a.lock, "ann", "travel") == 1);
    CHECK(cg_dialog_lock_acquire(locks, &c.lock, "ann", "travel") == 0);
    cg_dialog_lock_release(locks, &a.lock);
    CHECK_STR(granted_log, "c");
    CHECK(c.lock.state == CG_LOCK_NONE);
    CHECK(json_object_size(locks) == 0);
    json_decref(locks);
}

int main(void)
{
    test_acquire_wait_release();
    test_leave_line();
    test_dialogs_independent();
    test_release_non_holder();
    test_release_from_granted();
    return unit_done("test_lock");
}
