/*
 * upstream.h: the backends that answer messages, behind one table of operations.
 *
 * Three kinds (docs/protocol.md, "Upstreams"): the built-in demo, an OpenAI-compatible HTTP server
 * streaming server-sent events, and a chat app's own WebSocket server. A session starts a
 * call for one message and hears back through cg_upstream_events:
 *
 *   - start() either fails at once (returns < 0, never calls back) or returns 0 and later
 *     calls on_delta zero or more times, then exactly one of on_done or on_error, always
 *     from the event loop, never from inside start() itself;
 *   - after cancel(), no callback comes for that call, and the upstream is told to stop
 *     (the HTTP request is closed; a WebSocket app is sent {"type":"cancel","id":...});
 *   - pause(call, 1) stops reading from the upstream until pause(call, 0): the session's
 *     send buffer is full because its client reads slowly. While paused, the first-byte and
 *     idle timeouts do not run (silence is ours, not the upstream's); resuming re-arms them
 *     in full. A pause belongs to the call: the next call on a kept connection starts
 *     unpaused.
 *
 * The network kinds keep this contract through one call core (call.h): deadlines, replicas,
 * retries and the guards on these callbacks are the core's, the protocol the kind's.
 *
 * The call is owned by the upstream module; the caller forgets it after on_done, on_error or
 * cancel. Kinds that keep one upstream connection per client connection (ws) keep it in the
 * slot the session passes to start(), and close it in close_conn() when the client goes.
 */
#ifndef CHATGATE_UPSTREAM_H
#define CHATGATE_UPSTREAM_H

#include <stdarg.h>
#include <uv.h>
#include <libwebsockets.h>
#include <jansson.h>

#include "chatgate/config/config.h"
#include "chatgate/core/metrics.h"
#include "chatgate/core/net.h"

typedef struct cg_upstream cg_upstream;
typedef struct cg_upstream_call cg_upstream_call;

typedef struct cg_upstream_events {
    void (*on_delta)(void *ctx, const char *text, size_t len);
    /* usage and state are borrowed (NULL when the upstream gave none); state is a
     * WebSocket app's state directive (docs/state.md, "The state directive") or, with
     * state_tool, the model's chatgate_state arguments (a string when they are not an
     * object: refused) */
    void (*on_done)(void *ctx, json_t *usage, json_t *state);
    /* err is a CG_E_UPSTREAM_* code; message names the upstream and what went wrong.
     * detail (borrowed, NULL when there is nothing to add) holds what the upstream itself
     * said, as the error frame's extra fields: "status" (the HTTP status it answered with),
     * "upstream_type" and "upstream_code" (its error object's type and code), each present
     * only when known (cg_upstream_error_detail). */
    void (*on_error)(void *ctx, int err, const char *message, json_t *detail);
} cg_upstream_events;

/* What the gateway forwards for one message; start() copies what it keeps. */
typedef struct cg_upstream_message {
    const char *id;
    const char *user;
    const char *room;
    const char *text;
    const char *route;
    const char *service; /* the active service, or NULL */
    json_t *params;      /* merged params of service (flat object) */
    json_t *awaiting;    /* the awaiting state before this message, or NULL */
    json_t *soft;        /* soft context, or NULL */
    json_t *tool_result; /* the last tool result (within tool_result_cap), or NULL */
    json_t *profile;     /* the user's profile (name -> value), or NULL */
    json_t *history;     /* the last messages before this one: [{role, content, ts}] */
    const char *summary; /* the state in a sentence, for an LLM's system message; "" but for
                            a kind whose ops say reads_summary */
    const char *enriched; /* the rewritten message, or NULL; an LLM gets it instead of text */
    json_t *resolution;   /* what this message resolved, or NULL */
    json_t *annotations;  /* {"metadata": {...}} */
    json_t *rules;        /* names of the rules that fired */
} cg_upstream_message;

typedef struct cg_upstream_ops {
    const char *kind;
    int reads_summary; /* reads cg_upstream_message.summary: the turn builds it only then */
    int (*start)(cg_upstream *up, void **conn_slot, const cg_upstream_message *m,
                 const cg_upstream_events *ev, void *ctx, cg_upstream_call **call);
    void (*cancel)(cg_upstream_call *call);
    void (*pause)(cg_upstream_call *call, int paused);
    /* Inside on_done: the replica that answered (-1: the kind has one URL) and the attempts
     * the call took. NULL: one URL, one attempt. */
    void (*answered)(const cg_upstream_call *call, int *replica, int *attempts);
    /* The client connection that owns *conn_slot is gone; NULL when the kind keeps none. */
    void (*close_conn)(void *conn);
    /* The gateway stops: frees up->state (what the kind keeps between calls); NULL when the
     * kind keeps nothing. No call of the upstream is running. */
    void (*close)(cg_upstream *up);
} cg_upstream_ops;

struct cg_upstream {
    const cg_upstream_ops *ops;
    const cg_upstream_config *cfg;
    const cg_net *net; /* the loop and lws context its connections live on */
    /* where its connection counters go (cg_metrics' upstream_conns_*), by its index among
     * the upstreams; NULL: not counted */
    cg_metrics *metrics;
    int index;
    void *state; /* the kind's own, made at its first call (openai: its pool, URL, headers) */
};

extern const cg_upstream_ops cg_upstream_demo_ops;
extern const cg_upstream_ops cg_upstream_openai_ops;
extern const cg_upstream_ops cg_upstream_ws_ops;

/* The lws protocol of the ws upstream's client connections, registered by the gateway's
 * vhost with core/wsclient.h's callback (the OpenAI-compatible upstream's connections are
 * libcurl's, http_pool.h). */
#define CG_LWS_PROTOCOL_WS "cg-upstream-ws"

/* Picks the ops for cfg->kind and fills up; metrics (may be NULL) gets its connection
 * counters at index, its place among the gateway's upstreams (below CG_MAX_UPSTREAMS). */
void cg_upstream_init(cg_upstream *up, const cg_net *net, const cg_upstream_config *cfg, cg_metrics *metrics,
                      int index);

/* Adds headers ("Name: value" each) to an lws client handshake at *p (below end), for the
 * CLIENT_APPEND_HANDSHAKE_HEADER callback, but those skip (may be NULL) also names; -1 when
 * they do not fit. */
int cg_upstream_append_headers(struct lws *wsi, const cg_headers *headers, const cg_headers *skip, unsigned char **p,
                               unsigned char *end);

/* The gateway stops: what the upstream keeps between calls (the OpenAI pool's idle
 * connections) is closed. No call of it may be running. */
void cg_upstream_close(cg_upstream *up);

/*
 * Shared by the kinds' error paths. cg_upstream_error_detail builds an on_error detail:
 * status (0 for none) and, from error (the upstream's own error object, borrowed, or NULL),
 * its "type" (a string) and "code" (a string or an integer), strings cut to 128 bytes on a
 * character boundary. NULL when there is nothing to say. cg_upstream_fail formats
 * "upstream 'NAME' " + fmt, with its real length, and calls ev->on_error with the detail.
 */
json_t *cg_upstream_error_detail(int status, json_t *error);
void cg_upstream_fail(const cg_upstream_events *ev, void *ctx, const cg_upstream_config *cfg, int err, int status,
                      json_t *error, const char *fmt, va_list ap) __attribute__((format(printf, 7, 0)));

#endif
