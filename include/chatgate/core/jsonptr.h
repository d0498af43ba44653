/*
 * jsonptr.h: JSON Pointers (RFC 6901), which jansson lacks (docs/architecture.md, "Notes on the libraries"): "/a/0/b"
 * names root["a"][0]["b"]; "~1" stands for '/', "~0" for '~'; "" is the whole document.
 */
#ifndef CHATGATE_JSONPTR_H
#define CHATGATE_JSONPTR_H

#include <jansson.h>

/* 1 when ptr is a JSON pointer ("" or starting with '/', with only ~0 and ~1 escapes). */
int cg_json_pointer_valid(const char *ptr);
/* The value ptr names in root (borrowed), or NULL. */
json_t *cg_json_pointer_get(json_t *root, const char *ptr);

#endif
