/*
 * sse_server: an OpenAI-compatible streaming server for tests/bench/stream.sh.
 *
 * One thread, epoll, its own process. Every POST /v1/chat/completions (any body; the body is
 * read by its Content-Length and ignored) is answered as a model server answers with
 * "stream": true: HTTP/1.1 200, text/event-stream, chunked transfer encoding, then --deltas
 * chunks of `data: {"choices":[{"delta":{"content":TEXT}}]}` and a last write with the
 * finish chunk, a usage chunk, `data: [DONE]` and the chunked ending. The connection is kept
 * alive for the next request (chatgate's libcurl pool, nginx's upstream keepalive).
 *
 * One write() per delta: delta k of a reply is due at start + k * --interval-ms (a fixed
 * schedule: a late delta does not push the later ones back; start is the request's arrival
 * plus a random part of one interval, so that streams opened together do not stay in step),
 * and with --interval-ms 0 each
 * stream writes its next delta as soon as the socket takes it, the streams taking turns (one
 * delta each per pass over the ready ones), as fast as the readers read.
 *
 * The stamp: each delta's text is TEXT followed by "~" and 12 letters a..p, the low 48 bits
 * of CLOCK_MONOTONIC (ns) at the delta's write(), four bits a letter. A client on the same
 * machine reads the stamps out of whatever carries the text (SSE through nginx, chatgate.v1
 * delta frames, merged or not) and has the one-way delay of every delta: server write() to
 * client read(). The stamp has no digit, so a reply rule on digits (the shipped card number
 * mask) neither masks it nor holds it back as the start of a possible match.
 *
 * A delta that the socket does not take at once waits in the connection's buffer (EPOLLOUT);
 * with an interval the schedule goes on (the next deltas join the buffer, their stamps the
 * time they were queued, so the wait counts in the delay: it is the reader's), with 0 the
 * stream waits for the buffer to drain.
 *
 * GET /stats answers {"streams":N,"requests":N,"deltas":N} (streams replying now, requests
 * and deltas since the start), and closes: stream.sh waits for 0 streams between runs.
 *
 *   sse_server --port PORT [--host ADDR] [--deltas 100] [--interval-ms 10] [--text "w12 "]
 */
#define _GNU_SOURCE /* accept4 */
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
#include <sys/timerfd.h>
#include <time.h>
#include <unistd.h>

#include "stream_common.h"

#define MAX_REQUEST_HEAD (64u * 1024u)
#define MAX_REQUEST_BODY (16u * 1024u * 1024u)
#define MAX_TEXT 256
#define MAX_EVENTS 256
#define NS_PER_MS 1000000LL

enum conn_state {
	ST_HEAD,   /* reading a request's head */
	ST_BODY,   /* reading its body */
	ST_STREAM, /* replying */
};

struct conn {
	int fd;
	enum conn_state state;
	bool close_after; /* Connection: close, or GET /stats */
	bool epollout;    /* EPOLLOUT is asked for */
	char *in;         /* the request head, then whatever follows it */
	size_t in_len, in_cap;
	size_t body_left;
	struct bench_out out; /* what the socket did not take yet */
	unsigned int sent;  /* deltas of this reply written */
	int64_t start_ns;   /* the reply's start (its schedule) */
	int64_t due_ns;     /* the next write's time */
	size_t heap_index;  /* SIZE_MAX: not scheduled */
};

static struct {
	const char *host;
	int port;
	unsigned int deltas;
	int64_t interval_ns;
	char text_json[2 * MAX_TEXT]; /* TEXT, escaped for a JSON string, without the quotes */
} opt = { "127.0.0.1", 0, 100, 10 * NS_PER_MS, "w12 " };

static int epfd, timerfd_;
static struct conn **heap; /* by due_ns: the streams waiting for their next write */
static size_t heap_len, heap_cap;
static uint64_t n_streams, n_requests, n_deltas;
static volatile sig_atomic_t stop_now;

static void on_signal(int sig)
{
	(void)sig;
	stop_now = 1;
}

static void *xrealloc(void *p, size_t n)
{
	return bench_realloc("sse_server", p, n);
}

/* ---- the schedule: a binary min-heap of streams by due time ---- */

static bool heap_less(size_t a, size_t b)
{
	return heap[a]->due_ns < heap[b]->due_ns;
}

static void heap_swap(size_t a, size_t b)
{
	struct conn *t = heap[a];

	heap[a] = heap[b];
	heap[b] = t;
	heap[a]->heap_index = a;
	heap[b]->heap_index = b;
}

static void heap_up(size_t i)
{
	while (i > 0 && heap_less(i, (i - 1) / 2)) {
		heap_swap(i, (i - 1) / 2);
		i = (i - 1) / 2;
	}
}

static void heap_down(size_t i)
{
	for (;;) {
		size_t l = 2 * i + 1, r = l + 1, m = i;

		if (l < heap_len && heap_less(l, m))
			m = l;
		if (r < heap_len && heap_less(r, m))
			m = r;
		if (m == i)
			return;
		heap_swap(i, m);
		i = m;
	}
}

static void heap_push(struct conn *c)
{
	if (heap_len == heap_cap) {
		heap_cap = heap_cap ? 2 * heap_cap : 1024;
		heap = xrealloc(heap, heap_cap * sizeof(*heap));
	}
	heap[heap_len] = c;
	c->heap_index = heap_len++;
	heap_up(c->heap_index);
}

static void heap_remove(struct conn *c)
{
	size_t i = c->heap_index;

	if (i == SIZE_MAX)
		return;
	c->heap_index = SIZE_MAX;
	heap_len--;
	if (i == heap_len)
		return;
	heap[i] = heap[heap_len];
	heap[i]->heap_index = i;
	heap_up(i);
	heap_down(heap[i]->heap_index);
}

/* ---- connections ---- */

static void set_epollout(struct conn *c, bool on)
{
	struct epoll_event ev = { .events = EPOLLIN | (on ? EPOLLOUT : 0u), .data.ptr = c };

	if (c->epollout == on)
		return;
	c->epollout = on;
	epoll_ctl(epfd, EPOLL_CTL_MOD, c->fd, &ev);
}

static void conn_close(struct conn *c)
{
	if (c->state == ST_STREAM)
		n_streams--;
	heap_remove(c);
	close(c->fd);
	free(c->in);
	free(c->out.buf);
	free(c);
}

/*
 * Writes buf (after what still waits) with one write(); keeps what the socket did not take.
 * Returns -1 when the connection is gone.
 */
static int conn_write(struct conn *c, const char *buf, size_t len)
{
	int rc = bench_out_write(&c->out, c->fd, buf, len, "sse_server");

	if (rc > 0)
		set_epollout(c, true);
	return rc < 0 ? -1 : 0;
}

/* Writes what waits; -1 when the connection is gone. */
static int conn_flush(struct conn *c)
{
	int rc = bench_out_flush(&c->out, c->fd);

	if (rc == 0)
		set_epollout(c, false);
	return rc < 0 ? -1 : 0;
}

static bool conn_blocked(const struct conn *c)
{
	return c->out.off < c->out.len;
}

/* One chunk of the chunked encoding around payload, into buf. */
static size_t chunk(char *buf, size_t cap, const char *payload, size_t len)
{
	int h = snprintf(buf, cap, "%zx\r\n", len);

	if (h < 0 || (size_t)h + len + 2 > cap)
		return 0;
	memcpy(buf + h, payload, len);
	memcpy(buf + h + len, "\r\n", 2);
	return (size_t)h + len + 2;
}

/* The next write of the stream: a delta, or the reply's end. Returns -1 when gone. */
static int stream_step(struct conn *c, int64_t now /* the pass's */)
{
	char payload[1024], buf[1200];
	size_t n;
	int len;

	if (c->sent < opt.deltas) {
		char stamp[STAMP_LETTERS + 2];

		stamp_write(stamp, (uint64_t)now_ns());
		len = snprintf(payload, sizeof(payload),
			       "data: {\"id\":\"chatcmpl-bench\",\"object\":\"chat.completion.chunk\","
			       "\"created\":1700000000,\"model\":\"m\",\"choices\":[{\"index\":0,\"delta\":"
			       "{\"content\":\"%s%s\"},\"finish_reason\":null}]}\n\n",
			       opt.text_json, stamp);
		n = chunk(buf, sizeof(buf), payload, (size_t)len);
		c->sent++;
		n_deltas++;
		if (conn_write(c, buf, n) < 0)
			return -1;
		if (opt.interval_ns) {
			c->due_ns = c->start_ns + (int64_t)c->sent * opt.interval_ns;
		} else {
			/* after every stream due in this pass: the ready streams take turns */
			int64_t t = now_ns();

			c->due_ns = t > now ? t : now + 1;
		}
		/* as fast as the socket takes: a stream the socket holds up waits for EPOLLOUT */
		if (!opt.interval_ns && conn_blocked(c))
			return 0;
		heap_push(c);
		return 0;
	}
	/* the end: finish_reason, usage (asked for with stream_options.include_usage), [DONE] */
	len = snprintf(payload, sizeof(payload),
		       "data: {\"id\":\"chatcmpl-bench\",\"object\":\"chat.completion.chunk\","
		       "\"created\":1700000000,\"model\":\"m\",\"choices\":[{\"index\":0,\"delta\":{},"
		       "\"finish_reason\":\"stop\"}]}\n\n"
		       "data: {\"id\":\"chatcmpl-bench\",\"object\":\"chat.completion.chunk\","
		       "\"created\":1700000000,\"model\":\"m\",\"choices\":[],\"usage\":{\"prompt_tokens\":"
		       "10,\"completion_tokens\":%u,\"total_tokens\":%u}}\n\n"
		       "data: [DONE]\n\n",
		       opt.deltas, opt.deltas + 10);
	n = chunk(buf, sizeof(buf) - 5, payload, (size_t)len);
	memcpy(buf + n, "0\r\n\r\n", 5);
	n += 5;
	c->state = ST_HEAD;
	n_streams--;
	if (conn_write(c, buf, n) < 0)
		return -1;
	if (c->close_after && !conn_blocked(c))
		return -1;
	return 0;
}

static int start_reply(struct conn *c)
{
	static const char head[] = "HTTP/1.1 200 OK\r\n"
				   "Content-Type: text/event-stream\r\n"
				   "Cache-Control: no-cache\r\n"
				   "Transfer-Encoding: chunked\r\n\r\n";

	n_requests++;
	n_streams++;
	c->state = ST_STREAM;
	c->sent = 0;
	c->start_ns = c->due_ns = now_ns();
	if (opt.interval_ns) {
		/*
		 * The first delta after a random part of an interval, as a model's first token
		 * comes after its own time: streams started together do not stay in step, their
		 * deltas all due in the same instant (a burst every interval, which no real load
		 * has, and whose queue would be counted as the proxy's delay).
		 */
		static uint32_t rnd = 0x2545f491u;

		rnd ^= rnd << 13;
		rnd ^= rnd >> 17;
		rnd ^= rnd << 5;
		c->start_ns += (int64_t)(rnd % (uint64_t)opt.interval_ns);
		c->due_ns = c->start_ns;
	}
	if (conn_write(c, head, sizeof(head) - 1) < 0)
		return -1;
	if (!opt.interval_ns && conn_blocked(c))
		return 0;
	heap_push(c);
	return 0;
}

static int answer_simple(struct conn *c, const char *status, const char *body)
{
	char buf[512];
	int n = snprintf(buf, sizeof(buf),
			 "HTTP/1.1 %s\r\nContent-Type: application/json\r\nContent-Length: %zu\r\n"
			 "Connection: close\r\n\r\n%s",
			 status, strlen(body), body);

	c->close_after = true;
	if (conn_write(c, buf, (size_t)n) < 0 || !conn_blocked(c))
		return -1;
	return 0;
}

/* A header's value in a request head (lines end in \r\n), or NULL. */
static const char *header_value(const char *head, const char *name, size_t *len)
{
	size_t nl = strlen(name);

	for (const char *p = strstr(head, "\r\n"); p && p[2] != '\r'; p = strstr(p + 2, "\r\n")) {
		const char *line = p + 2;

		if (!strncasecmp(line, name, nl) && line[nl] == ':') {
			const char *v = line + nl + 1, *e;

			while (*v == ' ' || *v == '\t')
				v++;
			e = strstr(v, "\r\n");
			*len = (size_t)(e - v);
			return v;
		}
	}
	return NULL;
}

/* A complete head is in c->in (its end at head_len). Returns -1 to close. */
static int handle_head(struct conn *c, size_t head_len)
{
	char *head = c->in;
	const char *v;
	size_t vlen;
	unsigned long long body = 0;

	head[head_len - 2] = '\0'; /* ends in "\r\n" */
	c->close_after = false;
	if ((v = header_value(head, "Connection", &vlen)) && vlen == 5 && !strncasecmp(v, "close", 5))
		c->close_after = true;
	if (!strncmp(head, "GET /stats ", 11)) {
		char s[160];

		snprintf(s, sizeof(s), "{\"streams\":%" PRIu64 ",\"requests\":%" PRIu64 ",\"deltas\":%" PRIu64 "}\n",
			 n_streams, n_requests, n_deltas);
		return answer_simple(c, "200 OK", s);
	}
	if (strncmp(head, "POST ", 5))
		return answer_simple(c, "405 Method Not Allowed", "{\"error\":{\"message\":\"POST only\"}}\n");
	if ((v = header_value(head, "Transfer-Encoding", &vlen)))
		return answer_simple(c, "411 Length Required", "{\"error\":{\"message\":\"Content-Length only\"}}\n");
	if ((v = header_value(head, "Content-Length", &vlen))) {
		char *end;

		body = strtoull(v, &end, 10);
		if (end == v || body > MAX_REQUEST_BODY)
			return answer_simple(c, "413 Content Too Large", "{\"error\":{\"message\":\"body\"}}\n");
	}
	if ((v = header_value(head, "Expect", &vlen)) && vlen == 12 && !strncasecmp(v, "100-continue", 12))
		if (conn_write(c, "HTTP/1.1 100 Continue\r\n\r\n", 25) < 0)
			return -1;
	/* what follows the head is the body's start */
	memmove(c->in, c->in + head_len, c->in_len - head_len);
	c->in_len -= head_len;
	c->body_left = (size_t)body;
	c->state = ST_BODY;
	return 0;
}

/* Acts on what c->in holds. Returns -1 to close. */
static int process_input(struct conn *c)
{
	for (;;) {
		if (c->state == ST_HEAD) {
			char *end;

			if (c->in_len < 4)
				return 0;
			c->in[c->in_len] = '\0';
			end = strstr(c->in, "\r\n\r\n");
			if (!end)
				return c->in_len > MAX_REQUEST_HEAD ? -1 : 0;
			if (handle_head(c, (size_t)(end - c->in) + 4) < 0)
				return -1;
			if (c->close_after && c->state == ST_HEAD)
				return 0; /* answered, closing once written */
		} else if (c->state == ST_BODY) {
			size_t take = c->body_left < c->in_len ? c->body_left : c->in_len;

			memmove(c->in, c->in + take, c->in_len - take);
			c->in_len -= take;
			c->body_left -= take;
			if (c->body_left)
				return 0;
			if (start_reply(c) < 0)
				return -1;
		} else {
			return 0; /* a pipelined request waits for the reply's end */
		}
	}
}

static int on_readable(struct conn *c)
{
	for (;;) {
		ssize_t n;

		if (c->in_cap - c->in_len < 16384) {
			c->in_cap = c->in_cap ? 2 * c->in_cap : 32768;
			c->in = xrealloc(c->in, c->in_cap + 1);
		}
		n = read(c->fd, c->in + c->in_len, c->in_cap - c->in_len);
		if (n == 0)
			return -1;
		if (n < 0) {
			if (errno == EINTR)
				continue;
			if (errno == EAGAIN || errno == EWOULDBLOCK)
				break;
			return -1;
		}
		c->in_len += (size_t)n;
		if (c->state == ST_BODY || c->state == ST_HEAD)
			if (process_input(c) < 0)
				return -1;
		if (c->in_len > MAX_REQUEST_HEAD + MAX_REQUEST_BODY)
			return -1;
	}
	return 0;
}

static void on_accept(int lfd)
{
	for (;;) {
		int fd = accept4(lfd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
		int one = 1;
		struct conn *c;
		struct epoll_event ev;

		if (fd < 0) {
			if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)
				perror("sse_server: accept");
			return;
		}
		setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
		c = calloc(1, sizeof(*c));
		if (!c) {
			close(fd);
			continue;
		}
		c->fd = fd;
		c->heap_index = SIZE_MAX;
		ev.events = EPOLLIN;
		ev.data.ptr = c;
		if (epoll_ctl(epfd, EPOLL_CTL_ADD, fd, &ev) < 0) {
			close(fd);
			free(c);
		}
	}
}

/* Writes every stream due by now, each once (with interval 0, one pass over the ready). */
static void run_due(void)
{
	int64_t now = now_ns();

	while (heap_len && heap[0]->due_ns <= now) {
		struct conn *c = heap[0];

		heap_remove(c);
		if (stream_step(c, now) < 0)
			conn_close(c);
	}
}

static void arm_timer(void)
{
	struct itimerspec its = { 0 };

	if (heap_len) {
		int64_t due = heap[0]->due_ns;

		if (due < 1)
			due = 1;
		its.it_value.tv_sec = due / NS_PER_S;
		its.it_value.tv_nsec = due % NS_PER_S;
	}
	timerfd_settime(timerfd_, TFD_TIMER_ABSTIME, &its, NULL);
}

static int json_escape(const char *s, char *out, size_t cap)
{
	size_t o = 0;

	for (; *s; s++) {
		unsigned char ch = (unsigned char)*s;

		if (o + 7 >= cap)
			return -1;
		if (ch == '"' || ch == '\\') {
			out[o++] = '\\';
			out[o++] = (char)ch;
		} else if (ch < 0x20) {
			o += (size_t)snprintf(out + o, cap - o, "\\u%04x", ch);
		} else if (ch == '~') {
			return -2;
		} else {
			out[o++] = (char)ch;
		}
	}
	out[o] = '\0';
	return 0;
}

static void usage(FILE *f)
{
	fprintf(f, "usage: sse_server --port PORT [--host ADDR] [--deltas N] [--interval-ms MS] [--text TEXT]\n"
		   "  an OpenAI-compatible server: each POST streams N deltas (default 100) of TEXT\n"
		   "  (default \"w12 \") plus a stamp of its write time, one every MS ms (default 10;\n"
		   "  0: as fast as the socket takes), then [DONE]. GET /stats: streams now, totals.\n");
}

int main(int argc, char **argv)
{
	static const struct option longopts[] = {
		{ "port", required_argument, NULL, 'p' },
		{ "host", required_argument, NULL, 'H' },
		{ "deltas", required_argument, NULL, 'n' },
		{ "interval-ms", required_argument, NULL, 'i' },
		{ "text", required_argument, NULL, 't' },
		{ "help", no_argument, NULL, 'h' },
		{ NULL, 0, NULL, 0 },
	};
	const char *text = "w12 ";
	struct sockaddr_in sa = { .sin_family = AF_INET };
	struct epoll_event ev, events[MAX_EVENTS];
	struct rlimit rl;
	int lfd, one = 1, ch;
	char lmark, tmark; /* the epoll data of the listener and the timer */

	while ((ch = getopt_long(argc, argv, "", longopts, NULL)) != -1) {
		switch (ch) {
		case 'p': opt.port = atoi(optarg); break;
		case 'H': opt.host = optarg; break;
		case 'n': opt.deltas = (unsigned int)strtoul(optarg, NULL, 10); break;
		case 'i': opt.interval_ns = (int64_t)(strtod(optarg, NULL) * (double)NS_PER_MS); break;
		case 't': text = optarg; break;
		case 'h': usage(stdout); return 0;
		default: usage(stderr); return 2;
		}
	}
	if (opt.port < 1 || opt.port > 65535 || opt.interval_ns < 0 || strlen(text) > MAX_TEXT ||
	    inet_pton(AF_INET, opt.host, &sa.sin_addr) != 1) {
		usage(stderr);
		return 2;
	}
	if (json_escape(text, opt.text_json, sizeof(opt.text_json)) < 0) {
		fprintf(stderr, "sse_server: --text must not hold '~' (it marks the stamp) and be at most %d bytes\n",
			MAX_TEXT);
		return 2;
	}
	sa.sin_port = htons((uint16_t)opt.port);
	if (!getrlimit(RLIMIT_NOFILE, &rl)) {
		rl.rlim_cur = rl.rlim_max;
		setrlimit(RLIMIT_NOFILE, &rl);
	}
	signal(SIGPIPE, SIG_IGN);
	signal(SIGINT, on_signal);
	signal(SIGTERM, on_signal);

	lfd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
	setsockopt(lfd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
	if (lfd < 0 || bind(lfd, (struct sockaddr *)&sa, sizeof(sa)) < 0 || listen(lfd, 4096) < 0) {
		fprintf(stderr, "sse_server: cannot listen on %s:%d: %s\n", opt.host, opt.port, strerror(errno));
		return 1;
	}
	epfd = epoll_create1(EPOLL_CLOEXEC);
	timerfd_ = timerfd_create(CLOCK_MONOTONIC, TFD_NONBLOCK | TFD_CLOEXEC);
	if (epfd < 0 || timerfd_ < 0) {
		perror("sse_server: epoll");
		return 1;
	}
	ev.events = EPOLLIN;
	ev.data.ptr = &lmark;
	epoll_ctl(epfd, EPOLL_CTL_ADD, lfd, &ev);
	ev.data.ptr = &tmark;
	epoll_ctl(epfd, EPOLL_CTL_ADD, timerfd_, &ev);
	fprintf(stderr, "sse_server: listening on %s:%d, %u deltas a reply, every %.3f ms%s\n", opt.host,
		opt.port, opt.deltas, (double)opt.interval_ns / NS_PER_MS,
		opt.interval_ns ? "" : " (as fast as the socket takes)");

	while (!stop_now) {
		/* something due now (interval 0, or late): look at the sockets without waiting */
		int timeout = heap_len && heap[0]->due_ns <= now_ns() ? 0 : -1;
		int n;

		if (timeout < 0)
			arm_timer();
		n = epoll_wait(epfd, events, MAX_EVENTS, timeout);
		if (n < 0 && errno != EINTR) {
			perror("sse_server: epoll_wait");
			return 1;
		}
		for (int i = 0; i < n; i++) {
			void *p = events[i].data.ptr;
			struct conn *c = p;

			if (p == &lmark) {
				on_accept(lfd);
				continue;
			}
			if (p == &tmark) {
				uint64_t expirations;

				if (read(timerfd_, &expirations, sizeof(expirations)) < 0) {
					/* nothing: a timer re-armed before it was read */
				}
				continue;
			}
			if (events[i].events & (EPOLLERR | EPOLLHUP)) {
				conn_close(c);
				continue;
			}
			if (events[i].events & EPOLLOUT) {
				bool was_blocked = conn_blocked(c);

				if (conn_flush(c) < 0) {
					conn_close(c);
					continue;
				}
				if (was_blocked && !conn_blocked(c)) {
					if (c->close_after && c->state != ST_STREAM) {
						conn_close(c);
						continue;
					}
					/* interval 0: the stream goes on once its socket took the rest */
					if (c->state == ST_STREAM && c->heap_index == SIZE_MAX) {
						c->due_ns = now_ns();
						heap_push(c);
					}
				}
			}
			if (events[i].events & EPOLLIN) {
				if (on_readable(c) < 0) {
					conn_close(c);
					continue;
				}
				/* a request that came while the last reply ended */
				if (c->state == ST_HEAD && c->in_len && process_input(c) < 0)
					conn_close(c);
			}
		}
		run_due();
	}
	fprintf(stderr, "sse_server: %" PRIu64 " requests, %" PRIu64 " deltas\n", n_requests, n_deltas);
	return 0;
}
