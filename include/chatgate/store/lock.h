/*
 * lock.h: one turn at a time per dialog (user, room) in this process. A turn holds its
 * dialog's lock from the dialog's load to its save, so that two connections of one user in
 * one room (two tabs, or a tab and a drop-in client) cannot both load the dialog and have the
 * later save drop what the other added. Waiters are served in arrival order. The locks live
 * in one json object (dialog key -> lock) owned by the gateway and passed in by the caller
 * (the turn, server/turn.c).
 */
#ifndef CHATGATE_STORE_LOCK_H
#define CHATGATE_STORE_LOCK_H

#include <jansson.h>
#include <stdint.h>

typedef enum { CG_LOCK_NONE, CG_LOCK_HELD, CG_LOCK_WAITING } cg_lock_state;

/*
 * One holder of, or waiter for, a dialog's lock; embedded in the caller's request and zeroed
 * with it. `granted` is called when the lock passes to this waiter (from inside another
 * holder's cg_dialog_lock_release()); `owner` is the caller's.
 */
typedef struct cg_dialog_lock_waiter {
    void (*granted)(struct cg_dialog_lock_waiter *w);
    void *owner;
    cg_lock_state state;
    char *key;                          /* internal: the dialog's key while held or waiting */
    struct cg_dialog_lock_waiter *next; /* internal: the next in line */
} cg_dialog_lock_waiter;

/* Takes the lock of (user, room) for w: 1 when w holds it now, 0 when w waits in line
 * (w->granted comes later, never from inside this call). */
int cg_dialog_lock_acquire(json_t *locks, cg_dialog_lock_waiter *w, const char *user, const char *room);
/* The holder of the dialog's lock (key: cg_store_dialog_key), or NULL when it is free. */
cg_dialog_lock_waiter *cg_dialog_lock_holder(json_t *locks, const char *key);
/* Lets go: a holder passes the lock to the next in line (whose granted runs now), a waiter
 * leaves the line; nothing when w is neither. */
void cg_dialog_lock_release(json_t *locks, cg_dialog_lock_waiter *w);

#endif
