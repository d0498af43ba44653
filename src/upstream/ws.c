/*
 * ws.c: a chat app's own WebSocket server (docs/protocol.md, "Upstreams").
 *
 * One upstream connection per client connection, opened on that client's first message to
 * this upstream and closed with the client. With replicas (upstreams.NAME.urls) the call
 * core (call.c) picks the replica when the connection is opened, by the dialog of the
 * message that opens it; a connection that cannot be made, or that closes or stays silent
 * before the first frame of the reply, is closed and the message goes again, on a new
 * connection, to the next replica. After the first delta nothing is retried. Each message is sent as a chatgate message
 * frame; the app answers with delta/done/error frames carrying the same id, and frames of
 * any other id (a cancelled message's tail, say) are dropped. Cancel sends the app
 * {"type":"cancel","id":...}. If the app closes or cannot be reached, the message in flight
 * gets upstream_unavailable and the next message opens a new connection. An app's error
 * frame gives upstream_error with its message, and its "code" as upstream_code.
 *
 * Pausing (the client reads slowly) stops reading from the app; it belongs to the call in
 * flight, and the first-byte and idle deadlines (the core's) do not run while it lasts.
 *
 * A connection (ws_conn) is a WebSocket client (core/wsclient.h: connecting, the frame queue,
 * the close); it holds a reference for its clock's timer and one for its client, dropped when
 * the client has ended, and is freed when both are gone; its clock is lent to the call in
 * flight. The session's slot
 * points at the live connection; a connection that dies on its own clears the slot. The
 * upstream keeps its replicas' addresses and health in its ws_state (cg_upstream.state).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "chatgate/core/alloc.h"
#include "chatgate/core/buf.h"
#include "chatgate/core/error.h"
#include "chatgate/core/flush.h"
#include "chatgate/core/jsonflat.h"
#include "chatgate/core/jsonout.h"
#include "chatgate/core/log.h"
#include "chatgate/core/textframe.h"
#include "chatgate/core/wsclient.h"
#include "chatgate/core/wsconn.h"
#include "chatgate/upstream/call.h"
#include "chatgate/upstream/upstream.h"

#define MAX_APP_FRAME (1 << 20) /* one frame from the app */
#define MAX_PENDING 16          /* frames waiting to go to the app: a message and cancels */

/* What one upstream keeps between calls (cg_upstream.state): where each replica is (the
 * parsed URL: host, port, tls, authority, path) and how it fares. */
typedef struct ws_state {
    cg_upstream_config at[CG_MAX_REPLICAS];
    cg_replicas replicas;
} ws_state;

/* One history item as JSON text, kept for the next message (see hist_refresh). */
typedef struct hist_text {
    json_t *item; /* a reference: the pointer cannot be reused for another item while kept */
    char *text;
    size_t len;
} hist_text;

typedef struct ws_conn {
    cg_upstream *up;
    const cg_upstream_config *at; /* its replica's address (ws_state.at) */
    int replica;
    void **slot; /* the session's pointer to this connection; NULL once detached */
    int refs;
    int dead; /* closed, failed or detached: takes no more calls */
    cg_wsclient client;     /* the connection; its queue keeps the last frame's buffer as a spare */
    cg_call_clock clock;    /* lent to the call in flight (call.h) */
    cg_upstream_call *call; /* the message in flight */
    size_t last_head;    /* of the last message frame without its history: the next one's estimate */
    hist_text *hist; /* the last message's history as text, n_hist items (at most history_n) */
    size_t n_hist;
} ws_conn;

struct cg_upstream_call {
    cg_call core;  /* first: the core's cg_call is this call */
    ws_conn *conn; /* the connection the current attempt is on; NULL between attempts */
    void **slot;   /* the session's: a retry opens its next connection there */
    char *id;      /* the message's, whole: frames are matched on it */
    const cg_upstream_message *m; /* during start() only: the first attempt writes the frame */
    /* the message frame as sent (CG_WS_PRE headroom, then frame_len bytes), for a retry on
     * another replica; NULL when the upstream cannot retry (one replica, or max_attempts 1) */
    char *frame;
    size_t frame_len;
    cg_textframe delta; /* around the last delta's text: the next is read without a parser */
};

static void call_free(cg_upstream_call *c)
{
    free(c->frame);
    free(c->id);
    free(c);
}

static void hist_free(hist_text *h, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        json_decref(h[i].item);
        free(h[i].text);
    }
    free(h);
}

static void conn_unref(ws_conn *k)
{
    if (--k->refs > 0)
        return;
    hist_free(k->hist, k->n_hist);
    cg_wsconn_clear(&k->client.conn);
    free(k);
}

static void timer_closed(uv_handle_t *h)
{
    conn_unref((ws_conn *)((char *)h->data - offsetof(ws_conn, clock)));
}

/* Reading from the app stops while paused (the core stops the deadlines). */
static void conn_pause(ws_conn *k, int paused)
{
    cg_wsconn_pause_rx(&k->client.conn, paused);
}

static int conn_open(const ws_conn *k)
{
    return k->client.state == CG_WSCLIENT_OPEN;
}

/* The call's attempt leaves its connection, which waits for the next call, unpaused (the
 * pause was the call's; a cancelled reply's tail is read and dropped). */
static void call_detach(cg_upstream_call *c)
{
    ws_conn *k = c->conn;
    ws_state *st = c->core.up->state; /* NULL once the upstream has closed */
    if (!k)
        return;
    if (k->call == c)
        k->call = NULL;
    c->conn = NULL;
    cg_call_clock_drop(&c->core);
    if (st)
        st->replicas.r[k->replica].busy--;
    conn_pause(k, 0);
}

/* Reports the failure of the call in flight on k, if any, to the core (call.h: how, why):
 * it retries it on another replica or ends it; the connection is left as it is. error is
 * the app's own error detail ({"code": ...}, borrowed) or NULL. */
static void call_fail(ws_conn *k, cg_call_failure how, const char *why, int err, json_t *error, const char *fmt,
                      ...) __attribute__((format(printf, 6, 7)));
static void call_fail(ws_conn *k, cg_call_failure how, const char *why, int err, json_t *error, const char *fmt, ...)
{
    if (!k->call)
        return;
    va_list ap;
    va_start(ap, fmt);
    cg_call_vfail(&k->call->core, how, why, err, error, fmt, ap);
    va_end(ap);
}

/* {"type":"cancel","id":id} behind a frame's headroom, written as the message frame is;
 * NULL when it cannot be built */
static char *cancel_frame(const char *id, size_t *len)
{
    cg_jsonw w;
    cg_jsonw_init(&w, CG_WS_PRE, 64);
    CG_JSONW_LIT(&w, "{\"type\":\"cancel\"");
    cg_jsonw_member_str(&w, "id", id);
    CG_JSONW_LIT(&w, "}");
    w.failed |= !id;
    return cg_jsonw_end(&w, len);
}

/* The connection is no use any more: detach from the session and close. */
static void conn_kill(ws_conn *k)
{
    if (k->dead)
        return;
    k->dead = 1;
    if (k->call)
        call_detach(k->call);
    if (k->slot) {
        *k->slot = NULL;
        k->slot = NULL;
    }
    uv_close((uv_handle_t *)&k->clock.timer, timer_closed);
    /* a close frame (1001) when open; its end may come from inside (client_ended) */
    cg_wsclient_close(&k->client, 1001, "going away");
}

/* Queues frame (len bytes after CG_WS_PRE, in a buffer of cap bytes: 0 when it is not to be
 * kept as the connection's spare); takes it. NULL (it could not be built), or the queue's
 * bound reached: -1. */
static int queue_frame(ws_conn *k, char *frame, size_t len, size_t cap)
{
    if (!frame)
        return -1;
    return cg_wsconn_push(&k->client.conn, cg_wsframe_adopt(frame, len, cap <= CG_JSONW_KEEP_MAX ? cap : 0, 0));
}

/* Queues {"type":"cancel","id":id} for the app; when MAX_PENDING frames wait already (an app
 * that reads nothing), the app is not told, and the log says so. */
static void queue_cancel(ws_conn *k, const char *id)
{
    size_t len = 0;
    char *frame = cancel_frame(id, &len);
    if (queue_frame(k, frame, len, 0) < 0)
        cg_warn("upstream '%s': the cancel of a message could not be queued (%d frames wait for the app): it is "
                "not told to stop", k->up->cfg->name, k->client.conn.n);
}

/* ---- frames from the app -------------------------------------------------------------- */

/* A delta's text (len 0: none) for the message in flight. */
static void app_delta(cg_upstream_call *c, const char *text, size_t len)
{
    cg_call_progress(&c->core);
    if (len)
        cg_call_delta(&c->core, text, len);
}

/* The message in flight is done; usage and state are borrowed (NULL: none). */
static void app_done(cg_upstream_call *c, const char *text, size_t len, json_t *usage, json_t *state)
{
    /* A done with text but no deltas before it: the text is the reply. */
    if (!c->core.reply_bytes && len)
        cg_call_delta(&c->core, text, len);
    cg_call_done(&c->core, usage, state);
}

/*
 * The frames of every reply, a delta or a done of "type", "id" and "text" only, read without
 * a tree (core/jsonflat.h). Returns 1 when the frame was one and has been dealt with, 0 when
 * it is left to jansson (any other frame, and any frame the flat reader does not read).
 */
static int on_plain_frame(cg_upstream_call *c, const char *buf, size_t len)
{
    const char *t;
    size_t t_len;
    if (cg_textframe_match(&c->delta, buf, len, &t, &t_len)) { /* this message's delta, as the last */
        app_delta(c, t_len ? t : NULL, t_len);
        return 1;
    }
    cg_jsonflat f;
    int done = 0;
    if (!cg_jsonflat_read(&f, buf, len))
        goto out;
    const cg_jsonflat_member *type = cg_jsonflat_get(&f, "type"), *id = cg_jsonflat_get(&f, "id"),
                             *text = cg_jsonflat_get(&f, "text");
    if (f.n != (size_t)(!!type + !!id + !!text) || !type || type->kind != CG_JSONFLAT_STRING)
        goto out;
    int delta = cg_jsonflat_is(type, "delta");
    if (!delta && !cg_jsonflat_is(type, "done"))
        goto out;
    done = 1;
    if (!cg_jsonflat_is(id, c->id))
        goto out; /* about another message */
    int is_text = text && text->kind == CG_JSONFLAT_STRING;
    size_t text_len = is_text ? text->len : 0;
    if (delta && is_text) /* before the delta: it may end the call */
        cg_textframe_keep(&c->delta, buf, len, text->str, text_len);
    if (delta)
        app_delta(c, text_len ? text->str : NULL, text_len);
    else
        app_done(c, text_len ? text->str : NULL, text_len, NULL, NULL);
out:
    cg_jsonflat_free(&f);
    return done;
}

static void on_app_frame(ws_conn *k, const char *buf, size_t len)
{
    cg_upstream_call *c = k->call;
    if (!c)
        return; /* nothing in flight: a cancelled message's tail */
    if (on_plain_frame(c, buf, len))
        return;
    json_error_t jerr;
    json_t *o = json_loadb(buf, len, JSON_ALLOW_NUL, &jerr); /* "\u0000" is valid JSON */
    json_t *id = json_object_get(o, "id");
    json_t *type = json_object_get(o, "type");
    if (!json_is_object(o) || !json_is_string(type)) {
        /* what was wrong, and where: jansson's text ("too big integer near ...", at a
         * column) when it is no JSON at all */
        char why[200];
        if (!o)
            snprintf(why, sizeof(why), "not JSON (%s, at byte %d)", jerr.text, jerr.position);
        else
            snprintf(why, sizeof(why), "%s", json_is_object(o) ? "no \"type\" string" : "not a JSON object");
        json_decref(o);
        call_fail(k, CG_CALL_FINAL, NULL, CG_E_UPSTREAM_ERROR, NULL,
                  "sent a frame that is not a chatgate JSON frame: %s: %.*s", why, (int)(len < 80 ? len : 80), buf);
        return;
    }
    if (!json_is_string(id) || strcmp(json_string_value(id), c->id) != 0) {
        json_decref(o);
        return; /* about another message */
    }
    const char *t = json_string_value(type);
    json_t *text = json_object_get(o, "text");
    size_t text_len = json_is_string(text) ? json_string_length(text) : 0;
    if (strcmp(t, "delta") == 0) {
        app_delta(c, json_string_value(text), text_len);
    } else if (strcmp(t, "done") == 0) {
        json_t *usage = json_object_get(o, "usage");
        app_done(c, json_string_value(text), text_len, json_is_object(usage) ? usage : NULL,
                 json_object_get(o, "state"));
    } else if (strcmp(t, "error") == 0) {
        json_t *m = json_object_get(o, "message");
        const char *what = json_is_string(m) ? json_string_value(m) : "(no message)";
        json_t *error = json_object(); /* the app's "code"; its "type" is the frame's */
        json_t *code = json_object_get(o, "code");
        if (error && code && json_object_set(error, "code", code) < 0) {
            json_decref(error);
            error = NULL; /* the error still goes out, without the app's code */
        }
        if (c->core.reply_bytes)
            call_fail(k, CG_CALL_FINAL, NULL, CG_E_UPSTREAM_ERROR, error,
                      "failed mid-reply, after %zu bytes of reply text: %.300s", c->core.reply_bytes, what);
        else
            call_fail(k, CG_CALL_FINAL, NULL, CG_E_UPSTREAM_ERROR, error, "answered with an error: %.300s", what);
        json_decref(error);
    }
    json_decref(o);
}

/* ---- the connection (core/wsclient.h) --------------------------------------------------- */

/* upstreams.NAME.headers */
static int client_headers(cg_wsclient *w, unsigned char **p, unsigned char *end)
{
    ws_conn *k = w->owner;
    if (cg_upstream_append_headers(w->conn.wsi, &k->up->cfg->headers, NULL, p, end) == 0)
        return 0;
    cg_warn("upstream '%s': its configured headers do not fit lws's handshake buffer", k->up->cfg->name);
    return -1;
}

static void client_opened(cg_wsclient *w)
{
    ws_conn *k = w->owner;
    if (k->call)
        cg_call_arm(&k->call->core, CG_CALL_FIRST_BYTE);
}

static void client_message(cg_wsclient *w, const char *msg, size_t len, int binary)
{
    ws_conn *k = w->owner;
    if (binary)
        return; /* not ours: ignored */
    if (!msg)
        call_fail(k, CG_CALL_FINAL, NULL, CG_E_UPSTREAM_ERROR, NULL, "sent a frame over %d bytes", MAX_APP_FRAME);
    else
        on_app_frame(k, msg, len);
}

/* The connection ended: the message in flight fails (retried on another replica when no
 * reply text reached the client), and the connection's reference goes. */
static void client_ended(cg_wsclient *w, const cg_wsclient_end *e)
{
    ws_conn *k = w->owner;
    if (!e->opened) {
        call_fail(k, CG_CALL_RETRY, "could not be reached", CG_E_UPSTREAM_UNAVAILABLE, NULL, "%s", e->why);
    } else {
        char reason[160] = ""; /* the app's close frame, when it sent a valid one with a code */
        if (e->invalid)
            snprintf(reason, sizeof(reason), " (an invalid close frame)");
        else if (e->code && e->code != 1005)
            snprintf(reason, sizeof(reason), " (close code %d%s%.100s)", e->code, e->reason[0] ? ": " : "",
                     e->reason);
        if (k->call && k->call->core.reply_bytes) /* the client saw the reply start: not retried */
            call_fail(k, CG_CALL_FINAL, NULL, CG_E_UPSTREAM_UNAVAILABLE, NULL,
                      "closed the connection mid-reply, after %zu bytes of reply text%s", k->call->core.reply_bytes,
                      reason);
        else
            call_fail(k, CG_CALL_RETRY, "closed the connection", CG_E_UPSTREAM_UNAVAILABLE, NULL,
                      "closed the connection before any reply text%s", reason);
    }
    conn_kill(k);
    conn_unref(k);
}

static const cg_wsclient_ops client_ops = {
    .headers = client_headers,
    .opened = client_opened,
    .message = client_message,
    .ended = client_ended,
};

/* A write failed outside the connection's callbacks. */
static void conn_lost(cg_wsconn *c)
{
    ws_conn *k = c->owner;
    call_fail(k, CG_CALL_RETRY, "lost the connection", CG_E_UPSTREAM_UNAVAILABLE, NULL,
              "connection was lost while sending");
    conn_kill(k);
}

static const cg_wsconn_ops conn_ops = {.lost = conn_lost};

/* A connection to replica r of up, put in the session's slot; NULL when its address cannot
 * even be looked up (nothing is left in the slot then). */
static ws_conn *conn_new(cg_upstream *up, void **slot, int r)
{
    ws_state *st = up->state;
    ws_conn *k = cg_calloc(1, sizeof(*k));
    k->up = up;
    k->at = &st->at[r];
    k->replica = r;
    k->slot = slot;
    k->refs = 2; /* the timer's, and the client's until it has ended */
    cg_call_clock_init(&k->clock, up->net->loop);
    cg_wsclient_init(&k->client, up->net, &conn_ops, &client_ops, k);
    k->client.max_message = MAX_APP_FRAME;
    k->client.conn.max_frames = MAX_PENDING;
    *slot = k;
    const cg_upstream_config *at = k->at;
    cg_connect_spec spec = {.host = at->authority, .port = at->port, .tls = at->tls, .path = at->path,
                            .local_protocol = CG_LWS_PROTOCOL_WS};
    if (cg_wsclient_connect(&k->client, at->host, &spec) < 0) {
        conn_kill(k); /* the client ends at once: its reference goes */
        return NULL;
    }
    return k;
}

/*
 * Brings the connection's history text up to date with `history`: 0, or -1 when out of
 * memory. Every message carries the dialog's last history_n messages, and from one message
 * to the next that window moves by a turn: history items are never changed once pushed
 * (dialog.h), and the memory store hands the same items back turn after turn, so an item
 * already dumped for the last message is found by its pointer and its text reused. Dumping
 * the whole history again for every message was the largest single cost of a turn through
 * this upstream (docs/architecture.md, "Writing").
 */
static int hist_refresh(ws_conn *k, json_t *history)
{
    size_t n = json_array_size(history), from = 0;
    hist_text *next = n ? cg_calloc(n, sizeof(*next)) : NULL;
    if (n && !next)
        return -1;
    for (size_t i = 0; i < n; i++) {
        json_t *item = json_array_get(history, i);
        size_t j = from;
        while (j < k->n_hist && k->hist[j].item != item)
            j++;
        if (j < k->n_hist) { /* moved over: the old array no longer owns it */
            next[i] = k->hist[j];
            k->hist[j] = (hist_text){0};
            from = j + 1;
        } else if ((next[i].text = cg_json_dump_pre(item, 0, 256, &next[i].len))) {
            next[i].item = json_incref(item);
        } else {
            hist_free(next, i);
            return -1;
        }
    }
    hist_free(k->hist, k->n_hist);
    k->hist = next;
    k->n_hist = n;
    return 0;
}

/*
 * The message frame of docs/protocol.md ("Upstreams"), or NULL when it cannot be built,
 * written as text (core/jsonout.h, cg_jsonw), the history last, from the connection's texts
 * (hist_refresh). The buffer starts big enough for the history, whose size is known, and for
 * the rest as the connection's last frame had it.
 */
static char *message_frame(ws_conn *k, const cg_upstream_message *m, size_t *len, size_t *cap)
{
    if (hist_refresh(k, m->history) < 0)
        return NULL;
    size_t hist = 14 + k->n_hist; /* ,"history":[ ]} and the commas */
    for (size_t i = 0; i < k->n_hist; i++)
        hist += k->hist[i].len;
    cg_jsonw w;
    size_t spare_cap;
    char *spare = cg_wsconn_spare(&k->client.conn, &spare_cap);
    cg_jsonw_init_in(&w, CG_WS_PRE, k->last_head + k->last_head / 4 + hist, spare, spare_cap);
    CG_JSONW_LIT(&w, "{\"type\":\"message\"");
    cg_jsonw_member_str(&w, "id", m->id);
    cg_jsonw_member_str(&w, "user", m->user);
    cg_jsonw_member_str(&w, "room", m->room);
    cg_jsonw_member_str(&w, "text", m->text);
    cg_jsonw_member_str(&w, "enriched", m->enriched);
    cg_jsonw_member_str(&w, "route", m->route);
    cg_jsonw_member_str(&w, "service", m->service);
    cg_jsonw_member_json(&w, "params", m->params, "{}");
    cg_jsonw_member_json(&w, "awaiting", m->awaiting, "null");
    cg_jsonw_member_json(&w, "resolution", m->resolution, "null");
    cg_jsonw_member_json(&w, "soft_context", m->soft, "null");
    cg_jsonw_member_json(&w, "last_tool_result", m->tool_result, "null");
    cg_jsonw_member_json(&w, "profile", m->profile, "{}");
    cg_jsonw_member_json(&w, "rules", m->rules, "[]");
    cg_jsonw_member_json(&w, "annotations", m->annotations, "{}");
    k->last_head = w.used - CG_WS_PRE;
    CG_JSONW_LIT(&w, ",\"history\":[");
    for (size_t i = 0; i < k->n_hist; i++) {
        if (i)
            CG_JSONW_LIT(&w, ",");
        cg_jsonw_raw(&w, k->hist[i].text, k->hist[i].len);
    }
    CG_JSONW_LIT(&w, "]}");
    w.failed |= !m->id || !m->user || !m->room || !m->text || !m->route;
    *cap = w.cap;
    return cg_jsonw_end(&w, len);
}

/* The message frame for the call's attempt on k: written from the message at the first
 * attempt (kept for a retry when the upstream can retry), the kept one's copy after. */
static int queue_message(ws_conn *k, cg_upstream_call *c)
{
    size_t len = 0, cap = 0;
    char *frame;
    if (c->m) {
        frame = message_frame(k, c->m, &len, &cap);
        const cg_upstream_config *cfg = c->core.up->cfg;
        if (frame && !c->frame && c->core.replicas->n > 1 && cfg->max_attempts > 1) {
            c->frame = cg_malloc(CG_WS_PRE + len);
            memcpy(c->frame + CG_WS_PRE, frame + CG_WS_PRE, len);
            c->frame_len = len;
        }
    } else if (c->frame) {
        len = c->frame_len;
        frame = cg_malloc(CG_WS_PRE + len);
        memcpy(frame + CG_WS_PRE, c->frame + CG_WS_PRE, len);
    } else {
        return -1;
    }
    return queue_frame(k, frame, len, cap);
}

/* ---- the call's side of the core (cg_call_kind) ------------------------------------------ */

/* The message on replica r: on the session's connection when it is there (on r: the core
 * was given its replica), else on a new one. */
static int ws_attempt(cg_call *core, int r)
{
    cg_upstream_call *c = (cg_upstream_call *)core;
    ws_state *st = core->up->state;
    ws_conn *k = *c->slot;
    if (!k && !(k = conn_new(core->up, c->slot, r)))
        return -1;
    if (queue_message(k, c) < 0) { /* an app that reads nothing (MAX_PENDING): a new connection next */
        conn_kill(k);
        return -1;
    }
    cg_wsconn_soon(&k->client.conn, 0); /* the message goes when the event that made it ends (core/flush.h) */
    k->call = c;
    c->conn = k;
    st->replicas.r[r].busy++;
    core->clock = &k->clock;
    conn_pause(k, core->paused);
    cg_call_arm(core, conn_open(k) ? CG_CALL_FIRST_BYTE : CG_CALL_CONNECT);
    return 0;
}

/*
 * The attempt leaves its connection. A connection that failed the call before its first
 * byte (a retry follows) or did not connect in time is closed; an app that is alive but
 * slow, or a cancel, gets {"type":"cancel"} and keeps the connection.
 */
static void ws_stop(cg_call *core, cg_call_stop why)
{
    cg_upstream_call *c = (cg_upstream_call *)core;
    ws_conn *k = c->conn;
    if (!k)
        return;
    call_detach(c);
    if (why == CG_CALL_STOP_RETRY || (why == CG_CALL_STOP_TIMEOUT && core->phase == CG_CALL_CONNECT))
        conn_kill(k);
    else if ((why == CG_CALL_STOP_TIMEOUT || why == CG_CALL_STOP_CANCEL) && !k->dead)
        queue_cancel(k, c->id);
}

static void ws_pause_reading(cg_call *core, int paused)
{
    cg_upstream_call *c = (cg_upstream_call *)core;
    if (c->conn)
        conn_pause(c->conn, paused);
}

static void ws_release(cg_call *core)
{
    call_free((cg_upstream_call *)core);
}

static const cg_call_kind ws_kind = {
    .attempt = ws_attempt,
    .stop = ws_stop,
    .pause = ws_pause_reading,
    .release = ws_release,
    .idle_words = "went quiet for",
};

/* ---- the upstream ------------------------------------------------------------------------ */

static void ws_close(cg_upstream *up)
{
    ws_state *st = up->state;
    if (!st)
        return;
    up->state = NULL;
    for (int i = 0; i < st->replicas.n; i++)
        cg_upstream_config_free(&st->at[i]);
    free(st);
}

/* Where the replicas are (each URL parsed as the config did), made at the first call; NULL
 * when a URL cannot be read again (the config checked them: out of memory). */
static ws_state *state_of(cg_upstream *up)
{
    if (up->state)
        return up->state;
    const cg_upstream_config *cfg = up->cfg;
    ws_state *st = cg_calloc(1, sizeof(*st));
    up->state = st;
    st->replicas.n = cfg->n_replicas ? cfg->n_replicas : 1;
    for (int i = 0; i < st->replicas.n; i++) {
        char err[256];
        if (cg_config_parse_upstream_url(&st->at[i], cfg->n_replicas ? cfg->replicas[i] : cfg->url, err,
                                         sizeof(err)) < 0) {
            cg_warn("upstream '%s': replica %d: %s", cfg->name, i, err);
            ws_close(up);
            return NULL;
        }
    }
    return st;
}

static int ws_start(cg_upstream *up, void **conn_slot, const cg_upstream_message *m, const cg_upstream_events *ev,
                    void *ctx, cg_upstream_call **out)
{
    ws_state *st = state_of(up);
    if (!st)
        return -1;
    ws_conn *k = *conn_slot;
    cg_upstream_call *c = cg_calloc(1, sizeof(*c));
    cg_call_init(&c->core, up, &ws_kind, &st->replicas, ev, ctx, m->user, m->room);
    c->slot = conn_slot;
    c->id = cg_strdup(m->id);
    c->m = m;
    int rc = cg_call_start(&c->core, k ? k->replica : -1); /* a kept connection keeps its replica */
    c->m = NULL;
    if (rc < 0) {
        call_free(c);
        return -1;
    }
    *out = c;
    return 0;
}

static void ws_cancel(cg_upstream_call *c)
{
    cg_call_cancel(&c->core);
}

static void ws_pause(cg_upstream_call *c, int paused)
{
    cg_call_pause(&c->core, paused);
}

static void ws_answered(const cg_upstream_call *c, int *replica, int *attempts)
{
    cg_call_answered(&c->core, replica, attempts);
}

static void ws_close_conn(void *conn)
{
    ws_conn *k = conn;
    k->slot = NULL; /* the session is going away with its slot */
    if (k->call) { /* no callback comes: the session is gone */
        cg_upstream_call *c = k->call;
        call_detach(c);
        call_free(c);
    }
    conn_kill(k);
}

const cg_upstream_ops cg_upstream_ws_ops = {
    .kind = "ws",
    .start = ws_start,
    .cancel = ws_cancel,
    .pause = ws_pause,
    .answered = ws_answered,
    .close_conn = ws_close_conn,
    .close = ws_close,
};
