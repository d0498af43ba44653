/*
 * fallback.h: degraded mode, a wrapper in front of any dialog store that can be away (today
 * the Redis one).
 *
 * The wrapper's tables (cg_fallback_dialog_ops, _lease_ops, _limit_ops) stand in the
 * store's table in front of its own (the inner store's), and decide where each request goes:
 * to the inner store while it is up, else to this process's memory:
 *   - the gateway's copy of each dialog (what it last read or wrote through the inner store),
 *     so a conversation keeps its context while the store is away;
 *   - the dialogs written while away, or whose save the inner store failed (the dirty set,
 *     bounded in dialogs and bytes, least recently written going first): read and written
 *     here until their write-back, each through the inner store's merging write-back;
 *   - the per-user limits counted here meanwhile; whether each dialog was told
 *     "store_degraded"; how long the store was away.
 * The inner store answers only what it did: a request it could not do is answered with
 * status.unavailable (store.h), and the wrapper answers it from memory. It never answers
 * from memory itself.
 *
 * The wrapper knows no store: it is handed the inner tables, a backend (the write-back) and
 * is told when the store goes away and comes back. The gateway's copy is also what the inner
 * store keeps as its cache of its own copy (Redis's rev: docs/state.md, "The gateway's
 * copy"): cg_fallback_copy hands it over, and the inner store tells the fallback what its
 * answers mean for it (known, forget, written, note_saved).
 * Nothing here calls back from inside a call but the backend's write-back, which answers
 * later, through cg_fallback_written.
 */
#ifndef CHATGATE_STORE_FALLBACK_H
#define CHATGATE_STORE_FALLBACK_H

#include <jansson.h>
#include <stdint.h>

#include "chatgate/dialog/dialog.h"
#include "chatgate/store/limits.h"
#include "chatgate/store/store.h"

typedef struct cg_fallback cg_fallback;

/* One dialog written while the store was away, due for the write-back. */
typedef struct cg_fallback_dirty {
    const char *key;  /* the dialog's key, "<eu>:<er>" (cg_store_dialog_key) */
    const char *eu, *er; /* its user and room, escaped (cg_store_escape) */
    long version;     /* which write this is: cg_fallback_written names it */
    int base_unknown; /* the dialog began from nothing while the store was away: the store's
                       * own copy, if any, is not the one it went on from */
} cg_fallback_dirty;

typedef struct cg_fallback_backend_ops {
    /*
     * Writes d (item's dialog as memory holds it) to the store, merged with the store's own
     * copy (another gateway may have written it meanwhile). d is the backend's either way:
     * it frees it (cg_dialog_free) when done, or at once when it returns -1. The answer comes
     * later through cg_fallback_written(item->key, item->version, ...). Returns 0, or -1 when
     * it could not start: the dialog stays dirty and is tried again.
     */
    int (*writeback)(void *backend, const cg_fallback_dirty *item, cg_dialog *d);
} cg_fallback_backend_ops;

/* The store the wrapper stands in front of: its jobs' own tables. */
typedef struct cg_fallback_inner {
    const cg_store_dialog_ops *dialogs;
    const cg_store_lease_ops *lease;
    const cg_store_limit_ops *limits;
} cg_fallback_inner;

/*
 * A fallback for st (its loop, clock, cfg: max_dialogs, max_bytes, lifetimes,
 * writeback_max_bytes; its stats: degraded, degraded_seconds, degraded_answers,
 * writeback_*, flushed, loads, saves, deletes), in front of inner's tables (st->fallback is
 * set: the wrapper's tables find it there), named `name` in logs ("redis 10.0.0.5:6379"),
 * starting as not degraded. Aborts when out of memory (startup).
 */
cg_fallback *cg_fallback_new(cg_store *st, const char *name, const cg_fallback_inner *inner,
                             const cg_fallback_backend_ops *ops, void *backend);
/* Frees fb, and the requests still in it, once cg_fallback_closing's `closed` was called
 * (and the inner store will answer nothing more). */
void cg_fallback_free(cg_fallback *fb);

/* ---- the store's state, as the store tells it ------------------------------------------ */

/* The store is away (why: for the log, each new reason once): answers come from memory. */
void cg_fallback_down(cg_fallback *fb, const char *why);
/* The store is back: the dirty dialogs are written back. moved: the store is another copy
 * than before (Sentinel named another primary) and may lack what the old one took last, so
 * the dialogs saved in the last SWITCH_REWRITE_MS (cg_fallback_note_saved) go again too. */
void cg_fallback_up(cg_fallback *fb, int moved);
/* Part of the store moved to another copy while it stayed up (a cluster master's slots to
 * its promoted replica): the dialogs saved lately of the users pick takes (eu: the user,
 * escaped) go again, as cg_fallback_up's move does for all. */
void cg_fallback_moved(cg_fallback *fb, int (*pick)(void *ctx, const char *eu), void *ctx);
int cg_fallback_degraded(const cg_fallback *fb);
/* Called every 100 ms or so while the store is up (now: uv_now()): the dialogs marked while
 * it was up (a save it failed with an error) are written back again once a second. */
void cg_fallback_tick(cg_fallback *fb, uint64_t now);
/* The store is closing: no callback is called from now on; closed(arg) is called from the
 * loop once the fallback's timer has closed. While the store is up (not degraded), the
 * dialogs still marked and not in flight are handed to the backend now; the write-backs go
 * on (a newer version after the one in flight, a refused one again through
 * cg_fallback_tick), and the store may wait for cg_fallback_dirty_count and
 * cg_fallback_saves_in_flight to reach 0 before it closes, then calls
 * cg_fallback_stop_writeback. The store away, none goes now: cg_fallback_up, should it come
 * back meanwhile, hands them over. */
void cg_fallback_closing(cg_fallback *fb, void (*closed)(void *arg), void *arg);
/* Saves handed to the inner store and not answered yet: one it fails is kept in memory and
 * marked then, so a closing store waits for them as for the marked dialogs. */
size_t cg_fallback_saves_in_flight(const cg_fallback *fb);
/* The store writes back no more (all done, its deadline passed, or it is away: why, for the
 * log): says how many dialogs are left unwritten; they are lost at exit. */
void cg_fallback_stop_writeback(cg_fallback *fb, const char *why);

/* ---- the wrapper's tables: the store's ops for its dialogs, lease and limits ------------ */

extern const cg_store_dialog_ops cg_fallback_dialog_ops;
extern const cg_store_lease_ops cg_fallback_lease_ops;
extern const cg_store_limit_ops cg_fallback_limit_ops;

/* Does memory answer for key even while the store is up? A dialog written while the store was
 * away (or whose save it failed) is read and written here until its write-back. */
int cg_fallback_is_dirty(const cg_fallback *fb, const char *key);

/* ---- the store's answers, as they bear on memory ------------------------------------------ */

/* The gateway's copy of the dialogs: the store may read it, and keep in it what it read or
 * wrote (cg_memstore_keep, cg_memstore_put_rev), as its cache of its own copy. */
cg_memstore *cg_fallback_copy(cg_fallback *fb);
/* Was key served fresh from memory while the store was away, with nothing of the store's
 * copy read or written since? A save of it then must only create, never replace. */
int cg_fallback_base_unknown(const cg_fallback *fb, const char *key);
/* The store's copy of key is known now (read, or written by this gateway). */
void cg_fallback_known(cg_fallback *fb, const char *key);
/* The store kept its own copy of key over this gateway's (a conflict): the gateway's copy
 * goes, so the next load reads the store's. */
void cg_fallback_forget(cg_fallback *fb, const char *key);
/* A save of key (version 0) or a write-back (its version) was answered: written, or refused
 * (the store kept its copy; the caller calls cg_fallback_forget). A write-back of the same
 * version ends the dialog's dirtiness; one of an older version sends the newer one now. */
void cg_fallback_written(cg_fallback *fb, const char *key, long version, int written);
/* A write-back could not be answered (the store failed it): it goes again at the next tick
 * or reconnect. */
void cg_fallback_writeback_failed(cg_fallback *fb, const char *key, long version);
/* The store took a save of key just now (eu, er: its user and room, escaped): noted for the
 * rewrite after a move (cg_fallback_up). */
void cg_fallback_note_saved(cg_fallback *fb, const char *key, const char *eu, const char *er);
/* The store deleted key itself (a room over max_rooms_per_user): forgotten here too. */
void cg_fallback_remove(cg_fallback *fb, const char *key);
/* The dialogs waiting for their write-back, now. */
size_t cg_fallback_dirty_count(const cg_fallback *fb);

#endif
