/*
 * resume.h: replies that outlive their client's connection (docs/protocol.md, "Resuming a
 * reply").
 *
 * A chatgate.v1 client that goes away mid-reply (a phone changing network, a tab put to
 * sleep) leaves its reply here, parked, instead of cancelling it: the turn goes on for
 * resume.grace_ms while nobody listens, and its text is kept as the client would have got
 * it (up to max_reply_bytes). The same user, on any connection of this gateway, sends
 * {"type":"resume","id":ID,"after":SEQ} and gets the reply's text after SEQ as one delta,
 * then the rest live, then the one terminal frame; it may cancel it. After the grace with
 * nobody listening, a reply still running is cancelled as it would have been at the
 * disconnect, and a finished one is forgotten: a later resume gets not_found.
 *
 * With a Redis store, a parked reply is also published to Redis once its client is gone, and
 * a resume through another gateway reads it there (resume.c says how).
 *
 * Ownership: a parked reply owns the connection's cg_turns (heap: the connection's memory
 * goes with it) until its turn has ended; the registry owns the parked replies. A listener
 * (the connection that resumed) is borrowed: it detaches before it goes.
 */
#ifndef CHATGATE_SERVER_RESUME_H
#define CHATGATE_SERVER_RESUME_H

#include <stdint.h>
#include <uv.h>

#include "chatgate/proto/protocol.h"
#include "chatgate/server/turn.h"

typedef struct cg_parked cg_parked;

/* How a parked reply reaches the connection that resumed it. */
typedef struct cg_resume_listener {
    void (*delta)(void *conn, const char *id, const char *text, size_t len, uint64_t seq);
    void (*frame)(void *conn, cg_frame_text frame, int last); /* taken; last: a terminal frame */
    void *conn;
    cg_parked **listening; /* the connection's list of the replies it listens to */
} cg_resume_listener;

typedef struct cg_resume {
    cg_turn_env *env;
    uint64_t grace_ms;  /* 0: nothing is parked (a disconnect cancels, as it always did) */
    long max_parked;    /* replies parked at once, at most */
    cg_parked *head;    /* every parked reply */
    long n;
    int warned_full;    /* the bound was logged */
} cg_resume;

void cg_resume_init(cg_resume *r, cg_turn_env *env, uint64_t grace_ms, long max_parked);

/*
 * The client of q (heap-allocated) is gone. 0: its reply in flight is parked, and q is the
 * registry's; -1: there is none to keep (or resume is off, the gateway is draining, or the
 * bound is reached): the caller closes q as always.
 */
int cg_resume_park(cg_resume *r, cg_turns *q, const char *user);

/*
 * {"type":"resume"} from user: the reply of message id, parked here, goes to the listener
 * from after on (what was kept after it now, as one delta; the terminal frame if it has
 * ended; the rest live): 0; -1 when this gateway keeps no reply of this user with this id.
 * A listener that had it before gets its one terminal frame (not_found: resumed elsewhere).
 */
int cg_resume_attach(cg_resume *r, const char *user, const char *id, uint64_t after, const cg_resume_listener *l);
/* The same for a reply another gateway sharing a Redis store may hold: 1, and it comes as it
 * is read from the store (deltas as the holder published them, then its terminal frame), or
 * a not_found error frame when the store has none; -1 when the store shares no replies, or
 * at max_parked, or at the user's bound of readers. */
int cg_resume_attach_remote(cg_resume *r, const char *user, const char *id, uint64_t after,
                            const cg_resume_listener *l);

/* The listening connection's queue is over its mark (1) or under it again (0): the replies
 * it listens to pause (a turn here: its upstream; a reader: its reads), as its own do. */
void cg_resume_pause_all(cg_parked *listening, int paused);

/* The listening connection goes: the replies it listened to are unattended again, and their
 * grace starts afresh. */
void cg_resume_detach_all(cg_parked **listening);

/* The user's cancel of a parked reply: 0 (a reply read from another gateway: the cancel goes
 * there over the store's bus), -1 when there is none of this id. */
int cg_resume_cancel(cg_resume *r, const char *user, const char *id);

/* The gateway begins to drain. Without a store that shares replies (memory), nobody can
 * resume one from here on: the replies nobody listens to stop now, not at the drain's end.
 * With Redis they go on (published: a resume through another gateway reads them, as in a
 * rolling restart), within the drain's time. */
void cg_resume_draining(cg_resume *r);

/* The gateway stops: every parked reply still running is cancelled (saved as such). */
void cg_resume_close(cg_resume *r);

#endif
