/*
 * session.c: one client WebSocket connection speaking chatgate.v1 (see session.h).
 *
 * The session is an adapter: it turns frames into turn requests (turn.c owns what happens to
 * them) and the turn's events into frames. State lives in struct cg_session, which
 * libwebsockets allocates (zeroed) per connection and frees after LWS_CALLBACK_CLOSED. Two
 * bounded buffers hang off it, besides the turns' queue:
 *   - the receive buffer of a frame that came in pieces, only until it is whole (at most
 *     --max-frame bytes; core/wsrx.h);
 *   - the frames waiting to be written (high-water mark send_buffer; deltas of one message
 *     coalesce into one pending frame, so a slow client holds text, not frames).
 * Queued frames are written at the end of the loop iteration (core/flush.h), as many as the
 * socket takes; only a full socket waits for LWS_CALLBACK_SERVER_WRITEABLE. Close frames go
 * from the writable callback. A connection on the drop-in path is a session too, whose
 * frames go to dropin.c.
 */
#include <uv.h>
#include <libwebsockets.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "chatgate/core/alloc.h"
#include "chatgate/core/buf.h"
#include "chatgate/core/error.h"
#include "chatgate/core/flush.h"
#include "chatgate/core/keepalive.h"
#include "chatgate/core/log.h"
#include "chatgate/core/net.h"
#include "chatgate/core/wsconn.h"
#include "chatgate/proto/identity.h"
#include "chatgate/proto/protocol.h"
#include "chatgate/server/dropin.h"
#include "chatgate/server/handshake.h"
#include "chatgate/server/resume.h"
#include "chatgate/server/server.h"
#include "chatgate/server/session.h"
#include "chatgate/server/turn.h"

/* Text of one pending delta frame is cut here, so no single frame grows large. */
#define CG_DELTA_CHUNK 16384

/* Built frames are written from where they were dumped: the connection's headroom. */
_Static_assert(CG_FRAME_PRE == CG_WS_PRE, "protocol.h's frames carry core/wsconn.h's headroom");

/* One frame waiting to be written (core/wsconn.h): a finished JSON frame, or a delta's
 * text still growing (lazy: made into its frame as it is written, session_finish). */
typedef struct cg_out {
    cg_wsframe f;   /* first: the connection's queue holds &f */
    char *delta_id; /* delta: the message id; NULL for a finished frame */
    char *text;     /* delta: text so far, f.len bytes */
    size_t cap;     /* text capacity */
    uint64_t seq;   /* delta: the seq of its last text (turn.h) */
} cg_out;

struct cg_session {
    struct lws *wsi;
    cg_server *srv;
    int established;
    int unauthorized; /* nothing it sends is read; closed with 1008 once the error frame is out */
    int closed_normally; /* the client's close frame said 1000: it is done, its reply with it */
    char user[CG_MAX_USER + 1];
    char session_id[24];
    unsigned long auto_id;

    cg_wsconn ws;      /* the frames to the client, and the one from it being reassembled */
    cg_keepalive_item ka; /* its pings (keepalive.h) */
    cg_turns *turns;   /* the messages of this connection (turn.h); heap: a reply may outlive it (resume.h) */
    cg_parked *listening; /* the replies of gone connections this one resumed (resume.h) */
    cg_session *next, **pprev; /* in the process's open sessions (a resume finds a reply here) */
    cg_dropin *dropin; /* drop-in mode: this connection speaks the app's protocol (dropin.h) */
};

size_t cg_session_size(void)
{
    return sizeof(struct cg_session);
}

/* ---- the send queue ------------------------------------------------------------------- */

static void session_free_frame(cg_wsframe *f)
{
    cg_out *o = (cg_out *)f;
    free(f->buf);
    free(o->delta_id);
    free(o->text);
    free(o);
}

/* A delta's frame is made as it is written, from all the text that came while it waited. */
static void session_finish(cg_wsconn *c, cg_wsframe *f)
{
    (void)c;
    cg_out *o = (cg_out *)f;
    cg_frame_text built = cg_protocol_delta(o->delta_id, o->text, f->len, o->seq);
    f->buf = built.buf;
    f->len = built.len;
}

/*
 * The queue's marks (send_buffer): full, the upstream in flight is paused; overfull (twice
 * the mark), the client's own reading is too. Deltas stop at the mark, so what grows past it
 * is answers to a client that sends without reading. Both resume under a quarter of it.
 */
static void session_flow(cg_wsconn *c, int full, int overfull)
{
    cg_session *s = c->owner;
    if (full != s->turns->paused)
        cg_turns_pause(s->turns, full);
    cg_resume_pause_all(s->listening, full); /* a reply it resumed, as its own */
    cg_wsconn_pause_rx(c, overfull);
}

static const cg_wsconn_ops session_ws_ops = {
    .flow = session_flow,
    .finish = session_finish,
};

/* Queues a finished frame; takes ownership of it. */
static void session_send(cg_session *s, cg_frame_text frame)
{
    cg_out *o = cg_calloc(1, sizeof(*o));
    o->f.buf = frame.buf;
    o->f.len = frame.len;
    o->f.destroy = session_free_frame;
    cg_wsconn_push(&s->ws, &o->f);
}

/* An error of the session's own (a bad frame, a refused client): counted, then sent. */
static void session_send_error(cg_session *s, const char *id, int err, const char *message)
{
    cg_turn_count_error(&s->srv->metrics, err);
    session_send(s, cg_protocol_error_detail(id, cg_err_code(err), message, NULL));
}

/* Appends delta text, to the pending delta of the same message when there is one. */
static void session_send_delta(void *conn, const char *id, const char *text, size_t len, uint64_t seq)
{
    cg_session *s = conn;
    cg_out *o = (cg_out *)s->ws.tail;
    if (o && !o->f.buf && strcmp(o->delta_id, id) == 0 && o->f.len + len <= CG_DELTA_CHUNK) { /* lazy: a delta */
        size_t have = o->f.len;
        cg_buf_append(&o->text, &have, &o->cap, text, len, len + 64);
        o->seq = seq;
        cg_wsconn_grew(&s->ws, len);
        return;
    }
    o = cg_calloc(1, sizeof(*o));
    o->f.destroy = session_free_frame;
    o->seq = seq;
    o->delta_id = cg_strdup(id);
    cg_buf_append(&o->text, &o->f.len, &o->cap, text, len, len + 64);
    cg_wsconn_push(&s->ws, &o->f);
}

/*
 * A close frame from the client. lws 4.1.6 answers codes under 1000, 1004-1006, 1015 and
 * 1016-2999 with 1002 itself, but echoes a 1-byte payload, a code over 4999 and a reason that
 * is not UTF-8 as they came: those are answered here (1002, or 1007), and the connection goes.
 */
static int session_peer_close(cg_session *s, const void *in, size_t len)
{
    int answer = cg_ws_close_check(in, len);
    const unsigned char *code = in;
    s->closed_normally = !answer && len >= 2 && (code[0] << 8 | code[1]) == LWS_CLOSE_STATUS_NORMAL;
    if (!answer)
        return 0;
    cg_info("session %s: the client's close frame is not valid (RFC 6455 7.4): answered with %d", s->session_id,
            answer);
    cg_wsconn_close_now(&s->ws, answer, answer == LWS_CLOSE_STATUS_PROTOCOL_ERR ? "invalid close frame"
                                                                              : "close reason not UTF-8");
    return -1;
}

/* The writable callback: at shutdown, what is queued, then a close frame (1001). */
static int session_writable(cg_session *s)
{
    if (s->srv->closing_all)
        cg_wsconn_close(&s->ws, LWS_CLOSE_STATUS_GOINGAWAY, "going away");
    return cg_wsconn_writable(&s->ws);
}

/* ---- the turn's events as frames ------------------------------------------------------ */

/*
 * An ack that finds the queue empty waits up to ack_hold_ms (5) for the reply's first frames
 * and goes out in the same send() as they do: with an app that answers within the hold, a
 * turn's frames to the client take one system call instead of two (and the client one
 * receive), a fifth of a turn's system calls through a ws:// app (tests/bench: 4.7 -> 3.9 a
 * turn, nginx makes 4). Its order is kept: it is first in the queue, before anything else
 * about its message (docs/protocol.md). Any other frame queued meanwhile takes it along at
 * once; an upstream slower than the hold (an LLM's first token) gets the ack out on its own,
 * ack_hold_ms later than it would have been.
 */
static void sink_ack(void *conn, const cg_ack *ack)
{
    cg_session *s = conn;
    session_send(s, cg_protocol_ack(ack));
    if (s->srv->cfg->ack_hold_ms > 0)
        cg_wsconn_wait(&s->ws, (unsigned)s->srv->cfg->ack_hold_ms); /* when alone in the queue */
}

/* A turn's last frame: the client's queue goes when the event that ended the turn does
 * (core/flush.h), the ack and deltas with it; not before the store's commands of the same
 * iteration (the turn's save: a client that has the done may look). */
static void session_send_last(cg_session *s, cg_frame_text frame)
{
    session_send(s, frame);
    cg_wsconn_soon(&s->ws, 1);
}

static void sink_done(void *conn, const char *id, const char *reply, size_t len, json_t *usage, int truncated,
                      const cg_answer *who)
{
    session_send_last(conn, cg_protocol_done(id, reply, len, usage, truncated, who));
}

static void sink_cancelled(void *conn, const char *id)
{
    session_send_last(conn, cg_protocol_cancelled(id));
}

/* Counted by the turn already. */
static void sink_error(void *conn, const char *id, int err, const char *message, json_t *detail)
{
    session_send_last(conn, cg_protocol_error_detail(id, cg_err_code(err), message, detail));
}

static void sink_warning(void *conn, const char *id, const char *code, const char *message)
{
    session_send(conn, cg_protocol_warning(id, code, message));
}

static void sink_context(void *conn, const char *room, json_t *state)
{
    session_send(conn, cg_protocol_context(room, state));
}

static void sink_profile(void *conn, json_t *profile)
{
    session_send(conn, cg_protocol_profile(profile));
}

static const cg_turn_sink session_sink = {
    .ack = sink_ack,
    .delta = session_send_delta,
    .done = sink_done,
    .cancelled = sink_cancelled,
    .error = sink_error,
    .warning = sink_warning,
    .context = sink_context,
    .profile = sink_profile,
};

/* ---- frames from the client ------------------------------------------------------------ */

static char *dup_or_die(const char *s)
{
    char *d = cg_strdup(s);
    return d;
}

/* A parked reply's frames (resume.h) go out as this connection's own. */
static void listen_frame(void *conn, cg_frame_text frame, int last)
{
    if (last)
        session_send_last(conn, frame);
    else
        session_send(conn, frame);
}

/* The open sessions of this process: a resume may come before the gateway has seen its old
 * connection go (a phone that changed network: the old one looks open until its pings fail). */
static cg_session *open_sessions;

static void session_turns_new(cg_session *s)
{
    s->turns = cg_calloc(1, sizeof(*s->turns));
    cg_turns_init(s->turns, &s->srv->turn, &session_sink, NULL, s, s->user, s->session_id);
}

/*
 * Another open connection of this user has the reply of message id in flight: the reply is
 * parked as if that connection had gone, and it is closed (4000: the reply goes on
 * elsewhere), so that the resume finds it. 0 when one was taken over.
 */
static int session_take_over(cg_session *s, const char *id)
{
    for (cg_session *o = open_sessions; o; o = o->next) {
        const char *tid, *room, *text;
        size_t len;
        uint64_t seq;
        if (o == s || o->dropin || strcmp(o->user, s->user) != 0 ||
            cg_turns_reply(o->turns, &tid, &room, &text, &len, &seq) < 0 || strcmp(tid, id) != 0)
            continue;
        if (cg_resume_park(&s->srv->resume, o->turns, o->user) < 0)
            return -1;
        cg_info("session %s: message %s resumed on session %s: this connection is closed", o->session_id, id,
                s->session_id);
        session_turns_new(o); /* what it still gets until it closes is nobody's */
        cg_wsconn_close(&o->ws, 4000, "the reply was resumed on another connection");
        return 0;
    }
    return -1;
}

/* {"type":"resume"}: the reply of a connection of this user that went away mid-reply, here
 * (parked, or on a connection not yet seen gone) or at another gateway of the same store. */
static void session_resume(cg_session *s, const char *id, uint64_t after)
{
    cg_resume *r = &s->srv->resume;
    cg_resume_listener l = {.delta = session_send_delta, .frame = listen_frame, .conn = s, .listening = &s->listening};
    int rc = cg_resume_attach(r, s->user, id, after, &l);
    if (rc < 0 && r->grace_ms && session_take_over(s, id) == 0) /* not parked: maybe still "open" here */
        rc = cg_resume_attach(r, s->user, id, after, &l);
    if (rc < 0)
        rc = cg_resume_attach_remote(r, s->user, id, after, &l);
    if (rc < 0)
        session_send_error(s, id, CG_E_NOT_FOUND, "no reply of this id to resume: it was never here, or it ended "
                                                  "or was cancelled more than resume.grace_ms ago");
    cg_resume_pause_all(s->listening, s->ws.full); /* as this connection's own replies are */
}

/* A message or context command becomes a turn request. */
static void session_on_request(cg_session *s, cg_client_frame *f)
{
    int chat = f->type == CG_FRAME_MESSAGE;
    if (chat && !f->id[0])
        snprintf(f->id, sizeof(f->id), "g%lu", ++s->auto_id);
    cg_turn_request r = {
        .kind = chat ? CG_TURN_CHAT
                : f->type == CG_FRAME_CONTEXT_GET ? CG_TURN_CONTEXT_GET
                : f->type == CG_FRAME_CONTEXT_FORGET ? CG_TURN_CONTEXT_FORGET
                : f->type == CG_FRAME_PROFILE_GET    ? CG_TURN_PROFILE_GET
                : f->type == CG_FRAME_PROFILE_FORGET ? CG_TURN_PROFILE_FORGET : CG_TURN_CONTEXT_CLEAR,
        .id = dup_or_die(f->id),
        .room = dup_or_die(f->room),
        .text = f->text,
        .keys = f->keys,
        .unique_id = 1, /* a message's id names it for cancel */
    };
    f->text = NULL;
    f->keys = NULL;
    cg_turns_submit(s->turns, &r);
}

static void session_on_frame(cg_session *s, const char *buf, size_t len)
{
    cg_client_frame f;
    char err[256];
    if (cg_protocol_parse(buf, len, &f, err, sizeof(err)) < 0) {
        cg_debug("session %s: bad frame: %s", s->session_id, err);
        session_send_error(s, f.id, CG_E_BAD_FRAME, err);
        cg_client_frame_clear(&f);
        return;
    }
    if (f.type == CG_FRAME_RESUME) {
        /* charged to the rate limit as a message is: each costs Redis reads, and a reader of
         * another gateway's reply takes one of max_parked's slots */
        if (cg_turns_rate(s->turns, f.id) == 0)
            session_resume(s, f.id, f.after);
    } else if (f.type != CG_FRAME_CANCEL) {
        session_on_request(s, &f);
    } else if (cg_turns_cancel(s->turns, f.id) < 0 && cg_resume_cancel(&s->srv->resume, s->user, f.id) < 0) {
        session_send_error(s, f.id, CG_E_NOT_FOUND, "no message with this id is waiting or in flight");
    }
    cg_client_frame_clear(&f);
}

/* Reassembles one frame from its fragments, within --max-frame (core/wsrx.h). */
static void session_on_receive(cg_session *s, const char *in, size_t len)
{
    struct lws *wsi = s->wsi;
    size_t max = (size_t)s->srv->cfg->max_frame;
    const char *msg;
    size_t msg_len;
    /* a connection this gateway is closing (unauthorized, taken over by a resume elsewhere,
     * going away) starts nothing more: a taken-over one's turns are new and had no limits */
    if (s->unauthorized || cg_wsconn_closing(&s->ws) ||
        !cg_wsconn_receive(&s->ws, lws_is_first_fragment(wsi), lws_is_final_fragment(wsi), in, len, max, &msg,
                           &msg_len))
        return;
    if (s->dropin) { /* the app's protocol: frames of any kind go to drop-in */
        if (!msg) {
            cg_warn("session %s: a drop-in frame over the %zu-byte limit: closing with 1009", s->session_id, max);
            cg_dropin_client_refuse(s->dropin, 1009, "frame over the gateway's max_frame");
        } else
            cg_dropin_client_frame(s->dropin, msg, msg_len, lws_frame_is_binary(wsi));
    } else {
        s->srv->metrics.frames_in++;
        char err[128];
        if (lws_frame_is_binary(wsi)) {
            session_send_error(s, NULL, CG_E_BAD_FRAME, "binary frames are not accepted: send JSON text frames");
        } else if (!msg) {
            snprintf(err, sizeof(err), "the frame is over the %zu-byte limit", max);
            session_send_error(s, NULL, CG_E_TOO_LARGE, err);
        } else {
            session_on_frame(s, msg, msg_len);
        }
    }
    cg_wsconn_received(&s->ws);
}

/* ---- the connection ------------------------------------------------------------------- */

static int64_t session_now(cg_session *s)
{
    return s->srv->turn.store->now(s->srv->turn.store->clock_ctx);
}

static void dropin_open(cg_session *s, struct lws *wsi);

static void session_open(cg_session *s, struct lws *wsi)
{
    cg_server *srv = cg_server_of(wsi);
    s->wsi = wsi;
    s->srv = srv;
    s->established = 1;
    cg_wsconn_init(&s->ws, CG_WS_SERVER, &srv->net, &session_ws_ops, s);
    s->ws.batch = &srv->batch;
    s->ws.frames_out = &srv->metrics.frames_out;
    s->ws.high = (size_t)srv->cfg->send_buffer;
    cg_wsconn_open(&s->ws, wsi);
    cg_keepalive_add(srv->net.keepalive, &s->ka, wsi);
    snprintf(s->session_id, sizeof(s->session_id), "s_%lu", ++srv->session_seq);
    session_turns_new(s);
    s->next = open_sessions;
    if (s->next)
        s->next->pprev = &s->next;
    s->pprev = &open_sessions;
    open_sessions = s;
    srv->n_sessions++;
    char err[256];
    if (cg_handshake_is_dropin(srv, wsi)) {
        dropin_open(s, wsi);
        return;
    }
    char plan[CG_MAX_PLAN_NAME + 1];
    if (cg_handshake_identify(srv, wsi, session_now(s), s->user, sizeof(s->user), plan, err, sizeof(err)) < 0) {
        cg_warn("session %s: refused: %s", s->session_id, err);
        s->unauthorized = 1;
        s->user[0] = 0;
        srv->metrics.unauthorized++;
        session_send_error(s, NULL, CG_E_UNAUTHORIZED, err);
        cg_wsconn_close(&s->ws, LWS_CLOSE_STATUS_POLICY_VIOLATION, "unauthorized"); /* after the error */
        return;
    }
    cg_info("session %s: open (%ld connected)", s->session_id, srv->n_sessions);
    cg_turns_set_plan(s->turns, plan);
    char *resume = srv->cfg->auth_kind == CG_AUTH_NONE
                       ? cg_identity_resume_token(srv->resume_secret, srv->resume_secret_len, s->user)
                       : NULL;
    session_send(s, cg_protocol_hello(s->user, s->session_id, resume));
    free(resume);
}

/* The client is gone: stop the request in flight upstream and release everything. */
static void session_close(cg_session *s)
{
    if (!s->established)
        return;
    cg_server *srv = s->srv;
    cg_keepalive_remove(srv->net.keepalive, &s->ka);
    if (s->dropin) {
        cg_dropin_close(s->dropin);
        s->dropin = NULL;
    }
    cg_resume_detach_all(&s->listening);
    *s->pprev = s->next;
    if (s->next)
        s->next->pprev = s->pprev;
    /* a reply in flight goes on for a resume (resume.h), or stops as the turns close: a client
     * that said it is done (1000) is; a lost connection, or one going away (1001: a tab put
     * to sleep, a page left), may come back. (A drop-in session's turns are dropin.c's: these
     * hold none, and nothing is parked.) */
    if (!s->user[0] || s->closed_normally || cg_resume_park(&srv->resume, s->turns, s->user) < 0) {
        cg_turns_close(s->turns);
        free(s->turns);
    }
    s->turns = NULL;
    cg_wsconn_clear(&s->ws);
    s->established = 0;
    srv->n_sessions--;
    cg_info("session %s: closed (%ld connected)", s->session_id, srv->n_sessions);
}

/*
 * A client of the app on the drop-in path: the user comes from --auth as usual, or with
 * auth none from the app's session cookie (dropin.user_cookie), so the same session finds
 * the same dialogs; no hello, no chatgate.v1: the app's protocol goes on.
 */
static void dropin_open(cg_session *s, struct lws *wsi)
{
    cg_server *srv = s->srv;
    char err[256], plan[CG_MAX_PLAN_NAME + 1] = "";
    /* held for the app's handshake (listener.h): the app connection is open already */
    if ((s->dropin = cg_dropin_take_held(wsi, s->user, sizeof(s->user), s->session_id))) {
        cg_info("session %s: drop-in (%ld connected)", s->session_id, srv->n_sessions);
        return;
    }
    if (cg_dropin_identify(srv, wsi, s->user, sizeof(s->user), plan, err, sizeof(err)) < 0) {
        /* as for chatgate.v1, but with no error frame (the app's protocol has none of ours):
         * marked unauthorized (nothing it sends is read), then closed with 1008 from the
         * next writable */
        cg_warn("session %s: drop-in client refused: %s", s->session_id, err);
        s->unauthorized = 1;
        s->user[0] = 0;
        srv->metrics.unauthorized++;
        cg_wsconn_close(&s->ws, LWS_CLOSE_STATUS_POLICY_VIOLATION, "unauthorized");
        return;
    }
    s->dropin = cg_dropin_open(srv, wsi, s->user, plan, s->session_id);
    if (!s->dropin)
        lws_set_timeout(wsi, PENDING_TIMEOUT_CLOSE_SEND, LWS_TO_KILL_ASYNC);
    else
        cg_info("session %s: drop-in (%ld connected)", s->session_id, srv->n_sessions);
}

int cg_session_callback(struct lws *wsi, enum lws_callback_reasons reason, void *user, void *in, size_t len)
{
    cg_session *s = user;
    switch (reason) {
    case LWS_CALLBACK_HTTP_CONFIRM_UPGRADE:
        if (cg_dropin_confirm_held(wsi)) /* the app refused its own handshake: so is this one */
            return 1;
        return cg_handshake_confirm_upgrade(wsi);
    case LWS_CALLBACK_ADD_HEADERS: /* the 101 of a held drop-in client: the app's cookies */
        return cg_dropin_add_headers(wsi, in);
    case LWS_CALLBACK_ESTABLISHED:
        session_open(s, wsi);
        return 0;
    case LWS_CALLBACK_RECEIVE_PONG:
        cg_keepalive_seen(s->srv->net.keepalive, &s->ka);
        return 0;
    case LWS_CALLBACK_RECEIVE: {
        cg_flusher *f = s->srv->net.flush;
        cg_keepalive_seen(s->srv->net.keepalive, &s->ka);
        session_on_receive(s, in, len);
        cg_flush_event_end(f, wsi); /* the message goes to its app now (core/flush.h) */
        return 0;
    }
    case LWS_CALLBACK_SERVER_WRITEABLE: {
        /* a ping that is due goes first, but never after a close frame */
        int closing = s->dropin ? cg_dropin_client_closing(s->dropin) : cg_wsconn_closing(&s->ws);
        if (!closing && cg_keepalive_writable(s->srv->net.keepalive, &s->ka) < 0)
            return -1;
        return s->dropin ? cg_dropin_client_writable(s->dropin) : session_writable(s);
    }
    case LWS_CALLBACK_WS_PEER_INITIATED_CLOSE:
        return session_peer_close(s, in, len);
    case LWS_CALLBACK_CLOSED:
        session_close(s);
        return 0;
    case LWS_CALLBACK_WSI_DESTROY: {
        /* lws 4.1 tells protocols[0] (this one) of every wsi's end: pass it on to the
         * protocol the wsi had (an upstream client's), whose callback lets go of it */
        const struct lws_protocols *p = lws_get_protocol(wsi);
        if (p && p->callback && p->callback != cg_session_callback)
            return p->callback(wsi, reason, user, in, len);
        return 0;
    }
    default:
        return lws_callback_http_dummy(wsi, reason, user, in, len);
    }
}
