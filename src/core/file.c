/*
 * file.c: reading a named file whole, bounded (see file.h).
 */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "chatgate/core/alloc.h"
#include "chatgate/core/file.h"

char *cg_file_read(const char *path, size_t max, size_t *len, char *err, size_t errlen)
{
    int fd = open(path, O_RDONLY | O_NONBLOCK | O_CLOEXEC);
    if (fd < 0) {
        snprintf(err, errlen, "%s: %s", path, strerror(errno));
        return NULL;
    }
    /* open without waiting, then read waiting: a FIFO's writer is waited for only if there
     * is one (with none, read says end of file at once) */
    int flags = fcntl(fd, F_GETFL);
    if (flags >= 0)
        (void)fcntl(fd, F_SETFL, flags & ~O_NONBLOCK);
    size_t cap = max < 4096 ? max + 1 : 4096, n = 0; /* room for max + 1: one more says too big */
    char *buf = cg_malloc(cap + 1);
    int failed = 0;
    while (!failed && n <= max) {
        if (n == cap) {
            size_t bigger = cap * 2 > max + 1 ? max + 1 : cap * 2;
            buf = cg_realloc(buf, bigger + 1);
            cap = bigger;
        }
        ssize_t got = read(fd, buf + n, cap - n);
        if (got < 0 && errno == EINTR)
            continue;
        if (got < 0)
            failed = errno;
        else if (got == 0)
            break;
        else
            n += (size_t)got;
    }
    close(fd);
    if (!failed && n > max)
        failed = EFBIG;
    if (failed == EFBIG)
        snprintf(err, errlen, "%s: larger than %zu bytes", path, max);
    else if (failed)
        snprintf(err, errlen, "%s: %s", path, strerror(failed));
    if (failed) {
        free(buf);
        return NULL;
    }
    buf[n] = 0;
    *len = n;
    return buf;
}
