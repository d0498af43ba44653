/*
 * wsclient.c: one WebSocket connection the gateway opens (see wsclient.h).
 */
#include "chatgate/core/wsclient.h"

#include <stdio.h>
#include <string.h>

#include "chatgate/core/flush.h"
#include "chatgate/core/log.h"

void cg_wsclient_init(cg_wsclient *w, const cg_net *net, const cg_wsconn_ops *conn_ops,
                      const cg_wsclient_ops *ops, void *owner)
{
    memset(w, 0, sizeof(*w));
    cg_wsconn_init(&w->conn, CG_WS_CLIENT, net, conn_ops, owner);
    w->ops = ops;
    w->owner = owner;
    w->state = CG_WSCLIENT_IDLE;
    w->max_message = 1 << 20;
}

/* The one end: the socket is gone (or never was); nothing more comes. */
static void end(cg_wsclient *w, const cg_wsclient_end *e)
{
    if (w->state == CG_WSCLIENT_ENDED)
        return;
    w->state = CG_WSCLIENT_ENDED;
    cg_keepalive_remove(w->conn.net->keepalive, &w->ka);
    if (w->resolve) {
        cg_resolve_abandon(w->resolve);
        w->resolve = NULL;
    }
    cg_wsconn_gone(&w->conn);
    if (w->ops->ended)
        w->ops->ended(w, e);
}

static void end_failed(cg_wsclient *w, unsigned status, const char *why)
{
    cg_wsclient_end e = {.status = status, .why = why};
    end(w, &e);
}

static void on_resolved(void *data, const char *address, const char *err)
{
    cg_wsclient *w = data;
    w->resolve = NULL;
    if (!address) {
        char why[300];
        snprintf(why, sizeof(why), "%s ('%s')", err, w->host);
        end_failed(w, 0, why);
        return;
    }
    w->spec.address = address;
    w->state = CG_WSCLIENT_CONNECTING;
    struct lws *wsi = cg_net_connect(w->conn.net, &w->spec, w, &w->conn.wsi);
    if (!wsi && w->state == CG_WSCLIENT_CONNECTING) { /* refused before any callback said so */
        char why[300];
        snprintf(why, sizeof(why), "could not be reached at %s:%d", address, w->spec.port);
        w->conn.wsi = NULL;
        end_failed(w, 0, why);
    }
}

int cg_wsclient_connect(cg_wsclient *w, const char *host, const cg_connect_spec *spec)
{
    w->spec = *spec;
    w->host = host;
    w->state = CG_WSCLIENT_RESOLVING;
    w->resolve = cg_resolve_start(w->conn.net->loop, host, on_resolved, w);
    if (!w->resolve) {
        w->state = CG_WSCLIENT_IDLE;
        return -1;
    }
    return 0;
}

static void close_keeping(cg_wsclient *w, int code, const char *reason, int keep_queue)
{
    switch (w->state) {
    case CG_WSCLIENT_IDLE:
    case CG_WSCLIENT_RESOLVING:
        end_failed(w, 0, "closed before it connected");
        return;
    case CG_WSCLIENT_CONNECTING: /* nothing to say goodbye with yet: the connection goes */
        cg_wsconn_clear(&w->conn);
        if (w->conn.wsi)
            cg_net_kill_async(w->conn.net, w->conn.wsi, PENDING_TIMEOUT_KILLED_BY_PARENT);
        return;
    case CG_WSCLIENT_OPEN:
        if (!keep_queue)
            cg_wsconn_clear(&w->conn);
        cg_wsconn_close(&w->conn, code, reason); /* queued behind what is kept */
        return;
    case CG_WSCLIENT_ENDED:
        return;
    }
}

void cg_wsclient_close(cg_wsclient *w, int code, const char *reason)
{
    close_keeping(w, code, reason, 0);
}

void cg_wsclient_finish(cg_wsclient *w, int code, const char *reason)
{
    close_keeping(w, code, reason, 1);
}

/* The app's close frame, checked: kept for the end. */
static void peer_close(cg_wsclient *w, const unsigned char *in, size_t len)
{
    w->close_invalid = cg_ws_close_check(in, len) != 0;
    w->close_reason[0] = 0;
    if (w->close_invalid) {
        w->close_code = 0;
    } else if (len >= 2) {
        w->close_code = in[0] << 8 | in[1];
        snprintf(w->close_reason, sizeof(w->close_reason), "%.*s", (int)(len - 2), (const char *)in + 2);
    } else {
        w->close_code = 1005; /* a close frame with no status */
    }
}

/* The handshake failed: why, from what lws and OpenSSL know. */
static void connection_error(cg_wsclient *w, struct lws *wsi, const char *in)
{
    char why[300];
    unsigned status = lws_http_client_http_response(wsi);
    const char *tls = cg_net_tls_refusal(wsi);
    if (status)
        snprintf(why, sizeof(why), "refused the connection with HTTP %u", status);
    else if (tls)
        snprintf(why, sizeof(why), "could not be reached: its TLS certificate was refused: %s", tls);
    else
        snprintf(why, sizeof(why), "could not be reached: %s", in ? in : "connection failed");
    end_failed(w, status, why);
}

static void on_receive(cg_wsclient *w, struct lws *wsi, const char *in, size_t len)
{
    const char *msg;
    size_t msg_len;
    if (!cg_wsconn_receive(&w->conn, lws_is_first_fragment(wsi), lws_is_final_fragment(wsi), in, len,
                           w->max_message, &msg, &msg_len))
        return;
    if (w->ops->message)
        w->ops->message(w, msg, msg_len, lws_frame_is_binary(wsi));
    cg_wsconn_received(&w->conn);
}

int cg_wsclient_callback(struct lws *wsi, enum lws_callback_reasons reason, void *user, void *in, size_t len)
{
    cg_wsclient *w = lws_get_opaque_user_data(wsi);
    if (!w || w->state == CG_WSCLIENT_ENDED)
        return lws_callback_http_dummy(wsi, reason, user, in, len);
    switch (reason) {
    case LWS_CALLBACK_CLIENT_APPEND_HANDSHAKE_HEADER:
        return w->ops->headers ? w->ops->headers(w, (unsigned char **)in, *(unsigned char **)in + len) : 0;
    case LWS_CALLBACK_CLIENT_FILTER_PRE_ESTABLISH:
        if (w->ops->accepted)
            w->ops->accepted(w, wsi);
        return 0;
    case LWS_CALLBACK_CLIENT_ESTABLISHED:
        w->state = CG_WSCLIENT_OPEN;
        cg_keepalive_add(w->conn.net->keepalive, &w->ka, wsi);
        cg_wsconn_open(&w->conn, wsi); /* a close asked for meanwhile goes now */
        if (w->ops->opened)
            w->ops->opened(w);
        return 0;
    case LWS_CALLBACK_CLIENT_WRITEABLE:
        /* a ping that is due goes first, but never after a close frame */
        if (!cg_wsconn_closing(&w->conn) && cg_keepalive_writable(w->conn.net->keepalive, &w->ka) < 0)
            return -1;
        return cg_wsconn_writable(&w->conn);
    case LWS_CALLBACK_CLIENT_RECEIVE_PONG:
        cg_keepalive_seen(w->conn.net->keepalive, &w->ka);
        return 0;
    case LWS_CALLBACK_CLIENT_RECEIVE: {
        cg_flusher *f = w->conn.net->flush;
        cg_keepalive_seen(w->conn.net->keepalive, &w->ka);
        on_receive(w, wsi, in, len);
        cg_flush_event_end(f, wsi); /* what it made for its client goes now (flush.h) */
        return 0;
    }
    case LWS_CALLBACK_WS_PEER_INITIATED_CLOSE:
        peer_close(w, in, len);
        return 0;
    case LWS_CALLBACK_CLIENT_CONNECTION_ERROR:
        lws_set_opaque_user_data(wsi, NULL);
        connection_error(w, wsi, in);
        return 0;
    case LWS_CALLBACK_CLIENT_CLOSED:
    case LWS_CALLBACK_WSI_DESTROY: { /* gone without CLIENT_CLOSED: lost */
        lws_set_opaque_user_data(wsi, NULL);
        if (w->state != CG_WSCLIENT_OPEN) {
            end_failed(w, 0, "could not be reached: the connection was lost during the handshake");
            return 0;
        }
        cg_wsclient_end e = {.opened = 1, .code = w->close_code, .reason = w->close_reason,
                             .invalid = w->close_invalid};
        end(w, &e);
        return 0;
    }
    default:
        return lws_callback_http_dummy(wsi, reason, user, in, len);
    }
}
