/*
 * lock.c: the per-dialog lock (see lock.h).
 *
 * A lock is a line of waiters in a json object keyed by the dialog's store key (the escaped
 * user and room, so no two dialogs share one), which holds the lock's address
 * (core/addrmap.h). The holder is not in the line; the lock is freed when its holder lets go and
 * nobody waits. Across gateways this needs a lock in Redis (the next step of
 * docs/architecture.md, "Scaling out").
 */
#include <stdlib.h>

#include "chatgate/core/alloc.h"
#include "chatgate/core/addrmap.h"
#include "chatgate/store/lock.h"
#include "chatgate/store/store.h"

typedef struct dialog_lock {
    cg_dialog_lock_waiter *holder;
    cg_dialog_lock_waiter *waiters, *last; /* in arrival order */
} dialog_lock;

static dialog_lock *lock_of(json_t *locks, const char *key)
{
    return cg_addrmap_get(locks, key);
}

int cg_dialog_lock_acquire(json_t *locks, cg_dialog_lock_waiter *w, const char *user, const char *room)
{
    w->key = cg_store_dialog_key(user, room);
    w->next = NULL;
    dialog_lock *l = lock_of(locks, w->key);
    if (!l) {
        l = cg_calloc(1, sizeof(*l));
        if (cg_addrmap_set(locks, w->key, l) < 0)
            cg_out_of_memory(sizeof(*l)); /* jansson's object could not grow */
        l->holder = w;
        w->state = CG_LOCK_HELD;
        return 1;
    }
    w->state = CG_LOCK_WAITING;
    if (l->last)
        l->last->next = w;
    else
        l->waiters = w;
    l->last = w;
    return 0;
}

cg_dialog_lock_waiter *cg_dialog_lock_holder(json_t *locks, const char *key)
{
    dialog_lock *l = lock_of(locks, key);
    return l ? l->holder : NULL;
}

void cg_dialog_lock_release(json_t *locks, cg_dialog_lock_waiter *w)
{
    dialog_lock *l = w->state != CG_LOCK_NONE ? lock_of(locks, w->key) : NULL;
    cg_dialog_lock_waiter *next = NULL;
    if (l && w->state == CG_LOCK_WAITING) {
        cg_dialog_lock_waiter **pp = &l->waiters, *prev = NULL;
        while (*pp && *pp != w)
            prev = *pp, pp = &(*pp)->next;
        if (*pp)
            *pp = w->next;
        if (l->last == w)
            l->last = prev;
    } else if (l && !(next = l->waiters)) {
        json_object_del(locks, w->key);
        free(l);
    } else if (l) {
        l->waiters = next->next;
        if (!l->waiters)
            l->last = NULL;
        next->next = NULL;
        next->state = CG_LOCK_HELD;
        l->holder = next;
    }
    w->state = CG_LOCK_NONE;
    w->next = NULL;
    free(w->key);
    w->key = NULL;
    if (next) /* last: its callback may release again, or free what it belongs to */
        next->granted(next);
}
