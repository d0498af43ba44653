/*
 * upstream.c: what the upstream kinds share: picking the ops for a URL's kind, reporting a
 * failed call (the message and what the upstream itself said), resolving host names off
 * the event loop, and opening an lws client connection.
 */
#include <arpa/inet.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "chatgate/gateway.h"
#include "chatgate/log.h"
#include "chatgate/protocol.h"
#include "chatgate/upstream.h"

#define MAX_DETAIL_STRING 128 /* bytes kept of an upstream's error type or code */

void cg_upstream_init(cg_upstream *up, cg_gateway *gw, const cg_upstream_config *cfg)
{
    up->gw = gw;
    up->cfg = cfg;
    switch (cfg->kind) {
    case CG_UPSTREAM_DEMO: up->ops = &cg_upstream_demo_ops; break;
    case CG_UPSTREAM_OPENAI: up->ops = &cg_upstream_openai_ops; break;
    case CG_UPSTREAM_WS: up->ops = &cg_upstream_ws_ops; break;
    }
}

/* Sets key to a copy of a string or integer value; 0 when value is neither (nothing set). */
static int detail_set(json_t *detail, const char *key, json_t *value, int integer_ok)
{
    json_t *copy = NULL;
    if (json_is_string(value)) {
        const char *s = json_string_value(value);
        size_t len = json_string_length(value);
        copy = json_stringn(s, len > MAX_DETAIL_STRING ? cg_utf8_boundary(s, MAX_DETAIL_STRING) : len);
    } else if (integer_ok && json_is_integer(value)) {
        copy = json_integer(json_integer_value(value));
    } else {
        return 0;
    }
    return json_object_set_new(detail, key, copy); /* steals copy, even a NULL one (-1) */
}

json_t *cg_upstream_error_detail(int status, json_t *error)
{
    json_t *detail = json_object();
    if (!detail)
        return NULL;
    if (status > 0 && json_object_set_new(detail, "status", json_integer(status)) < 0)
        goto fail;
    if (json_is_object(error) && (detail_set(detail, "upstream_type", json_object_get(error, "type"), 0) < 0 ||
                                  detail_set(detail, "upstream_code", json_object_get(error, "code"), 1) < 0))
        goto fail;
    if (json_object_size(detail) > 0)
        return detail;
fail:
    json_decref(detail);
    return NULL;
}

void cg_upstream_fail(const cg_upstream_events *ev, void *ctx, const cg_upstream_config *cfg, int err, int status,
                      json_t *error, const char *fmt, va_list ap)
{
    va_list again;
    va_copy(again, ap);
    int n = vsnprintf(NULL, 0, fmt, ap);
    size_t prefix = strlen("upstream '' ") + strlen(cfg->name);
    size_t size = prefix + (n > 0 ? (size_t)n : 0) + 1;
    char *message = malloc(size);
    if (!message)
        abort();
    snprintf(message, size, "upstream '%s' ", cfg->name);
    if (n > 0)
        vsnprintf(message + prefix, size - prefix, fmt, again);
    va_end(again);
    json_t *detail = cg_upstream_error_detail(status, error);
    ev->on_error(ctx, err, message, detail);
    json_decref(detail);
    free(message);
}

/*
 * A resolution in flight. uv_getaddrinfo cannot be stopped once it runs on the thread
 * pool, so abandoning only clears `done`; the request frees itself when libuv calls back.
 */
struct cg_resolve {
    uv_getaddrinfo_t req;
    uv_idle_t idle; /* numeric addresses still answer from the loop, never from start */
    cg_resolve_fn done;
    void *data;
    char address[INET6_ADDRSTRLEN];
};

static void resolve_idle_closed(uv_handle_t *h)
{
    free(h->data);
}

static void resolve_numeric(uv_idle_t *idle)
{
    cg_resolve *r = idle->data;
    uv_idle_stop(idle);
    if (r->done)
        r->done(r->data, r->address, NULL);
    uv_close((uv_handle_t *)idle, resolve_idle_closed);
}

static void resolve_done(uv_getaddrinfo_t *req, int status, struct addrinfo *res)
{
    cg_resolve *r = req->data;
    char err[160];
    const char *address = NULL;
    /* IPv4 first, as hiredis and most clients do: "localhost" often lists ::1 first, and a
     * server bound to 127.0.0.1 only would refuse every connect (one address is tried) */
    const struct addrinfo *pick = NULL;
    for (const struct addrinfo *ai = status == 0 ? res : NULL; ai; ai = ai->ai_next) {
        if (ai->ai_family == AF_INET) {
            pick = ai;
            break;
        }
        if (!pick && ai->ai_family == AF_INET6)
            pick = ai;
    }
    if (pick) {
        const void *a = pick->ai_family == AF_INET6 ? (const void *)&((struct sockaddr_in6 *)pick->ai_addr)->sin6_addr
                                                    : (const void *)&((struct sockaddr_in *)pick->ai_addr)->sin_addr;
        if (inet_ntop(pick->ai_family, a, r->address, sizeof(r->address)))
            address = r->address;
    }
    if (!address)
        snprintf(err, sizeof(err), "could not resolve the host: %s", status ? uv_strerror(status) : "no address");
    if (r->done)
        r->done(r->data, address, address ? NULL : err);
    uv_freeaddrinfo(res);
    free(r);
}

cg_resolve *cg_resolve_start(uv_loop_t *loop, const char *host, cg_resolve_fn done, void *data)
{
    cg_resolve *r = calloc(1, sizeof(*r));
    if (!r)
        return NULL;
    r->done = done;
    r->data = data;
    unsigned char buf[sizeof(struct in6_addr)];
    if (inet_pton(AF_INET, host, buf) == 1 || inet_pton(AF_INET6, host, buf) == 1) {
        snprintf(r->address, sizeof(r->address), "%s", host);
        uv_idle_init(loop, &r->idle);
        r->idle.data = r;
        uv_idle_start(&r->idle, resolve_numeric);
        return r;
    }
    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM};
    r->req.data = r;
    if (uv_getaddrinfo(loop, &r->req, resolve_done, host, NULL, &hints) < 0) {
        free(r);
        return NULL;
    }
    return r;
}

void cg_resolve_abandon(cg_resolve *r)
{
    r->done = NULL;
}

struct lws *cg_upstream_connect(cg_upstream *up, const char *address, const char *path, const char *method,
                                const char *local_protocol, void *opaque, struct lws **pwsi)
{
    cg_connect_spec spec = {.address = address, .path = path, .method = method, .local_protocol = local_protocol};
    return cg_lws_connect(up->gw, up->cfg, &spec, opaque, pwsi);
}

struct lws *cg_lws_connect(cg_gateway *gw, const cg_upstream_config *cfg, const cg_connect_spec *spec, void *opaque,
                           struct lws **pwsi)
{
    struct lws_client_connect_info i;
    memset(&i, 0, sizeof(i));
    i.context = gw->lws;
    i.vhost = gw->vhost;
    i.address = spec->address;
    i.port = cfg->port;
    i.path = spec->path;
    i.host = cfg->host;
    i.origin = spec->origin ? spec->origin : cfg->host;
    i.protocol = spec->subprotocol;
    i.method = spec->method;
    i.ssl_connection = cfg->tls ? LCCSCF_USE_SSL : 0;
    i.local_protocol_name = spec->local_protocol;
    i.opaque_user_data = opaque;
    i.pwsi = pwsi;
    return lws_client_connect_via_info(&i);
}
