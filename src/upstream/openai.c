/*
 * openai.c: an OpenAI-compatible chat completions server (llama.cpp server, vLLM,
 * Ollama, OpenAI, LiteLLM), one streaming POST {base}/chat/completions per message.
 *
 * A call goes: a transfer on the upstream's connection pool (http_pool.c: libcurl on our
 * loop; a kept-alive HTTP/1.1 connection when one is idle, else a new one, resolved and TLS
 * resumed by libcurl) -> the JSON body -> server-sent events, each a chunk with
 * choices[0].delta.content, until `data: [DONE]`. The call core (call.c) keeps the phase's
 * deadline (connect_timeout_ms until the request goes out, first_byte_timeout_ms until the
 * response's first bytes, idle_timeout_ms between reads), the replicas and the retries;
 * this file builds the request, reads the response and stops the transfer.
 *
 * The connection: after [DONE] the rest of the response (the chunked ending) is still read
 * (CG_CALL_DRAIN, at most idle_timeout_ms), so that the connection goes back to the pool;
 * the session has already heard done. Every other end takes the transfer out unfinished, and
 * libcurl closes that connection: a cancel (which is how the backend learns to stop
 * generating), an error, a cut, a timeout. A response with `Connection: close` or HTTP/1.0
 * is not kept either (libcurl's rule).
 *
 * Failures say what happened (docs/upstreams.md, "When an upstream fails"): not reached, or no HTTP answer ->
 * upstream_unavailable; a stream that ends without [DONE] or a finish_reason (cut) ->
 * upstream_unavailable, "mid-reply" only when reply text had come; a 4xx/5xx answer, an
 * error event, or a body that is not the protocol -> upstream_error. The error carries the
 * HTTP status and the server's own error type and code (cg_upstream_error_detail).
 *
 * Ownership: the upstream owns its openai_state (cg_upstream.state: the pool, and the URL and
 * headers every request shares), made at the first call and freed by cg_upstream_close at
 * the gateway's stop; the pool owns the easy handle; the call holds a reference for its
 * clock's timer and one for its transfer, and is freed when both are gone, whatever ended
 * it (done, error, cancel, timeout).
 */
#define _GNU_SOURCE /* asprintf */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "chatgate/core/alloc.h"
#include "chatgate/core/buf.h"
#include "chatgate/core/error.h"
#include "chatgate/core/jsonout.h"
#include "chatgate/core/log.h"
#include "chatgate/core/num.h"
#include "chatgate/core/sse.h"
#include "chatgate/upstream/call.h"
#include "chatgate/upstream/chunk.h"
#include "chatgate/upstream/http_pool.h"
#include "chatgate/upstream/upstream.h"

#define MAX_EVENT_BYTES (1 << 20) /* one server-sent event */
#define MAX_ERROR_BODY 4096       /* kept of a 4xx/5xx body */
#define MAX_TOOL_ARGS (64 << 10)  /* the arguments of the model's chatgate_state call */

/* What one upstream keeps between calls (cg_upstream.state). */
typedef struct openai_state {
    cg_http_pool *pool;         /* one for every replica: libcurl keeps connections per host */
    struct curl_slist *headers; /* JSON in, events out, the bearer token */
    char *urls[CG_MAX_REPLICAS]; /* {base}/chat/completions of each replica (upstreams.NAME.urls) */
    cg_replicas replicas;
} openai_state;

/* One transfer of a call, to one replica. A retry stops the transfer and starts another:
 * the stopped one's callbacks may still run until its done, and they find they are not
 * the call's current attempt any more, so they touch nothing of the call. */
typedef struct attempt {
    cg_upstream_call *c;
    int replica;
    char curl_error[CURL_ERROR_SIZE]; /* libcurl's words when the transfer fails */
} attempt;

struct cg_upstream_call {
    cg_call core;       /* first: the core's cg_call is this call */
    int refs;
    CURL *easy;         /* while the current transfer runs (the pool's) */
    cg_http_pool *pool; /* the upstream's */
    attempt *cur;       /* the current transfer's attempt, NULL when none runs */
    cg_call_clock clock;
    char *body;
    size_t body_len;
    int request_sent; /* the request went out: a connection error now is no answer */
    int event_stream; /* the answer's Content-Type is text/event-stream */
    int events_seen;
    int finish_seen; /* a chunk with a finish_reason: the reply is complete */
    cg_sse sse;
    cg_chunk_head head; /* the chunks' head, read once a reply (chunk.h) */
    json_t *usage;
    /* the model's call of chatgate_state (upstreams.NAME.state_tool): its index among the
     * reply's tool calls (-1: none yet) and its arguments as they stream, bounded */
    int tool_index;
    char *tool_args;
    size_t tool_args_len, tool_args_cap;
    char tool_id[128];    /* the call's id, for the continuation's tool message */
    json_t *tool_kept;    /* the directive of a call answered by a continuation (below) */
    int continued;        /* the continuation was asked for */
    int sse_fresh;        /* its stream starts: the parser starts again at its first bytes */
    int replica;          /* of the last transfer started */
    char error_body[MAX_ERROR_BODY + 1];
    size_t error_body_len;
};

/* The call has ended (c->core.ev is NULL from then on); after a done the response is still
 * read to its end, in CG_CALL_DRAIN, to keep the connection. */
static int ended(const cg_upstream_call *c)
{
    return !c->core.ev;
}

static void call_unref(cg_upstream_call *c)
{
    if (--c->refs > 0)
        return;
    cg_sse_free(&c->sse);
    json_decref(c->usage);
    free(c->tool_args);
    json_decref(c->tool_kept);
    free(c->body);
    free(c);
}

static void timer_closed(uv_handle_t *h)
{
    call_unref((cg_upstream_call *)((char *)h->data - offsetof(cg_upstream_call, clock)));
}

/* The call has ended and its transfer is gone: the timer goes. */
static void call_finish(cg_upstream_call *c)
{
    if (ended(c) && !c->easy && !uv_is_closing((uv_handle_t *)&c->clock.timer))
        uv_close((uv_handle_t *)&c->clock.timer, timer_closed);
}

/* The state directive the model's call of chatgate_state carries: its arguments, an object
 * (a directive the gateway then checks as an app's); anything else is passed as the text it
 * was, which the turn refuses and warns about (bad_frame). NULL when the model made no call. */
static json_t *tool_state(cg_upstream_call *c)
{
    if (c->tool_index < 0)
        return NULL;
    json_error_t jerr;
    json_t *state = json_loadb(c->tool_args ? c->tool_args : "", c->tool_args_len, 0, &jerr);
    if (json_is_object(state))
        return state;
    json_decref(state);
    cg_warn("upstream '%s': the model called chatgate_state with arguments that are not a JSON object (%s, at "
            "byte %d): no state is set",
            c->core.up->cfg->name, jerr.text, jerr.position);
    return json_string("the model's chatgate_state arguments were not a JSON object");
}

static int request_start(cg_upstream_call *c, openai_state *st, int r);

/*
 * A model that called chatgate_state and wrote nothing to the user (many do: a tool call ends
 * their turn) is asked once more, as function calling goes: the request again with the
 * model's call and a tool message saying the state is kept, and tool_choice "none", so that
 * it now writes its reply, which streams to the client. The call's directive waits in
 * tool_kept for the continuation's done. -1 when it could not be started (the call then ends
 * as it is: the state set, no text).
 */
/* What a request learns of its answer, forgotten before the next request of the call: a
 * retry's (whose status the core resets too) or the continuation's after a tool call, which
 * kept the first answer's 200 until issue 39's seventh round, so that a continuation that
 * failed before any header was taken for a 200 without events (a final upstream_error, not
 * retried, no fallback). */
static void request_reset(cg_upstream_call *c)
{
    c->request_sent = c->event_stream = c->events_seen = c->finish_seen = 0;
    c->error_body_len = 0;
    c->tool_index = -1;
    c->tool_args_len = 0;
    c->core.status = 0;
    c->core.retry_after_ms = 0;
}

static int continue_after_tool(cg_upstream_call *c)
{
    openai_state *st = c->core.up->state;
    json_t *body = json_loadb(c->body, c->body_len, 0, NULL);
    json_t *messages = json_object_get(body, "messages");
    json_t *call = json_pack("{s:s, s:n, s:[{s:s, s:s, s:{s:s, s:s%}}]}", "role", "assistant", "content",
                             "tool_calls", "id", c->tool_id, "type", "function", "function", "name",
                             "chatgate_state", "arguments", c->tool_args ? c->tool_args : "", c->tool_args_len);
    json_t *answer = json_pack("{s:s, s:s, s:s}", "role", "tool", "tool_call_id", c->tool_id, "content",
                               "The state is kept. Now write your reply to the user.");
    char *text = NULL;
    size_t text_len = 0;
    if (st && json_is_array(messages) && json_array_append(messages, call) == 0 &&
        json_array_append(messages, answer) == 0 && json_object_set_new(body, "tool_choice", json_string("none")) == 0)
        text = cg_json_dump_pre(body, 0, c->body_len + 512, &text_len);
    json_decref(call);
    json_decref(answer);
    json_decref(body);
    if (!text)
        return -1;
    c->tool_kept = tool_state(c);
    c->continued = 1;
    free(c->body);
    c->body = text;
    c->body_len = text_len;
    CURL *answered = c->easy;
    c->easy = NULL; /* forgotten first: its done, which may come at once, finds it stopped */
    c->cur = NULL;
    if (answered) /* the answered transfer goes (unless it ended) */
        cg_http_pool_stop(c->pool, answered);
    request_reset(c);
    c->sse_fresh = 1; /* not here: this runs inside the parser's own callback */
    cg_call_arm(&c->core, CG_CALL_CONNECT);
    return request_start(c, st, c->replica);
}

static void call_done(cg_upstream_call *c)
{
    if (c->tool_index >= 0 && c->core.reply_bytes == 0 && !c->continued && continue_after_tool(c) == 0)
        return;
    json_t *usage = json_incref(c->usage);
    json_t *state = c->tool_kept ? json_incref(c->tool_kept) : tool_state(c);
    cg_call_done(&c->core, usage, state);
    json_decref(state);
    json_decref(usage);
}

/* Follows the reply's tool calls (a chunk's choices[0].delta.tool_calls): the one named
 * chatgate_state, offered when state_tool is on, has its arguments kept as they stream (at
 * most MAX_TOOL_ARGS bytes); calls of other names, never offered, are ignored. -1 when the
 * arguments pass the bound (the call has failed then). */
static int follow_tool_calls(cg_upstream_call *c, json_t *calls)
{
    size_t i;
    json_t *call;
    json_array_foreach(calls, i, call) {
        json_t *index = json_object_get(call, "index"), *fn = json_object_get(call, "function");
        long at = json_is_integer(index) ? (long)cg_clamp(json_integer_value(index), 0, 1 << 20) : (long)i;
        const char *name = json_string_value(json_object_get(fn, "name"));
        if (c->tool_index < 0 && name && strcmp(name, "chatgate_state") == 0 && c->core.up->cfg->state_tool) {
            c->tool_index = (int)at;
            const char *id = json_string_value(json_object_get(call, "id"));
            snprintf(c->tool_id, sizeof(c->tool_id), "%s", id && *id ? id : "call_chatgate_state");
        }
        json_t *args = json_object_get(fn, "arguments");
        if (at != c->tool_index || !json_is_string(args))
            continue;
        if (c->tool_args_len + json_string_length(args) > MAX_TOOL_ARGS) {
            cg_call_fail(&c->core, CG_CALL_FINAL, NULL, CG_E_UPSTREAM_ERROR, NULL,
                         "called chatgate_state with arguments over %d bytes", MAX_TOOL_ARGS);
            return -1;
        }
        cg_buf_append(&c->tool_args, &c->tool_args_len, &c->tool_args_cap, json_string_value(args),
                      json_string_length(args), 1024);
    }
    return 0;
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
    cg_chunk k; /* the plain chunk without a tree; anything else is jansson's (chunk.h) */
    int plain = cg_chunk_read(&k, &c->head, data, len);
    if (plain) {
        if (k.finished)
            c->finish_seen = 1;
        if (k.content_len > 0)
            cg_call_delta(&c->core, k.content, k.content_len);
    }
    cg_chunk_free(&k);
    if (plain)
        return ended(c) ? 1 : 0;
    json_error_t jerr;
    json_t *o = json_loadb(data, len, 0, &jerr);
    if (!json_is_object(o)) {
        json_decref(o);
        cg_call_fail(&c->core, CG_CALL_FINAL, NULL, CG_E_UPSTREAM_ERROR, NULL,
                     "sent an event that is not a JSON object: %.80s", data);
        return 1;
    }
    json_t *err = json_object_get(o, "error");
    if (err) {
        json_t *m = json_is_object(err) ? json_object_get(err, "message") : err;
        const char *text = json_is_string(m) ? json_string_value(m) : "(no message)";
        if (c->core.reply_bytes)
            cg_call_fail(&c->core, CG_CALL_FINAL, NULL, CG_E_UPSTREAM_ERROR, err,
                         "failed mid-reply, after %zu bytes of reply text: %.300s", c->core.reply_bytes, text);
        else
            cg_call_fail(&c->core, CG_CALL_FINAL, NULL, CG_E_UPSTREAM_ERROR, err,
                         "answered with an error event before any reply text: %.300s", text);
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
    if (json_is_string(content) && json_string_length(content) > 0)
        cg_call_delta(&c->core, json_string_value(content), json_string_length(content));
    json_t *calls = json_object_get(json_object_get(choice, "delta"), "tool_calls");
    if (!ended(c) && json_is_array(calls))
        follow_tool_calls(c, calls);
    json_decref(o);
    return ended(c) ? 1 : 0;
}

/* The server's own words from a 4xx/5xx body: error.message, or the start of the text. A
 * 5xx or 429 is the replica's trouble, not the request's: retried on another. */
static void fail_with_status(cg_upstream_call *c)
{
    char why[32];
    int status = c->core.status;
    snprintf(why, sizeof(why), "answered HTTP %d", status);
    c->error_body[c->error_body_len] = 0;
    json_t *o = json_loads(c->error_body, 0, NULL);
    json_t *err = json_object_get(o, "error");
    json_t *m = json_is_object(err) ? json_object_get(err, "message") : err;
    if (!json_is_string(m))
        m = json_object_get(o, "message");
    const char *text = json_is_string(m) ? json_string_value(m) : c->error_body;
    cg_call_fail(&c->core, status >= 500 || status == 429 ? CG_CALL_RETRY : CG_CALL_COUNTED, why, CG_E_UPSTREAM_ERROR,
                 err, "answered HTTP %d: %.300s", status, *text ? text : "(empty body)");
    json_decref(o);
}

static void on_body(cg_upstream_call *c, const char *in, size_t len)
{
    cg_call_progress(&c->core);
    if (c->core.status >= 300) {
        size_t room = MAX_ERROR_BODY - c->error_body_len;
        size_t n = len < room ? len : room;
        memcpy(c->error_body + c->error_body_len, in, n);
        c->error_body_len += n;
        return;
    }
    if (c->sse_fresh) {
        c->sse_fresh = 0;
        cg_sse_free(&c->sse);
        cg_sse_init(&c->sse, MAX_EVENT_BYTES, on_event, c);
    }
    if (cg_sse_feed(&c->sse, in, len) < 0)
        cg_call_fail(&c->core, CG_CALL_FINAL, NULL, CG_E_UPSTREAM_ERROR, NULL, "sent an event over %d bytes",
                     MAX_EVENT_BYTES);
}

/*
 * The response ended, cleanly or not (a reset mid-body comes here too, with its status), so
 * a stream without [DONE] or a finish_reason is taken as cut.
 */
static void on_end(cg_upstream_call *c)
{
    cg_call *core = &c->core;
    if (core->status >= 300)
        fail_with_status(c);
    else if (c->finish_seen)
        call_done(c); /* no [DONE], but the last chunk said why it finished */
    else if (core->reply_bytes)
        cg_call_fail(core, CG_CALL_FINAL, NULL, CG_E_UPSTREAM_UNAVAILABLE, NULL,
                     "cut the stream mid-reply, after %zu bytes of reply text (no [DONE])", core->reply_bytes);
    else if (c->events_seen || c->event_stream)
        cg_call_fail(core, CG_CALL_FINAL, NULL, CG_E_UPSTREAM_UNAVAILABLE, NULL,
                     "cut the stream before any reply text (no [DONE])");
    else
        cg_call_fail(core, CG_CALL_FINAL, NULL, CG_E_UPSTREAM_ERROR, NULL,
                     "answered HTTP %d without any server-sent event (is it OpenAI-compatible?)", core->status);
}

/* ---- the transfer's callbacks (from inside libcurl) ------------------------------------ */

/* The request goes out on a connection, kept or new: the connect phase is over. */
static int on_sending(void *data, char *ip, char *local_ip, int port, int local_port)
{
    attempt *a = data;
    cg_upstream_call *c = a->c;
    (void)ip, (void)local_ip, (void)port, (void)local_port;
    if (c->cur != a) /* a stopped attempt */
        return CURL_PREREQFUNC_ABORT;
    if (c->easy)
        cg_http_pool_sending(c->pool, c->easy);
    c->request_sent = 1;
    cg_call_arm(&c->core, CG_CALL_FIRST_BYTE);
    return ended(c) ? CURL_PREREQFUNC_ABORT : CURL_PREREQFUNC_OK;
}

/* What an ended call answers libcurl for len more bytes: takes them while it drains after
 * a done, else refuses them, which ends the transfer. */
static size_t ended_take(const cg_upstream_call *c, size_t len)
{
    return c->core.phase == CG_CALL_DRAIN ? len : 0;
}

/* One header line; at the blank line ending a final (not 1xx) header block, notes the
 * answer's status and whether it is an event stream. */
static size_t on_header(char *line, size_t size, size_t n, void *data)
{
    attempt *a = data;
    cg_upstream_call *c = a->c;
    size_t len = size * n;
    if (c->cur != a) /* a stopped attempt: refused, which ends it */
        return 0;
    cg_http_pool_header(c->pool, line, len);
    if (ended(c))
        return ended_take(c, len);
    cg_call_progress(&c->core); /* the first bytes came */
    if (len > 12 && strncasecmp(line, "Retry-After:", 12) == 0) { /* seconds (a date is not read) */
        long long s = cg_parse_decimal_sat(line + 12, 3600); /* a replica is marked out an hour at most */
        c->core.retry_after_ms = s > 0 ? (long)s * 1000 : 0;
    }
    if (len <= 2 && (line[0] == '\r' || line[0] == '\n')) {
        long code = 0;
        char *type = NULL;
        curl_easy_getinfo(c->easy, CURLINFO_RESPONSE_CODE, &code);
        if (code >= 200) {
            c->core.status = (int)code;
            curl_easy_getinfo(c->easy, CURLINFO_CONTENT_TYPE, &type);
            c->event_stream = type && strncasecmp(type, "text/event-stream", 17) == 0;
        }
    }
    return len;
}

/* Body bytes. A paused call takes none (libcurl holds them); an ended one takes the rest
 * only when draining after done, else refuses them, which ends the transfer. */
static size_t on_data(char *in, size_t size, size_t n, void *data)
{
    attempt *a = data;
    cg_upstream_call *c = a->c;
    size_t len = size * n;
    if (c->cur != a)
        return 0;
    if (ended(c))
        return ended_take(c, len);
    if (c->core.paused)
        return CURL_WRITEFUNC_PAUSE;
    on_body(c, in, len);
    if (ended(c))
        return ended_take(c, len);
    return len;
}

/* The transfer is over and the pool has cleaned it up: how it ended, unless the call had
 * already (done, cancel, an error of ours). */
static void on_transfer_done(void *data, CURLcode rc)
{
    attempt *a = data;
    cg_upstream_call *c = a->c;
    openai_state *st = c->core.up->state; /* NULL while the upstream closes */
    int current = c->cur == a;
    char why[CURL_ERROR_SIZE];
    snprintf(why, sizeof(why), "%s", a->curl_error[0] ? a->curl_error : curl_easy_strerror(rc));
    if (st)
        st->replicas.r[a->replica].busy--;
    free(a);
    if (!current) { /* an attempt a retry stopped */
        call_unref(c);
        return;
    }
    c->cur = NULL;
    c->easy = NULL;
    cg_call *core = &c->core;
    if (ended(c))
        ;
    else if (rc == CURLE_OK || core->status)
        on_end(c); /* complete, or cut after the headers: on_end tells which */
    else if (rc == CURLE_COULDNT_RESOLVE_HOST)
        cg_call_fail(core, CG_CALL_RETRY, why, CG_E_UPSTREAM_UNAVAILABLE, NULL, "could not resolve the host: %s", why);
    else if (!c->request_sent)
        cg_call_fail(core, CG_CALL_RETRY, why, CG_E_UPSTREAM_UNAVAILABLE, NULL, "could not be reached: %s", why);
    else
        cg_call_fail(core, CG_CALL_RETRY, why, CG_E_UPSTREAM_UNAVAILABLE, NULL,
                     "sent no HTTP answer to the request: %s", why);
    call_finish(c);
    call_unref(c); /* the transfer's */
}

/* ---- the request ------------------------------------------------------------------------ */

/* Appends one "Name: value" line, built with its real length (a key is as long as its
 * issuer likes); -1 when out of memory (h is then still whole). */
static int append_line(struct curl_slist **h, const char *name, const char *value)
{
    char *line = NULL;
    if (asprintf(&line, "%s: %s", name, value) < 0)
        return -1;
    struct curl_slist *next = curl_slist_append(*h, line);
    free(line);
    if (!next)
        return -1;
    *h = next;
    return 0;
}

/*
 * The headers besides Content-Length and Host (libcurl's, Host with the port): JSON in,
 * events out, who is asking (User-Agent), the bearer token, then upstreams.NAME.headers,
 * which replace the first four by name. No Origin: an API is not asked from a page, and
 * some (Ollama) refuse origins they do not know.
 */
static struct curl_slist *request_headers(const cg_upstream_config *cfg)
{
    struct curl_slist *h = NULL;
    const cg_headers *conf = &cfg->headers;
    const char *key = cfg->api_key_env ? getenv(cfg->api_key_env) : NULL;
    static const char *const fixed[][2] = {
        {"Content-Type", "application/json"},
        {"Accept", "text/event-stream"},
        {"User-Agent", "chatgate/" CG_VERSION},
    };
    for (size_t i = 0; i < sizeof(fixed) / sizeof(fixed[0]); i++)
        if (!cg_headers_has(conf, fixed[i][0]) && append_line(&h, fixed[i][0], fixed[i][1]) < 0)
            goto fail;
    struct curl_slist *next = curl_slist_append(h, "Expect:"); /* no 100-continue round trip */
    if (!next)
        goto fail;
    h = next;
    if (key && *key && !cg_headers_has(conf, "Authorization")) {
        char *bearer = NULL;
        int rc = asprintf(&bearer, "Bearer %s", key) < 0 ? -1 : append_line(&h, "Authorization", bearer);
        free(bearer);
        if (rc < 0)
            goto fail;
    }
    for (int i = 0; i < conf->n; i++)
        if (append_line(&h, conf->items[i].name, conf->items[i].value) < 0)
            goto fail;
    return h;
fail:
    curl_slist_free_all(h);
    return NULL;
}

/* The transfer for c to replica r: the pool's easy handle with this request; -1 on failure. */
static int request_start(cg_upstream_call *c, openai_state *st, int r)
{
    CURL *e = cg_http_pool_easy(st->pool);
    attempt *a = e ? cg_calloc(1, sizeof(*a)) : NULL;
    if (!a) {
        if (e)
            curl_easy_cleanup(e);
        return -1;
    }
    a->c = c;
    a->replica = r;
    c->replica = r;
    curl_easy_setopt(e, CURLOPT_URL, st->urls[r]);
    curl_easy_setopt(e, CURLOPT_HTTPHEADER, st->headers);
    curl_easy_setopt(e, CURLOPT_POSTFIELDS, c->body);
    curl_easy_setopt(e, CURLOPT_POSTFIELDSIZE_LARGE, (curl_off_t)c->body_len);
    curl_easy_setopt(e, CURLOPT_ERRORBUFFER, a->curl_error);
    curl_easy_setopt(e, CURLOPT_PREREQFUNCTION, on_sending);
    curl_easy_setopt(e, CURLOPT_PREREQDATA, a);
    curl_easy_setopt(e, CURLOPT_HEADERFUNCTION, on_header);
    curl_easy_setopt(e, CURLOPT_HEADERDATA, a);
    curl_easy_setopt(e, CURLOPT_WRITEFUNCTION, on_data);
    curl_easy_setopt(e, CURLOPT_WRITEDATA, a);
    c->easy = e;
    c->cur = a;
    c->refs++; /* the transfer's; dropped by on_transfer_done */
    if (cg_http_pool_start(st->pool, e, on_transfer_done, a) < 0) {
        c->easy = NULL;
        c->cur = NULL;
        c->refs--;
        curl_easy_cleanup(e);
        free(a);
        return -1;
    }
    st->replicas.r[r].busy++;
    return 0;
}

/* ---- the call's side of the core (cg_call_kind) ------------------------------------------ */

/* The request to replica r; whatever an earlier attempt read is forgotten. */
static int openai_attempt(cg_call *core, int r)
{
    cg_upstream_call *c = (cg_upstream_call *)core;
    request_reset(c);
    json_decref(c->usage);
    c->usage = NULL;
    if (core->attempts) {
        cg_sse_free(&c->sse);
        cg_sse_init(&c->sse, MAX_EVENT_BYTES, on_event, c);
    }
    cg_call_arm(core, CG_CALL_CONNECT);
    return request_start(c, core->up->state, r);
}

/*
 * After a done the rest of the response is read (drain), for the connection's sake; any
 * other stop takes the transfer out, and libcurl closes its connection, which is how the
 * backend learns to stop generating. A retry forgets the stopped transfer at once: its done
 * comes to a stopped attempt (on_transfer_done).
 */
static void openai_stop(cg_call *core, cg_call_stop why)
{
    cg_upstream_call *c = (cg_upstream_call *)core;
    if (!c->easy)
        return;
    if (why == CG_CALL_STOP_DONE) {
        cg_call_arm(core, CG_CALL_DRAIN);
        if (core->paused)
            cg_http_pool_pause(c->pool, c->easy, 0);
        return;
    }
    CURL *easy = c->easy;
    if (why == CG_CALL_STOP_RETRY) {
        /* forgotten before the stop: outside libcurl the pool ends the transfer at once, and
         * its done must find a stopped attempt, not the current one, or it is taken for a
         * second failure and retried inside this retry (test_replicas: the next replica got
         * the message twice, and max_attempts was passed) */
        c->easy = NULL;
        c->cur = NULL;
    }
    cg_http_pool_stop(c->pool, easy); /* done comes (maybe at once): call_finish */
}

static void openai_pause_reading(cg_call *core, int paused)
{
    cg_upstream_call *c = (cg_upstream_call *)core;
    if (c->easy)
        cg_http_pool_pause(c->pool, c->easy, paused);
}

static void openai_release(cg_call *core)
{
    call_finish((cg_upstream_call *)core);
}

static const cg_call_kind openai_kind = {
    .attempt = openai_attempt,
    .stop = openai_stop,
    .pause = openai_pause_reading,
    .release = openai_release,
    .idle_words = "went quiet within",
};

/* {scheme}://{host}:{port}{path}/chat/completions of a base URL (checked by the config);
 * an IPv6 address in brackets. NULL when it cannot be made. */
static char *request_url(const char *base)
{
    cg_upstream_config cfg = {0};
    char err[256], *url = NULL;
    if (cg_config_parse_upstream_url(&cfg, base, err, sizeof(err)) == 0 && cfg.host) {
        int v6 = strchr(cfg.host, ':') != NULL;
        if (asprintf(&url, "%s://%s%s%s:%d%s/chat/completions", cfg.tls ? "https" : "http", v6 ? "[" : "", cfg.host,
                     v6 ? "]" : "", cfg.port, cfg.path) < 0)
            url = NULL;
    }
    cg_upstream_config_free(&cfg);
    return url;
}


/* ---- the call ------------------------------------------------------------------------- */

/* Appends {"role": role, "content": content}; -1 when it cannot be built (text that is not
 * UTF-8, no memory), so that no message is silently left out of the request. */
static int append_message(json_t *messages, const char *role, json_t *content)
{
    return content ? json_array_append_new(messages, json_pack("{s:s, s:o}", "role", role, "content", content)) : -1;
}

/*
 * The function offered to the model when state_tool is on: its call is a state directive
 * (docs/state.md, "The state directive"; docs/upstreams.md, "State from the model"), applied
 * as an app's is, and never shown to the client. The schema names the directive's parts; the
 * gateway checks the call's arguments as it checks an app's directive.
 */
static const char state_tool_json[] =
    "[{\"type\":\"function\",\"function\":{\"name\":\"chatgate_state\",\"description\":"
    "\"Keep state for this conversation. Call it together with your reply when you ask the user to confirm "
    "something (awaiting type confirmation) or to pick one of several options (awaiting type selection, with the "
    "options), to remember facts of the task (service and params), what the user told about themselves "
    "(profile), context for follow-ups (soft_context) or a result the user may refer to next (last_tool_result). The user never sees the call; always also write your "
    "reply to the user.\",\"parameters\":{\"type\":\"object\",\"properties\":{"
    "\"service\":{\"type\":\"string\",\"description\":\"the task, e.g. payment, travel\"},"
    "\"params\":{\"type\":\"object\",\"description\":\"facts of the task by name; null forgets one\"},"
    "\"awaiting\":{\"type\":[\"object\",\"null\"],\"properties\":{"
    "\"type\":{\"type\":\"string\",\"enum\":[\"confirmation\",\"selection\",\"metadata\",\"input\"]},"
    "\"options\":{\"type\":\"array\",\"description\":\"for a selection: the options, in the order you listed them\"},"
    "\"context\":{\"type\":\"object\"},\"ttl\":{\"type\":\"integer\",\"description\":\"seconds\"}},"
    "\"required\":[\"type\"]},"
    "\"soft_context\":{\"type\":[\"object\",\"null\"]},"
    "\"profile\":{\"type\":\"object\",\"description\":\"what the user told about themselves (name, home_city, "
    "currency, language), kept for all their conversations; null forgets one\"},"
    "\"last_tool_result\":{\"description\":\"any JSON\"}}}}}]";

/* system (prompt + state summary), the history, then the user's message; with state_tool the
 * function of state_tool_json; NULL on failure */
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
        char *system = cg_malloc(n);
        snprintf(system, n, "%s%s%s", prompt, *prompt && *summary ? "\n" : "", summary);
        failed |= append_message(messages, "system", json_string(system)) < 0;
        free(system);
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
    /* the tool's schema is read once, and shared by every request (dumping does not change it) */
    static json_t *tools;
    if (cfg->state_tool && !tools)
        tools = json_loads(state_tool_json, 0, NULL); /* lives for the process */
    if (cfg->state_tool &&
        (json_object_set(o, "tools", tools) < 0 ||
         json_object_set_new(o, "tool_choice", json_string("auto")) < 0)) {
        json_decref(o);
        return NULL;
    }
    /* the history is most of it, every turn: the gateway's writer, not json_dumps, which was
     * a fifth of the gateway's CPU relaying fast streams (perf, stream.sh --fast) */
    char *s = cg_json_dump_pre(o, 0, 1024, len);
    json_decref(o);
    return s;
}

static void openai_close(cg_upstream *up)
{
    openai_state *st = up->state;
    if (!st)
        return;
    up->state = NULL; /* a stopped transfer's done may still come while the pool closes */
    cg_http_pool_free(st->pool); /* its idle connections close */
    curl_slist_free_all(st->headers);
    for (int i = 0; i < st->replicas.n; i++)
        free(st->urls[i]);
    free(st);
}

/* What the upstream keeps between calls, made at its first call (the loop runs by then; the
 * API key's variable is read then, once). NULL when it cannot be made. */
static openai_state *state_of(cg_upstream *up)
{
    if (up->state)
        return up->state;
    openai_state *st = cg_calloc(1, sizeof(*st));
    up->state = st;
    int ok = 1;
    st->replicas.n = up->cfg->n_replicas ? up->cfg->n_replicas : 1;
    for (int i = 0; i < st->replicas.n; i++)
        ok &= (st->urls[i] = request_url(up->cfg->n_replicas ? up->cfg->replicas[i] : up->cfg->url)) != NULL;
    st->headers = request_headers(up->cfg);
    st->pool = cg_http_pool_new(up->net->loop, up->cfg, up->net->tls_ca, up->metrics, up->index);
    if (!ok || !st->headers || !st->pool) {
        openai_close(up);
        up->state = NULL;
        return NULL;
    }
    return st;
}

static int openai_start(cg_upstream *up, void **conn_slot, const cg_upstream_message *m,
                        const cg_upstream_events *ev, void *ctx, cg_upstream_call **out)
{
    (void)conn_slot;
    openai_state *st = state_of(up);
    if (!st)
        return -1;
    cg_upstream_call *c = cg_calloc(1, sizeof(*c));
    c->pool = st->pool;
    c->body = build_body(up->cfg, m, &c->body_len);
    if (!c->body) {
        free(c);
        return -1;
    }
    cg_sse_init(&c->sse, MAX_EVENT_BYTES, on_event, c);
    cg_call_init(&c->core, up, &openai_kind, &st->replicas, ev, ctx, m->user, m->room);
    c->refs = 1; /* the timer's */
    cg_call_clock_init(&c->clock, up->net->loop);
    c->core.clock = &c->clock;
    if (cg_call_start(&c->core, -1) < 0) {
        call_finish(c); /* no transfer: the timer goes */
        return -1;
    }
    *out = c;
    return 0;
}

static void openai_answered(const cg_upstream_call *c, int *replica, int *attempts)
{
    cg_call_answered(&c->core, replica, attempts);
}

static void openai_cancel(cg_upstream_call *c)
{
    cg_call_cancel(&c->core);
}

static void openai_pause(cg_upstream_call *c, int paused)
{
    cg_call_pause(&c->core, paused);
}

const cg_upstream_ops cg_upstream_openai_ops = {
    .kind = "openai",
    .reads_summary = 1, /* the system message */
    .start = openai_start,
    .cancel = openai_cancel,
    .pause = openai_pause,
    .answered = openai_answered,
    .close_conn = NULL,
    .close = openai_close,
};
