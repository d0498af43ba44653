/*
 * stream_common.h: what the streaming benchmark's server (sse_server.c) and client
 * (stream_bench.c) share: the clock, the stamp each delta carries, and allocation.
 *
 * The stamp is '~' and STAMP_LETTERS letters 'a' to 'p', the low 48 bits of the monotonic
 * clock in nanoseconds at the server's write(), four bits a letter, most significant first.
 * No digits: the shipped reply rules (a card number's) would mask or hold back a stamp that
 * had them. Server and client are on one machine, so one clock.
 */
#ifndef CG_BENCH_STREAM_COMMON_H
#define CG_BENCH_STREAM_COMMON_H

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

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

#endif
