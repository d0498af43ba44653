/*
 * chunk_ref.h: what openai.c's jansson path makes of a streamed chunk, the reference that
 * upstream/chunk.h's reader is held to (test_chunk.c and fuzz_chunk.c). When cg_chunk_read
 * says 1, jansson must have read an object with no "error" and no usage object, the same
 * finish, and the same delta text.
 */
#ifndef CG_CHUNK_REF_H
#define CG_CHUNK_REF_H

#include <jansson.h>
#include <string.h>

#include "chatgate/upstream/chunk.h"

typedef struct chunk_ref {
    int object, error, usage, finished;
    json_t *tree;
    const char *content; /* a delta's text (NULL: none, as openai.c: a string of length > 0) */
    size_t content_len;
} chunk_ref;

static inline void chunk_ref_read(chunk_ref *r, const char *data, size_t len)
{
    memset(r, 0, sizeof(*r));
    r->tree = json_loadb(data, len, 0, NULL);
    if (!json_is_object(r->tree))
        return;
    r->object = 1;
    r->error = json_object_get(r->tree, "error") != NULL;
    r->usage = json_is_object(json_object_get(r->tree, "usage"));
    json_t *choice = json_array_get(json_object_get(r->tree, "choices"), 0);
    json_t *finish = json_object_get(choice, "finish_reason");
    r->finished = finish && !json_is_null(finish);
    json_t *content = json_object_get(json_object_get(choice, "delta"), "content");
    if (json_is_string(content) && json_string_length(content) > 0) {
        r->content = json_string_value(content);
        r->content_len = json_string_length(content);
    }
}

static inline void chunk_ref_free(chunk_ref *r)
{
    json_decref(r->tree);
    r->tree = NULL;
}

/* 1 when the reader's k (which said 1) and jansson's r agree. */
static inline int chunk_ref_agrees(const cg_chunk *k, const chunk_ref *r)
{
    size_t klen = k->content ? k->content_len : 0;
    if (!r->object || r->error || r->usage || !k->finished != !r->finished || klen != r->content_len)
        return 0;
    return klen == 0 || memcmp(k->content, r->content, klen) == 0;
}

#endif
