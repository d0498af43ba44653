/*
 * stream_bench: the streaming clients of tests/bench/stream.sh (issue 39).
 *
 * N connections from one thread (epoll, raw sockets, its own process), each keeping one
 * reply in flight (closed loop: the next request goes out when the reply has ended), in one
 * of two modes:
 *
 *   --mode chatgate  WebSocket to chatgate (ws://HOST:PORT/ws, chatgate.v1): after the hello,
 *                    {"type":"message","id","room","text"}; the reply is the delta frames
 *                    up to done (or error, cancelled); ack and warning frames are skipped
 *   --mode sse       HTTP/1.1 keep-alive to an OpenAI-compatible server or a proxy in front
 *                    of one (nginx): POST /v1/chat/completions with "stream": true, the
 *                    chunked text/event-stream read to its end
 *
 * The deltas come from tests/bench/sse_server, whose every delta text carries a stamp: "~"
 * and 12 letters a..p, the low 48 bits of CLOCK_MONOTONIC (ns) at the server's write(). The
 * client finds the stamps in the bytes it reads (an SSE event, or a delta frame, which may
 * hold several deltas merged) and takes, for each, the time of the read() that brought it:
 * the one-way delay, server write() to client read(), on one machine's clock. Through a
 * proxy that delay is what the proxy adds over the kernel's loopback and the two ends'
 * scheduling (stream.sh runs the client straight to the server too, for that floor). The gap
 * is the time between the arrivals of two consecutive deltas of one reply.
 *
 * Timeline: connect (every connection up: chatgate's hello seen, or the TCP connection made;
 * or the connect timeout) -> warmup -> measured window of --duration seconds -> stop (chatgate:
 * a close frame with 1000, so that the gateway stops the reply at once instead of keeping it
 * for a resume; sse: the socket is closed). Only deltas read inside the window count:
 * deltas/s is their number over the window's real length. --pid and --server-pid give the
 * processes whose CPU time (user + system, /proc/PID/stat, a master's children included) is
 * taken at both ends of the window, to be divided by the deltas.
 *
 * Bounded: delays and gaps go into log-linear histograms (1/256 relative precision), a frame
 * is reassembled up to MAX_FRAME bytes.
 *
 * Output: a summary on stderr and one line on stdout:
 *   RESULT mode=... streams=... window_s=... deltas=... deltas_per_sec=... frames=... turns=...
 *   errors=... delay_p50_ms=... delay_p90_ms=... delay_p99_ms=... delay_p999_ms=...
 *   delay_max_ms=... gap_p50_ms=... gap_p99_ms=... proxy_cpu_s=... server_cpu_s=...
 *   client_cpu_s=... proxy_us_per_delta=... server_us_per_delta=... client_us_per_delta=...
 *   client_cpu_pct=... machine_idle_pct=... bad_stamps=...
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <getopt.h>
#include <inttypes.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <signal.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/epoll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "stream_common.h"

#define NS_PER_MS 1000000.0
#define MAX_FRAME (4u * 1024u * 1024u)
#define MAX_HEAD (64u * 1024u)
#define MAX_CONNECTING 256 /* connection attempts at once (the peer's listen backlog) */
#define MAX_EVENTS 512
#define STOP_GRACE_NS (2 * NS_PER_S)
#define MAX_LOGGED 10

/* ---- histograms: values below 2 * SUB one bucket each, then SUB buckets a power of two ---- */

#define HIST_SUB_BITS 8
#define HIST_SUB (1u << HIST_SUB_BITS)
#define HIST_MAX_SHIFT 40
#define HIST_BUCKETS (2u * HIST_SUB + HIST_MAX_SHIFT * HIST_SUB)

struct hist {
	uint64_t counts[HIST_BUCKETS];
	uint64_t total, min, max;
};

static size_t hist_index(uint64_t v)
{
	if (v < 2u * HIST_SUB)
		return (size_t)v;
	unsigned int shift = 63u - (unsigned int)__builtin_clzll(v) - HIST_SUB_BITS;

	if (shift > HIST_MAX_SHIFT)
		return HIST_BUCKETS - 1;
	return 2u * HIST_SUB + (shift - 1u) * HIST_SUB + (size_t)((v >> shift) - HIST_SUB);
}

static uint64_t hist_value(size_t i)
{
	if (i < 2u * HIST_SUB)
		return i;
	size_t k = i - 2u * HIST_SUB;
	unsigned int shift = (unsigned int)(k / HIST_SUB) + 1u;

	return ((uint64_t)(k % HIST_SUB + HIST_SUB) << shift) + ((UINT64_C(1) << shift) - 1u) / 2u;
}

static void hist_add(struct hist *h, uint64_t v)
{
	h->counts[hist_index(v)]++;
	if (!h->total || v < h->min)
		h->min = v;
	if (v > h->max)
		h->max = v;
	h->total++;
}

/* The value at quantile q, clamped to what was seen; 0 when empty. */
static uint64_t hist_q(const struct hist *h, double q)
{
	uint64_t rank, seen = 0;

	if (!h->total)
		return 0;
	rank = (uint64_t)(q * (double)h->total + 0.999999);
	if (rank < 1)
		rank = 1;
	for (size_t i = 0; i < HIST_BUCKETS; i++) {
		seen += h->counts[i];
		if (seen >= rank) {
			uint64_t v = hist_value(i);

			return v < h->min ? h->min : v > h->max ? h->max : v;
		}
	}
	return h->max;
}

/* ---- state ---- */

enum mode { MODE_CHATGATE, MODE_SSE };
enum phase { PH_CONNECT, PH_WARMUP, PH_MEASURE, PH_STOP, PH_DONE };
enum conn_state { C_IDLE, C_CONNECTING, C_HANDSHAKE, C_OPEN, C_CLOSING, C_GONE };
enum http_state { H_HEAD, H_SIZE, H_DATA, H_DATA_END, H_TRAILER };

struct conn {
	int fd;
	unsigned int index;
	enum conn_state state;
	bool ready;     /* chatgate: hello seen; sse: connected */
	bool in_flight; /* a message or request is waiting for its reply's end */
	bool epollout;
	uint64_t seq;
	int64_t last_delta_ns; /* the arrival of the reply's last delta, 0 before its first */
	/* bytes read and not yet used: the WebSocket stream, or an HTTP response's head */
	char *in;
	size_t in_off, in_len, in_cap;
	/* chatgate: a fragmented message */
	char *msg;
	size_t msg_len, msg_cap;
	bool msg_active, msg_dropped;
	/* sse: the chunked body */
	enum http_state http;
	size_t chunk_left;
	unsigned int size_digits;
	unsigned int line_len; /* trailer: bytes of the current line, \r not counted */
	/* the stamp being read */
	unsigned int stamp_pos;
	uint64_t stamp_val;
	struct bench_out out; /* bytes the socket did not take yet */
};

static struct {
	enum mode mode;
	char host[64];
	int port;
	char path[512];
	unsigned int streams;
	double duration_s, warmup_s, connect_timeout_s;
	const char *text;
	long pid, server_pid;
	bool verbose;
} opt = { MODE_CHATGATE, "127.0.0.1", 0, "/ws", 20, 10, 1, 30, "Tell me a story", 0, 0, false };

static struct {
	enum phase phase;
	int epfd;
	struct conn *conns;
	struct sockaddr_in addr;
	unsigned int next_to_open, connecting, established, ready, failed, open_now, closed_early;
	int64_t start_ns, phase_deadline_ns, measure_start_ns, measure_end_ns;
	char *request; /* sse: the POST, whole */
	size_t request_len;
	char *text_json;
	/* the window's counts */
	uint64_t deltas, frames, turns, errors, bad_stamps, deltas_outside;
	struct hist *delay, *gap;
	double cpu0[3], cpu1[3]; /* proxy, server, client */
	unsigned long long idle0, total0, idle1, total1;
	uint64_t error_logged;
} B;

static volatile sig_atomic_t signal_seen;

static void on_signal(int sig)
{
	(void)sig;
	signal_seen = 1;
}

static void *xrealloc(void *p, size_t n)
{
	return bench_realloc("stream_bench", p, n);
}

/* ---- CPU time from /proc ---- */

static long long stat_ticks(long pid)
{
	char path[64], buf[1024];
	unsigned long long ut, st;
	const char *p;
	size_t n;
	FILE *f;

	snprintf(path, sizeof(path), "/proc/%ld/stat", pid);
	if (!(f = fopen(path, "r")))
		return -1;
	n = fread(buf, 1, sizeof(buf) - 1, f);
	fclose(f);
	buf[n] = '\0';
	p = strrchr(buf, ')'); /* fields 14 and 15 follow comm's ")" */
	if (!p || sscanf(p + 1, " %*c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %llu %llu", &ut, &st) != 2)
		return -1;
	return (long long)(ut + st);
}

/* User + system seconds of pid and its children (a master's workers); -1 if unknown. */
static double process_cpu_s(long pid)
{
	char path[80];
	long long ticks, t;
	long kid;
	FILE *f;

	if (pid <= 0 || (ticks = stat_ticks(pid)) < 0)
		return -1;
	snprintf(path, sizeof(path), "/proc/%ld/task/%ld/children", pid, pid);
	if ((f = fopen(path, "r"))) {
		while (fscanf(f, "%ld", &kid) == 1)
			if ((t = stat_ticks(kid)) >= 0)
				ticks += t;
		fclose(f);
	}
	return (double)ticks / (double)sysconf(_SC_CLK_TCK);
}

static double own_cpu_s(void)
{
	struct rusage ru;

	getrusage(RUSAGE_SELF, &ru);
	return (double)ru.ru_utime.tv_sec + (double)ru.ru_utime.tv_usec / 1e6 + (double)ru.ru_stime.tv_sec +
	       (double)ru.ru_stime.tv_usec / 1e6;
}

static void machine_ticks(unsigned long long *idle, unsigned long long *total)
{
	unsigned long long v[8] = { 0 };
	FILE *f = fopen("/proc/stat", "r");

	*idle = *total = 0;
	if (!f)
		return;
	if (fscanf(f, "cpu %llu %llu %llu %llu %llu %llu %llu %llu", &v[0], &v[1], &v[2], &v[3], &v[4], &v[5],
		   &v[6], &v[7]) == 8) {
		*idle = v[3] + v[4];
		for (int i = 0; i < 8; i++)
			*total += v[i];
	}
	fclose(f);
}

static void take_cpu(double *cpu, unsigned long long *idle, unsigned long long *total)
{
	cpu[0] = process_cpu_s(opt.pid);
	cpu[1] = process_cpu_s(opt.server_pid);
	cpu[2] = own_cpu_s();
	machine_ticks(idle, total);
}

/* ---- output ---- */

static void set_epollout(struct conn *c, bool on)
{
	struct epoll_event ev = { .events = EPOLLIN | (on ? EPOLLOUT : 0u), .data.ptr = c };

	if (c->epollout == on)
		return;
	c->epollout = on;
	epoll_ctl(B.epfd, EPOLL_CTL_MOD, c->fd, &ev);
}

/* One write() of buf after what waits; the rest waits for EPOLLOUT. -1: the connection is gone. */
static int conn_write(struct conn *c, const void *buf, size_t len)
{
	int rc = bench_out_write(&c->out, c->fd, buf, len, "stream_bench");

	if (rc > 0)
		set_epollout(c, true);
	return rc < 0 ? -1 : 0;
}

static int conn_flush(struct conn *c)
{
	int rc = bench_out_flush(&c->out, c->fd);

	if (rc == 0)
		set_epollout(c, false);
	return rc < 0 ? -1 : 0;
}

/* A client WebSocket frame (masked), FIN set. */
static int ws_send(struct conn *c, unsigned int opcode, const char *payload, size_t len)
{
	static uint32_t rnd = 0x9e3779b9u;
	unsigned char frame[16 + 4096];
	size_t h = 0;

	if (len > 4096)
		return -1;
	frame[h++] = (unsigned char)(0x80u | opcode);
	if (len < 126) {
		frame[h++] = (unsigned char)(0x80u | len);
	} else {
		frame[h++] = 0x80u | 126u;
		frame[h++] = (unsigned char)(len >> 8);
		frame[h++] = (unsigned char)len;
	}
	rnd ^= rnd << 13;
	rnd ^= rnd >> 17;
	rnd ^= rnd << 5;
	memcpy(frame + h, &rnd, 4);
	for (size_t i = 0; i < len; i++)
		frame[h + 4 + i] = (unsigned char)payload[i] ^ frame[h + (i & 3u)];
	return conn_write(c, frame, h + 4 + len);
}

/* ---- the requests ---- */

static int send_next(struct conn *c)
{
	c->last_delta_ns = 0;
	c->stamp_pos = 0;
	c->in_flight = true;
	c->seq++;
	if (opt.mode == MODE_SSE) {
		c->http = H_HEAD;
		c->in_off = c->in_len = 0;
		return conn_write(c, B.request, B.request_len);
	}
	char buf[4096];
	int n = snprintf(buf, sizeof(buf), "{\"type\":\"message\",\"id\":\"m%u-%" PRIu64 "\",\"room\":\"bench\",\"text\":%s}",
			 c->index, c->seq, B.text_json);

	if (n < 0 || (size_t)n >= sizeof(buf))
		return -1;
	return ws_send(c, 1, buf, (size_t)n);
}

static void reply_ended(struct conn *c, bool ok)
{
	c->in_flight = false;
	if (B.phase == PH_MEASURE) {
		if (ok)
			B.turns++;
		else
			B.errors++;
	}
}

/* ---- the deltas ---- */

static void stamp_seen(struct conn *c, uint64_t stamp, int64_t arrived)
{
	uint64_t delay = ((uint64_t)arrived - stamp) & STAMP_MASK;

	if (B.phase != PH_MEASURE) {
		B.deltas_outside++;
	} else if (delay > STAMP_MASK / 2) { /* before it was sent: not a stamp of ours */
		B.bad_stamps++;
	} else {
		B.deltas++;
		hist_add(B.delay, delay);
		if (c->last_delta_ns)
			hist_add(B.gap, (uint64_t)(arrived - c->last_delta_ns));
	}
	c->last_delta_ns = arrived;
}

/* Finds the stamps in text; a stamp may continue in the next call (sse). */
static void scan_stamps(struct conn *c, const char *p, size_t len, int64_t arrived)
{
	const char *end = p + len;

	while (p < end) {
		if (!c->stamp_pos) {
			const char *t = memchr(p, '~', (size_t)(end - p));

			if (!t)
				return;
			p = t + 1;
			c->stamp_pos = 1;
			c->stamp_val = 0;
			continue;
		}
		unsigned char ch = (unsigned char)*p;

		if (ch >= 'a' && ch <= 'p') {
			c->stamp_val = c->stamp_val << 4 | (uint64_t)(ch - 'a');
			p++;
			if (++c->stamp_pos == STAMP_LETTERS + 1) {
				stamp_seen(c, c->stamp_val, arrived);
				c->stamp_pos = 0;
			}
		} else {
			c->stamp_pos = 0; /* not a stamp; look again from this byte */
		}
	}
}

static void log_problem(const char *fmt, unsigned int index, const char *detail)
{
	if (B.error_logged++ < MAX_LOGGED)
		fprintf(stderr, fmt, index, detail);
}

/* chatgate: one whole text message. Returns -1 to close the connection. */
static int on_message(struct conn *c, const char *m, size_t len, int64_t arrived)
{
	static const char delta[] = "{\"type\":\"delta\",";
	static const char type_key[] = "{\"type\":\"";
	const char *type;
	size_t tlen;

	if (len > sizeof(delta) && !memcmp(m, delta, sizeof(delta) - 1)) {
		if (B.phase == PH_MEASURE)
			B.frames++;
		c->stamp_pos = 0;
		scan_stamps(c, m + sizeof(delta) - 1, len - (sizeof(delta) - 1), arrived);
		return 0;
	}
	if (len < sizeof(type_key) || memcmp(m, type_key, sizeof(type_key) - 1)) {
		log_problem("stream_bench: connection %u: a frame not of the form {\"type\":...: %.80s\n", c->index, m);
		return 0;
	}
	type = m + sizeof(type_key) - 1;
	tlen = strcspn(type, "\"");
	if (tlen == 5 && !memcmp(type, "hello", 5)) {
		if (!c->ready) {
			c->ready = true;
			B.ready++;
		}
		if (B.phase < PH_STOP && !c->in_flight)
			return send_next(c);
	} else if ((tlen == 4 && !memcmp(type, "done", 4)) || (tlen == 5 && !memcmp(type, "error", 5)) ||
		   (tlen == 9 && !memcmp(type, "cancelled", 9))) {
		bool ok = tlen == 4;

		if (!ok)
			log_problem("stream_bench: connection %u: %.200s\n", c->index, m);
		if (c->in_flight) {
			reply_ended(c, ok);
			if (B.phase < PH_STOP)
				return send_next(c);
		}
	}
	/* ack, warning, anything else: nothing to do */
	return 0;
}

/* chatgate: the WebSocket frames in c->in. Returns -1 to close. */
static int ws_read(struct conn *c, int64_t arrived)
{
	while (c->in_len - c->in_off >= 2) {
		unsigned char *f = (unsigned char *)c->in + c->in_off;
		size_t avail = c->in_len - c->in_off, h = 2;
		unsigned int opcode = f[0] & 0x0fu;
		bool fin = f[0] & 0x80u, masked = f[1] & 0x80u;
		uint64_t plen = f[1] & 0x7fu;

		if (plen == 126) {
			if (avail < 4)
				return 0;
			plen = (uint64_t)f[2] << 8 | f[3];
			h = 4;
		} else if (plen == 127) {
			if (avail < 10)
				return 0;
			plen = 0;
			for (int i = 0; i < 8; i++)
				plen = plen << 8 | f[2 + i];
			h = 10;
		}
		if (masked)
			h += 4;
		if (plen > MAX_FRAME) {
			log_problem("stream_bench: connection %u: %s\n", c->index, "a frame over 4 MiB");
			return -1;
		}
		if (avail < h + plen)
			return 0;
		char *p = (char *)f + h;

		if (masked)
			for (uint64_t i = 0; i < plen; i++)
				p[i] ^= (char)f[h - 4 + (i & 3u)];
		c->in_off += h + (size_t)plen;
		if (opcode == 0x8) { /* close */
			if (c->state == C_OPEN) {
				B.closed_early++;
				log_problem("stream_bench: connection %u: %s\n", c->index, "closed by the peer");
			}
			return -1;
		}
		if (opcode == 0x9) { /* ping */
			if (ws_send(c, 0xA, p, (size_t)plen) < 0)
				return -1;
			continue;
		}
		if (opcode == 0xA)
			continue;
		if (opcode == 0x1 || opcode == 0x2) {
			if (fin) {
				if (opcode == 0x1 && on_message(c, p, (size_t)plen, arrived) < 0)
					return -1;
				continue;
			}
			c->msg_active = true;
			c->msg_dropped = opcode != 0x1;
			c->msg_len = 0;
		} else if (opcode != 0x0 || !c->msg_active) {
			continue; /* an unknown opcode, or a continuation of nothing */
		}
		if (!c->msg_dropped) {
			if (c->msg_len + plen > MAX_FRAME) {
				c->msg_dropped = true;
			} else {
				if (c->msg_len + plen > c->msg_cap) {
					c->msg_cap = 2 * (c->msg_len + (size_t)plen);
					c->msg = xrealloc(c->msg, c->msg_cap);
				}
				memcpy(c->msg + c->msg_len, p, (size_t)plen);
				c->msg_len += (size_t)plen;
			}
		}
		if (fin) {
			c->msg_active = false;
			if (!c->msg_dropped && on_message(c, c->msg, c->msg_len, arrived) < 0)
				return -1;
		}
	}
	return 0;
}

/* sse: the body bytes p..p+len of a chunked response. Returns -1 to close. */
static int sse_body(struct conn *c, const char *p, size_t len, int64_t arrived)
{
	const char *end = p + len;

	while (p < end) {
		switch (c->http) {
		case H_SIZE: {
			char ch = *p++;

			if (ch == '\n') {
				if (!c->size_digits)
					return -1;
				c->http = c->chunk_left ? H_DATA : H_TRAILER;
				c->line_len = 0;
			} else if (c->size_digits >= 0x100) {
				/* an extension, skipped to the line's end */
			} else if ((ch >= '0' && ch <= '9') || (ch >= 'a' && ch <= 'f') || (ch >= 'A' && ch <= 'F')) {
				if (c->size_digits >= 15)
					return -1;
				c->chunk_left = c->chunk_left * 16 +
						(size_t)(ch <= '9' ? ch - '0' : (ch | 0x20) - 'a' + 10);
				c->size_digits++;
			} else if (ch == ';') {
				c->size_digits |= 0x100;
			} else if (ch != '\r') {
				return -1;
			}
			break;
		}
		case H_DATA: {
			size_t n = (size_t)(end - p) < c->chunk_left ? (size_t)(end - p) : c->chunk_left;

			scan_stamps(c, p, n, arrived);
			p += n;
			c->chunk_left -= n;
			if (!c->chunk_left)
				c->http = H_DATA_END;
			break;
		}
		case H_DATA_END: /* the \r\n after a chunk's data */
			if (*p++ == '\n') {
				c->http = H_SIZE;
				c->size_digits = 0;
				c->chunk_left = 0;
			}
			break;
		case H_TRAILER:
			if (*p == '\n') {
				if (!c->line_len) { /* the empty line: the response has ended */
					p++;
					reply_ended(c, true);
					if (p != end) {
						log_problem("stream_bench: connection %u: %s\n", c->index,
							    "bytes after the response's end");
						return -1;
					}
					return B.phase < PH_STOP ? send_next(c) : 0;
				}
				c->line_len = 0;
			} else if (*p != '\r') {
				c->line_len++;
			}
			p++;
			break;
		case H_HEAD:
			return -1;
		}
	}
	return 0;
}

/* sse: bytes of the response. Returns -1 to close. */
static int sse_read(struct conn *c, const char *p, size_t len, int64_t arrived)
{
	if (c->http != H_HEAD)
		return sse_body(c, p, len, arrived);
	if (!c->in_flight) {
		log_problem("stream_bench: connection %u: %s\n", c->index, "bytes with no request out");
		return -1;
	}
	/* the head: gathered in c->in */
	if (c->in_len + len + 1 > c->in_cap) {
		c->in_cap = 2 * (c->in_len + len + 1);
		c->in = xrealloc(c->in, c->in_cap);
	}
	memcpy(c->in + c->in_len, p, len);
	c->in_len += len;
	c->in[c->in_len] = '\0';
	char *end = strstr(c->in, "\r\n\r\n");

	if (!end)
		return c->in_len > MAX_HEAD ? -1 : 0;
	*end = '\0';
	if (strncmp(c->in, "HTTP/1.1 200", 12) || !strcasestr(c->in, "\ntransfer-encoding: chunked")) {
		char line[160];

		snprintf(line, sizeof(line), "%.*s", (int)strcspn(c->in, "\r"), c->in);
		log_problem("stream_bench: connection %u: not a 200 chunked response: %s\n", c->index, line);
		reply_ended(c, false);
		return -1;
	}
	size_t head = (size_t)(end - c->in) + 4, rest = c->in_len - head;

	c->http = H_SIZE;
	c->size_digits = 0;
	c->chunk_left = 0;
	c->in_len = 0;
	return rest ? sse_body(c, c->in + head, rest, arrived) : 0;
}

/* ---- connections ---- */

static void conn_gone(struct conn *c)
{
	if (c->state == C_GONE || c->state == C_IDLE)
		return;
	if (c->state == C_CONNECTING)
		B.connecting--;
	if (c->state == C_OPEN || c->state == C_HANDSHAKE || c->state == C_CLOSING)
		B.open_now--;
	if ((c->state == C_OPEN || c->state == C_HANDSHAKE) && B.phase < PH_STOP)
		B.closed_early++;
	c->state = C_GONE;
	close(c->fd);
	free(c->in);
	free(c->msg);
	free(c->out.buf);
	c->in = c->msg = NULL;
	c->in_cap = c->msg_cap = 0;
	c->out = (struct bench_out){0};
}

static void open_more(void)
{
	while (B.phase < PH_STOP && B.next_to_open < opt.streams && B.connecting < MAX_CONNECTING) {
		struct conn *c = &B.conns[B.next_to_open++];
		struct epoll_event ev = { .events = EPOLLOUT, .data.ptr = c };
		int one = 1;

		c->fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
		if (c->fd < 0) {
			log_problem("stream_bench: connection %u: socket: %s\n", c->index, strerror(errno));
			B.failed++;
			continue;
		}
		setsockopt(c->fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
		if (connect(c->fd, (struct sockaddr *)&B.addr, sizeof(B.addr)) < 0 && errno != EINPROGRESS) {
			log_problem("stream_bench: connection %u: connect: %s\n", c->index, strerror(errno));
			close(c->fd);
			B.failed++;
			continue;
		}
		c->state = C_CONNECTING;
		B.connecting++;
		c->epollout = true;
		epoll_ctl(B.epfd, EPOLL_CTL_ADD, c->fd, &ev);
	}
}

static int on_connected(struct conn *c)
{
	int err = 0;
	socklen_t l = sizeof(err);

	getsockopt(c->fd, SOL_SOCKET, SO_ERROR, &err, &l);
	B.connecting--;
	if (err) {
		c->state = C_IDLE; /* not counted as open */
		close(c->fd);
		B.failed++;
		log_problem("stream_bench: connection %u: %s\n", c->index, strerror(err));
		return 0;
	}
	B.established++;
	B.open_now++;
	set_epollout(c, false);
	if (opt.mode == MODE_SSE) {
		c->state = C_OPEN;
		c->ready = true;
		B.ready++;
		return B.phase < PH_STOP ? send_next(c) : -1;
	}
	char req[1024];
	int n = snprintf(req, sizeof(req),
			 "GET %s HTTP/1.1\r\nHost: %s:%d\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
			 "Sec-WebSocket-Key: c3RyZWFtX2JlbmNoIGtleQ==\r\nSec-WebSocket-Version: 13\r\n"
			 "Sec-WebSocket-Protocol: chatgate.v1\r\n\r\n",
			 opt.path, opt.host, opt.port);

	c->state = C_HANDSHAKE;
	return conn_write(c, req, (size_t)n);
}

static char rbuf[256 * 1024];

static int on_readable(struct conn *c)
{
	for (;;) {
		ssize_t n;
		int64_t arrived;

		if (opt.mode == MODE_SSE) {
			n = read(c->fd, rbuf, sizeof(rbuf));
		} else {
			if (c->in_off == c->in_len) {
				c->in_off = c->in_len = 0;
			} else if (c->in_cap - c->in_len < 16384 && c->in_off) {
				memmove(c->in, c->in + c->in_off, c->in_len - c->in_off);
				c->in_len -= c->in_off;
				c->in_off = 0;
			}
			if (c->in_cap - c->in_len < 16384) {
				c->in_cap = c->in_cap ? 2 * c->in_cap : 65536;
				if (c->in_cap > 2 * MAX_FRAME + 65536)
					return -1;
				c->in = xrealloc(c->in, c->in_cap + 1);
			}
			n = read(c->fd, c->in + c->in_len, c->in_cap - c->in_len);
		}
		if (n == 0) {
			if (c->state == C_OPEN && B.phase < PH_STOP)
				log_problem("stream_bench: connection %u: %s\n", c->index, "closed by the peer");
			return -1;
		}
		if (n < 0) {
			if (errno == EINTR)
				continue;
			return errno == EAGAIN || errno == EWOULDBLOCK ? 0 : -1;
		}
		arrived = now_ns();
		if (c->state == C_CLOSING && opt.mode == MODE_SSE)
			continue;
		if (opt.mode == MODE_SSE) {
			if (sse_read(c, rbuf, (size_t)n, arrived) < 0)
				return -1;
			continue;
		}
		c->in_len += (size_t)n;
		if (c->state == C_HANDSHAKE) {
			c->in[c->in_len] = '\0';
			char *end = strstr(c->in, "\r\n\r\n");

			if (!end) {
				if (c->in_len > MAX_HEAD)
					return -1;
				continue;
			}
			if (strncmp(c->in, "HTTP/1.1 101", 12)) {
				log_problem("stream_bench: connection %u: the upgrade was refused: %.40s\n", c->index, c->in);
				return -1;
			}
			c->in_off = (size_t)(end - c->in) + 4;
			c->state = C_OPEN;
		}
		if (c->state == C_CLOSING) {
			c->in_off = c->in_len; /* what comes after our close frame is not counted */
			continue;
		}
		if (ws_read(c, arrived) < 0)
			return -1;
	}
}

/* ---- phases ---- */

static void start_stop(void)
{
	int64_t now = now_ns();

	if (B.phase >= PH_STOP)
		return;
	B.measure_end_ns = now;
	take_cpu(B.cpu1, &B.idle1, &B.total1);
	if (B.measure_start_ns == 0) {
		B.measure_start_ns = now;
		memcpy(B.cpu0, B.cpu1, sizeof(B.cpu0));
		B.idle0 = B.idle1;
		B.total0 = B.total1;
	}
	B.phase = PH_STOP;
	B.phase_deadline_ns = now + STOP_GRACE_NS;
	for (unsigned int i = 0; i < B.next_to_open; i++) {
		struct conn *c = &B.conns[i];

		if (c->state == C_CONNECTING || c->state == C_HANDSHAKE ||
		    (c->state == C_OPEN && opt.mode == MODE_SSE)) {
			conn_gone(c);
		} else if (c->state == C_OPEN) {
			/* 1000: the client is done, the reply stops (no resume grace) */
			if (ws_send(c, 0x8, "\x03\xe8", 2) < 0)
				conn_gone(c);
			else
				c->state = C_CLOSING;
		}
	}
}

static void advance(int64_t now)
{
	if (signal_seen && B.phase < PH_STOP) {
		fprintf(stderr, "stream_bench: interrupted\n");
		start_stop();
	}
	if (B.phase == PH_CONNECT) {
		bool all = B.ready + B.failed + B.closed_early >= opt.streams;

		if (!all && now < B.phase_deadline_ns)
			return;
		if (!B.ready) {
			fprintf(stderr, "stream_bench: no connection came up (%u failed)\n", B.failed);
			start_stop();
			return;
		}
		if (!all)
			fprintf(stderr, "stream_bench: connect timeout: going on with %u of %u\n", B.ready, opt.streams);
		B.phase = PH_WARMUP;
		B.phase_deadline_ns = now + (int64_t)(opt.warmup_s * (double)NS_PER_S);
	}
	if (B.phase == PH_WARMUP && now >= B.phase_deadline_ns) {
		B.phase = PH_MEASURE;
		B.measure_start_ns = now_ns();
		take_cpu(B.cpu0, &B.idle0, &B.total0);
		B.phase_deadline_ns = B.measure_start_ns + (int64_t)(opt.duration_s * (double)NS_PER_S);
	}
	if (B.phase == PH_MEASURE && now >= B.phase_deadline_ns)
		start_stop();
	if (B.phase == PH_STOP && (!B.open_now || now >= B.phase_deadline_ns))
		B.phase = PH_DONE;
}

/* ---- setup and report ---- */

/* ws://HOST:PORT/PATH or http://HOST:PORT/PATH, HOST an IPv4 address. */
static int parse_url(const char *url)
{
	const char *p, *colon, *slash;
	size_t hl;

	if (!strncmp(url, "ws://", 5)) {
		opt.mode = MODE_CHATGATE;
		p = url + 5;
	} else if (!strncmp(url, "http://", 7)) {
		opt.mode = MODE_SSE;
		p = url + 7;
	} else {
		return -1;
	}
	slash = p + strcspn(p, "/");
	colon = memchr(p, ':', (size_t)(slash - p));
	hl = (size_t)((colon ? colon : slash) - p);
	if (!hl || hl >= sizeof(opt.host))
		return -1;
	memcpy(opt.host, p, hl);
	opt.host[hl] = '\0';
	opt.port = colon ? atoi(colon + 1) : 80;
	snprintf(opt.path, sizeof(opt.path), "%s", *slash ? slash : "/");
	return opt.port > 0 && opt.port < 65536 ? 0 : -1;
}

static char *json_string(const char *s)
{
	size_t n = strlen(s), o = 0;
	char *out = xrealloc(NULL, 6 * n + 3);

	out[o++] = '"';
	for (; *s; s++) {
		unsigned char ch = (unsigned char)*s;

		if (ch == '"' || ch == '\\') {
			out[o++] = '\\';
			out[o++] = (char)ch;
		} else if (ch < 0x20) {
			o += (size_t)sprintf(out + o, "\\u%04x", ch);
		} else {
			out[o++] = (char)ch;
		}
	}
	out[o++] = '"';
	out[o] = '\0';
	return out;
}

static double ms(uint64_t ns)
{
	return (double)ns / NS_PER_MS;
}

static void usage(FILE *f)
{
	fprintf(f,
		"usage: stream_bench --url URL [--streams N] [--duration S] [--warmup S] [--pid PID]\n"
		"                    [--server-pid PID] [--text TEXT] [--connect-timeout S] [--verbose]\n"
		"  URL ws://HOST:PORT/ws: chatgate.v1 (chatgate in front of tests/bench/sse_server)\n"
		"      http://HOST:PORT/v1/chat/completions: SSE (sse_server itself, or nginx in front)\n"
		"  N streams (default 20), each one reply in flight; the deltas' stamps give the\n"
		"  delay from the server's write() to this client's read(). --pid: the proxy, whose CPU\n"
		"  over the window is divided by the deltas; --server-pid: sse_server, the same.\n");
}

int main(int argc, char **argv)
{
	static const struct option longopts[] = {
		{ "url", required_argument, NULL, 'u' },
		{ "streams", required_argument, NULL, 'n' },
		{ "duration", required_argument, NULL, 'd' },
		{ "warmup", required_argument, NULL, 'w' },
		{ "pid", required_argument, NULL, 'p' },
		{ "server-pid", required_argument, NULL, 's' },
		{ "text", required_argument, NULL, 't' },
		{ "connect-timeout", required_argument, NULL, 'c' },
		{ "verbose", no_argument, NULL, 'v' },
		{ "help", no_argument, NULL, 'h' },
		{ NULL, 0, NULL, 0 },
	};
	const char *url = NULL;
	struct epoll_event events[MAX_EVENTS];
	struct rlimit rl;
	int ch;

	while ((ch = getopt_long(argc, argv, "", longopts, NULL)) != -1) {
		switch (ch) {
		case 'u': url = optarg; break;
		case 'n': opt.streams = (unsigned int)strtoul(optarg, NULL, 10); break;
		case 'd': opt.duration_s = strtod(optarg, NULL); break;
		case 'w': opt.warmup_s = strtod(optarg, NULL); break;
		case 'p': opt.pid = strtol(optarg, NULL, 10); break;
		case 's': opt.server_pid = strtol(optarg, NULL, 10); break;
		case 't': opt.text = optarg; break;
		case 'c': opt.connect_timeout_s = strtod(optarg, NULL); break;
		case 'v': opt.verbose = true; break;
		case 'h': usage(stdout); return 0;
		default: usage(stderr); return 2;
		}
	}
	if (!url || parse_url(url) < 0 || !opt.streams || opt.streams > 1000000 || opt.duration_s <= 0 ||
	    opt.warmup_s < 0 || strlen(opt.text) > 1000) {
		usage(stderr);
		return 2;
	}
	B.addr.sin_family = AF_INET;
	B.addr.sin_port = htons((uint16_t)opt.port);
	if (inet_pton(AF_INET, opt.host, &B.addr.sin_addr) != 1) {
		fprintf(stderr, "stream_bench: the host must be an IPv4 address: %s\n", opt.host);
		return 2;
	}
	B.text_json = json_string(opt.text);
	if (opt.mode == MODE_SSE) {
		char body[2048];
		int bl = snprintf(body, sizeof(body),
				  "{\"model\":\"m\",\"stream\":true,\"stream_options\":{\"include_usage\":true},"
				  "\"messages\":[{\"role\":\"user\",\"content\":%s}]}",
				  B.text_json);

		B.request = xrealloc(NULL, 4096);
		B.request_len = (size_t)snprintf(B.request, 4096,
						 "POST %s HTTP/1.1\r\nHost: %s:%d\r\nContent-Type: application/json\r\n"
						 "Accept: text/event-stream\r\nContent-Length: %d\r\n\r\n%s",
						 opt.path, opt.host, opt.port, bl, body);
	}
	if (!getrlimit(RLIMIT_NOFILE, &rl)) {
		rl.rlim_cur = rl.rlim_max;
		setrlimit(RLIMIT_NOFILE, &rl);
	}
	signal(SIGPIPE, SIG_IGN);
	signal(SIGINT, on_signal);
	signal(SIGTERM, on_signal);
	B.conns = calloc(opt.streams, sizeof(*B.conns));
	B.delay = calloc(1, sizeof(*B.delay));
	B.gap = calloc(1, sizeof(*B.gap));
	B.epfd = epoll_create1(EPOLL_CLOEXEC);
	if (!B.conns || !B.delay || !B.gap || B.epfd < 0) {
		fprintf(stderr, "stream_bench: out of memory\n");
		return 1;
	}
	for (unsigned int i = 0; i < opt.streams; i++)
		B.conns[i].index = i;
	B.start_ns = now_ns();
	B.phase = PH_CONNECT;
	B.phase_deadline_ns = B.start_ns + (int64_t)(opt.connect_timeout_s * (double)NS_PER_S);
	open_more();

	while (B.phase != PH_DONE) {
		int64_t now = now_ns();
		int64_t wait_ns = B.phase_deadline_ns - now;
		int timeout = wait_ns <= 0 ? 0 : wait_ns > 100 * 1000000LL ? 100 : (int)((wait_ns + 999999) / 1000000);
		int n = epoll_wait(B.epfd, events, MAX_EVENTS, timeout);

		if (n < 0 && errno != EINTR) {
			perror("stream_bench: epoll_wait");
			return 1;
		}
		for (int i = 0; i < n; i++) {
			struct conn *c = events[i].data.ptr;
			int rc = 0;

			if (c->state == C_GONE || c->state == C_IDLE)
				continue;
			if (c->state == C_CONNECTING) {
				rc = on_connected(c);
				open_more();
			} else {
				if ((events[i].events & EPOLLOUT) && conn_flush(c) < 0)
					rc = -1;
				if (!rc && (events[i].events & (EPOLLIN | EPOLLHUP | EPOLLERR)))
					rc = on_readable(c);
			}
			if (rc < 0)
				conn_gone(c);
		}
		advance(now_ns());
		if (B.phase == PH_MEASURE && !B.open_now) {
			fprintf(stderr, "stream_bench: every connection is gone\n");
			start_stop();
		}
	}
	for (unsigned int i = 0; i < B.next_to_open; i++)
		conn_gone(&B.conns[i]);

	double window = (double)(B.measure_end_ns - B.measure_start_ns) / NS_PER_S;
	double cpu[3];
	double per_delta[3];
	double idle = B.total1 > B.total0 ? 100.0 * (double)(B.idle1 - B.idle0) / (double)(B.total1 - B.total0) : -1;

	for (int i = 0; i < 3; i++) {
		cpu[i] = B.cpu0[i] >= 0 && B.cpu1[i] >= 0 ? B.cpu1[i] - B.cpu0[i] : -1;
		per_delta[i] = cpu[i] >= 0 && B.deltas ? cpu[i] * 1e6 / (double)B.deltas : -1;
	}
	fprintf(stderr,
		"stream_bench: %s %u streams, %.2f s window: %" PRIu64 " deltas (%.0f/s) in %" PRIu64
		" frames, %" PRIu64 " replies, %" PRIu64 " errors; delay p50 %.3f ms p99 %.3f ms max %.3f ms;"
		" gap p50 %.3f ms p99 %.3f ms\n",
		opt.mode == MODE_SSE ? "sse" : "chatgate", opt.streams, window, B.deltas,
		window > 0 ? (double)B.deltas / window : 0, B.frames, B.turns, B.errors, ms(hist_q(B.delay, 0.5)),
		ms(hist_q(B.delay, 0.99)), ms(B.delay->max), ms(hist_q(B.gap, 0.5)), ms(hist_q(B.gap, 0.99)));
	printf("RESULT mode=%s streams=%u ready=%u window_s=%.3f deltas=%" PRIu64 " deltas_per_sec=%.1f frames=%" PRIu64
	       " turns=%" PRIu64 " errors=%" PRIu64 " closed_early=%u delay_p50_ms=%.4f delay_p90_ms=%.4f"
	       " delay_p99_ms=%.4f delay_p999_ms=%.4f delay_max_ms=%.4f gap_p50_ms=%.4f gap_p99_ms=%.4f"
	       " proxy_cpu_s=%.3f server_cpu_s=%.3f client_cpu_s=%.3f proxy_us_per_delta=%.3f"
	       " server_us_per_delta=%.3f client_us_per_delta=%.3f client_cpu_pct=%.1f machine_idle_pct=%.1f"
	       " bad_stamps=%" PRIu64 "\n",
	       opt.mode == MODE_SSE ? "sse" : "chatgate", opt.streams, B.ready, window, B.deltas,
	       window > 0 ? (double)B.deltas / window : 0, B.frames, B.turns, B.errors, B.closed_early,
	       ms(hist_q(B.delay, 0.5)), ms(hist_q(B.delay, 0.9)), ms(hist_q(B.delay, 0.99)),
	       ms(hist_q(B.delay, 0.999)), ms(B.delay->max), ms(hist_q(B.gap, 0.5)), ms(hist_q(B.gap, 0.99)), cpu[0],
	       cpu[1], cpu[2], per_delta[0], per_delta[1], per_delta[2], window > 0 ? 100.0 * cpu[2] / window : 0,
	       idle, B.bad_stamps);
	return B.deltas ? 0 : 1;
}
