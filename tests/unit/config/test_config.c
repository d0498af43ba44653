/*
 * test_config.c: settings from flags and from a JSON file, and the messages for mistakes:
 * "--flag: ..." for a flag, "file:line:col: ..." for JSON syntax, "file: key: ..." for a
 * wrong value (docs/architecture.md, Operations).
 */
#include <stdarg.h>
#include <stdlib.h>
#include <unistd.h>

#include "chatgate/config/config.h"
#include "unit.h"

static char err[1024];

/* Loads from a NULL-terminated list of arguments; returns cg_config_load's result. */
static int load(cg_config *cfg, ...)
{
    char *argv[32] = {"chatgate"};
    int argc = 1;
    va_list ap;
    va_start(ap, cfg);
    for (char *a; (a = va_arg(ap, char *)) && argc < 31;)
        argv[argc++] = a;
    va_end(ap);
    err[0] = 0;
    return cg_config_load(cfg, argc, argv, err, sizeof(err));
}

static char path[64]; /* the one test file, rewritten by each write_file() */

static const char *write_file(const char *text)
{
    snprintf(path, sizeof(path), "/tmp/cg-test-config-%d.json", (int)getpid());
    FILE *f = fopen(path, "w");
    fputs(text, f);
    fclose(f);
    return path;
}

/* Loading fails with status 2 and a message that contains want. */
#define CHECK_FAILS(want, ...)                                                              \
    do {                                                                                    \
        cg_config c_;                                                                       \
        int rc_ = load(&c_, __VA_ARGS__, NULL);                                             \
        CHECK(rc_ == CG_CONFIG_EXIT_USAGE);                                                 \
        if (!strstr(err, want))                                                             \
            fprintf(stderr, "%s:%d: message \"%s\" lacks \"%s\"\n", __FILE__, __LINE__, err, want); \
        CHECK(strstr(err, want) != NULL);                                                   \
        cg_config_free(&c_);                                                                \
    } while (0)

/* A config file holding text fails to load with a message naming the file, then where (":LINE:COL: key: ..."). */
#define CHECK_FILE_FAILS(text, where)                                                       \
    do {                                                                                    \
        char want_[512];                                                                    \
        const char *path_ = write_file(text);                                               \
        snprintf(want_, sizeof(want_), "%s%s", path_, where);                               \
        CHECK_FAILS(want_, "--config", path_);                                              \
    } while (0)

static void test_defaults(void)
{
    cg_config c;
    CHECK(load(&c, NULL) == 0);
    CHECK_STR(c.listen_host, "127.0.0.1");
    CHECK(c.listen_port == 8080);
    CHECK(c.n_upstreams == 1);
    CHECK_STR(c.upstreams[0].name, "demo");
    CHECK(c.upstreams[0].kind == CG_UPSTREAM_DEMO);
    CHECK_STR(c.default_upstream, "demo");
    CHECK_STR(c.store, "memory");
    CHECK_STR(c.auth, "none");
    CHECK(c.max_frame == 65536);
    CHECK(c.queue_limit == 8);
    CHECK(c.rules_dir != NULL && c.web_dir != NULL);
    cg_config_free(&c);
}

static void test_flags(void)
{
    cg_config c;
    CHECK(load(&c, "--listen", "[::1]:9000", "--upstream", "llm=http://llm.local:8000/v1/", "--upstream=app=wss://chat.example/socket?x=1",
               "--default-upstream", "app", "--max-frame=2048", "--log-level", "debug", NULL) == 0);
    CHECK_STR(c.listen_host, "::1");
    CHECK(c.listen_port == 9000);
    CHECK(c.n_upstreams == 2);
    CHECK(c.upstreams[0].kind == CG_UPSTREAM_OPENAI);
    CHECK_STR(c.upstreams[0].host, "llm.local");
    CHECK(c.upstreams[0].port == 8000);
    CHECK_STR(c.upstreams[0].path, "/v1");
    CHECK(c.upstreams[1].kind == CG_UPSTREAM_WS);
    CHECK(c.upstreams[1].tls == 1);
    CHECK(c.upstreams[1].port == 443);
    CHECK_STR(c.upstreams[1].path, "/socket?x=1");
    CHECK(c.default_index == 1);
    CHECK(c.max_frame == 2048);
    CHECK_STR(c.log_level, "debug");
    cg_config_free(&c);
}

static void test_flag_mistakes(void)
{
    CHECK_FAILS("--max-frame: 'abc' is not a whole number", "--max-frame", "abc");
    CHECK_FAILS("--max-frame: '10' is not a whole number from 256", "--max-frame", "10");
    CHECK_FAILS("--listen: 'nowhere' must be HOST:PORT", "--listen", "nowhere");
    CHECK_FAILS("--listen: '127.0.0.1:70000' must be HOST:PORT", "--listen", "127.0.0.1:70000");
    CHECK_FAILS("--upstream: 'llm' must be NAME=URL", "--upstream", "llm");
    CHECK_FAILS("--upstream: 'ftp://x': the scheme must be", "--upstream", "llm=ftp://x");
    CHECK_FAILS("--upstream: 'http://h:0/v1': port '0'", "--upstream", "llm=http://h:0/v1");
    CHECK_FAILS("--default-upstream: no upstream named 'nope'", "--default-upstream", "nope");
    CHECK_FAILS("--bogus: unknown option", "--bogus", "1");
    CHECK_FAILS("--auth: 'magic' is not one of none jwt header", "--auth", "magic");
    unsetenv("CHATGATE_JWT_SECRET");
    CHECK_FAILS("--auth: jwt needs the secret in the environment variable CHATGATE_JWT_SECRET", "--auth", "jwt");
    CHECK_FAILS("--allow-origin: 'a,b' must be one origin", "--allow-origin", "a,b");
    CHECK_FAILS("--store: 'mongo' must be memory or redis://", "--store", "mongo");
    CHECK_FAILS("--web: '/nonexistent/web' is not a directory", "--web", "/nonexistent/web");
    CHECK_FAILS("--listen: needs a value", "--listen");
    CHECK_FAILS("'stray': unexpected argument", "stray");
}

static void test_file(void)
{
    cg_config c;
    write_file("{\n"
                                  "  \"listen\": \"127.0.0.1:9100\",\n"
                                  "  \"upstreams\": {\n"
                                  "    \"llm\": {\"url\": \"http://127.0.0.1:8000/v1\", \"model\": \"qwen\",\n"
                                  "            \"idle_timeout_ms\": 1500, \"system_prompt\": \"Be brief.\"},\n"
                                  "    \"demo\": \"demo\"\n"
                                  "  },\n"
                                  "  \"default_upstream\": \"llm\",\n"
                                  "  \"max_frame\": 1000,\n"
                                  "  \"rate_limit\": {\"messages_per_second\": 5, \"burst\": 7}\n"
                                  "}\n");
    CHECK(load(&c, "--config", path, "--max-frame", "2000", NULL) == 0);
    CHECK(c.listen_port == 9100);
    CHECK(c.n_upstreams == 2);
    CHECK_STR(c.upstreams[0].model, "qwen");
    CHECK_STR(c.upstreams[0].system_prompt, "Be brief.");
    CHECK(c.upstreams[0].idle_timeout_ms == 1500);
    CHECK(c.upstreams[0].connect_timeout_ms == 5000);
    CHECK(c.upstreams[1].kind == CG_UPSTREAM_DEMO);
    CHECK(c.default_index == 0);
    CHECK(c.max_frame == 2000); /* the flag wins over the file */
    CHECK(c.rate_per_second == 5 && c.rate_burst == 7);
    cg_config_free(&c);
}

static void test_file_mistakes(void)
{
    CHECK_FILE_FAILS("{\n  \"listen\": \"127.0.0.1:9100\",\n  \"max_frame\": ,\n}\n", ":3:");

    CHECK_FILE_FAILS("{\"max_frame\": \"big\"}", ":1:2: max_frame: must be a whole number");

    CHECK_FILE_FAILS("{\"max_frames\": 5}", ":1:2: max_frames: unknown key");

    CHECK_FILE_FAILS("{\"upstreams\": {\"llm\": {\"url\": \"http://h/v1\", \"idle_timeout_ms\": -1}}}",
                     ":1:46: upstreams.llm.idle_timeout_ms: must be a whole number");

    CHECK_FILE_FAILS("{\"upstreams\": {\"llm\": {\"model\": \"m\"}}}", ": upstreams.llm.url: missing");

    CHECK_FILE_FAILS("{\"rate_limit\": {\"burst\": 0}}", ":1:17: rate_limit.burst: '0' is not a whole number from 1");

    CHECK_FILE_FAILS("{\"listen\": \"x\"}", ": listen: 'x' must be HOST:PORT");

    CHECK_FILE_FAILS("[1]", ":1:1: the configuration must be a JSON object");

    CHECK_FAILS("/nonexistent.json: unable to open", "--config", "/nonexistent.json");
    unlink(path);
}

static void test_redis_url_env(void)
{
    cg_config c;
    setenv("REDIS_URL", "redis://127.0.0.1:6379", 1);
    CHECK(load(&c, NULL) == 0);
    CHECK_STR(c.store, "redis://127.0.0.1:6379");
    cg_config_free(&c);
    CHECK(load(&c, "--store", "memory", NULL) == 0); /* the flag wins over the environment */
    CHECK_STR(c.store, "memory");
    cg_config_free(&c);
    setenv("REDIS_URL", "mongodb://x", 1);
    CHECK_FAILS("REDIS_URL is set in the environment", "--listen", "127.0.0.1:1");
    unsetenv("REDIS_URL");
}

static void test_state_settings(void)
{
    cg_config c;
    write_file("{\"lifetimes\": {\"awaiting_s\": 1, \"soft_s\": 2},\n"
                                  " \"history_n\": 3, \"redis\": {\"prefix\": \"cg\", \"command_timeout_ms\": 250},\n"
                                  " \"services\": {\"travel\": {\"defaults\": {\"cabin_class\": \"economy\"}}},\n"
                                  " \"allow_origin\": [\"https://a.example\", \"https://b.example\"]}\n");
    CHECK(load(&c, "--config", path, "--allow-origin", "http://c.example", "--auth", "header", NULL) == 0);
    CHECK(c.lifetimes.awaiting_s == 1 && c.lifetimes.soft_s == 2 && c.lifetimes.params_s == 6 * 3600);
    CHECK(c.lifetimes.history_n == 3);
    CHECK_STR(c.redis_prefix, "cg");
    CHECK(c.redis_command_timeout_ms == 250);
    CHECK_STR(json_string_value(json_object_get(json_object_get(json_object_get(c.services, "travel"), "defaults"),
                                                "cabin_class")),
              "economy");
    CHECK_STR(c.allow_origin, "https://a.example,https://b.example,http://c.example");
    CHECK_STR(c.user_header, "X-User-Id");
    cg_config_free(&c);

    CHECK_FILE_FAILS("{\"services\": {\"travel\": {\"defaults\": 3}}}",
                     ":1:26: services.travel.defaults: must be an object");
    CHECK_FILE_FAILS("{\"lifetimes\": {\"awaiting\": 3}}", ":1:16: lifetimes.awaiting: unknown key");
    unlink(path);
}

/* Issue 9: redis.prefix with a hash-tag brace, jwt.allow_no_exp, max_header_bytes. */
static void test_hardening_settings(void)
{
    CHECK_FILE_FAILS("{\n  \"redis\": {\"prefix\": \"app{1}\"}\n}\n",
                     ":2:13: redis.prefix: 'app{1}' must not contain '{' or '}'");
    CHECK_FILE_FAILS("{\"redis.prefix\": \"x}\"}", ": redis.prefix: 'x}' must not contain");

    cg_config c;
    write_file("{\"jwt\": {\"allow_no_exp\": true}, \"max_header_bytes\": 32768}");
    CHECK(load(&c, "--config", path, NULL) == 0);
    CHECK(c.jwt_allow_no_exp == 1);
    CHECK(c.max_header_bytes == 32768);
    cg_config_free(&c);
    CHECK(load(&c, NULL) == 0);
    CHECK(c.jwt_allow_no_exp == 0); /* tokens without exp are refused by default */
    CHECK(c.max_header_bytes == 16384);
    CHECK_STR(c.redis_prefix, "chatgate");
    cg_config_free(&c);
    CHECK_FILE_FAILS("{\"jwt\": {\"allow_no_exp\": 1}}", ":1:10: jwt.allow_no_exp: must be true or false");
    CHECK_FILE_FAILS("{\"max_header_bytes\": 100000}",
                     ":1:2: max_header_bytes: '100000' is not a whole number from 1024 to 65535");
    unlink(path);

    /* a long nested key is not cut into another one */
    char text[512];
    snprintf(text, sizeof(text), "{\"redis\": {\"%0200d\": 1}}", 0);
    CHECK(cg_config_load_text(&c, "t.json", text, strlen(text), err, sizeof(err)) == CG_CONFIG_EXIT_USAGE);
    CHECK(strstr(err, "t.json:1:12: redis.000") && strstr(err, ": unknown key"));
    cg_config_free(&c);
    const char *ok = "{\"listen\": \"127.0.0.1:9\", \"redis\": {\"prefix\": \"cg-test\"}}";
    CHECK(cg_config_load_text(&c, "t.json", ok, strlen(ok), err, sizeof(err)) == 0);
    CHECK(c.listen_port == 9);
    CHECK_STR(c.redis_prefix, "cg-test");
    cg_config_free(&c);
    /* a flag name longer than any flag is refused, not cut */
    char flag[128];
    snprintf(flag, sizeof(flag), "--listen%0100d", 0);
    CHECK_FAILS("unknown option", flag, "x");
}

/* upstreams.NAME.headers (headers.h): values from the file or the environment, the Host of
 * the URL, and every refusal naming the header's key, never its value. */
static void test_upstream_headers(void)
{
    cg_config c;
    setenv("CG_TEST_HEADER_KEY", "sekrit", 1);
    const char *file = write_file("{\"upstreams\": {\"llm\": {\"url\": \"http://h:8080/v1\", \"headers\": "
                                  "{\"x-portkey-api-key\": {\"env\": \"CG_TEST_HEADER_KEY\"}, \"X-Title\": \"chat\"}}}}");
    CHECK(load(&c, "--config", file, NULL) == 0);
    CHECK(c.n_upstreams == 1 && c.upstreams[0].headers.n == 2);
    CHECK_STR(c.upstreams[0].headers.items[0].value, "sekrit");
    CHECK(cg_headers_has(&c.upstreams[0].headers, "X-PORTKEY-API-KEY") && !cg_headers_has(&c.upstreams[0].headers, "Host"));
    CHECK_STR(c.upstreams[0].authority, "h:8080");
    char names[128];
    cg_headers_names(&c.upstreams[0].headers, names, sizeof(names));
    CHECK_STR(names, "x-portkey-api-key, X-Title");
    cg_config_free(&c);

    CHECK_FILE_FAILS("{\"upstreams\": {\"llm\": {\"url\": \"http://h/v1\", \"headers\": {\"Host\": \"x\"}}}}",
                     ":1:58: upstreams.llm.headers.Host: chatgate writes this header itself");
    CHECK_FILE_FAILS("{\"upstreams\": {\"llm\": {\"url\": \"http://h/v1\", \"headers\": {\"X-K\": \"a\\r\\nB: c\"}}}}",
                     ":1:58: upstreams.llm.headers.X-K: the value must be one line");
    CHECK_FILE_FAILS("{\"upstreams\": {\"llm\": {\"url\": \"http://h/v1\", \"headers\": {\"X-K\": {\"env\": \"CG_NO_SUCH_VAR\"}}}}}",
                     ":1:58: upstreams.llm.headers.X-K: the environment variable CG_NO_SUCH_VAR is not set");
    CHECK_FILE_FAILS("{\"upstreams\": {\"llm\": {\"url\": \"http://h/v1\", \"headers\": {\"bad name\": \"v\"}}}}",
                     ":1:58: upstreams.llm.headers.bad name: not a header name");
    CHECK_FILE_FAILS("{\"upstreams\": {\"llm\": {\"url\": \"ws://h/a\", \"headers\": {\"Sec-WebSocket-Key\": \"v\"}}}}",
                     ":1:55: upstreams.llm.headers.Sec-WebSocket-Key: chatgate writes");
    CHECK(strstr(err, "sekrit") == NULL);
    unsetenv("CG_TEST_HEADER_KEY");
    unlink(path);
}

int main(void)
{
    unsetenv("REDIS_URL");
    test_defaults();
    test_flags();
    test_flag_mistakes();
    test_file();
    test_file_mistakes();
    test_redis_url_env();
    test_state_settings();
    test_hardening_settings();
    test_upstream_headers();
    return unit_done("test_config");
}
