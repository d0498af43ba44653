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

static inline int unit_done(const char *name)
{
    printf("%s: %d checks, %d passed, %d failed\n", name, unit_checks, unit_checks - unit_failures,
           unit_failures);
    return unit_failures ? 1 : 0;
}

#endif
