/*
 * unit.h: the few macros the C unit tests share. CHECK records a failure with its file and
 * line and goes on, so one run shows every broken case; a test's main returns unit_done().
 */
#ifndef CG_UNIT_H
#define CG_UNIT_H

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int unit_failures, unit_checks;

#define CHECK(cond)                                                                         \
    do {                                                                                    \
        unit_checks++;                                                                      \
        if (!(cond)) {                                                                      \
            unit_failures++;                                                                \
            fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond);        \
        }                                                                                   \
    } while (0)

#define CHECK_STR(a, b)                                                                     \
    do {                                                                                    \
        const char *a_ = (a), *b_ = (b);                                                    \
        unit_checks++;                                                                      \
        if (!a_ || !b_ || strcmp(a_, b_) != 0) {                                            \
            unit_failures++;                                                                \
            fprintf(stderr, "%s:%d: %s is \"%s\", expected \"%s\"\n", __FILE__, __LINE__, #a, \
                    a_ ? a_ : "(null)", b_ ? b_ : "(null)");                                \
        }                                                                                   \
    } while (0)

/* An exact-size malloc'd copy of s[0..len) (no NUL after it), so that ASan sees any read
 * past the end of a test's input. */
static inline char *unit_dup_exact(const char *s, size_t len)
{
    char *copy = malloc(len ? len : 1);
    if (!copy)
        abort();
    if (len)
        memcpy(copy, s, len);
    return copy;
}

/* A deterministic xorshift64 step on *state (a fixed seed per test, so a failure repeats):
 * the high 32 bits of the next state. */
static inline uint32_t unit_rand(uint64_t *state)
{
    *state ^= *state << 13;
    *state ^= *state >> 7;
    *state ^= *state << 17;
    return (uint32_t)(*state >> 32);
}

/* One random edit of buf[0..*n) (room for cap bytes), as a fuzzer would make: a byte deleted,
 * c inserted, or a byte replaced by c. The readers' tests hold mutated inputs to jansson. */
static inline void unit_mutate(uint64_t *state, char *buf, size_t *n, size_t cap, char c)
{
    size_t at = unit_rand(state) % (*n + 1);
    switch (unit_rand(state) % 3) {
    case 0: /* delete */
        if (at < *n) {
            memmove(buf + at, buf + at + 1, *n - at - 1);
            (*n)--;
        }
        break;
    case 1: /* insert */
        if (*n < cap) {
            memmove(buf + at + 1, buf + at, *n - at);
            buf[at] = c;
            (*n)++;
        }
        break;
    default: /* replace */
        if (at < *n)
            buf[at] = c;
    }
}

static inline int unit_done(const char *name)
{
    printf("%s: %d checks, %d passed, %d failed\n", name, unit_checks, unit_checks - unit_failures,
           unit_failures);
    return unit_failures ? 1 : 0;
}

#endif
