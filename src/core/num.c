/*
 * num.c: saturating reads and sums of numbers from peers (see num.h).
 */
#include <limits.h>

#include "chatgate/core/num.h"

long long cg_sat_add(long long a, long long b)
{
    if (a < 0)
        a = 0;
    if (b < 0)
        b = 0;
    return a > LLONG_MAX - b ? LLONG_MAX : a + b;
}

long long cg_parse_decimal_sat(const char *s, long long max)
{
    while (*s == ' ' || *s == '\t')
        s++;
    if (*s < '0' || *s > '9')
        return -1;
    long long v = 0;
    for (; *s >= '0' && *s <= '9'; s++) {
        int digit = *s - '0';
        v = v > (max - digit) / 10 ? max : v * 10 + digit;
    }
    return v;
}

long long cg_clamp(long long v, long long lo, long long hi)
{
    return v < lo ? lo : v > hi ? hi : v;
}
