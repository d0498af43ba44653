/*
 * handshake.c: the checks a connection passes before it is a session (see handshake.h).
 */
#define _GNU_SOURCE /* asprintf */
#include <openssl/evp.h>
#include <openssl/rand.h>
#include <ctype.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "chatgate/core/alloc.h"
#include "chatgate/core/log.h"
#include "chatgate/proto/identity.h"
#include "chatgate/proto/protocol.h"
#include "chatgate/server/handshake.h"

cg_server *cg_server_of(struct lws *wsi)
{
    return lws_context_user(lws_get_context(wsi));
}

/*
 * Writes a whole HTTP answer by hand ("connection: close", a text body, and the extra
 * header lines, each ending in CRLF) and returns 1. At the upgrade stage
 * lws_return_http_status() would say "HTTP/1.0", which strict WebSocket clients take for
 * no answer.
 */
static int http_answer(struct lws *wsi, int status, const char *reason, const char *extra, const char *body)
{
    char *text;
    int n = asprintf(&text, "%*sHTTP/1.1 %d %s\r\ncontent-type: text/plain\r\ncontent-length: %zu\r\n"
                            "cache-control: no-store\r\n%sconnection: close\r\n\r\n%s",
                     LWS_PRE, "", status, reason, strlen(body), extra, body);
    if (n < 0)
        return -1;
    lws_write(wsi, (unsigned char *)text + LWS_PRE, (size_t)n - LWS_PRE, LWS_WRITE_HTTP_HEADERS);
    free(text);
    return 1;
}

int cg_http_refuse(struct lws *wsi, int status, const char *reason, const char *body)
{
    return http_answer(wsi, status, reason, "", body);
}

const char *cg_http_reason(int status)
{
    static const struct {
        int status;
        const char *reason;
    } reasons[] = {{400, "Bad Request"},
                   {401, "Unauthorized"},
                   {403, "Forbidden"},
                   {404, "Not Found"},
                   {405, "Method Not Allowed"},
                   {408, "Request Timeout"},
                   {409, "Conflict"},
                   {410, "Gone"},
                   {413, "Content Too Large"},
                   {426, "Upgrade Required"},
                   {429, "Too Many Requests"},
                   {431, "Request Header Fields Too Large"},
                   {500, "Internal Server Error"},
                   {501, "Not Implemented"},
                   {502, "Bad Gateway"},
                   {503, "Service Unavailable"},
                   {504, "Gateway Timeout"}};
    for (size_t i = 0; i < sizeof(reasons) / sizeof(reasons[0]); i++)
        if (reasons[i].status == status)
            return reasons[i].reason;
    return "Error";
}

/*
 * Sums the request's headers as lws kept them. Every header is cut at max_header_bytes by
 * lws (the token limits), so one that reaches it was longer.
 */
static int headers_too_large(struct lws *wsi, long limit, long *total)
{
    *total = 0;
    int over = 0;
    for (int t = 0; t < WSI_TOKEN_COUNT; t++) {
        int n = lws_hdr_total_length(wsi, (enum lws_token_indexes)t);
        if (n >= limit)
            over = 1;
        *total += n > 0 ? n : 0;
    }
    return over || *total > limit;
}

int cg_refuse_large_headers(struct lws *wsi)
{
    cg_server *srv = cg_server_of(wsi);
    long total;
    if (!headers_too_large(wsi, srv->cfg->max_header_bytes, &total))
        return 0;
    cg_warn("refused a request with %ld bytes of headers or more, over max_header_bytes (%ld): 431", total,
            srv->cfg->max_header_bytes);
    srv->metrics.refused_connections++;
    char body[160];
    snprintf(body, sizeof(body), "the request's headers are over %ld bytes (a cookie or token too long?)\n",
             srv->cfg->max_header_bytes);
    cg_http_refuse(wsi, 431, "Request Header Fields Too Large", body);
    return 1;
}

/*
 * Who this connection is (docs/protocol.md, "Identity"), from the handshake: a resume token or a
 * fresh id (auth none), a JWT (auth jwt), or a proxy's header (auth header). 0, or -1 with
 * the reason in err.
 */
int cg_handshake_identify(const cg_server *srv, struct lws *wsi, int64_t now, char *user, size_t userlen, char *plan,
                          char *err, size_t errlen)
{
    cg_auth_kind auth = srv->cfg->auth_kind;
    plan[0] = 0;
    char buf[4096];
    if (auth == CG_AUTH_JWT) {
        /* copied whole: a long JWT fits the header space (max_header_bytes), not buf */
        int cap = lws_hdr_total_length(wsi, WSI_TOKEN_HTTP_AUTHORIZATION) +
                  lws_hdr_total_length(wsi, WSI_TOKEN_HTTP_URI_ARGS) + 1;
        char *tbuf = cg_malloc((size_t)cap);
        const char *token = NULL;
        if (lws_hdr_copy(wsi, tbuf, cap, WSI_TOKEN_HTTP_AUTHORIZATION) > 7 && strncasecmp(tbuf, "Bearer ", 7) == 0)
            token = tbuf + 7;
        else
            token = lws_get_urlarg_by_name(wsi, "access_token=", tbuf, cap);
        int rc = -1;
        if (!token)
            snprintf(err, errlen, "a JWT is needed: Authorization: Bearer, or ?access_token=");
        else
            rc = cg_identity_jwt_verify_ex(srv->jwt_secret, srv->jwt_secret_len, token, now, 30,
                                           srv->cfg->jwt_allow_no_exp, user, userlen, srv->cfg->limits.plan_claim, plan,
                                           CG_MAX_PLAN_NAME + 1, err, errlen);
        free(tbuf);
        return rc;
    }
    if (auth == CG_AUTH_HEADER) {
        char name[128];
        snprintf(name, sizeof(name), "%s:", srv->cfg->user_header);
        for (char *p = name; *p; p++)
            *p = (char)tolower((unsigned char)*p);
        int n = lws_hdr_custom_copy(wsi, buf, sizeof(buf), name, (int)strlen(name));
        if (n <= 0) {
            snprintf(err, errlen, "no %s header", srv->cfg->user_header);
            return -1;
        }
        if (n > CG_MAX_USER || (size_t)n >= userlen) {
            snprintf(err, errlen, "the user id is over %d bytes", CG_MAX_USER);
            return -1;
        }
        memcpy(user, buf, (size_t)n + 1);
        return 0;
    }
    const char *resume = lws_get_urlarg_by_name(wsi, "resume=", buf, sizeof(buf));
    if (resume && cg_identity_resume_check(srv->resume_secret, srv->resume_secret_len, resume, user,
                                           userlen) == 0)
        return 0;
    unsigned char rnd[8];
    if (RAND_bytes(rnd, sizeof(rnd)) != 1)
        abort();
    snprintf(user, userlen, "u_%02x%02x%02x%02x%02x%02x%02x%02x", rnd[0], rnd[1], rnd[2], rnd[3],
             rnd[4], rnd[5], rnd[6], rnd[7]);
    return 0;
}

/* 1 when uri is the drop-in path or lies under it (/socket, /socket/websocket,
 * /socket/room/1); 0 when drop-in is off. */
static int under_dropin_path(const cg_server *srv, const char *uri)
{
    const char *path = json_string_value(json_object_get(srv->cfg->dropin, "path"));
    if (!path)
        return 0;
    size_t n = strlen(path);
    while (n > 1 && path[n - 1] == '/')
        n--;
    return strncmp(uri, path, n) == 0 && (uri[n] == 0 || uri[n] == '/');
}

int cg_handshake_path_is_dropin(const cg_server *srv, const char *path)
{
    return under_dropin_path(srv, path);
}

int cg_handshake_is_dropin(const cg_server *srv, struct lws *wsi)
{
    char uri[1024];
    return lws_hdr_copy(wsi, uri, sizeof(uri), WSI_TOKEN_GET_URI) > 0 && under_dropin_path(srv, uri);
}

int cg_refuse_plain_http_on_ws(struct lws *wsi)
{
    char *p;
    int len;
    char uri[1024];
    if (lws_hdr_total_length(wsi, WSI_TOKEN_UPGRADE) > 0 || lws_http_get_uri_and_method(wsi, &p, &len) < 0 ||
        len <= 0 || (size_t)len >= sizeof(uri))
        return 0;
    memcpy(uri, p, (size_t)len);
    uri[len] = 0;
    const char *why = NULL;
    if (strcmp(uri, "/ws") == 0)
        why = "/ws takes WebSocket connections only (the chatgate.v1 protocol; docs/protocol.md)\n";
    else if (strcmp(uri, "/") != 0 && under_dropin_path(cg_server_of(wsi), uri))
        why = "this path takes the chat app's WebSocket only: send its other requests (Socket.IO's "
              "long-polling among them) to the app itself (docs/dropin.md)\n";
    return why ? http_answer(wsi, 426, "Upgrade Required", "upgrade: websocket\r\n", why) : 0;
}

int cg_refuse_unread_body(struct lws *wsi)
{
    char cl[32] = "";
    int chunked = lws_hdr_total_length(wsi, WSI_TOKEN_HTTP_TRANSFER_ENCODING) > 0;
    int has_length = lws_hdr_copy(wsi, cl, sizeof(cl), WSI_TOKEN_HTTP_CONTENT_LENGTH) > 0;
    if (!chunked && (!has_length || strspn(cl, "0") == strlen(cl)))
        return 0; /* no body */
    cg_warn("refused an HTTP request with a body: 413");
    return http_answer(wsi, 413, "Payload Too Large", "",
                       "no request takes a body here (the admin API takes its values in the query)\n");
}

/* Is host (no port, IPv6 in brackets) a name of this machine's loopback: localhost, a name
 * under .localhost (RFC 6761), 127.0.0.0/8 or [::1]? */
static int loopback_host(const char *host, size_t n)
{
    static const char sub[] = ".localhost";
    if ((n == 9 && strncasecmp(host, "localhost", 9) == 0) || (n == 5 && strncmp(host, "[::1]", 5) == 0) ||
        (n > sizeof(sub) - 1 && strncasecmp(host + n - (sizeof(sub) - 1), sub, sizeof(sub) - 1) == 0))
        return 1;
    if (n < 4 || strncmp(host, "127.", 4) != 0)
        return 0;
    for (size_t i = 4; i < n; i++)
        if (!(host[i] == '.' || (host[i] >= '0' && host[i] <= '9')))
            return 0;
    return 1;
}

/* Is host an IP literal (v4 digits and dots, or v6 in brackets)? A page at an IP literal
 * cannot be a rebound name. */
static int ip_literal(const char *host, size_t n)
{
    if (n >= 2 && host[0] == '[' && host[n - 1] == ']')
        return 1;
    for (size_t i = 0; i < n; i++)
        if (!(host[i] == '.' || (host[i] >= '0' && host[i] <= '9')))
            return 0;
    return n > 0;
}

/* The port of "host[:port]" (IPv6 in brackets), or dflt when it names none. */
static const char *port_of(const char *hostport, size_t n, const char *dflt)
{
    const char *end = hostport + n, *close = hostport[0] == '[' ? memchr(hostport, ']', n) : NULL;
    const char *colon = memchr(close ? close : hostport, ':', (size_t)(end - (close ? close : hostport)));
    return colon ? colon + 1 : dflt;
}

/*
 * The browser Origin check of docs/protocol.md, "Identity", against cross-site WebSocket
 * hijacking and DNS rebinding: an Origin, when present, must be allowed by --allow-origin
 * ("*" allows all, "null" a page opened from a file), or be a page of this gateway's own
 * loopback address (a loopback host at the port the request came to: localhost:8080 and
 * 127.0.0.1:8080 are one site, localhost:3000 another), or an IP literal that is the Host
 * the request was sent to. A name is never accepted because it matches the Host header:
 * with DNS rebinding, a page of http://rebind.attacker.example:P whose name now resolves to
 * 127.0.0.1 sends exactly that.
 */
static int origin_allowed(struct lws *wsi, const char *allow, char *origin, size_t originlen)
{
    char host[512];
    if (lws_hdr_total_length(wsi, WSI_TOKEN_ORIGIN) <= 0) {
        origin[0] = 0;
        return 1; /* not a browser */
    }
    if (lws_hdr_copy(wsi, origin, (int)originlen, WSI_TOKEN_ORIGIN) <= 0) {
        snprintf(origin, originlen, "(over %zu bytes)", originlen - 1);
        return 0; /* an Origin too long to be any allowed one */
    }
    if (allow) {
        size_t n = strlen(origin);
        for (const char *p = allow; *p;) {
            size_t len = strcspn(p, ",");
            if ((len == 1 && *p == '*') || (len == n && strncmp(p, origin, n) == 0))
                return 1;
            p += len + (p[len] == ',');
        }
    }
    const char *sep = strstr(origin, "://");
    if (!sep || (strncasecmp(origin, "http", 4) != 0))
        return 0;
    const char *name = sep + 3;
    size_t n = name[0] == '[' && strchr(name, ']') ? (size_t)(strchr(name, ']') - name) + 1 : strcspn(name, ":/");
    int hn = lws_hdr_copy(wsi, host, sizeof(host), WSI_TOKEN_HOST);
    if (hn <= 0)
        return 0;
    if (loopback_host(name, n)) { /* the same port: one site; another port is another site */
        const char *dflt = strncasecmp(origin, "https:", 6) == 0 ? "443" : "80";
        const char *hp = port_of(host, (size_t)hn, "80"), *op = port_of(name, strlen(name), dflt);
        return strcmp(hp, op) == 0;
    }
    return ip_literal(name, n) && strcasecmp(name, host) == 0;
}

/* A refused upgrade: its answer, and why, for the log (NULL: not logged). */
typedef struct refusal {
    int status;
    const char *reason, *extra, *body;
    char log[768]; /* an Origin (511 bytes at most) whole: a value cut before the log's masks is not masked */
} refusal;

/*
 * RFC 6455 4.2.1 and 4.4, which lws 4.1 does not hold to: Sec-WebSocket-Version must be 13
 * (else 426, saying which version we speak), Sec-WebSocket-Key 16 bytes in base64 (else
 * 400). 0 when both are fine, else 1 and the refusal.
 */
static int bad_websocket(struct lws *wsi, refusal *r)
{
    char v[16], key[64];
    int vn = lws_hdr_copy(wsi, v, sizeof(v), WSI_TOKEN_VERSION);
    if (vn != 2 || strcmp(v, "13") != 0) {
        *r = (refusal){426, "Upgrade Required", "sec-websocket-version: 13\r\n",
                       "only WebSocket version 13 is spoken (RFC 6455)\n", ""};
        snprintf(r->log, sizeof(r->log),
                 "refused a WebSocket handshake with Sec-WebSocket-Version '%.8s': only 13 is spoken (RFC 6455)",
                 vn > 0 ? v : "(none)");
        return 1;
    }
    unsigned char raw[48];
    int kn = lws_hdr_copy(wsi, key, sizeof(key), WSI_TOKEN_KEY);
    int ok = kn == 24 && key[22] == '=' && key[23] == '=' && EVP_DecodeBlock(raw, (unsigned char *)key, 24) == 18;
    for (int i = 0; ok && i < 22; i++)
        ok = isalnum((unsigned char)key[i]) || key[i] == '+' || key[i] == '/';
    if (!ok) {
        *r = (refusal){400, "Bad Request", "", "Sec-WebSocket-Key must be 16 bytes in base64 (RFC 6455 4.2.1)\n",
                       "refused a WebSocket handshake: Sec-WebSocket-Key is not 16 bytes in base64 (RFC 6455 4.2.1)"};
        return 1;
    }
    return 0;
}

/*
 * Would this upgrade be refused, and how? Only on /ws and the drop-in path, a handshake of
 * RFC 6455, an Origin allowed, and while under --max-connections and not shutting down.
 * Reads the headers only: a held drop-in client is asked before its app is opened.
 */
static int upgrade_refusal(struct lws *wsi, cg_server *srv, refusal *r)
{
    char uri[256], origin[512];
    memset(r, 0, sizeof(*r));
    if (lws_hdr_copy(wsi, uri, sizeof(uri), WSI_TOKEN_GET_URI) < 0 ||
        (strcmp(uri, "/ws") != 0 && !cg_handshake_is_dropin(srv, wsi))) {
        *r = (refusal){404, "Not Found", "", "WebSocket connections go to /ws\n", ""};
        return 1;
    }
    if (bad_websocket(wsi, r))
        return 1;
    if (!origin_allowed(wsi, srv->cfg->allow_origin, origin, sizeof(origin))) {
        *r = (refusal){403, "Forbidden", "", "this Origin may not connect (see --allow-origin)\n", ""};
        snprintf(r->log, sizeof(r->log),
                 "refused a connection from the page of Origin '%s': not a loopback page of this gateway nor "
                 "in --allow-origin (a page opened from a file sends 'null')",
                 origin);
        return 1;
    }
    if (srv->turn.stopping) {
        *r = (refusal){503, "Service Unavailable", "", "shutting down\n", ""};
        return 1;
    }
    /* drop-in clients waiting for their app's handshake hold two sockets each too */
    long held = srv->n_held;
    if (srv->n_sessions + held >= srv->cfg->max_connections) {
        *r = (refusal){503, "Service Unavailable", "", "too many connections\n", ""};
        snprintf(r->log, sizeof(r->log),
                 "refused a connection: %ld connected and %ld drop-in clients waiting for the app's handshake, the "
                 "limit is %ld",
                 srv->n_sessions, held, srv->cfg->max_connections);
        return 1;
    }
    long total;
    if (headers_too_large(wsi, srv->cfg->max_header_bytes, &total)) { /* answered by the front callback */
        *r = (refusal){431, "Request Header Fields Too Large", "", "", ""};
        return 1;
    }
    return 0;
}

int cg_handshake_upgrade_acceptable(struct lws *wsi)
{
    refusal r;
    return !upgrade_refusal(wsi, cg_server_of(wsi), &r);
}

/*
 * The WebSocket upgrade (upgrade_refusal). Refusals are HTTP answers (404, 403, 426, 400,
 * 503) so that a client or load balancer sees why; returning 1 tells lws the answer was
 * written.
 */
int cg_handshake_confirm_upgrade(struct lws *wsi)
{
    cg_server *srv = cg_server_of(wsi);
    refusal r;
    if (!upgrade_refusal(wsi, srv, &r))
        return 0;
    if (r.status != 404)
        srv->metrics.refused_connections++;
    if (r.log[0])
        cg_warn("%s", r.log);
    return http_answer(wsi, r.status, r.reason, r.extra, r.body);
}

int cg_handshake_dropin_user(const cg_server *srv, struct lws *client, char *out, size_t outlen)
{
    const char *name = json_string_value(json_object_get(srv->cfg->dropin, "user_cookie"));
    int total = lws_hdr_total_length(client, WSI_TOKEN_HTTP_COOKIE);
    if (!name || total <= 0)
        return -1;
    /* copied at its real length: big cookie headers (up to max_header_bytes) are common */
    char *cookies = cg_malloc((size_t)total + 1);
    if (lws_hdr_copy(client, cookies, total + 1, WSI_TOKEN_HTTP_COOKIE) <= 0) {
        free(cookies);
        return -1;
    }
    int rc = -1;
    size_t nl = strlen(name);
    for (char *p = cookies; p && *p;) {
        while (*p == ' ' || *p == ';')
            p++;
        char *end = strchr(p, ';');
        if (end)
            *end = 0;
        if (strncmp(p, name, nl) == 0 && p[nl] == '=' && p[nl + 1]) {
            unsigned char md[32];
            unsigned int mdlen = 0;
            EVP_Digest(p + nl + 1, strlen(p + nl + 1), md, &mdlen, EVP_sha256(), NULL);
            snprintf(out, outlen, "c_%02x%02x%02x%02x%02x%02x%02x%02x%02x%02x%02x%02x", md[0], md[1], md[2], md[3],
                     md[4], md[5], md[6], md[7], md[8], md[9], md[10], md[11]);
            rc = 0;
            break;
        }
        p = end ? end + 1 : NULL;
    }
    free(cookies);
    return rc;
}

