#ifndef CHATGATE_STORE_REDIS_ARGV_H
#define CHATGATE_STORE_REDIS_ARGV_H
/*
 * redis_argv.h: one Redis command, for the Redis store's files (internal to src/store).
 *
 * One command, written as RESP as its arguments come: an argument whose length is known
 * (a string, a key, a number) gets its "$<length>\r\n" first; one known only once written (a
 * JSON value) moves up by those few bytes, which then go in front. The "*<count>\r\n" goes
 * into the headroom before the first when the command is sent, so the connection is handed
 * the buffer as it is (cg_redis_send, which copies it). Building each
 * argument in its own malloc'd string (asprintf for keys and numbers, json_dumps for values)
 * and letting hiredis format them (sdscatfmt per argument) was a quarter of a Redis turn's
 * instructions; writing the arguments into a list and framing them as RESP in a second pass,
 * 4,000 instructions of a Redis turn's 177,000 (tests/bench/instructions.sh, issue 12).
 */
#include <jansson.h>
#include <stddef.h>

#include "chatgate/core/jsonout.h"
#include "chatgate/store/redis_client.h"

#define ARGV_HEAD 16 /* headroom for "*<count>\r\n" */
typedef struct cg_argv {
    cg_jsonw w;   /* the arguments as RESP bulk strings, after ARGV_HEAD bytes of headroom */
    int argc;
    unsigned slot; /* Redis Cluster: the slot of its keys (their hash tag, the user's) */
    int slot_known; /* slot is its first key's: every key of a command has the same tag */
} cg_argv;

/* Arguments: a string of n bytes, a C string, a number, a JSON value ("null" for one it
 * cannot encode, which the dialog never holds: text that is not UTF-8). */
void cg_argv_arg(cg_argv *a, const char *s, size_t n);
void cg_argv_str(cg_argv *a, const char *s);
void cg_argv_int(cg_argv *a, long long n);
void cg_argv_json(cg_argv *a, json_t *v);

/* An argument written piece by piece: cg_argv_known (its length known) or cg_argv_begin
 * (known once written: cg_argv_end(start)), then the bytes, then cg_argv_done. */
size_t cg_argv_begin(cg_argv *a);
void cg_argv_known(cg_argv *a, size_t n);
void cg_argv_end(cg_argv *a, size_t start);
void cg_argv_done(cg_argv *a);

/* "<prefix>:{<eu>}:<er>:<part>", or "<prefix>:{<eu>}:<part>" when er is NULL: a dialog's
 * key, or a user's (the hash tag is the user's: a user's keys live on one shard). put_key
 * writes it into the argument begun; key_stem_len is its length but the part's. */
void cg_argv_key(cg_argv *a, const char *prefix, const char *eu, const char *er, const char *part);
void cg_argv_put_key(cg_argv *a, const char *prefix, const char *eu, const char *er, const char *part);
size_t cg_argv_key_stem_len(const char *prefix, const char *eu, const char *er);

/* Empties a for the next command (its buffer kept); frees its buffer. */
void cg_argv_clear(cg_argv *a);
void cg_argv_free(cg_argv *a);

/* a's command, framed: its "*<count>" line written into the headroom before the first
 * argument; its bytes at the pointer returned, *len of them. NULL when a is empty. */
const char *cg_argv_framed(cg_argv *a, size_t *len);

#endif
