/*
 * test_redis_slots.c: the pure rules of Redis Cluster (redis_cluster.h, redis_slots.c),
 * without a server: the cluster's CRC16 (the spec's check value), a key's slot with the hash
 * tag rules (the slots of real keys, as Redis itself answers them), the redirects a node
 * answers (MOVED, ASK, TRYAGAIN, CLUSTERDOWN; a malformed MOVED or ASK is no redirect), and
 * the slot map read from a CLUSTER SLOTS reply built by hand (the masters kept, replicas
 * ignored, an empty host taking the seed's, gaps left unowned, malformed replies refused).
 */
#include <stdarg.h>

#include "chatgate/store/redis_cluster.h"
#include "unit.h"

/* ---- CRC16 and the slot of a key ---------------------------------------------------------- */

/* The slot of key[0..len), read from an exact-size copy (ASan sees a read past its end). */
static unsigned slot_of(const char *key, size_t len)
{
    char *copy = unit_dup_exact(key, len);
    unsigned slot = cg_redis_key_slot(copy, len);
    free(copy);
    return slot;
}

#define SLOT(s) slot_of((s), sizeof(s) - 1)

static void test_crc16(void)
{
    /* The cluster spec's check value (CRC16-CCITT, XMODEM). */
    char *nine = unit_dup_exact("123456789", 9);
    CHECK(cg_redis_crc16(nine, 9) == 0x31C3);
    free(nine);
    CHECK(cg_redis_crc16("", 0) == 0);
    CHECK(cg_redis_crc16("123456789", 0) == 0); /* len counts, not the NUL */
    CHECK(cg_redis_crc16("\xff", 1) == 0x1EF0);
}

/*
 * Every expected slot below is what Redis 7.0's CLUSTER KEYSLOT answers (redis-server 7.0.15,
 * --cluster-enabled yes; the binary keys given to redis-cli -x from printf).
 */
static void test_key_slot(void)
{
    CHECK(SLOT("foo") == 12182);
    CHECK(SLOT("123456789") == 12739); /* 0x31C3 */
    CHECK(SLOT("") == 0);

    /* A tag: only what is between the first '{' and the next '}' is hashed. */
    CHECK(SLOT("{user1000}.following") == 3443);
    CHECK(SLOT("{user1000}.followers") == 3443);
    CHECK(SLOT("user1000") == 3443);
    CHECK(SLOT("chatgate:{u_abc}:room:params") == 722);
    CHECK(SLOT("u_abc") == 722);
    CHECK(SLOT("a{b}") == 3300);

    /* "{}" first: no tag, the whole key is hashed (not "bar", 5061). */
    CHECK(SLOT("foo{}{bar}") == 8363);
    CHECK(SLOT("bar") == 5061);
    /* The first '{' and the first '}' after it: the tag is "{bar". */
    CHECK(SLOT("foo{{bar}}zap") == 4015);
    CHECK(SLOT("{bar") == 4015);
    /* Only the first tag counts: "bar", not "zap". */
    CHECK(SLOT("foo{bar}{zap}") == 5061);
    CHECK(SLOT("{a}{b}") == 15495);
    CHECK(SLOT("a") == 15495);
    /* A '}' before the first '{' does not close it. */
    CHECK(SLOT("}{bar}") == 5061);
    CHECK(SLOT("a}b{c}d") == 7365);
    CHECK(SLOT("c") == 7365);
    CHECK(SLOT("{}{bar}") == 11272); /* "{}" first: the whole key */
    /* A '{' with no '}' after it, or a lone brace: the whole key. */
    CHECK(SLOT("foo{bar") == 15278);
    CHECK(SLOT("{") == 4092);
    CHECK(SLOT("}") == 12090);
    CHECK(SLOT("{}") == 15257);

    /* Bytes that are not ASCII, and a NUL inside the key (the length counts, not the NUL). */
    CHECK(SLOT("\xff") == 7920);
    CHECK(SLOT("a\xff" "b") == 9024);
    CHECK(SLOT("{\xff}x") == 7920); /* the tag "\xff" */
    CHECK(SLOT("k\xff\x00\x01") == 6287);
}

/* ---- redirects --------------------------------------------------------------------------- */

/* Parses err (an exact-size copy, strlen bytes) into *out; the kind returned, which must also
 * be out->kind. */
static cg_redis_redirect_kind redirect(const char *err, cg_redis_redirect *out)
{
    size_t len = strlen(err);
    char *copy = unit_dup_exact(err, len);
    memset(out, 0x5a, sizeof(*out)); /* nothing left over from the caller */
    cg_redis_redirect_kind k = cg_redis_parse_redirect(copy, len, out);
    free(copy);
    CHECK(out->kind == k);
    return k;
}

static void test_redirect_moved_ask(void)
{
    cg_redis_redirect r;
    CHECK(redirect("MOVED 3999 127.0.0.1:6381", &r) == CG_REDIRECT_MOVED);
    CHECK(r.slot == 3999);
    CHECK_STR(r.host, "127.0.0.1");
    CHECK(r.port == 6381);

    CHECK(redirect("ASK 3999 127.0.0.1:6381", &r) == CG_REDIRECT_ASK);
    CHECK(r.slot == 3999);
    CHECK_STR(r.host, "127.0.0.1");
    CHECK(r.port == 6381);

    /* IPv6, without brackets: the port is after the last ':'. */
    CHECK(redirect("MOVED 1 ::1:7000", &r) == CG_REDIRECT_MOVED);
    CHECK(r.slot == 1);
    CHECK_STR(r.host, "::1");
    CHECK(r.port == 7000);

    /* The bounds that are still valid: slots 0 and 16383, ports 1 and 65535. */
    CHECK(redirect("MOVED 0 10.0.0.1:1", &r) == CG_REDIRECT_MOVED);
    CHECK(r.slot == 0 && r.port == 1);
    CHECK_STR(r.host, "10.0.0.1");
    CHECK(redirect("ASK 16383 redis-2.internal:65535", &r) == CG_REDIRECT_ASK);
    CHECK(r.slot == 16383 && r.port == 65535);
    CHECK_STR(r.host, "redis-2.internal");

    /* A host of 63 bytes fits host[64]. */
    char buf[160];
    char host63[64];
    memset(host63, 'h', 63);
    host63[63] = 0;
    snprintf(buf, sizeof(buf), "MOVED 42 %s:6379", host63);
    CHECK(redirect(buf, &r) == CG_REDIRECT_MOVED);
    CHECK(r.slot == 42 && r.port == 6379);
    CHECK_STR(r.host, host63);
}

/* The text is len bytes, not a C string: nothing after them is read (here, a byte that would
 * change the port, and a key's tag cut by len). */
static void test_redirect_len(void)
{
    static const char text[] = "MOVED 1 1.2.3.4:59";
    cg_redis_redirect r;
    memset(&r, 0x5a, sizeof(r));
    CHECK(cg_redis_parse_redirect(text, sizeof(text) - 2, &r) == CG_REDIRECT_MOVED); /* without the '9' */
    CHECK(r.slot == 1);
    CHECK_STR(r.host, "1.2.3.4");
    CHECK(r.port == 5);

    static const char ask[] = "ASK 12 1.2.3.4:5";
    memset(&r, 0x5a, sizeof(r));
    CHECK(cg_redis_parse_redirect(ask, 5, &r) == CG_REDIRECT_NONE); /* "ASK 1": no address */
    CHECK(r.kind == CG_REDIRECT_NONE);

    CHECK(cg_redis_key_slot("foo{bar}", 3) == 12182); /* "foo" */
    CHECK(cg_redis_key_slot("{bar}", 4) == 4015);     /* "{bar": no '}', the whole of it */
}

static void test_redirect_retry(void)
{
    cg_redis_redirect r;
    CHECK(redirect("TRYAGAIN Multiple keys request during rehashing of slot", &r) == CG_REDIRECT_TRYAGAIN);
    CHECK(redirect("CLUSTERDOWN The cluster is down", &r) == CG_REDIRECT_CLUSTERDOWN);
    CHECK(redirect("CLUSTERDOWN Hash slot not served", &r) == CG_REDIRECT_CLUSTERDOWN);
}

static void test_redirect_none(void)
{
    static const char *const none[] = {
        "MOVED",
        "MOVED ",
        "MOVED x 1.2.3.4:5",
        "MOVED 16384 1.2.3.4:5", /* slot out of range */
        "MOVED -1 1.2.3.4:5",
        "MOVED 1 1.2.3.4",       /* no port */
        "MOVED 1 1.2.3.4:",      /* an empty port */
        "MOVED 1 1.2.3.4:0",
        "MOVED 1 1.2.3.4:70000",
        "MOVED 1 1.2.3.4:63x",
        "MOVED 1 :6379",         /* no host */
        "MOVED 1",
        "ASK",
        "ASK 16384 1.2.3.4:5",
        "ASK 1 1.2.3.4",
        "ERR unknown command",
        "NOSCRIPT No matching script",
        "WRONGTYPE Operation against a key holding the wrong kind of value",
        "",
    };
    for (size_t i = 0; i < sizeof(none) / sizeof(none[0]); i++) {
        cg_redis_redirect r;
        cg_redis_redirect_kind k = redirect(none[i], &r);
        if (k != CG_REDIRECT_NONE)
            fprintf(stderr, "  \"%s\" gave kind %d\n", none[i], (int)k);
        CHECK(k == CG_REDIRECT_NONE);
    }

    /* A host of 64 bytes (and more) does not fit host[64]. */
    char buf[256];
    char host[129];
    cg_redis_redirect r;
    memset(host, 'h', 64);
    host[64] = 0;
    snprintf(buf, sizeof(buf), "MOVED 42 %s:6379", host);
    CHECK(redirect(buf, &r) == CG_REDIRECT_NONE);
    memset(host, 'h', 128);
    host[128] = 0;
    snprintf(buf, sizeof(buf), "ASK 42 %s:6379", host);
    CHECK(redirect(buf, &r) == CG_REDIRECT_NONE);
}

/* ---- CLUSTER SLOTS replies, built by hand ---------------------------------------------- */

static redisReply *rep_new(int type)
{
    redisReply *r = calloc(1, sizeof(*r));
    if (!r)
        abort();
    r->type = type;
    return r;
}

static redisReply *rep_int(long long v)
{
    redisReply *r = rep_new(REDIS_REPLY_INTEGER);
    r->integer = v;
    return r;
}

static redisReply *rep_text(int type, const char *s)
{
    redisReply *r = rep_new(type);
    r->len = strlen(s);
    r->str = malloc(r->len + 1);
    if (!r->str)
        abort();
    memcpy(r->str, s, r->len + 1);
    return r;
}

static redisReply *rep_str(const char *s)
{
    return rep_text(REDIS_REPLY_STRING, s);
}

/* An array of n elements, given as n redisReply *. */
static redisReply *rep_arr(size_t n, ...)
{
    redisReply *r = rep_new(REDIS_REPLY_ARRAY);
    r->elements = n;
    r->element = n ? calloc(n, sizeof(*r->element)) : NULL;
    if (n && !r->element)
        abort();
    va_list ap;
    va_start(ap, n);
    for (size_t i = 0; i < n; i++)
        r->element[i] = va_arg(ap, redisReply *);
    va_end(ap);
    return r;
}

static void rep_free(redisReply *r)
{
    if (!r)
        return;
    for (size_t i = 0; i < r->elements; i++)
        rep_free(r->element[i]);
    free(r->element);
    free(r->str);
    free(r);
}

/* A node of CLUSTER SLOTS: [host, port, id]. */
static redisReply *node(const char *host, long long port, const char *id)
{
    return rep_arr(3, rep_str(host), rep_int(port), rep_str(id));
}

/* A range [first, last, master] (no replica). */
static redisReply *range(long long first, long long last, redisReply *master)
{
    return rep_arr(3, rep_int(first), rep_int(last), master);
}

static cg_redis_slot_map *map_new(void)
{
    cg_redis_slot_map *m = malloc(sizeof(*m)); /* ~50 kB: not on the stack */
    if (!m)
        abort();
    memset(m, 0x5a, sizeof(*m)); /* garbage: the read must set every field it answers with */
    return m;
}

/* How many slots of m have owner o. */
static int owned_by(const cg_redis_slot_map *m, int o)
{
    int n = 0;
    for (int s = 0; s < CG_REDIS_SLOTS; s++)
        n += m->owner[s] == o;
    return n;
}

static void test_map_three_masters(void)
{
    /* What a 3-master cluster (one replica on the first) answers. */
    redisReply *r = rep_arr(
        3,
        rep_arr(4, rep_int(0), rep_int(5460), node("127.0.0.1", 7000, "e7d1eecce10fd6bb5eb35b9f99a514335d9ba9ca"),
                node("127.0.0.1", 7003, "2e7d2bbc6a9e3c4f4e0cf2b5b8e2d1b0c1a6c3f4")),
        range(5461, 10922, node("127.0.0.1", 7001, "0ded8ab8fa8f1d0a93f96ad1e0e1ea5ff1d0e0a1")),
        range(10923, 16383, node("127.0.0.1", 7002, "67ed2db8d677e59ec4a4cefb06858cf2a1a89fa1")));
    cg_redis_slot_map *m = map_new();
    char err[128] = "";
    CHECK(cg_redis_slot_map_read(r, "10.9.9.9", m, err, sizeof(err)) == 0);
    CHECK_STR(err, "");
    CHECK(m->n_nodes == 3);
    CHECK_STR(m->nodes[0].host, "127.0.0.1");
    CHECK(m->nodes[0].port == 7000);
    CHECK_STR(m->nodes[1].host, "127.0.0.1");
    CHECK(m->nodes[1].port == 7001);
    CHECK_STR(m->nodes[2].host, "127.0.0.1");
    CHECK(m->nodes[2].port == 7002);
    CHECK(m->owner[0] == 0);
    CHECK(m->owner[5460] == 0);
    CHECK(m->owner[5461] == 1);
    CHECK(m->owner[10922] == 1);
    CHECK(m->owner[10923] == 2);
    CHECK(m->owner[16383] == 2);
    CHECK(owned_by(m, 0) == 5461);
    CHECK(owned_by(m, 1) == 5462);
    CHECK(owned_by(m, 2) == 5461);
    CHECK(owned_by(m, -1) == 0);
    /* The replica (7003) is never a node of the map. */
    int replica = 0;
    for (int i = 0; i < m->n_nodes; i++)
        replica += m->nodes[i].port == 7003;
    CHECK(replica == 0);
    free(m);
    rep_free(r);
}

static void test_map_seed_host(void)
{
    /* A master named "" (or "?"): the node that answered, so the seed's address. */
    redisReply *r = rep_arr(2, range(0, 8191, node("", 7000, "a")), range(8192, 16383, node("?", 7001, "b")));
    cg_redis_slot_map *m = map_new();
    char err[128] = "";
    CHECK(cg_redis_slot_map_read(r, "10.1.2.3", m, err, sizeof(err)) == 0);
    CHECK(m->n_nodes == 2);
    CHECK_STR(m->nodes[0].host, "10.1.2.3");
    CHECK(m->nodes[0].port == 7000);
    CHECK_STR(m->nodes[1].host, "10.1.2.3");
    CHECK(m->nodes[1].port == 7001);
    CHECK(m->owner[0] == 0 && m->owner[8191] == 0);
    CHECK(m->owner[8192] == 1 && m->owner[16383] == 1);
    free(m);
    rep_free(r);
}

static void test_map_one_master_two_ranges(void)
{
    /* Ranges not in one piece on a master (after a resharding): one node. */
    redisReply *r = rep_arr(3, range(0, 99, node("10.0.0.1", 7000, "a")), range(100, 199, node("10.0.0.2", 7000, "b")),
                            range(200, 16383, node("10.0.0.1", 7000, "a")));
    cg_redis_slot_map *m = map_new();
    char err[128] = "";
    CHECK(cg_redis_slot_map_read(r, "10.9.9.9", m, err, sizeof(err)) == 0);
    CHECK(m->n_nodes == 2);
    CHECK_STR(m->nodes[0].host, "10.0.0.1");
    CHECK_STR(m->nodes[1].host, "10.0.0.2"); /* same port, another host: another node */
    CHECK(m->owner[0] == 0 && m->owner[99] == 0);
    CHECK(m->owner[100] == 1 && m->owner[199] == 1);
    CHECK(m->owner[200] == 0 && m->owner[16383] == 0);
    CHECK(owned_by(m, 0) == 16384 - 100);
    free(m);
    rep_free(r);

    /* Two ranges back to back on a single master. */
    r = rep_arr(2, range(0, 5000, node("10.0.0.1", 7000, "a")), range(5001, 16383, node("10.0.0.1", 7000, "a")));
    m = map_new();
    CHECK(cg_redis_slot_map_read(r, "10.9.9.9", m, err, sizeof(err)) == 0);
    CHECK(m->n_nodes == 1);
    CHECK(owned_by(m, 0) == 16384);
    free(m);
    rep_free(r);
}

static void test_map_gap(void)
{
    /* Slots 100-199 have no master (the cluster is down there): -1. */
    redisReply *r =
        rep_arr(2, range(0, 99, node("10.0.0.1", 7000, "a")), range(200, 16383, node("10.0.0.2", 7001, "b")));
    cg_redis_slot_map *m = map_new();
    char err[128] = "";
    CHECK(cg_redis_slot_map_read(r, "10.9.9.9", m, err, sizeof(err)) == 0);
    CHECK(m->n_nodes == 2);
    CHECK(m->owner[99] == 0);
    CHECK(m->owner[100] == -1);
    CHECK(m->owner[150] == -1);
    CHECK(m->owner[199] == -1);
    CHECK(m->owner[200] == 1);
    CHECK(owned_by(m, -1) == 100);
    free(m);
    rep_free(r);
}

/* Reads r, which must be refused: -1 and an error naming CLUSTER SLOTS (and want, if given). */
static void refused(redisReply *r, const char *want, int line)
{
    cg_redis_slot_map *m = map_new();
    char err[256] = "";
    int rc = cg_redis_slot_map_read(r, "10.9.9.9", m, err, sizeof(err));
    if (rc != -1 || !err[0] || !strstr(err, "CLUSTER SLOTS") || (want && !strstr(err, want)))
        fprintf(stderr, "  case of line %d: rc %d, err \"%s\"\n", line, rc, err);
    CHECK(rc == -1);
    CHECK(err[0] != 0);
    CHECK(strstr(err, "CLUSTER SLOTS") != NULL);
    if (want)
        CHECK(strstr(err, want) != NULL);
    free(m);
    rep_free(r);
}

static void test_map_malformed(void)
{
    refused(NULL, NULL, __LINE__);
    refused(rep_str("OK"), "not an array", __LINE__);
    refused(rep_int(3), "not an array", __LINE__);
    refused(rep_text(REDIS_REPLY_ERROR, "ERR This instance has cluster support disabled"), "cluster support disabled",
            __LINE__);
    /* A range of 2 elements (no master). */
    refused(rep_arr(1, rep_arr(2, rep_int(0), rep_int(16383))), NULL, __LINE__);
    /* last < first. */
    refused(rep_arr(1, range(200, 100, node("10.0.0.1", 7000, "a"))), NULL, __LINE__);
    /* last past the slots. */
    refused(rep_arr(1, range(0, 16384, node("10.0.0.1", 7000, "a"))), NULL, __LINE__);
    /* first below 0. */
    refused(rep_arr(1, range(-1, 100, node("10.0.0.1", 7000, "a"))), NULL, __LINE__);
    /* Ports 0 and 65536. */
    refused(rep_arr(1, range(0, 16383, node("10.0.0.1", 0, "a"))), NULL, __LINE__);
    refused(rep_arr(1, range(0, 16383, node("10.0.0.1", 65536, "a"))), NULL, __LINE__);
    /* A master that is not an array. */
    refused(rep_arr(1, rep_arr(3, rep_int(0), rep_int(16383), rep_str("10.0.0.1:7000"))), NULL, __LINE__);
    /* A master of one element (no port), and one whose port is a string. */
    refused(rep_arr(1, range(0, 16383, rep_arr(1, rep_str("10.0.0.1")))), NULL, __LINE__);
    refused(rep_arr(1, range(0, 16383, rep_arr(2, rep_str("10.0.0.1"), rep_str("7000")))), NULL, __LINE__);
    /* Slot bounds that are strings. */
    refused(rep_arr(1, rep_arr(3, rep_str("0"), rep_int(16383), node("10.0.0.1", 7000, "a"))), NULL, __LINE__);
    /* A range that is not an array, after a good one. */
    refused(rep_arr(2, range(0, 100, node("10.0.0.1", 7000, "a")), rep_int(7)), NULL, __LINE__);
    /* An empty answer: no slot is served. */
    refused(rep_arr(0), NULL, __LINE__);
}

/* ---- the node table -------------------------------------------------------------------- */

static void test_map_node(void)
{
    cg_redis_slot_map *m = map_new();
    m->n_nodes = 0;
    CHECK(cg_redis_slot_map_node(m, "10.0.0.1", 7000) == 0);
    CHECK(cg_redis_slot_map_node(m, "10.0.0.1", 7000) == 0); /* again: the same */
    CHECK(m->n_nodes == 1);
    CHECK(cg_redis_slot_map_node(m, "10.0.0.1", 7001) == 1); /* another port */
    CHECK(cg_redis_slot_map_node(m, "10.0.0.2", 7000) == 2); /* another host */
    CHECK(cg_redis_slot_map_node(m, "10.0.0.1", 7001) == 1);
    CHECK(m->n_nodes == 3);
    CHECK_STR(m->nodes[2].host, "10.0.0.2");
    CHECK(m->nodes[2].port == 7000);

    /* Full: a new node is -1, the known ones are still found. */
    for (int i = 3; i < CG_REDIS_CLUSTER_MAX_NODES; i++)
        CHECK(cg_redis_slot_map_node(m, "10.0.1.1", 10000 + i) == i);
    CHECK(m->n_nodes == CG_REDIS_CLUSTER_MAX_NODES);
    CHECK(cg_redis_slot_map_node(m, "10.0.9.9", 7000) == -1);
    CHECK(m->n_nodes == CG_REDIS_CLUSTER_MAX_NODES);
    CHECK(cg_redis_slot_map_node(m, "10.0.0.2", 7000) == 2);
    CHECK(cg_redis_slot_map_node(m, "10.0.1.1", 10000 + CG_REDIS_CLUSTER_MAX_NODES - 1) ==
          CG_REDIS_CLUSTER_MAX_NODES - 1);
    free(m);
}

int main(void)
{
    test_crc16();
    test_key_slot();
    test_redirect_moved_ask();
    test_redirect_len();
    test_redirect_retry();
    test_redirect_none();
    test_map_three_masters();
    test_map_seed_host();
    test_map_one_master_two_ranges();
    test_map_gap();
    test_map_malformed();
    test_map_node();
    return unit_done("test_redis_slots");
}
