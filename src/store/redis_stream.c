/*
 * redis_stream.c: the Redis store's stream (store.h, cg_store_stream_ops): one XADD a
 * record, to "<prefix>:<name>", trimmed with MAXLEN ~ (Redis trims whole macro nodes, so
 * the stream holds at least max_len records and a little more, cheaply).
 *
 * The command goes over the store's link (redis_link.c), so it reaches the one node, the
 * primary Sentinel names, or the master of the key's slot in a Cluster (the key has no hash
 * tag: it lives on one slot, as a stream must). Nothing is held here while Redis is away:
 * an append then fails at once and the caller (server/export.c) keeps its bounded queue.
 */
#define _GNU_SOURCE /* asprintf */
#include <hiredis/hiredis.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "chatgate/core/alloc.h"
#include "chatgate/core/log.h"
#include "chatgate/store/redis_argv.h"
#include "chatgate/store/redis_internal.h"

/* An append on its way: whom to tell (freed with the answer). */
typedef struct stream_append {
    cg_store_appended_fn cb;
    void *ctx;
} stream_append;

static void on_appended(cg_redis_conn *c, void *reply, void *priv)
{
    (void)c;
    stream_append *ap = priv;
    redisReply *r = reply;
    int ok = r && r->type == REDIS_REPLY_STRING; /* the new entry's id */
    if (r && r->type == REDIS_REPLY_ERROR)
        cg_warn("export: XADD refused: %.200s", r->str);
    ap->cb(ap->ctx, ok);
    free(ap);
}

/* XADD <prefix>:<name> [MAXLEN ~ <max_len>] * <field> <value> */
static int redis_stream_append(cg_store *st, const char *name, const char *field, const char *value, size_t len,
                               long max_len, cg_store_appended_fn cb, void *ctx)
{
    redis_store *rs = (redis_store *)st;
    if (rs->closing || !rs->link || !cg_redis_linked(rs))
        return -1;
    char *key = NULL;
    if (asprintf(&key, "%s:%s", rs->base.cfg.prefix, name) < 0)
        return -1;
    cg_argv a = {0};
    cg_argv_str(&a, "XADD");
    cg_argv_str(&a, key);
    a.slot = cg_redis_key_slot(key, strlen(key)); /* no hash tag: the whole key's slot */
    free(key);
    if (max_len > 0) {
        cg_argv_str(&a, "MAXLEN");
        cg_argv_str(&a, "~");
        cg_argv_int(&a, max_len);
    }
    cg_argv_str(&a, "*");
    cg_argv_str(&a, field);
    cg_argv_arg(&a, value, len);
    stream_append *ap = cg_malloc(sizeof(*ap));
    ap->cb = cb;
    ap->ctx = ctx;
    int rc = cg_redis_send_argv(rs, &a, on_appended, ap);
    cg_argv_free(&a);
    if (rc != 0) {
        free(ap);
        return -1;
    }
    return 0;
}

const cg_store_stream_ops cg_redis_stream_ops = {.append = redis_stream_append};
