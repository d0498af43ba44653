/*
 * test_config.c: settings from flags and from a JSON file, and the messages for mistakes:
 * "--flag: ..." for a flag, "file:line:col: ..." for JSON syntax, "file: key: ..." for a
 * wrong value (docs/architecture.md, Operations).
 */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <sys/wait.h>
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
    CHECK_FAILS("--store: must be memory, redis[s]://", "--store", "mongo");
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

    CHECK_FAILS("/nonexistent.json: No such file or directory", "--config", "/nonexistent.json");
    unlink(path);

    /* --config a FIFO no one writes to (core/file.h): read at once, and empty, where fopen()
     * waited in open() for ever */
    char fifo[64];
    snprintf(fifo, sizeof(fifo), "/tmp/cg-test-config-%d.fifo", (int)getpid());
    CHECK(mkfifo(fifo, 0600) == 0);
    CHECK_FAILS("fifo:1:0: '[' or '{' expected near end of file", "--config", fifo);
    unlink(fifo);

    /* --config <(...): bash hands the reading end of a pipe as /dev/fd/N, its writer there */
    int p[2];
    CHECK(pipe(p) == 0);
    pid_t writer = fork();
    if (writer == 0) {
        close(p[0]);
        static const char text[] = "{\"max_frame\": 4096}";
        _exit(write(p[1], text, sizeof(text) - 1) == (ssize_t)sizeof(text) - 1 ? 0 : 1);
    }
    close(p[1]);
    char dev_fd[32];
    snprintf(dev_fd, sizeof(dev_fd), "/dev/fd/%d", p[0]);
    cg_config c;
    CHECK(load(&c, "--config", dev_fd, NULL) == 0);
    CHECK(c.max_frame == 4096);
    cg_config_free(&c);
    close(p[0]);
    int status = 0;
    CHECK(waitpid(writer, &status, 0) == writer && WIFEXITED(status) && WEXITSTATUS(status) == 0);

    /* a "file" with no end stops at the bound */
    CHECK_FAILS("/dev/zero: larger than", "--config", "/dev/zero");
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

/* Config text (named t.json) that fails to load with a message containing want. */
#define CHECK_TEXT_FAILS(text, want)                                                        \
    do {                                                                                    \
        cg_config c_;                                                                       \
        const char *t_ = (text);                                                            \
        err[0] = 0;                                                                         \
        CHECK(cg_config_load_text(&c_, "t.json", t_, strlen(t_), err, sizeof(err)) == CG_CONFIG_EXIT_USAGE); \
        if (!strstr(err, want))                                                             \
            fprintf(stderr, "%s:%d: message \"%s\" lacks \"%s\"\n", __FILE__, __LINE__, err, want); \
        CHECK(strstr(err, want) != NULL);                                                   \
        cg_config_free(&c_);                                                                \
    } while (0)

static int limits_eq(const cg_limits *l, long messages, long turns, long long tok_minute, long long tok_day)
{
    return l && l->messages_per_minute == messages && l->turns_at_once == turns && l->tokens_per_minute == tok_minute &&
           l->tokens_per_day == tok_day;
}

/* The "limits" section (limits_config.h): the default plan, named plans inheriting the keys
 * they leave out, the users' list, and the plan a connection is held to. */
static void test_limits(void)
{
    cg_config c;
    const char *text = "{\n"
                       "  \"limits\": {\n"
                       "    \"messages_per_minute\": 20, \"turns_at_once\": 2,\n"
                       "    \"tokens_per_minute\": 20000, \"tokens_per_day\": 200000,\n"
                       "    \"plan_claim\": \"plan\",\n"
                       "    \"plans\": {\n"
                       "      \"pro\": {\"messages_per_minute\": 120, \"tokens_per_day\": 0},\n"
                       "      \"solo\": {\"turns_at_once\": 1},\n"
                       "      \"unlimited\": {\"messages_per_minute\": 0, \"turns_at_once\": 0,\n"
                       "                    \"tokens_per_minute\": 0, \"tokens_per_day\": 0}\n"
                       "    },\n"
                       "    \"users\": {\"ops-bot\": \"pro\", \"alice\": \"default\", \"root\": \"unlimited\"}\n"
                       "  }\n"
                       "}\n";
    err[0] = 0;
    CHECK(cg_config_load_text(&c, "t.json", text, strlen(text), err, sizeof(err)) == 0);
    CHECK_STR(err, "");
    const cg_limits_config *lc = &c.limits;
    CHECK(limits_eq(&lc->base, 20, 2, 20000, 200000));
    CHECK_STR(lc->plan_claim, "plan");
    CHECK(lc->n_plans == 3);
    CHECK_STR(lc->plans[0].name, "pro");
    CHECK(limits_eq(&lc->plans[0].limits, 120, 2, 20000, 0)); /* turns and tokens a minute: the default's */
    CHECK_STR(lc->plans[1].name, "solo");
    CHECK(limits_eq(&lc->plans[1].limits, 20, 1, 20000, 200000));
    CHECK_STR(lc->plans[2].name, "unlimited");
    CHECK(limits_eq(&lc->plans[2].limits, 0, 0, 0, 0));
    CHECK(json_object_size(lc->users) == 3);

    int warn = -1;
    /* the operator's list of users wins over the plan the token names */
    CHECK(cg_limits_for(lc, "ops-bot", "solo", &warn) == &lc->plans[0].limits && warn == 0);
    CHECK(cg_limits_for(lc, "ops-bot", NULL, &warn) == &lc->plans[0].limits && warn == 0);
    CHECK(cg_limits_for(lc, "alice", "pro", &warn) == &lc->base && warn == 0);
    CHECK(cg_limits_for(lc, "alice", "gold", &warn) == &lc->base && warn == 0);
    /* then the token's plan */
    CHECK(cg_limits_for(lc, "bob", "solo", &warn) == &lc->plans[1].limits && warn == 0);
    CHECK(cg_limits_for(lc, "bob", "pro", &warn) == &lc->plans[0].limits && warn == 0);
    CHECK(cg_limits_for(lc, "bob", "default", &warn) == &lc->base && warn == 0);
    /* no plan: the default one */
    CHECK(cg_limits_for(lc, "bob", NULL, &warn) == &lc->base && warn == 0);
    CHECK(cg_limits_for(lc, "bob", "", &warn) == &lc->base && warn == 0);
    CHECK(cg_limits_for(lc, NULL, NULL, &warn) == &lc->base && warn == 0);
    /* a plan not in limits.plans: the default one, and a warning */
    warn = 0;
    CHECK(cg_limits_for(lc, "bob", "gold", &warn) == &lc->base && warn == 1);
    CHECK(cg_limits_for(lc, "bob", "Pro", &warn) == &lc->base && warn == 1); /* names are exact */
    CHECK(cg_limits_for(lc, "bob", "pro", &warn) == &lc->plans[0].limits && warn == 0); /* warn is reset */
    /* a plan that sets no limit: nothing to count */
    CHECK(cg_limits_for(lc, "root", "pro", &warn) == NULL && warn == 0);
    CHECK(cg_limits_for(lc, "bob", "unlimited", &warn) == NULL && warn == 0);
    cg_config_free(&c);
    CHECK(c.limits.n_plans == 0 && c.limits.plan_claim == NULL && c.limits.users == NULL);

    /* the keys in any order: plans take the default's keys written after them; users may
     * name a plan written after them */
    text = "{\"limits\": {\"users\": {\"bob\": \"pro\"}, \"plans\": {\"pro\": {\"turns_at_once\": 3}},\n"
           "            \"turns_at_once\": 1, \"messages_per_minute\": 9}}";
    CHECK(cg_config_load_text(&c, "t.json", text, strlen(text), err, sizeof(err)) == 0);
    CHECK(limits_eq(&c.limits.base, 9, 1, 0, 0));
    CHECK(c.limits.n_plans == 1 && limits_eq(&c.limits.plans[0].limits, 9, 3, 0, 0));
    CHECK(c.limits.plan_claim == NULL);
    CHECK(cg_limits_for(&c.limits, "bob", NULL, &warn) == &c.limits.plans[0].limits && warn == 0);
    cg_config_free(&c);

    /* a default plan with no limits and one plan that has some; the largest values */
    char name64[80];
    snprintf(name64, sizeof(name64), "%064d", 0);
    char big[512];
    snprintf(big, sizeof(big),
             "{\"limits\": {\"plans\": {\"team\": {\"turns_at_once\": 1},\n"
             "  \"%s\": {\"messages_per_minute\": 1000000, \"turns_at_once\": 100000,\n"
             "           \"tokens_per_minute\": 1000000000000, \"tokens_per_day\": 1000000000000}}}}",
             name64);
    CHECK(cg_config_load_text(&c, "t.json", big, strlen(big), err, sizeof(err)) == 0);
    CHECK(limits_eq(&c.limits.base, 0, 0, 0, 0));
    CHECK(c.limits.n_plans == 2);
    CHECK(cg_limits_for(&c.limits, "bob", NULL, &warn) == NULL && warn == 0);
    CHECK(cg_limits_for(&c.limits, "bob", "team", &warn) == &c.limits.plans[0].limits && warn == 0);
    CHECK(cg_limits_for(&c.limits, "bob", "gold", &warn) == NULL && warn == 1); /* the default: no limit */
    CHECK(limits_eq(cg_limits_for(&c.limits, "bob", name64, &warn), 1000000, 100000, 1000000000000LL,
                    1000000000000LL));
    cg_config_free(&c);

    /* no limits section: no limits */
    CHECK(cg_config_load_text(&c, "t.json", "{}", 2, err, sizeof(err)) == 0);
    CHECK(c.limits.n_plans == 0 && c.limits.plan_claim == NULL && c.limits.users == NULL);
    CHECK(cg_limits_for(&c.limits, "bob", NULL, &warn) == NULL && warn == 0);
    CHECK(cg_limits_for(&c.limits, "bob", "", &warn) == NULL && warn == 0);
    cg_config_free(&c);
    CHECK(load(&c, NULL) == 0);
    CHECK(cg_limits_for(&c.limits, "bob", NULL, &warn) == NULL && warn == 0);
    cg_config_free(&c);

    /* refusals: each names the key and where it is */
    CHECK_TEXT_FAILS("{\"limits\": {\"messages_per_minute\": -1}}",
                     "t.json:1:13: limits.messages_per_minute: must be a whole number from 0 (no limit) to 1000000");
    CHECK_TEXT_FAILS("{\"limits\": {\"turns_at_once\": 100001}}",
                     "t.json:1:13: limits.turns_at_once: must be a whole number from 0 (no limit) to 100000");
    CHECK_TEXT_FAILS("{\"limits\": {\"tokens_per_minute\": \"20000\"}}",
                     "t.json:1:13: limits.tokens_per_minute: must be a whole number from 0 (no limit) to 1000000000000");
    CHECK_TEXT_FAILS("{\"limits\": {\"tokens_per_day\": 1.5}}",
                     "t.json:1:13: limits.tokens_per_day: must be a whole number from 0 (no limit) to 1000000000000");
    CHECK_TEXT_FAILS("{\"limits\": {\"tokens_per_day\": 1000000000001}}",
                     "t.json:1:13: limits.tokens_per_day: must be a whole number from 0 (no limit) to 1000000000000");
    CHECK_TEXT_FAILS("{\n  \"listen\": \"127.0.0.1:9000\",\n  \"limits\": {\n    \"turns_at_once\": 2,\n"
                     "    \"plans\": {\"pro\": {\"tokens_per_day\": \"lots\"}}\n  }\n}\n",
                     "t.json:5:23: limits.plans.pro.tokens_per_day: must be a whole number from 0 (no limit) to "
                     "1000000000000");
    CHECK_TEXT_FAILS("{\"limits\": {\"plans\": {\"pro\": {\"turns_at_once\": -2}}}}",
                     "t.json:1:31: limits.plans.pro.turns_at_once: must be a whole number from 0");
    CHECK_TEXT_FAILS("{\"limits\": {\"tokens_per_hour\": 5}}", "t.json:1:13: limits.tokens_per_hour: unknown key");
    CHECK_TEXT_FAILS("{\"limits\": {\"plans\": {\"pro\": {\"burst\": 3}}}}",
                     "t.json:1:31: limits.plans.pro.burst: unknown key (a plan sets messages_per_minute, "
                     "turns_at_once, tokens_per_minute, tokens_per_day)");
    CHECK_TEXT_FAILS("{\"limits\": {\"plans\": {\"pro\": {\"plan_claim\": \"p\"}}}}",
                     "t.json:1:31: limits.plans.pro.plan_claim: unknown key");
    CHECK_TEXT_FAILS("{\"limits\": {\"plans\": {\"default\": {\"turns_at_once\": 1}}}}",
                     "t.json:1:23: limits.plans.default: a plan's name is 1 to 64 bytes and not \"default\"");
    CHECK_TEXT_FAILS("{\"limits\": {\"plans\": {\"\": {\"turns_at_once\": 1}}}}",
                     "limits.plans.: a plan's name is 1 to 64 bytes");
    snprintf(big, sizeof(big), "{\"limits\": {\"plans\": {\"%065d\": {}}}}", 0);
    CHECK_TEXT_FAILS(big, "t.json:1:23: limits.plans.00000");
    CHECK(strstr(err, "0: a plan's name is 1 to 64 bytes") != NULL);
    /* at most CG_MAX_PLANS plans */
    char many[4096];
    size_t n = (size_t)snprintf(many, sizeof(many), "{\"limits\": {\"plans\": {");
    for (int i = 1; i <= CG_MAX_PLANS; i++)
        n += (size_t)snprintf(many + n, sizeof(many) - n, "%s\"p%d\": {\"turns_at_once\": %d}", i > 1 ? ", " : "", i, i);
    snprintf(many + n, sizeof(many) - n, "}}}");
    CHECK(cg_config_load_text(&c, "t.json", many, strlen(many), err, sizeof(err)) == 0);
    CHECK(c.limits.n_plans == 64 && c.limits.plans[63].limits.turns_at_once == 64);
    CHECK_STR(c.limits.plans[63].name, "p64");
    cg_config_free(&c);
    snprintf(many + n, sizeof(many) - n, ", \"p65\": {}}}}");
    CHECK_TEXT_FAILS(many, ": limits.plans.p65: must be an object of limits (at most 64 plans)");
    CHECK_TEXT_FAILS("{\"limits\": {\"plans\": {\"pro\": 5}}}",
                     "t.json:1:23: limits.plans.pro: must be an object of limits");
    CHECK_TEXT_FAILS("{\"limits\": {\"plans\": [\"pro\"]}}", "t.json:1:13: limits.plans: must be an object");
    CHECK_TEXT_FAILS("{\"limits\": {\"plans\": {\"pro\": {}}, \"users\": {\"bob\": \"gold\"}}}",
                     "t.json:1:45: limits.users.bob: must name a plan of limits.plans, or \"default\"");
    CHECK_TEXT_FAILS("{\"limits\": {\"users\": {\"bob\": \"pro\"}}}", "t.json:1:23: limits.users.bob: must name a plan");
    CHECK_TEXT_FAILS("{\"limits\": {\"users\": {\"bob\": 1}}}", "t.json:1:23: limits.users.bob: must name a plan");
    CHECK_TEXT_FAILS("{\"limits\": {\"users\": [\"bob\"]}}", "t.json:1:13: limits.users: must be an object");
    CHECK_TEXT_FAILS("{\"limits\": {\"plan_claim\": 7}}", "t.json:1:13: limits.plan_claim: must be the name of a JWT claim");
    CHECK_TEXT_FAILS("{\"limits\": {\"plan_claim\": true}}", "t.json:1:13: limits.plan_claim: must be the name");
    CHECK_TEXT_FAILS("{\"limits\": {\"plan_claim\": \"\"}}", "t.json:1:13: limits.plan_claim: must be the name");
    CHECK_TEXT_FAILS("{\"limits\": 5}", "t.json:1:2: limits: must be an object");

    /* and from a file, the file's name in front */
    CHECK_FILE_FAILS("{\n  \"limits\": {\"messages_per_minute\": -1}\n}\n", ":2:14: limits.messages_per_minute: must be");
    unlink(path);
}

/* --store and --auth are parsed once into kinds (the rest of a Redis URL is the store's). */
static void test_kinds(void)
{
    static const struct {
        const char *store;
        cg_store_kind kind;
        int tls;
        const char *name;
    } stores[] = {
        {"memory", CG_STORE_MEMORY, 0, "memory"},
        {"redis://127.0.0.1:6379", CG_STORE_REDIS, 0, "redis"},
        {"rediss://127.0.0.1:6379", CG_STORE_REDIS, 1, "rediss"},
        {"redis-sentinel://127.0.0.1:26379/mymaster", CG_STORE_SENTINEL, 0, "redis-sentinel"},
        {"rediss-cluster://127.0.0.1:7000", CG_STORE_CLUSTER, 1, "rediss-cluster"},
    };
    char text[256], err[256];
    for (size_t i = 0; i < sizeof(stores) / sizeof(stores[0]); i++) {
        cg_config c;
        snprintf(text, sizeof(text), "{\"store\": \"%s\", \"auth\": \"header\"}", stores[i].store);
        CHECK(cg_config_load_text(&c, "t.json", text, strlen(text), err, sizeof(err)) == 0);
        CHECK(c.store_kind == stores[i].kind && c.store_tls == stores[i].tls);
        CHECK_STR(cg_config_store_name(&c), stores[i].name);
        CHECK(c.auth_kind == CG_AUTH_HEADER);
        cg_config_free(&c);
    }
    cg_config c;
    CHECK(cg_config_load_text(&c, "t.json", "{}", 2, err, sizeof(err)) == 0);
    CHECK(c.auth_kind == CG_AUTH_NONE && c.store_kind == CG_STORE_MEMORY);
    cg_config_free(&c);
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
    test_limits();
    test_kinds();
    return unit_done("test_config");
}
