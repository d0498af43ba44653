/*
 * utf8.c: cutting text on a character boundary, and cleaning it (see utf8.h).
 */
#include "chatgate/core/utf8.h"

#include "chatgate/core/swar.h"

size_t cg_utf8_boundary(const char *text, size_t len)
{
    size_t n = len;
    /* Step back over continuation bytes (10xxxxxx) to the lead byte, then keep it only if
     * its whole sequence fits. */
    while (n > 0 && ((unsigned char)text[n - 1] & 0xC0) == 0x80 && len - n < 3)
        n--;
    if (n == 0)
        return len;
    unsigned char lead = (unsigned char)text[n - 1];
    size_t need = lead < 0x80 ? 1 : lead >= 0xF0 ? 4 : lead >= 0xE0 ? 3 : lead >= 0xC0 ? 2 : 1;
    return (len - (n - 1) >= need) ? len : n - 1;
}

size_t cg_utf8_char_len(const unsigned char *s, size_t n)
{
    size_t len = s[0] < 0x80 ? 1 : s[0] >= 0xC2 && s[0] <= 0xDF ? 2 : s[0] >= 0xE0 && s[0] <= 0xEF ? 3
                                 : s[0] >= 0xF0 && s[0] <= 0xF4 ? 4 : 0;
    if (len == 0 || len > n)
        return 0;
    for (size_t i = 1; i < len; i++)
        if ((s[i] & 0xC0) != 0x80)
            return 0;
    if ((s[0] == 0xE0 && s[1] < 0xA0) || (s[0] == 0xED && s[1] > 0x9F) || (s[0] == 0xF0 && s[1] < 0x90) ||
        (s[0] == 0xF4 && s[1] > 0x8F))
        return 0; /* overlong, surrogate, past U+10FFFF */
    return len;
}

size_t cg_utf8_ascii_prefix(const char *s, size_t n)
{
    const unsigned char *u = (const unsigned char *)s;
    size_t i = 0;
    while (i + 8 <= n && !(cg_swar_load(u + i) & CG_SWAR_HIGHS))
        i += 8;
    while (i < n && u[i] < 0x80)
        i++;
    return i;
}

int cg_utf8_valid(const char *s, size_t n)
{
    const unsigned char *u = (const unsigned char *)s;
    for (size_t i = cg_utf8_ascii_prefix(s, n); i < n;) {
        size_t len = u[i] < 0x80 ? 1 : cg_utf8_char_len(u + i, n - i);
        if (!len)
            return 0;
        i += len;
    }
    return 1;
}

void cg_utf8_clean(char *s, size_t n)
{
    for (size_t i = 0; i < n;) {
        size_t len = cg_utf8_char_len((unsigned char *)s + i, n - i);
        if (len == 0) {
            s[i++] = '?';
            continue;
        }
        i += len;
    }
}
