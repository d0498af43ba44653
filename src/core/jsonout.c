/*
 * jsonout.c: compact JSON dumped, or written as text, into a buffer with headroom (see
 * jsonout.h).
 */
#include "chatgate/core/alloc.h"
#include "chatgate/core/jsonout.h"

#include <stdlib.h>
#include <string.h>

#include "chatgate/core/swar.h"
#include "chatgate/core/utf8.h"

/* ---- the text writer ------------------------------------------------------------------ */

char *cg_json_dump_pre(json_t *j, size_t pre, size_t hint, size_t *len)
{
    cg_jsonw w;
    cg_jsonw_init(&w, pre, hint);
    if (!j)
        w.failed = 1;
    cg_jsonw_json(&w, j);
    return cg_jsonw_end(&w, len);
}

void cg_jsonw_init(cg_jsonw *w, size_t pre, size_t hint)
{
    w->pre = w->used = pre;
    w->cap = pre + (hint < 64 ? 64 : hint) + 1;
    w->failed = 0;
    w->buf = cg_malloc(w->cap);
}

void cg_jsonw_init_in(cg_jsonw *w, size_t pre, size_t hint, char *buf, size_t cap)
{
    if (!buf || cap < pre + (hint < 64 ? 64 : hint) + 1) {
        free(buf);
        cg_jsonw_init(w, pre, hint);
        return;
    }
    w->buf = buf;
    w->cap = cap;
    w->pre = w->used = pre;
    w->failed = 0;
}

void cg_jsonw_grow(cg_jsonw *w, size_t len)
{
    size_t cap = w->cap;
    while (w->used + len >= cap)
        cap *= 2;
    char *nb = cg_realloc(w->buf, cap);
    w->buf = nb;
    w->cap = cap;
}

/* Appends s[from..to) of a string's text, which needs no escape. */
static void str_run(cg_jsonw *w, const char *s, size_t from, size_t to)
{
    if (to > from)
        cg_jsonw_raw(w, s + from, to - from);
}

/* Nonzero when one of the 8 bytes of v needs a closer look: past ASCII, a control
 * character, '"' or '\\'. One test, one branch, for a string's common case. */
static inline uint64_t str_special(uint64_t v)
{
    return (v & CG_SWAR_HIGHS) | cg_swar_has_below(v, 0x20) | cg_swar_has(v, '"') | cg_swar_has(v, '\\');
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
        /* eight bytes of plain ASCII at once: none to escape or check. The last few go a
         * byte at a time: copied into a padded word instead, they took a fifth longer
         * (fewer instructions, but the word's load waits for the bytes' stores) */
        if (i + 8 <= len && !str_special(cg_swar_load(u + i))) {
            i += 8;
            continue;
        }
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

/* Deeper than this, a value is refused (a cycle: jansson refuses those too). */
#define MAX_DEPTH 2048

static void json_value(cg_jsonw *w, json_t *v, int depth)
{
    size_t i;
    const char *key;
    json_t *item;
    if (depth > MAX_DEPTH) {
        w->failed = 1;
        return;
    }
    switch (json_typeof(v)) {
    case JSON_OBJECT:
        CG_JSONW_LIT(w, "{");
        i = 0;
        json_object_foreach(v, key, item) { /* in the order set, as jansson dumps them */
            if (i++)
                CG_JSONW_LIT(w, ",");
            cg_jsonw_str(w, key, strlen(key));
            CG_JSONW_LIT(w, ":");
            json_value(w, item, depth + 1);
        }
        CG_JSONW_LIT(w, "}");
        break;
    case JSON_ARRAY:
        CG_JSONW_LIT(w, "[");
        json_array_foreach(v, i, item) {
            if (i)
                CG_JSONW_LIT(w, ",");
            json_value(w, item, depth + 1);
        }
        CG_JSONW_LIT(w, "]");
        break;
    case JSON_STRING:
        cg_jsonw_str(w, json_string_value(v), json_string_length(v));
        break;
    case JSON_INTEGER:
        cg_jsonw_int(w, (long long)json_integer_value(v));
        break;
    case JSON_TRUE:
        CG_JSONW_LIT(w, "true");
        break;
    case JSON_FALSE:
        CG_JSONW_LIT(w, "false");
        break;
    case JSON_NULL:
        CG_JSONW_LIT(w, "null");
        break;
    default: /* a real: jansson's own form of it ("%.17g", with a '.' or an exponent) */
        if (json_dump_callback(v, jsonw_dump, w, JSON_COMPACT | JSON_ENCODE_ANY) < 0)
            w->failed = 1;
    }
}

void cg_jsonw_json(cg_jsonw *w, json_t *v)
{
    if (!v)
        CG_JSONW_LIT(w, "null");
    else
        json_value(w, v, 0);
}

void cg_jsonw_null_if_failed(cg_jsonw *w, size_t at)
{
    if (!w->failed)
        return;
    w->failed = 0;
    w->used = at;
    CG_JSONW_LIT(w, "null");
}

void cg_jsonw_json_or_null(cg_jsonw *w, json_t *v)
{
    size_t at = w->used;
    cg_jsonw_json(w, v);
    cg_jsonw_null_if_failed(w, at);
}

/* "00" to "99": two digits a division (a turn writes a few hundred numbers: RESP lengths,
 * times in ms, counts). */
static const char two_digits[] = "00010203040506070809101112131415161718192021222324252627282930313233343536373839"
                                 "40414243444546474849505152535455565758596061626364656667686970717273747576777879"
                                 "8081828384858687888990919293949596979899";

size_t cg_int_text(char *end, long long n)
{
    char *p = end;
    unsigned long long u = n < 0 ? 0ULL - (unsigned long long)n : (unsigned long long)n;
    while (u >= 100) {
        unsigned d = (unsigned)(u % 100) * 2;
        u /= 100;
        *--p = two_digits[d + 1];
        *--p = two_digits[d];
    }
    if (u >= 10) {
        *--p = two_digits[u * 2 + 1];
        *--p = two_digits[u * 2];
    } else {
        *--p = (char)('0' + u);
    }
    if (n < 0)
        *--p = '-';
    return (size_t)(end - p);
}

void cg_jsonw_int(cg_jsonw *w, long long n)
{
    char num[24];
    size_t len = cg_int_text(num + sizeof(num), n);
    cg_jsonw_raw(w, num + sizeof(num) - len, len);
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
    w->buf[w->used] = 0; /* cap > used: there is room */
    *len = w->used - w->pre;
    return w->buf;
}
