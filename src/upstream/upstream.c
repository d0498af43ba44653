/*
 * upstream.c: what the upstream kinds share: picking the ops for a URL's kind, reporting a
 * failed call (the message and what the upstream itself said), and writing configured
 * headers into an lws client handshake.
 */
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "chatgate/core/alloc.h"
#include "chatgate/core/utf8.h"
#include "chatgate/upstream/upstream.h"

/* every upstream has its slot in the connection counters */
_Static_assert(CG_MAX_UPSTREAMS <= sizeof(((cg_metrics *)0)->upstream_conns_opened) /
                                       sizeof(((cg_metrics *)0)->upstream_conns_opened[0]),
               "cg_metrics' upstream_conns_* arrays must have CG_MAX_UPSTREAMS slots");

#define MAX_DETAIL_STRING 128 /* bytes kept of an upstream's error type or code */

void cg_upstream_init(cg_upstream *up, const cg_net *net, const cg_upstream_config *cfg, cg_metrics *metrics,
                      int index)
{
    up->net = net;
    up->cfg = cfg;
    up->metrics = metrics;
    up->index = index;
    up->state = NULL;
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
    char *message = cg_malloc(size);
    snprintf(message, size, "upstream '%s' ", cfg->name);
    if (n > 0)
        vsnprintf(message + prefix, size - prefix, fmt, again);
    va_end(again);
    json_t *detail = cg_upstream_error_detail(status, error);
    ev->on_error(ctx, err, message, detail);
    json_decref(detail);
    free(message);
}

void cg_upstream_close(cg_upstream *up)
{
    if (up->ops->close)
        up->ops->close(up);
    up->state = NULL;
}

int cg_upstream_append_headers(struct lws *wsi, const cg_headers *headers, const cg_headers *skip, unsigned char **p,
                               unsigned char *end)
{
    for (int i = 0; i < headers->n; i++) {
        char name[80]; /* lws writes the name as given: it wants the ':' */
        if (skip && cg_headers_has(skip, headers->items[i].name))
            continue;
        snprintf(name, sizeof(name), "%s:", headers->items[i].name);
        if (lws_add_http_header_by_name(wsi, (const unsigned char *)name,
                                        (const unsigned char *)headers->items[i].value,
                                        (int)strlen(headers->items[i].value), p, end))
            return -1;
    }
    return 0;
}
