/*
 * app_backend: the reference chat app for tests/bench/compare.sh.
 *
 * A libwebsockets server (the default poll loop, one thread, its own process) that speaks
 * the chat app side of chatgate's ws:// upstream (docs/protocol.md, "Upstreams"): every text
 * frame {"type":"message","id":ID,...} is answered with two {"type":"delta","id":ID,"text":...}
 * frames and one {"type":"done","id":ID}. Frames of any other type ("cancel") are ignored.
 * The same server is every path's backend in the comparison (the client straight to it,
 * nginx, the Node relay, chatgate), so it must cost the same whoever talks to it, and little:
 * the id is found by a scan of the raw frame (the first top-level-looking "id":"..." and
 * "type":"..." keys) and echoed as it was written, escapes and all; only a frame the scan
 * cannot read (an id that is not a plain string, odd spacing) falls back to jansson.
 *
 * It accepts a WebSocket upgrade on any path, with no subprotocol or one of the names it
 * knows (chatgate.v1, plus each --subprotocol): lws accepts only the names it was given.
 *
 * Bounded: a frame is reassembled up to MAX_FRAME bytes (a bigger one is dropped), and at
 * most MAX_PENDING answers wait per connection; while they do, reading from that connection
 * stops (lws_rx_flow_control), so a client that does not read cannot grow the queue.
 * Replies are written from WRITEABLE, as many frames as the socket takes without blocking
 * (lws_send_pipe_choked), so a turn's three frames usually leave in one poll round.
 *
 *   app_backend --port PORT [--host ADDR] [--subprotocol NAME]... [--text TEXT]
 */
#include <libwebsockets.h>
#include <jansson.h>

#include "chatgate/core/wsrx.h"

#include <errno.h>
#include <getopt.h>
#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>

#define MAX_FRAME (1u << 20)
#define MAX_PENDING 8 /* per connection; small: the app holds thousands of idle ones in --idle */
#define MAX_ID 256  /* bytes of an id as written in the frame (escapes included) */
#define MAX_SUBPROTOCOLS 8
#define OUT_CAP 4096 /* one reply frame */

struct pending_reply {
	char id[MAX_ID];
	size_t id_len;
	int next_frame; /* 0, 1: deltas; 2: done */
};

struct app_conn {
	cg_wsrx rx; /* a frame in pieces (the gateway's core/wsrx.h) */
	struct pending_reply q[MAX_PENDING];
	unsigned int head, count;
	bool rx_paused;
};

static const char *delta_texts[2] = { "Hello from the app, ", "here is your reply." };
static char delta_json[2][512]; /* the texts as JSON strings */
static volatile sig_atomic_t stop_now;
static unsigned long long turns_answered;

static void on_signal(int sig)
{
	(void)sig;
	stop_now = 1;
}

/*
 * Finds `"key":` followed by a JSON string and returns the string's body (between the
 * quotes, escapes as written), or NULL. A `"` inside a JSON string is always escaped, so
 * an unescaped `"key":"` can only be a key; the first one wins (chatgate and cg_bench write
 * type and id first).
 */
static const char *scan_string_field(const char *s, size_t n, const char *key, size_t *out_len)
{
	size_t klen = strlen(key);
	const char *end = s + n;

	for (const char *p = s; p + klen + 3 < end; p++) {
		p = memchr(p, '"', (size_t)(end - p));
		if (!p || p + klen + 3 >= end)
			return NULL;
		if (p > s && p[-1] == '\\')
			continue;
		if (memcmp(p + 1, key, klen) || p[klen + 1] != '"' || p[klen + 2] != ':' ||
		    p[klen + 3] != '"')
			continue;
		const char *v = p + klen + 4;
		const char *q = v;

		while (q < end && *q != '"') {
			if (*q == '\\')
				q++;
			q++;
		}
		if (q >= end)
			return NULL;
		*out_len = (size_t)(q - v);
		return v;
	}
	return NULL;
}

/* The slow path: type and id by jansson; id re-encoded as a JSON string body. */
static bool parse_with_jansson(const char *s, size_t n, bool *is_message, char *id, size_t *id_len)
{
	json_t *root = json_loadb(s, n, 0, NULL);
	const char *type = json_string_value(json_object_get(root, "type"));
	json_t *jid = json_object_get(root, "id");
	char *dump = NULL;
	bool ok = false;

	if (root && type) {
		*is_message = !strcmp(type, "message");
		if (jid && (dump = json_dumps(jid, JSON_ENCODE_ANY | JSON_COMPACT))) {
			size_t dl = strlen(dump);
			/* a string id loses its quotes; a number (or null) id is echoed as a string */
			const char *body = dump[0] == '"' ? dump + 1 : dump;
			size_t bl = dump[0] == '"' ? dl - 2 : dl;

			if (bl < MAX_ID && !(dump[0] != '"' && memchr(body, '"', bl))) {
				memcpy(id, body, bl);
				*id_len = bl;
				ok = true;
			}
		} else if (!jid) {
			*id_len = 0;
			ok = true;
		}
	}
	free(dump);
	json_decref(root);
	return ok;
}

static void handle_frame(struct lws *wsi, struct app_conn *c, const char *frame, size_t len)
{
	size_t type_len = 0, id_len = 0;
	const char *type = scan_string_field(frame, len, "type", &type_len);
	const char *id = scan_string_field(frame, len, "id", &id_len);
	bool is_message;
	struct pending_reply *r;

	if (c->count == MAX_PENDING)
		return; /* cannot happen: reading stops while the queue is full */
	r = &c->q[(c->head + c->count) % MAX_PENDING];
	if (type && id && id_len < MAX_ID) {
		is_message = type_len == 7 && !memcmp(type, "message", 7);
		memcpy(r->id, id, id_len);
		r->id_len = id_len;
	} else if (!parse_with_jansson(frame, len, &is_message, r->id, &r->id_len)) {
		return;
	}
	if (!is_message)
		return;
	r->next_frame = 0;
	c->count++;
	if (c->count == MAX_PENDING && !c->rx_paused) {
		c->rx_paused = true;
		lws_rx_flow_control(wsi, 0);
	}
	lws_callback_on_writable(wsi);
}

/* Writes the queued reply frames while the socket takes them. Returns -1 to close. */
static int write_replies(struct lws *wsi, struct app_conn *c)
{
	static unsigned char out[LWS_PRE + OUT_CAP];
	char *p = (char *)out + LWS_PRE;

	while (c->count && !lws_send_pipe_choked(wsi)) {
		struct pending_reply *r = &c->q[c->head];
		int len;

		if (r->next_frame < 2)
			len = snprintf(p, OUT_CAP, "{\"type\":\"delta\",\"id\":\"%.*s\",\"text\":%s}",
				       (int)r->id_len, r->id, delta_json[r->next_frame]);
		else
			len = snprintf(p, OUT_CAP, "{\"type\":\"done\",\"id\":\"%.*s\"}", (int)r->id_len,
				       r->id);
		if (len < 0 || len >= OUT_CAP)
			return -1;
		if (lws_write(wsi, (unsigned char *)p, (size_t)len, LWS_WRITE_TEXT) < len)
			return -1;
		if (++r->next_frame == 3) {
			c->head = (c->head + 1) % MAX_PENDING;
			c->count--;
			turns_answered++;
		}
	}
	if (c->rx_paused && c->count < MAX_PENDING / 2) {
		c->rx_paused = false;
		lws_rx_flow_control(wsi, 1);
	}
	if (c->count)
		lws_callback_on_writable(wsi);
	return 0;
}

static int callback_app(struct lws *wsi, enum lws_callback_reasons reason, void *user, void *in,
			size_t len)
{
	struct app_conn *c = user;

	switch (reason) {
	case LWS_CALLBACK_HTTP:
		/* a plain HTTP request: this server only speaks WebSocket */
		lws_return_http_status(wsi, HTTP_STATUS_NOT_FOUND, NULL);
		return -1;

	case LWS_CALLBACK_ESTABLISHED:
		memset(c, 0, sizeof(*c));
		break;

	case LWS_CALLBACK_RECEIVE: {
		const char *msg;
		size_t msg_len;

		if (lws_frame_is_binary(wsi) ||
		    !cg_wsrx_feed(&c->rx, lws_is_first_fragment(wsi), lws_is_final_fragment(wsi), in, len,
				  MAX_FRAME, &msg, &msg_len))
			break;
		if (msg)
			handle_frame(wsi, c, msg, msg_len);
		cg_wsrx_done(&c->rx);
		break;
	}

	case LWS_CALLBACK_SERVER_WRITEABLE:
		return write_replies(wsi, c);

	case LWS_CALLBACK_CLOSED:
		cg_wsrx_done(&c->rx);
		break;

	default:
		break;
	}
	return 0;
}

static void usage(FILE *out)
{
	fprintf(out, "usage: app_backend --port PORT [--host ADDR] [--subprotocol NAME]... [--text TEXT]\n"
		     "  --port PORT          listen port (required)\n"
		     "  --host ADDR          listen address (default 127.0.0.1)\n"
		     "  --subprotocol NAME   accept this Sec-WebSocket-Protocol too (besides none and\n"
		     "                       chatgate.v1); up to %d\n"
		     "  --text TEXT          the first delta's text\n"
		     "Answers each {\"type\":\"message\",\"id\":ID} with two deltas and a done.\n",
		MAX_SUBPROTOCOLS);
}

int main(int argc, char **argv)
{
	static const struct option longopts[] = {
		{ "port", required_argument, NULL, 'p' },
		{ "host", required_argument, NULL, 'H' },
		{ "subprotocol", required_argument, NULL, 's' },
		{ "text", required_argument, NULL, 't' },
		{ "help", no_argument, NULL, 'h' },
		{ NULL, 0, NULL, 0 },
	};
	/* [0]: no subprotocol (lws binds a connection without one to the first), then names */
	static struct lws_protocols protocols[MAX_SUBPROTOCOLS + 3];
	const char *names[MAX_SUBPROTOCOLS + 1] = { "chatgate.v1" };
	int n_names = 1;
	const char *host = "127.0.0.1";
	long port = 0;
	struct lws_context_creation_info info;
	struct lws_context *context;
	struct rlimit rl;
	int opt;

	while ((opt = getopt_long(argc, argv, "h", longopts, NULL)) != -1) {
		char *end;

		switch (opt) {
		case 'p':
			errno = 0;
			port = strtol(optarg, &end, 10);
			if (errno || end == optarg || *end || port < 1 || port > 65535) {
				fprintf(stderr, "app_backend: --port: not a port number: %s\n", optarg);
				return 2;
			}
			break;
		case 'H':
			host = optarg;
			break;
		case 's':
			if (n_names > MAX_SUBPROTOCOLS) {
				fprintf(stderr, "app_backend: --subprotocol: at most %d\n", MAX_SUBPROTOCOLS);
				return 2;
			}
			names[n_names++] = optarg;
			break;
		case 't':
			delta_texts[0] = optarg;
			break;
		case 'h':
			usage(stdout);
			return 0;
		default:
			usage(stderr);
			return 2;
		}
	}
	if (optind < argc || !port) {
		if (optind < argc)
			fprintf(stderr, "app_backend: unexpected argument: %s\n", argv[optind]);
		else
			fprintf(stderr, "app_backend: --port: required\n");
		usage(stderr);
		return 2;
	}
	for (int i = 0; i < 2; i++) {
		json_t *s = json_string(delta_texts[i]);
		char *d = s ? json_dumps(s, JSON_ENCODE_ANY | JSON_COMPACT) : NULL;

		if (!d || strlen(d) >= sizeof(delta_json[i])) {
			fprintf(stderr, "app_backend: --text: not valid UTF-8, or over %zu bytes\n",
				sizeof(delta_json[i]) - 3);
			return 2;
		}
		strcpy(delta_json[i], d);
		free(d);
		json_decref(s);
	}

	protocols[0] = (struct lws_protocols){ "app", callback_app, sizeof(struct app_conn), 4096, 0,
					       NULL, 0 };
	for (int i = 0; i < n_names; i++) {
		protocols[i + 1] = protocols[0];
		protocols[i + 1].name = names[i];
	}

	/* thousands of idle connections (compare.sh --idle): as many descriptors as allowed */
	if (!getrlimit(RLIMIT_NOFILE, &rl) && rl.rlim_cur < rl.rlim_max) {
		rl.rlim_cur = rl.rlim_max;
		setrlimit(RLIMIT_NOFILE, &rl);
	}

	signal(SIGINT, on_signal);
	signal(SIGTERM, on_signal);
	signal(SIGPIPE, SIG_IGN);
	lws_set_log_level(LLL_ERR, NULL);

	memset(&info, 0, sizeof(info));
	info.port = (int)port;
	info.iface = host;
	info.protocols = protocols;
	info.options = LWS_SERVER_OPTION_DISABLE_IPV6;
	context = lws_create_context(&info);
	if (!context) {
		fprintf(stderr, "app_backend: cannot listen on %s:%ld\n", host, port);
		return 1;
	}
	fprintf(stderr, "app_backend: listening on %s:%ld\n", host, port);
	while (!stop_now && lws_service(context, 0) >= 0)
		;
	lws_context_destroy(context);
	fprintf(stderr, "app_backend: stopped after %llu turns\n", turns_answered);
	return 0;
}
