/*
 * session.c: one client WebSocket connection speaking chatgate.v1 (see session.h).
 *
 * State lives in struct cg_session, which libwebsockets allocates (zeroed) per connection
 * and frees after LWS_CALLBACK_CLOSED. Three bounded queues hang off it:
 *   - the receive buffer of the frame being reassembled (at most --max-frame bytes);
 *   - the messages waiting for the reply in flight (at most queue_limit);
 *   - the frames waiting to be written (high-water mark send_buffer; deltas of one message
 *     coalesce into one pending frame, so a slow client holds text, not frames).
 * Frames are written only from LWS_CALLBACK_SERVER_WRITEABLE, one lws_write each.
 */
#include <uv.h>
#include <libwebsockets.h>

#include <openssl/rand.h>
#include <ctype.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "chatgate/core/rate.h"
#include "chatgate/core/utf8.h"
#include "chatgate/store/lock.h"
#include "chatgate/dialog/dialog.h"
#include "chatgate/server/dropin.h"
#include "chatgate/core/error.h"
#include "chatgate/server/gateway.h"
#include "chatgate/proto/identity.h"
#include "chatgate/core/log.h"
#include "chatgate/dialog/pipeline.h"
#include "chatgate/proto/protocol.h"
#include "chatgate/server/session.h"

/* Text of one pending delta frame is cut here, so no single frame grows large. */
#define CG_DELTA_CHUNK 16384

typedef struct cg_msg cg_msg;

/* One frame waiting to be written: a finished JSON frame, or delta text still growing. */
typedef struct cg_out {
    struct cg_out *next;
    char *json;      /* finished frame, or NULL for a delta */
    char *delta_id;  /* delta: the message id */
    char *text;      /* delta: text so far */
    size_t len, cap; /* json or text length; text capacity */
} cg_out;

/*
 * One client request, from arrival to its terminal frame: a chat message, or a context
 * command (which waits its turn too, so it sees the state the message before it left).
 * A turn is: load the dialog -> pipeline -> ack -> upstream -> reply -> save.
 */
typedef enum { MSG_CHAT, MSG_CONTEXT_GET, MSG_CONTEXT_FORGET, MSG_CONTEXT_CLEAR } msg_kind;

struct cg_msg {
    cg_msg *next;
    cg_session *s;
    msg_kind kind;
    char id[CG_MAX_ID + 1];
    char room[CG_MAX_ROOM + 1];
    char *text;
    json_t *keys;         /* context.forget */
    cg_ruleset *rules;    /* the rule set this message started with (a reference) */
    cg_dialog_lock_waiter lock; /* its dialog's lock, held from load to save (admission.h) */
    int64_t arrived;      /* unix seconds */
    uint64_t t_arrived, t_load, t_upstream; /* uv_hrtime() of arrival, load start, upstream start */
    int got_first;        /* the first delta came (first-token latency) */
    int counted;          /* in gw->inflight_turns (shutdown waits for it) */
    char *enriched;       /* the pipeline's rewrite, kept for the history */
    cg_store_req *load;   /* while the dialog loads */
    cg_dialog dialog;     /* once loaded */
    int has_dialog;
    int route;
    cg_upstream_call *call; /* while in flight */
    char *reply;            /* the whole reply, up to max_reply_bytes */
    size_t reply_len, reply_cap;
    int truncated;
};

struct cg_session {
    struct lws *wsi;
    cg_gateway *gw;
    int established;
    int unauthorized; /* close with 1008 once the error frame is out */
    int close_sent;   /* a close frame went out: the connection goes at the next writable */
    char user[CG_MAX_USER + 1];
    char session_id[24];
    unsigned long auto_id;

    char *rx; /* the frame being reassembled */
    size_t rx_len;
    int rx_too_large;

    cg_out *out_head, *out_tail;
    size_t out_bytes;
    int upstream_paused;
    int client_paused;

    cg_msg *inflight;
    cg_msg *queue_head, *queue_tail;
    long queued;

    cg_rate rate; /* rate_limit: a token bucket (admission.h) */

    void *up_conns[CG_MAX_UPSTREAMS]; /* per-client upstream connections (ws kind) */
    cg_dropin *dropin; /* drop-in mode: this connection speaks the app's protocol (dropin.h) */
};

size_t cg_session_size(void)
{
    return sizeof(struct cg_session);
}

/* ---- the send queue ------------------------------------------------------------------- */

static void out_free(cg_out *o)
{
    free(o->json);
    free(o->delta_id);
    free(o->text);
    free(o);
}

/*
 * Pauses the upstream in flight while the send queue is over its high-water mark and
 * resumes it under a quarter of it. The client's own reading is paused only at twice the
 * mark: deltas stop at the mark, so what grows past it is answers to a client that sends
 * without reading.
 */
static void session_flow(cg_session *s)
{
    size_t high = (size_t)s->gw->cfg->send_buffer;
    int want_upstream_paused = s->upstream_paused ? s->out_bytes > high / 4 : s->out_bytes > high;
    int want_client_paused = s->client_paused ? s->out_bytes > high / 4 : s->out_bytes > 2 * high;
    if (want_upstream_paused != s->upstream_paused) {
        s->upstream_paused = want_upstream_paused;
        if (s->inflight && s->inflight->call) {
            const cg_upstream *up = &s->gw->upstreams[s->inflight->route];
            up->ops->pause(s->inflight->call, want_upstream_paused);
        }
    }
    if (want_client_paused != s->client_paused) {
        s->client_paused = want_client_paused;
        lws_rx_flow_control(s->wsi, !want_client_paused);
    }
}

static void out_push(cg_session *s, cg_out *o)
{
    if (s->out_tail)
        s->out_tail->next = o;
    else
        s->out_head = o;
    s->out_tail = o;
    lws_callback_on_writable(s->wsi);
    session_flow(s);
}

/* Queues a finished frame; takes ownership of json. */
static void session_send(cg_session *s, char *json)
{
    cg_out *o = calloc(1, sizeof(*o));
    if (!o)
        abort();
    o->json = json;
    o->len = strlen(json);
    s->out_bytes += o->len;
    out_push(s, o);
}

/* An error frame; detail (borrowed, may be NULL) adds what an upstream said. */
static void session_send_error_detail(cg_session *s, const char *id, int err, const char *message, json_t *detail)
{
    int slot = err - CG__ERR_FIRST - 1;
    if (slot >= 0 && slot < 16)
        s->gw->metrics.errors[slot]++;
    if (err == CG_E_BAD_FRAME || err == CG_E_TOO_LARGE)
        s->gw->metrics.bad_frames++;
    else if (err == CG_E_RATE_LIMITED)
        s->gw->metrics.rate_limited++;
    session_send(s, cg_protocol_error_detail(id, cg_err_code(err), message, detail));
}

static void session_send_error(cg_session *s, const char *id, int err, const char *message)
{
    session_send_error_detail(s, id, err, message, NULL);
}

/* Appends delta text, to the pending delta of the same message when there is one. */
static void session_send_delta(cg_session *s, const char *id, const char *text, size_t len)
{
    cg_out *o = s->out_tail;
    if (!o || o->json || strcmp(o->delta_id, id) != 0 || o->len + len > CG_DELTA_CHUNK) {
        o = calloc(1, sizeof(*o));
        if (!o || !(o->delta_id = strdup(id)))
            abort();
        o->cap = len + 64;
        o->text = malloc(o->cap);
        if (!o->text)
            abort();
        s->out_bytes += len;
        memcpy(o->text, text, len);
        o->len = len;
        out_push(s, o);
        return;
    }
    if (o->len + len > o->cap) {
        size_t ncap = o->cap * 2 > o->len + len ? o->cap * 2 : o->len + len;
        char *nt = realloc(o->text, ncap);
        if (!nt)
            abort();
        o->text = nt;
        o->cap = ncap;
    }
    memcpy(o->text + o->len, text, len);
    o->len += len;
    s->out_bytes += len;
    session_flow(s);
}

/*
 * Writes a close frame with code and reason, then closes at the next writable. (4 is
 * LWS_WRITE_CLOSE, which lws 4.1's public header leaves out; lws_close_reason() followed by
 * -1 did not send the frame: the peer saw 1006.)
 */
static int session_write_close(cg_session *s, int code, const char *reason)
{
    if (s->close_sent)
        return -1;
    unsigned char close[LWS_PRE + 2 + 123];
    size_t rl = strlen(reason) > 123 ? 123 : strlen(reason);
    close[LWS_PRE] = (unsigned char)(code >> 8);
    close[LWS_PRE + 1] = (unsigned char)(code & 0xff);
    memcpy(close + LWS_PRE + 2, reason, rl);
    lws_write(s->wsi, close + LWS_PRE, 2 + rl, (enum lws_write_protocol)4);
    s->close_sent = 1;
    lws_callback_on_writable(s->wsi);
    return 0;
}

int cg_ws_close_payload_check(const void *payload, size_t len)
{
    const unsigned char *p = payload;
    if (len == 0)
        return 0;
    if (len == 1)
        return LWS_CLOSE_STATUS_PROTOCOL_ERR;
    int code = p[0] << 8 | p[1];
    if (code < 1000 || code > 4999 || code == 1004 || code == 1005 || code == 1006 || code == 1015 ||
        (code >= 1016 && code <= 2999))
        return LWS_CLOSE_STATUS_PROTOCOL_ERR;
    json_t *reason = json_stringn((const char *)p + 2, len - 2); /* NULL when not UTF-8 */
    if (!reason)
        return LWS_CLOSE_STATUS_INVALID_PAYLOAD;
    json_decref(reason);
    return 0;
}

/*
 * A close frame from the client. lws 4.1.6 answers codes under 1000, 1004-1006, 1015 and
 * 1016-2999 with 1002 itself, but echoes a 1-byte payload, a code over 4999 and a reason that
 * is not UTF-8 as they came: those are answered here (1002, or 1007), and the connection goes.
 */
static int session_peer_close(cg_session *s, const void *in, size_t len)
{
    int answer = cg_ws_close_payload_check(in, len);
    if (!answer)
        return 0;
    cg_info("session %s: the client's close frame is not valid (RFC 6455 7.4): answered with %d", s->session_id,
            answer);
    s->close_sent = 0; /* this answer is the close frame that counts */
    session_write_close(s, answer, answer == LWS_CLOSE_STATUS_PROTOCOL_ERR ? "invalid close frame"
                                                                           : "close reason not UTF-8");
    return -1;
}

/* Writes the frame at the head of the send queue. Returns -1 to close the connection. */
static int session_write_one(cg_session *s)
{
    cg_out *o = s->out_head;
    if (s->gw->closing_all && !o) /* shutdown: what was queued is out; a close frame, then the end */
        return session_write_close(s, LWS_CLOSE_STATUS_GOINGAWAY, "going away");
    if (!o && s->unauthorized) /* the error frame is out: now the close frame */
        return session_write_close(s, LWS_CLOSE_STATUS_POLICY_VIOLATION, "unauthorized");
    if (!o)
        return 0;
    s->out_head = o->next;
    if (!s->out_head)
        s->out_tail = NULL;
    s->out_bytes -= o->len;

    char *json = o->json ? o->json : cg_protocol_delta(o->delta_id, o->text, o->len);
    if (o->json)
        o->json = NULL;
    size_t len = strlen(json);
    unsigned char *buf = malloc(LWS_PRE + len);
    if (!buf)
        abort();
    memcpy(buf + LWS_PRE, json, len);
    free(json);
    out_free(o);
    int n = lws_write(s->wsi, buf + LWS_PRE, len, LWS_WRITE_TEXT);
    free(buf);
    s->gw->metrics.frames_out++;
    if (n < (int)len)
        return -1;
    if (s->out_head || s->unauthorized || s->gw->closing_all) /* a close goes in a writable of its own */
        lws_callback_on_writable(s->wsi);
    session_flow(s);
    return 0;
}

/* ---- turns --------------------------------------------------------------------------- */

static void msg_free(cg_msg *m)
{
    if (m->counted)
        m->s->gw->inflight_turns--;
    cg_dialog_lock_release(m->s->gw->dialog_locks, &m->lock);
    cg_ruleset_unref(m->rules);
    free(m->enriched);
    if (m->has_dialog)
        cg_dialog_free(&m->dialog);
    json_decref(m->keys);
    free(m->text);
    free(m->reply);
    free(m);
}

static int64_t session_now(cg_session *s)
{
    return s->gw->store->now(s->gw->store->clock_ctx);
}

static void session_pump(cg_session *s);
static int msg_load(cg_msg *m);

/* The request in flight ended (its terminal frame is queued): start the next one. */
static void msg_finish(cg_msg *m)
{
    cg_session *s = m->s;
    if (s->inflight == m)
        s->inflight = NULL;
    if (m->kind == MSG_CHAT)
        cg_histogram_observe(&s->gw->metrics.turn, (double)(uv_hrtime() - m->t_arrived) / 1e9);
    msg_free(m);
    session_pump(s);
}

typedef enum { TURN_DONE, TURN_ERROR, TURN_CANCELLED, TURN_ABSORBED } turn_end;

/*
 * Records the turn in the dialog and saves it: the user's message always joins the history;
 * the reply joins it when done, and when cancelled (what the user saw of it, marked
 * "cancelled"); an error leaves no assistant turn. The save needs no answer: the store
 * orders it before any later load of the same dialog.
 */
static void turn_save(cg_msg *m, turn_end end)
{
    cg_session *s = m->s;
    const cg_lifetimes *lt = &s->gw->cfg->lifetimes;
    int64_t now = session_now(s);
    cg_dialog *d = &m->dialog;
    json_t *user_extra = m->enriched ? json_pack("{s:s}", "enriched", m->enriched) : NULL;
    cg_dialog_push_history(d, "user", m->text, m->arrived, lt, user_extra);
    json_decref(user_extra);
    if (end == TURN_DONE || (end == TURN_CANCELLED && m->reply_len > 0)) {
        json_t *extra = end == TURN_CANCELLED ? json_pack("{s:b}", "cancelled", 1) : NULL;
        cg_dialog_push_history(d, "assistant", m->reply ? m->reply : "", now, lt, extra);
        json_decref(extra);
    }
    if (end == TURN_DONE || end == TURN_ABSORBED)
        d->turn_count++;
    unsigned long *count = end == TURN_DONE || end == TURN_ABSORBED ? &s->gw->metrics.turns_done
                           : end == TURN_ERROR ? &s->gw->metrics.turns_error : &s->gw->metrics.turns_cancelled;
    (*count)++;
    d->last_activity = now;
    s->gw->store->ops->save(s->gw->store, s->user, m->room, d, NULL, NULL);
}

/* Keeps the reply for the done frame, up to max_reply_bytes cut on a UTF-8 boundary. */
static void msg_keep_reply(cg_msg *m, const char *text, size_t len)
{
    size_t max = (size_t)m->s->gw->cfg->max_reply_bytes;
    if (m->truncated)
        return;
    if (m->reply_len + len > max) {
        len = cg_utf8_boundary(text, max - m->reply_len);
        m->truncated = 1;
    }
    if (m->reply_len + len + 1 > m->reply_cap) {
        size_t ncap = m->reply_cap ? m->reply_cap : 256;
        while (ncap < m->reply_len + len + 1)
            ncap *= 2;
        char *nr = realloc(m->reply, ncap);
        if (!nr)
            abort();
        m->reply = nr;
        m->reply_cap = ncap;
    }
    memcpy(m->reply + m->reply_len, text, len);
    m->reply_len += len;
    m->reply[m->reply_len] = 0;
}

static void on_upstream_delta(void *ctx, const char *text, size_t len)
{
    cg_msg *m = ctx;
    if (len == 0)
        return;
    if (!m->got_first) {
        m->got_first = 1;
        cg_histogram_observe(&m->s->gw->metrics.first_token, (double)(uv_hrtime() - m->t_upstream) / 1e9);
    }
    msg_keep_reply(m, text, len);
    session_send_delta(m->s, m->id, text, len);
}

static void on_upstream_done(void *ctx, json_t *usage, json_t *state)
{
    cg_msg *m = ctx;
    cg_session *s = m->s;
    m->call = NULL;
    if (state) {
        char err[256];
        int rc = cg_dialog_apply_directive(&m->dialog, state, s->gw->upstreams[m->route].cfg->name, session_now(s),
                                           &s->gw->cfg->lifetimes, err, sizeof(err));
        if (rc < 0) {
            /* the reply itself is fine: a warning, then its done */
            cg_warn("session %s: message %s: state from upstream '%s' refused: %s", s->session_id, m->id,
                    s->gw->upstreams[m->route].cfg->name, err);
            session_send(s, cg_protocol_warning(m->id, cg_err_code(rc), err));
        }
    }
    session_send(s, cg_protocol_done(m->id, m->reply ? m->reply : "", m->reply_len, usage, m->truncated));
    turn_save(m, TURN_DONE);
    msg_finish(m);
}

static void on_upstream_error(void *ctx, int err, const char *message, json_t *detail)
{
    cg_msg *m = ctx;
    m->call = NULL;
    m->s->gw->metrics.upstream_errors[m->route]++;
    cg_info("session %s: message %s: %s: %s", m->s->session_id, m->id, cg_err_code(err), message);
    session_send_error_detail(m->s, m->id, err, message, detail);
    turn_save(m, TURN_ERROR);
    msg_finish(m);
}

static const cg_upstream_events upstream_events = {
    .on_delta = on_upstream_delta,
    .on_done = on_upstream_done,
    .on_error = on_upstream_error,
};

/* A chat message with its dialog loaded: pipeline, ack, upstream. */
static void turn_start(cg_msg *m)
{
    cg_session *s = m->s;
    cg_gateway *gw = s->gw;
    cg_dialog *d = &m->dialog;
    d->message_count++;
    d->last_activity = session_now(s);

    json_t *awaiting_before = json_incref(d->awaiting); /* forwarded as it was */
    cg_pipeline_result res;
    uint64_t t0 = uv_hrtime();
    cg_pipeline_run(gw->cfg, m->rules, d, m->text, session_now(s), &gw->cfg->lifetimes, &res);
    cg_histogram_observe(&gw->metrics.rules, (double)(uv_hrtime() - t0) / 1e9);
    cg_metrics_count_pipeline(&gw->metrics, &res);
    if (res.error) { /* params over the cap: refused, nothing forwarded */
        session_send_error(s, m->id, res.error, res.error_message);
        json_decref(awaiting_before);
        cg_pipeline_result_free(&res);
        turn_save(m, TURN_ERROR);
        msg_finish(m);
        return;
    }
    m->route = res.route;
    if (res.enriched)
        m->enriched = strdup(res.enriched);
    cg_upstream *up = &gw->upstreams[m->route];
    json_t *params = cg_dialog_params_merged(d, d->service, cg_config_service_defaults(gw->cfg, d->service));
    cg_ack ack = {
        .id = m->id, .room = m->room, .route = up->cfg->name, .service = d->service, .enriched = res.enriched,
        .params = params, .resolution = res.resolution, .rules = res.rules,
    };
    session_send(s, cg_protocol_ack(&ack));
    if (res.absorb) { /* `cancel absorb`: answered here */
        session_send(s, cg_protocol_done(m->id, "", 0, NULL, 0));
        json_decref(awaiting_before);
        json_decref(params);
        cg_pipeline_result_free(&res);
        turn_save(m, TURN_ABSORBED);
        msg_finish(m);
        return;
    }

    char *summary = cg_dialog_summary(d, params, res.resolution, res.annotations);
    cg_upstream_message um = {
        .id = m->id, .user = s->user, .room = m->room, .text = m->text, .route = up->cfg->name,
        .service = d->service, .params = params, .awaiting = awaiting_before, .soft = d->soft,
        .history = d->history, .summary = summary, .enriched = res.enriched, .resolution = res.resolution,
        .annotations = res.annotations, .rules = res.rules,
    };
    gw->metrics.routed[m->route]++;
    m->t_upstream = uv_hrtime();
    int rc = up->ops->start(up, &s->up_conns[m->route], &um, &upstream_events, m, &m->call);
    free(summary);
    json_decref(params);
    json_decref(awaiting_before);
    cg_pipeline_result_free(&res);
    if (rc < 0) {
        session_send_error(s, m->id, CG_E_INTERNAL, "the upstream request could not be started");
        turn_save(m, TURN_ERROR);
        msg_finish(m);
        return;
    }
    if (s->upstream_paused)
        up->ops->pause(m->call, 1);
}

/* context.get, context.forget, context.clear: on the caller's own dialog only. */
static void context_command(cg_msg *m)
{
    cg_session *s = m->s;
    cg_store *st = s->gw->store;
    if (m->kind == MSG_CONTEXT_FORGET) {
        if (cg_dialog_forget(&m->dialog, m->keys) > 0)
            st->ops->save(st, s->user, m->room, &m->dialog, NULL, NULL);
    } else if (m->kind == MSG_CONTEXT_CLEAR) {
        st->ops->remove(st, s->user, m->room, NULL, NULL);
        cg_dialog_free(&m->dialog);
        cg_dialog_init(&m->dialog, session_now(s));
    }
    json_t *state = cg_dialog_context(&m->dialog);
    session_send(s, cg_protocol_context(m->room, state));
    json_decref(state);
    msg_finish(m);
}

static void on_dialog_loaded(void *ctx, cg_dialog *d, const cg_store_status *status)
{
    cg_msg *m = ctx;
    cg_metrics *mt = &m->s->gw->metrics;
    m->load = NULL;
    m->dialog = *d; /* ours now */
    m->has_dialog = 1;
    cg_histogram_observe(&mt->store_load, (double)(uv_hrtime() - m->t_load) / 1e9);
    if (m->kind == MSG_CHAT && status->found) /* reference 001's cache: a message found its dialog */
        mt->cache_hits++;
    else if (m->kind == MSG_CHAT)
        mt->cache_misses++;
    if (status->warn) {
        m->s->gw->metrics.degraded_warnings++;
        session_send(m->s, cg_protocol_warning(m->kind == MSG_CHAT ? m->id : NULL, "store_degraded",
                                               "state kept in memory: Redis unreachable"));
    }
    if (m->kind == MSG_CHAT)
        turn_start(m);
    else
        context_command(m);
}

/* Starts loading m's dialog; -1 (with an error frame sent) when the store refused. */
static int msg_load(cg_msg *m)
{
    cg_session *s = m->s;
    cg_store *st = s->gw->store;
    m->t_load = uv_hrtime();
    m->load = st->ops->load(st, s->user, m->room, on_dialog_loaded, m);
    if (m->load)
        return 0;
    session_send_error(s, m->kind == MSG_CHAT ? m->id : NULL, CG_E_INTERNAL, "the dialog could not be loaded");
    return -1;
}

/*
 * One turn at a time per dialog (admission.h): a message holds its dialog's lock from load
 * to save; when another connection's turn of the dialog holds it, the message waits, and
 * starts here when the lock passes to it.
 */
static void on_lock_granted(cg_dialog_lock_waiter *w)
{
    cg_msg *m = w->owner;
    if (msg_load(m) < 0) { /* cannot happen with the shipped stores; keep the line moving */
        m->s->inflight = NULL;
        msg_finish(m);
    }
}

/* Runs the next waiting request, if none is in flight: first, load its dialog. */
static void session_pump(cg_session *s)
{
    while (!s->inflight && s->queue_head) {
        cg_msg *m = s->queue_head;
        s->queue_head = m->next;
        if (!s->queue_head)
            s->queue_tail = NULL;
        s->queued--;
        m->next = NULL;
        s->inflight = m;
        if (m->kind == MSG_CHAT) {
            m->counted = 1;
            s->gw->inflight_turns++;
        }
        m->lock.granted = on_lock_granted;
        m->lock.owner = m;
        if (!cg_dialog_lock_acquire(s->gw->dialog_locks, &m->lock, s->user, m->room))
            return; /* another connection's turn of this dialog runs; on_lock_granted starts this one */
        if (msg_load(m) == 0)
            return;
        s->inflight = NULL;
        msg_free(m);
    }
}

static int session_id_in_use(cg_session *s, const char *id)
{
    if (s->inflight && s->inflight->kind == MSG_CHAT && strcmp(s->inflight->id, id) == 0)
        return 1;
    for (cg_msg *m = s->queue_head; m; m = m->next)
        if (m->kind == MSG_CHAT && strcmp(m->id, id) == 0)
            return 1;
    return 0;
}

static void inflight_stop(cg_session *s);

/*
 * A message that a cancel rule matches acts at once on the reply in flight of its dialog
 * (DESIGN.md section 1, "Arrival"): that reply gets `cancelled`; the message itself then
 * waits its turn like any other and goes through the pipeline, which clears awaiting.
 */
static void cancel_on_arrival(cg_session *s, const cg_client_frame *f)
{
    cg_msg *m = s->inflight;
    if (!m || m->kind != MSG_CHAT || strcmp(m->room, f->room) != 0)
        return;
    if (!cg_rules_cancels(s->gw->rules, f->text))
        return;
    cg_info("session %s: message %s stopped by a cancel phrase", s->session_id, m->id);
    inflight_stop(s);
    session_send(s, cg_protocol_cancelled(m->id));
    msg_finish(m);
}

/* Queues a message or context command, within the rate and queue limits. */
static void session_on_request(cg_session *s, cg_client_frame *f)
{
    char err[160];
    int chat = f->type == CG_FRAME_MESSAGE;
    if (chat && !f->id[0])
        snprintf(f->id, sizeof(f->id), "g%lu", ++s->auto_id);
    if (!cg_rate_take(&s->rate, s->gw->cfg->rate_per_second, s->gw->cfg->rate_burst, uv_now(s->gw->loop))) {
        snprintf(err, sizeof(err), "over %ld messages a second", s->gw->cfg->rate_per_second);
        session_send_error(s, f->id, CG_E_RATE_LIMITED, err);
        return;
    }
    if (s->queued >= s->gw->cfg->queue_limit) {
        snprintf(err, sizeof(err), "%ld messages wait already for the reply in flight", s->queued);
        session_send_error(s, f->id, CG_E_RATE_LIMITED, err);
        return;
    }
    if (s->gw->stopping) {
        session_send_error(s, f->id, CG_E_INTERNAL, "the gateway is shutting down: reconnect");
        return;
    }
    if (chat && session_id_in_use(s, f->id)) {
        snprintf(err, sizeof(err), "id '%.64s' is already in use by a message not yet answered", f->id);
        session_send_error(s, f->id, CG_E_BAD_FRAME, err);
        return;
    }
    if (chat)
        cancel_on_arrival(s, f);
    cg_msg *m = calloc(1, sizeof(*m));
    if (!m)
        abort();
    m->s = s;
    m->kind = chat ? MSG_CHAT
              : f->type == CG_FRAME_CONTEXT_GET ? MSG_CONTEXT_GET
              : f->type == CG_FRAME_CONTEXT_FORGET ? MSG_CONTEXT_FORGET : MSG_CONTEXT_CLEAR;
    memcpy(m->id, f->id, sizeof(m->id));
    memcpy(m->room, f->room, sizeof(m->room));
    m->text = f->text;
    f->text = NULL;
    m->keys = f->keys;
    f->keys = NULL;
    m->arrived = session_now(s);
    m->t_arrived = uv_hrtime();
    m->rules = cg_ruleset_ref(s->gw->rules);
    if (chat)
        s->gw->metrics.messages++;
    if (s->queue_tail)
        s->queue_tail->next = m;
    else
        s->queue_head = m;
    s->queue_tail = m;
    s->queued++;
    session_pump(s);
}

/*
 * Stops the request in flight without a frame (the caller sends one, or the client is
 * gone): its load is abandoned, or its upstream call cancelled and the turn saved as
 * cancelled.
 */
static void inflight_stop(cg_session *s)
{
    cg_msg *m = s->inflight;
    if (m->load) {
        s->gw->store->ops->abandon(m->load);
        m->load = NULL;
    } else if (m->kind == MSG_CHAT && m->has_dialog) {
        if (m->call)
            s->gw->upstreams[m->route].ops->cancel(m->call);
        m->call = NULL;
        turn_save(m, TURN_CANCELLED);
    }
}

/* A cancel acts at once: on the reply in flight, or on a message still waiting. */
static void session_on_cancel(cg_session *s, const char *id)
{
    cg_msg *m = s->inflight;
    if (m && m->kind == MSG_CHAT && strcmp(m->id, id) == 0) {
        inflight_stop(s);
        session_send(s, cg_protocol_cancelled(id));
        msg_finish(m);
        return;
    }
    for (cg_msg **pp = &s->queue_head, *prev = NULL; *pp; prev = *pp, pp = &(*pp)->next) {
        if ((*pp)->kind != MSG_CHAT || strcmp((*pp)->id, id) != 0)
            continue;
        m = *pp;
        *pp = m->next;
        if (s->queue_tail == m)
            s->queue_tail = prev;
        s->queued--;
        session_send(s, cg_protocol_cancelled(id));
        msg_free(m);
        return;
    }
    session_send_error(s, id, CG_E_NOT_FOUND, "no message with this id is waiting or in flight");
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
    if (f.type == CG_FRAME_CANCEL)
        session_on_cancel(s, f.id);
    else
        session_on_request(s, &f);
    cg_client_frame_clear(&f);
}

/* Reassembles one frame from its fragments, within --max-frame. */
static void session_on_receive(cg_session *s, const char *in, size_t len)
{
    struct lws *wsi = s->wsi;
    size_t max = (size_t)s->gw->cfg->max_frame;
    if (s->unauthorized)
        return;
    if (lws_is_first_fragment(wsi)) {
        s->rx_len = 0;
        s->rx_too_large = 0;
    }
    if (!s->rx_too_large) {
        if (s->rx_len + len > max) {
            s->rx_too_large = 1; /* read and drop the rest, answer at the end */
        } else {
            if (!s->rx) {
                s->rx = malloc(max);
                if (!s->rx)
                    abort();
            }
            memcpy(s->rx + s->rx_len, in, len);
            s->rx_len += len;
        }
    }
    if (!lws_is_final_fragment(wsi))
        return;
    if (s->dropin) { /* the app's protocol: frames of any kind go to drop-in */
        if (s->rx_too_large) {
            cg_warn("session %s: a drop-in frame over the %zu-byte limit: closing with 1009", s->session_id, max);
            cg_dropin_client_refuse(s->dropin, 1009, "frame over the gateway's max_frame");
        } else
            cg_dropin_client_frame(s->dropin, s->rx ? s->rx : "", s->rx_len, lws_frame_is_binary(wsi));
        s->rx_len = 0;
        return;
    }
    s->gw->metrics.frames_in++;
    char err[128];
    if (lws_frame_is_binary(wsi)) {
        session_send_error(s, NULL, CG_E_BAD_FRAME, "binary frames are not accepted: send JSON text frames");
    } else if (s->rx_too_large) {
        snprintf(err, sizeof(err), "the frame is over the %zu-byte limit", max);
        session_send_error(s, NULL, CG_E_TOO_LARGE, err);
    } else {
        session_on_frame(s, s->rx, s->rx_len);
    }
    s->rx_len = 0;
}

/* ---- identity -------------------------------------------------------------------------- */

/*
 * Who this connection is (DESIGN.md section 4), from the handshake: a resume token or a
 * fresh id (auth none), a JWT (auth jwt), or a proxy's header (auth header). 0, or -1 with
 * the reason in err.
 */
static int session_identify(cg_session *s, struct lws *wsi, char *err, size_t errlen)
{
    cg_gateway *gw = s->gw;
    const char *auth = gw->cfg->auth;
    char buf[4096];
    if (strcmp(auth, "jwt") == 0) {
        /* copied whole: a long JWT fits the header space (max_header_bytes), not buf */
        int cap = lws_hdr_total_length(wsi, WSI_TOKEN_HTTP_AUTHORIZATION) +
                  lws_hdr_total_length(wsi, WSI_TOKEN_HTTP_URI_ARGS) + 1;
        char *tbuf = malloc((size_t)cap);
        if (!tbuf)
            abort();
        const char *token = NULL;
        if (lws_hdr_copy(wsi, tbuf, cap, WSI_TOKEN_HTTP_AUTHORIZATION) > 7 && strncasecmp(tbuf, "Bearer ", 7) == 0)
            token = tbuf + 7;
        else
            token = lws_get_urlarg_by_name(wsi, "access_token=", tbuf, cap);
        int rc = -1;
        if (!token)
            snprintf(err, errlen, "a JWT is needed: Authorization: Bearer, or ?access_token=");
        else
            rc = cg_identity_jwt_verify_ex(gw->jwt_secret, gw->jwt_secret_len, token, session_now(s), 30,
                                           gw->cfg->jwt_allow_no_exp, s->user, sizeof(s->user), err, errlen);
        free(tbuf);
        return rc;
    }
    if (strcmp(auth, "header") == 0) {
        char name[128];
        snprintf(name, sizeof(name), "%s:", gw->cfg->user_header);
        for (char *p = name; *p; p++)
            *p = (char)tolower((unsigned char)*p);
        int n = lws_hdr_custom_copy(wsi, buf, sizeof(buf), name, (int)strlen(name));
        if (n <= 0) {
            snprintf(err, errlen, "no %s header", gw->cfg->user_header);
            return -1;
        }
        if (n > CG_MAX_USER) {
            snprintf(err, errlen, "the user id is over %d bytes", CG_MAX_USER);
            return -1;
        }
        memcpy(s->user, buf, (size_t)n + 1);
        return 0;
    }
    const char *resume = lws_get_urlarg_by_name(wsi, "resume=", buf, sizeof(buf));
    if (resume && cg_identity_resume_check(gw->resume_secret, gw->resume_secret_len, resume, s->user,
                                           sizeof(s->user)) == 0)
        return 0;
    unsigned char rnd[8];
    if (RAND_bytes(rnd, sizeof(rnd)) != 1)
        abort();
    snprintf(s->user, sizeof(s->user), "u_%02x%02x%02x%02x%02x%02x%02x%02x", rnd[0], rnd[1], rnd[2], rnd[3],
             rnd[4], rnd[5], rnd[6], rnd[7]);
    return 0;
}

/* ---- the connection ------------------------------------------------------------------- */

static int is_dropin_path(cg_gateway *gw, struct lws *wsi);
static void dropin_open(cg_session *s, struct lws *wsi);

static void session_open(cg_session *s, struct lws *wsi)
{
    cg_gateway *gw = cg_gateway_of(wsi);
    s->wsi = wsi;
    s->gw = gw;
    s->established = 1;
    cg_rate_init(&s->rate, gw->cfg->rate_burst, uv_now(gw->loop));
    snprintf(s->session_id, sizeof(s->session_id), "s_%lu", ++gw->session_seq);
    gw->n_sessions++;
    char err[256];
    if (is_dropin_path(gw, wsi)) {
        dropin_open(s, wsi);
        return;
    }
    if (session_identify(s, wsi, err, sizeof(err)) < 0) {
        cg_warn("session %s: refused: %s", s->session_id, err);
        s->unauthorized = 1;
        s->user[0] = 0;
        gw->metrics.unauthorized++;
        session_send_error(s, NULL, CG_E_UNAUTHORIZED, err);
        return;
    }
    cg_info("session %s: open (%ld connected)", s->session_id, gw->n_sessions);
    char *resume = strcmp(gw->cfg->auth, "none") == 0
                       ? cg_identity_resume_token(gw->resume_secret, gw->resume_secret_len, s->user)
                       : NULL;
    session_send(s, cg_protocol_hello(s->user, s->session_id, resume));
    free(resume);
}

/* The client is gone: stop the request in flight upstream and release everything. */
static void session_close(cg_session *s)
{
    if (!s->established)
        return;
    cg_gateway *gw = s->gw;
    if (s->dropin) {
        cg_dropin_close(s->dropin);
        s->dropin = NULL;
    }
    if (s->inflight) {
        inflight_stop(s);
        msg_free(s->inflight);
        s->inflight = NULL;
    }
    while (s->queue_head) {
        cg_msg *m = s->queue_head;
        s->queue_head = m->next;
        msg_free(m);
    }
    while (s->out_head) {
        cg_out *o = s->out_head;
        s->out_head = o->next;
        out_free(o);
    }
    for (int i = 0; i < gw->n_upstreams; i++)
        if (s->up_conns[i] && gw->upstreams[i].ops->close_conn)
            gw->upstreams[i].ops->close_conn(s->up_conns[i]);
    free(s->rx);
    s->established = 0;
    gw->n_sessions--;
    cg_info("session %s: closed (%ld connected)", s->session_id, gw->n_sessions);
}

/* The drop-in path and what lies under it (/socket, /socket/websocket, /socket/room/1). */
static int is_dropin_path(cg_gateway *gw, struct lws *wsi)
{
    const char *path = json_string_value(json_object_get(gw->cfg->dropin, "path"));
    char uri[1024];
    if (!path || lws_hdr_copy(wsi, uri, sizeof(uri), WSI_TOKEN_GET_URI) <= 0)
        return 0;
    size_t n = strlen(path);
    while (n > 1 && path[n - 1] == '/')
        n--;
    return strncmp(uri, path, n) == 0 && (uri[n] == 0 || uri[n] == '/');
}

/*
 * A client of the app on the drop-in path: the user comes from --auth as usual, or with
 * auth none from the app's session cookie (dropin.user_cookie), so the same session finds
 * the same dialogs; no hello, no chatgate.v1: the app's protocol goes on.
 */
static void dropin_open(cg_session *s, struct lws *wsi)
{
    cg_gateway *gw = s->gw;
    char err[256];
    if (strcmp(gw->cfg->auth, "none") == 0 && cg_dropin_user_from_cookie(gw, wsi, s->user, sizeof(s->user)) == 0) {
        /* the cookie's user */
    } else if (session_identify(s, wsi, err, sizeof(err)) < 0) {
        /* as for chatgate.v1, but with no error frame (the app's protocol has none of ours):
         * marked unauthorized (nothing it sends is read), then closed with 1008 from the
         * next writable */
        cg_warn("session %s: drop-in client refused: %s", s->session_id, err);
        s->unauthorized = 1;
        s->user[0] = 0;
        gw->metrics.unauthorized++;
        lws_callback_on_writable(wsi);
        return;
    }
    s->dropin = cg_dropin_open(gw, wsi, s->user);
    if (!s->dropin)
        lws_set_timeout(wsi, PENDING_TIMEOUT_CLOSE_SEND, LWS_TO_KILL_ASYNC);
    else
        cg_info("session %s: drop-in (%ld connected)", s->session_id, gw->n_sessions);
}

/*
 * The browser Origin check of DESIGN.md section 4 against cross-site WebSocket hijacking:
 * an Origin, when present, must name the Host the request was sent to, or be allowed by
 * --allow-origin ("*" allows all).
 */
static int origin_allowed(struct lws *wsi, const char *allow)
{
    char origin[512], host[512];
    if (lws_hdr_copy(wsi, origin, sizeof(origin), WSI_TOKEN_ORIGIN) <= 0)
        return 1; /* not a browser */
    if (allow) {
        size_t n = strlen(origin);
        for (const char *p = allow; *p;) {
            size_t len = strcspn(p, ",");
            if ((len == 1 && *p == '*') || (len == n && strncmp(p, origin, n) == 0))
                return 1;
            p += len + (p[len] == ',');
        }
    }
    const char *sep = strstr(origin, "://");
    return sep && lws_hdr_copy(wsi, host, sizeof(host), WSI_TOKEN_HOST) > 0 && strcasecmp(sep + 3, host) == 0;
}

/*
 * Answers an upgrade request with an HTTP error. lws_return_http_status() would say
 * "HTTP/1.0" here (lws has not yet read the request's version at this stage), which strict
 * WebSocket clients reject as no valid answer, so the status line is written by hand.
 */
static int refuse_upgrade(struct lws *wsi, int status, const char *reason, const char *body)
{
    char buf[LWS_PRE + 512];
    char *p = buf + LWS_PRE;
    int n = snprintf(p, sizeof(buf) - LWS_PRE,
                     "HTTP/1.1 %d %s\r\ncontent-type: text/plain\r\ncontent-length: %zu\r\n"
                     "connection: close\r\n\r\n%s",
                     status, reason, strlen(body), body);
    lws_write(wsi, (unsigned char *)p, (size_t)n, LWS_WRITE_HTTP_HEADERS);
    return 1;
}

/*
 * The WebSocket upgrade: only on /ws, and only while under --max-connections. Refusals
 * are HTTP answers (404, 503) so that a client or load balancer sees why; returning 1
 * tells lws the answer was written.
 */
static int session_confirm_upgrade(struct lws *wsi)
{
    cg_gateway *gw = cg_gateway_of(wsi);
    char uri[256];
    if (lws_hdr_copy(wsi, uri, sizeof(uri), WSI_TOKEN_GET_URI) < 0 || (strcmp(uri, "/ws") != 0 && !is_dropin_path(gw, wsi))) {
        return refuse_upgrade(wsi, 404, "Not Found", "WebSocket connections go to /ws\n");
    }
    if (!origin_allowed(wsi, gw->cfg->allow_origin)) {
        cg_warn("refused a connection from another site's page (Origin not allowed; see --allow-origin)");
        gw->metrics.refused_connections++;
        return refuse_upgrade(wsi, 403, "Forbidden", "this Origin may not connect (see --allow-origin)\n");
    }
    if (gw->stopping) {
        gw->metrics.refused_connections++;
        return refuse_upgrade(wsi, 503, "Service Unavailable", "shutting down\n");
    }
    if (gw->n_sessions >= gw->cfg->max_connections) {
        cg_warn("refused a connection: %ld connected, the limit is %ld", gw->n_sessions,
                gw->cfg->max_connections);
        gw->metrics.refused_connections++;
        return refuse_upgrade(wsi, 503, "Service Unavailable", "too many connections\n");
    }
    return 0;
}

int cg_session_callback(struct lws *wsi, enum lws_callback_reasons reason, void *user, void *in, size_t len)
{
    cg_session *s = user;
    switch (reason) {
    case LWS_CALLBACK_HTTP_CONFIRM_UPGRADE:
        return session_confirm_upgrade(wsi);
    case LWS_CALLBACK_ESTABLISHED:
        session_open(s, wsi);
        return 0;
    case LWS_CALLBACK_RECEIVE:
        session_on_receive(s, in, len);
        return 0;
    case LWS_CALLBACK_SERVER_WRITEABLE:
        if (s->dropin && s->gw->closing_all && cg_dropin_client_idle(s->dropin))
            return session_write_close(s, LWS_CLOSE_STATUS_GOINGAWAY, "going away");
        return s->dropin ? cg_dropin_client_writable(s->dropin) : session_write_one(s);
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
