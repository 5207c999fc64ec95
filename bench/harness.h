/* What the kernel harnesses share (bench/kernel_harness.c, bench/attention_harness.c): a monotonic
 * clock in seconds and a small fixed-seed generator, so each run draws the same inputs. */
#ifndef MEMSPEC_BENCH_HARNESS_H
#define MEMSPEC_BENCH_HARNESS_H

#include <stdint.h>
#include <time.h>

static inline double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static uint32_t seed = 1;
static inline uint32_t rnd(void) { return (seed = seed * 1664525u + 1013904223u) >> 8; }

#endif
