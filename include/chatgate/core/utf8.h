/*
 * utf8.h: cutting text on a character boundary. Ids, log lines, replies and close reasons
 * are cut to a bound in many places; a cut inside a UTF-8 sequence would make jansson refuse
 * the text later, so every cut goes through here. And making text that quotes what others
 * sent (log lines, error messages) valid UTF-8.
 */
#ifndef CHATGATE_CORE_UTF8_H
#define CHATGATE_CORE_UTF8_H

#include <stddef.h>

/* The largest n <= len such that text[0..n) does not end inside a UTF-8 sequence. */
size_t cg_utf8_boundary(const char *text, size_t len);

/* Replaces, in place, every byte of s[0..n) that does not belong to a valid UTF-8 character
 * with '?': stray and cut-off bytes, overlong forms, surrogates, code points past U+10FFFF. */
void cg_utf8_clean(char *s, size_t n);
/* Length of the valid UTF-8 character at s (n bytes left): 1 to 4, or 0 when s does not start
 * one (a stray or cut-off byte, an overlong form, a surrogate, past U+10FFFF). */
size_t cg_utf8_char_len(const unsigned char *s, size_t n);
/* 1 when s[0..n) is all valid UTF-8 characters, else 0. */
int cg_utf8_valid(const char *s, size_t n);
/* How many bytes s[0..n) begins with below 0x80 (n when it is all ASCII), eight at a time. */
size_t cg_utf8_ascii_prefix(const char *s, size_t n);

#endif
