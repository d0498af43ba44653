#ifndef CHATGATE_UPSTREAM_CHUNK_H
#define CHATGATE_UPSTREAM_CHUNK_H
/*
 * chunk.h: an OpenAI-compatible upstream's streamed chunk, read without building a tree.
 *
 * A streamed reply is a chunk an event, hundreds a reply, each a JSON object of which the
 * gateway wants two things: choices[0].delta.content and whether choices[0].finish_reason is
 * set. jansson's json_loadb built a tree of each (objects, their hash tables, a copy of every
 * key and string): 19% of the gateway's CPU relaying 200 streams (perf, issue 39). Here
 * yajl's callbacks read the chunk and keep the content as a pointer into it.
 *
 * Only the plain case is read here; everything else is left to jansson, whose answers and
 * error messages stay the gateway's (cg_chunk_read says 0, and the caller reads the chunk
 * with json_loadb as before). The plain case is
 *   - bytes that jansson and yajl read the same (cg_yajl_plain_bytes: no \u escape);
 *   - an object with no "error" member and a "usage" that is absent or null (an error or the
 *     usage come once a reply, and are jansson's);
 *   - "choices", when there, an array whose first element is an object; its "delta", when
 *     there, an object; "content" a string or null; "tool_calls" absent or null (a call of
 *     the state function, upstreams.NAME.state_tool, is jansson's); none of these keys twice
 *     where it counts
 *     (jansson keeps the last of two, the reader here would see the first);
 *   - numbers anywhere that jansson reads without a range error: an integer of at most 18
 *     digits, or a decimal fraction of at most 24 characters with no exponent;
 *   - at most CG_CHUNK_DEPTH levels of nesting.
 * So a chunk read here gives what jansson's reading gives (unit_chunk and fuzz_chunk hold the
 * two to each other).
 *
 * The head. A server's chunks of one reply begin with the same members ("id", "object",
 * "created", "model", "system_fingerprint": about half of a chunk's bytes), and yajl's
 * reading was half of the gateway's instructions a delta (callgrind, issue 39's eighth
 * round). So the bytes of a chunk read as plain, up to its first key that matters
 * ("choices" or "usage"), are kept as the reply's head (cg_chunk_head); a chunk that begins
 * with the same bytes, followed at once by a key's opening quote, is read as "{" and the rest:
 * the head's members were read and checked in full once, and both leave the reader at the
 * same place, inside the top object and before a key (a "}" at once, valid after "{" but not
 * after the head's ",", is not a key's quote, so that chunk is read whole). Any other chunk
 * is read whole, and a plain one becomes the head.
 *
 * The frame. Most chunks of a reply differ in nothing but their text (core/textframe.h): a
 * plain chunk read with a content of its own bytes (no escape) keeps the frame around it, and
 * a chunk that is the same frame around a plain text is read without yajl: its tokens are the
 * frame chunk's, but for that one string's text, which is the new content, and its finish is
 * the frame chunk's. The head is tried next, then the whole chunk.
 */
#include <stddef.h>

#include "chatgate/core/textframe.h"
#include "chatgate/core/yajlread.h"

#define CG_CHUNK_DEPTH 16
#define CG_CHUNK_HEAD_MAX 256 /* bytes of a head kept: a longer one is not kept */

/* How a chunk was read (cg_chunk.path): for the tests, which hold each way to jansson. */
enum { CG_CHUNK_WHOLE, CG_CHUNK_AFTER_HEAD, CG_CHUNK_IN_FRAME };

/* What a reply's chunks leave for the next (above), kept by the caller from one chunk to the
 * next: zeroed to begin. */
typedef struct cg_chunk_head {
    size_t len; /* the head's bytes; 0: none */
    char bytes[CG_CHUNK_HEAD_MAX];
    cg_textframe frame; /* around the last content read with yajl */
    int finished;       /* the frame chunk's finish */
} cg_chunk_head;

/* A container the reader is in (chunk.c's kinds and keys), and the key whose value is next. */
typedef struct cg_chunk_level {
    unsigned char kind, key;
    unsigned elements;
} cg_chunk_level;

typedef struct cg_chunk {
    const char *content; /* choices[0].delta.content[0..content_len), or NULL */
    size_t content_len;
    int finished; /* choices[0].finish_reason is there and not null */
    /* the read's own state */
    const char *data;
    size_t data_len;
    char *copy; /* the content when it had escapes, decoded: malloc'd */
    int depth, ended;
    unsigned seen; /* the keys met, by bit: one twice is not the plain case */
    size_t head_at; /* where the first key that matters begins (its quote), 0 when unknown */
    int path;       /* CG_CHUNK_WHOLE, _AFTER_HEAD or _IN_FRAME */
    cg_chunk_level level[CG_CHUNK_DEPTH];
    cg_yajl_room room;
} cg_chunk;

/* Reads data[0..len) into k: 1 when it is the plain case above, 0 when not (read it with
 * jansson). head (NULL for none) is the reply's head, used and kept (above). Either way
 * cg_chunk_free(k) afterwards; the content may point into data, which must outlive it. */
int cg_chunk_read(cg_chunk *k, cg_chunk_head *head, const char *data, size_t len);
void cg_chunk_free(cg_chunk *k);

#endif
