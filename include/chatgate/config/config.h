/*
 * config.h: the process's settings, from defaults, the environment, a JSON file and flags.
 *
 * Precedence: built-in defaults < environment (REDIS_URL) < --config FILE < flags.
 * Every mistake is reported as docs/architecture.md ("Operations") says: "file:line:col: message" for JSON
 * syntax, "file: key: message" for a wrong value, "--flag: message" for a flag; the caller
 * exits with status 2. Secrets never live here: they are read from the environment when used.
 */
#ifndef CHATGATE_CONFIG_H
#define CHATGATE_CONFIG_H

#include <jansson.h>
#include <stddef.h>

#include "chatgate/config/headers.h"
#include "chatgate/config/limits_config.h"

#define CG_MAX_UPSTREAMS 32
#define CG_MAX_REPLICAS 16 /* URLs of one upstream (upstreams.NAME.urls) */
#define CG_MAX_CONFIG_FILE (16 << 20) /* bytes of a --config file */
#define CG_MAX_WORKERS 64            /* --workers */
#define CG_MAX_REDIS_PREFIX 128       /* bytes of redis.prefix */
#define CG_MEMSTORE_DEFAULT_MAX_BYTES ((size_t)256 << 20) /* max_store_bytes */

/* How long each part of a dialog lives (lifetimes.* in the config file). */
typedef struct cg_lifetimes {
    long params_s;   /* 6 h */
    long dialog_s;   /* 6 h, touched on activity */
    long awaiting_s; /* 2 min, unless the directive says ttl */
    long soft_s;     /* 5 min */
    long history_s;  /* 30 min, renewed on activity */
    long history_n;  /* 10 messages */
    long params_cap; /* 10,000 bytes of params per dialog */
    long tool_result_cap; /* 16,384 bytes of the last tool result, handed back to backends */
    long profile_s;       /* 30 days: a user's profile, renewed by use */
    long profile_cap;     /* 4,096 bytes of a user's profile */
} cg_lifetimes;

void cg_lifetimes_default(cg_lifetimes *lt);

typedef enum cg_upstream_kind {
    CG_UPSTREAM_DEMO,
    CG_UPSTREAM_OPENAI, /* http:// or https:// */
    CG_UPSTREAM_WS,     /* ws:// or wss:// */
} cg_upstream_kind;

/* upstreams.NAME.replies_per_handle when the configuration does not say (docs/protocol.md,
 * "Upstreams": why libcurl's handles take a bounded number of replies) */
#define CG_REPLIES_PER_HANDLE 500

typedef struct cg_upstream_config {
    char *name;
    char *url;
    cg_upstream_kind kind;
    int tls;
    char *host;          /* NULL for demo */
    int port;
    char *authority;     /* host[:port] as the URL gives it: the Host header of its requests */
    char *path;          /* base path, "" or "/v1"; for ws the request path with query */
    char *model;         /* OpenAI: the "model" of each request */
    char *api_key_env;   /* OpenAI: environment variable holding the bearer token */
    char *system_prompt; /* OpenAI: the first system message */
    int state_tool;      /* OpenAI: the model is offered chatgate_state, a call of which sets state */
    int history_n;       /* the last N of the dialog's history messages it gets (200: all) */
    int connect_timeout_ms;
    int first_byte_timeout_ms;
    int idle_timeout_ms;
    int max_idle_connections; /* OpenAI: kept-alive connections held idle (16; 0 = none kept) */
    int idle_keepalive_ms;    /* OpenAI: an idle kept connection is closed after this (30 s) */
    int replies_per_handle;   /* OpenAI: transfers one libcurl multi handle runs at once */
    int delay_ms; /* demo: pause between words */
    cg_headers headers; /* openai, ws: sent on each request or handshake (headers.h) */
    /* replicas and failing over (docs/upstreams.md, "Replicas, retries and fallback"): the URLs of one
     * OpenAI-compatible upstream (url is the first), how a message picks one, how long one
     * that failed stays out, how many attempts a message gets, and the upstream it falls
     * back to when they are spent */
    char *replicas[CG_MAX_REPLICAS];
    int n_replicas;     /* 0 for a single url (the upstream's one replica) */
    int least_busy;     /* balance "least_busy"; else "dialog" (affinity by user and room) */
    int out_ms;         /* a replica that failed is out for this long (10000), or Retry-After */
    int max_attempts;   /* replicas tried for one message (3) */
    char *fallback;     /* another upstream's name, or NULL */
    int fallback_index; /* its index, -1 for none (set by the config's check) */
} cg_upstream_config;

/* --auth, parsed once (cg_config.auth keeps the word, for messages). */
typedef enum { CG_AUTH_NONE, CG_AUTH_JWT, CG_AUTH_HEADER } cg_auth_kind;
/* --store's scheme, parsed once (the store reads the rest of the URL when it opens). */
typedef enum { CG_STORE_MEMORY, CG_STORE_REDIS, CG_STORE_SENTINEL, CG_STORE_CLUSTER } cg_store_kind;

typedef struct cg_config {
    char *listen;      /* "HOST:PORT" as given */
    char *listen_host; /* parsed from listen */
    int listen_port;
    cg_upstream_config upstreams[CG_MAX_UPSTREAMS];
    int n_upstreams;
    char *default_upstream;
    int default_index; /* index of default_upstream in upstreams */
    char *store;
    cg_store_kind store_kind; /* store's scheme */
    int store_tls;            /* rediss: TLS to Redis */
    char *rules_dir;
    char *shadow_rules; /* --shadow-rules DIR, or NULL */
    char *web_dir;
    char *auth;
    cg_auth_kind auth_kind;   /* auth, parsed */
    char *log_level;
    char *log_format;
    char *timezone; /* IANA name ("Africa/Nairobi"); dates are this zone's */
    char *tls_ca_file; /* PEM CA certificates upstreams may chain to besides the system's, or NULL */
    struct cg_tls_ca *tls_ca; /* its certificates, read by the config's check (core/tls_ca.h) */
    long max_frame;
    long max_connections;
    long max_header_bytes; /* a request's header space; more gets 431 (gateway.c) */
    long queue_limit;
    long rate_per_second;
    long rate_burst;
    long max_reply_bytes;
    long reply_window; /* bytes of a reply held back for rules on replies (rules.h, cg_reply_filter) */
    long send_buffer;
    long ack_hold_ms; /* how long an ack waits for company (session.c, sink_ack) */
    long resume_grace_ms;   /* a gone client's reply goes on this long (server/resume.h); 0: off */
    long resume_max_parked; /* such replies at once */
    /* dialog state (docs/state.md) */
    cg_lifetimes lifetimes; /* lifetimes.*, history_n, params_cap */
    long max_dialogs;
    long max_rooms_per_user;
    long max_store_bytes; /* bytes of dialogs the memory store (and Redis's memory copy) holds */
    char *redis_prefix;
    char *redis_bus; /* redis.bus: where gateways tell each other to cancel; NULL: the store's URL */
    long redis_command_timeout_ms;
    long redis_connect_timeout_ms;
    long redis_writeback_max_bytes;
    long redis_lease_ms; /* a dialog lease's lifetime across gateways (redis.lease_ms, 15 s) */
    char *redis_tls_ca_file, *redis_tls_cert_file, *redis_tls_key_file, *redis_tls_server_name; /* rediss */
    long redis_tls_verify; /* 1 (default): Redis's certificate and name are checked */
    json_t *services; /* {"travel": {"defaults": {...}}} */
    cg_limits_config limits; /* limits per user (limits_config.h) */
    /* identity (docs/protocol.md, "Identity") */
    char *user_header;
    char *allow_origin; /* comma-separated origins, "*" for all; NULL: same host only */
    long jwt_allow_no_exp; /* jwt.allow_no_exp: accept JWTs without exp (never expiring) */
    json_t *dropin;     /* the drop-in mapping (dropin.h), or NULL */
    cg_upstream_config dropin_app; /* its app: dropin.app's URL and dropin.headers, read at load */
    char *admin_listen; /* HOST:PORT of the admin API's own listener, or NULL */
    char *admin_host;
    int admin_port;
    /* lifecycle */
    long ping_interval_s;
    long idle_timeout_s;
    long shutdown_timeout_s;
    long workers; /* --workers: processes on the one port (server/master.c); 1: no master */
    int workers_auto; /* --workers auto: workers is the CPUs this process may run on */
    /* the turn export (server/export.h; docs/operations.md, "The turn export") */
    char *export_to;       /* "redis" (a stream in the store's Redis) | "file" (JSON lines), or NULL: off */
    char *export_path;     /* file: where */
    long export_max_bytes; /* file: renamed to PATH.1 past this size (0: only the operator's SIGHUP) */
    char *export_stream;   /* redis: the stream's key under redis.prefix */
    long export_max_len;   /* redis: MAXLEN ~ this (0: not trimmed) */
    long export_texts;     /* the message's and the reply's text go in the record */
    long export_mask;      /* ... masked as log lines are (core/log.h) */
    long export_max_queue; /* records held while the sink is slow or away; more are dropped */
} cg_config;

/* Result of cg_config_load besides 0: print nothing more and exit with this status. */
#define CG_CONFIG_EXIT_OK 1    /* --help or --version was printed */
#define CG_CONFIG_EXIT_USAGE 2 /* a mistake; err holds the message */

/*
 * Fills cfg from argv (argv[0] is the program) and the environment. On a mistake returns
 * CG_CONFIG_EXIT_USAGE with the message in err. The strings in cfg are owned by cfg and
 * released by cg_config_free().
 */
int cg_config_load(cg_config *cfg, int argc, char **argv, char *err, size_t errlen);
void cg_config_free(cg_config *cfg);

/*
 * The same from the text of a config file alone (no flags, no file to read): name stands
 * for the file in messages. For tests and the fuzzer.
 */
int cg_config_load_text(cg_config *cfg, const char *name, const char *text, size_t len, char *err, size_t errlen);

/* Parses an upstream URL ("demo", "http://h:p/v1", "wss://h/app") into u; 0 or -1 with err. */
int cg_config_parse_upstream_url(cg_upstream_config *u, const char *url, char *err, size_t errlen);
/* Frees what u holds (its strings and headers) and zeroes it. */
void cg_upstream_config_free(cg_upstream_config *u);

/* The store's kind as a word for logs ("memory", "redis", "rediss-sentinel", ...). */
const char *cg_config_store_name(const cg_config *cfg);

/* services.NAME.defaults (borrowed), or NULL: the params every dialog of that service starts from. */
json_t *cg_config_service_defaults(const cg_config *cfg, const char *service);
/* service's params that default to an attribute of the user's profile (param -> attribute),
 * or NULL. Borrowed. */
json_t *cg_config_profile_defaults(const cg_config *cfg, const char *service);

/* Prints the flags' help text to stdout. */
void cg_config_usage(const char *prog);

#endif
