/*
 * jsonflat.c: a flat frame's members through yajl's callbacks (see jsonflat.h for which
 * frames and why). Each callback either records what it was given or stops the parse (it
 * returns 0), and a stopped parse is "not the plain case": the caller reads the frame with
 * jansson, which then also words any error.
 */
#include <stdlib.h>
#include <string.h>

#include "chatgate/core/alloc.h"
#include "chatgate/core/jsonflat.h"
#include "chatgate/core/yajlread.h"

/* Text yajl handed over: a pointer into the frame when the text had no escape, else into
 * its own buffer, valid only during the callback, so then copied. NULL when there is no room
 * (cannot happen: decoded texts are shorter than the frame). */
static const char *keep(cg_jsonflat *f, const unsigned char *s, size_t len)
{
    const char *p = (const char *)s;
    if (p >= f->frame && p + len <= f->frame + f->frame_len)
        return p;
    if (!f->copies)
        f->copies = cg_malloc(f->frame_len + 1);
    if (f->copied + len > f->frame_len)
        return NULL;
    char *dst = f->copies + f->copied;
    memcpy(dst, s, len);
    f->copied += len;
    return dst;
}

/* The value of the member whose key came last; 0 stops the parse. */
static int value(cg_jsonflat *f, cg_jsonflat_kind kind, const unsigned char *s, size_t len)
{
    if (f->depth != 1 || f->n == 0)
        return 0; /* a value that is not a member's: the frame is not an object */
    cg_jsonflat_member *m = &f->m[f->n - 1];
    m->kind = kind;
    if (kind == CG_JSONFLAT_STRING && !(m->str = keep(f, s, len)))
        return 0;
    m->len = len;
    return 1;
}

static int on_null(void *ctx)
{
    return value(ctx, CG_JSONFLAT_NULL, NULL, 0);
}

static int on_boolean(void *ctx, int b)
{
    return value(ctx, b ? CG_JSONFLAT_TRUE : CG_JSONFLAT_FALSE, NULL, 0);
}

static int on_string(void *ctx, const unsigned char *s, size_t len)
{
    return value(ctx, CG_JSONFLAT_STRING, s, len);
}

static int on_number(void *ctx, const char *s, size_t len)
{
    (void)ctx, (void)s, (void)len;
    return 0; /* jansson's range checks are jansson's */
}

/* The member whose key is key[0..len), or NULL. */
static const cg_jsonflat_member *named(const cg_jsonflat *f, const void *key, size_t len)
{
    for (size_t i = 0; i < f->n; i++)
        if (f->m[i].key_len == len && memcmp(f->m[i].key, key, len) == 0)
            return &f->m[i];
    return NULL;
}

static int on_key(void *ctx, const unsigned char *key, size_t len)
{
    cg_jsonflat *f = ctx;
    if (f->n == CG_JSONFLAT_MAX || named(f, key, len))
        return 0; /* a key twice: jansson refuses it or keeps the last, its call */
    cg_jsonflat_member *m = &f->m[f->n];
    if (!(m->key = keep(f, key, len)))
        return 0;
    m->key_len = len;
    m->str = NULL;
    m->len = 0;
    f->n++;
    return 1;
}

static int on_start_map(void *ctx)
{
    cg_jsonflat *f = ctx;
    return f->depth++ == 0; /* the frame itself, not an object inside it */
}

/* The frame's end: the parse is stopped here, so that what follows can be checked to be
 * whitespace (yajl would wait for the end of a string begun after it). */
static int on_end_map(void *ctx)
{
    cg_jsonflat *f = ctx;
    f->depth--;
    f->ok = 1;
    return 0;
}

static int on_start_array(void *ctx)
{
    (void)ctx;
    return 0;
}

static const yajl_callbacks callbacks = {
    .yajl_null = on_null,
    .yajl_boolean = on_boolean,
    .yajl_number = on_number,
    .yajl_string = on_string,
    .yajl_start_map = on_start_map,
    .yajl_map_key = on_key,
    .yajl_end_map = on_end_map,
    .yajl_start_array = on_start_array,
};

int cg_jsonflat_read(cg_jsonflat *f, const char *buf, size_t len)
{
    f->n = 0;
    f->frame = buf;
    f->frame_len = len;
    f->copies = NULL;
    f->copied = 0;
    f->depth = 0;
    f->ok = 0;
    if (!cg_yajl_plain_bytes(buf, len))
        return 0;
    yajl_handle h = cg_yajl_open(&f->room, &callbacks, f);
    if (!h)
        return 0;
    /* The parse stops at the object's end (on_end_map), and only whitespace may follow it. */
    int read = cg_yajl_whole(h, buf, len, &f->ok);
    yajl_free(h);
    return read;
}

const cg_jsonflat_member *cg_jsonflat_get(const cg_jsonflat *f, const char *key)
{
    return named(f, key, strlen(key));
}

int cg_jsonflat_is(const cg_jsonflat_member *m, const char *text)
{
    return m && m->kind == CG_JSONFLAT_STRING && m->len == strlen(text) && memcmp(m->str, text, m->len) == 0;
}

void cg_jsonflat_free(cg_jsonflat *f)
{
    free(f->copies);
    f->copies = NULL;
}
