/*
 * test_log.c: log lines never hold a phone number, an e-mail address or a token in clear,
 * and ordinary lines (addresses, ports, times, counts) stay readable. Phone numbers are
 * found in international and national forms and before a ':'; a line is masked before it
 * is cut to its bound, on a UTF-8 boundary, so a cut never leaves part of a secret.
 */
#include <stdlib.h>
#include <unistd.h>

#include "chatgate/core/log.h"
#include "unit.h"

static void check_mask(const char *in, const char *want)
{
    char out[2048];
    CHECK_STR(cg_log_mask(in, out, sizeof(out)), want);
}

static void test_masks(void)
{
    check_mask("send to +254 712 345 678 now", "send to [phone] now");
    check_mask("send to +254712345678", "send to [phone]");
    check_mask("phone 0712345678.", "phone [phone].");
    check_mask("mail jane.doe+x@example.co.ke please", "mail [email] please");
    check_mask("Authorization: Bearer abc.def-ghi", "Authorization: [token]");
    check_mask("jwt eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiJ1In0.c2ln", "jwt [token]");
    check_mask("GET /ws?access_token=abc.def&x=1", "GET /ws?[token]&x=1");
    check_mask("refused Origin 'http://x.example/?token=s3cr3t-value' (not a loopback page)",
               "refused Origin 'http://x.example/?[token]' (not a loopback page)"); /* the quote ends it */
    check_mask("resume u_0123456789abcdef.AAAAAAAAAAAAAAAAAAAAAAAAAAAA", "resume [token]");
    check_mask("key sk-abcdefghijkl", "key [token]");
    check_mask("listening on 127.0.0.1:8080 at 2026-11-22T06:00:00Z", "listening on 127.0.0.1:8080 at 2026-11-22T06:00:00Z");
    check_mask("upstream 'llm' sent nothing within 60000 ms", "upstream 'llm' sent nothing within 60000 ms");
    check_mask("session s_12: open (1024 connected)", "session s_12: open (1024 connected)");
    check_mask("a frame over 1048576 bytes", "a frame over 1048576 bytes");
    check_mask("call (555) 123-4567", "call [phone]");
    check_mask("caf\xc3\xa9 +33 6 12 34 56 78", "caf\xc3\xa9 [phone]");
}

/* Issue 9, defect 13: a number before ':' (a message id logged by "message %s: %s"), and
 * national forms the way people write them. */
static void test_phone_forms(void)
{
    check_mask("session s_1: message +254712345678: upstream_timeout: no reply",
               "session s_1: message [phone]: upstream_timeout: no reply");
    check_mask("message 0712345678: done", "message [phone]: done");
    check_mask("id +254712345678:", "id [phone]:");
    check_mask("call 0712 345 678 today", "call [phone] today");
    check_mask("office (020) 7946 0958.", "office [phone].");
    check_mask("office 020 7946 0958", "office [phone]");
    check_mask("mobile 07946-095-800, thanks", "mobile [phone], thanks");
    check_mask("us 555-123-4567", "us [phone]");
    check_mask("uk +44 (0)20 7946 0958", "uk [phone]");
    check_mask("\"+254712345678\"", "\"[phone]\"");
    check_mask("phone:+254712345678 tel+254712345678 id_+254712345678",
               "phone:[phone] tel[phone] id_[phone]");
    /* not phones: times, dates, ports, addresses, counts, versions, durations */
    check_mask("at 10:30:00 on 2026-02-05, port 127.0.0.1:6379", "at 10:30:00 on 2026-02-05, port 127.0.0.1:6379");
    check_mask("ts 1770112800 took 0.25 s, 12345678 bytes", "ts 1770112800 took 0.25 s, 12345678 bytes");
    check_mask("redis 7.0.15 at [::1]:6379, v0.14.1", "redis 7.0.15 at [::1]:6379, v0.14.1");
    check_mask("http://10.0.0.1:8080/v1/chat", "http://10.0.0.1:8080/v1/chat");
}

/* Runs cg_info(fmt, arg) and returns what it wrote to stderr (malloc'd). */
static char *logged(const char *fmt, const char *arg)
{
    char path[] = "/tmp/chatgate-test-log-XXXXXX";
    int fd = mkstemp(path);
    int saved = dup(STDERR_FILENO);
    dup2(fd, STDERR_FILENO);
    cg_info(fmt, arg);
    dup2(saved, STDERR_FILENO);
    close(saved);
    off_t n = lseek(fd, 0, SEEK_END);
    char *out = calloc(1, (size_t)n + 1);
    if (pread(fd, out, (size_t)n, 0) != n)
        out[0] = 0;
    close(fd);
    unlink(path);
    return out;
}

static int valid_utf8(const char *s)
{
    const unsigned char *p = (const unsigned char *)s;
    while (*p) {
        int n = *p < 0x80 ? 1 : (*p & 0xE0) == 0xC0 ? 2 : (*p & 0xF0) == 0xE0 ? 3 : (*p & 0xF8) == 0xF0 ? 4 : 0;
        if (!n)
            return 0;
        for (int i = 1; i < n; i++)
            if ((p[i] & 0xC0) != 0x80)
                return 0;
        p += n;
    }
    return 1;
}

/* Masked before it is cut: a secret across the 2,048-byte bound is not half written. */
static void test_cut_after_mask(void)
{
    for (size_t pad = 2010; pad < 2050; pad += 3) {
        char *text = malloc(pad + 1);
        memset(text, 'x', pad);
        text[pad] = 0;
        char *line = logged("%s +254 712 345 678 and jane.doe@example.com end", text);
        /* in the message only: the line's time and pid may hold those digits */
        const char *msg = strchr(line, 'x');
        CHECK(msg && strstr(msg, "254") == NULL && strstr(msg, "712") == NULL && strstr(msg, "jane") == NULL);
        /* whole when the masked text fits, else cut and marked */
        CHECK(strstr(line, pad + 24 <= 2048 ? " [phone] and [email] end\n" : "[cut]\n") != NULL);
        CHECK(strlen(line) < 2048 + 128);
        CHECK(line[strlen(line) - 1] == '\n');
        free(line);
        free(text);
    }

    /* a long line that masks short is written whole: nothing is lost to the old bound */
    char *token = malloc(3001);
    memcpy(token, "Bearer ", 7);
    memset(token + 7, 'a', 2993);
    token[3000] = 0;
    char *line = logged("auth %s then +254712345678: done", token);
    CHECK(strstr(line, "auth [token] then [phone]: done\n") != NULL);
    free(line);
    free(token);

    /* cut on a UTF-8 boundary, whatever the offset; bytes that are not UTF-8 become '?' */
    for (int shift = 0; shift < 3; shift++) {
        char text[6000];
        size_t n = 0;
        for (int i = 0; i < shift; i++)
            text[n++] = 'x';
        while (n < sizeof(text) - 4) {
            memcpy(text + n, "\xe2\x82\xac", 3); /* the euro sign */
            n += 3;
        }
        text[n] = 0;
        line = logged("%s", text);
        CHECK(valid_utf8(line));
        CHECK(strstr(line, "[cut]") != NULL);
        free(line);
    }
    line = logged("bad \xff\xfe bytes %s", "\xc3");
    CHECK(strstr(line, "bad ?? bytes ?\n") != NULL);
    free(line);

    /* the same in JSON lines */
    cg_log_set_json(1);
    char *text = malloc(2031);
    memset(text, 'x', 2030);
    text[2030] = 0;
    line = logged("%s +254 712 345 678", text);
    const char *msg = strchr(line, 'x'); /* the message: the time and pid may hold those digits */
    CHECK(msg && strstr(msg, "254") == NULL && strstr(msg, "712") == NULL);
    CHECK(line[0] == '{' && strstr(line, "}\n") != NULL);
    free(line);
    free(text);
    cg_log_set_json(0);

    /* cg_log_mask into a small buffer: masked first, then cut */
    char small[16];
    CHECK_STR(cg_log_mask("id 0712345678 and more", small, sizeof(small)), "id [phone] and ");
}

int main(void)
{
    test_masks();
    test_phone_forms();
    test_cut_after_mask();
    return unit_done("test_log");
}
