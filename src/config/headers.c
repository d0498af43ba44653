/*
 * headers.c: an upstream's configured request headers (see headers.h): loaded and checked
 * once at start; the upstreams add them to each request or handshake as they are.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "chatgate/core/alloc.h"
#include "chatgate/config/headers.h"

/* Headers the gateway writes itself: set from a config they would break or double the
 * request (framing, the WebSocket handshake, the target host). */
static const char *const reserved[] = {"host", "content-length", "transfer-encoding", "connection", "upgrade",
                                       "keep-alive", "te", "trailer", "expect", "proxy-connection", NULL};

static int is_reserved(const char *name)
{
    if (strncasecmp(name, "sec-websocket-", 14) == 0)
        return 1;
    for (int i = 0; reserved[i]; i++)
        if (strcasecmp(name, reserved[i]) == 0)
            return 1;
    return 0;
}

/* RFC 9110 5.6.2: token = 1*tchar */
static int is_token(const char *s)
{
    size_t n = strlen(s);
    return n > 0 && n <= 64 &&
           strspn(s, "!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ") == n;
}

/* One line of visible text and spaces (RFC 9110 5.5), no CR, LF or NUL: a value that could
 * end the header and start another is refused, not cleaned. */
static int is_field_value(const char *s, size_t n)
{
    if (n > CG_HEADER_VALUE_MAX)
        return 0;
    for (size_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)s[i];
        if ((c < 0x20 && c != '\t') || c == 0x7f)
            return 0;
    }
    return 1;
}

int cg_headers_load(json_t *obj, const char *where, cg_headers *out, char *err, size_t errlen)
{
    memset(out, 0, sizeof(*out));
    if (!obj)
        return 0;
    if (!json_is_object(obj) || json_object_size(obj) > CG_HEADERS_MAX) {
        snprintf(err, errlen, "%s: must be an object of at most %d \"Name\": \"value\" or {\"env\": \"VAR\"}",
                 where, CG_HEADERS_MAX);
        return -1;
    }
    const char *name;
    json_t *v;
    json_object_foreach(obj, name, v) {
        const char *value = NULL;
        size_t len = 0;
        json_t *env = json_object_get(v, "env");
        if (!is_token(name)) {
            snprintf(err, errlen, "%s.%s: not a header name (letters, digits and !#$%%&'*+-.^_`|~, at most 64)",
                     where, name);
            goto fail;
        }
        if (is_reserved(name)) {
            snprintf(err, errlen, "%s.%s: chatgate writes this header itself; it cannot be set", where, name);
            goto fail;
        }
        if (json_is_string(v)) {
            value = json_string_value(v);
            len = json_string_length(v);
        } else if (json_is_object(v) && json_object_size(v) == 1 && json_is_string(env)) {
            value = getenv(json_string_value(env));
            if (!value) {
                snprintf(err, errlen, "%s.%s: the environment variable %s is not set", where, name,
                         json_string_value(env));
                goto fail;
            }
            len = strlen(value);
        } else {
            snprintf(err, errlen, "%s.%s: must be a string or {\"env\": \"VARIABLE\"}", where, name);
            goto fail;
        }
        if (len == 0 || !is_field_value(value, len)) { /* the value is not echoed: it may be a secret */
            snprintf(err, errlen, "%s.%s: the value must be one line of 1 to %d bytes (no CR, LF or NUL)%s", where,
                     name, CG_HEADER_VALUE_MAX, json_is_string(v) ? "" : "; the environment variable is empty");
            goto fail;
        }
        cg_header *h = &out->items[out->n++];
        h->name = cg_strdup(name);
        h->value = cg_strndup(value, len);
    }
    return 0;
fail:
    cg_headers_free(out);
    return -1;
}

void cg_headers_free(cg_headers *h)
{
    for (int i = 0; i < h->n; i++) {
        free(h->items[i].name);
        free(h->items[i].value);
    }
    memset(h, 0, sizeof(*h));
}

int cg_headers_has(const cg_headers *h, const char *name)
{
    for (int i = 0; i < h->n; i++)
        if (strcasecmp(h->items[i].name, name) == 0)
            return 1;
    return 0;
}

void cg_headers_names(const cg_headers *h, char *buf, size_t len)
{
    size_t used = 0;
    buf[0] = 0;
    for (int i = 0; i < h->n && used < len; i++) {
        int n = snprintf(buf + used, len - used, "%s%s", i ? ", " : "", h->items[i].name);
        if (n < 0)
            break;
        used += (size_t)n;
    }
}
