/*
 * chunk.c: an OpenAI-compatible streamed chunk through yajl's callbacks (chunk.h says which
 * chunks and why). The reader keeps a stack of the containers it is in, each with the key
 * whose value comes next; a value is one of the few the gateway wants, or skipped. A callback
 * that returns 0 stops the parse: at the chunk's end (ended set), or because the chunk is not
 * the plain case, which jansson then reads.
 */
#include <stdlib.h>
#include <string.h>

#include "chatgate/core/alloc.h"
#include "chatgate/upstream/chunk.h"

/* The containers the reader can be in. */
enum { IN_TOP, IN_CHOICES, IN_CHOICE, IN_DELTA, IN_SKIPPED };

/* The keys that matter, each in one kind of container; a bit each in k->seen. */
enum { KEY_OTHER, KEY_CHOICES, KEY_USAGE, KEY_DELTA, KEY_FINISH, KEY_CONTENT, KEY_TOOLS };

/* What the next value is. */
typedef enum { V_SKIPPED, V_TOP, V_CHOICES, V_USAGE, V_CHOICE, V_DELTA, V_FINISH, V_CONTENT, V_TOOLS } value_kind;

static value_kind next_value(cg_chunk *k)
{
    if (k->depth == 0)
        return V_TOP;
    cg_chunk_level *l = &k->level[k->depth - 1];
    unsigned char key = l->key;
    l->key = KEY_OTHER; /* a key's value comes once */
    switch (l->kind) {
    case IN_TOP:
        return key == KEY_CHOICES ? V_CHOICES : key == KEY_USAGE ? V_USAGE : V_SKIPPED;
    case IN_CHOICES:
        return l->elements++ == 0 ? V_CHOICE : V_SKIPPED;
    case IN_CHOICE:
        return key == KEY_DELTA ? V_DELTA : key == KEY_FINISH ? V_FINISH : V_SKIPPED;
    case IN_DELTA:
        return key == KEY_CONTENT ? V_CONTENT : key == KEY_TOOLS ? V_TOOLS : V_SKIPPED;
    default:
        return V_SKIPPED;
    }
}

static int enter(cg_chunk *k, unsigned char kind)
{
    if (k->depth == CG_CHUNK_DEPTH)
        return 0;
    k->level[k->depth].kind = kind;
    k->level[k->depth].key = KEY_OTHER;
    k->level[k->depth].elements = 0;
    k->depth++;
    return 1;
}

static int leave(void *ctx)
{
    cg_chunk *k = ctx;
    if (--k->depth == 0) {
        k->ended = 1;
        return 0; /* the chunk's end: what follows is checked by cg_yajl_whole */
    }
    return 1;
}

/* A scalar (null 0, else 1): 1 goes on, 0 stops the parse (not the plain case). */
static int scalar(cg_chunk *k, int not_null)
{
    switch (next_value(k)) {
    case V_SKIPPED:
        return 1;
    case V_USAGE:
    case V_CONTENT:
    case V_TOOLS:
        return !not_null; /* a string content comes through on_string; tool calls are jansson's */
    case V_FINISH:
        k->finished |= not_null;
        return 1;
    default:
        return 0;
    }
}

static int on_null(void *ctx)
{
    return scalar(ctx, 0);
}

static int on_boolean(void *ctx, int b)
{
    (void)b;
    return scalar(ctx, 1);
}

/* A number jansson reads without a range error: -?D{1,18}, or -?D+.D+ in 24 characters
 * (yajl checked the grammar). Anything else, an exponent above all, is jansson's call. */
static int on_number(void *ctx, const char *s, size_t len)
{
    size_t i = s[0] == '-', digits = 0;
    int dot = 0;
    for (; i < len; i++) {
        if (s[i] == '.' && !dot)
            dot = 1;
        else if (s[i] >= '0' && s[i] <= '9')
            digits++;
        else
            return 0;
    }
    if (dot ? len > 24 : digits > 18)
        return 0;
    return scalar(ctx, 1);
}

static int on_string(void *ctx, const unsigned char *s, size_t len)
{
    cg_chunk *k = ctx;
    value_kind v = next_value(k);
    if (v == V_FINISH)
        k->finished = 1;
    if (v != V_CONTENT)
        return v == V_SKIPPED || v == V_FINISH;
    const char *p = (const char *)s;
    if (p < k->data || p + len > k->data + k->data_len) { /* decoded into yajl's buffer */
        k->copy = cg_malloc(len + 1);
        memcpy(k->copy, s, len);
        p = k->copy;
    }
    k->content = p;
    k->content_len = len;
    return 1;
}

static int on_key(void *ctx, const unsigned char *key, size_t len)
{
    cg_chunk *k = ctx;
    cg_chunk_level *l = &k->level[k->depth - 1];
#define KEY(in, key, name) {in, key, sizeof(name) - 1, name}
    static const struct {
        unsigned char in, key, len;
        const char *name;
    } keys[] = {
        KEY(IN_TOP, KEY_CHOICES, "choices"), KEY(IN_TOP, KEY_USAGE, "usage"), KEY(IN_TOP, KEY_OTHER, "error"),
        KEY(IN_CHOICE, KEY_DELTA, "delta"), KEY(IN_CHOICE, KEY_FINISH, "finish_reason"),
        KEY(IN_DELTA, KEY_CONTENT, "content"), KEY(IN_DELTA, KEY_TOOLS, "tool_calls"),
    };
#undef KEY
    l->key = KEY_OTHER;
    if (l->kind == IN_SKIPPED || l->kind == IN_CHOICES) /* no key there matters (most of a chunk's keys) */
        return 1;
    for (size_t i = 0; i < sizeof(keys) / sizeof(keys[0]); i++) {
        /* the length first: no strlen, and no memcmp but for a likely match (a key of every
         * chunk, a thirteenth of a delta's instructions with them) */
        if (keys[i].len != len || keys[i].in != l->kind || memcmp(keys[i].name, key, len) != 0)
            continue;
        if (keys[i].key == KEY_OTHER) /* "error": jansson's */
            return 0;
        if (k->seen & (1u << keys[i].key)) /* twice: jansson keeps the last */
            return 0;
        k->seen |= 1u << keys[i].key;
        l->key = keys[i].key;
        if (l->kind == IN_TOP && !k->head_at) { /* the head ends at the first: its quote, in data */
            const char *quote = (const char *)key - 1;
            if (quote > k->data && quote < k->data + k->data_len && *quote == '"')
                k->head_at = (size_t)(quote - k->data);
        }
        break;
    }
    return 1;
}

/* An object (map 1) or an array begins: the container the reader is now in. */
static int start(cg_chunk *k, int map)
{
    value_kind v = next_value(k);
    if (v == V_FINISH)
        k->finished = 1; /* a finish_reason of another type is still one, as for jansson */
    if (v == V_SKIPPED || v == V_FINISH)
        return enter(k, IN_SKIPPED);
    if (map)
        return v == V_TOP ? enter(k, IN_TOP) : v == V_CHOICE ? enter(k, IN_CHOICE) : v == V_DELTA && enter(k, IN_DELTA);
    return v == V_CHOICES && enter(k, IN_CHOICES);
}

static int on_start_map(void *ctx)
{
    return start(ctx, 1);
}

static int on_start_array(void *ctx)
{
    return start(ctx, 0);
}

static const yajl_callbacks callbacks = {
    .yajl_null = on_null,
    .yajl_boolean = on_boolean,
    .yajl_number = on_number,
    .yajl_string = on_string,
    .yajl_start_map = on_start_map,
    .yajl_map_key = on_key,
    .yajl_end_map = leave,
    .yajl_start_array = on_start_array,
    .yajl_end_array = leave,
};

/* How many of data's first bytes are the head: all of it, followed by a key's quote; else 0. */
static size_t head_matched(const cg_chunk_head *head, const char *data, size_t len)
{
    if (!head || !head->len || len <= head->len || data[head->len] != '"')
        return 0;
    return memcmp(data, head->bytes, head->len) == 0 ? head->len : 0;
}

/* A chunk that is the frame around plain text: read, 1; else 0. */
static int read_in_frame(cg_chunk *k, const cg_chunk_head *head, const char *data, size_t len)
{
    if (!head || !cg_textframe_match(&head->frame, data, len, &k->content, &k->content_len))
        return 0;
    k->finished = head->finished;
    k->path = CG_CHUNK_IN_FRAME;
    return 1;
}

/* A plain chunk read with yajl: its content, when it is data's own bytes between their
 * quotes, makes the frame; a chunk with no content leaves the frame as it was. */
static void keep_frame(const cg_chunk *k, cg_chunk_head *head)
{
    if (!k->content || k->copy)
        return;
    cg_textframe_keep(&head->frame, k->data, k->data_len, k->content, k->content_len);
    head->finished = k->finished;
}

int cg_chunk_read(cg_chunk *k, cg_chunk_head *head, const char *data, size_t len)
{
    k->content = NULL;
    k->content_len = 0;
    k->finished = 0;
    k->data = data;
    k->data_len = len;
    k->copy = NULL;
    k->depth = 0;
    k->ended = 0;
    k->seen = 0;
    k->head_at = 0;
    if (read_in_frame(k, head, data, len))
        return 1;
    size_t skip = head_matched(head, data, len); /* the head's bytes were checked when it was kept */
    k->path = skip ? CG_CHUNK_AFTER_HEAD : CG_CHUNK_WHOLE;
    if (!cg_yajl_plain_bytes(data + skip, len - skip))
        return 0;
    yajl_handle h = cg_yajl_open(&k->room, &callbacks, k);
    if (!h)
        return 0;
    int read = skip ? yajl_parse(h, (const unsigned char *)"{", 1) == yajl_status_ok &&
                          cg_yajl_whole(h, data + skip, len - skip, &k->ended)
                    : cg_yajl_whole(h, data, len, &k->ended);
    yajl_free(h);
    if (read && head)
        keep_frame(k, head);
    if (read && !skip && head) { /* a plain chunk read whole: its head is the reply's now */
        head->len = k->head_at > 1 && k->head_at <= CG_CHUNK_HEAD_MAX ? k->head_at : 0;
        memcpy(head->bytes, data, head->len);
    }
    return read;
}

void cg_chunk_free(cg_chunk *k)
{
    free(k->copy);
    k->copy = NULL;
}
