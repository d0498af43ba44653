/*
 * yajlread.c: what jsonflat.c and upstream/chunk.c share to read through yajl (see
 * yajlread.h): the bytes check, the room yajl allocates from, and a parse whole.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "chatgate/core/alloc.h"
#include "chatgate/core/swar.h"
#include "chatgate/core/utf8.h"
#include "chatgate/core/yajlread.h"

int cg_yajl_plain_bytes(const char *buf, size_t len)
{
    const unsigned char *u = (const unsigned char *)buf;
    for (size_t i = 0; i < len;) {
        if (i + 8 <= len) { /* eight bytes of ASCII at once, none of them '\\', \v or \f */
            uint64_t v = cg_swar_load(u + i);
            if (!(v & CG_SWAR_HIGHS) && !cg_swar_has(v, '\\') && !cg_swar_has(v, '\v') && !cg_swar_has(v, '\f')) {
                i += 8;
                continue;
            }
        }
        unsigned char c = u[i];
        if (c >= 0x80) {
            size_t n = cg_utf8_char_len(u + i, len - i);
            if (!n)
                return 0;
            i += n;
            continue;
        }
        if ((c == '\\' && i + 1 < len && u[i + 1] == 'u') || c == '\v' || c == '\f')
            return 0;
        i += c == '\\' ? 2 : 1; /* an escape's second byte is not the start of one */
    }
    return 1;
}

/* Each allocation in the room is preceded by its size, for a realloc; all are let go
 * together when the room goes. */
static void *room_malloc(void *ctx, size_t n)
{
    cg_yajl_room *r = ctx;
    size_t need = (sizeof(size_t) + n + 15) & ~(size_t)15;
    if (need > sizeof(r->bytes) - r->used)
        return cg_malloc(n);
    char *p = (char *)r->bytes + r->used;
    r->used += need;
    memcpy(p, &n, sizeof(n));
    return p + sizeof(size_t);
}

static int in_room(const cg_yajl_room *r, const void *p)
{
    return (const char *)p >= (const char *)r->bytes && (const char *)p < (const char *)r->bytes + sizeof(r->bytes);
}

static void room_free(void *ctx, void *p)
{
    if (!in_room(ctx, p))
        free(p);
}

static void *room_realloc(void *ctx, void *p, size_t n)
{
    if (!p || !in_room(ctx, p))
        return p ? cg_realloc(p, n) : room_malloc(ctx, n);
    size_t had;
    memcpy(&had, (char *)p - sizeof(size_t), sizeof(had));
    void *q = room_malloc(ctx, n);
    if (q)
        memcpy(q, p, had < n ? had : n);
    return q;
}

yajl_handle cg_yajl_open(cg_yajl_room *room, const yajl_callbacks *callbacks, void *ctx)
{
    room->used = 0;
    yajl_alloc_funcs funcs = {room_malloc, room_realloc, room_free, room};
    yajl_handle h = yajl_alloc(callbacks, &funcs, ctx);
    if (h)
        yajl_config(h, yajl_dont_validate_strings, 1);
    return h;
}

int cg_yajl_whole(yajl_handle h, const char *buf, size_t len, const int *ended)
{
    int read = yajl_parse(h, (const unsigned char *)buf, len) == yajl_status_client_canceled && *ended;
    for (size_t i = read ? yajl_get_bytes_consumed(h) : len; i < len && read; i++)
        read = buf[i] == ' ' || buf[i] == '\t' || buf[i] == '\n' || buf[i] == '\r';
    return read;
}
