/*
 * session.h: one client WebSocket connection speaking chatgate.v1.
 *
 * The session reads frames (reassembling fragments up to --max-frame), answers bad input
 * with an error frame, keeps a bounded queue of messages waiting for the reply in flight
 * (DESIGN.md section 1, "Arrival"), runs one message at a time through the pipeline to an
 * upstream, and relays the reply. What it sends waits in a bounded send queue written one
 * frame per WRITEABLE callback; when that queue passes its high-water mark the upstream is
 * paused (and, if the client keeps sending without reading, the client too), so a slow
 * client costs at most a bounded buffer. Every message gets exactly one terminal frame:
 * done, cancelled or error.
 */
#ifndef CHATGATE_SESSION_H
#define CHATGATE_SESSION_H

#include <uv.h>
#include <libwebsockets.h>

typedef struct cg_session cg_session;

/* The lws callback of the "chatgate.v1" protocol (also the vhost's HTTP handler). */
int cg_session_callback(struct lws *wsi, enum lws_callback_reasons reason, void *user, void *in,
                        size_t len);
/* lws sizes per-connection data with this. */
size_t cg_session_size(void);

/*
 * Checks a close frame's payload from a peer (RFC 6455 5.5.1, 7.4): empty, or a status code
 * of 1000-4999 that may be sent (not 1004, 1005, 1006, 1015, nor 1016-2999) followed by a
 * UTF-8 reason. 0 when valid, else the code to answer with: 1002 (protocol error) or 1007 (a
 * reason not UTF-8).
 */
int cg_ws_close_payload_check(const void *payload, size_t len);

#endif
