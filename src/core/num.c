/*
 * num.c: saturating reads and sums of numbers from peers (see num.h).
 */
#include <limits.h>
#include <stdlib.h>
#include <string.h>

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

/* Is the integer token of n digits at d (no sign) over a long long's bound (negative: its
 * magnitude may be one more)? Leading zeros are not JSON, but counted as digits anyway. */
static int int_too_big(const char *d, size_t n, int negative)
{
    static const char max[] = "9223372036854775807", min[] = "9223372036854775808";
    const char *bound = negative ? min : max;
    if (n != sizeof(max) - 1)
        return n > sizeof(max) - 1;
    return memcmp(d, bound, n) > 0;
}

/* The end of the number token at s[i] (a '-' or a digit), and whether it is an integer. */
static size_t number_end(const char *s, size_t len, size_t i, int *integer)
{
    *integer = 1;
    if (s[i] == '-')
        i++;
    for (; i < len; i++) {
        char c = s[i];
        if (c == '.' || c == 'e' || c == 'E' || ((c == '+' || c == '-') && !*integer))
            *integer = 0;
        else if (c < '0' || c > '9')
            break;
    }
    return i;
}

char *cg_json_saturate_ints(const char *s, size_t len, size_t *out_len)
{
    static const char max[] = "9223372036854775807", min[] = "-9223372036854775808";
    char *out = NULL;
    size_t n = 0, copied = 0; /* out's length; s's bytes up to `copied` are in out */
    int in_string = 0;
    for (size_t i = 0; i < len; i++) {
        char c = s[i];
        if (in_string) {
            if (c == '\\')
                i++; /* the escaped byte cannot end the string */
            else if (c == '"')
                in_string = 0;
            continue;
        }
        if (c == '"') {
            in_string = 1;
            continue;
        }
        if (c != '-' && (c < '0' || c > '9'))
            continue;
        int integer, negative = c == '-';
        size_t end = number_end(s, len, i, &integer);
        if (integer && int_too_big(s + i + negative, end - i - negative, negative)) {
            if (!out && !(out = malloc(len + 1)))
                return NULL; /* a bound is never longer than the digits it replaces */
            memcpy(out + n, s + copied, i - copied);
            n += i - copied;
            const char *bound = negative ? min : max;
            size_t bl = negative ? sizeof(min) - 1 : sizeof(max) - 1;
            memcpy(out + n, bound, bl);
            n += bl;
            copied = end;
        }
        i = end - 1;
    }
    if (!out)
        return NULL;
    memcpy(out + n, s + copied, len - copied);
    n += len - copied;
    out[n] = 0;
    *out_len = n;
    return out;
}
