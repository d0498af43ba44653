/*
 * limits.h: limits per user, across connections (docs/configuration.md, "Limits per user"): messages a
 * minute, turns at once, tokens a minute and a day. The store keeps the counts, so with
 * Redis they hold across workers and gateways (store.h, limit and limit_end); this is the
 * part both stores share: the limits, the windows, and the in-memory counter the memory
 * store uses and the Redis store falls back on while Redis is away.
 *
 * Windows are fixed: the wall clock's minute and its UTC day, the same for every gateway
 * (their clocks agree). A turn's tokens are known only at its end, so the token limits
 * refuse the next message once the window's tokens have reached the limit: a window can
 * go over by what the turns running at that moment spend.
 */
#ifndef CHATGATE_STORE_LIMITS_H
#define CHATGATE_STORE_LIMITS_H

#include <stdint.h>

#include "chatgate/config/limits_config.h" /* cg_limits */

/* Which limit a message met; the numbers are the Redis script's answers (redis_dialog.c). */
typedef enum {
    CG_LIMIT_OK = 0,
    CG_LIMIT_TOKENS_DAY = 1,
    CG_LIMIT_TOKENS_MINUTE = 2,
    CG_LIMIT_MESSAGES = 3,
    CG_LIMIT_TURNS = 4,
} cg_limit_hit;

typedef struct cg_limit_verdict {
    cg_limit_hit hit;
    long retry_after_ms; /* when the limit met lets the next message through (a hint for turns) */
    int local;           /* counted in this process's memory (memory store, or Redis away):
                          * the turn's end goes there too */
} cg_limit_verdict;

/* A turn refused by turns_at_once: its retry hint; nobody knows when a turn ends. */
#define CG_LIMIT_TURN_RETRY_MS 1000

/* The config key of the limit met ("messages_per_minute", ...); "" for CG_LIMIT_OK. */
const char *cg_limit_name(cg_limit_hit hit);
/* The windows a moment falls in (now: unix milliseconds). */
typedef struct cg_limit_clock {
    int64_t minute, day;          /* since the epoch */
    long to_minute_ms, to_day_ms; /* until the next of each */
} cg_limit_clock;
void cg_limit_clock_at(int64_t now_ms, cg_limit_clock *c);

/*
 * The counts of one process, by user: bounded to max_users entries, the least recently
 * used going first (its counts forgotten: the user gets a fresh window, never a refusal
 * that is not due). The key is any string naming the user (the stores use the escaped id).
 */
typedef struct cg_limiter cg_limiter;
cg_limiter *cg_limiter_new(long max_users);
void cg_limiter_free(cg_limiter *l);
/* Takes one message of user's against lim: the verdict; counted (its message, its turn)
 * only when let through. */
void cg_limiter_take(cg_limiter *l, const char *user, const cg_limits *lim, int64_t now_ms, cg_limit_verdict *v);
/* A turn that take() let through ended having spent tokens (0: none counted). */
void cg_limiter_end(cg_limiter *l, const char *user, const cg_limits *lim, long long tokens, int64_t now_ms);
/* The user is forgotten (DELETE /admin/users): their counts go; an entry whose turns still
 * run keeps only those (their ends come). */
void cg_limiter_forget(cg_limiter *l, const char *user);
long cg_limiter_count(const cg_limiter *l);

#endif
