/* The worker pool (pool.h): a generation counter that workers watch, spinning a while, then
 * waiting on a condition variable; a count of workers still running the current job. */
#include "pool.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>

#define SPINS 200000 /* polls of the generation before a worker sleeps (~0.1-1 ms) */

struct pool {
    int n;                 /* threads, the caller included */
    pthread_t *tids;       /* workers 1..n-1 */
    pthread_mutex_t lock;  /* guards sleeping workers' wake-up */
    pthread_cond_t wake;
    atomic_uint gen;       /* bumped once per job */
    atomic_int pending;    /* workers still running the current job */
    atomic_int stop;
    atomic_int park;       /* set between passes: workers sleep at once instead of spinning */
    pool_fn fn;
    void *arg;
};

struct worker {
    struct pool *p;
    int i;
};

static void *worker_main(void *w_) {
    struct worker w = *(struct worker *)w_;
    free(w_);
    struct pool *p = w.p;
    unsigned seen = 0;
    for (;;) {
        unsigned g;
        int spins = 0;
        while ((g = atomic_load_explicit(&p->gen, memory_order_acquire)) == seen) {
            if (atomic_load(&p->stop)) return NULL;
            if (++spins < SPINS && !atomic_load_explicit(&p->park, memory_order_relaxed)) continue;
            pthread_mutex_lock(&p->lock);
            while (atomic_load(&p->gen) == seen && !atomic_load(&p->stop)) pthread_cond_wait(&p->wake, &p->lock);
            pthread_mutex_unlock(&p->lock);
            spins = 0;
        }
        seen = g;
        p->fn(p->arg, w.i, p->n);
        atomic_fetch_sub_explicit(&p->pending, 1, memory_order_release);
    }
}

struct pool *pool_new(int threads) {
    struct pool *p = calloc(1, sizeof(*p));
    if (!p) return NULL;
    p->n = threads < 1 ? 1 : threads;
    p->tids = calloc((size_t)p->n, sizeof(pthread_t));
    if (!p->tids) {
        free(p);
        return NULL;
    }
    pthread_mutex_init(&p->lock, NULL);
    pthread_cond_init(&p->wake, NULL);
    for (int i = 1; i < p->n; i++) {
        struct worker *w = malloc(sizeof(*w));
        if (w) *w = (struct worker){p, i};
        if (!w || pthread_create(&p->tids[i], NULL, worker_main, w) != 0) {
            free(w);
            p->n = i; /* fewer threads: the same results, later */
            break;
        }
    }
    return p;
}

void pool_free(struct pool *p) {
    if (!p) return;
    atomic_store(&p->stop, 1);
    pthread_mutex_lock(&p->lock);
    pthread_cond_broadcast(&p->wake);
    pthread_mutex_unlock(&p->lock);
    for (int i = 1; i < p->n; i++) pthread_join(p->tids[i], NULL);
    pthread_mutex_destroy(&p->lock);
    pthread_cond_destroy(&p->wake);
    free(p->tids);
    free(p);
}

int pool_threads(const struct pool *p) { return p->n; }

void pool_park(struct pool *p) { atomic_store_explicit(&p->park, 1, memory_order_relaxed); }

void pool_run(struct pool *p, pool_fn fn, void *arg) {
    if (p->n == 1) {
        fn(arg, 0, 1);
        return;
    }
    p->fn = fn;
    p->arg = arg;
    atomic_store_explicit(&p->pending, p->n - 1, memory_order_relaxed);
    pthread_mutex_lock(&p->lock);
    atomic_store_explicit(&p->park, 0, memory_order_relaxed);
    atomic_fetch_add_explicit(&p->gen, 1, memory_order_release);
    pthread_cond_broadcast(&p->wake);
    pthread_mutex_unlock(&p->lock);
    fn(arg, 0, p->n);
    while (atomic_load_explicit(&p->pending, memory_order_acquire) != 0) {
    }
}
