/*
 * dropin_map.h: drop-in mode's mapping between an app's own frames and chatgate's (the
 * "dropin" object of the config, docs/protocol.md "Drop-in mode"), as pure functions: no I/O, no clock,
 * no state; the fuzz target tests/fuzz/fuzz_dropin.c drives them.
 *
 * A codec (dropin.codec) turns a text frame into the JSON value the mapping's pointers and
 * markers read, and back: "json" (the frame is a JSON value), "socket.io" (an Engine.IO v4
 * message carrying a Socket.IO v5 EVENT, `42/ns,7["name",args...]`: the value is the event's
 * array, the `42/ns,7` prefix is kept as it came; every other packet is not ours), and "text"
 * (the frame's text is the message, or the reply).
 *
 * A client frame is a chat message when it matches dropin.client.chat, a cancel when it
 * matches dropin.client.cancel, else nothing of ours (passed through untouched). The rule
 * the mapping keeps: nothing the app will read as a chat message reaches it unchecked. So
 * frames are read as the apps' own parsers read them (socket.io-parser's grammar, binary
 * events and all; JSON in binary frames), and a frame the app would read but the gateway
 * cannot check is CG_DROPIN_REFUSE, never passed: JSON that jansson refuses (a number out of
 * range, a lone surrogate, \u0000, a duplicate key), a chat message whose id is not a string
 * of at most CG_MAX_ID bytes or an integer, whose room is not one of at most CG_MAX_ROOM
 * bytes, whose text (dropin.client.text) is not a non-empty string, that holds a NUL byte,
 * that comes in a binary frame, or (socket.io) that carries more arguments than the mapping
 * takes (the next one is chatgate's).
 *
 * The object an app reads as chatgate's is always chatgate's: json codec, it replaces any
 * member of that name in a chat message, and a passed frame that carries one has it removed
 * (CG_DROPIN_STRIPPED); socket.io, it is the argument right after the ones the mapping takes
 * (dropin.client.arguments), padded with null, before an ack callback.
 */
#ifndef CHATGATE_DROPIN_MAP_H
#define CHATGATE_DROPIN_MAP_H

#include <jansson.h>
#include <stddef.h>

#include "chatgate/config/dropin_config.h"
#include "chatgate/proto/protocol.h"

typedef enum {
    CG_DROPIN_PASS,     /* not a chat message or cancel: untouched */
    CG_DROPIN_CHAT,     /* a chat message: chat is filled */
    CG_DROPIN_REFUSE,   /* the app would read it as a message, the gateway cannot check it: why says what */
    CG_DROPIN_CANCEL,   /* the client's own cancel frame (not a chat message too): chat->id is the id of
                         * the message it stops (client.cancel_id; "" any, NULL none: one no message
                         * can have); chat->frame is NULL, or, when it carried a member in chatgate's
                         * place, as for CG_DROPIN_STRIPPED */
    CG_DROPIN_STRIPPED, /* not a chat message, but it carried a member in chatgate's place (or the app's
                         * state_key): chat->frame is the frame without it, to send as
                         * cg_dropin_map_encode writes it */
} cg_dropin_client_kind;


/* A chat message from the client, every string owned (cg_dropin_chat_clear). */
typedef struct cg_dropin_chat {
    json_t *frame; /* the whole frame, decoded (socket.io: the event's array; text: a string) */
    char *prefix;  /* socket.io: the packet's "42/ns,7" as the client wrote it; else NULL */
    char *id;      /* "" when the frame has none */
    int id_is_integer; /* the client wrote the id as a JSON integer (id is its digits) */
    char *room;    /* "default" when the frame has none */
    char *text;
    long attachments; /* socket.io: the binary frames of this (binary) event that follow it */
} cg_dropin_chat;

cg_dropin_client_kind cg_dropin_map_client(json_t *dropin_cfg, const char *buf, size_t len, int binary,
                                           cg_dropin_chat *chat, char *why, size_t whylen);
void cg_dropin_chat_clear(cg_dropin_chat *chat);
/* socket.io: how many arguments a chat event carries (dropin.client.arguments, else the
 * highest argument the client pointers name: "/2/text" is 2; 1 at least). */
int cg_dropin_map_arguments(json_t *dropin_cfg);
/* A CG_DROPIN_STRIPPED frame as the codec writes it (buf NULL when out of memory). */
cg_frame_text cg_dropin_map_encode(json_t *dropin_cfg, const cg_dropin_chat *chat);

/* The frame for the app: chat->frame with object added at dropin.object_at (under
 * dropin.object_key, "chatgate", or appended to an array), encoded by the codec; the text
 * codec forwards the text as it came (object dropped). Takes object; built as protocol.h's
 * frames are (CG_FRAME_PRE bytes of room in front), buf NULL when it could not be built. */
cg_frame_text cg_dropin_map_forward(json_t *dropin_cfg, const cg_dropin_chat *chat, json_t *object);

/* One app frame, read through dropin.app_frames. */
typedef struct cg_dropin_app_frame {
    json_t *frame;     /* NULL when the codec finds nothing of ours in it (relayed as it is) */
    int reply;         /* matches dropin.app_frames.reply (every frame, when it names none) */
    char *id;          /* dropin.app_frames.id as text (owned; bytes, may hold NUL), NULL when none */
    size_t id_len;
    int end, cancelled; /* matches the end / cancelled marker */
    const char *text;  /* dropin.app_frames.text when a string (borrowed from frame), else NULL */
    size_t text_len;
    json_t *state;     /* the state directive under dropin.state_key (a reference), or NULL */
    char *rewritten;   /* the frame without the directive, when there was one (owned) */
    size_t rewritten_len;
} cg_dropin_app_frame;

/* 0, or -1 when the frame had a state directive and the frame without it could not be written
 * (out->rewritten NULL; the caller must not relay the directive). */
int cg_dropin_map_app(json_t *dropin_cfg, const char *buf, size_t len, int binary, cg_dropin_app_frame *out);
void cg_dropin_app_frame_clear(cg_dropin_app_frame *f);
/* Is this app frame about the chat message with id (its id is that id, or it has none)? */
int cg_dropin_app_frame_about(const cg_dropin_app_frame *f, const char *id);

/* dropin.app_frames.cancel_frame for id ("{id}" in its strings becomes the id, JSON-escaped;
 * a string that is "{id}" alone becomes the integer itself when id_is_integer, as the client
 * wrote it, so that an app keying messages by number finds it; the text codec's is a plain
 * string, the id put in as it is; socket.io's an event array, sent in dropin.namespace): a
 * malloc'd string and its length, or NULL when the mapping has none or it cannot be built. */
char *cg_dropin_map_cancel_frame(json_t *dropin_cfg, const char *id, int id_is_integer, size_t *len);

#endif
