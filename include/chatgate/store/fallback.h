/*
 * fallback.h: degraded mode, for any dialog store that can be away (today the Redis one).
 *
 * A store shared between gateways answers from this process's memory while it is away:
 * the gateway's copy of each dialog (what it last read or wrote there), so a conversation
 * keeps its context; the dialogs written while away (the dirty set, bounded in dialogs and
 * bytes, least recently written going first), written back when the store returns, each
 * through the store's own merging write-back; the per-user limits counted here meanwhile;
 * whether each dialog was told "store_degraded"; how long the store was away.
 *
 * The fallback knows no store: it is handed a backend (a table of function pointers: the
 * write-back) and is told when the store goes away and comes back. The store, for its
 * part, asks it whether it is degraded (cg_fallback_degraded) and hands it what it cannot
 * answer (cg_fallback_answer_req).
 * Nothing here calls back from inside a call except the backend's write-back, which answers
 * later, through cg_fallback_written.
 *
 * The gateway's copy is also what a store may keep as its cache of its own copy (Redis's
 * rev: docs/state.md, "The gateway's copy"): cg_fallback_copy hands it over.
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

/*
 * A fallback for st (its loop, clock, cfg: max_dialogs, max_bytes, lifetimes,
 * writeback_max_bytes; its stats: degraded, degraded_seconds, degraded_answers,
 * writeback_*, flushed), named `name` in logs ("redis 10.0.0.5:6379"), starting as not
 * degraded. Aborts when out of memory (startup).
 */
cg_fallback *cg_fallback_new(cg_store *st, const char *name, const cg_fallback_backend_ops *ops, void *backend);
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
/* The store is closing: says how many dialogs were never written back. */
void cg_fallback_closing(cg_fallback *fb);

/* ---- answers from memory ------------------------------------------------------------------ */

/* Does memory answer for key even while the store is up? A dialog written while the store was
 * away (or whose save it failed) is read and written here until its write-back. */
int cg_fallback_is_dirty(const cg_fallback *fb, const char *key);

/* What a request is about, as its store holds it: the fallback knows no store's request
 * type beyond their common header (store.h, CG_STORE_REQ_FIELDS). */
typedef struct cg_fallback_subject {
    const char *key;           /* the dialog's key; rooms: "<eu>:" */
    const char *eu, *er;       /* user and room, escaped */
    const char *user;          /* remove_user: the user as given */
    const cg_dialog *snapshot; /* save: the dialog; NULL when cg_fallback_save kept it already */
    long version;              /* save: a write-back's version (cg_fallback_dirty), else 0 */
    const cg_limits *limits;   /* limit: what the message is held to */
    json_t *profile;           /* profile: the answer (the store's copy decided it; NULL: none) */
    int profile_err;           /* profile: an update refused */
} cg_fallback_subject;

/*
 * Answers req (any store's request: its kind and callback) from memory, the store being away
 * or having failed it: a load from the gateway's copy (degraded, found, and warn on the
 * dialog's first such load in this outage: a save's answer reaches nobody, so it must not
 * use up the warning); a save kept and marked for the write-back (a failed write-back goes
 * again later); a delete here; the rooms memory holds; a limit counted by this gateway
 * alone. The callback is not called when req was abandoned or `closing`.
 */
void cg_fallback_answer_req(cg_fallback *fb, cg_store_req *req, const cg_fallback_subject *s, int closing);

/* Keeps d in memory (its parts shared, not copied: store.h) and marks it for the write-back. */
void cg_fallback_save(cg_fallback *fb, const char *key, const char *eu, const char *er, const cg_dialog *d);
/* Forgets key here: memory and write-back. */
void cg_fallback_remove(cg_fallback *fb, const char *key);
/* Forgets every dialog of user (eu: escaped) here: memory, write-back and limit counts. */
void cg_fallback_remove_user(cg_fallback *fb, const char *user, const char *eu);
/* A turn counted here ended (its tokens count here too). */
void cg_fallback_limit_end(cg_fallback *fb, const char *eu, const cg_limits *lim, long long tokens, int64_t now);

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
/* The dialogs waiting for their write-back, now. */
size_t cg_fallback_dirty_count(const cg_fallback *fb);

#endif
