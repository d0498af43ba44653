/*
 * dropin_config.h: the "dropin" object of a config file (drop-in mode, docs/protocol.md):
 * the app's path and URL, the headers and subprotocols passed on, and the mapping of the
 * app's frames (JSON pointers and markers). Checked whole at start.
 */
#ifndef CHATGATE_CONFIG_DROPIN_CONFIG_H
#define CHATGATE_CONFIG_DROPIN_CONFIG_H

#include <jansson.h>
#include <stddef.h>

/* Headers (and subprotocols) a mapping may name to pass on to the app. */
#define CG_DROPIN_MAX_FORWARD_HEADERS 8
/* The most arguments a socket.io chat event may be set to carry (dropin.client.arguments). */
#define CG_DROPIN_MAX_ARGUMENTS 16

/* Checks the "dropin" object of a config file; 0, or -1 with "file: dropin.key: ..." in err. */
int cg_dropin_config_check(json_t *dropin, const char *file, char *err, size_t errlen);

#endif
