/*
 * store.c: what both stores share: choosing one from its URL, dialog keys built from
 * escaped ids, and the clock.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "chatgate/core/log.h"
#include "chatgate/store/store.h"

cg_store *cg_store_open(uv_loop_t *loop, const cg_store_config *cfg, char *err, size_t errlen)
{
    if (strcmp(cfg->url, "memory") == 0)
        return cg_store_memory_open(loop, cfg);
    if (strncmp(cfg->url, "redis://", 8) == 0 || strncmp(cfg->url, "redis-sentinel://", 17) == 0)
        return cg_store_redis_open(loop, cfg, err, errlen);
    snprintf(err, errlen, "'%s' must be memory, redis://HOST:PORT[/DB] or redis-sentinel://HOST:PORT[,...]/MASTER[/DB]",
             cfg->url);
    return NULL;
}

char *cg_store_escape(const char *id)
{
    static const char hex[] = "0123456789ABCDEF";
    size_t n = strlen(id);
    char *out = malloc(n * 3 + 1);
    if (!out)
        abort();
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
    *p = 0;
    return out;
}

char *cg_store_dialog_key(const char *user, const char *room)
{
    char *u = cg_store_escape(user), *r = cg_store_escape(room);
    size_t n = strlen(u) + strlen(r) + 2;
    char *key = malloc(n);
    if (!key)
        abort();
    snprintf(key, n, "%s:%s", u, r);
    free(u);
    free(r);
    return key;
}

/* CHATGATE_NOW ("2026-02-05" or "2026-02-05T10:30:00Z") moves the clock, which then runs
 * on from there; the offset is taken once, at the first call. */
int64_t cg_store_default_now(void *unused)
{
    (void)unused;
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
    return (int64_t)time(NULL) + offset;
}
