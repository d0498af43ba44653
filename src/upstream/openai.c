/*
 * openai.c: an OpenAI-compatible chat completions server (llama.cpp server, vLLM,
 * Ollama, OpenAI, LiteLLM), one streaming POST {base}/chat/completions per message.
 *
 * A call goes: resolve the host (off the loop) -> connect -> send headers and the JSON body
 * -> read server-sent events, each a chunk with choices[0].delta.content, until
 * `data: [DONE]`. One uv timer enforces the phase's deadline: connect_timeout_ms until the
 * request is sent, first_byte_timeout_ms until the response's first bytes, idle_timeout_ms
 * between reads; the last two do not run while the call is paused (we are not reading, so
 * the upstream's silence means nothing) and start afresh on resume. Cancel closes the HTTP
 * connection, which is how the backend learns to stop generating.
 *
 * Failures say what happened (README, "Error codes"): not reached, or no HTTP answer ->
 * upstream_unavailable; a stream that ends without [DONE] or a finish_reason (cut) ->
 * upstream_unavailable, "mid-reply" only when reply text had come; a 4xx/5xx answer, an
 * error event, or a body that is not the protocol -> upstream_error. The error carries the
 * HTTP status and the server's own error type and code (cg_upstream_error_detail).
 *
 * Lifetime: the call holds a reference for its timer and one for its wsi; it is freed when
 * both are gone, whatever ended it (done, error, cancel, timeout).
 */
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "chatgate/core/error.h"
#include "chatgate/core/log.h"
#include "chatgate/core/sse.h"
#include "chatgate/upstream/upstream.h"

#define MAX_EVENT_BYTES (1 << 20) /* one server-sent event */
#define MAX_ERROR_BODY 4096       /* kept of a 4xx/5xx body */

typedef enum { PHASE_CONNECT, PHASE_FIRST_BYTE, PHASE_IDLE } call_phase;

struct cg_upstream_call {
    cg_upstream *up;
    const cg_upstream_events *ev; /* NULL once the call has ended */
    void *ctx;
    int refs;
    int ended;
    cg_resolve *resolve;
    struct lws *wsi;
    uv_timer_t timer;
    call_phase phase;
    char *path;
    char *body;
    size_t body_len;
    int status;       /* the HTTP status, 0 until the response headers came */
    int request_sent; /* the whole body went out: a connection error now is no answer */
    int event_stream; /* the answer's Content-Type is text/event-stream */
    size_t reply_bytes; /* of delta text relayed */
    int events_seen;
    int finish_seen; /* a chunk with a finish_reason: the reply is complete */
    int paused;
    cg_sse sse;
    json_t *usage;
    char error_body[MAX_ERROR_BODY + 1];
    size_t error_body_len;
};

static void call_unref(cg_upstream_call *c)
{
    if (--c->refs > 0)
        return;
    cg_sse_free(&c->sse);
    json_decref(c->usage);
    free(c->path);
    free(c->body);
    free(c);
}

static void timer_closed(uv_handle_t *h)
{
    call_unref(h->data);
}

/* Ends the call: no more callbacks, the timer goes, the connection is closed soon. */
static void call_end(cg_upstream_call *c)
{
    if (c->ended)
        return;
    c->ended = 1;
    c->ev = NULL;
    if (c->resolve) {
        cg_resolve_abandon(c->resolve);
        c->resolve = NULL;
    }
    uv_close((uv_handle_t *)&c->timer, timer_closed);
    if (c->wsi)
        cg_net_kill_async(c->up->net, c->wsi, PENDING_TIMEOUT_KILLED_BY_PARENT);
}

/* Ends the call with an error; error is the server's own error object (borrowed) or NULL. */
static void call_fail(cg_upstream_call *c, int err, json_t *error, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
static void call_fail(cg_upstream_call *c, int err, json_t *error, const char *fmt, ...)
{
    if (!c->ev)
        return;
    const cg_upstream_events *ev = c->ev;
    void *ctx = c->ctx;
    call_end(c);
    va_list ap;
    va_start(ap, fmt);
    cg_upstream_fail(ev, ctx, c->up->cfg, err, c->status, error, fmt, ap);
    va_end(ap);
}

static void call_done(cg_upstream_call *c)
{
    if (!c->ev)
        return;
    const cg_upstream_events *ev = c->ev;
    void *ctx = c->ctx;
    json_t *usage = json_incref(c->usage);
    call_end(c);
    ev->on_done(ctx, usage, NULL);
    json_decref(usage);
}

static void on_timeout(uv_timer_t *t)
{
    cg_upstream_call *c = t->data;
    static const char *const what[] = {"did not connect", "sent nothing", "went quiet"};
    static const char *const key[] = {"connect_timeout_ms", "first_byte_timeout_ms", "idle_timeout_ms"};
    const cg_upstream_config *cfg = c->up->cfg;
    int ms = c->phase == PHASE_CONNECT ? cfg->connect_timeout_ms
             : c->phase == PHASE_FIRST_BYTE ? cfg->first_byte_timeout_ms : cfg->idle_timeout_ms;
    call_fail(c, CG_E_UPSTREAM_TIMEOUT, NULL, "%s within %d ms (%s)", what[c->phase], ms, key[c->phase]);
}

/* Starts the phase's deadline afresh; a paused call waits for no first byte and no read
 * (the connect still runs, paused or not). */
static void arm(cg_upstream_call *c, call_phase phase)
{
    const cg_upstream_config *cfg = c->up->cfg;
    int ms = phase == PHASE_CONNECT ? cfg->connect_timeout_ms
             : phase == PHASE_FIRST_BYTE ? cfg->first_byte_timeout_ms : cfg->idle_timeout_ms;
    c->phase = phase;
    if (!c->ev)
        return;
    if (c->paused && phase != PHASE_CONNECT)
        uv_timer_stop(&c->timer);
    else
        uv_timer_start(&c->timer, on_timeout, (uint64_t)ms, 0);
}

/* ---- the reply ------------------------------------------------------------------------ */

/* One server-sent event: a chunk, an error object, or [DONE]. Returns 1 to stop. */
static int on_event(void *ctx, const char *event, const char *data, size_t len)
{
    cg_upstream_call *c = ctx;
    (void)event;
    c->events_seen++;
    if (strcmp(data, "[DONE]") == 0) {
        call_done(c);
        return 1;
    }
    json_error_t jerr;
    json_t *o = json_loadb(data, len, 0, &jerr);
    if (!json_is_object(o)) {
        json_decref(o);
        call_fail(c, CG_E_UPSTREAM_ERROR, NULL, "sent an event that is not a JSON object: %.80s", data);
        return 1;
    }
    json_t *err = json_object_get(o, "error");
    if (err) {
        json_t *m = json_is_object(err) ? json_object_get(err, "message") : err;
        const char *text = json_is_string(m) ? json_string_value(m) : "(no message)";
        if (c->reply_bytes)
            call_fail(c, CG_E_UPSTREAM_ERROR, err, "failed mid-reply, after %zu bytes of reply text: %.300s",
                      c->reply_bytes, text);
        else
            call_fail(c, CG_E_UPSTREAM_ERROR, err, "answered with an error event before any reply text: %.300s",
                      text);
        json_decref(o);
        return 1;
    }
    json_t *usage = json_object_get(o, "usage");
    if (json_is_object(usage)) {
        json_decref(c->usage);
        c->usage = json_incref(usage);
    }
    json_t *choice = json_array_get(json_object_get(o, "choices"), 0);
    json_t *finish = json_object_get(choice, "finish_reason");
    if (finish && !json_is_null(finish))
        c->finish_seen = 1;
    json_t *content = json_object_get(json_object_get(choice, "delta"), "content");
    if (json_is_string(content) && json_string_length(content) > 0) {
        c->reply_bytes += json_string_length(content);
        c->ev->on_delta(c->ctx, json_string_value(content), json_string_length(content));
    }
    json_decref(o);
    return c->ev ? 0 : 1;
}

/* The server's own words from a 4xx/5xx body: error.message, or the start of the text. */
static void fail_with_status(cg_upstream_call *c)
{
    c->error_body[c->error_body_len] = 0;
    json_t *o = json_loads(c->error_body, 0, NULL);
    json_t *err = json_object_get(o, "error");
    json_t *m = json_is_object(err) ? json_object_get(err, "message") : err;
    if (!json_is_string(m))
        m = json_object_get(o, "message");
    const char *text = json_is_string(m) ? json_string_value(m) : c->error_body;
    call_fail(c, CG_E_UPSTREAM_ERROR, err, "answered HTTP %d: %.300s", c->status, *text ? text : "(empty body)");
    json_decref(o);
}

static void on_body(cg_upstream_call *c, const char *in, size_t len)
{
    arm(c, PHASE_IDLE);
    if (c->status >= 300) {
        size_t room = MAX_ERROR_BODY - c->error_body_len;
        size_t n = len < room ? len : room;
        memcpy(c->error_body + c->error_body_len, in, n);
        c->error_body_len += n;
        return;
    }
    if (cg_sse_feed(&c->sse, in, len) < 0)
        call_fail(c, CG_E_UPSTREAM_ERROR, NULL, "sent an event over %d bytes", MAX_EVENT_BYTES);
}

/*
 * The response ended, cleanly or not: lws 4.1 reports a connection reset mid-body as a
 * completed response too, so a stream without [DONE] or a finish_reason is taken as cut.
 */
static void on_end(cg_upstream_call *c)
{
    if (c->status >= 300)
        fail_with_status(c);
    else if (c->finish_seen)
        call_done(c); /* no [DONE], but the last chunk said why it finished */
    else if (c->reply_bytes)
        call_fail(c, CG_E_UPSTREAM_UNAVAILABLE, NULL,
                  "cut the stream mid-reply, after %zu bytes of reply text (no [DONE])", c->reply_bytes);
    else if (c->events_seen || c->event_stream)
        call_fail(c, CG_E_UPSTREAM_UNAVAILABLE, NULL, "cut the stream before any reply text (no [DONE])");
    else
        call_fail(c, CG_E_UPSTREAM_ERROR, NULL,
                  "answered HTTP %d without any server-sent event (is it OpenAI-compatible?)", c->status);
}

/* Notes the answer's status and whether it is an event stream. */
static void on_response(cg_upstream_call *c, struct lws *wsi)
{
    c->status = (int)lws_http_client_http_response(wsi);
    char type[128];
    c->event_stream = lws_hdr_copy(wsi, type, sizeof(type), WSI_TOKEN_HTTP_CONTENT_TYPE) > 0 &&
                      strncasecmp(type, "text/event-stream", 17) == 0;
}

/* ---- the connection ------------------------------------------------------------------- */

static int add_headers(cg_upstream_call *c, struct lws *wsi, unsigned char **p, unsigned char *end)
{
    char len[32];
    snprintf(len, sizeof(len), "%zu", c->body_len);
    if (lws_add_http_header_by_token(wsi, WSI_TOKEN_HTTP_CONTENT_TYPE, (const unsigned char *)"application/json",
                                     16, p, end) ||
        lws_add_http_header_by_token(wsi, WSI_TOKEN_HTTP_CONTENT_LENGTH, (const unsigned char *)len,
                                     (int)strlen(len), p, end) ||
        lws_add_http_header_by_token(wsi, WSI_TOKEN_HTTP_ACCEPT, (const unsigned char *)"text/event-stream",
                                     17, p, end))
        return -1;
    const char *key = c->up->cfg->api_key_env ? getenv(c->up->cfg->api_key_env) : NULL;
    if (key && *key) {
        /* built with its real length: a key is as long as its issuer likes */
        size_t n = strlen("Bearer ") + strlen(key);
        char *auth = malloc(n + 1);
        if (!auth)
            return -1;
        snprintf(auth, n + 1, "Bearer %s", key);
        int rc = n > INT_MAX ? -1
                             : lws_add_http_header_by_token(wsi, WSI_TOKEN_HTTP_AUTHORIZATION,
                                                            (const unsigned char *)auth, (int)n, p, end);
        free(auth);
        if (rc) {
            call_fail(c, CG_E_UPSTREAM_ERROR, NULL, "request could not be sent: the API key in %s (%zu bytes) "
                      "does not fit the request headers", c->up->cfg->api_key_env, strlen(key));
            return -1;
        }
    }
    lws_client_http_body_pending(wsi, 1);
    lws_callback_on_writable(wsi);
    return 0;
}

static int write_body(cg_upstream_call *c, struct lws *wsi)
{
    unsigned char *buf = malloc(LWS_PRE + c->body_len);
    if (!buf)
        return -1;
    memcpy(buf + LWS_PRE, c->body, c->body_len);
    int n = lws_write(wsi, buf + LWS_PRE, c->body_len, LWS_WRITE_HTTP_FINAL);
    free(buf);
    lws_client_http_body_pending(wsi, 0);
    c->request_sent = 1;
    arm(c, PHASE_FIRST_BYTE);
    return n < (int)c->body_len ? -1 : 0;
}

/* The wsi is gone: drop its reference (once, whichever callback says so first). */
static void wsi_gone(struct lws *wsi, cg_upstream_call *c)
{
    lws_set_opaque_user_data(wsi, NULL);
    c->wsi = NULL;
    call_unref(c);
}

int cg_upstream_openai_callback(struct lws *wsi, enum lws_callback_reasons reason, void *user, void *in,
                                size_t len)
{
    cg_upstream_call *c = lws_get_opaque_user_data(wsi);
    if (!c)
        return lws_callback_http_dummy(wsi, reason, user, in, len);
    switch (reason) {
    case LWS_CALLBACK_CLIENT_APPEND_HANDSHAKE_HEADER:
        if (!c->ev)
            return -1;
        return add_headers(c, wsi, (unsigned char **)in, *(unsigned char **)in + len);
    case LWS_CALLBACK_CLIENT_HTTP_WRITEABLE:
        if (!c->ev)
            return -1;
        return write_body(c, wsi);
    case LWS_CALLBACK_ESTABLISHED_CLIENT_HTTP:
        on_response(c, wsi);
        return c->ev ? 0 : -1;
    case LWS_CALLBACK_RECEIVE_CLIENT_HTTP: {
        char buf[4096 + LWS_PRE];
        char *p = buf + LWS_PRE;
        int n = (int)sizeof(buf) - LWS_PRE;
        if (!c->ev || lws_http_client_read(wsi, &p, &n) < 0)
            return -1;
        return c->ev ? 0 : -1;
    }
    case LWS_CALLBACK_RECEIVE_CLIENT_HTTP_READ:
        if (c->ev)
            on_body(c, in, len);
        return c->ev ? 0 : -1;
    case LWS_CALLBACK_COMPLETED_CLIENT_HTTP:
        on_end(c);
        return -1;
    case LWS_CALLBACK_CLIENT_CONNECTION_ERROR:
        /* lws says so both when the connect fails and when no HTTP response comes */
        if (c->request_sent)
            call_fail(c, CG_E_UPSTREAM_UNAVAILABLE, NULL, "sent no HTTP answer to the request: %s",
                      in ? (const char *)in : "connection lost");
        else
            call_fail(c, CG_E_UPSTREAM_UNAVAILABLE, NULL, "could not be reached: %s",
                      in ? (const char *)in : "connection failed");
        wsi_gone(wsi, c);
        return 0;
    case LWS_CALLBACK_CLOSED_CLIENT_HTTP:
        if (c->status)
            on_end(c);
        else
            call_fail(c, CG_E_UPSTREAM_UNAVAILABLE, NULL, "closed the connection before answering");
        wsi_gone(wsi, c);
        return 0;
    case LWS_CALLBACK_WSI_DESTROY: /* the last word: a call still waiting would wait for ever */
        call_fail(c, CG_E_UPSTREAM_UNAVAILABLE, NULL, "connection was lost");
        wsi_gone(wsi, c);
        return 0;
    default:
        return lws_callback_http_dummy(wsi, reason, user, in, len);
    }
}

/* ---- the call ------------------------------------------------------------------------- */

static void on_resolved(void *data, const char *address, const char *err)
{
    cg_upstream_call *c = data;
    c->resolve = NULL;
    if (!address) {
        call_fail(c, CG_E_UPSTREAM_UNAVAILABLE, NULL, "%s ('%s')", err, c->up->cfg->host);
        return;
    }
    c->refs++; /* the wsi's; dropped by wsi_gone */
    /* lws stores the wsi in c->wsi early; wsi_gone clears it if the connection dies at once */
    if (!cg_upstream_connect(c->up, address, c->path, "POST", CG_LWS_PROTOCOL_OPENAI, c, &c->wsi) &&
        c->refs > 1) {
        /* lws gave up before any callback could report it */
        call_fail(c, CG_E_UPSTREAM_UNAVAILABLE, NULL, "could not be reached at %s:%d", address, c->up->cfg->port);
        call_unref(c);
    } else if (c->wsi && c->paused) {
        lws_rx_flow_control(c->wsi, 0);
    }
}

/* Appends {"role": role, "content": content}; -1 when it cannot be built (text that is not
 * UTF-8, no memory), so that no message is silently left out of the request. */
static int append_message(json_t *messages, const char *role, json_t *content)
{
    return content ? json_array_append_new(messages, json_pack("{s:s, s:o}", "role", role, "content", content)) : -1;
}

/* system (prompt + state summary), the history, then the user's message; NULL on failure */
static char *build_body(const cg_upstream_config *cfg, const cg_upstream_message *m, size_t *len)
{
    json_t *messages = json_array();
    if (!messages)
        return NULL;
    const char *prompt = cfg->system_prompt ? cfg->system_prompt : "";
    const char *summary = m->summary ? m->summary : "";
    int failed = 0;
    if (*prompt || *summary) {
        size_t n = strlen(prompt) + strlen(summary) + 2;
        char *system = malloc(n);
        if (system) {
            snprintf(system, n, "%s%s%s", prompt, *prompt && *summary ? "\n" : "", summary);
            failed |= append_message(messages, "system", json_string(system)) < 0;
            free(system);
        } else {
            failed = 1;
        }
    }
    size_t i;
    json_t *h;
    json_array_foreach(m->history, i, h) {
        json_t *role = json_object_get(h, "role"), *content = json_object_get(h, "content");
        if (json_is_string(role) && json_is_string(content))
            failed |= append_message(messages, json_string_value(role), json_incref(content)) < 0;
    }
    failed |= append_message(messages, "user", json_string(m->enriched ? m->enriched : m->text)) < 0;
    if (failed) {
        json_decref(messages);
        return NULL;
    }
    json_t *o = json_pack("{s:s, s:b, s:{s:b}, s:o}", "model", cfg->model ? cfg->model : "default", "stream", 1,
                          "stream_options", "include_usage", 1, "messages", messages);
    if (!o)
        return NULL;
    char *s = json_dumps(o, JSON_COMPACT);
    json_decref(o);
    if (s)
        *len = strlen(s);
    return s;
}

static int openai_start(cg_upstream *up, void **conn_slot, const cg_upstream_message *m,
                        const cg_upstream_events *ev, void *ctx, cg_upstream_call **out)
{
    (void)conn_slot;
    cg_upstream_call *c = calloc(1, sizeof(*c));
    if (!c)
        return -1;
    c->up = up;
    c->body = build_body(up->cfg, m, &c->body_len);
    size_t plen = strlen(up->cfg->path) + sizeof("/chat/completions");
    c->path = malloc(plen);
    if (!c->body || !c->path) {
        free(c->body);
        free(c->path);
        free(c);
        return -1;
    }
    snprintf(c->path, plen, "%s/chat/completions", up->cfg->path);
    cg_sse_init(&c->sse, MAX_EVENT_BYTES, on_event, c);
    c->ev = ev;
    c->ctx = ctx;
    c->refs = 1; /* the timer's */
    uv_timer_init(up->net->loop, &c->timer);
    c->timer.data = c;
    arm(c, PHASE_CONNECT);
    c->resolve = cg_resolve_start(up->net->loop, up->cfg->host, on_resolved, c);
    if (!c->resolve) {
        c->ended = 1;
        c->ev = NULL;
        uv_close((uv_handle_t *)&c->timer, timer_closed);
        return -1;
    }
    *out = c;
    return 0;
}

static void openai_cancel(cg_upstream_call *c)
{
    call_end(c);
}

static void openai_pause(cg_upstream_call *c, int paused)
{
    if (c->ended || c->paused == !!paused)
        return;
    c->paused = !!paused;
    if (c->wsi)
        lws_rx_flow_control(c->wsi, !paused);
    if (c->phase != PHASE_CONNECT) /* connecting goes on, paused or not: its deadline stays */
        arm(c, c->phase);          /* stops the first-byte or idle deadline, or starts it afresh */
}

const cg_upstream_ops cg_upstream_openai_ops = {
    .kind = "openai",
    .start = openai_start,
    .cancel = openai_cancel,
    .pause = openai_pause,
    .close_conn = NULL,
};
