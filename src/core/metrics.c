/*
 * metrics.c: latency histograms (see metrics.h). The bucket bounds span a millisecond
 * (a rule evaluation) to a minute (a long LLM reply).
 */
#include <stddef.h>
#include <stdio.h>

#include "chatgate/core/metrics.h"

static const double bounds[CG_HISTOGRAM_BUCKETS] = {0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
                                                     0.25,   0.5,   1,      2.5,   5,    10,    60};

void cg_histogram_observe(cg_histogram *h, double seconds)
{
    int i = 0;
    while (i < CG_HISTOGRAM_BUCKETS && seconds > bounds[i])
        i++;
    h->counts[i]++;
    h->sum_s += seconds;
    h->count++;
}

size_t cg_histogram_format(const cg_histogram *h, const char *name, const char *label, char *buf, size_t len)
{
    size_t used = 0;
    unsigned long cumulative = 0;
    for (int i = 0; i <= CG_HISTOGRAM_BUCKETS; i++) {
        cumulative += h->counts[i];
        char le[32];
        if (i < CG_HISTOGRAM_BUCKETS)
            snprintf(le, sizeof(le), "%g", bounds[i]);
        else
            snprintf(le, sizeof(le), "+Inf");
        int n = snprintf(buf + used, len - used, "%s_bucket{%s,le=\"%s\"} %lu\n", name, label, le, cumulative);
        if (n < 0 || (size_t)n >= len - used)
            return 0;
        used += (size_t)n;
    }
    int n = snprintf(buf + used, len - used, "%s_sum{%s} %.6f\n%s_count{%s} %lu\n", name, label, h->sum_s, name,
                     label, h->count);
    if (n < 0 || (size_t)n >= len - used)
        return 0;
    return used + (size_t)n;
}

/* The layout cg_metrics_add relies on (metrics.h): counters first, the histograms last. */
_Static_assert(offsetof(cg_metrics, store_load) % sizeof(unsigned long) == 0, "counters are whole words");
_Static_assert(offsetof(cg_metrics, rule_file_time) + sizeof(cg_histogram) * CG_METRIC_RULE_FILES ==
                   sizeof(cg_metrics),
               "histograms last");

static void histogram_add(cg_histogram *dst, const cg_histogram *src)
{
    for (int i = 0; i <= CG_HISTOGRAM_BUCKETS; i++)
        dst->counts[i] += src->counts[i];
    dst->sum_s += src->sum_s;
    dst->count += src->count;
}

void cg_metrics_add(cg_metrics *dst, const cg_metrics *src)
{
    unsigned long *d = (unsigned long *)dst;
    const unsigned long *s = (const unsigned long *)src;
    for (size_t i = 0; i < offsetof(cg_metrics, store_load) / sizeof(unsigned long); i++)
        d[i] += s[i];
    histogram_add(&dst->store_load, &src->store_load);
    histogram_add(&dst->rules, &src->rules);
    histogram_add(&dst->first_token, &src->first_token);
    histogram_add(&dst->turn, &src->turn);
    for (int i = 0; i < CG_METRIC_RULE_FILES; i++)
        histogram_add(&dst->rule_file_time[i], &src->rule_file_time[i]);
}
