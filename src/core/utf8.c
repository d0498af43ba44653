/*
 * utf8.c: cutting text on a character boundary (see utf8.h).
 */
#include "chatgate/core/utf8.h"

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
