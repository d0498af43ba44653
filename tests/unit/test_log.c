/*
 * test_log.c: log lines never hold a phone number, an e-mail address or a token in clear,
 * and ordinary lines (addresses, ports, times, counts) stay readable.
 */
#include "chatgate/log.h"
#include "unit.h"

static void check_mask(const char *in, const char *want)
{
    char out[2048];
    CHECK_STR(cg_log_mask(in, out, sizeof(out)), want);
}

int main(void)
{
    check_mask("send to +254 712 345 678 now", "send to [phone] now");
    check_mask("send to +254712345678", "send to [phone]");
    check_mask("phone 0712345678.", "phone [phone].");
    check_mask("mail jane.doe+x@example.co.ke please", "mail [email] please");
    check_mask("Authorization: Bearer abc.def-ghi", "Authorization: [token]");
    check_mask("jwt eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiJ1In0.c2ln", "jwt [token]");
    check_mask("GET /ws?access_token=abc.def&x=1", "GET /ws?[token]&x=1");
    check_mask("resume u_0123456789abcdef.AAAAAAAAAAAAAAAAAAAAAAAAAAAA", "resume [token]");
    check_mask("key sk-abcdefghijkl", "key [token]");
    check_mask("listening on 127.0.0.1:8080 at 2026-11-22T06:00:00Z", "listening on 127.0.0.1:8080 at 2026-11-22T06:00:00Z");
    check_mask("upstream 'llm' sent nothing within 60000 ms", "upstream 'llm' sent nothing within 60000 ms");
    check_mask("session s_12: open (1024 connected)", "session s_12: open (1024 connected)");
    check_mask("a frame over 1048576 bytes", "a frame over 1048576 bytes");
    check_mask("call (555) 123-4567", "call [phone]");
    check_mask("caf\xc3\xa9 +33 6 12 34 56 78", "caf\xc3\xa9 [phone]");
    return unit_done("test_log");
}
