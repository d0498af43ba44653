/*
 * listener.h: the gateway's own listening sockets, single process and --workers alike.
 *
 * Why not lws's listener: libwebsockets 4.1.6 as Debian ships it cannot share a port
 * between workers (SO_REUSEPORT, its issue 2470, fixed in 4.4), and it answers a WebSocket
 * upgrade in the same call that parses it, so a drop-in client would get its 101 before the
 * app has answered its own handshake. So the gateway accepts connections itself, reads each
 * one's request head into a buffer of its own (at most max_header_bytes x 4 + 2 KiB, within
 * 10 s), and hands the socket and the head to its vhost (lws_adopt_socket_vhost_readbuf),
 * which serves it as if lws had accepted it: HTTP (the page, /healthz, /metrics, /admin) and
 * WebSocket upgrades alike.
 *
 * A WebSocket upgrade under the drop-in path is handed over without the head's last CRLF:
 * lws has parsed every header (a handler can read them) but not the end of the head, and
 * reads nothing more while the connection's rx flow is off, so the client waits while the
 * gateway opens its app connection (dropin.h, cg_dropin_hold). When the app has answered,
 * the flow goes on, lws reads the CRLF and answers the client: 101 with the app's cookies,
 * or the app's refusal.
 *
 * An upgrade whose request target holds dot segments ("/../ws", "/./ws") is answered 400
 * here: lws would collapse them before any handler saw them.
 */
#ifndef CHATGATE_SERVER_LISTENER_H
#define CHATGATE_SERVER_LISTENER_H

#include <uv.h>
#include <libwebsockets.h>

#include "chatgate/server/server.h"

#define CG_LISTEN_SHARED 1 /* SO_REUSEPORT: --workers share the port */
#define CG_LISTEN_DROPIN 2 /* drop-in upgrades are held for their app (the main listener) */

/* Binds host:port and serves its connections on vh (flags: CG_LISTEN_*); `what` names it in
 * logs. 0, or -1 (logged). At most two listeners (the main one and the admin one). Needs
 * srv->net.loop. */
int cg_listener_open(cg_server *srv, struct lws_vhost *vh, const char *host, int port, int flags, const char *what);

/* The drain's start: the listeners close; heads still being read are dropped. */
void cg_listener_close_all(void);

#endif
