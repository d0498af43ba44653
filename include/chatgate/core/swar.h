#ifndef CHATGATE_CORE_SWAR_H
#define CHATGATE_CORE_SWAR_H
/*
 * swar.h: eight bytes of text looked at in one word, for the loops that pass over runs of
 * plain ASCII looking for the few bytes that need a closer look (the JSON writer's escapes,
 * the flat reader's checks). Each test is the classic bit trick, exact as a yes or no:
 * for a zero byte, (w - 0x01..01) & ~w & 0x80..80 is nonzero if and only if w holds one.
 */
#include <stdint.h>
#include <string.h>

#define CG_SWAR_ONES 0x0101010101010101ULL
#define CG_SWAR_HIGHS 0x8080808080808080ULL

/* The 8 bytes at p, whatever its alignment. */
static inline uint64_t cg_swar_load(const unsigned char *p)
{
    uint64_t w;
    memcpy(&w, p, sizeof(w));
    return w;
}

/* Nonzero when some byte of w is c. */
static inline uint64_t cg_swar_has(uint64_t w, unsigned char c)
{
    uint64_t x = w ^ (CG_SWAR_ONES * c);
    return (x - CG_SWAR_ONES) & ~x & CG_SWAR_HIGHS;
}

/* Nonzero when some byte of w is below n (n at most 128). */
static inline uint64_t cg_swar_has_below(uint64_t w, unsigned char n)
{
    return (w - CG_SWAR_ONES * n) & ~w & CG_SWAR_HIGHS;
}

#endif
