/*
 * buf.c: the growing byte buffer of buf.h.
 */
#include "chatgate/core/alloc.h"
#include "chatgate/core/buf.h"
#include "chatgate/core/utf8.h"

#include <stdlib.h>
#include <string.h>

void cg_buf_append(char **buf, size_t *len, size_t *cap, const void *data, size_t n, size_t first)
{
    if (*len + n + 1 > *cap) {
        size_t ncap = *cap ? *cap : first;
        while (ncap < *len + n + 1)
            ncap *= 2;
        char *nb = cg_realloc(*buf, ncap);
        *buf = nb;
        *cap = ncap;
    }
    if (n) /* data may be NULL then, which memcpy may not be given */
        memcpy(*buf + *len, data, n);
    *len += n;
    (*buf)[*len] = 0;
}

int cg_buf_append_upto(char **buf, size_t *len, size_t *cap, const char *text, size_t n, size_t max)
{
    int cut = *len + n > max;
    if (cut)
        n = cg_utf8_boundary(text, max > *len ? max - *len : 0);
    cg_buf_append(buf, len, cap, text, n, 256);
    return cut;
}
