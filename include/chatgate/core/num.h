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

/* JSON text s (len bytes) with every integer outside strings that a long long cannot hold
 * written as the bound it passed (9223372036854775807, or its negative - 1): jansson refuses
 * such a number, and with it the whole text. A malloc'd copy and its length (*out_len), or
 * NULL when s holds none (or out of memory). Numbers with a fraction or an exponent are
 * left as they are (jansson reads those as reals). */
char *cg_json_saturate_ints(const char *s, size_t len, size_t *out_len);

#endif
