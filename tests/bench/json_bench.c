/*
 * json_bench.c: what the gateway's JSON string paths cost by the clock (a benchmark, not a
 * test).
 *
 *   json_bench [ROUNDS]
 *
 * Instruction counts (instructions.sh) miss what a change costs the processor beyond its
 * instructions: a version of cg_jsonw_str that tested a string's last bytes as a padded
 * word ran fewer instructions and a fifth longer, its load waiting on the bytes just stored
 * (issue 12). So the string paths of a turn are timed here, best of ROUNDS (default 5), on
 * strings shaped like a turn's (frame keys, ids, a message and a reply, rule and param
 * names):
 *   - cg_jsonw_str, a string written as JSON text (every frame, every Redis argument);
 *   - cg_json_stringn against jansson's json_stringn, a string made a jansson value (the
 *     history's messages, the rules' params and names).
 * Prints one line each, ns per string; compare two builds in one sitting.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "chatgate/core/jsonout.h"

#define PER_ROUND 1000000

static const char *const strings[] = {
    "type", "delta", "id", "0f8c2b1e-8a5d-4c4e-9b7a-1f2d3c4b5a69", "Find flights from Nairobi to London on Feb 10",
    "user", "assistant", "Hello from the app, here is your reply.", "flight_route", "Zürich, the 20th of February",
};
#define N_STRINGS (sizeof(strings) / sizeof(strings[0]))

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

/* ns per string of one pass over the strings, PER_ROUND / N_STRINGS times, best of rounds */
static double time_writer(int rounds, const size_t *len)
{
    cg_jsonw w;
    cg_jsonw_init(&w, 16, 4096);
    double best = 1e9;
    for (int r = 0; r < rounds; r++) {
        double t0 = now_s();
        for (int k = 0; k < PER_ROUND / (int)N_STRINGS; k++) {
            w.used = w.pre;
            for (size_t i = 0; i < N_STRINGS; i++)
                cg_jsonw_str(&w, strings[i], len[i]);
        }
        double ns = (now_s() - t0) / PER_ROUND * 1e9;
        best = ns < best ? ns : best;
    }
    free(w.buf);
    return best;
}

static double time_values(int rounds, const size_t *len, int ours)
{
    double best = 1e9;
    for (int r = 0; r < rounds; r++) {
        double t0 = now_s();
        for (int k = 0; k < PER_ROUND / (int)N_STRINGS; k++)
            for (size_t i = 0; i < N_STRINGS; i++) {
                json_t *v = ours ? cg_json_stringn(strings[i], len[i]) : json_stringn(strings[i], len[i]);
                if (!v)
                    abort(); /* every string here is UTF-8 */
                json_decref(v);
            }
        double ns = (now_s() - t0) / PER_ROUND * 1e9;
        best = ns < best ? ns : best;
    }
    return best;
}

int main(int argc, char **argv)
{
    int rounds = argc > 1 ? atoi(argv[1]) : 5;
    if (rounds < 1) {
        fprintf(stderr, "usage: json_bench [ROUNDS]\n");
        return 2;
    }
    size_t len[N_STRINGS];
    for (size_t i = 0; i < N_STRINGS; i++)
        len[i] = strlen(strings[i]);
    printf("cg_jsonw_str     %6.2f ns a string\n", time_writer(rounds, len));
    printf("cg_json_stringn  %6.2f ns a string\n", time_values(rounds, len, 1));
    printf("json_stringn     %6.2f ns a string (jansson's own check)\n", time_values(rounds, len, 0));
    return 0;
}
