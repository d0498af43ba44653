#ifndef CHATGATE_CORE_YAJLREAD_H
#define CHATGATE_CORE_YAJLREAD_H
/*
 * yajlread.h: what the gateway's two yajl readers share (jsonflat.h's flat frames, and an
 * OpenAI-compatible upstream's streamed chunks, upstream/chunk.h). Each reads only a plain
 * case through yajl's callbacks, without building a tree, and leaves everything else to
 * jansson, whose answers and error messages stay the gateway's. So each needs:
 *   - the check that a text's bytes are ones jansson and yajl read the same (valid UTF-8 as
 *     jansson checks it, no \u escape, no \v or \f);
 *   - a yajl handle whose few allocations come from a room on the reader's stack;
 *   - a parse that a callback stops at the value's end, with only whitespace after it.
 */
#include <stddef.h>
#include <yajl/yajl_parse.h>

/* yajl's allocations for one read (its handle, lexer and stacks: five, some 400 bytes, and
 * the buffer of a text with escapes); past the room, malloc's. */
typedef struct cg_yajl_room {
    _Alignas(16) unsigned char bytes[1024];
    size_t used;
} cg_yajl_room;

/*
 * 1 when buf[0..len) may be read by yajl as jansson reads it, in one pass: valid UTF-8 as
 * jansson checks it (cg_utf8_char_len), no \u escape (yajl lets through forms jansson
 * refuses: overlong ones, a lone surrogate, which it turns into '?'; and "\u0000" would put a
 * NUL in a text), and no \v or \f, which yajl also takes for whitespace and jansson does not.
 */
int cg_yajl_plain_bytes(const char *buf, size_t len);

/* A strict handle (no comments; its own UTF-8 check off, cg_yajl_plain_bytes being the
 * stricter one) allocating from room, whose callbacks get ctx; NULL when out of memory. Let
 * go of it with yajl_free. */
yajl_handle cg_yajl_open(cg_yajl_room *room, const yajl_callbacks *callbacks, void *ctx);

/* Parses buf[0..len) with h: 1 when a callback stopped the parse (returned 0) with *ended
 * set, at the end of the value, and only JSON whitespace follows it; 0 otherwise. A callback
 * stops the parse at the value's end because yajl would otherwise wait for the end of a
 * string begun after it. */
int cg_yajl_whole(yajl_handle h, const char *buf, size_t len, const int *ended);

#endif
