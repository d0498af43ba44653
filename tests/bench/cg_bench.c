/*
 * cg_bench: a closed-loop load generator for chatgate.
 *
 * It opens N WebSocket connections to the gateway from one libwebsockets
 * context (the default poll loop, one thread, its own process) and keeps
 * exactly one chatgate.v1 "message" in flight on each connection: the next
 * message is sent when the previous one's terminal frame ("done", "error" or
 * "cancelled") has arrived. A turn's latency is the time from the lws_write()
 * of the message to the arrival of the last fragment of its terminal frame,
 * on CLOCK_MONOTONIC.
 *
 * Timeline: connect (until every connection is established or has failed, or
 * the connect timeout passes) -> warmup (traffic flows, nothing is recorded)
 * -> measured window of --duration seconds -> close every connection. Only
 * terminal frames that arrive inside the measured window are counted;
 * messages per second is the number of "done" frames divided by the real
 * length of the window. Latencies are recorded for "done" turns only; every
 * other terminal frame counts as an error.
 *
 * What must always hold: memory stays bounded whatever the length of the run
 * (latencies go into a fixed log-linear histogram with 1/1024 relative
 * precision, a frame is accumulated up to MAX_FRAME_BYTES), and nothing
 * blocks outside lws_service() but short reads of the gateway's /proc files
 * (status every 100 ms for RSS, stat at both ends of the window for CPU).
 * A host name in --url is resolved once, synchronously, before the run.
 *
 * --raw talks to a chat app directly (tests/bench/app_backend, or one behind nginx or a
 * relay: tests/bench/compare.sh) instead of to chatgate: the message frame is
 * {"type":"message","id","text"} with no room, no hello is expected, and only "done" and
 * "error" end a turn. --idle SECONDS measures memory instead of throughput: every
 * connection is opened and waits, sending nothing, until it is ready (chatgate's hello, or
 * the open itself with --raw); then all are held SECONDS and the --pid process's VmRSS is
 * compared with its value before the first connect (RESULT idle ... kib_per_conn=).
 */

#include <libwebsockets.h>
#include <jansson.h>

#include "chatgate/core/wsrx.h"

#include <errno.h>
#include <getopt.h>
#include <inttypes.h>
#include <limits.h>
#include <signal.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <time.h>
#include <unistd.h>

#define DEFAULT_URL "ws://127.0.0.1:8080/ws"
#define DEFAULT_TEXT "Find flights from Nairobi to London on Feb 10"
#define DEFAULT_ROOM "bench"

#define MAX_CONNECTIONS 1000000u
#define MAX_FRAME_BYTES (4u * 1024u * 1024u)
#define TICK_US (100 * LWS_US_PER_MS)  /* RSS sampling and housekeeping */
#define STOP_GRACE_NS (2 * NS_PER_S)   /* how long closing handshakes may take */
#define MAX_LOGGED_CONN_PROBLEMS 10    /* per kind, then only counted */
#define MAX_ERROR_CODES 16
/*
 * Connection attempts in progress at once. Thousands of SYNs at once overflow the server's
 * listen backlog (lws listens with a small one) and the dropped ones fail; a sliding window
 * opens them about as fast, and every one gets through.
 */
#define MAX_CONNECTING 256

#define NS_PER_S 1000000000LL
#define NS_PER_MS 1000000.0

/*
 * Latency histogram, in nanoseconds. Values below 2 * HIST_SUB get one bucket
 * each; above, every power of two is split into HIST_SUB buckets, so a
 * bucket's width is at most 1/HIST_SUB of its value. The last bucket also
 * holds anything beyond 2^(HIST_SUB_BITS + 1 + HIST_MAX_SHIFT) ns (~19 h).
 */
#define HIST_SUB_BITS 10
#define HIST_SUB (1u << HIST_SUB_BITS)
#define HIST_MAX_SHIFT 35
#define HIST_BUCKETS (2u * HIST_SUB + HIST_MAX_SHIFT * HIST_SUB)

struct latency_histogram {
	uint64_t counts[HIST_BUCKETS];
	uint64_t total;
	uint64_t min_ns;
	uint64_t max_ns;
	double sum_ns;
};

enum bench_phase {
	PHASE_CONNECT, /* connections being opened; traffic may already flow */
	PHASE_WARMUP,  /* traffic flows, nothing recorded */
	PHASE_MEASURE, /* traffic flows, terminal frames recorded */
	PHASE_STOP,    /* closing every connection */
	PHASE_DONE,    /* leave the service loop */
};

enum conn_state {
	CONN_CONNECTING,
	CONN_OPEN,
	CONN_FAILED, /* never established */
	CONN_CLOSED, /* established, then closed */
};

struct bench;

/* One client connection; lws hands it back as the callback's `user`. */
struct bench_conn {
	struct bench *bench;
	struct lws *wsi;
	unsigned int index;
	enum conn_state state;
	bool in_flight; /* a message was sent and its terminal frame is due */
	bool ready;     /* --idle: hello seen (or open, with --raw) */
	bool want_send;
	uint64_t seq;
	char msg_id[40];
	int64_t sent_ns;
	int close_code; /* from the peer's close frame, 0 if none */
	cg_wsrx rx; /* a text frame in pieces (the gateway's core/wsrx.h) */
};

struct error_code_count {
	char code[48];
	uint64_t count;
};

struct bench_options {
	const char *url;
	unsigned int connections;
	double duration_s;
	double warmup_s;
	double connect_timeout_s;
	const char *text;
	const char *room;
	const char *subprotocol; /* NULL: offer none */
	long pid;                /* gateway, 0 if not given */
	long store_pid;          /* the store (redis-server), 0 if not given */
	bool progress;
	bool verbose;
	bool raw;       /* a chat app, not chatgate: no hello, no room, done/error end a turn */
	double idle_s;  /* > 0: idle mode, hold the connections this long */
};

struct ws_target {
	char address[256];
	int port;
	char path[1024];
	char host_header[300];
};

/* The machine's CPU time, every CPU's summed (/proc/stat), in clock ticks. */
struct machine_ticks {
	unsigned long long idle;  /* idle and iowait */
	unsigned long long steal; /* taken by the hypervisor for other guests */
	unsigned long long total;
	int known;
};

struct bench {
	struct bench_options opt;
	struct ws_target target;
	struct lws_context *context;
	struct bench_conn *conns;

	enum bench_phase phase;
	lws_sorted_usec_list_t tick_sul;
	lws_sorted_usec_list_t phase_sul;
	int64_t start_ns;
	int64_t connect_deadline_ns;
	int64_t warmup_start_ns;
	int64_t measure_start_ns;
	int64_t measure_end_ns;
	int64_t stop_deadline_ns;
	bool fatal;          /* the run cannot give a result */
	bool lost_all;       /* every connection went away before the end */
	bool interrupted;    /* SIGINT or SIGTERM */
	unsigned int ticks;

	/* the message frame, rebuilt in place for every send */
	char *room_json;
	char *text_json;
	unsigned char *tx;
	size_t tx_cap;

	/* connections */
	unsigned int established;
	unsigned int failed;
	unsigned int open_now;
	unsigned int closed_early;
	unsigned int next_to_open;   /* connections [0, next_to_open) were started */
	unsigned int connecting;     /* started, neither established nor failed yet */
	bool opening;                /* inside open_more(): no re-entry from its callbacks */
	unsigned int ready;           /* --idle */
	unsigned int closed_unready;  /* --idle: closed before they were ready */
	long rss_before_kb;           /* --idle: before the first connect, -1 unknown */
	long rss_after_kb;            /* --idle: at the end of the hold */

	/* frames */
	uint64_t sent_total;
	uint64_t hellos;
	uint64_t acks;
	uint64_t deltas;
	uint64_t warnings;
	uint64_t other_frames;
	uint64_t unparsable_frames;
	uint64_t oversized_frames;
	uint64_t binary_frames;
	uint64_t stray_terminals; /* terminal frame for no message in flight */
	unsigned int in_flight_at_stop;
	uint64_t terminals_unmeasured; /* during connect and warmup */

	/* measured window */
	uint64_t done;
	uint64_t errors;
	uint64_t cancelled;
	struct error_code_count error_codes[MAX_ERROR_CODES];
	uint64_t error_codes_other;
	struct latency_histogram *hist;
	uint64_t progress_last_done;
	double cpu_at_measure_start_s; /* this process's user + system time */
	double cpu_at_measure_end_s;
	double gateway_cpu_at_measure_start_s; /* < 0: unknown */
	double gateway_cpu_at_measure_end_s;
	double store_cpu_at_measure_start_s; /* the store's, < 0: unknown */
	double store_cpu_at_measure_end_s;
	struct machine_ticks machine_at_measure_start; /* the whole machine's, from /proc/stat */
	struct machine_ticks machine_at_measure_end;

	/* gateway memory */
	long rss_peak_sampled_kb;
	long rss_last_kb;
	long hwm_kb;
	unsigned int rss_samples;
	bool pid_gone;
};

static volatile sig_atomic_t signal_seen;

static void on_signal(int sig)
{
	(void)sig;
	signal_seen = 1;
}

/*
 * The whole machine's CPU time from the first line of /proc/stat, in ticks summed over every
 * CPU: how much of it was idle, and how much the hypervisor took (steal). A closed loop whose
 * processes wait on each other leaves cores idle although every turn is in flight: with
 * the proxy's CPU, this says whether a path stopped at the cores or at one of its processes.
 */
static void read_machine_ticks(struct machine_ticks *m)
{
	unsigned long long v[8] = {0};
	FILE *f = fopen("/proc/stat", "r");

	m->known = 0;
	if (!f)
		return;
	/* user nice system idle iowait irq softirq steal (guest time is inside user) */
	if (fscanf(f, "cpu %llu %llu %llu %llu %llu %llu %llu %llu", &v[0], &v[1], &v[2], &v[3],
		   &v[4], &v[5], &v[6], &v[7]) == 8) {
		m->idle = v[3] + v[4];
		m->steal = v[7];
		m->total = 0;
		for (int i = 0; i < 8; i++)
			m->total += v[i];
		m->known = 1;
	}
	fclose(f);
}

/* Percent of the machine's CPU time between a and b that was idle, or stolen; -1 if unknown. */
static double machine_pct(const struct machine_ticks *a, const struct machine_ticks *b, int steal)
{
	if (!a->known || !b->known || b->total <= a->total)
		return -1;
	return 100.0 * (double)(steal ? b->steal - a->steal : b->idle - a->idle) /
	       (double)(b->total - a->total);
}

/* User plus system CPU time this process has used, in seconds. */
static double own_cpu_seconds(void)
{
	struct rusage ru;

	if (getrusage(RUSAGE_SELF, &ru))
		return 0;
	return (double)ru.ru_utime.tv_sec + (double)ru.ru_utime.tv_usec / 1e6 +
	       (double)ru.ru_stime.tv_sec + (double)ru.ru_stime.tv_usec / 1e6;
}

static int64_t now_ns(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (int64_t)ts.tv_sec * NS_PER_S + ts.tv_nsec;
}

/* ---- latency histogram ---- */

static size_t histogram_index(uint64_t ns)
{
	if (ns < 2u * HIST_SUB)
		return (size_t)ns;

	unsigned int msb = 63u - (unsigned int)__builtin_clzll(ns);
	unsigned int shift = msb - HIST_SUB_BITS; /* >= 1: ns >> shift is in [SUB, 2*SUB) */

	if (shift > HIST_MAX_SHIFT)
		return HIST_BUCKETS - 1;
	return 2u * HIST_SUB + (shift - 1u) * HIST_SUB + (size_t)((ns >> shift) - HIST_SUB);
}

/* The middle of the bucket's range of values. */
static uint64_t histogram_bucket_value(size_t index)
{
	if (index < 2u * HIST_SUB)
		return index;

	size_t k = index - 2u * HIST_SUB;
	unsigned int shift = (unsigned int)(k / HIST_SUB) + 1u;
	uint64_t low = (uint64_t)(k % HIST_SUB + HIST_SUB) << shift;

	return low + ((UINT64_C(1) << shift) - 1u) / 2u;
}

static void histogram_record(struct latency_histogram *h, uint64_t ns)
{
	h->counts[histogram_index(ns)]++;
	if (!h->total || ns < h->min_ns)
		h->min_ns = ns;
	if (ns > h->max_ns)
		h->max_ns = ns;
	h->total++;
	h->sum_ns += (double)ns;
}

/*
 * The value at quantile q (0 < q <= 1): the smallest bucket whose cumulative
 * count reaches ceil(q * total), clamped to the observed min and max so that
 * a wide bucket never reports beyond what was seen.
 */
static uint64_t histogram_quantile(const struct latency_histogram *h, double q)
{
	if (!h->total)
		return 0;

	uint64_t rank = (uint64_t)(q * (double)h->total + 0.999999);
	uint64_t seen = 0;

	if (rank < 1)
		rank = 1;
	if (rank > h->total)
		rank = h->total;
	for (size_t i = 0; i < HIST_BUCKETS; i++) {
		seen += h->counts[i];
		if (seen >= rank) {
			uint64_t v = histogram_bucket_value(i);

			if (v < h->min_ns)
				v = h->min_ns;
			if (v > h->max_ns)
				v = h->max_ns;
			return v;
		}
	}
	return h->max_ns;
}

/* ---- gateway memory from /proc/PID/status ---- */

/*
 * The children of pid, at most max of them into out: a master's workers (chatgate
 * --workers, nginx's master), whose memory and CPU are the gateway's. From
 * /proc/PID/task/PID/children (the main thread's children: a master forks from it); none on
 * a kernel without CONFIG_PROC_CHILDREN.
 */
#define MAX_CHILDREN 256 /* a master's workers counted: chatgate allows 64 */
static int children_of(long pid, long *out, int max)
{
	char path[64];
	int n = 0;
	FILE *f;

	snprintf(path, sizeof(path), "/proc/%ld/task/%ld/children", pid, pid);
	f = fopen(path, "r");
	if (!f)
		return 0;
	while (n < max && fscanf(f, "%ld", &out[n]) == 1)
		n++;
	fclose(f);
	return n;
}

/*
 * Reads VmRSS and VmHWM (kB) of one process. Returns 0, or -1 when the process is gone or
 * its status cannot be read.
 */
static int read_one_memory(long pid, long *rss_kb, long *hwm_kb)
{
	char path[64];
	char line[256];
	FILE *f;

	snprintf(path, sizeof(path), "/proc/%ld/status", pid);
	f = fopen(path, "r");
	if (!f)
		return -1;
	*rss_kb = -1;
	*hwm_kb = -1;
	while (fgets(line, sizeof(line), f)) {
		if (!strncmp(line, "VmRSS:", 6))
			*rss_kb = strtol(line + 6, NULL, 10);
		else if (!strncmp(line, "VmHWM:", 6))
			*hwm_kb = strtol(line + 6, NULL, 10);
	}
	fclose(f);
	/* a zombie has no Vm lines */
	return *rss_kb < 0 ? -1 : 0;
}

/* VmRSS of the process with its children's (a master's workers), and its own VmHWM (kB). */
static int read_process_memory(long pid, long *rss_kb, long *hwm_kb)
{
	long kids[MAX_CHILDREN], rss, hwm;
	int n;

	if (read_one_memory(pid, rss_kb, hwm_kb) < 0)
		return -1;
	n = children_of(pid, kids, MAX_CHILDREN);
	for (int i = 0; i < n; i++)
		if (read_one_memory(kids[i], &rss, &hwm) == 0)
			*rss_kb += rss;
	return 0;
}

/* User plus system CPU time of one process, in clock ticks; -1 if unknown. */
static long long stat_ticks(long pid)
{
	char path[64];
	char buf[1024];
	unsigned long long utime, stime;
	const char *p;
	size_t n;
	FILE *f;

	snprintf(path, sizeof(path), "/proc/%ld/stat", pid);
	f = fopen(path, "r");
	if (!f)
		return -1;
	n = fread(buf, 1, sizeof(buf) - 1, f);
	fclose(f);
	buf[n] = '\0';
	/* fields 14 and 15 (utime, stime) follow the ")" that ends field 2, comm */
	p = strrchr(buf, ')');
	if (!p || sscanf(p + 1, " %*c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %llu %llu", &utime,
			 &stime) != 2)
		return -1;
	return (long long)(utime + stime);
}

/* User plus system CPU time of a process and its children (a master's workers: their CPU
 * is the gateway's), in seconds; -1 if unknown. */
static double process_cpu_seconds(long pid)
{
	long kids[MAX_CHILDREN];
	long long ticks, t;
	int n;

	if (!pid || (ticks = stat_ticks(pid)) < 0)
		return -1;
	n = children_of(pid, kids, MAX_CHILDREN);
	for (int i = 0; i < n; i++)
		if ((t = stat_ticks(kids[i])) >= 0)
			ticks += t;
	return (double)ticks / (double)sysconf(_SC_CLK_TCK);
}

static void sample_gateway_memory(struct bench *b)
{
	long rss, hwm;

	if (!b->opt.pid || b->pid_gone)
		return;
	if (read_process_memory(b->opt.pid, &rss, &hwm)) {
		b->pid_gone = true;
		fprintf(stderr, "cg_bench: gateway pid %ld is gone (no /proc/%ld/status)\n",
			b->opt.pid, b->opt.pid);
		return;
	}
	b->rss_samples++;
	b->rss_last_kb = rss;
	if (rss > b->rss_peak_sampled_kb)
		b->rss_peak_sampled_kb = rss;
	if (hwm > b->hwm_kb)
		b->hwm_kb = hwm;
}

/* ---- run phases ---- */

static void phase_timer_fired(lws_sorted_usec_list_t *sul);

/*
 * Makes the service loop in main() end. Timers run inside lws_service()
 * before it polls, so the poll is woken up, or it would sleep until lws's
 * next internal timer (up to seconds).
 */
static void finish_run(struct bench *b)
{
	b->phase = PHASE_DONE;
	lws_cancel_service(b->context);
}

static void schedule_phase_timer(struct bench *b, double seconds)
{
	lws_sul_schedule(b->context, 0, &b->phase_sul, phase_timer_fired,
			 (lws_usec_t)(seconds * (double)LWS_US_PER_SEC));
}

static void start_measure(struct bench *b)
{
	b->phase = PHASE_MEASURE;
	b->measure_start_ns = now_ns();
	b->cpu_at_measure_start_s = own_cpu_seconds();
	b->gateway_cpu_at_measure_start_s = process_cpu_seconds(b->opt.pid);
	b->store_cpu_at_measure_start_s = b->opt.store_pid ? process_cpu_seconds(b->opt.store_pid) : -1;
	read_machine_ticks(&b->machine_at_measure_start);
	schedule_phase_timer(b, b->opt.duration_s);
}

static void start_warmup(struct bench *b)
{
	b->warmup_start_ns = now_ns();
	if (b->opt.warmup_s <= 0) {
		start_measure(b);
		return;
	}
	b->phase = PHASE_WARMUP;
	schedule_phase_timer(b, b->opt.warmup_s);
}

/* Ends the run: asks every open connection to close from its WRITEABLE. */
static void start_stop(struct bench *b)
{
	if (b->phase >= PHASE_STOP)
		return;
	b->measure_end_ns = now_ns();
	b->cpu_at_measure_end_s = own_cpu_seconds();
	b->gateway_cpu_at_measure_end_s = process_cpu_seconds(b->opt.pid);
	b->store_cpu_at_measure_end_s = b->opt.store_pid ? process_cpu_seconds(b->opt.store_pid) : -1;
	read_machine_ticks(&b->machine_at_measure_end);
	if (b->phase != PHASE_MEASURE) { /* empty window */
		b->measure_start_ns = b->measure_end_ns;
		b->cpu_at_measure_start_s = b->cpu_at_measure_end_s;
		b->gateway_cpu_at_measure_start_s = b->gateway_cpu_at_measure_end_s;
		b->store_cpu_at_measure_start_s = b->store_cpu_at_measure_end_s;
		b->machine_at_measure_start = b->machine_at_measure_end;
	}
	if (b->opt.idle_s > 0 && b->opt.pid) {
		long hwm;

		if (read_process_memory(b->opt.pid, &b->rss_after_kb, &hwm))
			b->rss_after_kb = -1;
	}
	b->phase = PHASE_STOP;
	b->stop_deadline_ns = b->measure_end_ns + STOP_GRACE_NS;
	lws_sul_cancel(&b->phase_sul);
	for (unsigned int i = 0; i < b->opt.connections; i++) {
		struct bench_conn *c = &b->conns[i];

		if (c->state == CONN_OPEN && c->wsi) {
			b->in_flight_at_stop += c->in_flight;
			lws_callback_on_writable(c->wsi);
		}
	}
	if (!b->open_now)
		finish_run(b);
}

static void phase_timer_fired(lws_sorted_usec_list_t *sul)
{
	struct bench *b = lws_container_of(sul, struct bench, phase_sul);

	if (b->phase == PHASE_WARMUP)
		start_measure(b);
	else if (b->phase == PHASE_MEASURE)
		start_stop(b);
}

/* Called whenever a connection attempt resolves, and on the connect deadline. */
static void check_connect_phase_over(struct bench *b, bool deadline_passed)
{
	if (b->phase != PHASE_CONNECT)
		return;
	unsigned int resolved = b->opt.idle_s > 0 ? b->ready + b->failed + b->closed_unready
						  : b->established + b->failed;

	if (resolved < b->opt.connections && !deadline_passed)
		return;
	if (!b->established) {
		fprintf(stderr, "cg_bench: no connection to %s could be established (%u failed%s)\n",
			b->opt.url, b->failed, deadline_passed ? ", connect timeout" : "");
		b->fatal = true;
		finish_run(b);
		return;
	}
	if (!b->open_now) {
		fprintf(stderr, "cg_bench: every established connection was closed by the gateway\n");
		b->fatal = true;
		finish_run(b);
		return;
	}
	if (deadline_passed)
		fprintf(stderr, "cg_bench: connect timeout: going on with %u of %u connections\n",
			b->opt.idle_s > 0 ? b->ready : b->established, b->opt.connections);
	if (b->opt.idle_s > 0) {
		/* the hold: no traffic; the window is the hold, for the report */
		b->phase = PHASE_MEASURE;
		b->warmup_start_ns = b->measure_start_ns = now_ns();
		schedule_phase_timer(b, b->opt.idle_s);
		return;
	}
	start_warmup(b);
}

static void print_progress(struct bench *b, int64_t now)
{
	static const char *const names[] = { "connect", "warmup", "measure", "stop", "done" };

	fprintf(stderr, "cg_bench: t=%.1fs phase=%s open=%u done/s=%" PRIu64 " errors=%" PRIu64 "\n",
		(double)(now - b->start_ns) / NS_PER_S, names[b->phase], b->open_now,
		b->done - b->progress_last_done, b->errors);
	b->progress_last_done = b->done;
}

static void tick(lws_sorted_usec_list_t *sul)
{
	struct bench *b = lws_container_of(sul, struct bench, tick_sul);
	int64_t now = now_ns();

	b->ticks++;
	sample_gateway_memory(b);
	if (signal_seen && !b->interrupted) {
		b->interrupted = true;
		fprintf(stderr, "cg_bench: interrupted, stopping\n");
		if (b->phase == PHASE_CONNECT && !b->established) {
			b->fatal = true;
			finish_run(b);
		} else {
			start_stop(b);
		}
	}
	if (b->phase == PHASE_CONNECT && now >= b->connect_deadline_ns)
		check_connect_phase_over(b, true);
	if (b->phase == PHASE_STOP && (!b->open_now || now >= b->stop_deadline_ns))
		finish_run(b);
	if (b->opt.progress && b->ticks % 10 == 0)
		print_progress(b, now);
	if (b->phase != PHASE_DONE)
		lws_sul_schedule(b->context, 0, &b->tick_sul, tick, TICK_US);
}

static void open_more(struct bench *b);

/* ---- messages ---- */

static void log_conn_problem(unsigned int *logged, const char *fmt, unsigned int index,
			     const char *detail)
{
	if (*logged >= MAX_LOGGED_CONN_PROBLEMS)
		return;
	(*logged)++;
	fprintf(stderr, fmt, index, detail);
	if (*logged == MAX_LOGGED_CONN_PROBLEMS)
		fprintf(stderr, "cg_bench: (further messages of this kind suppressed)\n");
}

static void count_error_code(struct bench *b, const char *code)
{
	if (!code)
		code = "(no code)";
	for (size_t i = 0; i < MAX_ERROR_CODES; i++) {
		struct error_code_count *e = &b->error_codes[i];

		if (!e->count) {
			snprintf(e->code, sizeof(e->code), "%s", code);
			e->count = 1;
			return;
		}
		if (!strncmp(e->code, code, sizeof(e->code) - 1)) {
			e->count++;
			return;
		}
	}
	b->error_codes_other++;
}

/* Sends the connection's next message. Returns -1 to close the connection. */
static int send_next_message(struct bench_conn *c)
{
	struct bench *b = c->bench;
	char *payload = (char *)b->tx + LWS_PRE;
	size_t room = b->tx_cap - LWS_PRE;
	int len;

	c->seq++;
	snprintf(c->msg_id, sizeof(c->msg_id), "b%u-%" PRIu64, c->index, c->seq);
	if (b->opt.raw)
		len = snprintf(payload, room, "{\"type\":\"message\",\"id\":\"%s\",\"text\":%s}",
			       c->msg_id, b->text_json);
	else
		len = snprintf(payload, room,
			       "{\"type\":\"message\",\"id\":\"%s\",\"room\":%s,\"text\":%s}",
			       c->msg_id, b->room_json, b->text_json);
	if (len < 0 || (size_t)len >= room) {
		fprintf(stderr, "cg_bench: message frame does not fit its buffer\n");
		return -1;
	}
	c->want_send = false;
	c->in_flight = true;
	c->sent_ns = now_ns();
	if (lws_write(c->wsi, (unsigned char *)payload, (size_t)len, LWS_WRITE_TEXT) < len) {
		fprintf(stderr, "cg_bench: connection %u: write failed\n", c->index);
		return -1;
	}
	b->sent_total++;
	return 0;
}

static void handle_terminal(struct bench_conn *c, const char *type, const char *id,
			    const char *code, int64_t arrived_ns)
{
	struct bench *b = c->bench;

	/* error frames about unparsable input carry "id":null; cancelled may lack one */
	if (!c->in_flight || (id && strcmp(id, c->msg_id))) {
		b->stray_terminals++;
		return;
	}
	c->in_flight = false;
	if (b->phase == PHASE_MEASURE) {
		if (!strcmp(type, "done")) {
			b->done++;
			histogram_record(b->hist, (uint64_t)(arrived_ns - c->sent_ns));
		} else {
			b->errors++;
			if (!strcmp(type, "cancelled"))
				b->cancelled++;
			else
				count_error_code(b, code);
		}
	} else if (b->phase < PHASE_MEASURE) {
		b->terminals_unmeasured++;
	}
	if (b->phase < PHASE_STOP) {
		c->want_send = true;
		lws_callback_on_writable(c->wsi);
	}
}

/* --idle: the connection is up (hello seen, or open with --raw). */
static void mark_ready(struct bench_conn *c)
{
	if (c->ready)
		return;
	c->ready = true;
	c->bench->ready++;
	check_connect_phase_over(c->bench, false);
}

/* One complete text frame from the gateway. */
static void handle_frame(struct bench_conn *c, const char *frame, size_t len, int64_t arrived_ns)
{
	struct bench *b = c->bench;
	static const char delta_prefix[] = "{\"type\":\"delta\",";
	json_error_t jerr;
	json_t *root;
	const char *type;

	/*
	 * Deltas are most frames and need no field: counted without a parse, so that the client
	 * spends less of the machine the gateway and the backend share.
	 */
	if (len > sizeof(delta_prefix) && !memcmp(frame, delta_prefix, sizeof(delta_prefix) - 1)) {
		b->deltas++;
		return;
	}
	root = json_loadb(frame, len, 0, &jerr);

	if (!root || !json_is_object(root)) {
		if (!b->unparsable_frames && b->opt.verbose)
			fprintf(stderr, "cg_bench: unparsable frame: %s\n", jerr.text);
		b->unparsable_frames++;
		json_decref(root);
		return;
	}
	type = json_string_value(json_object_get(root, "type"));
	if (!type)
		b->other_frames++;
	else if (!strcmp(type, "delta"))
		b->deltas++;
	else if (!strcmp(type, "ack"))
		b->acks++;
	else if (!strcmp(type, "done") || !strcmp(type, "error") ||
		 (!b->opt.raw && !strcmp(type, "cancelled")))
		handle_terminal(c, type, json_string_value(json_object_get(root, "id")),
				json_string_value(json_object_get(root, "code")), arrived_ns);
	else if (!strcmp(type, "hello")) {
		b->hellos++;
		if (b->opt.idle_s > 0 && !b->opt.raw)
			mark_ready(c);
	}
	else if (!strcmp(type, "warning"))
		b->warnings++;
	else
		b->other_frames++;
	json_decref(root);
}

static int callback_bench(struct lws *wsi, enum lws_callback_reasons reason, void *user,
			  void *in, size_t len)
{
	struct bench_conn *c = user;
	struct bench *b = c ? c->bench : NULL;

	switch (reason) {
	case LWS_CALLBACK_CLIENT_CONNECTION_ERROR:
		if (!c || c->state != CONN_CONNECTING)
			break;
		c->state = CONN_FAILED;
		c->wsi = NULL;
		b->failed++;
		b->connecting--;
		open_more(b);
		{
			static unsigned int logged;

			log_conn_problem(&logged, "cg_bench: connection %u failed: %s\n", c->index,
					 in ? (const char *)in : "(no reason given)");
		}
		check_connect_phase_over(b, false);
		break;

	case LWS_CALLBACK_CLIENT_ESTABLISHED:
		if (!c || c->state != CONN_CONNECTING)
			break;
		c->state = CONN_OPEN;
		c->wsi = wsi;
		b->established++;
		b->connecting--;
		b->open_now++;
		if (b->phase >= PHASE_STOP) {
			lws_callback_on_writable(wsi); /* closes it */
		} else if (b->opt.idle_s > 0) {
			if (b->opt.raw)
				mark_ready(c);
		} else {
			c->want_send = true;
			lws_callback_on_writable(wsi);
		}
		open_more(b); /* the next attempt; ends the connect phase after the last */
		break;

	case LWS_CALLBACK_CLIENT_WRITEABLE:
		if (!c || c->state != CONN_OPEN)
			break;
		if (b->phase >= PHASE_STOP) {
			lws_close_reason(wsi, LWS_CLOSE_STATUS_NORMAL, (unsigned char *)"bench over", 10);
			return -1;
		}
		if (c->want_send && !c->in_flight)
			return send_next_message(c);
		break;

	case LWS_CALLBACK_CLIENT_RECEIVE: {
		int64_t arrived_ns = now_ns();
		const char *msg;
		size_t msg_len;

		if (!c)
			break;
		if (lws_frame_is_binary(wsi)) {
			if (lws_is_final_fragment(wsi))
				b->binary_frames++;
			break;
		}
		if (!cg_wsrx_feed(&c->rx, lws_is_first_fragment(wsi), lws_is_final_fragment(wsi), in, len,
				  MAX_FRAME_BYTES, &msg, &msg_len))
			break;
		if (!msg)
			b->oversized_frames++;
		else
			handle_frame(c, msg, msg_len, arrived_ns);
		cg_wsrx_done(&c->rx);
		break;
	}

	case LWS_CALLBACK_WS_PEER_INITIATED_CLOSE:
		if (c && in && len >= 2)
			c->close_code = ((const unsigned char *)in)[0] << 8 |
					((const unsigned char *)in)[1];
		break;

	case LWS_CALLBACK_CLIENT_CLOSED:
		if (!c || c->state != CONN_OPEN)
			break;
		c->state = CONN_CLOSED;
		c->wsi = NULL;
		b->open_now--;
		if (b->opt.idle_s > 0 && !c->ready && b->phase == PHASE_CONNECT) {
			b->closed_unready++;
			check_connect_phase_over(b, false);
		}
		if (b->phase < PHASE_STOP) {
			static unsigned int logged;
			char detail[64];

			b->closed_early++;
			if (c->close_code)
				snprintf(detail, sizeof(detail), "close code %d", c->close_code);
			else
				snprintf(detail, sizeof(detail), "no close frame");
			log_conn_problem(&logged, "cg_bench: connection %u closed by the gateway (%s)\n",
					 c->index, detail);
			if (!b->open_now && b->phase != PHASE_CONNECT) {
				fprintf(stderr, "cg_bench: every connection is closed, ending the run\n");
				b->lost_all = true;
				start_stop(b);
			}
		} else if (!b->open_now) {
			finish_run(b);
		}
		break;

	case LWS_CALLBACK_WSI_DESTROY:
		if (c && c->wsi == wsi)
			c->wsi = NULL;
		break;

	default:
		break;
	}
	return 0;
}

static const struct lws_protocols protocols[] = {
	{ "cg-bench", callback_bench, 0, 0, 0, NULL, 0 },
	{ NULL, NULL, 0, 0, 0, NULL, 0 }, /* LWS_PROTOCOL_LIST_TERM is not in 4.1 */
};

/* ---- setup ---- */

/* ws://host[:port][/path], host may be an [IPv6] literal. Returns 0 or -1. */
static int parse_ws_url(const char *url, struct ws_target *t)
{
	const char *p, *host_end, *port_start = NULL;
	size_t host_len;

	memset(t, 0, sizeof(*t));
	if (!strncmp(url, "wss://", 6)) {
		fprintf(stderr, "cg_bench: wss:// is not supported; benchmark the gateway over ws://\n");
		return -1;
	}
	if (strncmp(url, "ws://", 5)) {
		fprintf(stderr, "cg_bench: --url must start with ws://: %s\n", url);
		return -1;
	}
	p = url + 5;
	if (*p == '[') {
		host_end = strchr(p, ']');
		if (!host_end) {
			fprintf(stderr, "cg_bench: unterminated [IPv6] host in %s\n", url);
			return -1;
		}
		p++;
		host_len = (size_t)(host_end - p);
		host_end++;
	} else {
		host_end = p + strcspn(p, ":/?");
		host_len = (size_t)(host_end - p);
	}
	if (!host_len || host_len >= sizeof(t->address)) {
		fprintf(stderr, "cg_bench: bad host in %s\n", url);
		return -1;
	}
	memcpy(t->address, p, host_len);
	t->port = 80;
	if (*host_end == ':') {
		char *end;
		long port;

		port_start = host_end + 1;
		errno = 0;
		port = strtol(port_start, &end, 10);
		if (errno || end == port_start || port < 1 || port > 65535 ||
		    (*end && *end != '/' && *end != '?')) {
			fprintf(stderr, "cg_bench: bad port in %s\n", url);
			return -1;
		}
		t->port = (int)port;
		host_end = end;
	} else if (*host_end && *host_end != '/' && *host_end != '?') {
		fprintf(stderr, "cg_bench: bad url %s\n", url);
		return -1;
	}
	if (snprintf(t->path, sizeof(t->path), "%s%s", *host_end == '/' ? "" : "/", host_end) >=
	    (int)sizeof(t->path)) {
		fprintf(stderr, "cg_bench: path too long in %s\n", url);
		return -1;
	}
	if (strchr(t->address, ':'))
		snprintf(t->host_header, sizeof(t->host_header), "[%s]:%d", t->address, t->port);
	else
		snprintf(t->host_header, sizeof(t->host_header), "%s:%d", t->address, t->port);
	return 0;
}

/* Raises RLIMIT_NOFILE to `need` if it can; returns the resulting soft limit. */
static rlim_t raise_fd_limit(rlim_t need)
{
	struct rlimit rl;

	if (getrlimit(RLIMIT_NOFILE, &rl))
		return 1024;
	if (rl.rlim_cur >= need)
		return rl.rlim_cur;
	if (rl.rlim_max != RLIM_INFINITY && rl.rlim_max < need) {
		struct rlimit both = { need, need }; /* works as root */

		if (!setrlimit(RLIMIT_NOFILE, &both))
			return need;
		need = rl.rlim_max;
	}
	rl.rlim_cur = need;
	if (setrlimit(RLIMIT_NOFILE, &rl))
		getrlimit(RLIMIT_NOFILE, &rl);
	return rl.rlim_cur;
}

static char *json_quote(const char *s, const char *what)
{
	json_t *str = json_string(s);
	char *out;

	if (!str) {
		fprintf(stderr, "cg_bench: %s is not valid UTF-8\n", what);
		return NULL;
	}
	out = json_dumps(str, JSON_ENCODE_ANY | JSON_COMPACT);
	json_decref(str);
	return out;
}

/* Starts connections until MAX_CONNECTING attempts are in progress or all are started. */
static void open_more(struct bench *b)
{
	if (b->opening)
		return;
	b->opening = true;
	while (b->next_to_open < b->opt.connections && b->connecting < MAX_CONNECTING &&
	       b->phase < PHASE_STOP) {
		unsigned int i = b->next_to_open++;
		struct bench_conn *c = &b->conns[i];
		struct lws_client_connect_info ci;

		memset(&ci, 0, sizeof(ci));
		ci.context = b->context;
		ci.address = b->target.address;
		ci.port = b->target.port;
		ci.path = b->target.path;
		ci.host = b->target.host_header;
		ci.protocol = b->opt.subprotocol;
		ci.local_protocol_name = protocols[0].name;
		ci.userdata = c;
		ci.pwsi = &c->wsi;

		c->bench = b;
		c->index = i;
		c->state = CONN_CONNECTING;
		b->connecting++;
		if (!lws_client_connect_via_info(&ci) && c->state == CONN_CONNECTING) {
			/* failed before any callback could report it */
			static unsigned int logged;

			c->state = CONN_FAILED;
			c->wsi = NULL;
			b->failed++;
			b->connecting--;
			log_conn_problem(&logged, "cg_bench: connection %u: %s\n", i,
					 "lws_client_connect_via_info failed");
		}
	}
	b->opening = false;
	check_connect_phase_over(b, false);
}

static void usage(FILE *out)
{
	fprintf(out,
		"usage: cg_bench [options]\n"
		"  --url URL              gateway endpoint (default " DEFAULT_URL ")\n"
		"  --connections N        concurrent connections (default 1)\n"
		"  --duration SECONDS     measured window (default 10)\n"
		"  --warmup SECONDS       traffic before the window, not recorded (default 1)\n"
		"  --text TEXT            message text (default \"" DEFAULT_TEXT "\")\n"
		"  --room ROOM            room of every message (default " DEFAULT_ROOM ")\n"
		"  --pid PID              gateway process, for its RSS and CPU with its children's\n"
		"                         (a master's workers; its own peak RSS)\n"
		"  --store-pid PID        the store's process (redis-server), for its CPU over the\n"
		"                         window (store_cpu_s)\n"
		"  --connect-timeout S    give up waiting for connections after S (default 10)\n"
		"  --subprotocol NAME     offer this Sec-WebSocket-Protocol (default none)\n"
		"  --raw                  a chat app, not chatgate: send {type,id,text}, expect no\n"
		"                         hello; done and error end a turn\n"
		"  --idle SECONDS         memory mode: open every connection, wait until each is\n"
		"                         ready (hello; open with --raw), hold them SECONDS, print\n"
		"                         --pid's RSS per connection (RESULT idle ...)\n"
		"  --progress             print a line per second to stderr\n"
		"  --verbose              libwebsockets notices and parse errors\n"
		"Each connection keeps one message in flight (closed loop). Prints a summary\n"
		"and a line: RESULT conns= msgs_per_sec= p50_ms= p99_ms= p999_ms= peak_rss_kb= ...\n");
}

static int parse_double(const char *s, const char *name, double min, double *out)
{
	char *end;

	errno = 0;
	*out = strtod(s, &end);
	if (errno || end == s || *end || *out < min || *out > 1e7) {
		fprintf(stderr, "cg_bench: bad %s: %s\n", name, s);
		return -1;
	}
	return 0;
}

static int parse_options(int argc, char **argv, struct bench_options *o)
{
	enum { OPT_URL = 1000, OPT_CONNS, OPT_DURATION, OPT_WARMUP, OPT_TEXT, OPT_ROOM, OPT_PID,
	       OPT_STORE_PID, OPT_CONNECT_TIMEOUT, OPT_SUBPROTOCOL, OPT_PROGRESS, OPT_VERBOSE, OPT_RAW, OPT_IDLE,
	       OPT_HELP };
	static const struct option longopts[] = {
		{ "url", required_argument, NULL, OPT_URL },
		{ "connections", required_argument, NULL, OPT_CONNS },
		{ "duration", required_argument, NULL, OPT_DURATION },
		{ "warmup", required_argument, NULL, OPT_WARMUP },
		{ "text", required_argument, NULL, OPT_TEXT },
		{ "room", required_argument, NULL, OPT_ROOM },
		{ "pid", required_argument, NULL, OPT_PID },
		{ "store-pid", required_argument, NULL, OPT_STORE_PID },
		{ "connect-timeout", required_argument, NULL, OPT_CONNECT_TIMEOUT },
		{ "subprotocol", required_argument, NULL, OPT_SUBPROTOCOL },
		{ "progress", no_argument, NULL, OPT_PROGRESS },
		{ "verbose", no_argument, NULL, OPT_VERBOSE },
		{ "raw", no_argument, NULL, OPT_RAW },
		{ "idle", required_argument, NULL, OPT_IDLE },
		{ "help", no_argument, NULL, OPT_HELP },
		{ NULL, 0, NULL, 0 },
	};
	int opt;

	o->url = DEFAULT_URL;
	o->connections = 1;
	o->duration_s = 10;
	o->warmup_s = 1;
	o->connect_timeout_s = 10;
	o->text = DEFAULT_TEXT;
	o->room = DEFAULT_ROOM;

	while ((opt = getopt_long(argc, argv, "h", longopts, NULL)) != -1) {
		char *end;
		long v;

		switch (opt) {
		case OPT_URL:
			o->url = optarg;
			break;
		case OPT_CONNS:
			errno = 0;
			v = strtol(optarg, &end, 10);
			if (errno || end == optarg || *end || v < 1 || v > (long)MAX_CONNECTIONS) {
				fprintf(stderr, "cg_bench: bad --connections: %s\n", optarg);
				return -1;
			}
			o->connections = (unsigned int)v;
			break;
		case OPT_DURATION:
			if (parse_double(optarg, "--duration", 0.001, &o->duration_s))
				return -1;
			break;
		case OPT_WARMUP:
			if (parse_double(optarg, "--warmup", 0, &o->warmup_s))
				return -1;
			break;
		case OPT_CONNECT_TIMEOUT:
			if (parse_double(optarg, "--connect-timeout", 0.1, &o->connect_timeout_s))
				return -1;
			break;
		case OPT_TEXT:
			o->text = optarg;
			break;
		case OPT_ROOM:
			o->room = optarg;
			break;
		case OPT_PID:
			errno = 0;
			v = strtol(optarg, &end, 10);
			if (errno || end == optarg || *end || v < 1) {
				fprintf(stderr, "cg_bench: bad --pid: %s\n", optarg);
				return -1;
			}
			o->pid = v;
			break;
		case OPT_STORE_PID:
			errno = 0;
			v = strtol(optarg, &end, 10);
			if (errno || end == optarg || *end || v < 1) {
				fprintf(stderr, "cg_bench: bad --store-pid: %s\n", optarg);
				return -1;
			}
			o->store_pid = v;
			break;
		case OPT_SUBPROTOCOL:
			o->subprotocol = optarg;
			break;
		case OPT_PROGRESS:
			o->progress = true;
			break;
		case OPT_VERBOSE:
			o->verbose = true;
			break;
		case OPT_RAW:
			o->raw = true;
			break;
		case OPT_IDLE:
			if (parse_double(optarg, "--idle", 0.001, &o->idle_s))
				return -1;
			break;
		case OPT_HELP:
		case 'h':
			usage(stdout);
			exit(0);
		default:
			usage(stderr);
			return -1;
		}
	}
	if (optind < argc) {
		fprintf(stderr, "cg_bench: unexpected argument: %s\n", argv[optind]);
		return -1;
	}
	return 0;
}

/* ---- report ---- */

static void print_report(struct bench *b)
{
	const struct latency_histogram *h = b->hist;
	double window_s = (double)(b->measure_end_ns - b->measure_start_ns) / NS_PER_S;
	double rate = window_s > 0 ? (double)b->done / window_s : 0;
	double p50 = (double)histogram_quantile(h, 0.50) / NS_PER_MS;
	double p99 = (double)histogram_quantile(h, 0.99) / NS_PER_MS;
	double p999 = (double)histogram_quantile(h, 0.999) / NS_PER_MS;
	double client_cpu_pct = window_s > 0 ? 100.0 * (b->cpu_at_measure_end_s -
							  b->cpu_at_measure_start_s) / window_s
					     : 0;
	double gateway_cpu_pct = -1;
	double idle_pct = machine_pct(&b->machine_at_measure_start, &b->machine_at_measure_end, 0);
	double steal_pct = machine_pct(&b->machine_at_measure_start, &b->machine_at_measure_end, 1);
	long peak_kb = -1;
	double store_cpu_s = -1; /* the store's CPU over the window, < 0: not measured */
	if (b->store_cpu_at_measure_start_s >= 0 && b->store_cpu_at_measure_end_s >= 0)
		store_cpu_s = b->store_cpu_at_measure_end_s - b->store_cpu_at_measure_start_s;
	if (window_s > 0 && b->gateway_cpu_at_measure_start_s >= 0 &&
	    b->gateway_cpu_at_measure_end_s >= 0)
		gateway_cpu_pct = 100.0 *
				  (b->gateway_cpu_at_measure_end_s - b->gateway_cpu_at_measure_start_s) /
				  window_s;
	if (b->opt.pid)
		peak_kb = b->hwm_kb > b->rss_peak_sampled_kb ? b->hwm_kb : b->rss_peak_sampled_kb;

	printf("cg_bench results (%s)\n", b->opt.url);
	printf("  connections        %u requested, %u established, %u failed, %u closed early\n",
	       b->opt.connections, b->established, b->failed, b->closed_early);
	printf("  warmup             %.3f s\n", b->opt.warmup_s);
	printf("  duration           %.3f s measured (%.3f s asked)%s%s\n", window_s,
	       b->opt.duration_s, b->interrupted ? ", interrupted" : "",
	       b->lost_all ? ", every connection lost" : "");
	printf("  messages completed %" PRIu64 " done\n", b->done);
	printf("  errors             %" PRIu64, b->errors);
	if (b->errors) {
		const char *sep = " (";

		if (b->cancelled) {
			printf("%scancelled=%" PRIu64, sep, b->cancelled);
			sep = ", ";
		}
		for (size_t i = 0; i < MAX_ERROR_CODES && b->error_codes[i].count; i++) {
			printf("%s%s=%" PRIu64, sep, b->error_codes[i].code, b->error_codes[i].count);
			sep = ", ";
		}
		if (b->error_codes_other)
			printf("%sother codes=%" PRIu64, sep, b->error_codes_other);
		printf(")");
	}
	printf("\n");
	printf("  messages/sec       %.1f\n", rate);
	if (h->total)
		printf("  turn latency ms    p50 %.3f  p99 %.3f  p99.9 %.3f  (min %.3f, mean %.3f, max %.3f)\n",
		       p50, p99, p999, (double)h->min_ns / NS_PER_MS,
		       h->sum_ns / (double)h->total / NS_PER_MS, (double)h->max_ns / NS_PER_MS);
	else
		printf("  turn latency ms    none recorded\n");
	printf("  frames             sent %" PRIu64 " messages; got %" PRIu64 " hello, %" PRIu64
	       " ack, %" PRIu64 " delta, %" PRIu64 " warning (whole run)\n",
	       b->sent_total, b->hellos, b->acks, b->deltas, b->warnings);
	if (b->unparsable_frames || b->oversized_frames || b->binary_frames || b->other_frames ||
	    b->stray_terminals)
		printf("  odd frames         %" PRIu64 " unparsable, %" PRIu64 " over %u bytes, %" PRIu64
		       " binary, %" PRIu64 " unknown type, %" PRIu64 " terminal for no message in flight\n",
		       b->unparsable_frames, b->oversized_frames, MAX_FRAME_BYTES, b->binary_frames,
		       b->other_frames, b->stray_terminals);
	printf("  in flight at end   %u (not counted)\n", b->in_flight_at_stop);
	printf("  client CPU         %.0f%% of one core%s\n", client_cpu_pct,
	       client_cpu_pct >= 85 ? " (cg_bench itself may be the bottleneck)" : "");
	if (gateway_cpu_pct >= 0)
		printf("  gateway CPU        %.0f%% of one core\n", gateway_cpu_pct);
	if (store_cpu_s >= 0 && b->done)
		printf("  store CPU          %.0f%% of one core, %.1f µs a turn\n", 100.0 * store_cpu_s / window_s,
		       store_cpu_s * 1e6 / (double)b->done);
	if (idle_pct >= 0)
		printf("  machine            %.1f%% of all CPUs' time idle, %.1f%% stolen by the hypervisor\n",
		       idle_pct, steal_pct);
	if (b->opt.pid && b->rss_samples)
		printf("  gateway pid %-6ld peak RSS %ld kB (VmHWM %ld kB, sampled VmRSS max %ld kB over %u samples, last %ld kB)%s\n",
		       b->opt.pid, peak_kb, b->hwm_kb, b->rss_peak_sampled_kb, b->rss_samples,
		       b->rss_last_kb, b->pid_gone ? ", process gone before the end" : "");
	else if (b->opt.pid)
		printf("  gateway pid %-6ld RSS unknown (no /proc/%ld/status)\n", b->opt.pid, b->opt.pid);
	else
		printf("  gateway RSS        not measured (no --pid)\n");
	printf("RESULT conns=%u msgs_per_sec=%.1f p50_ms=%.3f p99_ms=%.3f p999_ms=%.3f peak_rss_kb=%ld"
	       " msgs=%" PRIu64 " errors=%" PRIu64 " duration_s=%.3f client_cpu_pct=%.0f"
	       " gateway_cpu_pct=%.0f gateway_cpu_s=%.3f store_cpu_s=%.3f machine_idle_pct=%.1f machine_steal_pct=%.1f\n",
	       b->established, rate, p50, p99, p999, peak_kb, b->done, b->errors, window_s,
	       client_cpu_pct, gateway_cpu_pct,
	       gateway_cpu_pct >= 0 ? b->gateway_cpu_at_measure_end_s - b->gateway_cpu_at_measure_start_s
				    : -1.0,
	       store_cpu_s, idle_pct, steal_pct);
	fflush(stdout);
}

/* --idle: RSS growth per ready connection. Returns the exit status. */
static int print_idle_report(struct bench *b)
{
	double per_conn = -1;

	if (b->rss_before_kb >= 0 && b->rss_after_kb >= 0 && b->ready)
		per_conn = (double)(b->rss_after_kb - b->rss_before_kb) / b->ready;
	printf("cg_bench idle (%s)\n", b->opt.url);
	printf("  connections        %u requested, %u established, %u ready, %u failed, %u closed before ready\n",
	       b->opt.connections, b->established, b->ready, b->failed, b->closed_unready);
	printf("  held               %.3f s\n", (double)(b->measure_end_ns - b->measure_start_ns) / NS_PER_S);
	if (per_conn >= 0)
		printf("  pid %-6ld VmRSS    %ld kB before, %ld kB with every connection up: %.1f KiB each\n",
		       b->opt.pid, b->rss_before_kb, b->rss_after_kb, per_conn);
	else
		printf("  RSS                not measured (no --pid, or no /proc/PID/status)\n");
	printf("RESULT idle conns=%u ready=%u rss_before_kb=%ld rss_after_kb=%ld kib_per_conn=%.1f\n",
	       b->opt.connections, b->ready, b->rss_before_kb, b->rss_after_kb, per_conn);
	fflush(stdout);
	if (!b->ready || b->interrupted)
		return 1;
	return 0;
}

int main(int argc, char **argv)
{
	static struct bench bench; /* static: starts zeroed */
	struct bench *b = &bench;
	struct lws_context_creation_info info;
	rlim_t fd_limit;
	int rc = 0;

	if (parse_options(argc, argv, &b->opt))
		return 2;
	if (parse_ws_url(b->opt.url, &b->target))
		return 2;
	b->room_json = json_quote(b->opt.room, "--room");
	b->text_json = json_quote(b->opt.text, "--text");
	if (!b->room_json || !b->text_json)
		return 2;
	b->tx_cap = LWS_PRE + strlen(b->room_json) + strlen(b->text_json) + 128;
	b->tx = malloc(b->tx_cap);
	b->hist = calloc(1, sizeof(*b->hist));
	b->conns = calloc(b->opt.connections, sizeof(*b->conns));
	if (!b->tx || !b->hist || !b->conns) {
		fprintf(stderr, "cg_bench: out of memory\n");
		return 1;
	}

	fd_limit = raise_fd_limit((rlim_t)b->opt.connections + 64);
	if (fd_limit < (rlim_t)b->opt.connections + 16)
		fprintf(stderr, "cg_bench: open file limit is %llu, too low for %u connections; some will fail\n",
			(unsigned long long)fd_limit, b->opt.connections);

	signal(SIGINT, on_signal);
	signal(SIGTERM, on_signal);
	signal(SIGPIPE, SIG_IGN);
	lws_set_log_level(b->opt.verbose ? LLL_ERR | LLL_WARN | LLL_NOTICE : LLL_ERR, NULL);

	memset(&info, 0, sizeof(info));
	info.port = CONTEXT_PORT_NO_LISTEN;
	info.protocols = protocols;
	info.fd_limit_per_thread = (unsigned int)(fd_limit < (rlim_t)b->opt.connections + 32
						  ? fd_limit : (rlim_t)b->opt.connections + 32);
	info.connect_timeout_secs = (unsigned int)(b->opt.connect_timeout_s + 0.999);
	b->context = lws_create_context(&info);
	if (!b->context) {
		fprintf(stderr, "cg_bench: lws_create_context failed\n");
		return 1;
	}

	b->start_ns = now_ns();
	b->connect_deadline_ns = b->start_ns + (int64_t)(b->opt.connect_timeout_s * NS_PER_S) +
				 NS_PER_S; /* lws reports its own timeout first */
	b->phase = PHASE_CONNECT;
	sample_gateway_memory(b);
	b->rss_before_kb = b->rss_samples ? b->rss_last_kb : -1;
	lws_sul_schedule(b->context, 0, &b->tick_sul, tick, TICK_US);
	open_more(b);

	while (b->phase != PHASE_DONE) {
		if (lws_service(b->context, 0) < 0)
			break;
	}
	sample_gateway_memory(b);
	lws_sul_cancel(&b->tick_sul);
	lws_sul_cancel(&b->phase_sul);
	lws_context_destroy(b->context);

	if (b->fatal) {
		rc = 1;
	} else if (b->opt.idle_s > 0) {
		rc = print_idle_report(b);
	} else {
		print_report(b);
		if (!b->done) {
			fprintf(stderr, "cg_bench: no message completed in the measured window\n");
			rc = 1;
		} else if (b->lost_all || b->interrupted) {
			rc = 1;
		}
	}

	for (unsigned int i = 0; i < b->opt.connections; i++)
		cg_wsrx_done(&b->conns[i].rx);
	free(b->conns);
	free(b->hist);
	free(b->tx);
	free(b->room_json);
	free(b->text_json);
	return rc;
}
