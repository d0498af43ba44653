/*
 * textframe.c: the frame around a streamed reply's text (textframe.h).
 */
#include <stdint.h>
#include <string.h>

#include "chatgate/core/swar.h"
#include "chatgate/core/textframe.h"
#include "chatgate/core/utf8.h"

int cg_json_text_plain(const char *s, size_t n)
{
    const unsigned char *u = (const unsigned char *)s;
    for (size_t i = 0; i < n;) {
        if (i + 8 <= n) { /* eight bytes of ASCII at once, none of them a quote, a backslash or a control */
            uint64_t w = cg_swar_load(u + i);
            if (!(w & CG_SWAR_HIGHS) && !cg_swar_has(w, '"') && !cg_swar_has(w, '\\') && !cg_swar_has_below(w, 0x20)) {
                i += 8;
                continue;
            }
        }
        if (u[i] >= 0x80) {
            size_t l = cg_utf8_char_len(u + i, n - i);
            if (!l)
                return 0;
            i += l;
        } else if (u[i] == '"' || u[i] == '\\' || u[i] < 0x20) {
            return 0;
        } else {
            i++;
        }
    }
    return 1;
}

void cg_textframe_keep(cg_textframe *fr, const char *buf, size_t len, const char *text, size_t text_len)
{
    fr->before = 0; /* none, unless this one is kept */
    if (text <= buf || text + text_len >= buf + len)
        return; /* not buf's own bytes with a byte on each side */
    size_t before = (size_t)(text - buf), after = len - before - text_len;
    if (before + after > CG_TEXTFRAME_MAX || buf[before - 1] != '"' || buf[before + text_len] != '"')
        return;
    memcpy(fr->bytes, buf, before);
    memcpy(fr->bytes + before, buf + before + text_len, after);
    fr->before = before;
    fr->after = after;
}

int cg_textframe_match(const cg_textframe *fr, const char *buf, size_t len, const char **text, size_t *text_len)
{
    if (!fr->before || len < fr->before + fr->after || memcmp(buf, fr->bytes, fr->before) != 0 ||
        memcmp(buf + len - fr->after, fr->bytes + fr->before, fr->after) != 0)
        return 0;
    size_t n = len - fr->before - fr->after;
    if (!cg_json_text_plain(buf + fr->before, n))
        return 0;
    *text = buf + fr->before;
    *text_len = n;
    return 1;
}
