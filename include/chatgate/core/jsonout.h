#ifndef CHATGATE_CORE_JSONOUT_H
#define CHATGATE_CORE_JSONOUT_H
/*
 * jsonout.h: compact JSON text written straight into the buffer it is sent from.
 *
 * json_dumps() grows its text from 16 bytes by doubling, then copies it into a fresh string,
 * and a frame for lws was then copied once more behind LWS_PRE bytes of headroom: for a
 * ws upstream's message frame, which carries the history, a dozen allocations and three
 * copies per message. Here the text is written (cg_jsonw_json, below) into one buffer that
 * starts at the size of the caller's previous frame and leaves `pre` bytes in front of it.
 */
#include <jansson.h>
#include <stddef.h>
#include <string.h>

#include "chatgate/core/utf8.h"

/*
 * A jansson string of s[0..n), or NULL when that is not UTF-8, as json_stringn() makes it;
 * the check is cg_utf8_valid's, eight bytes at a time over ASCII, where jansson's goes a
 * character at a time with a call for each (a fiftieth of a turn's instructions with the
 * rules: the history's messages, the rules' params and names; callgrind, issue 12).
 */
static inline json_t *cg_json_stringn(const char *s, size_t n)
{
    return s && cg_utf8_valid(s, n) ? json_stringn_nocheck(s, n) : NULL;
}

/* cg_json_stringn of a NUL-terminated s, as json_string(); NULL for NULL. */
static inline json_t *cg_json_string(const char *s)
{
    return s ? cg_json_stringn(s, strlen(s)) : NULL;
}

/*
 * j as compact JSON at buf + pre (NUL-terminated; *len is its length), in a malloc'd buffer
 * of at least pre + hint + 1 bytes, the bytes json_dumps writes. NULL when j is NULL or
 * cannot be encoded (text that is not UTF-8).
 * Aborts when out of memory, as the gateway does for buffers it cannot work without.
 */
char *cg_json_dump_pre(json_t *j, size_t pre, size_t hint, size_t *len);

/*
 * A frame written as text, piece by piece, into the same kind of buffer: for the frames of a
 * fixed shape that every turn sends (delta, done, ack, the ws upstream's message). Building
 * them as jansson trees and dumping those took about half of a turn's instructions
 * (callgrind, issue 12): json_pack allocates an object, a table and a copy of every string,
 * and the dump walks it in a callback per token. Here the frame's skeleton is literal text,
 * strings are escaped straight into the buffer (cg_jsonw_str: RFC 8259, as jansson writes
 * them: '"', '\' and control characters escaped, nothing else; text that is not valid
 * UTF-8 fails the frame, as jansson refuses it), and values that are JSON trees (params,
 * usage, history messages) are walked with jansson's iterators and written the same way
 * (cg_jsonw_json), jansson's own dump being used for reals only. unit_jsonw holds all of it
 * to jansson's output byte for byte.
 *
 *   cg_jsonw w;
 *   cg_jsonw_init(&w, LWS_PRE, 256);
 *   CG_JSONW_LIT(&w, "{\"type\":\"delta\"");
 *   cg_jsonw_member_str(&w, "id", id);
 *   CG_JSONW_LIT(&w, "}");
 *   char *buf = cg_jsonw_end(&w, &len);  // the text at buf + LWS_PRE, or NULL
 *
 * Out of memory aborts, as for every buffer the gateway cannot work without.
 */
typedef struct cg_jsonw {
    char *buf;
    size_t used, cap; /* used counts the headroom; cap > used always (room for the NUL) */
    size_t pre;
    int failed; /* a string was not UTF-8, or a value could not be encoded */
} cg_jsonw;

/* Starts a text with pre bytes of headroom, in a buffer of at least pre + hint + 1 bytes. */
void cg_jsonw_init(cg_jsonw *w, size_t pre, size_t hint);
/* The same in buf (cap bytes, malloc'd, or NULL), which the writer takes: kept when it holds
 * pre + hint + 1 bytes, else freed for a new one. For the buffers of frames a connection
 * writes again and again: a buffer over 1 KiB taken from malloc each time also has malloc
 * sort its lists of small free chunks (malloc_consolidate), a few percent of a turn. */
void cg_jsonw_init_in(cg_jsonw *w, size_t pre, size_t hint, char *buf, size_t cap);
/* The largest buffer worth keeping for the next text; one grown past it goes back to malloc. */
#define CG_JSONW_KEEP_MAX (64 * 1024)
/* Appends len bytes of JSON text as they are (the caller's literal skeleton). Inline: a
 * frame is written in some twenty pieces, most of them a few bytes. */
void cg_jsonw_grow(cg_jsonw *w, size_t len);
static inline void cg_jsonw_raw(cg_jsonw *w, const char *text, size_t len)
{
    if (w->used + len >= w->cap)
        cg_jsonw_grow(w, len);
    memcpy(w->buf + w->used, text, len);
    w->used += len;
}
#define CG_JSONW_LIT(w, lit) cg_jsonw_raw((w), (lit), sizeof(lit) - 1)
/* Appends s[0..len) as a JSON string; s NULL appends null. */
void cg_jsonw_str(cg_jsonw *w, const char *s, size_t len);
/* Appends v as compact JSON, as json_dumps(v, JSON_COMPACT | JSON_ENCODE_ANY) writes it
 * (keys in the order set; reals are left to jansson); v NULL appends null. */
void cg_jsonw_json(cg_jsonw *w, json_t *v);
/* The value written since `at` (w->used before it) becomes null when it could not be written
 * (w->failed: text that is not UTF-8, nesting too deep), and w goes on: one value lost, not
 * the whole text. */
void cg_jsonw_null_if_failed(cg_jsonw *w, size_t at);
/* cg_jsonw_json, then cg_jsonw_null_if_failed. */
void cg_jsonw_json_or_null(cg_jsonw *w, json_t *v);
/* Appends n as a JSON number. */
void cg_jsonw_int(cg_jsonw *w, long long n);
/* n in decimal, written backwards to end just before end (at most 20 bytes); its length. */
size_t cg_int_text(char *end, long long n);
/* Members after an object's first: ,"name":value, name being a key that needs no escape.
 * A NULL string is null; a NULL JSON value is `empty` ("null", "{}" or "[]"). */
void cg_jsonw_member_str(cg_jsonw *w, const char *name, const char *value);
void cg_jsonw_member_json(cg_jsonw *w, const char *name, json_t *value, const char *empty);
/* Ends the text: the buffer (text at buf + pre, NUL-terminated, *len its length), or NULL
 * (the buffer freed) when a piece failed. */
char *cg_jsonw_end(cg_jsonw *w, size_t *len);

#endif
