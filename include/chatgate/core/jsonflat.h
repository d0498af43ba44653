#ifndef CHATGATE_CORE_JSONFLAT_H
#define CHATGATE_CORE_JSONFLAT_H
/*
 * jsonflat.h: the members of a flat JSON frame, read without building a tree.
 *
 * A turn reads a client's message frame and the app's delta and done frames, each an object
 * of a few strings. jansson's json_loadb built a tree for each (an object, its hash table, a
 * copy of every key and string): about a microsecond a frame and a third of a turn's
 * instructions with no rules (callgrind, issue 12). Here yajl, a streaming parser, reads the
 * frame and the members are kept as pointers into it.
 *
 * Only the plain case is read here; everything else is left to jansson, whose answer and error
 * messages stay the gateway's: cg_jsonflat_read says 0, and the caller reads the frame with
 * json_loadb as before. The plain case is
 *   - a JSON object whose values are strings, true, false or null (no number, array or
 *     nested object), at most CG_JSONFLAT_MAX members, no key twice;
 *   - valid UTF-8 as jansson checks it (cg_utf8_valid), and no \u escape: yajl lets some
 *     forms through that jansson refuses (overlong forms; a lone surrogate, which it turns
 *     into '?'), and a "\u0000" would put a NUL in a key or a string.
 * So a frame read here is one jansson accepts with the same members and values (unit_jsonflat
 * holds the two to each other).
 */
#include <stddef.h>

#include "chatgate/core/yajlread.h"

#define CG_JSONFLAT_MAX 16

typedef enum cg_jsonflat_kind { CG_JSONFLAT_STRING, CG_JSONFLAT_NULL, CG_JSONFLAT_TRUE, CG_JSONFLAT_FALSE } cg_jsonflat_kind;

/* A member: its key and, for a string, its text (str[0..len), not NUL-terminated). Both
 * point into the frame, or into the reader's own copy of a text that had escapes. */
typedef struct cg_jsonflat_member {
    const char *key, *str;
    size_t key_len, len;
    cg_jsonflat_kind kind;
} cg_jsonflat_member;

typedef struct cg_jsonflat {
    size_t n;
    cg_jsonflat_member m[CG_JSONFLAT_MAX];
    /* the read's own state */
    const char *frame;
    size_t frame_len;
    char *copies; /* texts that had escapes, decoded: malloc'd when the first one comes */
    size_t copied;
    int depth, ok;
    cg_yajl_room room; /* yajl's allocations */
} cg_jsonflat;

/* Reads buf[0..len) into f: 1 when it is the plain case above, 0 when not (read it with
 * jansson). Either way cg_jsonflat_free(f) afterwards; the members point into buf, which must
 * outlive them. */
int cg_jsonflat_read(cg_jsonflat *f, const char *buf, size_t len);
/* The member named key, or NULL. */
const cg_jsonflat_member *cg_jsonflat_get(const cg_jsonflat *f, const char *key);
/* 1 when m is a member (not NULL) whose value is the string text. */
int cg_jsonflat_is(const cg_jsonflat_member *m, const char *text);
void cg_jsonflat_free(cg_jsonflat *f);

#endif
