/*
 * config.c: settings as table rows, filled from defaults, the environment, a JSON file and
 * the command line, in that order (later wins).
 *
 * Each setting is one row of `settings[]` (name, type, bounds, where it lives); the JSON
 * loader and the flag parser both go through the same row, so a value is checked the same
 * way wherever it comes from. Upstreams are the one structured setting: an object of
 * name -> {url, model, ...} in the file, `--upstream NAME=URL` on the command line.
 */
#define _GNU_SOURCE /* asprintf */
#include <errno.h>
#include <jansson.h>
#include <limits.h>
#include <sched.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "chatgate/core/alloc.h"
#include "chatgate/config/config.h"
#include "chatgate/config/dropin_config.h"
#include "chatgate/core/file.h"
#include "chatgate/core/log.h"
#include "chatgate/core/tls_ca.h"

typedef enum { T_STR, T_INT, T_ENUM, T_BOOL } setting_type; /* T_BOOL: a long, 0 or 1 */

typedef struct setting {
    const char *name; /* key in the JSON file; the flag is "--" + name with '_' as '-' */
    setting_type type;
    size_t offset;
    long min, max;             /* T_INT bounds */
    const char *const *choices; /* T_ENUM values, NULL-terminated; T_INT: a word allowed besides a
                                 * number ("auto"), stored as 0 (outside the bounds) */
    int flag;                  /* 1 when the setting is also a command-line flag */
    const char *help;
} setting;

static const char *const auth_choices[] = {"none", "jwt", "header", NULL};
static const char *const log_choices[] = {"error", "warn", "info", "debug", NULL};
static const char *const log_formats[] = {"text", "json", NULL};
static const char *const auto_word[] = {"auto", NULL};
static const char *const export_sinks[] = {"redis", "file", NULL};

#define OFF(f) offsetof(cg_config, f)
static const setting settings[] = {
    {"listen", T_STR, OFF(listen), 0, 0, NULL, 1, "HOST:PORT to listen on (default 127.0.0.1:8080)"},
    {"default_upstream", T_STR, OFF(default_upstream), 0, 0, NULL, 1,
     "NAME of the upstream messages go to (default: the first)"},
    {"store", T_STR, OFF(store), 0, 0, NULL, 1,
     "memory | redis[s]://[[USER]:PASSWORD@]HOST:PORT[/DB] | "
     "redis[s]-sentinel://[[USER]:PASSWORD@]HOST:PORT[,HOST:PORT...]/MASTER[/DB] | "
     "redis[s]-cluster://[[USER]:PASSWORD@]HOST:PORT[,HOST:PORT...] (default memory, or $REDIS_URL; rediss: TLS)"},
    {"rules", T_STR, OFF(rules_dir), 0, 0, NULL, 1, "DIR of *.rules files (default: the shipped rules)"},
    {"shadow_rules", T_STR, OFF(shadow_rules), 0, 0, NULL, 1,
     "DIR of a second rule set run beside the live one on every message, never acting: differences are counted "
     "and logged (default none)"},
    {"web", T_STR, OFF(web_dir), 0, 0, NULL, 1, "DIR served at / (default: the shipped demo page)"},
    {"auth", T_ENUM, OFF(auth), 0, 0, auth_choices, 1, "none | jwt | header: who the user is (default none: a signed resume token)"},
    {"log_level", T_ENUM, OFF(log_level), 0, 0, log_choices, 1, "error | warn | info | debug (default info)"},
    {"timezone", T_STR, OFF(timezone), 0, 0, NULL, 1,
     "ZONE for dates the rules read (\"tomorrow\", \"Feb 20\"), an IANA name such as Africa/Nairobi (default UTC)"},
    {"tls_ca_file", T_STR, OFF(tls_ca_file), 0, 0, NULL, 1,
     "FILE of PEM CA certificates that the certificates of https and wss upstreams and of the drop-in app may "
     "chain to, besides the system's (default: the system's alone)"},
    {"log_format", T_ENUM, OFF(log_format), 0, 0, log_formats, 1, "text | json: one line or one JSON object per event"},
    {"max_frame", T_INT, OFF(max_frame), 256, 16 << 20, NULL, 1, "BYTES, largest client frame (default 65536)"},
    {"max_connections", T_INT, OFF(max_connections), 1, 1000000, NULL, 1,
     "N WebSocket connections at once; more get 503 (default 1024)"},
    {"max_header_bytes", T_INT, OFF(max_header_bytes), 1024, 65535, NULL, 0,
     "BYTES of a request's headers; more gets HTTP 431"},
    {"queue_limit", T_INT, OFF(queue_limit), 1, 1024, NULL, 0,
     "N messages of a connection waiting for their dialog; more are refused"},
    {"rate_limit.messages_per_second", T_INT, OFF(rate_per_second), 1, 1000000, NULL, 0,
     "N chat messages a second per connection (token bucket rate)"},
    {"rate_limit.burst", T_INT, OFF(rate_burst), 1, 1000000, NULL, 0,
     "N chat messages a connection may send at once (token bucket size)"},
    {"max_reply_bytes", T_INT, OFF(max_reply_bytes), 1024, 64 << 20, NULL, 0,
     "BYTES of a reply's text kept for its done frame"},
    {"reply_window", T_INT, OFF(reply_window), 8, 65536, NULL, 0,
     "BYTES of a reply held back at most while it may become a match of a rule on replies"},
    {"send_buffer", T_INT, OFF(send_buffer), 4096, 16 << 20, NULL, 0,
     "BYTES waiting for a client before its upstream is paused"},
    {"ack_hold_ms", T_INT, OFF(ack_hold_ms), 0, 100, NULL, 0,
     "MS an ack waits for the reply's first frames to go out with them; 0 sends it alone at once"},
    {"resume.grace_ms", T_INT, OFF(resume_grace_ms), 0, 3600000, NULL, 0,
     "MS a reply goes on after its client left mid-reply, for a resume; 0 cancels it at the disconnect"},
    {"resume.max_parked", T_INT, OFF(resume_max_parked), 1, 1000000, NULL, 0,
     "N replies of gone clients kept at once; past it a disconnect cancels, as with resume off"},
    {"user_header", T_STR, OFF(user_header), 0, 0, NULL, 1,
     "NAME of the header a trusted proxy sets to the user id, with --auth header (default X-User-Id)"},
    {"allow_origin", T_STR, OFF(allow_origin), 0, 0, NULL, 1,
     "ORIGIN a browser may connect from besides loopback pages at its own port; repeatable; * allows all, null a file's page"},
    {"jwt.allow_no_exp", T_BOOL, OFF(jwt_allow_no_exp), 0, 1, NULL, 0,
     "with --auth jwt: accept tokens without exp"},
    {"lifetimes.params_s", T_INT, OFF(lifetimes.params_s), 1, 30L * 86400, NULL, 0, "SECONDS a dialog's params live"},
    {"lifetimes.dialog_s", T_INT, OFF(lifetimes.dialog_s), 1, 30L * 86400, NULL, 0,
     "SECONDS a dialog (its service and meta) lives after its last turn"},
    {"lifetimes.awaiting_s", T_INT, OFF(lifetimes.awaiting_s), 1, 86400, NULL, 0,
     "SECONDS an awaiting state set without a ttl lives"},
    {"lifetimes.soft_s", T_INT, OFF(lifetimes.soft_s), 1, 86400, NULL, 0, "SECONDS soft context lives"},
    {"lifetimes.history_s", T_INT, OFF(lifetimes.history_s), 1, 30L * 86400, NULL, 0,
     "SECONDS the history lives, renewed by every turn"},
    {"history_n", T_INT, OFF(lifetimes.history_n), 0, 200, NULL, 0, "N messages of history kept per dialog"},
    {"params_cap", T_INT, OFF(lifetimes.params_cap), 64, 1 << 20, NULL, 0,
     "BYTES of a dialog's params, as compact JSON"},
    {"lifetimes.profile_s", T_INT, OFF(lifetimes.profile_s), 1, 366L * 86400, NULL, 0,
     "SECONDS a user's profile lives after its last use (a turn reads it, a write renews it)"},
    {"profile_cap", T_INT, OFF(lifetimes.profile_cap), 64, 1 << 20, NULL, 0,
     "BYTES of a user's profile, as compact JSON; an update past it is refused whole"},
    {"tool_result_cap", T_INT, OFF(lifetimes.tool_result_cap), 64, 1 << 20, NULL, 0,
     "BYTES of a dialog's last tool result, as compact JSON (it goes back to the backend every turn)"},
    {"max_dialogs", T_INT, OFF(max_dialogs), 1, 100000000, NULL, 0,
     "N dialogs the memory store (and Redis's in-memory copy) holds; least recently used go first"},
    {"max_rooms_per_user", T_INT, OFF(max_rooms_per_user), 1, 1000000, NULL, 0,
     "N dialogs (rooms) one user keeps in the store; past it, the user's least recently used goes"},
    {"max_store_bytes", T_INT, OFF(max_store_bytes), 16384, 1L << 40, NULL, 0,
     "BYTES the memory store (and Redis's in-memory copy) holds; least recently used go first"},
    {"admin_listen", T_STR, OFF(admin_listen), 0, 0, NULL, 1,
     "HOST:PORT for the admin API alone (default: on --listen; on only with CHATGATE_ADMIN_TOKEN)"},
    {"ping_interval_s", T_INT, OFF(ping_interval_s), 1, 3600, NULL, 0, "SECONDS between pings of a quiet WebSocket"},
    {"idle_timeout_s", T_INT, OFF(idle_timeout_s), 2, 65535, NULL, 0,
     "SECONDS without any frame, not even a pong, before a WebSocket is closed; over ping_interval_s"},
    {"shutdown_timeout_s", T_INT, OFF(shutdown_timeout_s), 0, 3600, NULL, 1,
     "SECONDS replies in flight may take to finish after SIGTERM (default 10)"},
    {"workers", T_INT, OFF(workers), 1, CG_MAX_WORKERS, auto_word, 1,
     "N worker processes on the one port under a master that restarts them (default 1; more need --store redis://); "
     "auto: one per CPU the process may run on, as nginx's worker_processes auto (1 with the memory store)"},
    {"redis.prefix", T_STR, OFF(redis_prefix), 0, 0, NULL, 0,
     "TEXT starting every Redis key, up to 128 bytes, without '{' or '}'"},
    {"redis.bus", T_STR, OFF(redis_bus), 0, 0, NULL, 0,
     "redis[s]://[[USER]:PASSWORD@]HOST:PORT of a Redis (not twemproxy) for cancels between gateways (default: the "
     "store's)"},
    {"redis.command_timeout_ms", T_INT, OFF(redis_command_timeout_ms), 10, 600000, NULL, 0,
     "MILLISECONDS without an answer to a Redis command before its connection is dropped (Redis is away)"},
    {"redis.connect_timeout_ms", T_INT, OFF(redis_connect_timeout_ms), 10, 600000, NULL, 0,
     "MILLISECONDS a connection to Redis may take"},
    {"redis.writeback_max_bytes", T_INT, OFF(redis_writeback_max_bytes), 4096, 1L << 40, NULL, 0,
     "BYTES of dialogs held in memory for Redis's write-back while it is away"},
    {"redis.tls_ca_file", T_STR, OFF(redis_tls_ca_file), 0, 0, NULL, 0,
     "FILE of PEM CA certificates that Redis's certificates must chain to (rediss; default: the system's)"},
    {"redis.tls_cert_file", T_STR, OFF(redis_tls_cert_file), 0, 0, NULL, 0,
     "FILE of the PEM client certificate (chain) shown to Redis, for mutual TLS"},
    {"redis.tls_key_file", T_STR, OFF(redis_tls_key_file), 0, 0, NULL, 0,
     "FILE of its PEM key (default: in redis.tls_cert_file)"},
    {"redis.tls_server_name", T_STR, OFF(redis_tls_server_name), 0, 0, NULL, 0,
     "NAME Redis's certificates must be for (SNI too; default: each node's host or address)"},
    {"redis.tls_verify", T_BOOL, OFF(redis_tls_verify), 0, 1, NULL, 0,
     "true | false: check Redis's certificate and name (default true; false only for tests)"},
    {"redis.lease_ms", T_INT, OFF(redis_lease_ms), 1000, 3600000, NULL, 0,
     "MILLISECONDS of a dialog's lease across gateways: a killed holder frees the dialog after it"},
    {"export.to", T_ENUM, OFF(export_to), 0, 0, export_sinks, 0,
     "redis | file: where each finished turn's record goes, a Redis Stream in the store's Redis or JSON lines "
     "(default: no export)"},
    {"export.path", T_STR, OFF(export_path), 0, 0, NULL, 0,
     "FILE the records are appended to, with export.to file; reopened on SIGHUP"},
    {"export.max_bytes", T_INT, OFF(export_max_bytes), 0, 1L << 40, NULL, 0,
     "BYTES past which the file is renamed to FILE.1 and a new one started (0: only the operator rotates it)"},
    {"export.stream", T_STR, OFF(export_stream), 0, 0, NULL, 0,
     "NAME of the stream, with export.to redis: the key is redis.prefix:NAME"},
    {"export.max_len", T_INT, OFF(export_max_len), 0, 1000000000, NULL, 0,
     "N records the stream keeps, about (XADD MAXLEN ~; 0: never trimmed)"},
    {"export.texts", T_BOOL, OFF(export_texts), 0, 1, NULL, 0,
     "true | false: the message's and the reply's text go in the record"},
    {"export.mask", T_BOOL, OFF(export_mask), 0, 1, NULL, 0,
     "true | false: those texts are masked as log lines are (tokens, e-mail addresses, phone numbers)"},
    {"export.max_queue", T_INT, OFF(export_max_queue), 1, 1000000, NULL, 0,
     "N records held in memory while the export's sink is slow or away; more are dropped and counted"},
};
#undef OFF

typedef struct up_setting {
    const char *name;
    setting_type type;
    size_t offset;
    long min, max;
    const char *help; /* for --help-config */
} up_setting;

#define UOFF(f) offsetof(cg_upstream_config, f)
static const up_setting upstream_settings[] = {
    {"model", T_STR, UOFF(model), 0, 0, "OpenAI: the model of each request (default: \"default\")"},
    {"api_key_env", T_STR, UOFF(api_key_env), 0, 0, "OpenAI: the environment variable holding the bearer token"},
    {"system_prompt", T_STR, UOFF(system_prompt), 0, 0, "OpenAI: the system message"},
    {"state_tool", T_BOOL, UOFF(state_tool), 0, 1,
     "OpenAI: offer the model the function chatgate_state, whose call sets the dialog's state as a directive"},
    {"connect_timeout_ms", T_INT, UOFF(connect_timeout_ms), 1, 3600000, "MILLISECONDS until the request is sent"},
    {"first_byte_timeout_ms", T_INT, UOFF(first_byte_timeout_ms), 1, 3600000,
     "MILLISECONDS from the request until the answer starts"},
    {"idle_timeout_ms", T_INT, UOFF(idle_timeout_ms), 1, 3600000, "MILLISECONDS between chunks of the answer"},
    {"max_idle_connections", T_INT, UOFF(max_idle_connections), 0, 1024,
     "OpenAI: N kept-alive connections held idle for the next request (0: a new one per message)"},
    {"idle_keepalive_ms", T_INT, UOFF(idle_keepalive_ms), 1000, 3600000,
     "OpenAI: MILLISECONDS before an idle kept connection is closed"},
    {"replies_per_handle", T_INT, UOFF(replies_per_handle), 1, 100000,
     "OpenAI: N replies at once that share one libcurl handle and its connections"},
    {"delay_ms", T_INT, UOFF(delay_ms), 0, 60000, "demo: MILLISECONDS between words (0: all at once)"},
    {"out_ms", T_INT, UOFF(out_ms), 100, 3600000, "MILLISECONDS a replica that failed is not picked"},
    {"max_attempts", T_INT, UOFF(max_attempts), 1, CG_MAX_REPLICAS, "N replicas one message may be sent to"},
    {"history_n", T_INT, UOFF(history_n), 0, 200,
     "N of the dialog's last history messages this upstream gets (200: all the dialog keeps, history_n)"},
    {"fallback", T_STR, UOFF(fallback), 0, 0,
     "NAME of the upstream a message goes to when this one fails before any reply text"},
};
#undef UOFF

static void set_err(char *err, size_t errlen, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static void set_err(char *err, size_t errlen, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, errlen, fmt, ap);
    va_end(ap);
}

static void replace_str(char **slot, const char *value)
{
    free(*slot);
    *slot = value ? cg_strdup(value) : NULL;
}


void cg_lifetimes_default(cg_lifetimes *lt)
{
    lt->params_s = 6 * 3600;
    lt->dialog_s = 6 * 3600;
    lt->awaiting_s = 120;
    lt->soft_s = 300;
    lt->history_s = 30 * 60;
    lt->history_n = 10;
    lt->params_cap = 10000;
    lt->tool_result_cap = 16384;
    lt->profile_s = 30L * 86400;
    lt->profile_cap = 4096;
}

/* The CPUs this process may run on (its affinity mask, as taskset or a container's cpuset
 * leaves it), at most CG_MAX_WORKERS: what --workers auto runs. */
static long cpus_usable(void)
{
    cpu_set_t set;
    long n = sched_getaffinity(0, sizeof(set), &set) == 0 ? CPU_COUNT(&set) : sysconf(_SC_NPROCESSORS_ONLN);
    return n < 1 ? 1 : n > CG_MAX_WORKERS ? CG_MAX_WORKERS : n;
}

/* Parses a whole decimal number within [min, max]; 0 or -1. */
static int parse_long(const char *s, long min, long max, long *out)
{
    char *end;
    errno = 0;
    long v = strtol(s, &end, 10);
    if (errno || end == s || *end || v < min || v > max)
        return -1;
    *out = v;
    return 0;
}

/*
 * redis.prefix starts every Redis key, outside the dialog's {hash tag}: a '{' or '}' in it
 * would make the prefix (or part of it) the tag, so every dialog would land on one shard,
 * or keys of different dialogs share a slot (docs/state.md, "Redis layout").
 */
static int check_redis_prefix(const char *value, char *err, size_t errlen)
{
    if (strpbrk(value, "{}")) {
        set_err(err, errlen, "'%s' must not contain '{' or '}' (they would change the keys' hash tag)", value);
        return -1;
    }
    if (strlen(value) > CG_MAX_REDIS_PREFIX) {
        set_err(err, errlen, "must be 1 to %d bytes", CG_MAX_REDIS_PREFIX);
        return -1;
    }
    return 0;
}

/* Checks a string value beyond its type, for the keys that need it. */
static int check_string(const setting *st, const char *value, char *err, size_t errlen)
{
    if (!*value) {
        set_err(err, errlen, "must not be empty");
        return -1;
    }
    if (strcmp(st->name, "redis.prefix") == 0)
        return check_redis_prefix(value, err, errlen);
    if (strcmp(st->name, "redis.bus") == 0 && strncmp(value, "redis://", 8) != 0 && strncmp(value, "rediss://", 9) != 0) {
        set_err(err, errlen, "must be redis[s]://[[USER]:PASSWORD@]HOST:PORT (a Redis itself: twemproxy has no "
                             "SUBSCRIBE)");
        return -1;
    }
    return 0;
}

/* Applies one textual value to a setting row; on error writes "must be ..." to err. */
static int apply_setting(cg_config *cfg, const setting *st, const char *value, char *err, size_t errlen)
{
    void *field = (char *)cfg + st->offset;
    switch (st->type) {
    case T_STR:
        if (check_string(st, value, err, errlen) < 0)
            return -1;
        replace_str((char **)field, value);
        return 0;
    case T_BOOL:
        if (strcmp(value, "true") != 0 && strcmp(value, "false") != 0) {
            set_err(err, errlen, "'%s' must be true or false", value);
            return -1;
        }
        *(long *)field = strcmp(value, "true") == 0;
        return 0;
    case T_INT:
        if (st->choices && strcmp(value, st->choices[0]) == 0) {
            *(long *)field = 0;
            return 0;
        }
        if (parse_long(value, st->min, st->max, (long *)field) < 0) {
            set_err(err, errlen, "'%s' is not a whole number from %ld to %ld%s%s", value, st->min, st->max,
                    st->choices ? ", nor " : "", st->choices ? st->choices[0] : "");
            return -1;
        }
        return 0;
    case T_ENUM:
        for (const char *const *c = st->choices; *c; c++)
            if (strcmp(*c, value) == 0) {
                replace_str((char **)field, value);
                return 0;
            }
        set_err(err, errlen, "'%s' is not one of", value);
        for (const char *const *c = st->choices; *c; c++) {
            size_t used = strlen(err);
            snprintf(err + used, errlen - used, " %s", *c);
        }
        return -1;
    }
    return -1;
}

static const setting *find_setting(const char *name)
{
    for (size_t i = 0; i < sizeof(settings) / sizeof(settings[0]); i++)
        if (strcmp(settings[i].name, name) == 0)
            return &settings[i];
    return NULL;
}

/* ---- upstream URLs ---------------------------------------------------------------- */

int cg_config_parse_upstream_url(cg_upstream_config *u, const char *url, char *err, size_t errlen)
{
    static const struct { const char *prefix; cg_upstream_kind kind; int tls; int port; } schemes[] = {
        {"http://", CG_UPSTREAM_OPENAI, 0, 80},
        {"https://", CG_UPSTREAM_OPENAI, 1, 443},
        {"ws://", CG_UPSTREAM_WS, 0, 80},
        {"wss://", CG_UPSTREAM_WS, 1, 443},
    };
    free(u->host);
    free(u->path);
    free(u->authority);
    u->host = u->path = u->authority = NULL;
    replace_str(&u->url, url);
    if (strcmp(url, "demo") == 0 || strcmp(url, "demo:") == 0) {
        u->kind = CG_UPSTREAM_DEMO;
        return 0;
    }
    for (size_t i = 0; i < sizeof(schemes) / sizeof(schemes[0]); i++) {
        size_t plen = strlen(schemes[i].prefix);
        if (strncmp(url, schemes[i].prefix, plen) != 0)
            continue;
        const char *host = url + plen;
        const char *path = host + strcspn(host, "/?");
        const char *host_end = path;
        const char *colon = NULL;
        if (*host == '[') { /* [v6]:port */
            const char *close = memchr(host, ']', (size_t)(path - host));
            if (!close) {
                set_err(err, errlen, "'%s': unterminated '[' in the host", url);
                return -1;
            }
            colon = (close + 1 < path && close[1] == ':') ? close + 1 : NULL;
            host_end = colon ? colon : close + 1;
        } else {
            colon = memchr(host, ':', (size_t)(path - host));
            if (colon)
                host_end = colon;
        }
        if (host_end == host) {
            set_err(err, errlen, "'%s': no host", url);
            return -1;
        }
        if (schemes[i].kind == CG_UPSTREAM_WS && path - host > 110) { /* lws writes Host in 128 bytes */
            set_err(err, errlen, "'%s': the host[:port] is over 110 bytes", url);
            return -1;
        }
        long port = schemes[i].port;
        if (colon) {
            char buf[16];
            size_t n = (size_t)(path - colon - 1);
            if (n == 0 || n >= sizeof(buf)) {
                set_err(err, errlen, "'%s': bad port", url);
                return -1;
            }
            memcpy(buf, colon + 1, n);
            buf[n] = 0;
            if (parse_long(buf, 1, 65535, &port) < 0) {
                set_err(err, errlen, "'%s': port '%s' is not 1 to 65535", url, buf);
                return -1;
            }
        }
        const char *h = host, *he = host_end;
        if (*h == '[') { /* lws and getaddrinfo want the bare v6 address */
            h++;
            he--;
        }
        u->host = cg_strndup(h, (size_t)(he - h));
        u->authority = cg_strndup(host, (size_t)(path - host));
        u->port = (int)port;
        u->kind = schemes[i].kind;
        u->tls = schemes[i].tls;
        if (u->kind == CG_UPSTREAM_OPENAI) {
            /* A base URL: drop a trailing '/' so "{base}/chat/completions" has one. */
            size_t plen2 = strlen(path);
            while (plen2 > 0 && path[plen2 - 1] == '/')
                plen2--;
            u->path = cg_strndup(path, plen2);
        } else {
            u->path = cg_strdup(*path == '/' ? path : "/");
            if (*path == '?') { /* "ws://h:1?x" means path "/?x" */
                free(u->path);
                size_t n = strlen(path) + 2;
                u->path = cg_malloc(n);
                snprintf(u->path, n, "/%s", path);
            }
        }
        return 0;
    }
    set_err(err, errlen, "'%s': the scheme must be demo, http://, https://, ws:// or wss://", url);
    return -1;
}

static cg_upstream_config *upstream_upsert(cg_config *cfg, const char *name, char *err, size_t errlen)
{
    for (int i = 0; i < cfg->n_upstreams; i++)
        if (strcmp(cfg->upstreams[i].name, name) == 0)
            return &cfg->upstreams[i];
    if (cfg->n_upstreams == CG_MAX_UPSTREAMS) {
        set_err(err, errlen, "more than %d upstreams", CG_MAX_UPSTREAMS);
        return NULL;
    }
    size_t n = strlen(name);
    if (n == 0 || n > 64 || strspn(name, "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-") != n) {
        set_err(err, errlen, "upstream name '%s' must be 1 to 64 letters, digits, '_' or '-'", name);
        return NULL;
    }
    cg_upstream_config *u = &cfg->upstreams[cfg->n_upstreams++];
    memset(u, 0, sizeof(*u));
    u->name = cg_strdup(name);
    u->connect_timeout_ms = 5000;
    u->history_n = 200;
    u->first_byte_timeout_ms = 60000;
    u->idle_timeout_ms = 60000;
    u->max_idle_connections = 16;
    u->idle_keepalive_ms = 30000;
    u->replies_per_handle = CG_REPLIES_PER_HANDLE;
    u->delay_ms = 30;
    u->api_key_env = cg_strdup("CHATGATE_UPSTREAM_API_KEY");
    u->system_prompt = cg_strdup("You are a helpful assistant.");
    u->out_ms = 10000;
    u->max_attempts = 3;
    u->fallback_index = -1;
    return u;
}

/* ---- the JSON file ---------------------------------------------------------------- */

/* upstreams.NAME.urls: 1 to CG_MAX_REPLICAS URLs of one upstream's replicas, all of one
 * kind (http:// or https:// of an OpenAI-compatible server, ws:// or wss:// of a chat
 * app); the first is its url. */
static int load_replicas(cg_upstream_config *u, json_t *urls, char *err, size_t errlen)
{
    size_t i;
    json_t *one;
    if (!json_is_array(urls) || json_array_size(urls) < 1 || json_array_size(urls) > CG_MAX_REPLICAS) {
        set_err(err, errlen, "must be a list of 1 to %d URLs", CG_MAX_REPLICAS);
        return -1;
    }
    for (int r = 0; r < u->n_replicas; r++)
        free(u->replicas[r]);
    u->n_replicas = 0;
    int first_kind = -1;
    json_array_foreach(urls, i, one) {
        cg_upstream_config probe = {0};
        const char *s = json_string_value(one);
        int rc = s ? cg_config_parse_upstream_url(&probe, s, err, errlen) : -1;
        int kind = probe.kind;
        cg_upstream_config_free(&probe);
        if (first_kind < 0)
            first_kind = kind;
        if (rc < 0 || kind == CG_UPSTREAM_DEMO || kind != first_kind) {
            if (rc == 0 || !s)
                set_err(err, errlen, "[%zu]: replicas are all of one kind: http:// or https:// URLs of an "
                        "OpenAI-compatible upstream, or ws:// or wss:// URLs of a chat app", i);
            return -1;
        }
        u->replicas[u->n_replicas++] = cg_strdup(s);
    }
    return cg_config_parse_upstream_url(u, u->replicas[0], err, errlen);
}

static int load_upstream_object(cg_config *cfg, const char *file, const char *name, json_t *obj,
                                char *err, size_t errlen)
{
    char msg[256];
    if (json_is_string(obj)) { /* "llm": "http://..." is short for {"url": ...} */
        cg_upstream_config *u = upstream_upsert(cfg, name, msg, sizeof(msg));
        if (!u || cg_config_parse_upstream_url(u, json_string_value(obj), msg, sizeof(msg)) < 0) {
            set_err(err, errlen, "%s: upstreams.%s: %s", file, name, msg);
            return -1;
        }
        return 0;
    }
    if (!json_is_object(obj)) {
        set_err(err, errlen, "%s: upstreams.%s: must be an object or a URL string", file, name);
        return -1;
    }
    json_t *url = json_object_get(obj, "url"), *urls = json_object_get(obj, "urls");
    if (!json_is_string(url) && !urls) {
        set_err(err, errlen, "%s: upstreams.%s.url: missing, or not a string (or give \"urls\")", file, name);
        return -1;
    }
    cg_upstream_config *u = upstream_upsert(cfg, name, msg, sizeof(msg));
    if (!u)
        goto bad_url;
    if (urls ? load_replicas(u, urls, msg, sizeof(msg)) < 0
             : cg_config_parse_upstream_url(u, json_string_value(url), msg, sizeof(msg)) < 0)
        goto bad_url;
    const char *key;
    json_t *val;
    json_object_foreach(obj, key, val) {
        if (strcmp(key, "url") == 0 || strcmp(key, "urls") == 0)
            continue;
        if (strcmp(key, "balance") == 0) {
            const char *b = json_string_value(val);
            if (!b || (strcmp(b, "dialog") && strcmp(b, "least_busy"))) {
                set_err(err, errlen, "%s: upstreams.%s.balance: must be \"dialog\" or \"least_busy\"", file, name);
                return -1;
            }
            u->least_busy = strcmp(b, "least_busy") == 0;
            continue;
        }
        if (strcmp(key, "headers") == 0) {
            char where[128];
            snprintf(where, sizeof(where), "upstreams.%s.headers", name);
            cg_headers_free(&u->headers);
            if (cg_headers_load(val, where, &u->headers, msg, sizeof(msg)) < 0) {
                set_err(err, errlen, "%s: %s", file, msg);
                return -1;
            }
            continue;
        }
        const up_setting *st = NULL;
        for (size_t i = 0; i < sizeof(upstream_settings) / sizeof(upstream_settings[0]); i++)
            if (strcmp(upstream_settings[i].name, key) == 0)
                st = &upstream_settings[i];
        if (!st) {
            set_err(err, errlen, "%s: upstreams.%s.%s: unknown key", file, name, key);
            return -1;
        }
        void *field = (char *)u + st->offset;
        if (st->type == T_STR) {
            if (!json_is_string(val)) {
                set_err(err, errlen, "%s: upstreams.%s.%s: must be a string", file, name, key);
                return -1;
            }
            replace_str((char **)field, json_string_value(val));
        } else if (st->type == T_BOOL) {
            if (!json_is_boolean(val)) {
                set_err(err, errlen, "%s: upstreams.%s.%s: must be true or false", file, name, key);
                return -1;
            }
            *(int *)field = json_is_true(val);
        } else {
            json_int_t v = json_is_integer(val) ? json_integer_value(val) : LLONG_MIN;
            if (v < st->min || v > st->max) {
                set_err(err, errlen, "%s: upstreams.%s.%s: must be a whole number from %ld to %ld",
                        file, name, key, st->min, st->max);
                return -1;
            }
            *(int *)field = (int)v;
        }
    }
    return 0;
bad_url:
    set_err(err, errlen, "%s: upstreams.%s.%s: %s", file, name, urls ? "urls" : "url", msg);
    return -1;
}

/* Applies one JSON value to the setting named path ("max_frame", "rate_limit.burst"). */
static int load_json_value(cg_config *cfg, const char *file, const char *path, json_t *val,
                           char *err, size_t errlen)
{
    const setting *st = find_setting(path);
    if (!st) {
        set_err(err, errlen, "%s: %s: unknown key", file, path);
        return -1;
    }
    char text[64];
    const char *value;
    /* a T_INT key's word ("auto") is the one string it takes: a number in quotes is refused, as
     * for every other whole-number key */
    if (st->type == T_INT && st->choices && json_is_string(val) &&
        strcmp(json_string_value(val), st->choices[0]) == 0) {
        value = json_string_value(val);
    } else if (st->type == T_INT) {
        if (!json_is_integer(val)) {
            if (st->choices)
                set_err(err, errlen, "%s: %s: must be a whole number or \"%s\"", file, path, st->choices[0]);
            else
                set_err(err, errlen, "%s: %s: must be a whole number", file, path);
            return -1;
        }
        snprintf(text, sizeof(text), "%" JSON_INTEGER_FORMAT, json_integer_value(val));
        value = text;
    } else if (st->type == T_BOOL) {
        if (!json_is_boolean(val)) {
            set_err(err, errlen, "%s: %s: must be true or false", file, path);
            return -1;
        }
        value = json_is_true(val) ? "true" : "false";
    } else {
        if (!json_is_string(val)) {
            set_err(err, errlen, "%s: %s: must be a string", file, path);
            return -1;
        }
        value = json_string_value(val);
    }
    char msg[256];
    if (apply_setting(cfg, st, value, msg, sizeof(msg)) < 0) {
        set_err(err, errlen, "%s: %s: %s", file, path, msg);
        return -1;
    }
    return 0;
}

/* Appends one origin to the comma-separated allow list; -1 if it holds a comma. */
static int add_origin(cg_config *cfg, const char *origin)
{
    if (!*origin || strchr(origin, ','))
        return -1;
    size_t n = (cfg->allow_origin ? strlen(cfg->allow_origin) + 1 : 0) + strlen(origin) + 1;
    char *list = cg_malloc(n);
    snprintf(list, n, "%s%s%s", cfg->allow_origin ? cfg->allow_origin : "", cfg->allow_origin ? "," : "", origin);
    free(cfg->allow_origin);
    cfg->allow_origin = list;
    return 0;
}

/* "services": {"travel": {"defaults": {"cabin_class": "economy"},
 *                         "profile_defaults": {"from": "home_city"}}} */
static int load_services(cg_config *cfg, const char *file, json_t *val, char *err, size_t errlen)
{
    if (!json_is_object(val)) {
        set_err(err, errlen, "%s: services: must be an object of name -> {\"defaults\": {...}}", file);
        return -1;
    }
    const char *name;
    json_t *svc;
    json_object_foreach(val, name, svc) {
        const char *key;
        json_t *v;
        if (!json_is_object(svc)) {
            set_err(err, errlen, "%s: services.%s: must be an object", file, name);
            return -1;
        }
        json_object_foreach(svc, key, v) {
            if (strcmp(key, "defaults") != 0 && strcmp(key, "profile_defaults") != 0) {
                set_err(err, errlen, "%s: services.%s.%s: unknown key (defaults, profile_defaults)", file, name, key);
                return -1;
            }
            if (!json_is_object(v)) {
                set_err(err, errlen, "%s: services.%s.%s: must be an object of name -> %s", file, name, key,
                        key[0] == 'd' ? "value" : "the profile attribute it defaults to");
                return -1;
            }
            const char *param;
            json_t *attr;
            json_object_foreach(v, param, attr) {
                if (key[0] == 'p' && !json_is_string(attr)) {
                    set_err(err, errlen, "%s: services.%s.profile_defaults.%s: must be the name of a profile attribute",
                            file, name, param);
                    return -1;
                }
            }
        }
    }
    json_decref(cfg->services);
    cfg->services = json_incref(val);
    return 0;
}

/*
 * jansson keeps no positions for values, so "file: a.b.c: message" is turned into
 * "file:line:col: a.b.c: message" by finding "a", then "b" after it, then "c" after that,
 * in the file's text (NUL-terminated): the place the user has to look. Left as it is when
 * not found.
 */
static void add_position(const char *file, const char *text, char *err, size_t errlen)
{
    size_t flen = strlen(file);
    if (strncmp(err, file, flen) != 0 || strncmp(err + flen, ": ", 2) != 0)
        return;
    const char *path = err + flen + 2;
    const char *path_end = strstr(path, ": ");
    if (!path_end)
        return;
    const char *at = text, *found = NULL;
    for (const char *key = path; key < path_end;) {
        size_t klen = strcspn(key, ".:");
        char *quoted;
        if (asprintf(&quoted, "\"%.*s\"", (int)klen, key) < 0)
            return;
        found = strstr(at, quoted);
        if (found)
            at = found + strlen(quoted);
        free(quoted);
        if (!found)
            return;
        key += klen;
        if (*key == '.')
            key++;
        else
            break;
    }
    int line = 1, col = 1;
    for (const char *p = text; p < found; p++) {
        if (*p == '\n') {
            line++;
            col = 1;
        } else {
            col++;
        }
    }
    char *rest = cg_strdup(path);
    snprintf(err, errlen, "%s:%d:%d: %s", file, line, col, rest);
    free(rest);
}

/* Applies the settings of one parsed file; "file: key: message" on a mistake. */
/* The drop-in app (checked with the mapping): its URL and its headers, the environment's
 * values read once, here. */
static int load_dropin_app(cg_config *cfg, const char *file, json_t *dropin, char *err, size_t errlen)
{
    char msg[256];
    cg_upstream_config_free(&cfg->dropin_app);
    if (cg_config_parse_upstream_url(&cfg->dropin_app, json_string_value(json_object_get(dropin, "app")), msg,
                                     sizeof(msg)) < 0) {
        set_err(err, errlen, "%s: dropin.app: %s", file, msg);
        return -1;
    }
    if (cg_headers_load(json_object_get(dropin, "headers"), "dropin.headers", &cfg->dropin_app.headers, msg,
                        sizeof(msg)) < 0) {
        set_err(err, errlen, "%s: %s", file, msg);
        return -1;
    }
    return 0;
}

static int load_root(cg_config *cfg, const char *file, json_t *root, char *err, size_t errlen)
{
    if (!json_is_object(root)) {
        set_err(err, errlen, "%s:1:1: the configuration must be a JSON object", file);
        return -1;
    }
    const char *key;
    json_t *val;
    json_object_foreach(root, key, val) {
        if (strcmp(key, "upstreams") == 0) {
            if (!json_is_object(val)) {
                set_err(err, errlen, "%s: upstreams: must be an object of name -> {\"url\": ...}", file);
                return -1;
            }
            const char *name;
            json_t *up;
            json_object_foreach(val, name, up) {
                if (load_upstream_object(cfg, file, name, up, err, errlen) < 0)
                    return -1;
            }
        } else if (strcmp(key, "dropin") == 0) {
            if (cg_dropin_config_check(val, file, err, errlen) < 0 || load_dropin_app(cfg, file, val, err, errlen) < 0)
                return -1;
            json_decref(cfg->dropin);
            cfg->dropin = json_incref(val);
        } else if (strcmp(key, "services") == 0) {
            if (load_services(cfg, file, val, err, errlen) < 0)
                return -1;
        } else if (strcmp(key, "limits") == 0) {
            if (cg_limits_config_load(&cfg->limits, file, val, err, errlen) < 0)
                return -1;
        } else if (strcmp(key, "allow_origin") == 0 && json_is_array(val)) {
            size_t i;
            json_t *o;
            json_array_foreach(val, i, o) {
                if (!json_is_string(o) || add_origin(cfg, json_string_value(o)) < 0) {
                    set_err(err, errlen, "%s: allow_origin[%zu]: must be an origin string without ','", file, i);
                    return -1;
                }
            }
        } else if (json_is_object(val)) { /* rate_limit, lifetimes, redis, jwt: "key.sub" rows */
            const char *sub;
            json_t *sval;
            json_object_foreach(val, sub, sval) {
                char *path; /* built with its real length: a cut name could be another key */
                if (asprintf(&path, "%s.%s", key, sub) < 0) {
                    set_err(err, errlen, "%s: %s: out of memory", file, key);
                    return -1;
                }
                int rc = load_json_value(cfg, file, path, sval, err, errlen);
                free(path);
                if (rc < 0)
                    return -1;
            }
        } else if (load_json_value(cfg, file, key, val, err, errlen) < 0) {
            return -1;
        }
    }
    return 0;
}

/* Parses the text of a config file named file (len bytes, not NUL-terminated) into cfg. */
static int load_text(cg_config *cfg, const char *file, const char *text, size_t len, char *err, size_t errlen)
{
    json_error_t jerr;
    json_t *root = json_loadb(text, len, JSON_REJECT_DUPLICATES, &jerr);
    if (!root) {
        if (jerr.line < 0)
            set_err(err, errlen, "%s: %s", file, jerr.text);
        else
            set_err(err, errlen, "%s:%d:%d: %s", file, jerr.line, jerr.column, jerr.text);
        return -1;
    }
    int rc = load_root(cfg, file, root, err, errlen);
    json_decref(root);
    if (rc < 0) {
        char *copy = cg_strndup(text, len); /* the text holds no NUL: jansson parsed it */
        add_position(file, copy, err, errlen);
        free(copy);
    }
    return rc;
}

/* Reads the whole file (at most CG_MAX_CONFIG_FILE bytes; core/file.h: a FIFO too, as
 * `--config <(...)` gives) and loads it. */
static int load_file(cg_config *cfg, const char *file, char *err, size_t errlen)
{
    size_t n = 0;
    char *text = cg_file_read(file, CG_MAX_CONFIG_FILE, &n, err, errlen);
    if (!text)
        return -1;
    int rc = load_text(cfg, file, text, n, err, errlen);
    free(text);
    return rc;
}

const char *cg_config_store_name(const cg_config *cfg)
{
    static const char *const names[2][4] = {{"memory", "redis", "redis-sentinel", "redis-cluster"},
                                            {"memory", "rediss", "rediss-sentinel", "rediss-cluster"}};
    return names[cfg->store_tls ? 1 : 0][cfg->store_kind];
}

json_t *cg_config_service_defaults(const cg_config *cfg, const char *service)
{
    return service ? json_object_get(json_object_get(cfg->services, service), "defaults") : NULL;
}

/* Without a "services" section, the travel service's origin defaults to the user's home city
 * (the shipped rules/15-profile.rules remembers it); a configured section says its own. */
json_t *cg_config_profile_defaults(const cg_config *cfg, const char *service)
{
    static json_t *builtin;
    if (!service)
        return NULL;
    if (cfg->services)
        return json_object_get(json_object_get(cfg->services, service), "profile_defaults");
    if (!builtin)
        builtin = json_pack("{s:s}", "from", "home_city"); /* lives for the process */
    return strcmp(service, "travel") == 0 ? builtin : NULL;
}

/* ---- flags -------------------------------------------------------------------------- */

void cg_config_usage(const char *prog)
{
    printf("Usage: %s [options]\n"
           "       %s --config FILE [options]\n\n"
           "chatgate: a WebSocket gateway between chat clients and LLM or app backends.\n\n",
           prog, prog);
    printf("  --%-18s %s\n", "upstream NAME=URL",
           "an upstream; URL is demo, http(s)://BASE (OpenAI-compatible) or ws(s)://HOST/PATH "
           "(a chat app); repeatable (default demo=demo)");
    for (size_t i = 0; i < sizeof(settings) / sizeof(settings[0]); i++) {
        if (!settings[i].flag)
            continue;
        char flag[64];
        snprintf(flag, sizeof(flag), "%s", settings[i].name);
        for (char *p = flag; *p; p++)
            if (*p == '_')
                *p = '-';
        printf("  --%-18s %s\n", flag, settings[i].help);
    }
    printf("  --%-18s %s\n", "config FILE", "a JSON file with these settings and more (docs/configuration.md); flags win");
    printf("  --%-18s %s\n", "help", "this text");
    printf("  --%-18s %s\n", "help-config", "every key of the config file, one a line: KEY, TYPE, default, meaning");
    printf("  --%-18s %s\n", "version", "the version");
}

/* Maps "--max-frame" to its row; NULL when the flag is not a setting. */
static const setting *flag_setting(const char *flag)
{
    char name[64];
    if (strlen(flag) >= sizeof(name))
        return NULL;
    snprintf(name, sizeof(name), "%s", flag);
    for (char *p = name; *p; p++)
        if (*p == '-')
            *p = '_';
    const setting *st = find_setting(name);
    return st && st->flag ? st : NULL;
}

/*
 * Splits argv[*i] into flag name and value ("--x=v" or "--x v"). Returns 0, -1 when the
 * value is missing, or -2 when the name does not fit in name (no flag is that long; a cut
 * name must not pass for a real one). Flags without a value (help, help-config, version) get NULL.
 */
static int next_flag(int argc, char **argv, int *i, char *name, size_t namelen, const char **value)
{
    const char *arg = argv[*i] + 2;
    const char *eq = strchr(arg, '=');
    size_t n = eq ? (size_t)(eq - arg) : strlen(arg);
    if (n >= namelen) {
        snprintf(name, namelen, "%.*s", (int)namelen - 1, arg);
        return -2;
    }
    memcpy(name, arg, n);
    name[n] = 0;
    if (strcmp(name, "help") == 0 || strcmp(name, "version") == 0 || strcmp(name, "help-config") == 0) {
        *value = NULL;
        return 0;
    }
    if (eq) {
        *value = eq + 1;
        return 0;
    }
    if (*i + 1 >= argc)
        return -1;
    *value = argv[++*i];
    return 0;
}

static int apply_flag(cg_config *cfg, const char *name, const char *value, char *err, size_t errlen)
{
    char msg[256];
    if (strcmp(name, "upstream") == 0) {
        const char *eq = strchr(value, '=');
        if (!eq || eq == value) {
            set_err(err, errlen, "--upstream: '%s' must be NAME=URL", value);
            return -1;
        }
        char *upname = cg_strndup(value, (size_t)(eq - value)); /* the whole name, checked by upsert */
        cg_upstream_config *u = upstream_upsert(cfg, upname, msg, sizeof(msg));
        free(upname);
        if (!u || cg_config_parse_upstream_url(u, eq + 1, msg, sizeof(msg)) < 0) {
            set_err(err, errlen, "--upstream: %s", msg);
            return -1;
        }
        return 0;
    }
    if (strcmp(name, "allow-origin") == 0) {
        if (add_origin(cfg, value) < 0) {
            set_err(err, errlen, "--allow-origin: '%s' must be one origin (repeat the flag for more)", value);
            return -1;
        }
        return 0;
    }
    const setting *st = flag_setting(name);
    if (!st) {
        set_err(err, errlen, "--%s: unknown option (see --help)", name);
        return -1;
    }
    if (apply_setting(cfg, st, value, msg, sizeof(msg)) < 0) {
        set_err(err, errlen, "--%s: %s", name, msg);
        return -1;
    }
    return 0;
}

/* ---- defaults and checks ------------------------------------------------------------ */

static int is_dir(const char *path)
{
    struct stat sb;
    return stat(path, &sb) == 0 && S_ISDIR(sb.st_mode);
}

/*
 * The shipped rules/ and web/: next to the installed binary (<prefix>/share/chatgate/NAME),
 * then the install prefix chosen at build time, then the source tree (a build not installed).
 */
static char *default_data_dir(const char *name)
{
    char exe[PATH_MAX], path[PATH_MAX + 64];
    ssize_t n = readlink("/proc/self/exe", exe, sizeof(exe) - 1);
    if (n > 0) {
        exe[n] = 0;
        char *slash = strrchr(exe, '/');
        if (slash) {
            *slash = 0;
            snprintf(path, sizeof(path), "%s/../share/chatgate/%s", exe, name);
            if (is_dir(path))
                return realpath(path, NULL);
        }
    }
    snprintf(path, sizeof(path), "%s/%s", CG_DATADIR, name);
    if (is_dir(path))
        return cg_strdup(path);
    snprintf(path, sizeof(path), "%s/%s", CG_SOURCE_DIR, name);
    return cg_strdup(path);
}

/* HOST:PORT (or [v6]:PORT) into host and port; 0, or -1 with err. */
static int parse_host_port(const char *s, char **host, int *port, const char *where, char *err, size_t errlen)
{
    const char *colon = strrchr(s, ':');
    long p;
    if (!colon || colon == s || parse_long(colon + 1, 1, 65535, &p) < 0) {
        set_err(err, errlen, "%s: '%s' must be HOST:PORT with a port from 1 to 65535", where, s);
        return -1;
    }
    const char *h = s, *he = colon;
    if (*h == '[' && he[-1] == ']') {
        h++;
        he--;
    }
    free(*host);
    *host = cg_strndup(h, (size_t)(he - h));
    *port = (int)p;
    return 0;
}

static int parse_listen(cg_config *cfg, const char *where, char *err, size_t errlen)
{
    return parse_host_port(cfg->listen, &cfg->listen_host, &cfg->listen_port, where, err, errlen);
}

/* Where a setting came from, for messages about values checked after loading. */
static void origin_of(const char *key, const char *flag, int from_flag, const char *file,
                      char *out, size_t outlen)
{
    if (from_flag)
        snprintf(out, outlen, "--%s", flag);
    else if (file)
        snprintf(out, outlen, "%s: %s", file, key);
    else
        snprintf(out, outlen, "%s", key);
}

static int flag_given(int argc, char **argv, const char *flag)
{
    size_t n = strlen(flag);
    for (int i = 1; i < argc; i++)
        if (strncmp(argv[i], "--", 2) == 0 && strncmp(argv[i] + 2, flag, n) == 0 &&
            (argv[i][2 + n] == 0 || argv[i][2 + n] == '='))
            return 1;
    return 0;
}

/* Each upstream's fallback names another upstream. */
static int check_fallbacks(cg_config *cfg, const char *file, char *err, size_t errlen)
{
    for (int i = 0; i < cfg->n_upstreams; i++) {
        cg_upstream_config *u = &cfg->upstreams[i];
        u->fallback_index = -1;
        for (int j = 0; u->fallback && j < cfg->n_upstreams; j++)
            if (j != i && strcmp(cfg->upstreams[j].name, u->fallback) == 0)
                u->fallback_index = j;
        if (u->fallback && u->fallback_index < 0) {
            set_err(err, errlen, "%s: upstreams.%s.fallback: no other upstream named '%s'", file ? file : "flags",
                    u->name, u->fallback);
            return -1;
        }
    }
    return 0;
}

/* The export's keys together: a file needs its path, a stream the store's Redis, and a size
 * bound one process (workers would each rename the file they all append to). */
static int check_export(const cg_config *cfg, const char *file, char *err, size_t errlen)
{
    const char *where = file ? file : "the configuration";
    if (!cfg->export_to)
        return 0;
    if (strcmp(cfg->export_to, "file") == 0 && !cfg->export_path) {
        set_err(err, errlen, "%s: export.to file needs export.path", where);
        return -1;
    }
    if (strcmp(cfg->export_to, "redis") == 0 && cfg->store_kind == CG_STORE_MEMORY) {
        set_err(err, errlen, "%s: export.to redis needs a Redis store (--store redis://...): the memory store "
                             "has no stream", where);
        return -1;
    }
    if (strcmp(cfg->export_to, "file") == 0 && cfg->export_max_bytes > 0 && cfg->workers > 1) {
        set_err(err, errlen, "%s: export.max_bytes with %ld workers: each would rotate the file the others "
                             "append to; rotate it with SIGHUP (logrotate's postrotate) instead", where, cfg->workers);
        return -1;
    }
    return 0;
}

static int check(cg_config *cfg, int argc, char **argv, const char *file, char *err, size_t errlen)
{
    char where[PATH_MAX + 64];
    origin_of("listen", "listen", flag_given(argc, argv, "listen"), file, where, sizeof(where));
    if (parse_listen(cfg, where, err, errlen) < 0)
        return -1;

    if (cfg->n_upstreams == 0) {
        char msg[64];
        cg_upstream_config *u = upstream_upsert(cfg, "demo", msg, sizeof(msg));
        cg_config_parse_upstream_url(u, "demo", msg, sizeof(msg));
    }
    cfg->default_index = 0;
    if (cfg->default_upstream) {
        cfg->default_index = -1;
        for (int i = 0; i < cfg->n_upstreams; i++)
            if (strcmp(cfg->upstreams[i].name, cfg->default_upstream) == 0)
                cfg->default_index = i;
        if (cfg->default_index < 0) {
            origin_of("default_upstream", "default-upstream", flag_given(argc, argv, "default-upstream"),
                      file, where, sizeof(where));
            set_err(err, errlen, "%s: no upstream named '%s'", where, cfg->default_upstream);
            return -1;
        }
    } else {
        cfg->default_upstream = cg_strdup(cfg->upstreams[0].name);
    }
    if (check_fallbacks(cfg, file, err, errlen) < 0)
        return -1;

    origin_of("store", "store", flag_given(argc, argv, "store"), file, where, sizeof(where));
    /* the store checks the rest of a Redis URL when it opens (exit 2 too, "store: ...") */
    static const struct {
        const char *scheme;
        cg_store_kind kind;
        int tls;
    } schemes[] = {
        {"redis://", CG_STORE_REDIS, 0},       {"rediss://", CG_STORE_REDIS, 1},
        {"redis-sentinel://", CG_STORE_SENTINEL, 0}, {"rediss-sentinel://", CG_STORE_SENTINEL, 1},
        {"redis-cluster://", CG_STORE_CLUSTER, 0},   {"rediss-cluster://", CG_STORE_CLUSTER, 1},
    };
    int known = strcmp(cfg->store, "memory") == 0;
    cfg->store_kind = CG_STORE_MEMORY;
    cfg->store_tls = 0;
    for (size_t i = 0; i < sizeof(schemes) / sizeof(schemes[0]) && !known; i++)
        if (strncmp(cfg->store, schemes[i].scheme, strlen(schemes[i].scheme)) == 0) {
            known = 1;
            cfg->store_kind = schemes[i].kind;
            cfg->store_tls = schemes[i].tls;
        }
    if (!known) {
        set_err(err, errlen,
                "%s: must be memory, redis[s]://HOST:PORT[/DB], "
                "redis[s]-sentinel://HOST:PORT[,HOST:PORT...]/MASTER[/DB] or redis[s]-cluster://HOST:PORT[,HOST:PORT...]%s",
                where,
                getenv("REDIS_URL") ? " (REDIS_URL is set in the environment)" : "");
        return -1;
    }
    if (cfg->workers == 0) { /* auto */
        cfg->workers_auto = 1;
        cfg->workers = cfg->store_kind == CG_STORE_MEMORY ? 1 : cpus_usable();
    }
    if (cfg->workers > 1 && cfg->store_kind == CG_STORE_MEMORY) {
        /* each worker would keep its own dialogs: a user's next message, on another
         * worker, would find none (and the dialog lock would not hold across them) */
        origin_of("workers", "workers", flag_given(argc, argv, "workers"), file, where, sizeof(where));
        set_err(err, errlen, "%s: %ld workers need a shared store: --store redis://...", where, cfg->workers);
        return -1;
    }
    if (check_export(cfg, file, err, errlen) < 0)
        return -1;
    if (strcmp(cfg->timezone, "UTC") != 0) {
        char zone[PATH_MAX];
        snprintf(zone, sizeof(zone), "/usr/share/zoneinfo/%s", cfg->timezone);
        struct stat sb;
        if (strlen(cfg->timezone) > 255 || strstr(cfg->timezone, "..") || stat(zone, &sb) != 0 ||
            !S_ISREG(sb.st_mode)) {
            origin_of("timezone", "timezone", flag_given(argc, argv, "timezone"), file, where, sizeof(where));
            set_err(err, errlen, "%s: '%s' is not a time zone of this machine (an IANA name such as Africa/Nairobi)",
                    where, cfg->timezone);
            return -1;
        }
    }
    if (cfg->tls_ca_file) {
        char why[512];
        if (!(cfg->tls_ca = cg_tls_ca_load(cfg->tls_ca_file, why, sizeof(why)))) {
            origin_of("tls_ca_file", "tls-ca-file", flag_given(argc, argv, "tls-ca-file"), file, where, sizeof(where));
            set_err(err, errlen, "%s: %s", where, why);
            return -1;
        }
    }
    if (cfg->admin_listen) {
        origin_of("admin_listen", "admin-listen", flag_given(argc, argv, "admin-listen"), file, where, sizeof(where));
        if (parse_host_port(cfg->admin_listen, &cfg->admin_host, &cfg->admin_port, where, err, errlen) < 0)
            return -1;
    }
    if (cfg->idle_timeout_s <= cfg->ping_interval_s) {
        set_err(err, errlen, "%s%sidle_timeout_s: must be longer than ping_interval_s (%ld)", file ? file : "",
                file ? ": " : "", cfg->ping_interval_s);
        return -1;
    }
    /* auth_choices' order: none, jwt, header (the enum's) */
    cfg->auth_kind = strcmp(cfg->auth, "jwt") == 0 ? CG_AUTH_JWT : strcmp(cfg->auth, "header") == 0 ? CG_AUTH_HEADER
                                                                                                   : CG_AUTH_NONE;
    if (cfg->auth_kind == CG_AUTH_JWT && !(getenv("CHATGATE_JWT_SECRET") && *getenv("CHATGATE_JWT_SECRET"))) {
        origin_of("auth", "auth", flag_given(argc, argv, "auth"), file, where, sizeof(where));
        set_err(err, errlen, "%s: jwt needs the secret in the environment variable CHATGATE_JWT_SECRET", where);
        return -1;
    }
    static const struct { const char *key; size_t offset; const char *dir; } dirs[] = {
        {"rules", offsetof(cg_config, rules_dir), "rules"},
        {"web", offsetof(cg_config, web_dir), "web"},
    };
    for (size_t i = 0; i < 2; i++) {
        char **slot = (char **)((char *)cfg + dirs[i].offset);
        if (!*slot)
            *slot = default_data_dir(dirs[i].dir);
        if (!is_dir(*slot)) {
            origin_of(dirs[i].key, dirs[i].key, flag_given(argc, argv, dirs[i].key), file, where, sizeof(where));
            set_err(err, errlen, "%s: '%s' is not a directory", where, *slot);
            return -1;
        }
    }
    if (cfg->shadow_rules && !is_dir(cfg->shadow_rules)) {
        origin_of("shadow_rules", "shadow-rules", flag_given(argc, argv, "shadow-rules"), file, where, sizeof(where));
        set_err(err, errlen, "%s: '%s' is not a directory", where, cfg->shadow_rules);
        return -1;
    }
    return 0;
}

static void set_defaults(cg_config *cfg)
{
    memset(cfg, 0, sizeof(*cfg));
    cfg->listen = cg_strdup("127.0.0.1:8080");
    cfg->store = cg_strdup("memory");
    cfg->auth = cg_strdup("none");
    cfg->log_level = cg_strdup("info");
    cfg->log_format = cg_strdup("text");
    cfg->timezone = cg_strdup("UTC");
    cfg->max_frame = 65536;
    cfg->max_connections = 1024;
    cfg->max_header_bytes = 16384;
    cfg->queue_limit = 8;
    cfg->rate_per_second = 20;
    cfg->rate_burst = 40;
    cfg->max_reply_bytes = 1 << 20;
    cfg->reply_window = 64;
    cfg->send_buffer = 64 * 1024;
    cfg->ack_hold_ms = 5;
    cfg->resume_grace_ms = 30000;
    cfg->resume_max_parked = 10000;
    cg_lifetimes_default(&cfg->lifetimes);
    cfg->max_dialogs = 100000;
    cfg->max_rooms_per_user = 1000;
    cfg->max_store_bytes = (long)CG_MEMSTORE_DEFAULT_MAX_BYTES;
    cfg->redis_prefix = cg_strdup("chatgate");
    cfg->redis_command_timeout_ms = 1000;
    cfg->redis_connect_timeout_ms = 1000;
    cfg->redis_writeback_max_bytes = 64L << 20;
    cfg->redis_lease_ms = 15000;
    cfg->redis_tls_verify = 1;
    cfg->user_header = cg_strdup("X-User-Id");
    cfg->ping_interval_s = 30;
    cfg->idle_timeout_s = 300;
    cfg->shutdown_timeout_s = 10;
    cfg->workers = 1;
    cfg->export_stream = cg_strdup("export");
    cfg->export_max_len = 100000;
    cfg->export_texts = 1;
    cfg->export_max_queue = 4096;
}

/* ---- --help-config ------------------------------------------------------------------ */

/*
 * The keys that are no row of the tables above: the structured ones load_upstream_object,
 * load_services, limits_config.c and dropin_config.c read themselves. Written out here,
 * beside the tables, so that --help-config lists every key the file may hold: the man page
 * (docs/chatgate.1) is held to that list, and a file with the keys is loaded, by
 * tests/e2e/test_manpage.py. A key added to one of those loaders belongs here too.
 */
typedef struct key_doc {
    const char *key, *type, *def, *help; /* def "-": none, or as help says */
} key_doc;

/* upstreams.NAME.KEY besides upstream_settings[]: how the upstream is reached */
static const key_doc upstream_keys[] = {
    {"url", "url", "-",
     "demo, http(s)://BASE (OpenAI-compatible) or ws(s)://HOST/PATH (a chat app), as --upstream; "
     "upstreams.NAME may also be the URL alone"},
    {"urls", "list", "-", "1 to 16 replicas' URLs (all http(s) or all ws(s)), instead of url"},
    {"balance", "enum dialog|least_busy", "dialog",
     "a dialog keeps its replica, or the replica with the fewest requests in flight"},
    {"headers", "object", "-",
     "extra headers on each request or handshake: {\"Name\": \"value\"} or {\"Name\": {\"env\": \"VARIABLE\"}}"},
};

static const key_doc structured_keys[] = {
    {"services.NAME.defaults", "object", "-", "params every dialog of service NAME starts from"},
    {"services.NAME.profile_defaults", "object", "-",
     "param -> the profile attribute it defaults to when the dialog has none (travel: from -> home_city)"},
    {"limits.messages_per_minute", "integer 0..1000000", "0", "chat messages a user may send a minute (0: no limit)"},
    {"limits.turns_at_once", "integer 0..100000", "0", "turns of a user running at once (0: no limit)"},
    {"limits.tokens_per_minute", "integer 0..1000000000000", "0", "tokens a user may spend a minute (0: no limit)"},
    {"limits.tokens_per_day", "integer 0..1000000000000", "0", "tokens a user may spend a UTC day (0: no limit)"},
    {"limits.plan_claim", "string", "-", "the JWT claim naming the user's plan"},
    {"limits.plans.NAME", "object", "-",
     "plan NAME: messages_per_minute, turns_at_once, tokens_per_minute, tokens_per_day over the limits above"},
    {"limits.users.USER", "string", "-", "the plan of user id USER: a NAME of limits.plans, or default"},
    {"dropin.path", "string", "-", "the app's WebSocket path, served by chatgate (not /ws); sets drop-in mode"},
    {"dropin.app", "url", "-", "the app's ws:// or wss:// URL; the client's path and query are appended"},
    {"dropin.codec", "enum json|socket.io|text", "json", "how a frame becomes the value pointers and markers read"},
    {"dropin.subprotocols", "list", "-", "subprotocols accepted from clients and passed on (at most 8)"},
    {"dropin.forward_headers", "list", "Cookie,Authorization", "the client's headers passed on to the app (at most 8)"},
    {"dropin.user_cookie", "string", "-", "the cookie whose hash is the dialog's user"},
    {"dropin.host", "string", "app",
     "the Host of the app's handshake: app (the app URL's host:port), client (the client's) or HOST[:PORT]"},
    {"dropin.headers", "object", "-", "extra handshake headers, as upstreams.NAME.headers"},
    {"dropin.client.chat", "marker", "-", "what marks a client frame as a chat message"},
    {"dropin.client.text", "pointer", "-", "the message's text in a chat message"},
    {"dropin.client.room", "pointer", "-", "the message's room"},
    {"dropin.client.id", "pointer", "-", "the message's id"},
    {"dropin.client.cancel", "marker", "-", "what marks a client frame as a cancel"},
    {"dropin.client.cancel_id", "pointer", "-", "the id of the message a cancel stops"},
    {"dropin.client.arguments", "integer 1..16", "-",
     "socket.io codec: the chat event's argument count (default: the highest the client pointers name)"},
    {"dropin.app_frames.text", "pointer", "-", "the reply's text in an app frame"},
    {"dropin.app_frames.id", "pointer", "-", "the id of the message an app frame answers"},
    {"dropin.app_frames.end", "marker", "-", "what marks the end of a reply"},
    {"dropin.app_frames.cancelled", "marker", "-", "what marks a reply the app stopped"},
    {"dropin.app_frames.reply", "marker", "-", "which app frames are reply frames at all"},
    {"dropin.app_frames.cancel_frame", "object|list|string", "-",
     "the frame sent to the app to stop a reply, \"{id}\" standing for its id"},
    {"dropin.object_key", "string", "chatgate", "the key the chatgate object goes under"},
    {"dropin.object_at", "pointer", "-",
     "where the chatgate object goes: the object there, or appended to the array of a pointer ending in /-"},
    {"dropin.state_key", "string", "-", "json codec: the key of a state directive in the app's frames"},
    {"dropin.namespace", "string", "/", "socket.io codec: the namespace of the chat events"},
    {"dropin.turn_timeout_ms", "integer 100..3600000", "60000",
     "MILLISECONDS a turn may wait for a frame of its reply from the app"},
    {"dropin.reply_gap_ms", "integer 100..3600000", "-",
     "MILLISECONDS of quiet that end a reply once begun (default 2000 without app_frames.end)"},
};

static void print_key(const char *prefix, const char *key, const char *type, const char *def, const char *help)
{
    printf("%s%s\t%s\t%s\t%s\n", prefix, key, type, def && *def ? def : "-", help);
}

/* A row's type as --help-config writes it: string, boolean, integer MIN..MAX, enum A|B. */
static void type_text(setting_type type, long min, long max, const char *const *choices, char *out, size_t outlen)
{
    if (type == T_INT) {
        snprintf(out, outlen, "integer %ld..%ld%s%s", min, max, choices ? " | " : "", choices ? choices[0] : "");
    } else if (type == T_ENUM) {
        snprintf(out, outlen, "enum");
        for (const char *const *c = choices; *c; c++) {
            size_t used = strlen(out);
            snprintf(out + used, outlen - used, "%c%s", c == choices ? ' ' : '|', *c);
        }
    } else {
        snprintf(out, outlen, "%s", type == T_BOOL ? "boolean" : "string");
    }
}

/*
 * --help-config: every key of the file, "KEY<TAB>TYPE<TAB>default<TAB>meaning" a line, the
 * rows written from the tables the loader reads, with the defaults of set_defaults and
 * upstream_upsert themselves (not the environment's), so the list cannot drift from them.
 */
static void help_config(void)
{
    static cg_config d; /* static: cg_config is large */
    char type[256], def[64], msg[128];
    set_defaults(&d);
    for (size_t i = 0; i < sizeof(settings) / sizeof(settings[0]); i++) {
        const setting *st = &settings[i];
        void *field = (char *)&d + st->offset;
        const char *value = def;
        type_text(st->type, st->min, st->max, st->choices, type, sizeof(type));
        if (st->type == T_INT)
            snprintf(def, sizeof(def), "%ld", *(long *)field);
        else if (st->type == T_BOOL)
            value = *(long *)field ? "true" : "false";
        else
            value = *(char **)field;
        /* allow_origin is one origin a flag, and a string or a list of them in the file (load_root) */
        print_key("", st->name, strcmp(st->name, "allow_origin") == 0 ? "string|list" : type, value, st->help);
    }
    for (size_t i = 0; i < sizeof(upstream_keys) / sizeof(upstream_keys[0]); i++)
        print_key("upstreams.NAME.", upstream_keys[i].key, upstream_keys[i].type, upstream_keys[i].def,
                  upstream_keys[i].help);
    cg_upstream_config *u = upstream_upsert(&d, "NAME", msg, sizeof(msg)); /* for its defaults */
    for (size_t i = 0; u && i < sizeof(upstream_settings) / sizeof(upstream_settings[0]); i++) {
        const up_setting *st = &upstream_settings[i];
        void *field = (char *)u + st->offset;
        const char *value = def;
        type_text(st->type, st->min, st->max, NULL, type, sizeof(type));
        if (st->type == T_INT)
            snprintf(def, sizeof(def), "%d", *(int *)field);
        else if (st->type == T_BOOL)
            value = *(int *)field ? "true" : "false";
        else
            value = *(char **)field;
        print_key("upstreams.NAME.", st->name, type, value, st->help);
    }
    for (size_t i = 0; i < sizeof(structured_keys) / sizeof(structured_keys[0]); i++)
        print_key("", structured_keys[i].key, structured_keys[i].type, structured_keys[i].def,
                  structured_keys[i].help);
    cg_config_free(&d);
}

/* The environment's defaults, over set_defaults' own (apart so --help-config shows those). */
static void env_defaults(cg_config *cfg)
{
    const char *redis = getenv("REDIS_URL");
    if (redis && *redis)
        replace_str(&cfg->store, redis);
}

int cg_config_load(cg_config *cfg, int argc, char **argv, char *err, size_t errlen)
{
    set_defaults(cfg);
    env_defaults(cfg);
    char name[64];
    const char *value;
    const char *file = NULL;

    /* The file first, wherever --config stands, so that every flag wins over it. */
    for (int i = 1; i < argc; i++) {
        if (strncmp(argv[i], "--", 2) != 0) {
            set_err(err, errlen, "'%s': unexpected argument (see --help)", argv[i]);
            return CG_CONFIG_EXIT_USAGE;
        }
        int got = next_flag(argc, argv, &i, name, sizeof(name), &value);
        if (got == -2) {
            set_err(err, errlen, "--%.40s...: unknown option (see --help)", name);
            return CG_CONFIG_EXIT_USAGE;
        }
        if (got < 0) {
            set_err(err, errlen, "--%s: needs a value", name);
            return CG_CONFIG_EXIT_USAGE;
        }
        if (strcmp(name, "help") == 0) {
            cg_config_usage(argv[0]);
            return CG_CONFIG_EXIT_OK;
        }
        if (strcmp(name, "version") == 0) {
            printf("chatgate %s\n", CG_VERSION);
            return CG_CONFIG_EXIT_OK;
        }
        if (strcmp(name, "help-config") == 0) {
            help_config();
            return CG_CONFIG_EXIT_OK;
        }
        if (strcmp(name, "config") == 0)
            file = value;
    }
    if (file && load_file(cfg, file, err, errlen) < 0)
        return CG_CONFIG_EXIT_USAGE;
    for (int i = 1; i < argc; i++) {
        next_flag(argc, argv, &i, name, sizeof(name), &value);
        if (strcmp(name, "config") == 0)
            continue;
        if (apply_flag(cfg, name, value, err, errlen) < 0)
            return CG_CONFIG_EXIT_USAGE;
    }
    if (check(cfg, argc, argv, file, err, errlen) < 0)
        return CG_CONFIG_EXIT_USAGE;
    return 0;
}

int cg_config_load_text(cg_config *cfg, const char *name, const char *text, size_t len, char *err, size_t errlen)
{
    set_defaults(cfg);
    env_defaults(cfg);
    char *argv[] = {"chatgate", NULL};
    if (load_text(cfg, name, text, len, err, errlen) < 0 || check(cfg, 1, argv, name, err, errlen) < 0)
        return CG_CONFIG_EXIT_USAGE;
    return 0;
}

void cg_upstream_config_free(cg_upstream_config *u)
{
    free(u->name);
    free(u->url);
    free(u->host);
    free(u->authority);
    free(u->path);
    free(u->model);
    free(u->api_key_env);
    free(u->system_prompt);
    cg_headers_free(&u->headers);
    for (int i = 0; i < u->n_replicas; i++)
        free(u->replicas[i]);
    free(u->fallback);
    memset(u, 0, sizeof(*u));
}

void cg_config_free(cg_config *cfg)
{
    for (int i = 0; i < cfg->n_upstreams; i++)
        cg_upstream_config_free(&cfg->upstreams[i]);
    for (size_t i = 0; i < sizeof(settings) / sizeof(settings[0]); i++)
        if (settings[i].type == T_STR || settings[i].type == T_ENUM)
            free(*(char **)((char *)cfg + settings[i].offset));
    free(cfg->listen_host);
    free(cfg->admin_host);
    cg_tls_ca_free(cfg->tls_ca);
    json_decref(cfg->services);
    cg_limits_config_free(&cfg->limits);
    json_decref(cfg->dropin);
    cg_upstream_config_free(&cfg->dropin_app);
    memset(cfg, 0, sizeof(*cfg));
}
