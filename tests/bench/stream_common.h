/*
 * stream_common.h: what the streaming benchmark's server (sse_server.c) and client
 * (stream_bench.c) share: the clock, the stamp each delta carries, allocation, and a
 * connection's output that a non-blocking socket did not take yet.
 *
 * The stamp is '~' and STAMP_LETTERS letters 'a' to 'p', the low 48 bits of the monotonic
 * clock in nanoseconds at the server's write(), four bits a letter, most significant first.
 * No digits: the shipped reply rules (a card number's) would mask or hold back a stamp that
 * had them. Server and client are on one machine, so one clock.
 */
#ifndef CG_BENCH_STREAM_COMMON_H
#define CG_BENCH_STREAM_COMMON_H

#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define NS_PER_S 1000000000LL
#define STAMP_LETTERS 12
#define STAMP_MASK ((UINT64_C(1) << (4 * STAMP_LETTERS)) - 1u)

static inline int64_t now_ns(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (int64_t)ts.tv_sec * NS_PER_S + ts.tv_nsec;
}

/* Writes the stamp of t, '~' and STAMP_LETTERS letters, and a NUL into out. */
static inline void stamp_write(char out[STAMP_LETTERS + 2], uint64_t t)
{
	out[0] = '~';
	for (int i = 0; i < STAMP_LETTERS; i++)
		out[1 + i] = (char)('a' + ((t >> (4 * (STAMP_LETTERS - 1 - i))) & 15u));
	out[STAMP_LETTERS + 1] = '\0';
}

/* realloc, or the program's end with "NAME: out of memory". */
static inline void *bench_realloc(const char *name, void *p, size_t n)
{
	void *q = realloc(p, n);

	if (!q) {
		fprintf(stderr, "%s: out of memory\n", name);
		exit(1);
	}
	return q;
}

/* What a socket did not take yet: buf[off..len). */
struct bench_out {
	char *buf;
	size_t off, len, cap;
};

/*
 * One write() of buf[0..n) to fd after what waits (none is tried while some waits); keeps
 * the rest. 0: all written; 1: some waits (ask for EPOLLOUT); -1: the connection is gone.
 */
static inline int bench_out_write(struct bench_out *o, int fd, const void *buf, size_t n, const char *name)
{
	const char *p = buf;

	if (o->off == o->len) {
		ssize_t w = write(fd, p, n);

		if (w < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)
			return -1;
		if (w > 0) {
			p += w;
			n -= (size_t)w;
		}
		o->off = o->len = 0;
		if (!n)
			return 0;
	}
	if (o->len + n > o->cap) {
		o->cap = 2 * (o->len + n);
		o->buf = bench_realloc(name, o->buf, o->cap);
	}
	memcpy(o->buf + o->len, p, n);
	o->len += n;
	return 1;
}

/* Writes what waits: 0 when nothing waits any more, 1 when some still does, -1 when the
 * connection is gone. */
static inline int bench_out_flush(struct bench_out *o, int fd)
{
	while (o->off < o->len) {
		ssize_t w = write(fd, o->buf + o->off, o->len - o->off);

		if (w < 0) {
			if (errno == EINTR)
				continue;
			return errno == EAGAIN || errno == EWOULDBLOCK ? 1 : -1;
		}
		o->off += (size_t)w;
	}
	o->off = o->len = 0;
	return 0;
}

#endif
