/*
 * handshake.h: what a connection must pass before it is a session: the request's size, the
 * path, the browser's Origin, the connection limit and shutdown, and who the user is (a
 * resume token or a fresh id, a JWT, a proxy's header, or the drop-in app's session cookie;
 * docs/protocol.md, "Identity"). Also the HTTP answers written by hand and the check of a
 * peer's close frame, which chatgate.v1 and drop-in share.
 */
#ifndef CHATGATE_SERVER_HANDSHAKE_H
#define CHATGATE_SERVER_HANDSHAKE_H

#include <libwebsockets.h>
#include <stddef.h>
#include <stdint.h>

#include "chatgate/server/server.h"

/* Writes a whole HTTP answer (status, reason, a text body, connection: close); returns 1. */
int cg_http_refuse(struct lws *wsi, int status, const char *reason, const char *body);

/* The reason phrase of an HTTP status the gateway answers or passes on ("Error" for one it
 * does not name: RFC 9110 lets a client ignore the phrase). */
const char *cg_http_reason(int status);

/* When the request's headers pass max_header_bytes, answers 431 and returns 1; else 0. */
int cg_refuse_large_headers(struct lws *wsi);

/* A request without an Upgrade header on /ws or the drop-in path: answers 426 Upgrade
 * Required (with "upgrade: websocket" and a body that says what the path takes) and returns
 * 1; else 0. Without it such a request fell through to the pages' 404. */
int cg_refuse_plain_http_on_ws(struct lws *wsi);
/* lws 4.1 spins at 100% CPU on a request's body unless the request is answered within its
 * BODY_COMPLETION (a PUT to a page, a POST to /metrics, a POST to /admin answered later): a
 * request with a body is answered 413 before it is routed (no path here takes one). 1 when
 * answered (the caller closes). */
int cg_refuse_unread_body(struct lws *wsi);

/* LWS_CALLBACK_HTTP_CONFIRM_UPGRADE: 0 to accept; 1 when refused (the answer is written:
 * 404 off /ws and the drop-in path, 426 or 400 for a handshake not of RFC 6455, 403 for an
 * Origin not allowed, 503 while shutting down or over max_connections). */
int cg_handshake_confirm_upgrade(struct lws *wsi);

/* 1 when cg_handshake_confirm_upgrade would accept this upgrade; nothing written or logged
 * (a held drop-in client is asked before its app is opened, listener.h). */
int cg_handshake_upgrade_acceptable(struct lws *wsi);

/* The request is on the drop-in path or under it (/socket, /socket/websocket). */
int cg_handshake_is_dropin(const cg_server *srv, struct lws *wsi);
/* The same for a path (no query). */
int cg_handshake_path_is_dropin(const cg_server *srv, const char *path);

/* Who the connection is, by --auth, into user, and the plan its JWT names (limits.plan_claim)
 * into plan ("" when none; plan is CG_MAX_PLAN_NAME + 1 bytes); 0, or -1 with the reason in
 * err. now is unix seconds (a JWT's exp and nbf). */
int cg_handshake_identify(const cg_server *srv, struct lws *wsi, int64_t now, char *user, size_t userlen, char *plan,
                          char *err, size_t errlen);

/* The user id drop-in derives from the session cookie named by dropin.user_cookie (a hash,
 * so the cookie itself never reaches a key), into out; 0, or -1 when there is no such cookie. */
int cg_handshake_dropin_user(const cg_server *srv, struct lws *wsi, char *out, size_t outlen);


#endif
