/*
 * ws.c: a chat app's own WebSocket server (docs/protocol.md, "Upstreams").
 *
 * One upstream connection per client connection, opened on that client's first message to
 * this upstream and closed with the client. Each message is sent as a chatgate message
 * frame; the app answers with delta/done/error frames carrying the same id, and frames of
 * any other id (a cancelled message's tail, say) are dropped. Cancel sends the app
 * {"type":"cancel","id":...}. If the app closes or cannot be reached, the message in flight
 * gets upstream_unavailable and the next message opens a new connection. An app's error
 * frame gives upstream_error with its message, and its "code" as upstream_code.
 *
 * Pausing (the client reads slowly) stops reading from the app; it belongs to the call in
 * flight, and the first-byte and idle deadlines do not run while it lasts.
 *
 * A connection (ws_conn) holds a reference for its timer and one for its wsi, and is freed
 * when both are gone. The session's slot points at the live connection; a connection that
 * dies on its own clears the slot.
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
#include "chatgate/core/wsrx.h"
#include "chatgate/upstream/upstream.h"

#define MAX_APP_FRAME (1 << 20) /* one frame from the app */
_Static_assert(LWS_PRE >= CG_NET_CLIENT_HEAD, "a frame's header is written into its LWS_PRE headroom");
#define MAX_PENDING 16          /* frames waiting to go to the app */

typedef enum { PHASE_CONNECT, PHASE_FIRST_BYTE, PHASE_IDLE, PHASE_NONE } conn_phase;

typedef struct pending {
    struct pending *next;
    char *frame; /* LWS_PRE bytes of headroom, then the JSON text (core/jsonout.h) */
    size_t len;
    size_t cap; /* the buffer's size, for the connection's spare (0: not to be kept) */
} pending;

/* One history item as JSON text, kept for the next message (see hist_refresh). */
typedef struct hist_text {
    json_t *item; /* a reference: the pointer cannot be reused for another item while kept */
    char *text;
    size_t len;
} hist_text;

typedef struct ws_conn {
    cg_upstream *up;
    void **slot; /* the session's pointer to this connection; NULL once detached */
    int refs;
    int dead; /* closed, failed or detached: takes no more calls */
    cg_resolve *resolve;
    struct lws *wsi;
    int open;
    uv_timer_t timer;
    uint64_t deadline; /* uv_now() by which the phase's deadline is due; 0: none runs */
    conn_phase phase;
    cg_upstream_call *call; /* the message in flight */
    pending *out_head, *out_tail;
    int n_out;
    cg_flush_item flush; /* registered while frames wait for the end of the iteration */
    size_t last_head;    /* of the last message frame without its history: the next one's estimate */
    cg_wsrx rx; /* an app frame in pieces (core/wsrx.h) */
    hist_text *hist; /* the last message's history as text, n_hist items (at most history_n) */
    size_t n_hist;
    char *spare; /* the last message frame's buffer, written: the next one's (cg_jsonw_init_in) */
    size_t spare_cap;
    int paused;
    char close_reason[128];
    int close_sent;
} ws_conn;

struct cg_upstream_call {
    ws_conn *conn;
    const cg_upstream_events *ev;
    void *ctx;
    char *id;           /* the message's, whole: frames are matched on it */
    size_t reply_bytes; /* of delta text relayed */
};

static void call_free(cg_upstream_call *c)
{
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
    while (k->out_head) {
        pending *p = k->out_head;
        k->out_head = p->next;
        free(p->frame);
        free(p);
    }
    free(k->spare);
    cg_wsrx_done(&k->rx);
    free(k);
}

static void timer_closed(uv_handle_t *h)
{
    conn_unref(h->data);
}

static void on_timeout(uv_timer_t *t);

/*
 * Starts the phase's deadline afresh; while paused only the connect deadline runs. Only
 * the deadline moves: the timer is set again only when it would fire after it, and
 * on_timeout sets it again for the rest of a deadline that moved on meanwhile (the way
 * nginx keeps its timers). Moving the timer in libuv's heap at every frame of every reply,
 * and stopping it at every reply's end, was a fiftieth of a turn with no rules (issue 12).
 */
static void arm(ws_conn *k, conn_phase phase)
{
    const cg_upstream_config *cfg = k->up->cfg;
    k->phase = phase;
    if (k->dead)
        return;
    if (phase == PHASE_NONE || (k->paused && phase != PHASE_CONNECT)) {
        k->deadline = 0; /* the timer may still run: when it fires, nothing is due */
        return;
    }
    uint64_t ms = (uint64_t)(phase == PHASE_CONNECT      ? cfg->connect_timeout_ms
                             : phase == PHASE_FIRST_BYTE ? cfg->first_byte_timeout_ms
                                                         : cfg->idle_timeout_ms);
    k->deadline = uv_now(k->timer.loop) + ms;
    if (!uv_is_active((uv_handle_t *)&k->timer) || uv_timer_get_due_in(&k->timer) > ms)
        uv_timer_start(&k->timer, on_timeout, ms, 0);
}

/* Reading from the app stops while paused; the first-byte and idle deadlines with it. */
static void conn_pause(ws_conn *k, int paused)
{
    if (k->paused == paused)
        return;
    k->paused = paused;
    if (k->wsi && k->open)
        lws_rx_flow_control(k->wsi, !paused);
    if (k->phase != PHASE_CONNECT)
        arm(k, k->phase);
}

/* The call in flight is over: the connection waits for the next, unpaused (the pause was
 * the call's; a cancelled reply's tail is read and dropped). */
static void call_detach(ws_conn *k)
{
    k->call = NULL;
    arm(k, PHASE_NONE);
    conn_pause(k, 0);
}

/* Ends the call in flight with an error; the connection itself is left as it is. error is
 * the app's own error detail ({"code": ...}, borrowed) or NULL. */
static void call_fail(ws_conn *k, int err, json_t *error, const char *fmt, ...) __attribute__((format(printf, 4, 5)));
static void call_fail(ws_conn *k, int err, json_t *error, const char *fmt, ...)
{
    cg_upstream_call *c = k->call;
    if (!c)
        return;
    call_detach(k);
    const cg_upstream_events *ev = c->ev;
    void *ctx = c->ctx;
    call_free(c);
    va_list ap;
    va_start(ap, fmt);
    cg_upstream_fail(ev, ctx, k->up->cfg, err, 0, error, fmt, ap);
    va_end(ap);
}

/* {"type":"cancel","id":id} behind lws's headroom, written as the message frame is; NULL
 * when it cannot be built */
static char *cancel_frame(const char *id, size_t *len)
{
    cg_jsonw w;
    cg_jsonw_init(&w, LWS_PRE, 64);
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
    if (k->slot) {
        *k->slot = NULL;
        k->slot = NULL;
    }
    if (k->resolve) {
        cg_resolve_abandon(k->resolve);
        k->resolve = NULL;
    }
    cg_flush_cancel(&k->flush);
    uv_close((uv_handle_t *)&k->timer, timer_closed);
    if (k->wsi && k->open) /* a close frame (1001) first, at the next writable */
        lws_callback_on_writable(k->wsi);
    else if (k->wsi)
        cg_net_kill_async(k->up->net, k->wsi, PENDING_TIMEOUT_KILLED_BY_PARENT);
}

/* The connection is dead: says goodbye with a close frame, then goes. */
static int write_close(ws_conn *k, struct lws *wsi)
{
    if (k->close_sent)
        return -1;
    cg_net_write_close(wsi, 1001, "going away");
    k->close_sent = 1;
    lws_set_timeout(wsi, PENDING_TIMEOUT_CLOSE_SEND, 1);
    lws_callback_on_writable(wsi);
    return 0;
}

static void conn_flush(cg_flush_item *item);

/* Queues frame (len bytes after LWS_PRE, in a buffer of cap bytes: 0 when it is not to be
 * kept as the connection's spare); takes it. NULL (it could not be built): -1. */
static int queue_frame(ws_conn *k, char *frame, size_t len, size_t cap)
{
    if (!frame || k->n_out >= MAX_PENDING) {
        free(frame);
        return -1;
    }
    pending *p = cg_calloc(1, sizeof(*p));
    p->frame = frame;
    p->len = len;
    p->cap = cap;
    if (k->out_tail)
        k->out_tail->next = p;
    else
        k->out_head = p;
    k->out_tail = p;
    k->n_out++;
    if (k->open && k->wsi)
        cg_flush_request(k->up->net->flush, &k->flush, conn_flush);
    return 0;
}

/* Queues {"type":"cancel","id":id} for the app. */
static void queue_cancel(ws_conn *k, const char *id)
{
    size_t len = 0;
    char *frame = cancel_frame(id, &len);
    queue_frame(k, frame, len, 0);
}

static void on_timeout(uv_timer_t *t)
{
    ws_conn *k = t->data;
    const cg_upstream_config *cfg = k->up->cfg;
    uint64_t now = uv_now(t->loop);
    if (!k->deadline)
        return; /* none runs now (arm) */
    if (now < k->deadline) { /* it moved on since the timer was set */
        uv_timer_start(t, on_timeout, k->deadline - now, 0);
        return;
    }
    k->deadline = 0;
    if (k->phase == PHASE_CONNECT) {
        call_fail(k, CG_E_UPSTREAM_TIMEOUT, NULL, "did not connect within %d ms (connect_timeout_ms)",
                  cfg->connect_timeout_ms);
        conn_kill(k);
        return;
    }
    /* The app is alive but slow: tell it to stop this message, keep the connection. */
    if (k->call)
        queue_cancel(k, k->call->id);
    if (k->phase == PHASE_FIRST_BYTE)
        call_fail(k, CG_E_UPSTREAM_TIMEOUT, NULL, "sent nothing within %d ms (first_byte_timeout_ms)",
                  cfg->first_byte_timeout_ms);
    else
        call_fail(k, CG_E_UPSTREAM_TIMEOUT, NULL, "went quiet for %d ms (idle_timeout_ms)", cfg->idle_timeout_ms);
}

/* ---- frames from the app -------------------------------------------------------------- */

/* A delta's text (len 0: none) for the message in flight. */
static void app_delta(ws_conn *k, cg_upstream_call *c, const char *text, size_t len)
{
    arm(k, PHASE_IDLE);
    if (len) {
        c->reply_bytes += len;
        c->ev->on_delta(c->ctx, text, len);
    }
}

/* The message in flight is done; usage and state are borrowed (NULL: none). */
static void app_done(ws_conn *k, cg_upstream_call *c, const char *text, size_t len, json_t *usage, json_t *state)
{
    call_detach(k);
    const cg_upstream_events *ev = c->ev;
    void *ctx = c->ctx;
    /* A done with text but no deltas before it: the text is the reply. */
    if (!c->reply_bytes && len)
        ev->on_delta(ctx, text, len);
    call_free(c);
    ev->on_done(ctx, usage, state);
}

/*
 * The frames of every reply, a delta or a done of "type", "id" and "text" only, read without
 * a tree (core/jsonflat.h). Returns 1 when the frame was one and has been dealt with, 0 when
 * it is left to jansson (any other frame, and any frame the flat reader does not read).
 */
static int on_plain_frame(ws_conn *k, cg_upstream_call *c, const char *buf, size_t len)
{
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
    size_t text_len = text && text->kind == CG_JSONFLAT_STRING ? text->len : 0;
    if (delta)
        app_delta(k, c, text_len ? text->str : NULL, text_len);
    else
        app_done(k, c, text_len ? text->str : NULL, text_len, NULL, NULL);
out:
    cg_jsonflat_free(&f);
    return done;
}

static void on_app_frame(ws_conn *k, const char *buf, size_t len)
{
    cg_upstream_call *c = k->call;
    if (!c)
        return; /* nothing in flight: a cancelled message's tail */
    if (on_plain_frame(k, c, buf, len))
        return;
    json_error_t jerr;
    json_t *o = json_loadb(buf, len, JSON_ALLOW_NUL, &jerr); /* "\u0000" is valid JSON */
    json_t *id = json_object_get(o, "id");
    json_t *type = json_object_get(o, "type");
    if (!json_is_object(o) || !json_is_string(type)) {
        json_decref(o);
        call_fail(k, CG_E_UPSTREAM_ERROR, NULL, "sent a frame that is not a chatgate JSON frame: %.*s",
                  (int)(len < 80 ? len : 80), buf);
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
        app_delta(k, c, json_string_value(text), text_len);
    } else if (strcmp(t, "done") == 0) {
        json_t *usage = json_object_get(o, "usage");
        app_done(k, c, json_string_value(text), text_len, json_is_object(usage) ? usage : NULL,
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
        if (c->reply_bytes)
            call_fail(k, CG_E_UPSTREAM_ERROR, error, "failed mid-reply, after %zu bytes of reply "
                      "text: %.300s", c->reply_bytes, what);
        else
            call_fail(k, CG_E_UPSTREAM_ERROR, error, "answered with an error: %.300s", what);
        json_decref(error);
    }
    json_decref(o);
}

static void on_receive(ws_conn *k, struct lws *wsi, const char *in, size_t len)
{
    const char *msg;
    size_t msg_len;
    if (!cg_wsrx_feed(&k->rx, lws_is_first_fragment(wsi), lws_is_final_fragment(wsi), in, len, MAX_APP_FRAME, &msg,
                      &msg_len))
        return;
    if (lws_frame_is_binary(wsi))
        ; /* not ours: ignored */
    else if (!msg)
        call_fail(k, CG_E_UPSTREAM_ERROR, NULL, "sent a frame over %d bytes", MAX_APP_FRAME);
    else
        on_app_frame(k, msg, msg_len);
    cg_wsrx_done(&k->rx);
}

/* ---- the connection ------------------------------------------------------------------- */

static void wsi_gone(struct lws *wsi, ws_conn *k)
{
    lws_set_opaque_user_data(wsi, NULL);
    k->wsi = NULL;
    k->open = 0;
    conn_unref(k);
}

static int write_one(ws_conn *k, struct lws *wsi)
{
    pending *p = k->out_head;
    if (!p)
        return 0;
    k->out_head = p->next;
    if (!k->out_head)
        k->out_tail = NULL;
    k->n_out--;
    /* the frame is made here, written as bytes (net.h: no read() of a key per frame) */
    unsigned char *payload = (unsigned char *)p->frame + LWS_PRE;
    size_t head = cg_net_client_frame(payload, p->len, 0), len = head + p->len;
    int n = head ? lws_write(wsi, payload - head, len, LWS_WRITE_HTTP) : -1;
    if (!k->spare && p->cap && p->cap <= CG_JSONW_KEEP_MAX) { /* lws has the bytes (or buffered them) */
        k->spare = p->frame;
        k->spare_cap = p->cap;
    } else {
        free(p->frame);
    }
    free(p);
    return n < (int)len ? -1 : 0;
}

/* Writes queued frames while the socket takes them; the rest waits for the writable
 * callback (core/flush.h). Returns -1 when the socket failed. */
static int write_queue(ws_conn *k, struct lws *wsi)
{
    while (k->out_head && !lws_partial_buffered(wsi))
        if (write_one(k, wsi) < 0)
            return -1;
    if (k->out_head)
        lws_callback_on_writable(wsi);
    return 0;
}

static void conn_flush(cg_flush_item *item)
{
    ws_conn *k = (ws_conn *)((char *)item - offsetof(ws_conn, flush));
    if (!k->dead && k->open && k->wsi && write_queue(k, k->wsi) < 0) {
        call_fail(k, CG_E_UPSTREAM_UNAVAILABLE, NULL, "connection was lost while sending");
        conn_kill(k);
    }
}

int cg_upstream_ws_callback(struct lws *wsi, enum lws_callback_reasons reason, void *user, void *in, size_t len)
{
    ws_conn *k = lws_get_opaque_user_data(wsi);
    if (!k)
        return lws_callback_http_dummy(wsi, reason, user, in, len);
    switch (reason) {
    case LWS_CALLBACK_CLIENT_APPEND_HANDSHAKE_HEADER: /* upstreams.NAME.headers */
        if (cg_upstream_append_headers(wsi, &k->up->cfg->headers, NULL, (unsigned char **)in,
                                       *(unsigned char **)in + len) == 0)
            return 0;
        cg_warn("upstream '%s': its configured headers do not fit lws's handshake buffer", k->up->cfg->name);
        return -1;
    case LWS_CALLBACK_CLIENT_ESTABLISHED:
        if (k->dead)
            return -1;
        k->open = 1;
        arm(k, k->call ? PHASE_FIRST_BYTE : PHASE_NONE);
        if (k->paused)
            lws_rx_flow_control(wsi, 0);
        lws_callback_on_writable(wsi);
        return 0;
    case LWS_CALLBACK_CLIENT_WRITEABLE:
        if (k->dead)
            return write_close(k, wsi);
        return write_queue(k, wsi);
    case LWS_CALLBACK_CLIENT_RECEIVE: {
        if (k->dead)
            return -1;
        cg_flusher *f = k->up->net->flush;
        on_receive(k, wsi, in, len);
        cg_flush_event_end(f, wsi); /* a reply that is done goes to its client now */
        return 0;
    }
    case LWS_CALLBACK_WS_PEER_INITIATED_CLOSE:
        if (len >= 2) {
            const unsigned char *b = in;
            snprintf(k->close_reason, sizeof(k->close_reason), " (close code %d%s%.*s)", b[0] << 8 | b[1],
                     len > 2 ? ": " : "", (int)(len > 100 ? 98 : len - 2), (const char *)in + 2);
        }
        return 0;
    case LWS_CALLBACK_CLIENT_CONNECTION_ERROR: {
        const char *tls = cg_net_tls_refusal(wsi);
        if (tls)
            call_fail(k, CG_E_UPSTREAM_UNAVAILABLE, NULL, "could not be reached: its TLS certificate was refused: %s",
                      tls);
        else
            call_fail(k, CG_E_UPSTREAM_UNAVAILABLE, NULL, "could not be reached: %s",
                      in ? (const char *)in : "connection failed");
        conn_kill(k);
        wsi_gone(wsi, k);
        return 0;
    }
    case LWS_CALLBACK_CLIENT_CLOSED:
        if (k->call && k->call->reply_bytes)
            call_fail(k, CG_E_UPSTREAM_UNAVAILABLE, NULL, "closed the connection mid-reply, after %zu bytes of "
                      "reply text%s", k->call->reply_bytes, k->close_reason);
        else
            call_fail(k, CG_E_UPSTREAM_UNAVAILABLE, NULL, "closed the connection before any reply text%s",
                      k->close_reason);
        conn_kill(k);
        wsi_gone(wsi, k);
        return 0;
    case LWS_CALLBACK_WSI_DESTROY:
        call_fail(k, CG_E_UPSTREAM_UNAVAILABLE, NULL, "connection was lost");
        conn_kill(k);
        wsi_gone(wsi, k);
        return 0;
    default:
        return lws_callback_http_dummy(wsi, reason, user, in, len);
    }
}

static void on_resolved(void *data, const char *address, const char *err)
{
    ws_conn *k = data;
    k->resolve = NULL;
    if (!address) {
        call_fail(k, CG_E_UPSTREAM_UNAVAILABLE, NULL, "%s ('%s')", err, k->up->cfg->host);
        conn_kill(k);
        return;
    }
    const cg_upstream_config *cfg = k->up->cfg;
    cg_connect_spec spec = {.host = cfg->authority, .port = cfg->port, .tls = cfg->tls, .address = address,
                            .path = cfg->path, .local_protocol = CG_LWS_PROTOCOL_WS};
    k->refs++; /* the wsi's; dropped by wsi_gone */
    if (!cg_net_connect(k->up->net, &spec, k, &k->wsi) && k->refs > 1) {
        call_fail(k, CG_E_UPSTREAM_UNAVAILABLE, NULL, "could not be reached at %s:%d", address, k->up->cfg->port);
        conn_kill(k);
        conn_unref(k);
    }
}

static ws_conn *conn_new(cg_upstream *up, void **slot)
{
    ws_conn *k = cg_calloc(1, sizeof(*k));
    k->up = up;
    k->slot = slot;
    k->refs = 1; /* the timer's */
    uv_timer_init(up->net->loop, &k->timer);
    k->timer.data = k;
    arm(k, PHASE_CONNECT);
    *slot = k;
    k->resolve = cg_resolve_start(up->net->loop, up->cfg->host, on_resolved, k);
    if (!k->resolve) {
        conn_kill(k);
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
    cg_jsonw_init_in(&w, LWS_PRE, k->last_head + k->last_head / 4 + hist, k->spare, k->spare_cap);
    k->spare = NULL;
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
    cg_jsonw_member_json(&w, "rules", m->rules, "[]");
    cg_jsonw_member_json(&w, "annotations", m->annotations, "{}");
    k->last_head = w.used - LWS_PRE;
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

static int ws_start(cg_upstream *up, void **conn_slot, const cg_upstream_message *m, const cg_upstream_events *ev,
                    void *ctx, cg_upstream_call **out)
{
    ws_conn *k = *conn_slot;
    if (!k && !(k = conn_new(up, conn_slot)))
        return -1;
    cg_upstream_call *c = cg_calloc(1, sizeof(*c));
    c->conn = k;
    c->ev = ev;
    c->ctx = ctx;
    c->id = cg_strdup(m->id);
    size_t len = 0;
    size_t cap = 0;
    char *frame = message_frame(k, m, &len, &cap);
    if (queue_frame(k, frame, len, cap) < 0) {
        call_free(c);
        return -1;
    }
    if (k->open && k->wsi) /* the message goes when the event that made it ends (core/flush.h) */
        cg_flush_request_event(k->up->net->flush, &k->flush, conn_flush, k->wsi, 0);
    k->call = c;
    conn_pause(k, 0); /* a new call starts unpaused; the session pauses it if it must */
    if (k->open)
        arm(k, PHASE_FIRST_BYTE);
    *out = c;
    return 0;
}

static void ws_cancel(cg_upstream_call *c)
{
    ws_conn *k = c->conn;
    if (k->call == c) {
        call_detach(k);
        if (!k->dead)
            queue_cancel(k, c->id);
    }
    call_free(c);
}

static void ws_pause(cg_upstream_call *c, int paused)
{
    ws_conn *k = c->conn;
    if (k->call == c)
        conn_pause(k, !!paused);
}

static void ws_close_conn(void *conn)
{
    ws_conn *k = conn;
    k->slot = NULL; /* the session is going away with its slot */
    if (k->call) {
        call_free(k->call);
        k->call = NULL;
    }
    conn_kill(k);
}

const cg_upstream_ops cg_upstream_ws_ops = {
    .kind = "ws",
    .start = ws_start,
    .cancel = ws_cancel,
    .pause = ws_pause,
    .close_conn = ws_close_conn,
};
