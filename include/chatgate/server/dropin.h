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
/* Nothing is queued for the client (shutdown closes it then). */
int cg_dropin_client_idle(cg_dropin *d);
/* The client connection is writable: writes one frame; -1 closes the connection. */
int cg_dropin_client_writable(cg_dropin *d);
/* The client is gone: the app connection goes too; d is freed when that is done. */
void cg_dropin_close(cg_dropin *d);

/* The lws callback of the upstream (app) connections. */
int cg_dropin_app_callback(struct lws *wsi, enum lws_callback_reasons reason, void *user, void *in, size_t len);

#endif
