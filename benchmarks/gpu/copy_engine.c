/* mcore-offload copy engine (an experiment, see copy_engine.py): a native thread that issues the offload CUDA calls.
 *
 * Why: inside a launch-bound training step every CUDA call the Python runtime makes costs 8-10 us of the step's
 * host time (session 11), and an offloaded group needs about 25 of them (fences, waits, copies, done events).
 * The training thread instead appends one job (a short list of operations) to this engine's queue and goes on;
 * the engine's own thread, which never holds the GIL, makes the calls in order. Completion of D2H jobs is
 * confirmed by a second thread (a blocking event synchronize), so the Python side can drop its references to
 * the copied device blocks without a CUDA call of its own.
 *
 * The CUDA entry points are passed in as function pointers (those of the runtime library PyTorch has loaded),
 * so this file needs no CUDA headers and the tests drive it with fakes.
 *
 * Job format (int64 words): OP_RECORD ev stream | OP_WAIT stream ev | OP_COPY dst src n kind stream |
 * OP_COMPLETE ev. A job is "issued" once every operation in it has been called; jobs are issued in submission
 * order, so the Python side only needs the count of issued jobs. OP_COMPLETE hands an event to the reaper,
 * which synchronizes on it and then counts one completion; completions are counted in submission order too.
 */
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef int (*set_device_fn)(int);
typedef int (*record_fn)(void *, void *);
typedef int (*wait_fn)(void *, void *, unsigned int);
typedef int (*memcpy_fn)(void *, const void *, size_t, int, void *);
typedef int (*sync_fn)(void *);

enum { OP_RECORD = 1, OP_WAIT = 2, OP_COPY = 3, OP_COMPLETE = 4 };

/* Counters the Python side reads without a call (int64 each, written under the lock, read racily: a stale
 * value only makes Python take the blocking path). */
enum { C_SUBMITTED = 0, C_ISSUED, C_COMPLETIONS, C_COMPLETED, C_ERROR, C_ERROR_OP, C_COUNT };

typedef struct {
    int64_t *words;
    int64_t cap, head, tail; /* ring of words; a job is [length, ops...] */
    void **reap;
    int64_t reap_cap, reap_head, reap_tail;
    volatile int64_t counters[C_COUNT];
    int stop, stop_reaper; /* the reaper stops only after the worker has pushed its last completion */
    int device;
    pthread_mutex_t lock;
    pthread_cond_t work, space, issued, reaped, reap_work;
    pthread_t worker, reaper;
    set_device_fn set_device;
    record_fn record;
    wait_fn wait;
    memcpy_fn copy;
    sync_fn sync;
} engine_t;

static void fail(engine_t *e, int err, int64_t op) {
    /* the first error wins; later calls keep going so that every counter still advances (no waiter hangs) */
    if (err && !e->counters[C_ERROR]) {
        e->counters[C_ERROR_OP] = op;
        e->counters[C_ERROR] = err;
    }
}

static void run_job(engine_t *e, const int64_t *w, int64_t n) {
    int64_t i = 0;
    while (i < n) {
        int64_t op = w[i];
        switch (op) {
        case OP_RECORD:
            fail(e, e->record((void *)w[i + 1], (void *)w[i + 2]), op);
            i += 3;
            break;
        case OP_WAIT:
            fail(e, e->wait((void *)w[i + 1], (void *)w[i + 2], 0), op);
            i += 3;
            break;
        case OP_COPY:
            fail(e, e->copy((void *)w[i + 1], (const void *)w[i + 2], (size_t)w[i + 3], (int)w[i + 4],
                            (void *)w[i + 5]), op);
            i += 6;
            break;
        case OP_COMPLETE:
            pthread_mutex_lock(&e->lock);
            while (e->reap_tail - e->reap_head >= e->reap_cap) pthread_cond_wait(&e->reaped, &e->lock);
            e->reap[e->reap_tail % e->reap_cap] = (void *)w[i + 1];
            e->reap_tail++;
            e->counters[C_COMPLETIONS]++;
            pthread_cond_signal(&e->reap_work);
            pthread_mutex_unlock(&e->lock);
            i += 2;
            break;
        default:
            fail(e, -1, -1); /* a malformed job: stop reading it */
            return;
        }
    }
}

static void *worker_main(void *arg) {
    engine_t *e = arg;
    int64_t job[4096];
    if (e->set_device) fail(e, e->set_device(e->device), 0);
    pthread_mutex_lock(&e->lock);
    for (;;) {
        while (e->head == e->tail && !e->stop) pthread_cond_wait(&e->work, &e->lock);
        if (e->head == e->tail) break; /* stopping, nothing left */
        int64_t n = e->words[e->head % e->cap];
        for (int64_t k = 0; k < n; k++) job[k] = e->words[(e->head + 1 + k) % e->cap];
        e->head += n + 1;
        pthread_cond_broadcast(&e->space);
        pthread_mutex_unlock(&e->lock);
        run_job(e, job, n);
        pthread_mutex_lock(&e->lock);
        e->counters[C_ISSUED]++;
        pthread_cond_broadcast(&e->issued);
    }
    pthread_mutex_unlock(&e->lock);
    return NULL;
}

static void *reaper_main(void *arg) {
    engine_t *e = arg;
    if (e->set_device) e->set_device(e->device);
    pthread_mutex_lock(&e->lock);
    for (;;) {
        while (e->reap_head == e->reap_tail && !e->stop_reaper) pthread_cond_wait(&e->reap_work, &e->lock);
        if (e->reap_head == e->reap_tail) break;
        void *ev = e->reap[e->reap_head % e->reap_cap];
        pthread_mutex_unlock(&e->lock);
        int err = e->sync(ev);
        pthread_mutex_lock(&e->lock);
        fail(e, err, OP_COMPLETE);
        e->reap_head++;
        e->counters[C_COMPLETED]++;
        pthread_cond_broadcast(&e->reaped);
    }
    pthread_mutex_unlock(&e->lock);
    return NULL;
}

/* fns: set_device (may be NULL), event_record, stream_wait_event, memcpy_async, event_synchronize */
void *mco_start(void **fns, int device, int64_t cap_words, int64_t reap_cap) {
    engine_t *e = calloc(1, sizeof(engine_t));
    if (!e) return NULL;
    e->words = calloc((size_t)cap_words, sizeof(int64_t));
    e->reap = calloc((size_t)reap_cap, sizeof(void *));
    if (!e->words || !e->reap) {
        free(e->words);
        free(e->reap);
        free(e);
        return NULL;
    }
    e->cap = cap_words;
    e->reap_cap = reap_cap;
    e->device = device;
    e->set_device = (set_device_fn)fns[0];
    e->record = (record_fn)fns[1];
    e->wait = (wait_fn)fns[2];
    e->copy = (memcpy_fn)fns[3];
    e->sync = (sync_fn)fns[4];
    pthread_mutex_init(&e->lock, NULL);
    pthread_cond_init(&e->work, NULL);
    pthread_cond_init(&e->space, NULL);
    pthread_cond_init(&e->issued, NULL);
    pthread_cond_init(&e->reaped, NULL);
    pthread_cond_init(&e->reap_work, NULL);
    if (pthread_create(&e->worker, NULL, worker_main, e)) {
        free(e->words);
        free(e->reap);
        free(e);
        return NULL;
    }
    if (pthread_create(&e->reaper, NULL, reaper_main, e)) {
        pthread_mutex_lock(&e->lock);
        e->stop = 1;
        pthread_cond_broadcast(&e->work);
        pthread_mutex_unlock(&e->lock);
        pthread_join(e->worker, NULL);
        free(e->words);
        free(e->reap);
        free(e);
        return NULL;
    }
    return e;
}

/* Append one job of n words (n <= 4096); blocks only while the ring is full. Returns the job's index. */
int64_t mco_submit(void *h, const int64_t *w, int64_t n) {
    engine_t *e = h;
    if (n < 1 || n > 4096 || n + 1 > e->cap) return -1;
    pthread_mutex_lock(&e->lock);
    while (e->cap - (e->tail - e->head) < n + 1) pthread_cond_wait(&e->space, &e->lock);
    e->words[e->tail % e->cap] = n;
    for (int64_t k = 0; k < n; k++) e->words[(e->tail + 1 + k) % e->cap] = w[k];
    e->tail += n + 1;
    int64_t index = e->counters[C_SUBMITTED]++;
    pthread_cond_signal(&e->work);
    pthread_mutex_unlock(&e->lock);
    return index;
}

/* Block until more than `count` jobs are issued. */
void mco_wait_issued(void *h, int64_t count) {
    engine_t *e = h;
    pthread_mutex_lock(&e->lock);
    while (e->counters[C_ISSUED] <= count) pthread_cond_wait(&e->issued, &e->lock);
    pthread_mutex_unlock(&e->lock);
}

/* Block until more than `count` completions are confirmed. */
void mco_wait_completed(void *h, int64_t count) {
    engine_t *e = h;
    pthread_mutex_lock(&e->lock);
    while (e->counters[C_COMPLETED] <= count) pthread_cond_wait(&e->reaped, &e->lock);
    pthread_mutex_unlock(&e->lock);
}

volatile int64_t *mco_counters(void *h) { return ((engine_t *)h)->counters; }

/* Issue everything queued, confirm every completion, then end both threads (the counters stay readable). */
void mco_stop(void *h) {
    engine_t *e = h;
    pthread_mutex_lock(&e->lock);
    e->stop = 1;
    pthread_cond_broadcast(&e->work);
    pthread_mutex_unlock(&e->lock);
    pthread_join(e->worker, NULL);
    pthread_mutex_lock(&e->lock);
    e->stop_reaper = 1;
    pthread_cond_broadcast(&e->reap_work);
    pthread_mutex_unlock(&e->lock);
    pthread_join(e->reaper, NULL);
}

/* Free a stopped engine. */
void mco_free(void *h) {
    engine_t *e = h;
    free(e->words);
    free(e->reap);
    free(e);
}
