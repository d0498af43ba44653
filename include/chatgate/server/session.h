/*
 * session.h: one client WebSocket connection speaking chatgate.v1.
 *
 * The session reads frames (reassembling fragments up to --max-frame), answers bad input
 * with an error frame, and hands each message to its turns (turn.h: the queue, the lock,
 * the pipeline, the upstream call), whose events it writes back as frames. What it sends
 * waits in a bounded send queue written at the end of the event or loop iteration, as many
 * frames as the socket takes (the writable callback only once it is full); when that queue
 * passes its high-water mark the upstream is paused (and, if the client keeps sending
 * without reading, the client too), so a slow client costs at most a bounded buffer. Every
 * message gets exactly one terminal frame: done, cancelled or error.
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

#endif
