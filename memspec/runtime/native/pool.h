/* A fixed pool of worker threads for the forward pass.
 *
 * pool_run(p, fn, arg) calls fn(arg, i, n) once on each of the n threads (the caller is
 * thread 0) and returns when every call has returned.  What a thread computes is decided by
 * fn from (i, n) alone: the forward pass splits outputs into fixed ranges, never a sum, so
 * the result does not depend on n.  Workers spin briefly between runs (a forward pass issues
 * a few hundred runs back to back), then sleep. */
#ifndef MEMSPEC_POOL_H
#define MEMSPEC_POOL_H

struct pool;
typedef void (*pool_fn)(void *arg, int i, int n);

struct pool *pool_new(int threads); /* NULL when out of memory or no thread could start */
void pool_free(struct pool *p);
int pool_threads(const struct pool *p);
void pool_run(struct pool *p, pool_fn fn, void *arg);
/* The runs are over for now (a forward pass has ended): the workers sleep at once instead of spinning
 * for the next run, leaving the cores to the threads that run between passes.  The next pool_run
 * wakes them. */
void pool_park(struct pool *p);

/* [*lo, *hi): thread i's share of `count` items split into n contiguous ranges. */
static inline void pool_range(int count, int i, int n, int *lo, int *hi) {
    *lo = (int)((long long)count * i / n);
    *hi = (int)((long long)count * (i + 1) / n);
}

#endif
