/*
 * alloc.c: allocations that never return NULL (alloc.h).
 */
#define _GNU_SOURCE /* strndup */
#include "chatgate/core/alloc.h"

#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

void cg_out_of_memory(size_t n)
{
    /* no stdio buffer, no allocation: the message must get out with memory gone */
    char msg[96];
    int len = snprintf(msg, sizeof(msg), "chatgate: out of memory allocating %zu bytes: aborting\n", n);
    if (len > 0 && write(STDERR_FILENO, msg, (size_t)len) < 0)
        msg[0] = 0;
    abort();
}

void *cg_malloc(size_t n)
{
    void *p = malloc(n ? n : 1);
    if (!p)
        cg_out_of_memory(n);
    return p;
}

void *cg_calloc(size_t count, size_t size)
{
    void *p = calloc(count ? count : 1, size ? size : 1);
    if (!p)
        cg_out_of_memory(count * size);
    return p;
}

void *cg_realloc(void *p, size_t n)
{
    void *q = realloc(p, n ? n : 1);
    if (!q)
        cg_out_of_memory(n);
    return q;
}

char *cg_strdup(const char *s)
{
    char *d = strdup(s);
    if (!d)
        cg_out_of_memory(strlen(s) + 1);
    return d;
}

char *cg_strndup(const char *s, size_t n)
{
    char *d = strndup(s, n);
    if (!d)
        cg_out_of_memory(n + 1);
    return d;
}

void cg_alloc_init(void)
{
    json_set_alloc_funcs(cg_malloc, free);
}
