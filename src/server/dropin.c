/*
 * dropin.c: drop-in mode (see dropin.h).
 *
 * Each client connection has a cg_dropin with its two connections' plumbing (core/wsconn.h),
 * each with a bounded frame queue:
 *   to_app:    the app connection's; client frames in arrival order. A chat frame enters
 *              held and waits for its dialog to load and the pipeline to run; the frames
 *              behind it wait too, so the app sees them in the order the client sent them.
 *   to_client: the client connection's; app frames in arrival order (and a close frame at
 *              the end, when the app closed).
 * Each is written as wsconn writes (at the end of the loop iteration, as many frames as the
 * socket takes; close frames from the writable callback: the client's, and the app's 1001
 * when the client left). Past CG_DROPIN_HIGH bytes a queue pauses the side that fills it.
 *
 * A chat frame is a turn request (turn.c owns its life: arrival checks, queue, the dialog's lock,
 * load, pipeline, history, save): the turn hands it back through the sink's forward once the
 * pipeline ran, with the chatgate object to add, and the frame takes its place in to_app.
 * The app's frames about it are its reply (cg_turn_reply, cg_turn_state), its end or
 * cancelled marker ends it (cg_turn_end); the next chat frame ends it too (supersede), and
 * so does dropin.turn_timeout_ms of silence. The mapping itself (which frame is what, the
 * forwarded and relayed frames) is dropin_map.c. Lifetime: the struct holds a reference for
 * the client and one for the app connection, and is freed when both are gone.
 */
#define _GNU_SOURCE /* open_memstream */
#include <openssl/evp.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "chatgate/core/alloc.h"
#include "chatgate/proto/identity.h"
#include "chatgate/config/dropin_config.h"
#include "chatgate/core/error.h"
#include "chatgate/core/flush.h"
#include "chatgate/core/log.h"
#include "chatgate/core/wsclient.h"
#include "chatgate/core/wsconn.h"
#include "chatgate/core/net.h"
#include "chatgate/proto/dropin_map.h"
#include "chatgate/proto/protocol.h"
#include "chatgate/server/dropin.h"
#include "chatgate/server/handshake.h"
#include "chatgate/server/turn.h"

#define CG_DROPIN_HIGH (256 * 1024)
#define CG_DROPIN_HOLD_S 40 /* a held client's wait for the app's handshake (its connect bound is 30 s) */

/* Frames keep the headroom of the ones dumped for us (protocol.h), so those are adopted as
 * they are. */
_Static_assert(CG_FRAME_PRE == CG_WS_PRE, "protocol.h's frames carry core/wsconn.h's headroom");

/* A chat frame on its way through its turn: its place in to_app, and the parsed frame the
 * chatgate object is added to. The turn's opaque; back to us through forward or unsent. */
typedef struct pending_chat {
    cg_wsframe *slot; /* NULL once it could not be queued (the app connection is gone) */
    cg_dropin_chat chat; /* frame only: id, room and text went to the turn */
} pending_chat;

struct cg_dropin {
    cg_server *srv;
    json_t *cfg; /* the "dropin" object (borrowed from the config) */
    struct lws *client;
    cg_wsclient app; /* the app connection (core/wsclient.h), its queue to_app: app.conn */
    int refs;
    int client_gone;
    char user[CG_MAX_USER + 1];
    char name[24];     /* the session id, for the log */
    char *path;        /* app base path + the client's path and query */
    char *subprotocol; /* the client's, forwarded */
    cg_headers forwarded; /* the client's Origin and forward_headers, passed on as they came */
    cg_wsconn to_client;
    int refusing;       /* chat messages over a limit are being refused (logged once) */
    long drop_binary;   /* binary frames still to drop: a refused socket.io binary event's attachments */
    void *submitting;   /* the pending chat being submitted (cg_dropin_client_frame), or NULL */
    int submit_dropped; /* ... which its turn dropped before the submission returned */
    cg_turns turns;     /* the chat messages of this client (turn.h) */
    char host[128];   /* the Host header of the app's handshake (dropin.host) */
    /* a cancelled reply the app could not be told to stop (no cancel_frame) is not relayed
     * for a while (see suppressed()) */
    struct {
        char *id;           /* the stopped message's id; NULL: nothing is held */
        uint64_t since;     /* uv_now() of the cancel */
        uint64_t last;      /* uv_now() of the last frame held, 0 before the first */
        uint64_t gap_ms, max_ms;
        unsigned long ends_at; /* forwards count past which a chat message has gone after it */
        unsigned long frames;
    } suppress;
    unsigned long forwards; /* chat messages handed to the app so far */
    char *integer_id; /* the last one's id, when the client wrote it as an integer: its cancel frame's too */
    /* the client's handshake held until the app has answered its own (cg_dropin_hold) */
    enum { HOLD_NONE, HOLD_WAITING, HOLD_APP_OPEN, HOLD_APP_REFUSED } hold;
    unsigned int app_status; /* HOLD_APP_REFUSED: the app's HTTP status, 0 when it gave none */
    json_t *app_cookies;     /* HOLD_APP_OPEN: the app's Set-Cookie values, for the client's 101 */
    struct cg_dropin *held_next; /* the list of held clients (held_head) */
    cg_flush_item release_flush; /* the held client's flow goes on at the iteration's end */
};

/* ---- queues ---------------------------------------------------------------------------- */

/* A queue past CG_DROPIN_HIGH pauses the side that fills it (wsconn.h's marks). */
static void to_client_flow(cg_wsconn *c, int full, int overfull)
{
    cg_dropin *d = c->owner;
    (void)overfull;
    cg_wsconn_pause_rx(&d->app.conn, full);
}

static void to_app_flow(cg_wsconn *c, int full, int overfull)
{
    cg_dropin *d = c->owner;
    (void)overfull;
    cg_wsconn_pause_rx(&d->to_client, full);
}

static const cg_wsconn_ops to_client_ops = {.flow = to_client_flow};
static const cg_wsconn_ops to_app_ops = {.flow = to_app_flow};

/* Relays a frame to the client (nothing once it is gone). */
static void to_client(cg_dropin *d, const void *data, size_t len, int binary)
{
    if (!d->client_gone)
        cg_wsconn_send(&d->to_client, data, len, binary);
}

/* Closes the client with code and reason once what is queued for it is written; the reason
 * is cut to what a close frame holds when it is written (cg_net_write_close). */
static void close_client(cg_dropin *d, int code, const char *reason)
{
    if (!d->client_gone)
        cg_wsconn_close(&d->to_client, code, reason);
}

void cg_dropin_client_refuse(cg_dropin *d, int code, const char *reason)
{
    close_client(d, code, reason);
}

/* ---- lifetime -------------------------------------------------------------------------- */

static void pending_free(pending_chat *c)
{
    cg_dropin_chat_clear(&c->chat);
    free(c);
}

static void dropin_unref(cg_dropin *d)
{
    if (--d->refs > 0)
        return;
    cg_flush_cancel(&d->release_flush);
    cg_wsconn_clear(&d->app.conn);
    cg_wsconn_clear(&d->to_client);
    cg_headers_free(&d->forwarded);
    free(d->path);
    free(d->subprotocol);
    free(d->suppress.id);
    free(d->integer_id);
    json_decref(d->app_cookies);
    free(d);
}

void cg_dropin_close(cg_dropin *d)
{
    d->client_gone = 1;
    cg_wsconn_gone(&d->to_client);
    /* the turn in flight is saved as cancelled, the waiting ones go, their dialogs' locks too
     * (their chat frames leave to_app) */
    cg_turns_close(&d->turns);
    /* the app is written what the client sent before it left and the gateway let through
     * (chat messages whose turns had not forwarded them went with cg_turns_close), then its
     * close frame (1001); an app connection not open yet goes at once (the client's
     * handshake waits for the app's, so the client has sent nothing; still resolving: the
     * app connection ends now, app_ended) */
    cg_wsclient_finish(&d->app, 1001, "client left");
    dropin_unref(d); /* the client's reference */
}

/* ---- the turn's side ------------------------------------------------------------------- */

static int has_cancel_frame(const cg_dropin *d)
{
    return json_object_get(json_object_get(d->cfg, "app_frames"), "cancel_frame") != NULL;
}

/* Can the app's frames of one reply be told apart: by their id (app_frames.id), or, without
 * ids, by the reply marker (app_frames.reply)? Without either, in a chat between people
 * every frame with text could be someone's message, and none may be held back. */
static int replies_known(const cg_dropin *d)
{
    json_t *appf = json_object_get(d->cfg, "app_frames");
    return json_object_get(appf, "id") || json_object_get(appf, "reply");
}

/*
 * The user cancelled the reply in flight: send the app the mapping's cancel frame (unless
 * the client's own cancel frame, on its way to the app, already says so), or, when the
 * mapping names none, hold back the rest of that reply (on_app_frame) for a bounded while
 * (suppressed() says how long).
 */
static void sink_stop_forward(void *conn, cg_turn *t, int client_said)
{
    cg_dropin *d = conn;
    if (!has_cancel_frame(d) && !replies_known(d)) {
        cg_info("dropin: session %s: a reply was cancelled, and the mapping has no cancel_frame, nor app_frames.id or "
                "app_frames.reply to tell the reply's frames from other people's: the app goes on, its frames are "
                "relayed", d->name);
        return;
    }
    if (!has_cancel_frame(d)) {
        free(d->suppress.id);
        d->suppress.id = cg_strdup(cg_turn_id(t));
        d->suppress.since = uv_now(d->srv->net.loop);
        d->suppress.last = 0;
        d->suppress.gap_ms = d->turns.fw.reply_gap_ms ? d->turns.fw.reply_gap_ms : d->turns.fw.reply_timeout_ms;
        d->suppress.max_ms = d->turns.fw.reply_timeout_ms;
        /* a cancel phrase is itself a chat message, forwarded next: the message after it
         * is the first whose reply is not the stopped one's */
        d->suppress.ends_at = d->forwards + (client_said ? 0 : 1);
        d->suppress.frames = 0;
        cg_info("dropin: session %s: a reply was cancelled and the mapping has no cancel_frame: the app goes on, "
                "and the rest of that reply is not relayed until its end marker, %llu ms without a frame of it, "
                "or %llu ms at most",
                d->name, (unsigned long long)d->suppress.gap_ms, (unsigned long long)d->suppress.max_ms);
        return;
    }
    if (client_said)
        return;
    size_t len = 0;
    const char *id = cg_turn_id(t);
    int id_is_integer = d->integer_id && strcmp(d->integer_id, id) == 0;
    char *s = cg_dropin_map_cancel_frame(d->cfg, id, id_is_integer, &len);
    if (!s) { /* only when out of memory: the reply goes on */
        cg_warn("dropin: the cancel frame could not be built: the reply in flight goes on");
        return;
    }
    cg_wsconn_send(&d->app.conn, s, len, 0);
    free(s);
}

/* The chatgate object a chat message reaches the app with (docs/protocol.md, "Drop-in
 * mode"); NULL when it could not be built. */
static json_t *chatgate_object(const cg_turn_forward *f)
{
    return json_pack(
        "{s:s, s:s, s:s, s:o, s:O, s:O, s:o, s:O, s:O, s:o, s:O, s:O, s:O}", "user", f->user, "room", f->room, "route",
        "app", "service", f->service ? json_string(f->service) : json_null(), "params", f->params, "resolution",
        f->resolution ? f->resolution : json_null(), "enriched", f->enriched ? json_string(f->enriched) : json_null(),
        "soft_context", f->soft ? f->soft : json_null(), "last_tool_result",
        f->tool_result ? f->tool_result : json_null(), "profile", f->profile ? json_incref(f->profile) : json_object(),
        "awaiting", f->awaiting ? f->awaiting : json_null(), "rules",
        f->rules, "annotations", f->annotations);
}

/* A chat message's slot in to_app leaves the queue unsent (the frames behind it go on); one
 * not queued yet (its turn ended inside cg_turns_submit) is freed, and the submitter told. */
static void drop_slot(cg_dropin *d, pending_chat *c)
{
    if (c == d->submitting)
        d->submit_dropped = 1;
    if (c->slot)
        cg_wsconn_remove(&d->app.conn, c->slot);
    pending_free(c);
}

/* The pipeline ran: the chat frame, with the chatgate object added, takes its place. When
 * the object cannot be added, the message is dropped (the turn ends with an error): as the
 * client wrote it, it could carry an object of its own where the app reads chatgate's. */
static int sink_forward(void *conn, cg_turn *t, const cg_turn_forward *f)
{
    cg_dropin *d = conn;
    pending_chat *c = f->opaque;
    if (!c->slot) { /* the app connection was gone when it was to be queued */
        pending_free(c);
        return -1;
    }
    cg_frame_text built = cg_dropin_map_forward(d->cfg, &c->chat, chatgate_object(f));
    if (!built.buf) {
        cg_warn("dropin: session %s: the chatgate object could not be added to a chat message: not forwarded",
                d->name);
        drop_slot(d, c);
        return -1;
    }
    d->forwards++;
    free(d->integer_id);
    d->integer_id = c->chat.id_is_integer ? cg_strdup(cg_turn_id(t)) : NULL;
    cg_wsconn_release(&d->app.conn, c->slot, built.buf, built.len); /* same headroom */
    pending_free(c);
    return 0;
}

/* A chat message whose turn ended before it was forwarded (over a limit, its dialog not
 * loaded, params over the cap, the connection gone): it never reaches the app. */
static void sink_unsent(void *conn, void *opaque)
{
    drop_slot(conn, opaque);
}

/* A chat message refused (rate, queue bound, shutdown on arrival; a user's limit, its
 * dialog's load or the params cap later): not forwarded, as the app's protocol has no error
 * frame of ours; logged once per run of refusals (counted by the turn in
 * chatgate_rate_limited_total, chatgate_limited_total and chatgate_errors_total). */
static void sink_error(void *conn, const char *id, int err, const char *message, json_t *detail)
{
    cg_dropin *d = conn;
    (void)id;
    (void)detail;
    if (!d->refusing)
        cg_warn("dropin: a chat message refused (%s: %s): not forwarded to the app (nor the next ones while refused)",
                cg_err_code(err), message);
    d->refusing = 1;
}

static const cg_turn_sink dropin_sink = {
    .error = sink_error,
    .forward = sink_forward,
    .stop_forward = sink_stop_forward,
    .unsent = sink_unsent,
};

/* ---- frames from the client ------------------------------------------------------------ */

void cg_dropin_client_frame(cg_dropin *d, const char *buf, size_t len, int binary)
{
    d->srv->metrics.frames_in++;
    char why[160];
    pending_chat *c = cg_calloc(1, sizeof(*c));
    if (binary && d->drop_binary > 0) { /* an attachment of a refused socket.io binary event */
        d->drop_binary--;
        pending_free(c);
        return;
    }
    d->drop_binary = 0;
    cg_dropin_client_kind kind = cg_dropin_map_client(d->cfg, buf, len, binary, &c->chat, why, sizeof(why));
    if (kind == CG_DROPIN_CANCEL) {
        if (c->chat.id) /* the client's own cancel frame goes on to the app */
            cg_turns_cancel_current(&d->turns, c->chat.id);
        if (c->chat.frame)
            kind = CG_DROPIN_STRIPPED; /* without a member in chatgate's place */
    }
    if (kind == CG_DROPIN_REFUSE) { /* the app would read it as a message, unchecked: never forwarded */
        d->drop_binary = c->chat.attachments;
        pending_free(c);
        if (cg_turns_admit(&d->turns, "") != 0) /* still charged to the rate limit */
            return;
        d->srv->metrics.bad_frames++;
        cg_warn("dropin: session %s: a client frame refused, not forwarded: %s", d->name, why);
        return;
    }
    if (kind == CG_DROPIN_STRIPPED) { /* a member in chatgate's place, removed */
        cg_frame_text f = cg_dropin_map_encode(d->cfg, &c->chat);
        pending_free(c);
        if (!f.buf) {
            cg_warn("dropin: session %s: a frame that named chatgate's member could not be rewritten: dropped",
                    d->name);
            return;
        }
        cg_wsconn_push(&d->app.conn, cg_wsframe_adopt(f.buf, f.len, 0, binary)); /* text or binary, as it came */
        return;
    }
    if (kind != CG_DROPIN_CHAT) {
        pending_free(c);
        cg_wsconn_send(&d->app.conn, buf, len, binary); /* untouched */
        return;
    }
    /* the frame joins to_app after cg_turns_submit, so that a cancel frame the submission
     * sends (the message is a cancel phrase) goes before it; c may come back from the turn
     * (forward or unsent) before submit returns, which `submitting` notes */
    cg_wsframe *slot = c->slot = cg_wsframe_new(buf, len, 0);
    slot->held = 1;
    cg_turn_request r = {
        .kind = CG_TURN_CHAT, .id = c->chat.id, .room = c->chat.room, .text = c->chat.text, .opaque = c,
    };
    c->chat.id = c->chat.room = c->chat.text = NULL;
    d->submitting = c;
    d->submit_dropped = 0;
    int rc = cg_turns_submit(&d->turns, &r);
    d->submitting = NULL;
    if (rc != 0) { /* refused on arrival: not forwarded; c is still ours */
        cg_wsframe_free(slot);
        pending_free(c);
        return;
    }
    d->refusing = 0; /* c is the turn's now, or already back */
    if (d->submit_dropped) /* refused before submit returned: slot and c are gone */
        return;
    if (cg_wsconn_push(&d->app.conn, slot) < 0) /* the app connection is gone: freed */
        c->slot = NULL;
}

/* The client's writable callback: at shutdown, what is queued, then a close frame (1001). */
int cg_dropin_client_writable(cg_dropin *d)
{
    if (d->srv->closing_all)
        cg_wsconn_close(&d->to_client, LWS_CLOSE_STATUS_GOINGAWAY, "going away");
    return cg_wsconn_writable(&d->to_client);
}

int cg_dropin_client_closing(const cg_dropin *d)
{
    return cg_wsconn_closing(&d->to_client);
}

/* ---- frames to and from the app -------------------------------------------------------- */

/*
 * Is this app frame part of a cancelled reply that is not relayed? Frames of its id, or,
 * when the app's frames carry none, every frame with text that app_frames.reply marks as a
 * reply (never one it does not: another user's message, the user's own echoed, presence or
 * typing all pass). Only held at all when one of the two is set (replies_known). The hold ends at the reply's end marker; after gap_ms
 * with no frame of it once one came; for an app whose frames carry no ids, once a chat
 * message after the cancel has gone to the app (its reply cannot be told from the stopped
 * one's, and the newer one is what the user waits for); and max_ms after the cancel at
 * most. Logged: a client is never muted for good by an app that sends no end.
 */
static int suppressed(cg_dropin *d, const cg_dropin_app_frame *a)
{
    if (!d->suppress.id)
        return 0;
    /* a frame without an id is held only when the reply marker says it is one */
    int marker = json_object_get(json_object_get(d->cfg, "app_frames"), "reply") != NULL;
    int of_it = a->id ? cg_dropin_app_frame_about(a, d->suppress.id) : marker && a->reply && a->text;
    uint64_t now = uv_now(d->srv->net.loop);
    int end = of_it && (a->end || a->cancelled);
    int ids = json_object_get(json_object_get(d->cfg, "app_frames"), "id") != NULL;
    const char *over = end ? "its end marker came"
                       : of_it && !ids && d->forwards > d->suppress.ends_at ? "a later message went to the app"
                       : d->suppress.last && now - d->suppress.last >= d->suppress.gap_ms ? "the reply went quiet"
                       : now - d->suppress.since >= d->suppress.max_ms ? "the longest hold passed"
                                                                        : NULL;
    if (over) {
        cg_info("dropin: session %s: the cancelled reply is over (%s): %lu frames of it were not relayed", d->name,
                over, d->suppress.frames);
        free(d->suppress.id);
        d->suppress.id = NULL;
        return end; /* the end marker itself is relayed by the caller */
    }
    if (of_it) {
        d->suppress.last = now;
        d->suppress.frames++;
    }
    return of_it;
}

static void on_app_frame(cg_dropin *d, const char *buf, size_t len, int binary)
{
    cg_dropin_app_frame a;
    int rc = cg_dropin_map_app(d->cfg, buf, len, binary, &a);
    if (!a.frame) { /* nothing the codec reads (not JSON, a socket.io ping, binary): relayed as it is */
        to_client(d, buf, len, binary);
        return;
    }
    cg_turn *t = cg_turns_forwarded(&d->turns);
    int about = t && cg_dropin_app_frame_about(&a, cg_turn_id(t));
    int ours = about && a.reply; /* a frame of the reply in flight (not presence, an echo, ...) */
    int ends = about && (a.end || a.cancelled);
    if (suppressed(d, &a)) {
        /* the rest of a cancelled reply the app could not be told to stop: not relayed; its
         * end marker is, so the client's view of the reply completes, and its turn ends */
        if (a.end || a.cancelled) {
            to_client(d, a.rewritten ? a.rewritten : buf, a.rewritten ? a.rewritten_len : len, 0);
            if (ends)
                cg_turn_end(t, 1);
        }
        cg_dropin_app_frame_clear(&a);
        return;
    }
    if (a.state && about) /* in an end frame too, which app_frames.reply need not match */
        cg_turn_state(t, a.state, "app");
    if (ours) /* the app is still answering: text for the history, and its silence bound again */
        cg_turn_reply(t, a.text ? a.text : "", a.text ? a.text_len : 0);
    if (rc < 0) /* never relay the directive: the client must not see it */
        cg_warn("dropin: an app frame without its state directive could not be written: not relayed");
    else
        to_client(d, a.rewritten ? a.rewritten : buf, a.rewritten ? a.rewritten_len : len, 0);
    if (ends)
        cg_turn_end(t, a.cancelled);
    cg_dropin_app_frame_clear(&a);
}

static void hold_app_cookies(cg_dropin *d, struct lws *app);
static void hold_app_open(cg_dropin *d);
static void hold_refused(cg_dropin *d, unsigned int status);

/*
 * The app's handshake: the client's Origin and forwarded headers as they came (lws would
 * write "http://" before any origin it is given, so it is given none and the header is
 * ours), then dropin.headers, which replace the client's of the same name. -1 (the
 * connection fails, the client is closed with 1014) when they do not fit.
 */
static int app_headers(cg_wsclient *w, unsigned char **p, unsigned char *end)
{
    cg_dropin *d = w->owner;
    const cg_headers *conf = &d->srv->cfg->dropin_app.headers;
    int rc = cg_upstream_append_headers(w->conn.wsi, &d->forwarded, conf, p, end) |
             cg_upstream_append_headers(w->conn.wsi, conf, NULL, p, end);
    if (rc)
        cg_warn("dropin: session %s: the app's handshake headers do not fit lws's buffer: not connecting", d->name);
    return rc ? -1 : 0;
}

static void app_accepted(cg_wsclient *w, struct lws *wsi)
{
    cg_dropin *d = w->owner;
    if (d->hold == HOLD_WAITING)
        hold_app_cookies(d, wsi);
}

static void app_opened(cg_wsclient *w)
{
    cg_dropin *d = w->owner;
    if (d->hold == HOLD_WAITING)
        hold_app_open(d);
}

/* One app frame, reassembled up to 16 x --max-frame (app.max_message). */
static void app_message(cg_wsclient *w, const char *msg, size_t len, int binary)
{
    cg_dropin *d = w->owner;
    if (msg) {
        on_app_frame(d, msg, len, binary);
        return;
    }
    /* never dropped silently: the client is told, with 1009 */
    cg_warn("dropin: the app sent a frame over the limit (16 x max_frame): closing the client with 1009");
    close_client(d, 1009, "the app sent a frame over the gateway's limit");
}

/*
 * The app connection is over, and its reference goes. Never open: the app's own refusal
 * (401, 403: an Origin or a session it does not accept) is the app's policy, 1008, with its
 * status; anything else is a bad gateway, 1014; a held client's handshake gets the refusal
 * instead. Closed: the client gets the app's code and reason, when they may be sent on (RFC
 * 6455 7.4); a bad close frame from the app is the app's failure, 1011, as is none at all;
 * an empty one (no status, 1005, which may not be sent on) is a normal closure, 1000.
 */
static void app_ended(cg_wsclient *w, const cg_wsclient_end *e)
{
    cg_dropin *d = w->owner;
    char reason[320]; /* close_client cuts it to what a close frame holds */
    if (d->client_gone) {
        cg_debug("dropin: session %s: the app connection ended after the client left", d->name);
    } else if (!e->opened) {
        snprintf(reason, sizeof(reason), "the app %s", e->why);
        cg_warn("dropin: session %s: %s", d->name, reason);
        if (d->hold == HOLD_WAITING)
            hold_refused(d, e->status);
        else
            close_client(d, e->status == 401 || e->status == 403 ? 1008 : 1014, reason);
    } else if (e->invalid) {
        cg_warn("dropin: the app's close frame is not valid (RFC 6455 7.4): closing the client with 1011");
        close_client(d, 1011, "the app sent an invalid close frame");
    } else if (!e->code) {
        cg_info("dropin: session %s: the app connection was lost", d->name);
        close_client(d, 1011, "the app went away");
    } else {
        cg_info("dropin: session %s: the app closed the connection (%d)", d->name, e->code);
        close_client(d, e->code == 1005 ? 1000 : e->code, e->reason);
    }
    dropin_unref(d);
}

static const cg_wsclient_ops app_ops = {
    .headers = app_headers,
    .accepted = app_accepted,
    .opened = app_opened,
    .message = app_message,
    .ended = app_ended,
};

/* ---- the client's handshake, held for the app's ------------------------------------------ */

static void release_flush(cg_flush_item *item)
{
    cg_dropin *d = (cg_dropin *)((char *)item - offsetof(cg_dropin, release_flush));
    int rc = lws_rx_flow_control(d->client, 1);
    cg_debug("dropin: session %s: the client's handshake goes on (%d)", d->name, rc);
}

/* A client waiting for the app's handshake holds two sockets for up to CG_DROPIN_HOLD_S: it
 * counts toward max_connections (srv->n_held, read by the handshake's checks) until the app
 * has answered (until issue 39's ninth round it did not, and a flood of them passed it). */
static void hold_set(cg_dropin *d, int hold)
{
    d->srv->n_held += (hold == HOLD_WAITING) - (d->hold == HOLD_WAITING);
    d->hold = hold;
}

/* The held client's handshake goes on: lws reads the end of its head (listener.h). Not from
 * inside the app connection's callback, where lws does not apply another wsi's flow change:
 * at the end of the loop iteration. */
static void hold_release(cg_dropin *d)
{
    cg_flush_request(d->srv->net.flush, &d->release_flush, release_flush);
}

/* The app's answer to its handshake, while lws still has its headers (FILTER_PRE_ESTABLISH):
 * its cookies, for the client's 101. */
static void hold_app_cookies(cg_dropin *d, struct lws *app)
{
    json_decref(d->app_cookies);
    d->app_cookies = json_array();
    char *value = cg_malloc((size_t)d->srv->cfg->max_header_bytes + 1);
    for (int i = 0;; i++) {
        int n = lws_hdr_copy_fragment(app, value, (int)d->srv->cfg->max_header_bytes + 1, WSI_TOKEN_HTTP_SET_COOKIE, i);
        if (n <= 0)
            break;
        json_array_append_new(d->app_cookies, json_stringn(value, (size_t)n)); /* NULL (not UTF-8): left out */
    }
    free(value);
}

/* The app answered 101: the client's handshake goes on. */
static void hold_app_open(cg_dropin *d)
{
    hold_set(d, HOLD_APP_OPEN);
    hold_release(d);
}

/* The app refused the handshake (status) or could not be reached (0): so is the client. */
static void hold_refused(cg_dropin *d, unsigned int status)
{
    hold_set(d, HOLD_APP_REFUSED);
    d->app_status = status;
    hold_release(d);
}

/* The clients held now, found by their wsi (a wsi's opaque data is not ours to read: other
 * connections keep theirs there); at most max_connections (hold_set). */
static cg_dropin *held_head;

static cg_dropin *held_of(struct lws *client)
{
    for (cg_dropin *d = held_head; d; d = d->held_next)
        if (d->client == client)
            return d;
    return NULL;
}

/* The client's handshake is done, or the client gone: it is held no more. */
static void held_remove(cg_dropin *d)
{
    for (cg_dropin **pp = &held_head; *pp; pp = &(*pp)->held_next)
        if (*pp == d) {
            *pp = d->held_next;
            break;
        }
    d->held_next = NULL;
    hold_set(d, HOLD_NONE);
}

int cg_dropin_identify(cg_server *srv, struct lws *client, char *user, size_t userlen, char *plan, char *err,
                       size_t errlen)
{
    plan[0] = 0;
    if (srv->cfg->auth_kind == CG_AUTH_NONE && cg_handshake_dropin_user(srv, client, user, userlen) == 0)
        return 0; /* the cookie's user */
    int64_t now = srv->turn.store->now(srv->turn.store->clock_ctx);
    return cg_handshake_identify(srv, client, now, user, userlen, plan, err, errlen);
}

static cg_dropin *dropin_new(cg_server *srv, struct lws *client, const char *user, const char *plan,
                             const char *name);

int cg_dropin_hold(cg_server *srv, struct lws *client)
{
    char user[CG_MAX_USER + 1], plan[CG_MAX_PLAN_NAME + 1], err[256];
    if (!cg_handshake_upgrade_acceptable(client) ||
        cg_dropin_identify(srv, client, user, sizeof(user), plan, err, sizeof(err)) < 0)
        return -1; /* refused as it would be unheld, without an app connection */
    cg_dropin *d = dropin_new(srv, client, user, plan, "(handshake)");
    if (!d)
        return -1;
    hold_set(d, HOLD_WAITING);
    d->held_next = held_head;
    held_head = d;
    /* lws's wait for the rest of a head (10 s) becomes the app's: its connect bound and more */
    lws_set_timeout(client, PENDING_TIMEOUT_HOLDING_AH, CG_DROPIN_HOLD_S);
    return 0;
}

int cg_dropin_confirm_held(struct lws *client)
{
    cg_dropin *d = held_of(client);
    if (!d || d->hold != HOLD_APP_REFUSED)
        return 0;
    /* the app's own refusal (4xx, 5xx), as a proxy passes it on; anything else (no answer,
     * or one that is neither 101 nor a refusal) is a bad gateway */
    unsigned int status = d->app_status >= 400 && d->app_status <= 599 ? d->app_status : 502;
    char body[128];
    if (d->app_status)
        snprintf(body, sizeof(body), "the app refused the connection with HTTP %u\n", d->app_status);
    else
        snprintf(body, sizeof(body), "the app could not be reached\n");
    d->srv->metrics.refused_connections++;
    return cg_http_refuse(client, (int)status, cg_http_reason((int)status), body);
}

int cg_dropin_add_headers(struct lws *client, void *in)
{
    cg_dropin *d = held_of(client);
    struct lws_process_html_args *args = in;
    size_t i;
    json_t *cookie;
    if (!d || !args)
        return 0;
    unsigned char *p = (unsigned char *)args->p, *end = p + args->max_len;
    json_array_foreach(d->app_cookies, i, cookie) {
        if (lws_add_http_header_by_name(client, (const unsigned char *)"set-cookie:",
                                        (const unsigned char *)json_string_value(cookie),
                                        (int)json_string_length(cookie), &p, end)) {
            cg_warn("dropin: session %s: the app's Set-Cookie does not fit the 101: left out", d->name);
            break;
        }
    }
    args->p = (char *)p;
    return 0;
}

cg_dropin *cg_dropin_take_held(struct lws *client, char *user, size_t userlen, const char *name)
{
    cg_dropin *d = held_of(client);
    if (!d)
        return NULL;
    held_remove(d);
    lws_set_timeout(client, NO_PENDING_TIMEOUT, 0);
    snprintf(user, userlen, "%s", d->user);
    snprintf(d->name, sizeof(d->name), "%s", name); /* the session's id from now on */
    cg_wsconn_open(&d->to_client, client); /* what the app said before the client's handshake was done */
    return d;
}

void cg_dropin_client_gone(struct lws *client)
{
    cg_dropin *d = held_of(client);
    if (!d)
        return;
    held_remove(d);
    cg_dropin_close(d);
}

/* ---- opening --------------------------------------------------------------------------- */

/*
 * The app's path: its base path, the client's path and the client's query ("a=1&b=two
 * words", from lws's url-decoded fragments), both encoded again, all at their real length
 * (a query is as long as the header space allows). NULL when out of memory.
 */
static char *app_path(const cg_server *srv, struct lws *client)
{
    char *out = NULL, *scratch = NULL;
    size_t outlen = 0;
    FILE *f = open_memstream(&out, &outlen);
    if (!f)
        return NULL;
    int ulen = lws_hdr_total_length(client, WSI_TOKEN_GET_URI);
    scratch = cg_malloc((size_t)(ulen > 0 ? ulen : 0) + 1);
    const char *app = srv->cfg->dropin_app.path;
    const char *base = app && strcmp(app, "/") ? app : "";
    if (scratch && lws_hdr_copy(client, scratch, ulen + 1, WSI_TOKEN_GET_URI) >= 0) {
        /* lws hands the path decoded ("/a b", a '?' that was %3F): encoded again outside RFC
         * 3986's pchar, so the app gets the path the client meant, never a raw space or TAB */
        fputs(base, f);
        for (const unsigned char *c = (unsigned char *)scratch; *c; c++) {
            if ((*c >= 'a' && *c <= 'z') || (*c >= 'A' && *c <= 'Z') || (*c >= '0' && *c <= '9') ||
                strchr("/-._~!$&'()*+,;=:@", *c))
                fputc(*c, f);
            else
                fprintf(f, "%%%02X", *c);
        }
    }
    for (int idx = 0;; idx++) {
        int flen = lws_hdr_fragment_length(client, WSI_TOKEN_HTTP_URI_ARGS, idx);
        char *grown = flen > 0 ? cg_realloc(scratch, (size_t)flen + 1) : NULL;
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

_Static_assert(CG_DROPIN_MAX_FORWARD_HEADERS + 1 <= CG_HEADERS_MAX, "the Origin and every forwarded header fit");

/*
 * The subprotocol the client's handshake gets, as lws chooses it: the first name the client
 * offers (Sec-WebSocket-Protocol) that the vhost has, chatgate.v1 or one of
 * dropin.subprotocols. Read from the header, since a held client (listener.h) is not bound
 * to it yet. NULL for chatgate.v1 or none (the app is offered none).
 */
static char *client_subprotocol(const cg_dropin *d, struct lws *client)
{
    int total = lws_hdr_total_length(client, WSI_TOKEN_PROTOCOL);
    char *offered = total > 0 ? cg_malloc((size_t)total + 1) : NULL;
    char *chosen = NULL;
    if (!offered || lws_hdr_copy(client, offered, total + 1, WSI_TOKEN_PROTOCOL) <= 0) {
        free(offered);
        return NULL;
    }
    json_t *subs = json_object_get(d->cfg, "subprotocols");
    for (char *save = NULL, *name = strtok_r(offered, ", \t", &save); name && !chosen;
         name = strtok_r(NULL, ", \t", &save)) {
        if (strcmp(name, CG_PROTOCOL_NAME) == 0)
            break; /* lws takes chatgate.v1: the app is offered none */
        for (size_t i = 0; i < json_array_size(subs) && !chosen; i++)
            if (strcmp(name, json_string_value(json_array_get(subs, i))) == 0)
                chosen = cg_strdup(name);
    }
    free(offered);
    return chosen;
}

/* Keeps one header of the client's handshake (name lower-cased, without ':') to pass on. */
static void forward_header(cg_dropin *d, const char *name, const char *value)
{
    cg_header *h = &d->forwarded.items[d->forwarded.n++];
    h->name = cg_strdup(name);
    h->value = cg_strdup(value);
}

/*
 * Copies what of the handshake goes on to the app: the browser's Origin, so the app's own
 * check still works, then the configured headers. Values are copied whole: a header is at
 * most the whole header space lws keeps (4 x max_header_bytes, gateway.c), so one scratch
 * buffer of that size takes any of them; a name or value that cannot be copied is logged,
 * never sent cut.
 */
static void copy_headers(cg_dropin *d, struct lws *client)
{
    json_t *names = json_object_get(d->cfg, "forward_headers");
    json_t *defaults = NULL;
    if (!names)
        names = defaults = json_pack("[s, s]", "Cookie", "Authorization");
    size_t cap = (size_t)d->srv->cfg->max_header_bytes * 4 + 1;
    char *value = cg_malloc(cap);
    if (lws_hdr_copy(client, value, (int)cap, WSI_TOKEN_ORIGIN) > 0)
        forward_header(d, "origin", value);
    size_t i;
    json_t *name;
    json_array_foreach(names, i, name) {
        char lower[72]; /* "name:": names are checked to be under 64 bytes (dropin_config.c) */
        snprintf(lower, sizeof(lower), "%s:", json_string_value(name));
        for (char *p = lower; *p; p++)
            *p = (char)(*p >= 'A' && *p <= 'Z' ? *p + 32 : *p);
        int n = strcmp(lower, "cookie:") == 0          ? lws_hdr_copy(client, value, (int)cap, WSI_TOKEN_HTTP_COOKIE)
                : strcmp(lower, "authorization:") == 0 ? lws_hdr_copy(client, value, (int)cap,
                                                                      WSI_TOKEN_HTTP_AUTHORIZATION)
                                                       : lws_hdr_custom_copy(client, value, (int)cap, lower,
                                                                             (int)strlen(lower));
        lower[strlen(lower) - 1] = 0; /* kept without the ':' */
        if (n > 0)
            forward_header(d, lower, value);
        else if (n < 0 && lws_hdr_custom_length(client, lower, (int)strlen(lower)) > 0)
            cg_warn("dropin: the client's %s header was not forwarded: it could not be copied", lower);
    }
    free(value);
    json_decref(defaults);
}

/*
 * The Host of the app's handshake (dropin.host): the app URL's host[:port] ("app", the
 * default: the page is the app's own, served from the app's origin, and only its WebSocket
 * URL changed to chatgate's, so an app that compares Origin with Host, as Tornado's
 * check_origin does, sees its own host as it would without chatgate; for wss:// it is also
 * the name the certificate is checked against); the client's own, port and all ("client":
 * when the page comes through the same host as chatgate, a proxy in front of both); or the
 * configured text. lws writes Host in 128 bytes: a longer one falls back to the app's.
 */
static void app_host(cg_dropin *d, struct lws *client)
{
    const cg_upstream_config *u = &d->srv->cfg->dropin_app;
    const char *want = json_string_value(json_object_get(d->cfg, "host"));
    if (!want)
        want = "app";
    int n = strcmp(want, "client") == 0 ? lws_hdr_copy(client, d->host, sizeof(d->host), WSI_TOKEN_HOST)
            : strcmp(want, "app") == 0  ? 0
                                        : snprintf(d->host, sizeof(d->host), "%s", want);
    if (n > 0 && n <= 110)
        return;
    if (n != 0)
        cg_warn("dropin: session %s: the Host for the app is missing or over 110 bytes: the app's own (%s) is sent",
                d->name, u->authority);
    snprintf(d->host, sizeof(d->host), "%s", u->authority);
}

/* The client's connection is not written to until it is open: at once (cg_dropin_open), or
 * once its handshake, held for the app's, is done (cg_dropin_hold, cg_dropin_take_held). */
static cg_dropin *dropin_new(cg_server *srv, struct lws *client, const char *user, const char *plan,
                             const char *name)
{
    cg_dropin *d = cg_calloc(1, sizeof(*d));
    d->srv = srv;
    d->cfg = srv->cfg->dropin;
    d->client = client;
    d->refs = 2; /* the client's and the app connection's */
    cg_wsconn_init(&d->to_client, CG_WS_SERVER, &srv->net, &to_client_ops, d);
    d->to_client.batch = &srv->batch;
    d->to_client.frames_out = &srv->metrics.frames_out;
    d->to_client.high = CG_DROPIN_HIGH;
    cg_wsclient_init(&d->app, &srv->net, &to_app_ops, &app_ops, d);
    d->app.conn.high = CG_DROPIN_HIGH;
    d->app.max_message = (size_t)srv->cfg->max_frame * 16;
    snprintf(d->user, sizeof(d->user), "%s", user);
    snprintf(d->name, sizeof(d->name), "%s", name); /* d outlives the session that named it */
    json_t *tt = json_object_get(d->cfg, "turn_timeout_ms");
    json_t *gap = json_object_get(d->cfg, "reply_gap_ms");
    int no_end = !json_object_get(json_object_get(d->cfg, "app_frames"), "end");
    cg_turn_forwarding fw = {
        .supersede = 1, /* the app's protocol may have no end marker: the next message ends a turn */
        .reply_timeout_ms = json_is_integer(tt) ? (uint64_t)json_integer_value(tt) : 60000,
        .reply_gap_ms = json_is_integer(gap) ? (uint64_t)json_integer_value(gap) : no_end ? 2000 : 0,
    };
    cg_turns_init(&d->turns, &srv->turn, &dropin_sink, &fw, d, d->user, d->name);
    cg_turns_set_plan(&d->turns, plan);
    d->path = app_path(srv, client);
    if (!d->path) {
        free(d);
        return NULL;
    }
    d->subprotocol = client_subprotocol(d, client);
    copy_headers(d, client);
    app_host(d, client);
    const cg_upstream_config *u = &srv->cfg->dropin_app;
    cg_connect_spec spec = {.host = d->host, .port = u->port, .tls = u->tls, .path = d->path,
                            .subprotocol = d->subprotocol, .local_protocol = CG_LWS_PROTOCOL_DROPIN_APP};
    if (cg_wsclient_connect(&d->app, u->host, &spec) < 0) {
        d->refs = 1;
        dropin_unref(d); /* frees what was copied: path, subprotocol, headers */
        return NULL;
    }
    cg_info("dropin: a client connected; opening the app connection");
    return d;
}

cg_dropin *cg_dropin_open(cg_server *srv, struct lws *client, const char *user, const char *plan, const char *name)
{
    cg_dropin *d = dropin_new(srv, client, user, plan, name);
    if (d)
        cg_wsconn_open(&d->to_client, client);
    return d;
}
