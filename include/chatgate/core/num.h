/*
 * num.h: numbers that come from outside (an upstream's header or usage, a Redis answer, a
 * request's header) read and added without overflow: every count saturates at its bound
 * instead of wrapping, so a peer's 99999999999999999999 is "a lot", never negative.
 */
#ifndef CHATGATE_CORE_NUM_H
#define CHATGATE_CORE_NUM_H

#include <stddef.h>

/* a + b, both counts (negative ones taken as 0), saturating at LLONG_MAX. */
long long cg_sat_add(long long a, long long b);

/* The decimal number at s (after spaces and tabs), saturating at max (>= 0): digits of any
 * length. -1 when s starts with no digit. What follows the digits is not read. */
long long cg_parse_decimal_sat(const char *s, long long max);

/* v clamped to [lo, hi]. */
long long cg_clamp(long long v, long long lo, long long hi);

#endif
