/*
 * protocol.h: the chatgate.v1 frames (docs/protocol.md), parsed and built.
 *
 * Parsing turns one client text frame into a cg_client_frame or a bad_frame error whose
 * message names the field that was wrong. Building gives the gateway's frames as compact
 * JSON dumped once into the buffer they are sent from, behind CG_FRAME_PRE bytes of room
 * for the WebSocket header (lws writes it there: LWS_PRE), with their length, so the sender
 * neither measures nor copies them. Pure: no I/O, no clock.
 */
#ifndef CHATGATE_PROTOCOL_H
#define CHATGATE_PROTOCOL_H

#include <jansson.h>
#include <stddef.h>
#include <stdint.h>

#define CG_PROTOCOL_NAME "chatgate.v1"
#define CG_MAX_ID 128    /* bytes of a client message id */
#define CG_MAX_ROOM 256  /* bytes of a room id (docs/state.md, "Keys") */

typedef enum cg_frame_type {
    CG_FRAME_MESSAGE,
    CG_FRAME_CANCEL,
    CG_FRAME_CONTEXT_GET,
    CG_FRAME_CONTEXT_FORGET,
    CG_FRAME_CONTEXT_CLEAR,
    CG_FRAME_RESUME,
    CG_FRAME_PROFILE_GET,
    CG_FRAME_PROFILE_FORGET,
} cg_frame_type;

typedef struct cg_client_frame {
    cg_frame_type type;
    char id[CG_MAX_ID + 1]; /* "" when the frame had none */
    char room[CG_MAX_ROOM + 1];
    char *text;             /* message: owned, freed by cg_client_frame_clear() */
    json_t *keys;           /* context.forget, profile.forget (NULL: every name): array of strings, owned */
    uint64_t after;         /* resume: the seq of the last delta the client has */
} cg_client_frame;

/*
 * Parses one text frame. Returns 0, or CG_E_BAD_FRAME with a message in err naming what
 * was wrong; out->id is filled whenever the frame carried a usable id, so that the error
 * can be about that message.
 */
int cg_protocol_parse(const char *buf, size_t len, cg_client_frame *out, char *err, size_t errlen);
void cg_client_frame_clear(cg_client_frame *f);

/* Room in front of a built frame's JSON: lws's LWS_PRE (16 in lws 4.1; session.c checks). */
#define CG_FRAME_PRE 16

/* A built frame: compact JSON (NUL-terminated) at json = buf + CG_FRAME_PRE, len bytes of
 * it; buf is malloc'd and the caller's to free. */
typedef struct cg_frame_text {
    char *buf;
    char *json;
    size_t len;
} cg_frame_text;

/* Builders: each returns a frame (never without one; aborts on no memory). */
cg_frame_text cg_protocol_hello(const char *user, const char *session, const char *resume);
/* What an ack says about a message (docs/protocol.md); JSON parts borrowed, NULL gives null/{}/[]. */
typedef struct cg_ack {
    const char *id, *room, *route, *service, *enriched;
    json_t *params, *resolution, *rules;
    json_t *from_profile; /* names of params the user's profile gave, or NULL (not said) */
} cg_ack;
cg_frame_text cg_protocol_ack(const cg_ack *a);
/* state is borrowed. */
cg_frame_text cg_protocol_context(const char *room, json_t *state);
/* {"type":"profile","profile":{...}}: the user's profile (docs/protocol.md). */
cg_frame_text cg_protocol_profile(json_t *profile);
cg_frame_text cg_protocol_warning(const char *id, const char *code, const char *message);
/* seq: the reply's bytes relayed up to the end of this text, for a resume's "after" */
cg_frame_text cg_protocol_delta(const char *id, const char *text, size_t len, uint64_t seq);
/* usage is borrowed and may be NULL; truncated says the text holds only the reply's start. */
/* Who answered a message: the done frame's "upstream", "replica", "attempts" and
 * "fallback_from" (docs/upstreams.md, "Replicas, retries and fallback"). */
typedef struct cg_answer {
    const char *upstream;      /* the upstream's name; NULL: not said */
    int replica;               /* its replica that answered; -1 when it has one URL */
    int attempts;              /* attempts it took on that upstream; said when over 1 */
    const char *fallback_from; /* the upstream that failed before, or NULL */
    json_t *reply_rules;       /* what reply rules did to it (rules.h, cg_reply_filter_acted), or NULL */
} cg_answer;
cg_frame_text cg_protocol_done(const char *id, const char *text, size_t len, json_t *usage, int truncated,
                               const cg_answer *who);
cg_frame_text cg_protocol_cancelled(const char *id);
/* id NULL or "" gives "id":null. */
cg_frame_text cg_protocol_error(const char *id, const char *code, const char *message);
/* The same with detail's members added (borrowed, NULL for none; never replacing type, id,
 * code or message): an upstream's "status", "upstream_type", "upstream_code". */
cg_frame_text cg_protocol_error_detail(const char *id, const char *code, const char *message, json_t *detail);

/* Serialises obj compactly and decrefs it; aborts on no memory. */
char *cg_protocol_dump(json_t *obj);
/* The same as a frame (CG_FRAME_PRE bytes of room in front). */
cg_frame_text cg_protocol_frame(json_t *obj);

#endif
