/*
 * test_clock.c: the store's default clock in milliseconds never steps back, across a
 * second's turn too. A room's place in the rooms set (least recently used first) is that
 * clock; built from time()'s second and clock_gettime()'s milliseconds, it stepped back by
 * most of a second whenever time(), updated at the kernel's tick, lagged at a second's turn,
 * and a bound could then forget the wrong room.
 */
#include <time.h>

#include "chatgate/store/store.h"
#include "unit.h"

/* Reads the clock until a second's turn has passed (at most about 1 s, read after read, as
 * time() lags there by up to a tick): every reading at or after the one before, and never
 * more than a second from time(). */
static void test_ms_clock_ordered(void)
{
    int64_t first = cg_store_default_now_ms(), last = first;
    int turns = 0, back = 0, apart = 0;
    while (turns < 1 && last - first < 1500) {
        int64_t ms = cg_store_default_now_ms();
        int64_t s = cg_store_default_now(NULL);
        if (ms < last)
            back++;
        if (s * 1000 > ms + 1000 || ms - s * 1000 >= 2000)
            apart++;
        if (ms / 1000 != last / 1000)
            turns++;
        last = ms;
    }
    CHECK(turns == 1);
    CHECK(back == 0);
    CHECK(apart == 0);
}

int main(void)
{
    test_ms_clock_ordered();
    return unit_done("test_clock");
}
