/*
 * dropin.h: drop-in mode (docs/protocol.md, "Drop-in mode"): chatgate in front of an existing chat app
 * whose browser code speaks its own WebSocket protocol, changing only the URL its client
 * connects to.
 *
 * A client connection on the drop-in path gets one upstream connection to the app, with the
 * client's path, query, subprotocol and chosen headers (Cookie, Authorization). Frames that
 * are not chat messages pass through untouched, both ways, in order; a chat message (found
 * by a JSON pointer in the config) goes through the pipeline and is forwarded as written
 * plus one added object (`chatgate`: route, service, params, resolution, enriched, ...); the
 * app's frames come back untouched but for a state directive under a configured key, which
 * is applied to the dialog and removed. A cancel phrase, or the client's own cancel frame,
 * sends the app the cancel frame the mapping names, or else stops relaying the rest of that
 * reply. When the app closes, the client is closed with the same code and reason.
 *
 * Chat messages are turns like chatgate.v1 messages (turn.h): the connection's token bucket,
 * queue_limit messages waiting, and the dialog's lock, held from the load to the end of the
 * turn (the app's end or cancelled marker, the connection's next chat message, or
 * dropin.turn_timeout_ms of silence). What the app's protocol cannot say (over a limit) is
 * logged and counted.
 */
#ifndef CHATGATE_DROPIN_H
#define CHATGATE_DROPIN_H

#include <uv.h>
#include <libwebsockets.h>
#include <jansson.h>

#include "chatgate/server/server.h"

typedef struct cg_dropin cg_dropin;

#define CG_LWS_PROTOCOL_DROPIN_APP "cg-dropin-app"

/* Starts drop-in for a client connection just established on the drop-in path: copies what
 * is forwarded from the handshake and connects to the app; plan is the one the client's
 * token named ("" for none: limits_config.h). NULL on failure (logged). */
cg_dropin *cg_dropin_open(cg_server *srv, struct lws *client, const char *user, const char *plan, const char *name);
/* One whole frame from the client. */
void cg_dropin_client_frame(cg_dropin *d, const char *buf, size_t len, int binary);
/* Closes the client with code and reason (1009 for a frame over --max-frame: the app's
 * protocol has no error frame of ours to say it with). */
void cg_dropin_client_refuse(cg_dropin *d, int code, const char *reason);
/* The client connection is writable: writes what it takes (at shutdown, then a close frame);
 * -1 closes the connection. */
int cg_dropin_client_writable(cg_dropin *d);
/* 1 once the client's close frame is queued or out (wsconn.h, cg_wsconn_closing). */
int cg_dropin_client_closing(const cg_dropin *d);
/* The client is gone: the app connection goes too; d is freed when that is done. */
void cg_dropin_close(cg_dropin *d);

/*
 * The client's handshake waits for the app's (listener.h holds its head): the client gets
 * its 101 only once the app has sent its own, with the app's Set-Cookie, or the app's
 * refusal (401 or 403 as the app said it, else 502), as a proxy would answer it; a client
 * connecting right after another is the app's before anything else is said.
 *
 * cg_dropin_hold runs the handshake's checks and the client's identity on the held head and,
 * when they pass, opens the app connection: 0, held (its rx flow stays off until the app
 * answers); -1 when not held (the checks refuse it, or the app cannot be opened): the
 * handshake goes on at once, refused or served as without a hold. The callbacks of the
 * client's handshake then ask: cg_dropin_confirm_held (CONFIRM_UPGRADE: 1 when the app
 * refused, its answer written), cg_dropin_add_headers (ADD_HEADERS: the app's Set-Cookie),
 * cg_dropin_take_held (ESTABLISHED: the session takes d, and its user), and
 * cg_dropin_client_gone (WSI_DESTROY before that: d goes as for a client that left).
 */
int cg_dropin_hold(cg_server *srv, struct lws *client);
/* Who a drop-in client is: with auth none the app's session cookie (dropin.user_cookie)
 * when it sends one, else as for chatgate.v1 (a resume token, or a fresh id); with --auth
 * as for chatgate.v1; 0, or -1 with err. plan is CG_MAX_PLAN_NAME + 1 bytes. */
int cg_dropin_identify(cg_server *srv, struct lws *client, char *user, size_t userlen, char *plan, char *err,
                       size_t errlen);
int cg_dropin_confirm_held(struct lws *client);
int cg_dropin_add_headers(struct lws *client, void *in);
cg_dropin *cg_dropin_take_held(struct lws *client, char *user, size_t userlen, const char *name);
void cg_dropin_client_gone(struct lws *client);

#endif
