/*
 * fuzz_protocol.c: libFuzzer target for the client frame parser (cg_protocol_parse): any
 * bytes as one text frame must parse or be refused with a message, never crash or leak.
 * What a parse gives must hold what protocol.h promises (id up to CG_MAX_ID bytes, a room,
 * text for a message, 1 to 100 keys for context.forget), and the frames built from it (the
 * ack, a delta cut on a character boundary, the error for a refused frame) must encode.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "chatgate/core/utf8.h"
#include "chatgate/proto/protocol.h"

/* The builders fall back to this frame when encoding failed; it must never be needed. */
static void check_built(cg_frame_text built)
{
    const char *frame = built.json;
    if (built.len != strlen(frame))
        __builtin_trap();
    if (strcmp(frame, "{\"type\":\"error\",\"id\":null,\"code\":\"internal\","
                      "\"message\":\"a frame could not be encoded\"}") == 0)
        __builtin_trap();
    json_t *j = json_loads(frame, 0, NULL);
    if (!json_is_object(j))
        __builtin_trap();
    json_decref(j);
    free(built.buf);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    cg_client_frame f;
    char err[256];
    err[0] = 0;
    int rc = cg_protocol_parse((const char *)data, size, &f, err, sizeof(err));
    if (rc < 0) {
        if (!err[0])
            __builtin_trap(); /* every refusal says why */
        check_built(cg_protocol_error(f.id, "bad_frame", err));
        cg_client_frame_clear(&f);
        return 0;
    }
    size_t id_len = strlen(f.id), room_len = strlen(f.room);
    if (id_len > CG_MAX_ID || room_len > CG_MAX_ROOM)
        __builtin_trap();
    switch (f.type) {
    case CG_FRAME_MESSAGE: {
        if (!f.text || !*f.text || room_len == 0)
            __builtin_trap();
        cg_ack a = {.id = id_len ? f.id : "g1", .room = f.room, .route = "demo"};
        check_built(cg_protocol_ack(&a));
        size_t len = strlen(f.text);
        size_t cut = cg_utf8_boundary(f.text, len / 2);
        if (cut > len / 2)
            __builtin_trap();
        check_built(cg_protocol_delta(a.id, f.text, cut, cut));
        check_built(cg_protocol_done(a.id, f.text, len, NULL, 1, NULL));
        break;
    }
    case CG_FRAME_CANCEL:
        if (id_len == 0)
            __builtin_trap();
        check_built(cg_protocol_cancelled(f.id));
        break;
    case CG_FRAME_RESUME: /* a whole number from 0 */
        if (id_len == 0 || f.after > (uint64_t)INT64_MAX)
            __builtin_trap();
        check_built(cg_protocol_delta(f.id, "x", 1, f.after));
        break;
    case CG_FRAME_CONTEXT_FORGET:
        if (json_array_size(f.keys) < 1 || json_array_size(f.keys) > 100)
            __builtin_trap();
        /* fall through */
    case CG_FRAME_CONTEXT_GET:
    case CG_FRAME_CONTEXT_CLEAR:
        if (room_len == 0)
            __builtin_trap();
    {
        json_t *state = json_object(); /* the dialog's state; here the keys to forget */
        if (f.keys)
            json_object_set(state, "keys", f.keys);
        check_built(cg_protocol_context(f.room, state));
        json_decref(state);
        break;
    }
    case CG_FRAME_PROFILE_FORGET: /* keys: none (all), or 1 to 100 strings */
        if (f.keys && (json_array_size(f.keys) < 1 || json_array_size(f.keys) > 100))
            __builtin_trap();
        /* fall through */
    case CG_FRAME_PROFILE_GET: {
        json_t *profile = json_object();
        if (f.keys)
            json_object_set(profile, "keys", f.keys);
        check_built(cg_protocol_profile(profile));
        json_decref(profile);
        break;
    }
    }
    cg_client_frame_clear(&f);
    return 0;
}
