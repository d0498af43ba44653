#ifndef CHATGATE_CORE_ADDRMAP_H
#define CHATGATE_CORE_ADDRMAP_H
/*
 * addrmap.h: a jansson object used as a map from a string key to an address (held as a
 * json integer). jansson's hash table is seeded at random, so keys a client picks cannot
 * crowd one bucket. The map owns nothing it points to: the caller frees what it stored,
 * and deletes its key (json_object_del) before.
 */
#include <jansson.h>
#include <stdint.h>

/* The address stored under key, or NULL. */
static inline void *cg_addrmap_get(json_t *map, const char *key)
{
    json_t *at = json_object_get(map, key);
    return at ? (void *)(uintptr_t)json_integer_value(at) : NULL;
}

/* Stores p under key (a key that needs no UTF-8 check: an escaped id, store.h); 0, or -1
 * out of memory. */
static inline int cg_addrmap_set(json_t *map, const char *key, void *p)
{
    return json_object_set_new_nocheck(map, key, json_integer((json_int_t)(uintptr_t)p));
}

#endif
