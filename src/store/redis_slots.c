/*
 * redis_slots.c: the pure rules of Redis Cluster a client follows (redis_cluster.h): a key's
 * slot, the redirects, the slot map from CLUSTER SLOTS. No I/O: tests/unit/test_redis_slots.c
 * checks each against the cluster spec's examples.
 */
#include "chatgate/store/redis_cluster.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* CRC16-CCITT as the cluster spec defines it (XMODEM: polynomial 0x1021, initial value 0, no
 * reflection), a byte at a time through a table of the 256 bytes' remainders, made at the
 * first use from the bitwise definition: a turn hashes a user's tag twice (a command's keys
 * share it), and bit by bit it was 4% of the gateway's instructions a turn (callgrind). */
static unsigned short crc16_table[256];

static void crc16_table_make(void)
{
    for (unsigned b = 0; b < 256; b++) {
        unsigned crc = b << 8;
        for (int bit = 0; bit < 8; bit++)
            crc = (crc & 0x8000) ? ((crc << 1) ^ 0x1021) & 0xffff : (crc << 1) & 0xffff;
        crc16_table[b] = (unsigned short)crc;
    }
}

unsigned cg_redis_crc16(const char *buf, size_t len)
{
    if (crc16_table[1] == 0) /* 0x1021 once made: one process, one thread hashes */
        crc16_table_make();
    unsigned crc = 0;
    for (size_t i = 0; i < len; i++)
        crc = ((crc << 8) ^ crc16_table[((crc >> 8) ^ (unsigned char)buf[i]) & 0xff]) & 0xffff;
    return crc;
}

unsigned cg_redis_key_slot(const char *key, size_t len)
{
    const char *open = memchr(key, '{', len);
    if (open) {
        size_t after = len - (size_t)(open + 1 - key);
        const char *close = memchr(open + 1, '}', after);
        if (close && close > open + 1) /* "{}" is no tag: the whole key counts */
            return cg_redis_crc16(open + 1, (size_t)(close - open - 1)) & (CG_REDIS_SLOTS - 1);
    }
    return cg_redis_crc16(key, len) & (CG_REDIS_SLOTS - 1);
}

/* The decimal number at [*p, end) (digits only, at most max), *p moved past it; -1 when none
 * or too large. Never reads at or past end: the error text need not end with a NUL. */
static long parse_num(const char **p, const char *end, long max)
{
    const char *c = *p;
    long v = 0;
    while (c < end && *c >= '0' && *c <= '9') {
        v = v * 10 + (*c - '0');
        if (v > max)
            return -1;
        c++;
    }
    if (c == *p)
        return -1;
    *p = c;
    return v;
}

/* "MOVED 3999 127.0.0.1:6381" / "ASK 3999 127.0.0.1:6381": the slot and the node's address
 * (the port after the last ':', so an IPv6 address keeps its colons). */
static int parse_target(const char *p, const char *end, cg_redis_redirect *out)
{
    long slot = parse_num(&p, end, CG_REDIS_SLOTS - 1);
    if (slot < 0 || p == end || *p != ' ')
        return -1;
    const char *addr = p + 1;
    const char *colon = NULL;
    for (const char *c = addr; c < end; c++)
        if (*c == ':')
            colon = c;
    if (!colon || colon == addr || (size_t)(colon - addr) >= sizeof(out->host))
        return -1;
    const char *q = colon + 1;
    long port = parse_num(&q, end, 65535);
    if (port < 1 || q != end)
        return -1;
    out->slot = (int)slot;
    memcpy(out->host, addr, (size_t)(colon - addr));
    out->host[colon - addr] = 0;
    out->port = (int)port;
    return 0;
}

cg_redis_redirect_kind cg_redis_parse_redirect(const char *err, size_t len, cg_redis_redirect *out)
{
    memset(out, 0, sizeof(*out));
    const char *end = err + len;
    while (end > err && (end[-1] == '\r' || end[-1] == '\n' || end[-1] == ' '))
        end--;
    size_t n = (size_t)(end - err);
    if (n > 6 && memcmp(err, "MOVED ", 6) == 0 && parse_target(err + 6, end, out) == 0)
        out->kind = CG_REDIRECT_MOVED;
    else if (n > 4 && memcmp(err, "ASK ", 4) == 0 && parse_target(err + 4, end, out) == 0)
        out->kind = CG_REDIRECT_ASK;
    else if (n >= 8 && memcmp(err, "TRYAGAIN", 8) == 0)
        out->kind = CG_REDIRECT_TRYAGAIN;
    else if (n >= 11 && memcmp(err, "CLUSTERDOWN", 11) == 0)
        out->kind = CG_REDIRECT_CLUSTERDOWN;
    return out->kind;
}

int cg_redis_slot_map_node(cg_redis_slot_map *m, const char *host, int port)
{
    for (int i = 0; i < m->n_nodes; i++)
        if (m->nodes[i].port == port && strcmp(m->nodes[i].host, host) == 0)
            return i;
    if (m->n_nodes == CG_REDIS_CLUSTER_MAX_NODES || strlen(host) >= sizeof(m->nodes[0].host))
        return -1;
    snprintf(m->nodes[m->n_nodes].host, sizeof(m->nodes[0].host), "%s", host);
    m->nodes[m->n_nodes].port = port;
    return m->n_nodes++;
}

/*
 * CLUSTER SLOTS: an array of ranges, each [first, last, master, replica...], a node being
 * [host, port, id, ...]. Only the master (the first node) is kept: writes never go to a
 * replica.
 */
int cg_redis_slot_map_read(const redisReply *r, const char *seed_host, cg_redis_slot_map *m, char *err,
                           size_t errlen)
{
    m->n_nodes = 0;
    for (int i = 0; i < CG_REDIS_SLOTS; i++)
        m->owner[i] = -1;
    if (!r || r->type != REDIS_REPLY_ARRAY) {
        snprintf(err, errlen, "CLUSTER SLOTS: %s", r && r->type == REDIS_REPLY_ERROR ? r->str : "not an array");
        return -1;
    }
    for (size_t i = 0; i < r->elements; i++) {
        const redisReply *range = r->element[i];
        if (range->type != REDIS_REPLY_ARRAY || range->elements < 3 || range->element[0]->type != REDIS_REPLY_INTEGER ||
            range->element[1]->type != REDIS_REPLY_INTEGER || range->element[2]->type != REDIS_REPLY_ARRAY ||
            range->element[2]->elements < 2 || range->element[2]->element[0]->type != REDIS_REPLY_STRING ||
            range->element[2]->element[1]->type != REDIS_REPLY_INTEGER) {
            snprintf(err, errlen, "CLUSTER SLOTS: range %zu is malformed", i + 1);
            return -1;
        }
        long long first = range->element[0]->integer, last = range->element[1]->integer;
        const redisReply *master = range->element[2];
        long long port = master->element[1]->integer;
        const char *host = master->element[0]->str;
        if (!host[0] || strcmp(host, "?") == 0)
            host = seed_host;
        if (first < 0 || last >= CG_REDIS_SLOTS || first > last || port < 1 || port > 65535) {
            snprintf(err, errlen, "CLUSTER SLOTS: range %zu (%lld-%lld, port %lld) is out of range", i + 1, first, last,
                     port);
            return -1;
        }
        int node = cg_redis_slot_map_node(m, host, (int)port);
        if (node < 0) {
            snprintf(err, errlen, "CLUSTER SLOTS: more than %d masters, or a host of 64 bytes or more",
                     CG_REDIS_CLUSTER_MAX_NODES);
            return -1;
        }
        for (long long s = first; s <= last; s++)
            m->owner[s] = (int16_t)node;
    }
    if (m->n_nodes == 0) {
        snprintf(err, errlen, "CLUSTER SLOTS: no slot is served");
        return -1;
    }
    return 0;
}
