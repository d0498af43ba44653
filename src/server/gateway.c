/*
 * gateway.c: the server: one libuv loop shared by libwebsockets (as a foreign loop), the
 * upstream clients and every timer (docs/architecture.md, "Threading").
 *
 * The vhost listens on --listen, serves the web directory at / (lws's file mount: missing
 * files are 404), takes WebSocket connections on /ws with the chatgate.v1 protocol (also
 * when the client names no subprotocol), and hosts the client protocols of the upstreams.
 * SIGTERM and SIGINT stop it.
 *
 * A request's headers get max_header_bytes (16 KiB) of lws's header space, each header at
 * most that much: a bigger request is answered 431 instead of the connection being dropped
 * in silence (lws's own answer to a full header space). lws asks protocols[0] about every
 * request before it is routed, so protocols[0]'s callback is front_callback, which checks
 * the size and passes everything else on to the session callback; the admin listener's own
 * callback does the same check (cg_refuse_large_headers, handshake.c).
 */
#define _GNU_SOURCE /* asprintf */
#include <uv.h>
#include <libwebsockets.h>

#include <openssl/crypto.h>
#include <openssl/rand.h>
#include <signal.h>
#include <sys/resource.h>
#include <unistd.h> /* getppid */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "chatgate/core/alloc.h"
#include "chatgate/server/admin.h"
#include "chatgate/server/dropin.h"
#include "chatgate/server/export.h"
#include "chatgate/proto/protocol.h"
#include "chatgate/server/gateway.h"
#include "chatgate/server/handshake.h"
#include "chatgate/server/listener.h"
#include "chatgate/server/ops.h"
#include "chatgate/core/log.h"
#include "chatgate/core/wsclient.h"
#include "chatgate/core/tls_ca.h"
#include "chatgate/server/master.h"
#include "chatgate/server/session.h"
#include "chatgate/server/worker.h"

/*
 * protocols[0]: lws asks it about every request of the main listener before routing it
 * (an upgrade, or plain HTTP for the pages, /healthz, /metrics and /admin). Too large
 * headers are answered here; the rest is the session callback's.
 */
static int front_callback(struct lws *wsi, enum lws_callback_reasons reason, void *user, void *in, size_t len)
{
    switch (reason) {
    case LWS_CALLBACK_HTTP_CONFIRM_UPGRADE:
        if (cg_refuse_large_headers(wsi))
            return 1; /* answered */
        break;
    case LWS_CALLBACK_FILTER_HTTP_CONNECTION:
        if (cg_refuse_large_headers(wsi) || cg_refuse_plain_http_on_ws(wsi) || cg_refuse_unread_body(wsi))
            return -1; /* answered; lws closes the connection */
        break;
    case LWS_CALLBACK_OPENSSL_LOAD_EXTRA_CLIENT_VERIFY_CERTS: {
        /* the vhost's client context (user), made inside lws_create_context: tls_ca_file's
         * certificates join the system's for wss upstreams and drop-in apps (tls_ca.h) */
        const cg_server *srv = cg_server_of(wsi);
        if (srv && cg_tls_ca_trust(srv->cfg->tls_ca, user) < 0)
            cg_error("tls_ca_file: OpenSSL refused its certificates for wss connections (out of memory?)");
        return 0;
    }
    case LWS_CALLBACK_OPENSSL_PERFORM_SERVER_CERT_VERIFICATION:
        /* an upstream's or a drop-in app's certificate: lws's own check decides (but for
         * an IPv6 literal host), and a refusal's reason is kept for the connection's error
         * (core/net.h) */
        cg_net_tls_verified(wsi, user, in, (int)len);
        return 0;
    case LWS_CALLBACK_WSI_DESTROY: {
        cg_dropin_client_gone(wsi); /* a drop-in client held for its app that never got a session */
        /* The session callback passes a wsi's end on to the wsi's own protocol when that is
         * not its own: for a wsi of protocols[0] that would be this callback again. */
        const struct lws_protocols *p = lws_get_protocol(wsi);
        if (p && p->callback == front_callback)
            return 0;
        break;
    }
    default:
        break;
    }
    return cg_session_callback(wsi, reason, user, in, len);
}

/* A callback of a chatgate.v1 or drop-in client protocol. */
static int is_session_callback(lws_callback_function *cb)
{
    return cb == cg_session_callback || cb == front_callback;
}

/* A client connection's receive buffer in lws, allocated at its upgrade and held while it is
 * open: the most of a message lws hands over at once. A chat message is mostly far smaller;
 * a longer one comes in pieces, put together by core/wsrx. Each KiB here is a KiB per idle
 * connection (docs/architecture.md, "Memory"); the app connections, few, keep 4 KiB. */
#define CG_CLIENT_RX_BUFFER 2048

/*
 * The vhost's protocols: chatgate.v1 first (the default for a WebSocket without a
 * subprotocol), then the drop-in app's subprotocols (lws accepts only names it was given;
 * they are handled by the same session callback), then the client and HTTP handlers.
 */
static struct lws_protocols *build_protocols(const cg_config *cfg)
{
    static const struct lws_protocols fixed[] = {
        {CG_LWS_PROTOCOL_WS, cg_wsclient_callback, 0, 4096, 0, NULL, 0},
        {CG_LWS_PROTOCOL_OPS, cg_ops_callback, 0, 0, 0, NULL, 0},
        {CG_LWS_PROTOCOL_ADMIN, cg_admin_callback, 0, 0, 0, NULL, 0},
        {CG_LWS_PROTOCOL_DROPIN_APP, cg_wsclient_callback, 0, 4096, 0, NULL, 0},
    };
    json_t *subs = json_object_get(cfg->dropin, "subprotocols");
    size_t n_fixed = sizeof(fixed) / sizeof(fixed[0]), n_subs = json_array_size(subs);
    struct lws_protocols *p = cg_calloc(1 + n_subs + n_fixed + 1, sizeof(*p)); /* zeroed: the list's end */
    size_t n = 0;
    p[n++] = (struct lws_protocols){CG_PROTOCOL_NAME, front_callback, cg_session_size(), CG_CLIENT_RX_BUFFER, 0, NULL,
                                    0};
    for (size_t i = 0; i < n_subs; i++)
        p[n++] = (struct lws_protocols){json_string_value(json_array_get(subs, i)), cg_session_callback,
                                        cg_session_size(), CG_CLIENT_RX_BUFFER, 0, NULL, 0};
    for (size_t i = 0; i < n_fixed; i++) {
        p[n] = fixed[i];
        if (strcmp(p[n].name, CG_LWS_PROTOCOL_ADMIN) == 0)
            p[n].per_session_data_size = cg_admin_session_size();
        n++;
    }
    return p;
}

/* The running set counts each rule's hits into the metrics (by index: the counts start
 * again, as a new set's indices mean other rules). */
static void count_rules(cg_metrics *m, cg_ruleset *rs)
{
    memset(m->rule_hits, 0, sizeof(m->rule_hits));
    memset(m->rule_limited, 0, sizeof(m->rule_limited));
    memset(m->rule_file_time, 0, sizeof(m->rule_file_time));
    cg_rules_counts c = {m->rule_hits, m->rule_limited, CG_METRIC_RULES, m->rule_file_time, CG_METRIC_RULE_FILES};
    cg_ruleset_count_into(rs, &c);
}

/* Loads the rules of dir (and the shadow set's, when there is one): 0, or -1 with err, and
 * nothing loaded. */
static int load_rule_sets(const cg_config *cfg, cg_ruleset **rs, cg_ruleset **shadow, char *err, size_t errlen)
{
    char msg[1024];
    *rs = *shadow = NULL;
    if (cg_rules_load(cfg->rules_dir, rs, msg, sizeof(msg)) < 0) {
        snprintf(err, errlen, "rules: %s", msg);
        return -1;
    }
    if (cfg->shadow_rules && cg_rules_load(cfg->shadow_rules, shadow, msg, sizeof(msg)) < 0) {
        snprintf(err, errlen, "shadow rules: %s", msg);
        cg_ruleset_unref(*rs);
        *rs = NULL;
        return -1;
    }
    return 0;
}

/* Loads the rules again (SIGHUP, POST /admin/reload), the shadow set with them: 0, or -1
 * with err; the running sets stay on failure. srv is the gateway's own (its first member). */
static int gateway_reload_rules(cg_server *srv, char *err, size_t errlen)
{
    cg_gateway *gw = (cg_gateway *)srv;
    cg_ruleset *rs, *shadow;
    if (load_rule_sets(gw->srv.cfg, &rs, &shadow, err, errlen) < 0) {
        gw->srv.metrics.reload_failures++;
        cg_error("%s: reload refused, the running sets stay", err);
        return -1;
    }
    /* messages in flight (and queued) keep the old set until they end, uncounted: the
     * counts' indices are the new set's now */
    static const cg_rules_counts none;
    cg_ruleset_count_into(gw->srv.turn.rules, &none);
    cg_ruleset_unref(gw->srv.turn.rules);
    gw->srv.turn.rules = rs;
    cg_ruleset_unref(gw->srv.turn.shadow);
    gw->srv.turn.shadow = shadow;
    count_rules(&gw->srv.metrics, rs);
    gw->srv.metrics.reloads++;
    cg_info("rules: reloaded %zu rules from %s%s%s", cg_ruleset_count(rs), gw->srv.cfg->rules_dir,
            shadow ? ", and the shadow set from " : "", shadow ? gw->srv.cfg->shadow_rules : "");
    return 0;
}

/* POST /admin/reload: this worker's reload, then (--workers) SIGHUP to the master, which
 * passes it on to every other worker (master.c: not back to the one that sent it). */
static int gateway_reload_rules_admin(cg_server *srv, char *err, size_t errlen)
{
    int rc = gateway_reload_rules(srv, err, errlen);
    if (rc == 0 && cg_worker_self() && cg_worker_master() > 0 && getppid() == cg_worker_master())
        kill(cg_worker_master(), SIGHUP);
    return rc;
}

/* SIGHUP: load the rules again (a broken set is refused and the running one stays), and
 * reopen the export's file (the operator moved it away: logrotate). */
static void on_reload(uv_signal_t *sig, int signum)
{
    (void)signum;
    char err[1024];
    cg_gateway *gw = sig->data;
    gateway_reload_rules(&gw->srv, err, sizeof(err));
    cg_export_reopen(gw->srv.turn.exporter);
}

static void free_secrets(cg_gateway *gw);

/* The names of an upstream's configured headers; their values may be secrets: never logged. */
static void log_headers(const char *what, const char *name, const cg_headers *h)
{
    char names[512];
    cg_headers_names(h, names, sizeof(names));
    if (h->n)
        cg_info("%s%s%s%s: sends %d configured header%s: %s (values not logged)", what, name ? " '" : "",
                name ? name : "", name ? "'" : "", h->n, h->n > 1 ? "s" : "", names);
}

/*
 * With --auth none a connection's user is new unless it comes back with its resume token
 * (or, drop-in, the app's session cookie): a client that simply reconnects starts its
 * limits afresh. Said at start, naming the keys, since such limits look like they hold.
 */
static void warn_limits_without_users(const cg_config *cfg)
{
    const cg_limits *l = &cfg->limits.base;
    if (cfg->auth_kind != CG_AUTH_NONE || (!cg_limits_any(l) && cfg->limits.n_plans == 0))
        return;
    char keys[160] = "";
    static const char *const names[] = {"messages_per_minute", "turns_at_once", "tokens_per_minute",
                                        "tokens_per_day"};
    long long set[] = {l->messages_per_minute, l->turns_at_once, l->tokens_per_minute, l->tokens_per_day};
    for (int i = 0; i < 4; i++)
        if (set[i] > 0)
            snprintf(keys + strlen(keys), sizeof(keys) - strlen(keys), "%slimits.%s", keys[0] ? ", " : "", names[i]);
    cg_warn("%s%s: with --auth none every connection is a new user unless it resumes with its token (drop-in: the "
            "app's session cookie, dropin.user_cookie), so a client that reconnects starts its limits afresh; use "
            "--auth jwt or --auth header for limits that hold per user",
            keys[0] ? keys : "limits.plans", keys[0] && cfg->limits.n_plans ? " and limits.plans" : "");
}

/* After a failed start, inside one run of the loop: lws is destroyed while the loop runs
 * (its libuv plugin closes handles of its own), the store and the flusher close theirs. */
static void on_abort_tick(uv_timer_t *t)
{
    cg_gateway *gw = t->data;
    uv_close((uv_handle_t *)t, NULL);
    cg_listener_close_all();
    if (gw->lws)
        lws_context_destroy(gw->lws);
    gw->lws = NULL;
    cg_export_close(gw->srv.turn.exporter);
    gw->srv.turn.exporter = NULL;
    if (gw->srv.turn.store)
        gw->srv.turn.store->ops->close(gw->srv.turn.store);
    gw->srv.turn.store = NULL;
    cg_flusher_close(&gw->srv.flusher);
    if (gw->srv.net.keepalive) /* started */
        cg_keepalive_close(gw->srv.net.keepalive);
}

void cg_gateway_abort(cg_gateway *gw)
{
    uv_timer_init(gw->loop, &gw->drain);
    gw->drain.data = gw;
    uv_timer_start(&gw->drain, on_abort_tick, 0, 0);
    uv_run(gw->loop, UV_RUN_DEFAULT); /* until every handle start opened has closed */
    cg_ruleset_unref(gw->srv.turn.rules);
    gw->srv.turn.rules = NULL;
    cg_ruleset_unref(gw->srv.turn.shadow);
    gw->srv.turn.shadow = NULL;
    json_decref(gw->srv.turn.locks);
    gw->srv.turn.locks = NULL;
    free_secrets(gw);
}

static void gateway_stop(cg_gateway *gw);

static void on_drain_tick(uv_timer_t *t)
{
    cg_gateway *gw = t->data;
    if (gw->srv.closing_all || gw->srv.turn.inflight == 0 || uv_now(gw->loop) >= gw->drain_deadline)
        gateway_stop(gw);
}

/* The end: close every connection (replies still running are cancelled and saved as
 * such), flush the store, and let the loop run out. */
static void gateway_stop(cg_gateway *gw)
{
    if (!gw->lws)
        return;
    if (!gw->srv.closing_all) {
        /* first every client gets a close frame (1001, going away), then the context goes */
        if (gw->srv.turn.inflight)
            cg_warn("shutdown: %ld replies still running at the deadline are cancelled", gw->srv.turn.inflight);
        gw->srv.closing_all = 1;
        for (size_t i = 0; gw->protocols[i].name; i++)
            if (is_session_callback(gw->protocols[i].callback))
                lws_callback_on_writable_all_protocol(gw->lws, &gw->protocols[i]);
        uv_timer_stop(&gw->drain);
        uv_timer_start(&gw->drain, on_drain_tick, 300, 0);
        return;
    }
    uv_timer_stop(&gw->drain);
    uv_close((uv_handle_t *)&gw->drain, NULL);
    uv_signal_stop(&gw->sig_term);
    uv_signal_stop(&gw->sig_int);
    uv_signal_stop(&gw->sig_hup);
    cg_listener_close_all();
    cg_worker_stop(&gw->srv); /* --workers: its publishing */
    /* With a foreign loop, destroying the context closes its handles; the loop then runs
     * until they are gone (docs/architecture.md, "Threading"). */
    lws_context_destroy(gw->lws);
    gw->lws = NULL;
    cg_resume_close(&gw->srv.resume); /* replies of gone clients: cancelled, saved as such */
    for (int i = 0; i < gw->srv.turn.n_upstreams; i++)
        cg_upstream_close(&gw->srv.upstreams[i]); /* kept-alive upstream connections */
    /* the sessions' last turns are queued: the export sends them before the store closes */
    cg_export_close(gw->srv.turn.exporter);
    gw->srv.turn.exporter = NULL;
    if (gw->srv.turn.store) {
        gw->srv.turn.store->ops->close(gw->srv.turn.store);
        gw->srv.turn.store = NULL;
    }
    uv_close((uv_handle_t *)&gw->sig_term, NULL);
    uv_close((uv_handle_t *)&gw->sig_int, NULL);
    uv_close((uv_handle_t *)&gw->sig_hup, NULL);
    cg_flusher_close(&gw->srv.flusher);
    if (gw->srv.net.keepalive) /* started */
        cg_keepalive_close(gw->srv.net.keepalive);
    cg_net_batch_free(&gw->srv.batch);
    cg_ruleset_unref(gw->srv.turn.rules);
    gw->srv.turn.rules = NULL;
    cg_ruleset_unref(gw->srv.turn.shadow);
    gw->srv.turn.shadow = NULL;
    json_decref(gw->srv.turn.locks); /* empty: every session has closed */
    gw->srv.turn.locks = NULL;
    free_secrets(gw);
    cg_info("stopped cleanly");
}


/*
 * SIGTERM, SIGINT: stop taking connections (upgrades get 503, /healthz says 503 so a load
 * balancer moves on), let the replies in flight finish for up to shutdown_timeout_s, then
 * stop. A second signal stops at once.
 */
static void on_signal(uv_signal_t *sig, int signum)
{
    cg_gateway *gw = sig->data;
    if (gw->srv.turn.stopping) {
        cg_info("signal %d again: stopping now", signum);
        gateway_stop(gw);
        return;
    }
    gw->srv.turn.stopping = 1;
    cg_resume_draining(&gw->srv.resume);
    gw->drain_deadline = uv_now(gw->loop) + (uint64_t)gw->srv.cfg->shutdown_timeout_s * 1000;
    cg_info("signal %d: stopping; %ld replies in flight may finish within %ld s", signum, gw->srv.turn.inflight,
            gw->srv.cfg->shutdown_timeout_s);
    uv_timer_start(&gw->drain, on_drain_tick, 0, 50);
}

/* Secrets come from the environment only; the resume secret is random when unset, so
 * resume tokens then do not survive a restart. */
static void load_secrets(cg_gateway *gw, const cg_config *cfg)
{
    /* copied whole: a secret cut to a buffer's size would be another secret */
    const char *resume = getenv("CHATGATE_RESUME_SECRET");
    if (resume && *resume) {
        gw->srv.resume_secret_len = strlen(resume);
        gw->srv.resume_secret = (unsigned char *)cg_strdup(resume);
    } else if (cg_workers_shared()) {
        /* --workers: the master's random one, the same in every worker */
        gw->srv.resume_secret_len = sizeof(cg_workers_shared()->resume_secret);
        gw->srv.resume_secret = cg_malloc(gw->srv.resume_secret_len);
        if (gw->srv.resume_secret)
            memcpy(gw->srv.resume_secret, cg_workers_shared()->resume_secret, gw->srv.resume_secret_len);
    } else {
        gw->srv.resume_secret_len = 32;
        gw->srv.resume_secret = cg_malloc(32);
        if (gw->srv.resume_secret && RAND_bytes(gw->srv.resume_secret, 32) != 1)
            abort();
    }
    const char *jwt = getenv("CHATGATE_JWT_SECRET");
    if (cfg->auth_kind == CG_AUTH_JWT && jwt) {
        gw->srv.jwt_secret_len = strlen(jwt);
        gw->srv.jwt_secret = (unsigned char *)cg_strdup(jwt);
    } else {
        gw->srv.jwt_secret = (unsigned char *)cg_strdup("");
    }
    if (!gw->srv.resume_secret || !gw->srv.jwt_secret)
        abort();
}

static void free_secrets(cg_gateway *gw)
{
    if (gw->srv.resume_secret)
        OPENSSL_cleanse(gw->srv.resume_secret, gw->srv.resume_secret_len);
    if (gw->srv.jwt_secret)
        OPENSSL_cleanse(gw->srv.jwt_secret, gw->srv.jwt_secret_len);
    free(gw->srv.resume_secret);
    free(gw->srv.jwt_secret);
    gw->srv.resume_secret = gw->srv.jwt_secret = NULL;
    gw->srv.resume_secret_len = gw->srv.jwt_secret_len = 0;
}

/* --admin-listen: a vhost of its own that serves /admin and nothing else. */
static int start_admin_listener(cg_gateway *gw, const cg_config *cfg, const struct lws_context_creation_info *main)
{
    static struct lws_protocols admin_protocols[] = {
        {CG_LWS_PROTOCOL_ADMIN, cg_admin_callback, 0, 0, 0, NULL, 0},
        {NULL, NULL, 0, 0, 0, NULL, 0},
    };
    admin_protocols[0].per_session_data_size = cg_admin_session_size();
    struct lws_context_creation_info info = *main;
    info.port = cg_worker_self() ? CONTEXT_PORT_NO_LISTEN_SERVER : cfg->admin_port;
    info.iface = cfg->admin_host;
    info.protocols = admin_protocols;
    info.mounts = &gw->mount_admin;
    info.vhost_name = "chatgate-admin";
    info.foreign_loops = NULL;
    struct lws_vhost *vh = lws_create_vhost(gw->lws, &info);
    if (!vh) {
        cg_error("could not start the admin listener on %s", cfg->admin_listen);
        return -1;
    }
    if (cg_worker_self() &&
        cg_listener_open(&gw->srv, vh, cfg->admin_host, cfg->admin_port, CG_LISTEN_SHARED, "admin listener") < 0)
        return -1;
    cg_info("admin API on http://%s/admin/%s", cfg->admin_listen,
            getenv("CHATGATE_ADMIN_TOKEN") ? "" : " (off: CHATGATE_ADMIN_TOKEN is not set)");
    return 0;
}

/* Another gateway asked the store to stop this process's turn of a dialog. */
static void on_store_cancel(void *ctx, const char *key)
{
    cg_turns_cancel_dialog(ctx, key);
}

static int open_store(cg_gateway *gw, const cg_config *cfg, char *err, size_t errlen)
{
    cg_store_config sc;
    memset(&sc, 0, sizeof(sc));
    sc.url = cfg->store;
    sc.prefix = cfg->redis_prefix;
    sc.max_dialogs = cfg->max_dialogs;
    sc.max_rooms_per_user = cfg->max_rooms_per_user;
    sc.max_bytes = (size_t)cfg->max_store_bytes;
    sc.command_timeout_ms = cfg->redis_command_timeout_ms;
    sc.connect_timeout_ms = cfg->redis_connect_timeout_ms;
    sc.writeback_max_bytes = cfg->redis_writeback_max_bytes;
    sc.lease_ms = cfg->redis_lease_ms;
    sc.bus_url = cfg->redis_bus;
    sc.tls.ca_file = cfg->redis_tls_ca_file;
    sc.tls.cert_file = cfg->redis_tls_cert_file;
    sc.tls.key_file = cfg->redis_tls_key_file;
    sc.tls.server_name = cfg->redis_tls_server_name;
    sc.tls.no_verify = !cfg->redis_tls_verify;
    sc.lifetimes = cfg->lifetimes;
    sc.flush = &gw->srv.flusher; /* initialised below, before the loop runs and so before any write */
    char msg[256];
    gw->srv.turn.store = cg_store_open(gw->loop, &sc, msg, sizeof(msg));
    if (!gw->srv.turn.store) {
        snprintf(err, errlen, "store: %s", msg);
        return -1;
    }
    return 0;
}

/* The HTTP mounts of the main listener: the web page, /metrics, /healthz, and /admin unless
 * it has a listener of its own (--admin-listen). */
static void set_mounts(cg_gateway *gw, const cg_config *cfg)
{
    gw->mount.mountpoint = "/";
    gw->mount.mountpoint_len = 1;
    gw->mount.origin = cfg->web_dir;
    gw->mount.def = "index.html";
    gw->mount.origin_protocol = LWSMPRO_FILE;
    gw->mount.mount_next = &gw->mount_metrics;
    static const struct { const char *path; } ops_paths[] = {{"/metrics"}, {"/healthz"}};
    struct lws_http_mount *ops_mounts[] = {&gw->mount_metrics, &gw->mount_healthz};
    for (int i = 0; i < 2; i++) {
        ops_mounts[i]->mountpoint = ops_paths[i].path;
        ops_mounts[i]->mountpoint_len = (unsigned char)strlen(ops_paths[i].path);
        ops_mounts[i]->protocol = CG_LWS_PROTOCOL_OPS;
        ops_mounts[i]->origin_protocol = LWSMPRO_CALLBACK;
    }
    gw->mount_metrics.mount_next = &gw->mount_healthz;
    gw->mount_admin.mountpoint = "/admin";
    gw->mount_admin.mountpoint_len = 6;
    gw->mount_admin.protocol = CG_LWS_PROTOCOL_ADMIN;
    gw->mount_admin.origin_protocol = LWSMPRO_CALLBACK;
    if (!cfg->admin_listen)
        gw->mount_healthz.mount_next = &gw->mount_admin;
}

/*
 * The process's descriptor limit (soft RLIMIT_NOFILE), set before lws sizes its tables by it.
 * lws 4.1.6 finds a socket's connection by its descriptor in a table as long as that limit.
 * Given a smaller fd_limit_per_thread, it walks the table at every event instead of indexing
 * it (unix-fds.c): with the shipped unit's LimitNOFILE=65536 and max_connections 1024, every
 * event of every connection walked up to every connection. 8,000 idle connections spent a
 * third of their CPU there (issue 39). So lws gets no fd limit: the limit is raised
 * to what max_connections needs (a client and an upstream socket each, and room for kept-alive
 * upstream connections, Redis and files) where the hard limit allows, and an unreasonable one
 * (over 10 million, where lws falls back to 2,560) is lowered.
 */
static void set_fd_limit(const cg_config *cfg)
{
    rlim_t need = (rlim_t)cfg->max_connections * 2 + 1024;
    struct rlimit rl;
    if (getrlimit(RLIMIT_NOFILE, &rl) < 0)
        return;
    rlim_t want = rl.rlim_cur;
    if (want < need)
        want = rl.rlim_max != RLIM_INFINITY && rl.rlim_max < need ? rl.rlim_max : need;
    if (want > 10000000)
        want = need > (1 << 20) ? need : (1 << 20);
    if (want != rl.rlim_cur) {
        rl.rlim_cur = want;
        if (setrlimit(RLIMIT_NOFILE, &rl) < 0)
            cg_warn("could not set the descriptor limit (ulimit -n) to %llu", (unsigned long long)want);
    }
    if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur < need)
        cg_warn("max_connections %ld needs about %llu descriptors, and the limit (ulimit -n, LimitNOFILE) is %llu: "
                "connections past it are refused",
                cfg->max_connections, (unsigned long long)need, (unsigned long long)rl.rlim_cur);
}

/* The lws context on the gateway's loop, its vhost, and the admin listener when it has its
 * own; 0, or -1 (said). */
static int start_lws(cg_gateway *gw, const cg_config *cfg, uv_loop_t *loop)
{
    void *foreign_loops[1] = {loop};
    struct lws_context_creation_info info;
    memset(&info, 0, sizeof(info));
    info.options = LWS_SERVER_OPTION_LIBUV | LWS_SERVER_OPTION_DO_SSL_GLOBAL_INIT |
                   LWS_SERVER_OPTION_HTTP_HEADERS_SECURITY_BEST_PRACTICES_ENFORCE;
    info.foreign_loops = foreign_loops;
    /* the gateway listens itself (listener.h: a drop-in client's head is held while its app
     * answers; workers share the port, which lws 4.1 cannot) */
    info.port = CONTEXT_PORT_NO_LISTEN_SERVER;
    info.protocols = gw->protocols;
    info.mounts = &gw->mount;
    info.user = &gw->srv; /* cg_server_of() */
    info.vhost_name = "chatgate";
    set_fd_limit(cfg); /* and no fd_limit_per_thread: its comment says why */
    info.timeout_secs = 30;
    /* no pings nor hang-ups of lws's: the gateway's keepalive does them (core/keepalive.h:
     * lws's walked every connection's timer at each ping and pong) */
    info.retry_and_idle_policy = &cg_net_no_lws_keepalive;
    info.connect_timeout_secs = 30;
    /* Header space: every header cut at max_header_bytes (so that one too long header ends
     * the parse normally and gets its 431), and room for several of them; lws allocates it
     * per connection only while that connection's headers are read. */
    for (int t = 0; t < WSI_TOKEN_COUNT; t++)
        gw->token_limits.token_limit[t] = (unsigned short)cfg->max_header_bytes;
    info.token_limits = &gw->token_limits;
    info.max_http_header_data2 = (unsigned int)cfg->max_header_bytes * 4;
    /* The one service thread's scratch buffer, which also holds a client handshake we send
     * (drop-in forwards the client's Cookie and Authorization to the app): room for them. */
    info.pt_serv_buf_size = (unsigned int)cfg->max_header_bytes * 4 + 4096;
    gw->lws = lws_create_context(&info);
    if (!gw->lws) {
        cg_error("could not start listening on %s (in use, or not an address of this machine?)", cfg->listen);
        return -1;
    }
    gw->vhost = lws_get_vhost_by_name(gw->lws, "chatgate");
    if (gw->vhost && cfg->admin_listen && start_admin_listener(gw, cfg, &info) < 0)
        return -1;
    if (!gw->vhost) {
        /* lws keeps the context when only the listener failed: cg_gateway_abort destroys
         * it inside uv_run (outside, lws would unload its libuv plugin while the plugin's
         * handles are still closing). */
        cg_error("could not start listening on %s (in use, or not an address of this machine?)", cfg->listen);
        return -1;
    }
    return 0;
}

/* SIGTERM and SIGINT drain, SIGHUP reloads the rules; SIGPIPE is ignored. */
static void start_signals(cg_gateway *gw, uv_loop_t *loop)
{
    uv_signal_init(loop, &gw->sig_term);
    uv_signal_init(loop, &gw->sig_int);
    gw->sig_term.data = gw->sig_int.data = gw;
    uv_signal_start(&gw->sig_term, on_signal, SIGTERM);
    uv_signal_start(&gw->sig_int, on_signal, SIGINT);
    uv_timer_init(loop, &gw->drain);
    gw->drain.data = gw;
    uv_signal_init(loop, &gw->sig_hup);
    gw->sig_hup.data = gw;
    uv_signal_start(&gw->sig_hup, on_reload, SIGHUP);
    signal(SIGPIPE, SIG_IGN);
}

/* What the gateway started with, said once in the log. */
static void log_start(const cg_gateway *gw, const cg_config *cfg)
{
    if (cg_worker_self())
        cg_info("worker %d (pid %d) of %ld", cg_worker_index(), (int)uv_os_getpid(), cfg->workers);
    else if (cfg->workers_auto) /* auto gave one process: say why there is no master */
        cg_info("workers auto: 1 (%s)", cfg->store_kind == CG_STORE_MEMORY ? "the memory store is one process's"
                                                                           : "this process may run on one CPU");
    cg_info("chatgate %s listening on http://%s/ (WebSocket /ws), web %s, store %s, auth %s", CG_VERSION,
            cfg->listen, cfg->web_dir, cg_config_store_name(cfg), cfg->auth);
    cg_info("rules: %zu from %s", cg_ruleset_count(gw->srv.turn.rules), cfg->rules_dir);
    if (gw->srv.turn.shadow)
        cg_info("shadow rules: %zu from %s, evaluated beside the live set on every message, never acting",
                cg_ruleset_count(gw->srv.turn.shadow), cfg->shadow_rules);
    warn_limits_without_users(cfg);
    if (cfg->dropin)
        cg_info("drop-in: WebSocket %s... goes to the app at %s", json_string_value(json_object_get(cfg->dropin, "path")),
                json_string_value(json_object_get(cfg->dropin, "app")));
    for (int i = 0; i < cfg->n_upstreams; i++)
        cg_info("upstream '%s': %s (%s)%s", cfg->upstreams[i].name, cfg->upstreams[i].url,
                gw->srv.upstreams[i].ops->kind, i == cfg->default_index ? ", default" : "");
    log_headers("drop-in app", NULL, &cfg->dropin_app.headers);
    for (int i = 0; i < cfg->n_upstreams; i++)
        log_headers("upstream", cfg->upstreams[i].name, &cfg->upstreams[i].headers);
    if (cfg->tls_ca)
        cg_info("tls_ca_file %s: %d CA certificate%s trusted besides the system's", cfg->tls_ca_file,
                cg_tls_ca_count(cfg->tls_ca), cg_tls_ca_count(cfg->tls_ca) > 1 ? "s" : "");
}

int cg_gateway_start(cg_gateway *gw, const cg_config *cfg, uv_loop_t *loop, char *err, size_t errlen)
{
    memset(gw, 0, sizeof(*gw));
    gw->srv.cfg = cfg;
    gw->loop = loop;
    /* first: the store's first write comes after its connect, and a failed start closes it */
    cg_flusher_init(&gw->srv.flusher, loop);
    gw->srv.reload_rules = gateway_reload_rules_admin;
    /* what every turn gets: the members below, as they are filled */
    gw->srv.turn = (cg_turn_env){.cfg = cfg, .loop = loop, .upstreams = gw->srv.upstreams, .metrics = &gw->srv.metrics};
    cg_turn_env_services(&gw->srv.turn);
    cg_resume_init(&gw->srv.resume, &gw->srv.turn, (uint64_t)cfg->resume_grace_ms, cfg->resume_max_parked);
    load_secrets(gw, cfg);
    gw->srv.turn.locks = json_object();
    if (load_rule_sets(cfg, &gw->srv.turn.rules, &gw->srv.turn.shadow, err, errlen) < 0)
        return CG_GATEWAY_BAD_CONFIG;
    count_rules(&gw->srv.metrics, gw->srv.turn.rules);
    /* Client frames arrive in pieces of CG_CLIENT_RX_BUFFER bytes; a frame over it is
     * reassembled (core/wsrx.h). */
    gw->protocols = build_protocols(cfg);
    set_mounts(gw, cfg);

    /* the store first: a wrong store URL exits before lws has put handles on the loop */
    if (open_store(gw, cfg, err, errlen) < 0)
        return CG_GATEWAY_BAD_CONFIG;
    gw->srv.turn.store->on_cancel = on_store_cancel;
    gw->srv.turn.store->cancel_ctx = &gw->srv.turn;
    if (cg_export_open(&gw->srv.turn.exporter, loop, cfg, gw->srv.turn.store, &gw->srv.metrics, err, errlen) < 0)
        return CG_GATEWAY_BAD_CONFIG;

    gw->srv.net.loop = loop; /* the listeners' (listener.h), before the rest of net is set */
    if (start_lws(gw, cfg, loop) < 0)
        return -1;
    gw->srv.net = (cg_net){.loop = loop, .lws = gw->lws, .vhost = gw->vhost, .flush = &gw->srv.flusher,
                           .keepalive = &gw->srv.keepalive, .tls_ca = cfg->tls_ca};
    /* WebSocket pings when a connection is quiet (proxies drop idle ones: nginx after 60 s),
     * and a hang-up when nothing, not even a pong, came for idle_timeout_s */
    cg_keepalive_init(&gw->srv.keepalive, &gw->srv.net, (unsigned)cfg->ping_interval_s, (unsigned)cfg->idle_timeout_s,
                      &gw->srv.metrics);
    int flags = CG_LISTEN_DROPIN | (cg_worker_self() ? CG_LISTEN_SHARED : 0);
    if (cg_listener_open(&gw->srv, gw->vhost, cfg->listen_host, cfg->listen_port, flags, "listener") < 0)
        return -1;
    gw->srv.turn.n_upstreams = cfg->n_upstreams;
    for (int i = 0; i < cfg->n_upstreams; i++)
        cg_upstream_init(&gw->srv.upstreams[i], &gw->srv.net, &cfg->upstreams[i], &gw->srv.metrics, i);
    start_signals(gw, loop);
    cg_worker_publish_start(&gw->srv);
    log_start(gw, cfg);
    return 0;
}

int cg_gateway_run(cg_gateway *gw)
{
    uv_run(gw->loop, UV_RUN_DEFAULT);
    if (gw->lws)
        lws_context_destroy(gw->lws);
    return 0;
}
