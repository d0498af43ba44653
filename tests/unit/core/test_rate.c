/*
 * test_rate.c: the token bucket of a client connection (rate.h), driven by a clock the test
 * passes in: a full bucket gives `burst` messages at once, it refills at `per_second` from
 * the passed clock, part-tokens add up, a clock that goes backwards gives nothing, and the
 * bucket never holds more than `burst` (also when burst is lowered by a reload).
 */
#include "chatgate/core/rate.h"
#include "unit.h"

/* How many messages the bucket lets through at one instant before refusing one. */
static int drain(cg_rate *r, long per_second, long burst, uint64_t now)
{
    int n = 0;
    while (n < 1000 && cg_rate_take(r, per_second, burst, now))
        n++;
    return n;
}

static void test_burst(void)
{
    cg_rate r;
    cg_rate_init(&r, 5, 1000);
    CHECK(drain(&r, 1, 5, 1000) == 5);  /* a new connection may send `burst` at once */
    CHECK(!cg_rate_take(&r, 1, 5, 1000)); /* and the next one, at the same instant, is refused */
    CHECK(!cg_rate_take(&r, 1, 5, 1000)); /* a refusal costs nothing and gives nothing */

    cg_rate one;
    cg_rate_init(&one, 1, 0);
    CHECK(cg_rate_take(&one, 1000, 1, 0));
    CHECK(!cg_rate_take(&one, 1000, 1, 0));
}

static void test_refill(void)
{
    cg_rate r;
    cg_rate_init(&r, 3, 10000);
    CHECK(drain(&r, 10, 3, 10000) == 3);
    /* 10 per second: one token per 100 ms of the passed clock, not before. */
    CHECK(!cg_rate_take(&r, 10, 3, 10099));
    CHECK(cg_rate_take(&r, 10, 3, 10100));
    CHECK(!cg_rate_take(&r, 10, 3, 10100));
    /* 250 ms later: two tokens and a half; two messages go through. */
    CHECK(drain(&r, 10, 3, 10350) == 2);
    /* the half token is kept: 50 ms more make a whole one */
    CHECK(!cg_rate_take(&r, 10, 3, 10399));
    CHECK(cg_rate_take(&r, 10, 3, 10400));

    /* Part-tokens add up across refused calls: at 3 per second, 333 ms give 0.999 of a
     * token (refused), one more millisecond makes it whole. */
    cg_rate s;
    cg_rate_init(&s, 1, 0);
    CHECK(cg_rate_take(&s, 3, 1, 0));
    CHECK(!cg_rate_take(&s, 3, 1, 333));
    CHECK(cg_rate_take(&s, 3, 1, 334));
    CHECK(!cg_rate_take(&s, 3, 1, 334));

    /* A steady sender at exactly the rate is never refused, whatever the burst. */
    cg_rate t;
    cg_rate_init(&t, 1, 0);
    int refused = 0;
    for (uint64_t now = 0; now <= 10000; now += 50) /* 20 per second */
        refused += !cg_rate_take(&t, 20, 1, now);
    CHECK(refused == 0);
    /* and one sending twice as fast gets half through */
    cg_rate u;
    cg_rate_init(&u, 1, 0);
    int through = 0;
    for (uint64_t now = 0; now < 10000; now += 25)
        through += cg_rate_take(&u, 20, 1, now);
    CHECK(through == 200);
}

static void test_clock_backwards(void)
{
    cg_rate r;
    cg_rate_init(&r, 2, 5000);
    CHECK(drain(&r, 10, 2, 5000) == 2);
    /* The clock steps back a second: no tokens (an unsigned difference that wrapped would
     * fill the bucket), and no message through. */
    CHECK(!cg_rate_take(&r, 10, 2, 4000));
    CHECK(!cg_rate_take(&r, 10, 2, 0));
    /* From there it refills from the clock it last saw, at the rate: 100 ms, one token. */
    CHECK(!cg_rate_take(&r, 10, 2, 99));
    CHECK(cg_rate_take(&r, 10, 2, 100));
    CHECK(!cg_rate_take(&r, 10, 2, 100));
    /* A full bucket stays full when the clock goes back, and takes as usual. */
    cg_rate f;
    cg_rate_init(&f, 3, 1000000);
    CHECK(drain(&f, 1, 3, 10) == 3);
}

static void test_cap(void)
{
    cg_rate r;
    cg_rate_init(&r, 4, 0);
    CHECK(cg_rate_take(&r, 100, 4, 0));
    /* An hour idle at 100 per second is worth 360,000 tokens; the bucket holds 4. */
    CHECK(drain(&r, 100, 4, 3600000) == 4);
    CHECK(!cg_rate_take(&r, 100, 4, 3600000));
    /* Idle, then exactly enough time for more than burst: still burst. */
    CHECK(drain(&r, 100, 4, 3600000 + 1000) == 4);

    /* burst is passed on every call (a reload may lower it): a bucket filled under the old
     * burst of 10 gives at most the new burst of 2. */
    cg_rate s;
    cg_rate_init(&s, 10, 0);
    CHECK(drain(&s, 1, 2, 0) == 2);
    /* and a raised burst does not fill the bucket by itself: it fills at the rate */
    cg_rate t;
    cg_rate_init(&t, 1, 0);
    CHECK(drain(&t, 1, 50, 0) == 1);
    CHECK(drain(&t, 1, 50, 3000) == 3);
}

int main(void)
{
    test_burst();
    test_refill();
    test_clock_backwards();
    test_cap();
    return unit_done("test_rate");
}
