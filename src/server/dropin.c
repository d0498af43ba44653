/*
 * dropin.c: drop-in mode (see dropin.h).
 *
 * Each client connection has a cg_dropin with two bounded frame queues:
 *   to_app:    client frames in arrival order. A chat frame enters "not ready" and waits
 *              for its dialog to load and the pipeline to run; the frames behind it wait
 *              too, so the app sees them in the order the client sent them.
 *   to_client: app frames in arrival order (and a close frame at the end, when the app
 *              closed), written one per writable callback.
 * Past CG_DROPIN_HIGH bytes a queue pauses the side that fills it (lws rx flow control).
 *
 * One chat turn at a time: the turn in flight (its dialog, its id, the reply text read so
 * far) ends at the app's end or cancelled marker, or when the next chat frame comes, and is
 * then saved; it holds its dialog's lock (admission.h) from the load to then, so a chat frame
 * of another connection for the same dialog waits, and the frames behind it. The mapping
 * itself (which frame is what, the forwarded and relayed frames) is dropin_map.c.
 * Lifetime: the struct holds a reference for the client and one for the app connection, and
 * is freed when both are gone.
 */
#define _GNU_SOURCE /* asprintf */
#include <openssl/evp.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "chatgate/core/rate.h"
#include "chatgate/config/dropin_config.h"
#include "chatgate/core/utf8.h"
#include "chatgate/store/lock.h"
#include "chatgate/server/dropin.h"
#include "chatgate/proto/dropin_map.h"
#include "chatgate/core/jsonptr.h"
#include "chatgate/core/error.h"
#include "chatgate/server/gateway.h"
#include "chatgate/proto/identity.h"
#include "chatgate/core/log.h"
#include "chatgate/dialog/pipeline.h"
#include "chatgate/proto/protocol.h"
#include "chatgate/server/session.h"

#define CG_DROPIN_HIGH (256 * 1024)
#define CG_DROPIN_MAX_REPLY (1 << 20)

typedef struct frame {
    struct frame *next;
    unsigned char *data; /* LWS_PRE headroom, then len bytes */
    size_t len;
    int binary;
    int ready; /* a chat frame is ready once the pipeline has run */
    int close; /* to_client: a close frame (2 bytes of code, then the reason) */
} frame;

typedef struct frame_queue {
    frame *head, *tail;
    size_t bytes;
} frame_queue;

/* The chat message whose reply is in flight. */
typedef struct turn {
    int active;
    char *id;   /* "" when the message had none */
    char *room;
    char *text;
    char *enriched;
    cg_dialog dialog;
    char *reply;
    size_t reply_len;
    int cancelled;  /* the user cancelled: relaying stops when the app has no cancel frame */
    int64_t arrived;
} turn;

/* A chat frame waiting for its dialog. */
typedef struct pending_chat {
    struct pending_chat *next;
    frame *slot; /* its place in to_app */
    cg_dropin_chat chat;
    int64_t arrived;
} pending_chat;

struct cg_dropin {
    cg_gateway *gw;
    json_t *cfg; /* the "dropin" object (borrowed from the config) */
    struct lws *client;
    struct lws *app;
    int refs;
    int app_open;
    int client_gone;
    char user[CG_MAX_USER + 1];
    char *path;        /* app base path + the client's path and query */
    char *subprotocol; /* the client's, forwarded */
    char *headers[CG_DROPIN_MAX_FORWARD_HEADERS][2];
    int n_headers;
    cg_resolve *resolve;
    frame_queue to_app, to_client;
    int client_paused, app_paused;
    int closing; /* the close frame was written; the connection goes at the next writable */
    pending_chat *chats, *chats_tail;
    long n_chats;       /* in chats: at most queue_limit */
    cg_dialog_lock_waiter lock; /* the dialog's lock: waited for by chats (the head), held from
                                 * its load to the end of its turn (admission.h) */
    cg_store_req *load; /* the dialog of chats (the head) is loading */
    uv_timer_t turn_timer; /* a turn whose app says nothing for turn_timeout_ms ends there */
    cg_rate rate;       /* rate_limit, as for chatgate.v1 clients */
    int refusing;       /* chat messages over a limit are being refused (logged once) */
    turn t;
    char close_reason[124];
    int close_code;
    int app_failed; /* CLIENT_CONNECTION_ERROR came */
    int app_close_sent;
    char origin[256]; /* the client's Origin header, passed on */
    char *suppress_id; /* a cancelled reply not relayed (no cancel frame) */
    int suppressing;
    char *app_rx;   /* the app frame being reassembled */
    size_t app_rx_len, app_rx_cap;
    int app_rx_too_large;
};

/* ---- queues ---------------------------------------------------------------------------- */

static frame *frame_new(const void *data, size_t len, int binary)
{
    frame *f = calloc(1, sizeof(*f));
    if (!f || !(f->data = malloc(LWS_PRE + len + 1)))
        abort();
    if (len)
        memcpy(f->data + LWS_PRE, data, len);
    f->len = len;
    f->binary = binary;
    f->ready = 1;
    return f;
}

static void frame_free(frame *f)
{
    free(f->data);
    free(f);
}

static void queue_push(frame_queue *q, frame *f)
{
    if (q->tail)
        q->tail->next = f;
    else
        q->head = f;
    q->tail = f;
    q->bytes += f->len;
}

static frame *queue_pop(frame_queue *q)
{
    frame *f = q->head;
    if (!f)
        return NULL;
    q->head = f->next;
    if (!q->head)
        q->tail = NULL;
    q->bytes -= f->len;
    f->next = NULL;
    return f;
}

static void queue_clear(frame_queue *q)
{
    frame *f;
    while ((f = queue_pop(q)))
        frame_free(f);
}

/* Pauses the side that fills a queue past the mark; resumes under a quarter of it. */
static void dropin_flow(cg_dropin *d)
{
    int pause_app = d->app_paused ? d->to_client.bytes > CG_DROPIN_HIGH / 4 : d->to_client.bytes > CG_DROPIN_HIGH;
    if (pause_app != d->app_paused && d->app && d->app_open) {
        d->app_paused = pause_app;
        lws_rx_flow_control(d->app, !pause_app);
    }
    int pause_client = d->client_paused ? d->to_app.bytes > CG_DROPIN_HIGH / 4 : d->to_app.bytes > CG_DROPIN_HIGH;
    if (pause_client != d->client_paused && !d->client_gone) {
        d->client_paused = pause_client;
        lws_rx_flow_control(d->client, !pause_client);
    }
}

static void to_client(cg_dropin *d, frame *f)
{
    if (d->client_gone) {
        frame_free(f);
        return;
    }
    queue_push(&d->to_client, f);
    lws_callback_on_writable(d->client);
    dropin_flow(d);
}

static void to_app(cg_dropin *d, frame *f)
{
    queue_push(&d->to_app, f);
    if (d->app && d->app_open)
        lws_callback_on_writable(d->app);
    dropin_flow(d);
}

/* Closes the client with code and reason once what is queued for it is written; the reason
 * is cut to the 123 bytes a close frame holds, on a UTF-8 character boundary. */
static void close_client(cg_dropin *d, int code, const char *reason)
{
    unsigned char payload[2 + 123];
    size_t rl = cg_utf8_boundary(reason, strlen(reason) > 123 ? 123 : strlen(reason));
    payload[0] = (unsigned char)(code >> 8);
    payload[1] = (unsigned char)(code & 0xff);
    memcpy(payload + 2, reason, rl);
    frame *f = frame_new(payload, 2 + rl, 0);
    f->close = 1;
    to_client(d, f);
}

void cg_dropin_client_refuse(cg_dropin *d, int code, const char *reason)
{
    close_client(d, code, reason);
}

/* ---- lifetime -------------------------------------------------------------------------- */

static void turn_end(cg_dropin *d, int cancelled);
static void on_turn_timer_closed(uv_handle_t *h);

static void pending_free(pending_chat *c)
{
    cg_dropin_chat_clear(&c->chat);
    free(c);
}

static void dropin_unref(cg_dropin *d)
{
    if (--d->refs > 0)
        return;
    queue_clear(&d->to_app);
    queue_clear(&d->to_client);
    while (d->chats) {
        pending_chat *c = d->chats;
        d->chats = c->next;
        pending_free(c);
    }
    for (int i = 0; i < d->n_headers; i++) {
        free(d->headers[i][0]);
        free(d->headers[i][1]);
    }
    free(d->path);
    free(d->subprotocol);
    free(d->app_rx);
    free(d->suppress_id);
    free(d);
}

void cg_dropin_close(cg_dropin *d)
{
    d->client_gone = 1;
    if (d->load) {
        d->gw->store->ops->abandon(d->load);
        d->load = NULL;
    }
    if (d->t.active)
        turn_end(d, 1); /* the client went away mid-reply: saved as cancelled (the lock goes too) */
    cg_dialog_lock_release(d->gw->dialog_locks, &d->lock); /* held for a load, or waited for */
    uv_close((uv_handle_t *)&d->turn_timer, on_turn_timer_closed); /* its reference goes there */
    if (d->resolve) {
        cg_resolve_abandon(d->resolve);
        d->resolve = NULL;
        d->refs--; /* the app connection that will not be */
    }
    if (d->app && d->app_open) /* a close frame (1001, going away), then the connection */
        lws_callback_on_writable(d->app);
    /* still connecting: the close frame goes once the handshake is done (ESTABLISHED) */
    dropin_unref(d); /* the client's reference */
}

/* ---- turns ----------------------------------------------------------------------------- */

/* The turn's end: into the history, saved, and its dialog's lock let go. */
static void turn_end(cg_dropin *d, int cancelled)
{
    turn *t = &d->t;
    if (!t->active)
        return;
    uv_timer_stop(&d->turn_timer);
    cg_gateway *gw = d->gw;
    const cg_lifetimes *lt = &gw->cfg->lifetimes;
    int64_t now = gw->store->now(gw->store->clock_ctx);
    /* a NULL extra (the pack failed) only leaves out the mark */
    json_t *user_extra = t->enriched ? json_pack("{s:s}", "enriched", t->enriched) : NULL;
    cg_dialog_push_history(&t->dialog, "user", t->text, t->arrived, lt, user_extra);
    json_decref(user_extra);
    if (t->reply_len) {
        json_t *extra = cancelled || t->cancelled ? json_pack("{s:b}", "cancelled", 1) : NULL;
        cg_dialog_push_history(&t->dialog, "assistant", t->reply, now, lt, extra);
        json_decref(extra);
    }
    if (!cancelled && !t->cancelled)
        t->dialog.turn_count++;
    t->dialog.last_activity = now;
    gw->store->ops->save(gw->store, d->user, t->room, &t->dialog, NULL, NULL);
    gw->inflight_turns--;
    cg_dialog_free(&t->dialog);
    free(t->id);
    free(t->room);
    free(t->text);
    free(t->enriched);
    free(t->reply);
    memset(t, 0, sizeof(*t));
    /* last: the lock may pass to another connection's turn of this dialog at once */
    cg_dialog_lock_release(gw->dialog_locks, &d->lock);
}

/*
 * A turn holds its dialog's lock until the app's end or cancelled marker. An app that never
 * sends one (a mapping without app_frames.end, an app that stalls mid-reply) must not hold
 * the dialog for ever: the turn ends, saved as it stands, after turn_timeout_ms (default
 * 60 s) with no frame of it from the app, and another connection's turn may go.
 */
static void on_turn_timeout(uv_timer_t *timer);
static void process_next_chat(cg_dropin *d);

static void turn_timer_arm(cg_dropin *d)
{
    json_t *v = json_object_get(d->cfg, "turn_timeout_ms");
    uint64_t ms = json_is_integer(v) ? (uint64_t)json_integer_value(v) : 60000;
    uv_timer_start(&d->turn_timer, on_turn_timeout, ms, 0);
}

static void on_turn_timeout(uv_timer_t *timer)
{
    cg_dropin *d = timer->data;
    if (!d->t.active)
        return;
    cg_info("dropin: the app sent nothing of the reply in flight for turn_timeout_ms: the turn ends, its "
            "dialog is free");
    turn_end(d, 0);
    process_next_chat(d);
}

static void on_turn_timer_closed(uv_handle_t *h)
{
    dropin_unref(h->data);
}

/* Writes the ready frames at the head of to_app, in order. */
static void flush_to_app(cg_dropin *d)
{
    if (d->app && d->app_open && d->to_app.head && d->to_app.head->ready)
        lws_callback_on_writable(d->app);
}

/*
 * The user cancelled the reply in flight: send the app the mapping's cancel frame (unless
 * the client's own cancel frame, on its way to the app, already says so), or, when the
 * mapping names none, stop relaying that reply's frames until its end marker.
 */
static void cancel_reply(cg_dropin *d, int client_frame_sent)
{
    if (!d->t.active || d->t.cancelled)
        return;
    d->t.cancelled = 1;
    if (!json_object_get(json_object_get(d->cfg, "app_frames"), "cancel_frame")) {
        free(d->suppress_id);
        d->suppress_id = strdup(d->t.id);
        if (!d->suppress_id)
            abort();
        d->suppressing = 1;
        return;
    }
    if (client_frame_sent)
        return;
    size_t len = 0;
    char *s = cg_dropin_map_cancel_frame(d->cfg, d->t.id, &len);
    if (!s) { /* only when out of memory: the reply goes on */
        cg_warn("dropin: the cancel frame could not be built: the reply in flight goes on");
        return;
    }
    to_app(d, frame_new(s, len, 0));
    free(s);
}

static void process_next_chat(cg_dropin *d);

/* The chatgate object a chat message reaches the app with (DESIGN.md section 6); NULL when it
 * could not be built. */
static json_t *chatgate_object(cg_dropin *d, const pending_chat *c, cg_dialog *dialog, json_t *awaiting_before,
                               const cg_pipeline_result *res)
{
    cg_gateway *gw = d->gw;
    const char *service = dialog->service;
    json_t *params = cg_dialog_params_merged(dialog, service, cg_config_service_defaults(gw->cfg, service));
    json_t *object = json_pack(
        "{s:s, s:s, s:s, s:o, s:o, s:O, s:o, s:O, s:O, s:O, s:O}", "user", d->user, "room", c->chat.room, "route",
        "app", "service", service ? json_string(service) : json_null(), "params", params, "resolution",
        res->resolution ? res->resolution : json_null(), "enriched",
        res->enriched ? json_string(res->enriched) : json_null(), "soft_context",
        dialog->soft ? dialog->soft : json_null(), "awaiting", awaiting_before ? awaiting_before : json_null(),
        "rules", res->rules, "annotations", res->annotations);
    if (object && res->error &&
        json_object_set_new(object, "error", json_pack("{s:s, s:s}", "code", cg_err_code(res->error), "message",
                                                       res->error_message)) < 0)
        cg_warn("dropin: the pipeline's error could not be added to the chatgate object");
    return object;
}

static void on_chat_loaded(void *ctx, cg_dialog *dialog, const cg_store_status *st)
{
    cg_dropin *d = ctx;
    cg_gateway *gw = d->gw;
    d->load = NULL;
    pending_chat *c = d->chats;
    d->chats = c->next;
    if (!d->chats)
        d->chats_tail = NULL;
    d->n_chats--;
    if (st->found)
        gw->metrics.cache_hits++;
    else
        gw->metrics.cache_misses++;

    int64_t now = gw->store->now(gw->store->clock_ctx);
    dialog->message_count++;
    dialog->last_activity = now;
    json_t *awaiting_before = json_incref(dialog->awaiting);
    cg_pipeline_result res;
    cg_pipeline_run(gw->cfg, gw->rules, dialog, c->chat.text, now, &gw->cfg->lifetimes, &res);
    gw->metrics.messages++;
    cg_metrics_count_pipeline(&gw->metrics, &res);
    size_t len = 0;
    char *s = cg_dropin_map_forward(d->cfg, &c->chat, chatgate_object(d, c, dialog, awaiting_before, &res), &len);
    frame *f = c->slot;
    if (s) {
        free(f->data);
        f->data = malloc(LWS_PRE + len);
        if (!f->data)
            abort();
        memcpy(f->data + LWS_PRE, s, len);
        d->to_app.bytes += len - f->len;
        f->len = len;
        free(s);
    } else { /* the frame as the client wrote it is still the app's message */
        cg_warn("dropin: the chatgate object could not be added to a chat message: forwarded as written");
    }
    f->ready = 1;
    json_decref(awaiting_before);

    /* this message's reply is the turn in flight now (it holds the dialog's lock) */
    turn *t = &d->t;
    t->active = 1;
    gw->inflight_turns++; /* a graceful shutdown waits for this reply too */
    t->id = c->chat.id;
    t->room = c->chat.room;
    t->text = c->chat.text;
    c->chat.id = c->chat.room = c->chat.text = NULL;
    t->enriched = res.enriched ? strdup(res.enriched) : NULL;
    t->dialog = *dialog;
    t->arrived = c->arrived;
    turn_timer_arm(d);
    cg_pipeline_result_free(&res);
    pending_free(c);
    flush_to_app(d);
    process_next_chat(d);
}

static void load_head_chat(cg_dropin *d)
{
    cg_store *st = d->gw->store;
    d->load = st->ops->load(st, d->user, d->chats->chat.room, on_chat_loaded, d);
}

/* The dialog's lock passed to this connection's first waiting chat message. */
static void on_lock_granted(cg_dialog_lock_waiter *w)
{
    load_head_chat(w->owner);
}

/* Loads the dialog of the first chat frame waiting, unless one is loading or waits for its
 * dialog's lock (another connection's turn of the same dialog). */
static void process_next_chat(cg_dropin *d)
{
    if (d->load || d->lock.state == CG_LOCK_WAITING || !d->chats || d->client_gone)
        return;
    turn_end(d, 0); /* the next message: the last turn is over */
    if (cg_dialog_lock_acquire(d->gw->dialog_locks, &d->lock, d->user, d->chats->chat.room))
        load_head_chat(d);
}

/* ---- frames from the client ------------------------------------------------------------ */

/* The rate limit and queue bound of chatgate.v1 (admission.h), for a frame marked as a chat
 * message: 1 when it may go on. Over a limit the frame is not forwarded (the app's protocol
 * has no error frame of ours), counted in chatgate_rate_limited_total, and logged once per
 * run of refusals. */
static int chat_admitted(cg_dropin *d)
{
    const cg_config *cfg = d->gw->cfg;
    const char *over = NULL;
    if (!cg_rate_take(&d->rate, cfg->rate_per_second, cfg->rate_burst, uv_now(d->gw->loop)))
        over = "rate_limit.messages_per_second";
    else if (d->n_chats >= cfg->queue_limit)
        over = "queue_limit (chat messages waiting for their dialog)";
    if (!over) {
        d->refusing = 0;
        return 1;
    }
    d->gw->metrics.rate_limited++;
    if (!d->refusing)
        cg_warn("dropin: a chat message over %s: not forwarded to the app (and the next ones while over it)", over);
    d->refusing = 1;
    return 0;
}

void cg_dropin_client_frame(cg_dropin *d, const char *buf, size_t len, int binary)
{
    d->gw->metrics.frames_in++;
    char why[160];
    pending_chat *c = calloc(1, sizeof(*c));
    if (!c)
        abort();
    cg_dropin_client_kind kind = cg_dropin_map_client(d->cfg, buf, len, binary, &c->chat, why, sizeof(why));
    if (kind == CG_DROPIN_CANCEL)
        cancel_reply(d, 1); /* the client's own cancel frame goes on to the app as it is */
    if ((kind == CG_DROPIN_CHAT || kind == CG_DROPIN_BAD_CHAT) && !chat_admitted(d)) {
        pending_free(c);
        return;
    }
    if (kind == CG_DROPIN_BAD_CHAT) { /* the app's own frame, but not a message of ours */
        d->gw->metrics.bad_frames++;
        cg_warn("dropin: a frame marked as a chat message passes through untouched, not as one: %s", why);
    }
    if (kind != CG_DROPIN_CHAT) {
        pending_free(c);
        to_app(d, frame_new(buf, len, binary)); /* untouched */
        return;
    }
    c->arrived = d->gw->store->now(d->gw->store->clock_ctx);
    /* a cancel phrase acts at once on the reply in flight (DESIGN.md section 1) */
    if (cg_rules_cancels(d->gw->rules, c->chat.text))
        cancel_reply(d, 0);
    c->slot = frame_new(buf, len, 0);
    c->slot->ready = 0;
    queue_push(&d->to_app, c->slot);
    dropin_flow(d);
    if (d->chats_tail)
        d->chats_tail->next = c;
    else
        d->chats = c;
    d->chats_tail = c;
    d->n_chats++;
    process_next_chat(d);
}

int cg_dropin_client_idle(cg_dropin *d)
{
    return d->to_client.head == NULL;
}

int cg_dropin_client_writable(cg_dropin *d)
{
    if (d->closing)
        return -1;
    frame *f = queue_pop(&d->to_client);
    if (!f)
        return 0;
    int rc = 0;
    if (f->close) {
        /* 4 is LWS_WRITE_CLOSE, which lws 4.1's public header leaves out (see session.c) */
        lws_write(d->client, f->data + LWS_PRE, f->len, (enum lws_write_protocol)4);
        d->closing = 1;
        lws_callback_on_writable(d->client);
    } else {
        int n = lws_write(d->client, f->data + LWS_PRE, f->len, f->binary ? LWS_WRITE_BINARY : LWS_WRITE_TEXT);
        d->gw->metrics.frames_out++;
        rc = n < (int)f->len ? -1 : 0;
        if (d->to_client.head || d->gw->closing_all)
            lws_callback_on_writable(d->client);
    }
    frame_free(f);
    dropin_flow(d);
    return rc;
}

/* ---- frames from the app --------------------------------------------------------------- */

/* Keeps the reply's text for the history, up to CG_DROPIN_MAX_REPLY bytes. */
static void turn_keep_reply(turn *t, const char *text, size_t n)
{
    if (t->reply_len + n >= CG_DROPIN_MAX_REPLY)
        return;
    char *r = realloc(t->reply, t->reply_len + n + 1);
    if (!r)
        abort();
    t->reply = r;
    memcpy(t->reply + t->reply_len, text, n);
    t->reply_len += n;
    t->reply[t->reply_len] = 0;
}

static void on_app_frame(cg_dropin *d, const char *buf, size_t len, int binary)
{
    cg_dropin_app_frame a;
    int rc = cg_dropin_map_app(d->cfg, buf, len, binary, &a);
    if (!a.frame) { /* not a JSON object: relayed as it is */
        to_client(d, frame_new(buf, len, binary));
        return;
    }
    turn *t = &d->t;
    int ours = t->active && cg_dropin_app_frame_about(&a, t->id);
    int suppressed = d->suppressing && (a.id ? cg_dropin_app_frame_about(&a, d->suppress_id) : a.text != NULL);
    if (suppressed) {
        /* the rest of a cancelled reply (no cancel frame to send): not relayed; its end
         * marker is, so the client's view of the reply completes */
        if (a.end || a.cancelled) {
            d->suppressing = 0;
            to_client(d, frame_new(a.rewritten ? a.rewritten : buf, a.rewritten ? a.rewritten_len : len, 0));
        }
        cg_dropin_app_frame_clear(&a);
        return;
    }
    if (a.state && ours) {
        char err[256];
        if (cg_dialog_apply_directive(&t->dialog, a.state, "app", d->gw->store->now(d->gw->store->clock_ctx),
                                      &d->gw->cfg->lifetimes, err, sizeof(err)) < 0)
            cg_warn("dropin: state from the app refused: %s", err);
    }
    if (ours)
        turn_timer_arm(d); /* the app is still answering */
    if (ours && a.text)
        turn_keep_reply(t, a.text, a.text_len);
    if (rc < 0) /* never relay the directive: the client must not see it */
        cg_warn("dropin: an app frame without its state directive could not be written: not relayed");
    else
        to_client(d, frame_new(a.rewritten ? a.rewritten : buf, a.rewritten ? a.rewritten_len : len, 0));
    if (ours && (a.end || a.cancelled))
        turn_end(d, a.cancelled);
    cg_dropin_app_frame_clear(&a);
}

/* Appends a fragment (lws hands them over 4 KiB at a time) to the frame being reassembled, up
 * to max bytes: the buffer grows by doubling (kept between frames up to 64 KiB), so a frame of n
 * bytes costs O(n) copying, not one realloc of the whole per fragment. NULL when over max. */
static char *rx_buf_append(char **rx, size_t *rx_len, size_t *rx_cap, const void *in, size_t len, size_t max)
{
    if (*rx_len + len > max)
        return NULL;
    if (*rx_len + len + 1 > *rx_cap) {
        size_t cap = *rx_cap ? *rx_cap : 4096;
        while (cap < *rx_len + len + 1)
            cap *= 2;
        char *n = realloc(*rx, cap);
        if (!n)
            abort();
        *rx = n;
        *rx_cap = cap;
    }
    memcpy(*rx + *rx_len, in, len);
    *rx_len += len;
    return *rx;
}

int cg_dropin_app_callback(struct lws *wsi, enum lws_callback_reasons reason, void *user, void *in, size_t len)
{
    cg_dropin *d = lws_get_opaque_user_data(wsi);
    if (!d)
        return lws_callback_http_dummy(wsi, reason, user, in, len);
    switch (reason) {
    case LWS_CALLBACK_CLIENT_APPEND_HANDSHAKE_HEADER: {
        unsigned char **p = (unsigned char **)in, *end = *p + len;
        for (int i = 0; i < d->n_headers; i++)
            if (lws_add_http_header_by_name(wsi, (const unsigned char *)d->headers[i][0],
                                            (const unsigned char *)d->headers[i][1], (int)strlen(d->headers[i][1]), p,
                                            end))
                return -1;
        return 0;
    }
    case LWS_CALLBACK_CLIENT_ESTABLISHED:
        d->app_open = 1;
        if (d->client_gone) { /* the client left during the handshake: a close frame (1001) */
            lws_callback_on_writable(wsi);
            return 0;
        }
        flush_to_app(d);
        return 0;
    case LWS_CALLBACK_CLIENT_WRITEABLE: {
        if (d->client_gone) {
            if (d->app_close_sent)
                return -1;
            unsigned char close[LWS_PRE + 16];
            close[LWS_PRE] = 1001 >> 8;
            close[LWS_PRE + 1] = 1001 & 0xff;
            memcpy(close + LWS_PRE + 2, "client left", 11);
            lws_write(wsi, close + LWS_PRE, 13, (enum lws_write_protocol)4); /* LWS_WRITE_CLOSE */
            d->app_close_sent = 1;
            lws_set_timeout(wsi, PENDING_TIMEOUT_CLOSE_SEND, 1); /* the app's answer, or not */
            lws_callback_on_writable(wsi);
            return 0;
        }
        frame *f = d->to_app.head;
        if (!f || !f->ready)
            return 0;
        queue_pop(&d->to_app);
        int n = lws_write(wsi, f->data + LWS_PRE, f->len, f->binary ? LWS_WRITE_BINARY : LWS_WRITE_TEXT);
        int short_write = n < (int)f->len;
        frame_free(f);
        dropin_flow(d);
        if (short_write)
            return -1;
        flush_to_app(d);
        return 0;
    }
    case LWS_CALLBACK_CLIENT_RECEIVE: /* reassembled up to 16 x --max-frame */
        if (lws_is_first_fragment(wsi)) {
            d->app_rx_len = 0;
            d->app_rx_too_large = 0;
        }
        if (!d->app_rx_too_large &&
            !rx_buf_append(&d->app_rx, &d->app_rx_len, &d->app_rx_cap, in, len, (size_t)d->gw->cfg->max_frame * 16))
            d->app_rx_too_large = 1;
        if (!lws_is_final_fragment(wsi))
            return 0;
        if (d->app_rx_too_large) { /* never dropped silently: the client is told, with 1009 */
            cg_warn("dropin: the app sent a frame over the limit (16 x max_frame): closing the client with 1009");
            close_client(d, 1009, "the app sent a frame over the gateway's limit");
        } else
            on_app_frame(d, d->app_rx ? d->app_rx : "", d->app_rx_len, lws_frame_is_binary(wsi));
        d->app_rx_len = 0;
        if (d->app_rx_cap > 64 * 1024) { /* an idle connection keeps a small buffer, not its largest frame */
            free(d->app_rx);
            d->app_rx = NULL;
            d->app_rx_cap = 0;
        }
        return 0;
    case LWS_CALLBACK_WS_PEER_INITIATED_CLOSE:
        /* the client gets the app's code and reason, when they may be sent on (RFC 6455 7.4);
         * a bad close frame from the app is the app's failure: 1011 */
        if (cg_ws_close_payload_check(in, len) != 0) {
            cg_warn("dropin: the app's close frame is not valid (RFC 6455 7.4): closing the client with 1011");
            d->close_code = 1011;
            snprintf(d->close_reason, sizeof(d->close_reason), "the app sent an invalid close frame");
        } else if (len >= 2) {
            const unsigned char *b = in;
            d->close_code = b[0] << 8 | b[1];
            snprintf(d->close_reason, sizeof(d->close_reason), "%.*s", (int)(len - 2), (const char *)in + 2);
        }
        return 0;
    case LWS_CALLBACK_CLIENT_CONNECTION_ERROR: {
        /* refused at the TCP level, or the app answered the handshake with an HTTP error */
        char reason[256]; /* close_client cuts it to what a close frame holds */
        snprintf(reason, sizeof(reason), "the app refused or could not be reached: %s",
                 in ? (const char *)in : "connection failed");
        cg_warn("dropin: %s", reason);
        close_client(d, 1014, reason);
        lws_set_opaque_user_data(wsi, NULL);
        d->app = NULL;
        d->app_failed = 1;
        dropin_unref(d);
        return 0;
    }
    case LWS_CALLBACK_CLIENT_CLOSED:
        cg_info("dropin: the app closed the connection (%d)", d->close_code);
        close_client(d, d->close_code ? d->close_code : 1011, d->close_code ? d->close_reason : "the app went away");
        lws_set_opaque_user_data(wsi, NULL);
        d->app = NULL;
        d->app_open = 0;
        dropin_unref(d);
        return 0;
    default:
        return lws_callback_http_dummy(wsi, reason, user, in, len);
    }
}

/* ---- opening --------------------------------------------------------------------------- */

static void on_app_resolved(void *data, const char *address, const char *err)
{
    cg_dropin *d = data;
    d->resolve = NULL;
    cg_upstream_config *u = &d->gw->dropin_app;
    if (!address) {
        cg_warn("dropin: %s ('%s')", err, u->host);
        close_client(d, 1014, "the app could not be reached");
        dropin_unref(d);
        return;
    }
    cg_connect_spec spec = {
        .host = u->host,
        .port = u->port,
        .tls = u->tls,
        .address = address,
        .path = d->path,
        .subprotocol = d->subprotocol,
        .origin = d->origin[0] ? d->origin : NULL, /* the browser's, so the app's own check still works */
        .local_protocol = CG_LWS_PROTOCOL_DROPIN_APP,
    };
    if (!cg_net_connect(&d->gw->net, &spec, d, &d->app) && !d->app_failed) { /* refused before any callback said so */
        d->app = NULL;
        close_client(d, 1014, "the app could not be reached");
        dropin_unref(d);
    }
}

/*
 * The app's path: its base path, the client's path and the client's query ("a=1&b=two
 * words", from lws's url-decoded fragments, encoded again), all at their real length (a
 * query is as long as the header space allows). NULL when out of memory.
 */
static char *app_path(cg_gateway *gw, struct lws *client)
{
    char *out = NULL, *scratch = NULL;
    size_t outlen = 0;
    FILE *f = open_memstream(&out, &outlen);
    if (!f)
        return NULL;
    int ulen = lws_hdr_total_length(client, WSI_TOKEN_GET_URI);
    scratch = malloc((size_t)(ulen > 0 ? ulen : 0) + 1);
    const char *base = gw->dropin_app.path && strcmp(gw->dropin_app.path, "/") ? gw->dropin_app.path : "";
    if (scratch && lws_hdr_copy(client, scratch, ulen + 1, WSI_TOKEN_GET_URI) >= 0)
        fprintf(f, "%s%s", base, scratch);
    for (int idx = 0;; idx++) {
        int flen = lws_hdr_fragment_length(client, WSI_TOKEN_HTTP_URI_ARGS, idx);
        char *grown = flen > 0 ? realloc(scratch, (size_t)flen + 1) : NULL;
        if (!grown)
            break;
        scratch = grown;
        if (lws_hdr_copy_fragment(client, scratch, flen + 1, WSI_TOKEN_HTTP_URI_ARGS, idx) <= 0)
            break;
        fputc(idx ? '&' : '?', f);
        for (const unsigned char *c = (unsigned char *)scratch; *c; c++) {
            int keep = (*c >= 'a' && *c <= 'z') || (*c >= 'A' && *c <= 'Z') || (*c >= '0' && *c <= '9') ||
                       strchr("-_.~=", *c);
            if (keep)
                fputc(*c, f);
            else
                fprintf(f, "%%%02X", *c);
        }
    }
    free(scratch);
    if (fclose(f) != 0) {
        free(out);
        return NULL;
    }
    return out;
}

/* Copies the configured headers of the handshake, to send them on to the app. Values are
 * copied whole: a header is at most the whole header space lws keeps (4 x max_header_bytes,
 * gateway.c), so one scratch buffer of that size takes any of them; a name or value that
 * cannot be copied is logged, never sent cut. */
static void copy_headers(cg_dropin *d, struct lws *client)
{
    json_t *names = json_object_get(d->cfg, "forward_headers");
    json_t *defaults = NULL;
    if (!names)
        names = defaults = json_pack("[s, s]", "Cookie", "Authorization");
    size_t cap = (size_t)d->gw->cfg->max_header_bytes * 4 + 1;
    char *value = malloc(cap);
    size_t i;
    json_t *name;
    json_array_foreach(names, i, name) {
        char *lower = NULL;
        if (!value || !json_string_value(name) || asprintf(&lower, "%s:", json_string_value(name)) < 0) {
            cg_error("dropin: out of memory copying the handshake's headers");
            break;
        }
        for (char *p = lower; *p; p++)
            *p = (char)(*p >= 'A' && *p <= 'Z' ? *p + 32 : *p);
        int n = strcmp(lower, "cookie:") == 0          ? lws_hdr_copy(client, value, (int)cap, WSI_TOKEN_HTTP_COOKIE)
                : strcmp(lower, "authorization:") == 0 ? lws_hdr_copy(client, value, (int)cap,
                                                                      WSI_TOKEN_HTTP_AUTHORIZATION)
                                                       : lws_hdr_custom_copy(client, value, (int)cap, lower,
                                                                             (int)strlen(lower));
        char *copy = n > 0 && d->n_headers < CG_DROPIN_MAX_FORWARD_HEADERS ? strdup(value) : NULL;
        if (copy) {
            d->headers[d->n_headers][0] = lower;
            d->headers[d->n_headers][1] = copy;
            d->n_headers++;
            lower = NULL;
        } else if (n > 0 || (n < 0 && lws_hdr_custom_length(client, lower, (int)strlen(lower)) > 0)) {
            cg_warn("dropin: the client's %s header was not forwarded (over %d headers, or out of memory)", lower,
                    CG_DROPIN_MAX_FORWARD_HEADERS);
        }
        free(lower);
    }
    free(value);
    json_decref(defaults);
}

int cg_dropin_user_from_cookie(cg_gateway *gw, struct lws *client, char *out, size_t outlen)
{
    const char *name = json_string_value(json_object_get(gw->cfg->dropin, "user_cookie"));
    int total = lws_hdr_total_length(client, WSI_TOKEN_HTTP_COOKIE);
    if (!name || total <= 0)
        return -1;
    /* copied at its real length: big cookie headers (up to max_header_bytes) are common */
    char *cookies = malloc((size_t)total + 1);
    if (!cookies || lws_hdr_copy(client, cookies, total + 1, WSI_TOKEN_HTTP_COOKIE) <= 0) {
        free(cookies);
        return -1;
    }
    int rc = -1;
    size_t nl = strlen(name);
    for (char *p = cookies; p && *p;) {
        while (*p == ' ' || *p == ';')
            p++;
        char *end = strchr(p, ';');
        if (end)
            *end = 0;
        if (strncmp(p, name, nl) == 0 && p[nl] == '=' && p[nl + 1]) {
            unsigned char md[32];
            unsigned int mdlen = 0;
            EVP_Digest(p + nl + 1, strlen(p + nl + 1), md, &mdlen, EVP_sha256(), NULL);
            snprintf(out, outlen, "c_%02x%02x%02x%02x%02x%02x%02x%02x%02x%02x%02x%02x", md[0], md[1], md[2], md[3],
                     md[4], md[5], md[6], md[7], md[8], md[9], md[10], md[11]);
            rc = 0;
            break;
        }
        p = end ? end + 1 : NULL;
    }
    free(cookies);
    return rc;
}

cg_dropin *cg_dropin_open(cg_gateway *gw, struct lws *client, const char *user)
{
    cg_dropin *d = calloc(1, sizeof(*d));
    if (!d)
        return NULL;
    d->gw = gw;
    d->cfg = gw->cfg->dropin;
    d->client = client;
    d->refs = 3; /* the client's, the app connection's and the turn timer's */
    d->lock.granted = on_lock_granted;
    d->lock.owner = d;
    cg_rate_init(&d->rate, gw->cfg->rate_burst, uv_now(gw->loop));
    snprintf(d->user, sizeof(d->user), "%s", user);
    d->path = app_path(gw, client);
    if (!d->path) {
        free(d);
        return NULL;
    }
    const struct lws_protocols *proto = lws_get_protocol(client);
    if (proto && strcmp(proto->name, CG_PROTOCOL_NAME) != 0)
        d->subprotocol = strdup(proto->name);
    copy_headers(d, client);
    if (lws_hdr_copy(client, d->origin, sizeof(d->origin), WSI_TOKEN_ORIGIN) <= 0)
        d->origin[0] = 0;
    d->resolve = cg_resolve_start(gw->loop, gw->dropin_app.host, on_app_resolved, d);
    if (!d->resolve) {
        free(d->path);
        free(d->subprotocol);
        free(d);
        return NULL;
    }
    uv_timer_init(gw->loop, &d->turn_timer); /* closed by cg_dropin_close */
    d->turn_timer.data = d;
    cg_info("dropin: a client connected; opening the app connection");
    return d;
}
