/*
 * resume.c: replies that outlive their client's connection (see resume.h).
 *
 * A parked reply is in one of three states: its turn runs (RUNNING: the connection's
 * cg_turns report here), its turn has ended and its cg_turns waits to be closed from the
 * loop (ENDED: never closed inside the turn's own callback), or only the record is kept
 * (KEPT: the text and the terminal frame, for a resume that comes late). One timer per
 * parked reply serves all three: the grace while nobody listens, and the close after the end.
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

typedef enum { PARKED_RUNNING, PARKED_ENDED, PARKED_KEPT } parked_state;

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
    uv_timer_t *timer; /* malloc'd: it closes after the record is freed */
    cg_resume_listener l; /* l.conn NULL: nobody listens */
    cg_parked *lnext, **lpprev; /* in the listener's list */
};

/* ---- the record ------------------------------------------------------------------------- */

static void timer_closed(uv_handle_t *h)
{
    free(h);
}

static void listener_unlink(cg_parked *p)
{
    if (p->lpprev) {
        *p->lpprev = p->lnext;
        if (p->lnext)
            p->lnext->lpprev = p->lpprev;
    }
    p->lnext = NULL;
    p->lpprev = NULL;
    p->l = (cg_resume_listener){0};
}

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
    free(p->user);
    free(p->id);
    free(p->name);
    free(p->text);
    free(p->terminal);
    free(p);
}

/* The text kept, up to max_reply_bytes cut on a character boundary, as the turn keeps it. */
static void keep_text(cg_parked *p, const char *text, size_t len)
{
    size_t max = (size_t)p->r->env->cfg->max_reply_bytes;
    if (p->len + len > max)
        len = cg_utf8_boundary(text, max > p->len ? max - p->len : 0);
    cg_buf_append(&p->text, &p->len, &p->cap, text, len, 256);
}

static void on_timer(uv_timer_t *t);

static void arm(cg_parked *p, uint64_t ms)
{
    uv_timer_start(p->timer, on_timer, ms, 0);
}

/* The grace starts afresh: nobody listens from now. */
static void grace_restart(cg_parked *p)
{
    p->deadline = uv_now(p->timer->loop) + p->r->grace_ms;
    if (p->state != PARKED_ENDED) /* ENDED: its close comes first, and arms what is left */
        arm(p, p->r->grace_ms);
}

/* The turn has ended: its frame is kept; the turns close from the loop. */
static void ended(cg_parked *p, cg_frame_text frame)
{
    if (p->state != PARKED_RUNNING) {
        free(frame.buf);
        return;
    }
    p->state = PARKED_ENDED;
    free(p->terminal);
    p->terminal = cg_malloc(frame.len + 1);
    memcpy(p->terminal, frame.json, frame.len + 1);
    p->terminal_len = frame.len;
    if (p->l.conn)
        p->l.frame(p->l.conn, frame, 1);
    else
        free(frame.buf);
    arm(p, 0);
}

static void on_timer(uv_timer_t *t)
{
    cg_parked *p = t->data;
    uint64_t now = uv_now(t->loop);
    switch (p->state) {
    case PARKED_RUNNING: /* the grace passed */
        if (p->l.conn)
            return; /* someone listens: it goes on */
        cg_info("resume: message %s of a gone client: nobody resumed it within %llu ms (resume.grace_ms): cancelled",
                p->id, (unsigned long long)p->r->grace_ms);
        cg_turns_cancel(p->q, p->id); /* its cancelled comes back here: ENDED */
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

static cg_parked *find(cg_resume *r, const char *user, const char *id)
{
    for (cg_parked *p = r->head; p; p = p->next)
        if (strcmp(p->id, id) == 0 && strcmp(p->user, user) == 0)
            return p;
    return NULL;
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
    cg_info("resume: %s: the client left mid-reply: message %s goes on, kept %llu ms for a resume", name, p->id,
            (unsigned long long)r->grace_ms);
    return 0;
}

int cg_resume_attach(cg_resume *r, const char *user, const char *id, uint64_t after, const cg_resume_listener *l)
{
    cg_parked *p = find(r, user, id);
    if (!p)
        return -1;
    listener_unlink(p); /* a listener before (another tab): this one takes over */
    p->l = *l;
    p->lnext = *l->listening;
    if (p->lnext)
        p->lnext->lpprev = &p->lnext;
    p->lpprev = l->listening;
    *l->listening = p;
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

void cg_resume_detach_all(cg_parked **listening)
{
    while (*listening) {
        cg_parked *p = *listening;
        listener_unlink(p);
        grace_restart(p);
    }
}

int cg_resume_cancel(cg_resume *r, const char *user, const char *id)
{
    cg_parked *p = find(r, user, id);
    if (!p || p->state != PARKED_RUNNING)
        return -1;
    return cg_turns_cancel(p->q, p->id);
}

void cg_resume_close(cg_resume *r)
{
    while (r->head) {
        cg_parked *p = r->head;
        if (p->q) {
            p->state = PARKED_KEPT; /* what the turn says as it stops goes nowhere */
            cg_turns_close(p->q);
            free(p->q);
            p->q = NULL;
        }
        parked_free(p);
    }
}
