/*
 * test_limits.c: the limits' windows and the in-memory counter of limits.h, driven by a
 * clock the test passes in: the minute and the UTC day a moment falls in, each limit
 * letting exactly its number through and refusing the next with the limit's name and the
 * wait until its window ends, refusals that count nothing, the order the limits are
 * checked in (the longest wait first), users counted apart, and the bound on users (the
 * least recently used forgotten, its counts starting again).
 */
#include "chatgate/store/limits.h"
#include "unit.h"

/* 2023-11-14T00:00:00Z: the start of a UTC day (19675), so of a minute (28332000) too. */
#define DAY0 1699920000000LL
#define MIN_MS 60000LL
#define DAY_MS 86400000LL

static cg_limits limits(long messages, long turns, long long tok_minute, long long tok_day)
{
    cg_limits l = {messages, turns, tok_minute, tok_day};
    return l;
}

/* One take: its verdict's hit; the retry hint into *retry (if given). Every verdict of the
 * in-memory counter is local. */
static cg_limit_hit take(cg_limiter *l, const char *user, const cg_limits *lim, int64_t now, long *retry)
{
    cg_limit_verdict v = {.hit = 99, .retry_after_ms = -1, .local = 0};
    cg_limiter_take(l, user, lim, now, &v);
    CHECK(v.local == 1);
    if (v.hit == CG_LIMIT_OK)
        CHECK(v.retry_after_ms == 0);
    if (retry)
        *retry = v.retry_after_ms;
    return v.hit;
}

/* How many takes are let through at one instant before one is refused (at most 1000). */
static int drain(cg_limiter *l, const char *user, const cg_limits *lim, int64_t now)
{
    int n = 0;
    while (n < 1000 && take(l, user, lim, now, NULL) == CG_LIMIT_OK)
        n++;
    return n;
}

static void test_clock(void)
{
    cg_limit_clock c;
    cg_limit_clock_at(DAY0, &c); /* on a day's (and a minute's) first millisecond */
    CHECK(c.minute == 28332000);
    CHECK(c.day == 19675);
    CHECK(c.to_minute_ms == 60000);
    CHECK(c.to_day_ms == 86400000);

    cg_limit_clock_at(DAY0 - 1, &c); /* the last millisecond of the day before */
    CHECK(c.minute == 28331999);
    CHECK(c.day == 19674);
    CHECK(c.to_minute_ms == 1);
    CHECK(c.to_day_ms == 1);

    cg_limit_clock_at(DAY0 + 12345, &c); /* mid-minute */
    CHECK(c.minute == 28332000);
    CHECK(c.day == 19675);
    CHECK(c.to_minute_ms == 47655);
    CHECK(c.to_day_ms == 86387655);

    cg_limit_clock_at(DAY0 + 3 * MIN_MS + 59999, &c); /* a minute's last millisecond */
    CHECK(c.minute == 28332003);
    CHECK(c.to_minute_ms == 1);
    CHECK(c.to_day_ms == DAY_MS - 3 * MIN_MS - 59999);

    cg_limit_clock_at(0, &c);
    CHECK(c.minute == 0 && c.day == 0);
    CHECK(c.to_minute_ms == 60000 && c.to_day_ms == 86400000);
}

static void test_names(void)
{
    CHECK_STR(cg_limit_name(CG_LIMIT_OK), "");
    CHECK_STR(cg_limit_name(CG_LIMIT_TOKENS_DAY), "tokens_per_day");
    CHECK_STR(cg_limit_name(CG_LIMIT_TOKENS_MINUTE), "tokens_per_minute");
    CHECK_STR(cg_limit_name(CG_LIMIT_MESSAGES), "messages_per_minute");
    CHECK_STR(cg_limit_name(CG_LIMIT_TURNS), "turns_at_once");
    CHECK_STR(cg_limit_name((cg_limit_hit)99), "");
    /* the numbers are the Redis script's answers */
    CHECK(CG_LIMIT_OK == 0 && CG_LIMIT_TOKENS_DAY == 1 && CG_LIMIT_TOKENS_MINUTE == 2 && CG_LIMIT_MESSAGES == 3 &&
          CG_LIMIT_TURNS == 4);

    cg_limits none = limits(0, 0, 0, 0), m = limits(1, 0, 0, 0), t = limits(0, 1, 0, 0), tm = limits(0, 0, 1, 0),
              td = limits(0, 0, 0, 1);
    CHECK(!cg_limits_any(&none));
    CHECK(cg_limits_any(&m) && cg_limits_any(&t) && cg_limits_any(&tm) && cg_limits_any(&td));
}

static void test_messages(void)
{
    cg_limiter *l = cg_limiter_new(10);
    cg_limits lim = limits(3, 0, 0, 0);
    long retry = -1;
    CHECK(drain(l, "u", &lim, DAY0 + 10000) == 3); /* exactly 3 in the minute */
    CHECK(take(l, "u", &lim, DAY0 + 20000, &retry) == CG_LIMIT_MESSAGES);
    CHECK(retry == 40000); /* until the next minute */
    CHECK(take(l, "u", &lim, DAY0 + MIN_MS - 1, &retry) == CG_LIMIT_MESSAGES);
    CHECK(retry == 1);
    /* the next minute lets 3 through again, and only 3 */
    CHECK(drain(l, "u", &lim, DAY0 + MIN_MS) == 3);
    CHECK(take(l, "u", &lim, DAY0 + MIN_MS + 500, &retry) == CG_LIMIT_MESSAGES);
    CHECK(retry == 59500);
    /* a minute skipped counts nothing either */
    CHECK(drain(l, "u", &lim, DAY0 + 5 * MIN_MS + 1) == 3);
    CHECK(cg_limiter_count(l) == 1);

    /* no limit set: no refusal */
    cg_limits none = limits(0, 0, 0, 0);
    CHECK(drain(l, "free", &none, DAY0) == 1000);
    cg_limiter_free(l);
}

/* A refused message is not counted: neither as a message nor as a turn. */
static void test_refused_not_counted(void)
{
    cg_limiter *l = cg_limiter_new(10);
    long retry = -1;
    /* refusals by turns_at_once leave the minute's messages as they were */
    cg_limits lim = limits(3, 1, 0, 0);
    CHECK(take(l, "u", &lim, DAY0 + 1000, NULL) == CG_LIMIT_OK);
    for (int i = 0; i < 5; i++)
        CHECK(take(l, "u", &lim, DAY0 + 2000, &retry) == CG_LIMIT_TURNS);
    CHECK(retry == CG_LIMIT_TURN_RETRY_MS);
    cg_limiter_end(l, "u", &lim, 0, DAY0 + 3000);
    CHECK(take(l, "u", &lim, DAY0 + 4000, NULL) == CG_LIMIT_OK); /* message 2 */
    cg_limiter_end(l, "u", &lim, 0, DAY0 + 5000);
    CHECK(take(l, "u", &lim, DAY0 + 6000, NULL) == CG_LIMIT_OK); /* message 3 */
    cg_limiter_end(l, "u", &lim, 0, DAY0 + 7000);
    CHECK(take(l, "u", &lim, DAY0 + 8000, &retry) == CG_LIMIT_MESSAGES);
    CHECK(retry == 52000);

    /* a refusal by messages_per_minute takes no turn */
    cg_limits one = limits(1, 1, 0, 0);
    CHECK(take(l, "v", &one, DAY0, NULL) == CG_LIMIT_OK);
    cg_limiter_end(l, "v", &one, 0, DAY0 + 100);
    for (int i = 0; i < 3; i++)
        CHECK(take(l, "v", &one, DAY0 + 200, NULL) == CG_LIMIT_MESSAGES);
    CHECK(take(l, "v", &one, DAY0 + MIN_MS, NULL) == CG_LIMIT_OK); /* not TURNS: no turn was taken */
    CHECK(take(l, "v", &one, DAY0 + MIN_MS + 1, NULL) == CG_LIMIT_MESSAGES);
    cg_limiter_end(l, "v", &one, 0, DAY0 + MIN_MS + 2);

    /* a refusal by tokens takes no message */
    cg_limits tok = limits(2, 0, 10, 0);
    CHECK(take(l, "w", &tok, DAY0, NULL) == CG_LIMIT_OK);
    cg_limiter_end(l, "w", &tok, 10, DAY0 + 1);
    for (int i = 0; i < 3; i++)
        CHECK(take(l, "w", &tok, DAY0 + 2, NULL) == CG_LIMIT_TOKENS_MINUTE);
    cg_limits msg_only = limits(2, 0, 0, 0); /* the same minute, the tokens limit lifted */
    CHECK(drain(l, "w", &msg_only, DAY0 + 3) == 1);
    cg_limiter_free(l);
}

static void test_turns(void)
{
    cg_limiter *l = cg_limiter_new(10);
    cg_limits lim = limits(0, 2, 0, 0);
    long retry = -1;
    CHECK(take(l, "u", &lim, DAY0, NULL) == CG_LIMIT_OK);
    CHECK(take(l, "u", &lim, DAY0 + 1, NULL) == CG_LIMIT_OK);
    CHECK(take(l, "u", &lim, DAY0 + 2, &retry) == CG_LIMIT_TURNS);
    CHECK(retry == CG_LIMIT_TURN_RETRY_MS);
    /* turns do not end with the minute */
    CHECK(take(l, "u", &lim, DAY0 + 3 * MIN_MS, &retry) == CG_LIMIT_TURNS);
    CHECK(retry == 1000);
    cg_limiter_end(l, "u", &lim, 0, DAY0 + 3 * MIN_MS + 1);
    CHECK(take(l, "u", &lim, DAY0 + 3 * MIN_MS + 2, NULL) == CG_LIMIT_OK); /* one more */
    CHECK(take(l, "u", &lim, DAY0 + 3 * MIN_MS + 3, NULL) == CG_LIMIT_TURNS);
    /* both end: two more, then the third is refused */
    cg_limiter_end(l, "u", &lim, 0, DAY0 + 3 * MIN_MS + 4);
    cg_limiter_end(l, "u", &lim, 0, DAY0 + 3 * MIN_MS + 5);
    CHECK(drain(l, "u", &lim, DAY0 + 3 * MIN_MS + 6) == 2);
    /* more ends than turns do not make room for more than the limit */
    for (int i = 0; i < 5; i++)
        cg_limiter_end(l, "u", &lim, 0, DAY0 + 3 * MIN_MS + 7);
    CHECK(drain(l, "u", &lim, DAY0 + 3 * MIN_MS + 8) == 2);
    cg_limiter_free(l);
}

static void test_tokens_minute(void)
{
    cg_limiter *l = cg_limiter_new(10);
    cg_limits lim = limits(0, 0, 100, 0);
    long retry = -1;
    CHECK(take(l, "u", &lim, DAY0 + 1000, NULL) == CG_LIMIT_OK);
    cg_limiter_end(l, "u", &lim, 60, DAY0 + 2000);
    CHECK(take(l, "u", &lim, DAY0 + 2500, NULL) == CG_LIMIT_OK); /* 60 of 100 */
    cg_limiter_end(l, "u", &lim, 39, DAY0 + 2600);
    CHECK(take(l, "u", &lim, DAY0 + 2700, NULL) == CG_LIMIT_OK); /* 99 of 100 */
    cg_limiter_end(l, "u", &lim, 1, DAY0 + 2800);                /* 100: the limit */
    CHECK(take(l, "u", &lim, DAY0 + 3000, &retry) == CG_LIMIT_TOKENS_MINUTE);
    CHECK(retry == 57000);
    CHECK(take(l, "u", &lim, DAY0 + MIN_MS - 1, &retry) == CG_LIMIT_TOKENS_MINUTE);
    CHECK(retry == 1);
    /* the next minute: let through again */
    CHECK(take(l, "u", &lim, DAY0 + MIN_MS, NULL) == CG_LIMIT_OK);
    /* a turn may go over the limit: its tokens are known only at its end */
    cg_limiter_end(l, "u", &lim, 500, DAY0 + MIN_MS + 10);
    CHECK(take(l, "u", &lim, DAY0 + MIN_MS + 20, &retry) == CG_LIMIT_TOKENS_MINUTE);
    CHECK(retry == MIN_MS - 20);
    CHECK(take(l, "u", &lim, DAY0 + 2 * MIN_MS, NULL) == CG_LIMIT_OK);

    /* a turn ending in the next minute counts its tokens there */
    cg_limiter_end(l, "u", &lim, 100, DAY0 + 3 * MIN_MS + 5);
    CHECK(take(l, "u", &lim, DAY0 + 3 * MIN_MS + 6, NULL) == CG_LIMIT_TOKENS_MINUTE);
    cg_limiter_free(l);
}

static void test_tokens_day(void)
{
    cg_limiter *l = cg_limiter_new(10);
    long retry = -1;
    cg_limits lim = limits(0, 0, 100, 150);
    int64_t t = DAY0 + 10 * 3600 * 1000LL; /* 10:00 UTC */
    CHECK(take(l, "u", &lim, t, NULL) == CG_LIMIT_OK);
    cg_limiter_end(l, "u", &lim, 100, t + 1);
    CHECK(take(l, "u", &lim, t + 2, &retry) == CG_LIMIT_TOKENS_MINUTE); /* 100 of 150 today */
    CHECK(retry == MIN_MS - 2);
    CHECK(take(l, "u", &lim, t + MIN_MS, NULL) == CG_LIMIT_OK);
    cg_limiter_end(l, "u", &lim, 50, t + MIN_MS + 1); /* 150 today, 50 this minute */
    CHECK(take(l, "u", &lim, t + MIN_MS + 2, &retry) == CG_LIMIT_TOKENS_DAY);
    CHECK(retry == DAY_MS - 10 * 3600 * 1000LL - MIN_MS - 2); /* until the next UTC day */
    CHECK(take(l, "u", &lim, DAY0 + DAY_MS - 1, &retry) == CG_LIMIT_TOKENS_DAY);
    CHECK(retry == 1);
    CHECK(take(l, "u", &lim, DAY0 + DAY_MS, NULL) == CG_LIMIT_OK); /* the next day */
    cg_limiter_free(l);

    /* the day limit is checked before the minute ones: every limit met, the day's wins */
    l = cg_limiter_new(10);
    cg_limits all = limits(1, 1, 100, 100);
    CHECK(take(l, "u", &all, t, NULL) == CG_LIMIT_OK);           /* its message, its turn */
    CHECK(take(l, "u", &all, t + 1, NULL) == CG_LIMIT_MESSAGES); /* messages before turns */
    cg_limiter_end(l, "u", &all, 100, t + 2);                     /* tokens minute and day met */
    CHECK(take(l, "u", &all, t + 3, &retry) == CG_LIMIT_TOKENS_DAY);
    CHECK(retry == DAY_MS - 10 * 3600 * 1000LL - 3);
    CHECK(take(l, "u", &all, t + MIN_MS, &retry) == CG_LIMIT_TOKENS_DAY); /* the next minute too */
    CHECK(retry == DAY_MS - 10 * 3600 * 1000LL - MIN_MS);
    CHECK(take(l, "u", &all, DAY0 + DAY_MS, NULL) == CG_LIMIT_OK);
    cg_limiter_free(l);

    /* the minute's tokens before the messages */
    l = cg_limiter_new(10);
    cg_limits mt = limits(1, 0, 100, 1000);
    CHECK(take(l, "u", &mt, t, NULL) == CG_LIMIT_OK);
    cg_limiter_end(l, "u", &mt, 100, t + 1);
    CHECK(take(l, "u", &mt, t + 2, &retry) == CG_LIMIT_TOKENS_MINUTE);
    CHECK(retry == MIN_MS - 2);
    cg_limiter_free(l);
}

static void test_users_apart(void)
{
    cg_limiter *l = cg_limiter_new(10);
    cg_limits lim = limits(3, 1, 10, 0);
    CHECK(take(l, "alice", &lim, DAY0, NULL) == CG_LIMIT_OK);
    CHECK(take(l, "alice", &lim, DAY0 + 1, NULL) == CG_LIMIT_TURNS);
    CHECK(take(l, "bob", &lim, DAY0 + 2, NULL) == CG_LIMIT_OK); /* alice's turn is hers */
    cg_limiter_end(l, "alice", &lim, 10, DAY0 + 3);
    CHECK(take(l, "alice", &lim, DAY0 + 4, NULL) == CG_LIMIT_TOKENS_MINUTE);
    cg_limiter_end(l, "bob", &lim, 0, DAY0 + 5);
    CHECK(take(l, "bob", &lim, DAY0 + 6, NULL) == CG_LIMIT_OK); /* alice's tokens are not his */
    CHECK(take(l, "bob", &lim, DAY0 + 7, NULL) == CG_LIMIT_TURNS);
    cg_limiter_end(l, "bob", &lim, 0, DAY0 + 8);
    CHECK(take(l, "bob", &lim, DAY0 + 9, NULL) == CG_LIMIT_OK); /* his third message */
    cg_limiter_end(l, "bob", &lim, 0, DAY0 + 10);
    CHECK(take(l, "bob", &lim, DAY0 + 11, NULL) == CG_LIMIT_MESSAGES); /* his own 3 messages */
    CHECK(take(l, "alice2", &lim, DAY0 + 12, NULL) == CG_LIMIT_OK); /* a key is the whole string */
    CHECK(take(l, "alic", &lim, DAY0 + 13, NULL) == CG_LIMIT_OK);
    CHECK(cg_limiter_count(l) == 4);
    cg_limiter_free(l);
}

static void test_bound(void)
{
    cg_limiter *l = cg_limiter_new(2);
    cg_limits lim = limits(1, 0, 0, 0);
    CHECK(cg_limiter_count(l) == 0);
    CHECK(take(l, "a", &lim, DAY0, NULL) == CG_LIMIT_OK);
    CHECK(take(l, "b", &lim, DAY0 + 1, NULL) == CG_LIMIT_OK);
    CHECK(cg_limiter_count(l) == 2);
    CHECK(take(l, "c", &lim, DAY0 + 2, NULL) == CG_LIMIT_OK); /* over the bound: a goes */
    CHECK(cg_limiter_count(l) == 2);
    CHECK(take(l, "b", &lim, DAY0 + 3, NULL) == CG_LIMIT_MESSAGES); /* kept (and used now) */
    CHECK(take(l, "a", &lim, DAY0 + 4, NULL) == CG_LIMIT_OK);       /* forgotten: counts start again; c goes */
    CHECK(cg_limiter_count(l) == 2);
    CHECK(take(l, "b", &lim, DAY0 + 5, NULL) == CG_LIMIT_MESSAGES);
    CHECK(take(l, "a", &lim, DAY0 + 6, NULL) == CG_LIMIT_MESSAGES);
    CHECK(take(l, "c", &lim, DAY0 + 7, NULL) == CG_LIMIT_OK); /* c was the least recently used */
    CHECK(cg_limiter_count(l) == 2);

    /* an end with tokens is a use too: it keeps its user and pushes out the other */
    cg_limits tok = limits(0, 0, 10, 0);
    cg_limiter_end(l, "x", &tok, 10, DAY0 + 8); /* a new user: a, the least recently used, goes */
    CHECK(cg_limiter_count(l) == 2);
    CHECK(take(l, "x", &tok, DAY0 + 9, NULL) == CG_LIMIT_TOKENS_MINUTE);
    CHECK(take(l, "c", &lim, DAY0 + 10, NULL) == CG_LIMIT_MESSAGES); /* kept */
    CHECK(take(l, "a", &lim, DAY0 + 11, NULL) == CG_LIMIT_OK);       /* forgotten; x goes */
    CHECK(take(l, "c", &lim, DAY0 + 12, NULL) == CG_LIMIT_MESSAGES);
    CHECK(take(l, "x", &tok, DAY0 + 13, NULL) == CG_LIMIT_OK); /* its tokens went with it */
    CHECK(cg_limiter_count(l) == 2);
    cg_limiter_free(l);

    /* an end of a user not known (or forgotten) with no tokens creates nothing */
    l = cg_limiter_new(2);
    cg_limiter_end(l, "nobody", &lim, 0, DAY0);
    CHECK(cg_limiter_count(l) == 0);
    cg_limits turns = limits(0, 1, 0, 0);
    cg_limiter_end(l, "nobody", &turns, 0, DAY0);
    CHECK(cg_limiter_count(l) == 0);
    CHECK(take(l, "nobody", &turns, DAY0 + 1, NULL) == CG_LIMIT_OK);
    CHECK(cg_limiter_count(l) == 1);
    cg_limiter_free(l);

    /* a bound below 1 is 1 */
    l = cg_limiter_new(0);
    CHECK(take(l, "a", &lim, DAY0, NULL) == CG_LIMIT_OK);
    CHECK(take(l, "b", &lim, DAY0, NULL) == CG_LIMIT_OK);
    CHECK(cg_limiter_count(l) == 1);
    CHECK(take(l, "b", &lim, DAY0, NULL) == CG_LIMIT_MESSAGES);
    CHECK(take(l, "a", &lim, DAY0, NULL) == CG_LIMIT_OK);
    cg_limiter_free(l);
    cg_limiter_free(NULL);
}

/* Forgetting a user (DELETE /admin/users) drops their counts at once (issue 35): an entry
 * with no turn running goes; one with turns running keeps those, its counts zeroed. */
static void test_forget(void)
{
    cg_limiter *l = cg_limiter_new(10);
    cg_limits msgs = limits(3, 0, 0, 1000);
    CHECK(drain(l, "u", &msgs, DAY0 + 1000) == 3);
    cg_limiter_end(l, "u", &msgs, 1000, DAY0 + 1001); /* a day's tokens spent too */
    CHECK(take(l, "u", &msgs, DAY0 + 1002, NULL) != CG_LIMIT_OK);
    cg_limiter_forget(l, "u");
    CHECK(cg_limiter_count(l) == 0);
    CHECK(drain(l, "u", &msgs, DAY0 + 1003) == 3); /* a fresh minute and day */
    cg_limiter_forget(l, "nobody"); /* not counted: nothing happens */

    cg_limits turns = limits(0, 1, 0, 0);
    CHECK(take(l, "t", &turns, DAY0, NULL) == CG_LIMIT_OK); /* its turn runs */
    cg_limiter_forget(l, "t");
    CHECK(take(l, "t", &turns, DAY0 + 1, NULL) == CG_LIMIT_TURNS); /* the turn still runs */
    cg_limiter_end(l, "t", &turns, 0, DAY0 + 2);
    CHECK(take(l, "t", &turns, DAY0 + 3, NULL) == CG_LIMIT_OK);
    cg_limiter_free(l);
}

int main(void)
{
    test_forget();
    test_clock();
    test_names();
    test_messages();
    test_refused_not_counted();
    test_turns();
    test_tokens_minute();
    test_tokens_day();
    test_users_apart();
    test_bound();
    return unit_done("test_limits");
}
