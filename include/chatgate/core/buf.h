#ifndef CHATGATE_CORE_BUF_H
#define CHATGATE_CORE_BUF_H
/*
 * buf.h: a growing byte buffer (a reply kept for the history, a frame put together, JSON
 * text written): appends grow it by doubling, from `first` bytes, so n bytes cost O(n)
 * copying, and keep it NUL-terminated. Running out of memory aborts, as the gateway does
 * for buffers it cannot work without. The caller bounds what it appends.
 */
#include <stddef.h>

/* Appends n bytes of data to *buf (holding *len bytes in *cap; all 0/NULL at first). */
void cg_buf_append(char **buf, size_t *len, size_t *cap, const void *data, size_t n, size_t first);

/* Appends UTF-8 text as cg_buf_append does, but never past max bytes in all: what would pass
 * it is cut on a character boundary and left out. 1 when it cut (the caller keeps no more),
 * else 0. */
int cg_buf_append_upto(char **buf, size_t *len, size_t *cap, const char *text, size_t n, size_t max);

#endif
