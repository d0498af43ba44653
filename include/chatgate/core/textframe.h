#ifndef CHATGATE_CORE_TEXTFRAME_H
#define CHATGATE_CORE_TEXTFRAME_H
/*
 * textframe.h: the frame around a streamed reply's text. The frames of one reply (an
 * OpenAI-compatible server's chunks, a WebSocket app's delta frames) mostly differ from the
 * one before in nothing but the text of one JSON string: the bytes before its opening quote
 * and after its closing one are the same. So a reader keeps those two runs of the last frame
 * it read in full (its own bytes between two quotes: no escape), and a frame that is the same
 * two runs around text that needs no decoding is read without a parser: its tokens are the
 * kept frame's, but for that string's text, which is the new one. Reading each frame was half
 * of a relayed delta's instructions (issue 39's eighth round).
 */
#include <stddef.h>

#define CG_TEXTFRAME_MAX 384 /* bytes of the two runs kept: a longer frame is not kept */

typedef struct cg_textframe {
    size_t before, after; /* the runs, in bytes[0..before + after); before 0: none kept */
    char bytes[CG_TEXTFRAME_MAX];
} cg_textframe;

/* 1 when s[0..n) is a JSON string's text as it stands, to be taken without decoding: no
 * quote, backslash or control byte, and valid UTF-8 as jansson checks it. */
int cg_json_text_plain(const char *s, size_t n);

/* Keeps the frame of buf[0..len) around text[0..text_len), which must lie in buf between two
 * quotes; when it does not, or the frame is over CG_TEXTFRAME_MAX, none is kept. */
void cg_textframe_keep(cg_textframe *fr, const char *buf, size_t len, const char *text, size_t text_len);

/* 1 when buf[0..len) is the kept frame around a plain text (cg_json_text_plain): *text and
 * *text_len are that text, in buf; else 0. */
int cg_textframe_match(const cg_textframe *fr, const char *buf, size_t len, const char **text, size_t *text_len);

#endif
