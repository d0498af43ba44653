/*
 * resume.c: replies that outlive their client's connection (see resume.h).
 *
 * A parked reply is in one of three states: its turn runs (RUNNING: the connection's
 * cg_turns report here), its turn has ended and its cg_turns waits to be closed from the
 * loop (ENDED: never closed inside the turn's own callback), or only the record is kept
 * (KEPT: the text and the terminal frame, for a resume that comes late). One timer per
 * parked reply serves all three: the grace while nobody listens, and the close after the end.
 *
 * Across gateways (a Redis store: cg_store_reply_ops). A parked reply is also published, a
 * piece at most every PUBLISH_MS, to a Redis Stream (what was kept, then the text as it comes,
 * then the terminal frame): only once its client is gone, so a client that stays costs no
 * command per delta. A resume this gateway does not hold reads that stream (REMOTE: a reader,
 * not a holder): what it has after `after`, then every POLL_MS what came since, to the
 * terminal frame; while it reads it says so in Redis, and the holder, at its grace, goes on
 * instead of cancelling. A cancel it gets goes to the holder over the store's cancel bus.
 */
#include "chatgate/server/resume.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "chatgate/core/alloc.h"
#include "chatgate/core/buf.h"
#include "chatgate/core/error.h"
#include "chatgate/core/log.h"
#include "chatgate/core/utf8.h"

typedef enum { PARKED_RUNNING, PARKED_ENDED, PARKED_KEPT, PARKED_REMOTE } parked_state;

#define PUBLISH_MS 50     /* a published reply's pieces: at most one XADD this often */
#define POLL_MS 100       /* a remote reader reads what came this often */
#define LISTEN_MS 3000    /* ... and says it listens, for this long, every second */
#define HOLD_ON_MS 1000   /* a holder whose reply is read elsewhere looks again this much later */
#define MAX_READERS_PER_USER 8 /* resumes of replies held elsewhere, a user's at once */
#define APPEAR_MS 3000    /* a reply not (yet) in the store is looked for this long before not_found */

struct cg_parked {
    cg_parked *next; /* in the registry */
    cg_resume *r;
    parked_state state;
    cg_turns *q;     /* RUNNING, ENDED: the gone connection's turns, owned */
    char *user, *id, *name;
    char *text;      /* the reply as its client would have got it, up to max_reply_bytes */
    size_t len, cap;
    uint64_t seq;    /* bytes of the reply relayed (text may hold fewer: max_reply_bytes) */
    char *terminal;  /* once ended: its terminal frame's JSON, for a late resume */
    size_t terminal_len;
    uint64_t deadline; /* uv_now() at which the grace ends */
    uint64_t ended_at; /* uv_now() at its end (ENDED, KEPT): kept twice the grace past it at most */
    uv_timer_t *timer; /* malloc'd: it closes after the record is freed */
    cg_resume_listener l; /* l.conn NULL: nobody listens */
    cg_parked *lnext, **lpprev; /* in the listener's list */
    char *room;        /* the dialog's (a holder's; a reader's once read), for a cancel */
    int pending;       /* store calls out: their callbacks come (also at the store's close) */
    int paused;        /* the listener's queue is full: the reply waits (cg_resume_pause_all) */
    int truncated;     /* text stopped at max_reply_bytes: nothing more is kept */
    int dead;          /* freed when the last of them comes */
    /* a holder, publishing (a store with replies) */
    int published;
    char *pub;         /* text not yet appended */
    size_t pub_len, pub_cap;
    uv_timer_t *pub_timer;
    /* a reader (REMOTE) */
    uint64_t after;    /* the bytes the listener has */
    int failures;      /* reads in a row the store did not answer */
    char *last_entry;  /* the stream's last entry read */
    uint64_t last_listen, last_news; /* uv_now() of the last listen said, of the last entry read */
};

/* ---- the record ------------------------------------------------------------------------- */

static void timer_closed(uv_handle_t *h)
{
    free(h);
}

static void listener_unlink(cg_parked *p)
{
    if (p->paused && p->state == PARKED_RUNNING)
        cg_turns_pause(p->q, 0); /* nobody reads slowly now */
    p->paused = 0;
    if (p->lpprev) {
        *p->lpprev = p->lnext;
        if (p->lnext)
            p->lnext->lpprev = p->lpprev;
    }
    p->lnext = NULL;
    p->lpprev = NULL;
    p->l = (cg_resume_listener){0};
}

static void parked_release(cg_parked *p)
{
    free(p->user);
    free(p->id);
    free(p->name);
    free(p->text);
    free(p->terminal);
    free(p->room);
    free(p->pub);
    free(p->last_entry);
    free(p);
}

/* Out of the registry and the listener's list, its timers closed; its memory goes now, or
 * when the store's last callback about it comes. */
static void parked_free(cg_parked *p)
{
    cg_resume *r = p->r;
    for (cg_parked **pp = &r->head; *pp; pp = &(*pp)->next)
        if (*pp == p) {
            *pp = p->next;
            r->n--;
            break;
        }
    listener_unlink(p);
    uv_close((uv_handle_t *)p->timer, timer_closed);
    if (p->pub_timer)
        uv_close((uv_handle_t *)p->pub_timer, timer_closed);
    p->dead = 1;
    if (!p->pending)
        parked_release(p);
}

/* A store callback came: 1 when p is gone meanwhile (and now freed). */
static int came_back(cg_parked *p)
{
    p->pending--;
    if (!p->dead)
        return 0;
    if (!p->pending)
        parked_release(p);
    return 1;
}

static cg_store *store_of(const cg_parked *p)
{
    return p->r->env->store;
}

static const cg_store_reply_ops *replies_of(const cg_parked *p)
{
    cg_store *st = store_of(p);
    return st ? st->ops->replies : NULL;
}

/* ---- publishing (a holder, with a store that has replies) --------------------------------- */

/* The stream lives past the grace: a reader that comes late still finds the end. */
static long stream_ttl(const cg_parked *p)
{
    return (long)p->r->grace_ms * 2 + 10000;
}

/* Appends what waits (and end, the terminal frame's JSON, or NULL). */
static void on_publish_timer(uv_timer_t *t);

static void publish(cg_parked *p, const char *end, size_t end_len)
{
    if (!p->published || (!p->pub_len && !end))
        return;
    cg_reply_entry e = {.seq = p->seq, .text = p->pub ? p->pub : "", .len = p->pub_len, .end = end,
                        .end_len = end_len};
    if (replies_of(p)->append(store_of(p), p->user, p->id, &e, stream_ttl(p)) == 0)
        p->pub_len = 0;
    else if (!uv_is_active((uv_handle_t *)p->pub_timer)) /* Redis away: kept, tried again */
        uv_timer_start(p->pub_timer, on_publish_timer, PUBLISH_MS * 10, 0);
}

static void on_publish_timer(uv_timer_t *t)
{
    cg_parked *p = t->data;
    publish(p, p->state == PARKED_RUNNING ? NULL : p->terminal, p->state == PARKED_RUNNING ? 0 : p->terminal_len);
}

/* The first entry: what was kept, and the room. */
static void publish_start(cg_parked *p)
{
    if (!replies_of(p))
        return;
    p->published = 1;
    p->pub_timer = cg_malloc(sizeof(*p->pub_timer));
    uv_timer_init(p->r->env->loop, p->pub_timer);
    p->pub_timer->data = p;
    cg_reply_entry e = {.seq = p->len, .text = p->text ? p->text : "", .len = p->len, .room = p->room};
    replies_of(p)->append(store_of(p), p->user, p->id, &e, stream_ttl(p));
}

static void publish_text(cg_parked *p, const char *text, size_t len)
{
    if (!p->published)
        return;
    cg_buf_append(&p->pub, &p->pub_len, &p->pub_cap, text, len, 256);
    if (!uv_is_active((uv_handle_t *)p->pub_timer))
        uv_timer_start(p->pub_timer, on_publish_timer, PUBLISH_MS, 0);
}

/* The text kept, up to max_reply_bytes cut on a character boundary, as the turn keeps it. */
static void keep_text(cg_parked *p, const char *text, size_t len)
{
    if (!p->truncated) /* past the cut nothing: the kept text stays a prefix of what was sent */
        p->truncated = cg_buf_append_upto(&p->text, &p->len, &p->cap, text, len,
                                          (size_t)p->r->env->cfg->max_reply_bytes);
}

static void on_timer(uv_timer_t *t);

static void arm(cg_parked *p, uint64_t ms)
{
    uv_timer_start(p->timer, on_timer, ms, 0);
}

/* The grace starts afresh: nobody listens from now. An ended reply's, for a listener whose
 * connection went before its end reached it, only up to twice the grace after the end: a
 * client that resumes and drops it again and again does not keep it for ever. */
static void grace_restart(cg_parked *p)
{
    uint64_t now = uv_now(p->timer->loop), grace = p->r->grace_ms;
    p->deadline = now + grace;
    if (p->state == PARKED_ENDED || p->state == PARKED_KEPT) {
        uint64_t last = p->ended_at + 2 * grace;
        p->deadline = last < p->deadline ? last : p->deadline;
    }
    if (p->state != PARKED_ENDED) /* ENDED: its close comes first, and arms what is left */
        arm(p, p->deadline > now ? p->deadline - now : 0);
}

/* The turn has ended: its frame is kept; the turns close from the loop. */
static void ended(cg_parked *p, cg_frame_text frame)
{
    if (p->state != PARKED_RUNNING) {
        free(frame.buf);
        return;
    }
    p->state = PARKED_ENDED;
    p->ended_at = uv_now(p->timer->loop);
    free(p->terminal);
    p->terminal = cg_malloc(frame.len + 1);
    memcpy(p->terminal, frame.json, frame.len + 1);
    p->terminal_len = frame.len;
    publish(p, p->terminal, p->terminal_len);
    if (p->l.conn)
        p->l.frame(p->l.conn, frame, 1);
    else
        free(frame.buf);
    arm(p, 0);
}

/* Nobody came back within the grace: the reply stops, as it would have at the disconnect. */
static void grace_over(cg_parked *p)
{
    cg_info("resume: message %s of a gone client: nobody resumed it within %llu ms (resume.grace_ms): cancelled",
            p->id, (unsigned long long)p->r->grace_ms);
    cg_turns_cancel(p->q, p->id); /* its cancelled comes back here: ENDED */
}

/* Whether another gateway reads the reply: then it goes on, and the question comes again. */
static void on_listened(void *ctx, int listened)
{
    cg_parked *p = ctx;
    if (came_back(p) || p->state != PARKED_RUNNING || p->l.conn)
        return;
    if (listened)
        arm(p, HOLD_ON_MS);
    else
        grace_over(p);
}

static void remote_poll(cg_parked *p);

static void on_timer(uv_timer_t *t)
{
    cg_parked *p = t->data;
    uint64_t now = uv_now(t->loop);
    switch (p->state) {
    case PARKED_RUNNING: /* the grace passed */
        if (p->l.conn)
            return; /* someone listens here: it goes on */
        if (p->published && replies_of(p)->listened(store_of(p), p->user, p->id, on_listened, p) == 0) {
            p->pending++; /* another gateway may serve it: asked first */
            return;
        }
        grace_over(p);
        return;
    case PARKED_ENDED:
        cg_turns_close(p->q);
        free(p->q);
        p->q = NULL;
        p->state = PARKED_KEPT;
        arm(p, p->deadline > now ? p->deadline - now : 0);
        return;
    case PARKED_KEPT: /* kept for a late resume as long as the grace, no longer */
        parked_free(p);
        return;
    case PARKED_REMOTE:
        remote_poll(p);
        return;
    }
}

/* ---- what the turn says (its sink) ------------------------------------------------------- */

static void pk_ack(void *conn, const cg_ack *ack)
{
    cg_parked *p = conn;
    if (p->l.conn)
        p->l.frame(p->l.conn, cg_protocol_ack(ack), 0);
}

static void pk_delta(void *conn, const char *id, const char *text, size_t len, uint64_t seq)
{
    cg_parked *p = conn;
    keep_text(p, text, len);
    p->seq = seq;
    publish_text(p, text, len);
    if (p->l.conn)
        p->l.delta(p->l.conn, id, text, len, seq);
}

static void pk_done(void *conn, const char *id, const char *reply, size_t len, json_t *usage, int truncated,
                    const cg_answer *who)
{
    ended(conn, cg_protocol_done(id, reply, len, usage, truncated, who));
}

static void pk_cancelled(void *conn, const char *id)
{
    ended(conn, cg_protocol_cancelled(id));
}

static void pk_error(void *conn, const char *id, int err, const char *message, json_t *detail)
{
    ended(conn, cg_protocol_error_detail(id, cg_err_code(err), message, detail));
}

static void pk_warning(void *conn, const char *id, const char *code, const char *message)
{
    cg_parked *p = conn;
    if (p->l.conn)
        p->l.frame(p->l.conn, cg_protocol_warning(id, code, message), 0);
}

static void pk_context(void *conn, const char *room, json_t *state)
{
    cg_parked *p = conn;
    if (p->l.conn)
        p->l.frame(p->l.conn, cg_protocol_context(room, state), 0);
}

static const cg_turn_sink parked_sink = {
    .ack = pk_ack,
    .delta = pk_delta,
    .done = pk_done,
    .cancelled = pk_cancelled,
    .error = pk_error,
    .warning = pk_warning,
    .context = pk_context,
};

/* ---- the registry ------------------------------------------------------------------------ */

void cg_resume_init(cg_resume *r, cg_turn_env *env, uint64_t grace_ms, long max_parked)
{
    *r = (cg_resume){.env = env, .grace_ms = grace_ms, .max_parked = max_parked};
}

/* The user's reply of id this gateway holds (remote 0), or a resume of it it serves from
 * another's (remote 1). */
static cg_parked *find(cg_resume *r, const char *user, const char *id, int remote)
{
    for (cg_parked *p = r->head; p; p = p->next)
        if ((p->state == PARKED_REMOTE) == remote && strcmp(p->id, id) == 0 && strcmp(p->user, user) == 0)
            return p;
    return NULL;
}

/* ---- a resume of another gateway's reply (REMOTE) ----------------------------------------- */

/* p's listener, if another connection than l's, loses the reply to l: its one terminal frame
 * (none when it has had the reply's own already: a reply ends once for a listener). */
static void displace(const cg_parked *p, const cg_resume_listener *l)
{
    if (p->l.conn && p->l.conn != l->conn && !p->terminal)
        p->l.frame(p->l.conn, cg_protocol_error_detail(p->id, cg_err_code(CG_E_NOT_FOUND), "this reply was resumed "
                                                       "on another connection", NULL), 1);
}

static void listen_link(cg_parked *p, const cg_resume_listener *l)
{
    displace(p, l); /* a listener before (another tab) */
    listener_unlink(p); /* this one takes over */
    p->l = *l;
    p->lnext = *l->listening;
    if (p->lnext)
        p->lnext->lpprev = &p->lnext;
    p->lpprev = l->listening;
    *l->listening = p;
}

/* The reader is done: what it says last went out. */
static void remote_end(cg_parked *p, cg_frame_text last)
{
    if (p->l.conn)
        p->l.frame(p->l.conn, last, 1);
    else
        free(last.buf);
    parked_free(p);
}

/* The holder's terminal frame, as it came from the store: sent on only when it is one, about
 * this message (a store's answer is not trusted blindly). */
static cg_frame_text remote_terminal(const cg_parked *p, const char *json, size_t len)
{
    json_t *o = json_loadb(json, len, 0, NULL);
    const char *type = json_string_value(json_object_get(o, "type"));
    const char *id = json_string_value(json_object_get(o, "id"));
    int ok = type && id && strcmp(id, p->id) == 0 &&
             (strcmp(type, "done") == 0 || strcmp(type, "cancelled") == 0 || strcmp(type, "error") == 0);
    json_decref(o);
    if (!ok) {
        cg_warn("resume: message %s: the end of its reply read from the store is not a terminal frame of it", p->id);
        return cg_protocol_error_detail(p->id, cg_err_code(CG_E_INTERNAL), "the reply's end could not be read back", NULL);
    }
    char *buf = cg_malloc(CG_FRAME_PRE + len + 1);
    memcpy(buf + CG_FRAME_PRE, json, len);
    buf[CG_FRAME_PRE + len] = 0;
    return (cg_frame_text){.buf = buf, .json = buf + CG_FRAME_PRE, .len = len};
}

/* Says in the store, every HOLD_ON_MS, that a resume reads the reply: its holder goes on. */
static void listen_now(cg_parked *p, uint64_t now)
{
    if (now - p->last_listen < HOLD_ON_MS)
        return;
    replies_of(p)->listen(store_of(p), p->user, p->id, LISTEN_MS);
    p->last_listen = now;
}

/* One piece: the bytes (seq - len, seq]; the listener gets those after what it has. */
static void remote_piece(cg_parked *p, const cg_reply_entry *e)
{
    uint64_t begin = e->seq - e->len;
    if (e->seq <= p->after || !p->l.conn)
        return;
    if (begin > p->after) /* pieces lost in the store (trimmed, or not written): the seq jumps */
        cg_warn("resume: message %s: bytes %llu to %llu of the reply were not in the store", p->id,
                (unsigned long long)p->after, (unsigned long long)begin);
    size_t from = p->after > begin ? (size_t)(p->after - begin) : 0;
    while (from < e->len && ((unsigned char)e->text[from] & 0xC0) == 0x80)
        from++;
    if (from < e->len && cg_utf8_valid(e->text + from, e->len - from))
        p->l.delta(p->l.conn, p->id, e->text + from, e->len - from, e->seq);
    p->after = e->seq;
}

static void on_entries(void *ctx, const cg_reply_entry *e, size_t n, int failed)
{
    cg_parked *p = ctx;
    if (came_back(p))
        return;
    uint64_t now = uv_now(p->timer->loop);
    if (failed && p->last_entry && ++p->failures < 50) { /* away a moment: read again */
        arm(p, POLL_MS);
        return;
    }
    p->failures = 0;
    if (!failed && !p->last_entry && n == 0 && now - p->last_news < APPEAR_MS) {
        arm(p, POLL_MS); /* its gateway may not have seen its client go yet (a reset on its way) */
        return;
    }
    if (failed || (!p->last_entry && n == 0)) { /* the store is away, or holds no such reply */
        remote_end(p, cg_protocol_error_detail(p->id, cg_err_code(CG_E_NOT_FOUND), "no reply of this id to resume: it was never "
                                               "here, or it ended or was cancelled more than resume.grace_ms ago",
                                               NULL));
        return;
    }
    for (size_t i = 0; i < n; i++) {
        if (e[i].room && !p->room)
            p->room = cg_strdup(e[i].room);
        remote_piece(p, &e[i]);
        free(p->last_entry);
        p->last_entry = cg_strdup(e[i].entry);
        p->last_news = now;
        if (e[i].end) {
            cg_info("resume: message %s: its reply, read from another gateway's, has ended", p->id);
            remote_end(p, remote_terminal(p, e[i].end, e[i].end_len));
            return;
        }
    }
    if (now - p->last_news > p->r->grace_ms * 2 + 10000) { /* its holder went away (killed, say) */
        remote_end(p, cg_protocol_error_detail(p->id, cg_err_code(CG_E_UPSTREAM_UNAVAILABLE), "the reply stopped coming: the "
                                               "gateway that held it went away", NULL));
        return;
    }
    listen_now(p, now);
    arm(p, n && !p->paused ? 0 : POLL_MS); /* a full read may have more behind it */
}

static void remote_poll(cg_parked *p)
{
    if (p->paused) { /* the listener reads slowly: no more is read, but its holder is told it listens */
        listen_now(p, uv_now(p->timer->loop));
        arm(p, POLL_MS);
        return;
    }
    if (replies_of(p)->read(store_of(p), p->user, p->id, p->last_entry, on_entries, p) == 0) {
        p->pending++;
        return;
    }
    remote_end(p, cg_protocol_error_detail(p->id, cg_err_code(CG_E_NOT_FOUND),
                                           "no reply of this id to resume: the store that holds it is away", NULL));
}

/* A resume of a reply this gateway does not hold: read from the store, if it has replies. */
int cg_resume_attach_remote(cg_resume *r, const char *user, const char *id, uint64_t after, const cg_resume_listener *l)
{
    cg_store *st = r->env->store;
    if (!st || !st->ops->replies || r->n >= r->max_parked)
        return -1;
    cg_parked *old = find(r, user, id, 1);
    if (old) { /* one reader a reply: the one before ends (its listener told) */
        displace(old, l);
        parked_free(old);
    }
    int readers = 0;
    for (cg_parked *q = r->head; q; q = q->next)
        readers += q->state == PARKED_REMOTE && strcmp(q->user, user) == 0;
    if (readers >= MAX_READERS_PER_USER)
        return -1;
    cg_parked *p = cg_calloc(1, sizeof(*p));
    p->r = r;
    p->state = PARKED_REMOTE;
    p->user = cg_strdup(user);
    p->id = cg_strdup(id);
    p->name = cg_strdup("(a resume)");
    p->after = after;
    p->timer = cg_malloc(sizeof(*p->timer));
    uv_timer_init(r->env->loop, p->timer);
    p->timer->data = p;
    p->last_news = p->last_listen = uv_now(r->env->loop);
    p->next = r->head;
    r->head = p;
    r->n++;
    listen_link(p, l);
    st->ops->replies->listen(st, user, id, LISTEN_MS); /* first: its holder's grace may be ending */
    remote_poll(p);
    return 1;
}

int cg_resume_park(cg_resume *r, cg_turns *q, const char *user)
{
    const char *id, *room, *text;
    size_t len;
    uint64_t seq;
    if (!r->grace_ms || r->env->stopping || cg_turns_reply(q, &id, &room, &text, &len, &seq) < 0)
        return -1;
    if (r->n >= r->max_parked) {
        if (!r->warned_full)
            cg_warn("resume: %ld replies of gone clients are kept already (resume.max_parked): the next are "
                    "cancelled at the disconnect, as without resume", r->n);
        r->warned_full = 1;
        return -1;
    }
    r->warned_full = 0;
    cg_parked *p = cg_calloc(1, sizeof(*p));
    p->r = r;
    p->q = q;
    p->user = cg_strdup(user);
    p->id = cg_strdup(id);
    p->room = cg_strdup(room);
    char name[64];
    snprintf(name, sizeof(name), "%s (gone)", q->name ? q->name : "?");
    p->name = cg_strdup(name);
    keep_text(p, text, len);
    p->seq = seq;
    p->timer = cg_malloc(sizeof(*p->timer));
    uv_timer_init(r->env->loop, p->timer);
    p->timer->data = p;
    p->next = r->head;
    r->head = p;
    r->n++;
    cg_turns_hand_over(q, &parked_sink, p, p->user, p->name);
    grace_restart(p);
    publish_start(p);
    cg_info("resume: %s: the client left mid-reply: message %s goes on, kept %llu ms for a resume", name, p->id,
            (unsigned long long)r->grace_ms);
    return 0;
}

int cg_resume_attach(cg_resume *r, const char *user, const char *id, uint64_t after, const cg_resume_listener *l)
{
    cg_parked *p = find(r, user, id, 0);
    if (!p)
        return -1;
    listen_link(p, l);
    /* what was kept after `after` (a seq of ours: a character boundary; else the next one) */
    size_t from = after < p->len ? (size_t)after : p->len;
    while (from < p->len && ((unsigned char)p->text[from] & 0xC0) == 0x80)
        from++;
    if (from < p->len)
        l->delta(l->conn, p->id, p->text + from, p->len - from, p->len);
    if (p->terminal) {
        char *buf = cg_malloc(CG_FRAME_PRE + p->terminal_len + 1);
        memcpy(buf + CG_FRAME_PRE, p->terminal, p->terminal_len + 1);
        l->frame(l->conn, (cg_frame_text){.buf = buf, .json = buf + CG_FRAME_PRE, .len = p->terminal_len}, 1);
    }
    cg_info("resume: message %s resumed after %llu of %llu bytes%s", p->id, (unsigned long long)after,
            (unsigned long long)p->seq, p->terminal ? " (it had ended)" : "");
    return 0;
}

void cg_resume_pause_all(cg_parked *listening, int paused)
{
    for (cg_parked *p = listening; p; p = p->lnext) {
        if (p->paused == !!paused)
            continue;
        p->paused = !!paused;
        if (p->state == PARKED_RUNNING)
            cg_turns_pause(p->q, p->paused);
        else if (p->state == PARKED_REMOTE && !p->paused && !p->pending)
            arm(p, 0); /* read on now */
    }
}

void cg_resume_detach_all(cg_parked **listening)
{
    while (*listening) {
        cg_parked *p = *listening;
        listener_unlink(p);
        if (p->state == PARKED_REMOTE)
            parked_free(p); /* a reader with nobody to read for */
        else
            grace_restart(p);
    }
}

int cg_resume_cancel(cg_resume *r, const char *user, const char *id)
{
    cg_parked *p = find(r, user, id, 0);
    if (p && p->state == PARKED_RUNNING)
        return cg_turns_cancel(p->q, p->id);
    cg_store *st = r->env->store;
    p = find(r, user, id, 1);
    if (!p || !p->room || !st->ops->bus)
        return -1;
    /* its holder is another gateway: the cancel goes there, its cancelled comes back here */
    st->ops->bus->cancel_remote(st, user, p->room);
    return 0;
}

void cg_resume_draining(cg_resume *r)
{
    cg_store *st = r->env->store;
    if (st && st->ops->replies)
        return;
    for (cg_parked *p = r->head; p; p = p->next)
        if (p->state == PARKED_RUNNING && !p->l.conn)
            cg_turns_cancel(p->q, p->id); /* ENDED: closed from the loop, kept no longer than the drain */
}

void cg_resume_close(cg_resume *r)
{
    while (r->head) {
        cg_parked *p = r->head;
        if (p->q) { /* its cancelled ends it as any end does: a reader elsewhere hears of it */
            cg_turns_close(p->q);
            free(p->q);
            p->q = NULL;
        }
        parked_free(p);
    }
}
