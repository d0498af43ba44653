/*
 * metrics.h: latency histograms in Prometheus' shape (cumulative buckets, sum, count).
 * One worker thread, so plain counters.
 */
#ifndef CHATGATE_METRICS_H
#define CHATGATE_METRICS_H

#include <stddef.h>

#define CG_HISTOGRAM_BUCKETS 15

typedef struct cg_histogram {
    unsigned long counts[CG_HISTOGRAM_BUCKETS + 1]; /* the last one is +Inf */
    double sum_s;
    unsigned long count;
} cg_histogram;

/* Records one observation of `seconds`. */
void cg_histogram_observe(cg_histogram *h, double seconds);

/* Appends "name_bucket{stage=...,le=...}" lines, _sum and _count to buf; returns the bytes
 * written (0 when buf is too small, so the caller can stop). */
size_t cg_histogram_format(const cg_histogram *h, const char *name, const char *label, char *buf, size_t len);

#endif
