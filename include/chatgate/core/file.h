#ifndef CHATGATE_CORE_FILE_H
#define CHATGATE_CORE_FILE_H
/*
 * file.h: a whole file an operator named (the config, tls_ca_file, a rule file) read into
 * memory, bounded, and never waiting for ever: a FIFO is opened without waiting for a writer
 * (then read to its end: a writer that is there, as with `--config <(...)`, is read; with
 * none there is nothing to read), and a file with no end (/dev/urandom) stops at the bound.
 * fopen() waited in open() for a FIFO's writer, before the gateway had said anything.
 */
#include <stddef.h>

/* The bytes of path, NUL-terminated after *len of them (malloc'd: the caller frees), or NULL
 * with "<path>: <why>" in err: the system's reason (No such file or directory, Is a
 * directory, ...), or "larger than <max> bytes". */
char *cg_file_read(const char *path, size_t max, size_t *len, char *err, size_t errlen);

#endif
