/*
 * alloc.h: the gateway's one out-of-memory policy, as redis's zmalloc has one: an allocation
 * that fails is not an error a caller handles but the process's end. It says so on stderr
 * (how many bytes, no allocation needed for that) and aborts: a supervisor (systemd, the
 * master of --workers) starts it again, and no half-done request goes on with a part
 * missing. Every allocation of the gateway goes through these; jansson's too
 * (cg_alloc_init), so a json_* that returns NULL means a wrong argument, never memory.
 */
#ifndef CHATGATE_CORE_ALLOC_H
#define CHATGATE_CORE_ALLOC_H

#include <stddef.h>

/* Never NULL (n 0 gets a valid pointer too). */
void *cg_malloc(size_t n);
void *cg_calloc(size_t count, size_t size);
void *cg_realloc(void *p, size_t n);
char *cg_strdup(const char *s);
char *cg_strndup(const char *s, size_t n);

/* Makes jansson allocate through cg_malloc (once, at start, before any json_*). */
void cg_alloc_init(void);

/* Says "out of memory" with the size asked for, and aborts. For a library's allocation
 * that failed inside a call that cannot say so otherwise. */
void cg_out_of_memory(size_t n) __attribute__((noreturn));

#endif
