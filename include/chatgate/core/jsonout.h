#ifndef CHATGATE_CORE_JSONOUT_H
#define CHATGATE_CORE_JSONOUT_H
/*
 * jsonout.h: compact JSON text written straight into the buffer it is sent from.
 *
 * json_dumps() grows its text from 16 bytes by doubling, then copies it into a fresh string,
 * and a frame for lws was then copied once more behind LWS_PRE bytes of headroom: for a
 * ws upstream's message frame, which carries the history, a dozen allocations and three
 * copies per message. Here the text is dumped (json_dump_callback) into one buffer that
 * starts at the size of the caller's previous frame and leaves `pre` bytes in front of it.
 */
#include <jansson.h>
#include <stddef.h>

/*
 * j as compact JSON at buf + pre (NUL-terminated; *len is its length), in a malloc'd buffer
 * of at least pre + hint + 1 bytes. NULL when j cannot be encoded (text that is not UTF-8).
 * Aborts when out of memory, as the gateway does for buffers it cannot work without.
 */
char *cg_json_dump_pre(json_t *j, size_t pre, size_t hint, size_t *len);

#endif
