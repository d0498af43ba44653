/*
 * jsonout.c: compact JSON dumped, or written as text, into a buffer with headroom (see
 * jsonout.h).
 */
#include "chatgate/core/jsonout.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "chatgate/core/buf.h"
#include "chatgate/core/utf8.h"

typedef struct {
    char *buf;
    size_t used, cap; /* used counts the headroom */
} out_buf;

static int append(const char *text, size_t size, void *data)
{
    out_buf *o = data;
    cg_buf_append(&o->buf, &o->used, &o->cap, text, size, 64);
    return 0;
}

char *cg_json_dump_pre(json_t *j, size_t pre, size_t hint, size_t *len)
{
    out_buf o = {.used = pre, .cap = pre + (hint < 64 ? 64 : hint) + 1};
    o.buf = malloc(o.cap);
    if (!o.buf)
        abort();
    if (!j || json_dump_callback(j, append, &o, JSON_COMPACT) < 0) {
        free(o.buf);
        return NULL;
    }
    o.buf[o.used] = 0;
    *len = o.used - pre;
    return o.buf;
}

/* ---- the text writer ------------------------------------------------------------------ */

void cg_jsonw_init(cg_jsonw *w, size_t pre, size_t hint)
{
    w->pre = w->used = pre;
    w->cap = pre + (hint < 64 ? 64 : hint) + 1;
    w->failed = 0;
    w->buf = malloc(w->cap);
    if (!w->buf)
        abort();
}

void cg_jsonw_raw(cg_jsonw *w, const char *text, size_t len)
{
    cg_buf_append(&w->buf, &w->used, &w->cap, text, len, 64);
}

/* Appends s[from..to) of a string's text, which needs no escape. */
static void str_run(cg_jsonw *w, const char *s, size_t from, size_t to)
{
    if (to > from)
        cg_buf_append(&w->buf, &w->used, &w->cap, s + from, to - from, 64);
}

void cg_jsonw_str(cg_jsonw *w, const char *s, size_t len)
{
    static const char hex[] = "0123456789ABCDEF";
    if (!s) {
        CG_JSONW_LIT(w, "null");
        return;
    }
    CG_JSONW_LIT(w, "\"");
    const unsigned char *u = (const unsigned char *)s;
    size_t run = 0; /* the start of the text not yet appended */
    for (size_t i = 0; i < len;) {
        unsigned char c = u[i];
        if (c >= 0x80) { /* a character of 2 to 4 bytes, appended as it is when valid */
            size_t n = cg_utf8_char_len(u + i, len - i);
            if (!n) {
                w->failed = 1;
                return;
            }
            i += n;
            continue;
        }
        if (c >= 0x20 && c != '"' && c != '\\') {
            i++;
            continue;
        }
        str_run(w, s, run, i);
        char esc[6] = {'\\', 0};
        size_t n = 2;
        switch (c) {
        case '"': esc[1] = '"'; break;
        case '\\': esc[1] = '\\'; break;
        case '\b': esc[1] = 'b'; break;
        case '\f': esc[1] = 'f'; break;
        case '\n': esc[1] = 'n'; break;
        case '\r': esc[1] = 'r'; break;
        case '\t': esc[1] = 't'; break;
        default: /* the other control characters, as jansson writes them */
            memcpy(esc + 1, "u00", 3);
            esc[4] = hex[c >> 4];
            esc[5] = hex[c & 15];
            n = 6;
        }
        cg_jsonw_raw(w, esc, n);
        run = ++i;
    }
    str_run(w, s, run, len);
    CG_JSONW_LIT(w, "\"");
}

static int jsonw_dump(const char *text, size_t size, void *data)
{
    cg_jsonw_raw(data, text, size);
    return 0;
}

void cg_jsonw_json(cg_jsonw *w, json_t *v)
{
    if (!v || json_is_null(v))
        CG_JSONW_LIT(w, "null");
    else if (json_is_object(v) && json_object_size(v) == 0)
        CG_JSONW_LIT(w, "{}");
    else if (json_is_array(v) && json_array_size(v) == 0)
        CG_JSONW_LIT(w, "[]");
    else if (json_dump_callback(v, jsonw_dump, w, JSON_COMPACT | JSON_ENCODE_ANY) < 0)
        w->failed = 1;
}

void cg_jsonw_int(cg_jsonw *w, long long n)
{
    char num[24];
    int k = snprintf(num, sizeof(num), "%lld", n);
    cg_jsonw_raw(w, num, (size_t)k);
}

/* ,"name": */
static void member(cg_jsonw *w, const char *name)
{
    CG_JSONW_LIT(w, ",\"");
    cg_jsonw_raw(w, name, strlen(name));
    CG_JSONW_LIT(w, "\":");
}

void cg_jsonw_member_str(cg_jsonw *w, const char *name, const char *value)
{
    member(w, name);
    cg_jsonw_str(w, value, value ? strlen(value) : 0);
}

void cg_jsonw_member_json(cg_jsonw *w, const char *name, json_t *value, const char *empty)
{
    member(w, name);
    if (value)
        cg_jsonw_json(w, value);
    else
        cg_jsonw_raw(w, empty, strlen(empty));
}

char *cg_jsonw_end(cg_jsonw *w, size_t *len)
{
    if (w->failed) {
        free(w->buf);
        w->buf = NULL;
        return NULL;
    }
    w->buf[w->used] = 0; /* cg_buf_append keeps room for it */
    *len = w->used - w->pre;
    return w->buf;
}
