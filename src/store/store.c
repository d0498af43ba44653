/*
 * store.c: what both stores share: choosing one from its URL, dialog keys built from
 * escaped ids, and the clock.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "chatgate/core/alloc.h"
#include "chatgate/core/log.h"
#include "chatgate/store/store.h"

cg_store *cg_store_open(uv_loop_t *loop, const cg_store_config *cfg, char *err, size_t errlen)
{
    if (strcmp(cfg->url, "memory") == 0)
        return cg_store_memory_open(loop, cfg);
    if (strncmp(cfg->url, "redis", 5) == 0)
        return cg_store_redis_open(loop, cfg, err, errlen); /* it says which of its schemes it is not */
    /* the URL is not quoted: it may hold a password */
    snprintf(err, errlen, "must be memory, redis[s]://HOST:PORT[/DB], redis[s]-sentinel://HOST:PORT[,...]/MASTER[/DB] "
                          "or redis[s]-cluster://HOST:PORT[,...]");
    return NULL;
}

static int hexval(char c)
{
    return c >= '0' && c <= '9' ? c - '0' : c >= 'A' && c <= 'F' ? c - 'A' + 10 : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
}

/* id escaped at out (room for 3 bytes a byte); returns the end. */
static char *escape_into(char *out, const char *id)
{
    static const char hex[] = "0123456789ABCDEF";
    char *p = out;
    for (const unsigned char *s = (const unsigned char *)id; *s; s++) {
        if ((*s >= 'a' && *s <= 'z') || (*s >= 'A' && *s <= 'Z') || (*s >= '0' && *s <= '9') || *s == '_' ||
            *s == '.' || *s == '@' || *s == '|' || *s == '-') {
            *p++ = (char)*s;
        } else {
            *p++ = '%';
            *p++ = hex[*s >> 4];
            *p++ = hex[*s & 15];
        }
    }
    return p;
}

char *cg_store_escape(const char *id)
{
    char *out = cg_malloc(strlen(id) * 3 + 1);
    *escape_into(out, id) = 0;
    return out;
}

char *cg_store_unescape(const char *s, size_t n)
{
    char *out = cg_malloc(n + 1), *p = out;
    for (size_t i = 0; i < n; i++) {
        int hi, lo;
        if (s[i] == '%' && i + 2 < n && (hi = hexval(s[i + 1])) >= 0 && (lo = hexval(s[i + 2])) >= 0) {
            *p++ = (char)(hi << 4 | lo);
            i += 2;
        } else {
            *p++ = s[i];
        }
    }
    *p = 0;
    return out;
}

char *cg_store_key_join(const char *eu, const char *er)
{
    size_t nu = strlen(eu), nr = strlen(er); /* a few times a turn: no asprintf */
    char *key = cg_malloc(nu + nr + 2);
    memcpy(key, eu, nu);
    key[nu] = ':';
    memcpy(key + nu + 1, er, nr + 1);
    return key;
}

char *cg_store_dialog_key(const char *user, const char *room)
{
    /* a few times a turn (its lock, the store's load and save): escaped in place, one malloc */
    char *key = cg_malloc((strlen(user) + strlen(room)) * 3 + 2);
    char *p = escape_into(key, user);
    *p++ = ':';
    *escape_into(p, room) = 0;
    return key;
}

/* CHATGATE_NOW ("2026-02-05" or "2026-02-05T10:30:00Z") moves the clock, which then runs
 * on from there; the offset (seconds) is taken once, at the first call. */
static int64_t clock_offset(void)
{
    static int init;
    static int64_t offset;
    if (!init) {
        init = 1;
        const char *env = getenv("CHATGATE_NOW");
        struct tm tm;
        memset(&tm, 0, sizeof(tm));
        if (env && *env) {
            int y, mo, d, h = 0, mi = 0, s = 0;
            if (sscanf(env, "%d-%d-%dT%d:%d:%d", &y, &mo, &d, &h, &mi, &s) >= 3) {
                tm.tm_year = y - 1900;
                tm.tm_mon = mo - 1;
                tm.tm_mday = d;
                tm.tm_hour = h;
                tm.tm_min = mi;
                tm.tm_sec = s;
                offset = (int64_t)timegm(&tm) - (int64_t)time(NULL);
            } else {
                cg_warn("CHATGATE_NOW='%s' is not an ISO date (2026-02-05T10:30:00Z); using the real clock", env);
            }
        }
    }
    return offset;
}

int64_t cg_store_default_now(void *unused)
{
    (void)unused;
    return (int64_t)time(NULL) + clock_offset();
}

/* One reading of the clock, not time() plus clock_gettime()'s milliseconds: time() reads
 * the kernel's tick-updated second, which can lag clock_gettime() by a tick, so the pair
 * could step back by most of a second at a second's turn. */
int64_t cg_store_default_now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return ((int64_t)ts.tv_sec + clock_offset()) * 1000 + ts.tv_nsec / 1000000;
}

double cg_store_degraded_seconds(const cg_store_stats *st, uint64_t now)
{
    double s = st->degraded_seconds;
    if (st->degraded)
        s += (double)(now - st->degraded_since_ms) / 1000.0;
    return s;
}

void cg_store_stats_add(cg_store_stats *dst, const cg_store_stats *src, int gauges)
{
    dst->loads += src->loads;
    dst->saves += src->saves;
    dst->deletes += src->deletes;
    dst->errors += src->errors;
    dst->degraded_answers += src->degraded_answers;
    dst->reconnects += src->reconnects;
    dst->flushed += src->flushed;
    dst->evictions += src->evictions;
    dst->evictions_bytes += src->evictions_bytes;
    dst->evictions_rooms += src->evictions_rooms;
    dst->writeback_dropped_bound += src->writeback_dropped_bound;
    dst->writeback_dropped_gone += src->writeback_dropped_gone;
    dst->writeback_failed += src->writeback_failed;
    dst->save_conflicts += src->save_conflicts;
    dst->lease_waits += src->lease_waits;
    dst->lease_lost += src->lease_lost;
    dst->remote_cancels += src->remote_cancels;
    dst->loads_cached += src->loads_cached;
    dst->loads_pipelined += src->loads_pipelined;
    dst->lease_wakes += src->lease_wakes;
    dst->loads_pipelined_again += src->loads_pipelined_again;
    dst->saves_appended += src->saves_appended;
    dst->primary_switches += src->primary_switches;
    dst->readonly_replies += src->readonly_replies;
    dst->replica_refused += src->replica_refused;
    dst->degraded_seconds += src->degraded_seconds;
    if (gauges) {
        dst->memory_bytes += src->memory_bytes;
        dst->memory_dialogs += src->memory_dialogs;
        dst->writeback_pending += src->writeback_pending;
        dst->writeback_pending_bytes += src->writeback_pending_bytes;
        dst->degraded |= src->degraded;
    }
}

int64_t cg_store_now_ms(cg_store *st)
{
    return st->now(st->clock_ctx) * 1000;
}

unsigned long cg_store_key_tag(const char *key)
{
    unsigned long h = 2166136261ul; /* FNV-1a, 32 bits */
    for (const unsigned char *p = (const unsigned char *)key; *p; p++)
        h = ((h ^ *p) * 16777619ul) & 0xfffffffful;
    return h;
}
