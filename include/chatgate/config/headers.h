/*
 * headers.h: the "headers" map of an upstream or of drop-in mode's app (docs/upstreams.md, "Upstream
 * headers"): extra request headers chatgate sends, each value given in the file or read from
 * an environment variable at start ({"env": "NAME"}), so secrets stay out of config files.
 *
 * Checked whole when loaded: a name must be an HTTP token, a value one line of at most
 * CG_HEADER_VALUE_MAX bytes, and the headers the gateway itself must write (Host,
 * Content-Length, Connection, Upgrade, Sec-WebSocket-*, ...) are refused, so a config cannot
 * break the request it is added to. Values are never logged: cg_headers_names gives the
 * names alone for the log.
 */
#ifndef CHATGATE_CONFIG_HEADERS_H
#define CHATGATE_CONFIG_HEADERS_H

#include <jansson.h>
#include <stddef.h>

#define CG_HEADERS_MAX 32
#define CG_HEADER_VALUE_MAX 4096

typedef struct cg_header {
    char *name;  /* as written in the config */
    char *value; /* secret, perhaps: never logged */
} cg_header;

typedef struct cg_headers {
    cg_header items[CG_HEADERS_MAX];
    int n;
} cg_headers;

/* Loads obj (a "headers" object; NULL: none) into out, which must be empty. 0, or -1 with
 * "where.NAME: why" in err (where is the key's path, "upstreams.llm.headers"); out is then
 * freed. */
int cg_headers_load(json_t *obj, const char *where, cg_headers *out, char *err, size_t errlen);
void cg_headers_free(cg_headers *h);

/* Does h set the header name (any case)? */
int cg_headers_has(const cg_headers *h, const char *name);

/* "name1, name2" (the names alone, for the log) into buf. */
void cg_headers_names(const cg_headers *h, char *buf, size_t len);

#endif
