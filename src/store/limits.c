/*
 * limits.c: the limits' windows and the in-memory counter of limits.h.
 *
 * The counter is a binary tree of entries by user (POSIX tsearch) and a list of the same
 * entries in order of use, least recent first, as the memory store keeps dialogs. Each
 * entry holds the window its counts belong to, so a count from an older window reads as
 * zero without any timer: nothing runs between messages.
 */
#include <search.h>
#include <stdlib.h>
#include <string.h>
#include <sys/queue.h>

#include "chatgate/core/alloc.h"
#include "chatgate/core/num.h"
#include "chatgate/store/limits.h"

const char *cg_limit_name(cg_limit_hit hit)
{
    switch (hit) {
    case CG_LIMIT_TOKENS_DAY:
        return "tokens_per_day";
    case CG_LIMIT_TOKENS_MINUTE:
        return "tokens_per_minute";
    case CG_LIMIT_MESSAGES:
        return "messages_per_minute";
    case CG_LIMIT_TURNS:
        return "turns_at_once";
    default:
        return "";
    }
}

void cg_limit_clock_at(int64_t now_ms, cg_limit_clock *c)
{
    c->minute = now_ms / 60000;
    c->day = now_ms / 86400000;
    c->to_minute_ms = (long)((c->minute + 1) * 60000 - now_ms);
    c->to_day_ms = (long)((c->day + 1) * 86400000 - now_ms);
}

typedef struct lim_entry {
    TAILQ_ENTRY(lim_entry) order; /* least recently used first */
    int64_t msg_minute, tok_minute, tok_day; /* the windows of the counts below */
    long messages;
    long long tokens_minute, tokens_day;
    long busy;       /* turns let through and not ended */
    const char *key; /* stored right after the entry */
} lim_entry;

struct cg_limiter {
    void *tree;
    TAILQ_HEAD(, lim_entry) order;
    long count, max_users;
};

static int by_key(const void *a, const void *b)
{
    return strcmp(((const lim_entry *)a)->key, ((const lim_entry *)b)->key);
}

cg_limiter *cg_limiter_new(long max_users)
{
    cg_limiter *l = cg_calloc(1, sizeof(*l));
    TAILQ_INIT(&l->order);
    l->max_users = max_users > 0 ? max_users : 1;
    return l;
}

static void entry_drop(cg_limiter *l, lim_entry *e)
{
    tdelete(e, &l->tree, by_key);
    TAILQ_REMOVE(&l->order, e, order);
    l->count--;
    free(e);
}

void cg_limiter_free(cg_limiter *l)
{
    if (!l)
        return;
    while (!TAILQ_EMPTY(&l->order))
        entry_drop(l, TAILQ_FIRST(&l->order));
    free(l);
}

long cg_limiter_count(const cg_limiter *l)
{
    return l->count;
}

/* Counts of an older window read as zero. */
static void roll(lim_entry *e, const cg_limit_clock *c)
{
    if (e->msg_minute != c->minute) {
        e->msg_minute = c->minute;
        e->messages = 0;
    }
    if (e->tok_minute != c->minute) {
        e->tok_minute = c->minute;
        e->tokens_minute = 0;
    }
    if (e->tok_day != c->day) {
        e->tok_day = c->day;
        e->tokens_day = 0;
    }
}

/* The user's entry, the most recently used now; NULL when there is none and !create. */
static lim_entry *entry_get(cg_limiter *l, const char *user, int create)
{
    lim_entry probe = {.key = user};
    lim_entry **found = tfind(&probe, &l->tree, by_key);
    lim_entry *e = found ? *found : NULL;
    if (!e && !create)
        return NULL;
    if (e) {
        TAILQ_REMOVE(&l->order, e, order);
    } else {
        size_t n = strlen(user) + 1;
        e = cg_calloc(1, sizeof(*e) + n);
        memcpy((char *)(e + 1), user, n);
        e->key = (const char *)(e + 1);
        if (!tsearch(e, &l->tree, by_key))
            abort();
        l->count++;
        while (l->count > l->max_users)
            entry_drop(l, TAILQ_FIRST(&l->order));
    }
    TAILQ_INSERT_TAIL(&l->order, e, order);
    return e;
}

void cg_limiter_forget(cg_limiter *l, const char *user)
{
    lim_entry *e = entry_get(l, user, 0);
    if (!e)
        return;
    if (e->busy == 0) {
        entry_drop(l, e);
        return;
    }
    e->messages = 0;
    e->tokens_minute = e->tokens_day = 0;
}

void cg_limiter_take(cg_limiter *l, const char *user, const cg_limits *lim, int64_t now_ms, cg_limit_verdict *v)
{
    cg_limit_clock c;
    cg_limit_clock_at(now_ms, &c);
    lim_entry *e = entry_get(l, user, 1);
    roll(e, &c);
    v->local = 1;
    v->retry_after_ms = 0;
    /* the order of the Redis script: the longest wait first */
    if (lim->tokens_per_day > 0 && e->tokens_day >= lim->tokens_per_day) {
        v->hit = CG_LIMIT_TOKENS_DAY;
        v->retry_after_ms = c.to_day_ms;
    } else if (lim->tokens_per_minute > 0 && e->tokens_minute >= lim->tokens_per_minute) {
        v->hit = CG_LIMIT_TOKENS_MINUTE;
        v->retry_after_ms = c.to_minute_ms;
    } else if (lim->messages_per_minute > 0 && e->messages >= lim->messages_per_minute) {
        v->hit = CG_LIMIT_MESSAGES;
        v->retry_after_ms = c.to_minute_ms;
    } else if (lim->turns_at_once > 0 && e->busy >= lim->turns_at_once) {
        v->hit = CG_LIMIT_TURNS;
        v->retry_after_ms = CG_LIMIT_TURN_RETRY_MS;
    } else {
        v->hit = CG_LIMIT_OK;
        e->messages++;
        if (lim->turns_at_once > 0)
            e->busy++;
    }
}

void cg_limiter_end(cg_limiter *l, const char *user, const cg_limits *lim, long long tokens, int64_t now_ms)
{
    lim_entry *e = entry_get(l, user, tokens > 0);
    if (!e)
        return; /* forgotten (the bound): its counts went with it */
    cg_limit_clock c;
    cg_limit_clock_at(now_ms, &c);
    roll(e, &c);
    if (lim->turns_at_once > 0 && e->busy > 0)
        e->busy--;
    if (tokens > 0) {
        e->tokens_minute = cg_sat_add(e->tokens_minute, tokens);
        e->tokens_day = cg_sat_add(e->tokens_day, tokens);
    }
}
