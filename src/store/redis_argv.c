/*
 * redis_argv.c: one Redis command, written as RESP as its arguments come (redis_argv.h).
 */
#include <stdlib.h>
#include <string.h>

#include "chatgate/core/jsonout.h"
#include "chatgate/core/num.h"
#include "chatgate/store/redis_argv.h"
#include "chatgate/store/redis_cluster.h"


static size_t digits(size_t n)
{
    size_t d = 1;
    while (n >= 10) {
        n /= 10;
        d++;
    }
    return d;
}

/* "<kind><n>\r\n", a RESP line of a count or a length, at out (d + 3 bytes, d = digits(n)). */
static void resp_line(char *out, char kind, size_t n, size_t d)
{
    out[0] = kind;
    cg_int_text(out + 1 + d, (long long)n);
    out[d + 1] = '\r';
    out[d + 2] = '\n';
}

/* Its CRLF after the argument just written. */
void cg_argv_done(cg_argv *a)
{
    CG_JSONW_LIT(&a->w, "\r\n");
    a->argc++;
}

/* Starts an argument: where its bytes begin. */
size_t cg_argv_begin(cg_argv *a)
{
    if (!a->w.buf)
        cg_jsonw_init(&a->w, ARGV_HEAD, 1024);
    return a->w.used;
}

/* The length line "$<n>\r\n" of the argument that begins at start, written there; what is
 * written of the argument already moves up behind it. */
static void length_line(cg_argv *a, size_t start, size_t n)
{
    size_t d = digits(n);
    if (a->w.used + d + 3 >= a->w.cap)
        cg_jsonw_grow(&a->w, d + 3);
    if (a->w.used > start)
        memmove(a->w.buf + start + d + 3, a->w.buf + start, a->w.used - start);
    resp_line(a->w.buf + start, '$', n, d);
    a->w.used += d + 3;
}

/* Starts an argument of n bytes, which the caller writes, then calls cg_argv_done. */
void cg_argv_known(cg_argv *a, size_t n)
{
    length_line(a, cg_argv_begin(a), n);
}

/* Ends the argument begun at start (its length known only once written). */
void cg_argv_end(cg_argv *a, size_t start)
{
    length_line(a, start, a->w.used - start);
    cg_argv_done(a);
}

/* Every argument is the buffer's own copy: a script command may be sent again (NOSCRIPT)
 * after the strings it was built from are gone. */
void cg_argv_arg(cg_argv *a, const char *s, size_t n)
{
    cg_argv_known(a, n);
    cg_jsonw_raw(&a->w, s, n);
    cg_argv_done(a);
}

void cg_argv_str(cg_argv *a, const char *s)
{
    cg_argv_arg(a, s, strlen(s));
}

void cg_argv_int(cg_argv *a, long long n)
{
    char num[24];
    size_t len = cg_int_text(num + sizeof(num), n);
    cg_argv_arg(a, num + sizeof(num) - len, len);
}

/* A JSON value as an argument; one it cannot encode, which the dialog never holds (text
 * that is not UTF-8), is "null", not a crash. */
void cg_argv_json(cg_argv *a, json_t *v)
{
    size_t start = cg_argv_begin(a);
    cg_jsonw_json_or_null(&a->w, v);
    cg_argv_end(a, start);
}

/* "<prefix>:{<eu>}:<er>:<part>", or "<prefix>:{<eu>}:<part>" when er is NULL, into the
 * argument begun: a dialog's key, or a user's (the hash tag is the user's: a user's keys
 * live on one shard). */
void cg_argv_put_key(cg_argv *a, const char *prefix, const char *eu, const char *er, const char *part)
{
    if (!a->slot_known) { /* every key of a command has this tag */
        a->slot = cg_redis_key_slot(eu, strlen(eu));
        a->slot_known = 1;
    }
    cg_jsonw_raw(&a->w, prefix, strlen(prefix));
    CG_JSONW_LIT(&a->w, ":{");
    cg_jsonw_raw(&a->w, eu, strlen(eu));
    CG_JSONW_LIT(&a->w, "}:");
    if (er) {
        cg_jsonw_raw(&a->w, er, strlen(er));
        CG_JSONW_LIT(&a->w, ":");
    }
    cg_jsonw_raw(&a->w, part, strlen(part));
}

/* The length of cg_argv_put_key's key but its part: "<prefix>:{<eu>}:<er>:" or "<prefix>:{<eu>}:". */
size_t cg_argv_key_stem_len(const char *prefix, const char *eu, const char *er)
{
    return strlen(prefix) + 4 + strlen(eu) + (er ? strlen(er) + 1 : 0);
}

void cg_argv_key(cg_argv *a, const char *prefix, const char *eu, const char *er, const char *part)
{
    cg_argv_known(a, cg_argv_key_stem_len(prefix, eu, er) + strlen(part));
    cg_argv_put_key(a, prefix, eu, er, part);
    cg_argv_done(a);
}

void cg_argv_clear(cg_argv *a)
{
    a->argc = 0;
    a->slot = 0;
    a->slot_known = 0;
    a->w.used = a->w.pre;
}

void cg_argv_free(cg_argv *a)
{
    free(a->w.buf);
    *a = (cg_argv){0};
}

/* a's command, cg_argv_framed: its "*<count>" line written into the headroom before the first
 * argument; its bytes at the pointer returned, *len of them. NULL when a is empty. */
const char *cg_argv_framed(cg_argv *a, size_t *len)
{
    if (!a->w.buf)
        return NULL;
    size_t hl = digits((size_t)a->argc) + 3;
    char *at = a->w.buf + a->w.pre - hl; /* hl < ARGV_HEAD: argc is an int */
    resp_line(at, '*', (size_t)a->argc, hl - 3);
    *len = a->w.used - a->w.pre + hl;
    return at;
}

