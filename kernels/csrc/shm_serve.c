/* The shared-memory data plane's serving loop in a worker (expert_server/transport/shm.py).
 *
 * One call serves a connection's FORWARD frames for as long as each is the common request: its
 * header checks out, its slot's segment is mapped and holds the reply, and every pair lies in one
 * held set whose frame kernel (a PreparedExperts' frame_kernel, e.g. hm_dense_frame) takes it.
 * Such a frame is read, computed into its reply's place in the segment, counted and answered
 * here, with no Python on the way: in a running cluster a worker's request spent most of its
 * time in the interpreter, cold after the other processes had run on the same cores. Any other
 * message (a new segment's descriptor, another kind, a frame some check refuses, a kernel that
 * declines) is handed back to Python whole, which answers it as before, naming what is wrong.
 *
 * The frame layout is protos/frames.py's (HEADER, forward_payload, reply_offset, partial_header);
 * tests/test_transport.py checks the two against each other through a worker.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>

#include "frames.h"

enum { MAX_SLOTS = 64, MAX_BUCKETS = 32 };

/* A held set's frame kernel: hm_dense_frame's signature and return codes (dense_experts.c). */
typedef int (*frame_kernel)(const void *payload, int dtype, int64_t T, int64_t H, int64_t P, int64_t first,
                            int64_t I, int64_t E, const void *w13t, const void *w2t, int act, float *out);

typedef struct {
    frame_kernel kernel; /* NULL: this set's requests go to Python */
    const void *w13t, *w2t;
    int64_t intermediate, num_experts;
    int64_t act;
} hm_set;

typedef struct {
    const int64_t *set_of; /* [num_experts]: index into sets, -1 not held; NULL: a layer not served */
    const int64_t *offset; /* [sets]: each set's first expert id */
    const hm_set *sets;
} hm_layer;

/* What LocalExperts holds, swapped by hm_tables_set between two computations. */
typedef struct {
    pthread_mutex_t lock;
    const hm_layer *layers; /* by layer index */
    int64_t num_layers, hidden, num_experts;
} hm_tables;

/* Counters of the requests served here (expert_server/metrics.py adds them to Python's). */
typedef struct {
    uint64_t ok, received_bytes, sent_bytes, rows, pairs, seconds_ns;
    uint64_t buckets[MAX_BUCKETS]; /* per bound, not cumulative; the last one past every bound */
    double bounds[MAX_BUCKETS];
    int64_t num_bounds;
} hm_counts;

/* One connection: its slots' segments, and the message handed back to Python. */
typedef struct {
    unsigned char *base[MAX_SLOTS];
    uint64_t size[MAX_SLOTS];
    unsigned char message[HEADER_BYTES];
    int64_t length; /* bytes of message received (the rest of a longer one is cut, as Python's recv) */
    int64_t fd;     /* a descriptor that came with it, or -1 */
} hm_conn;

hm_tables *hm_tables_new(int64_t hidden, int64_t num_experts) {
    hm_tables *t = calloc(1, sizeof *t);
    if (!t) return NULL;
    pthread_mutex_init(&t->lock, NULL);
    t->hidden = hidden;
    t->num_experts = num_experts;
    return t;
}

void hm_tables_set(hm_tables *t, const hm_layer *layers, int64_t num_layers) {
    pthread_mutex_lock(&t->lock);
    t->layers = layers;
    t->num_layers = num_layers;
    pthread_mutex_unlock(&t->lock);
}

void hm_tables_free(hm_tables *t) {
    if (!t) return;
    pthread_mutex_destroy(&t->lock);
    free(t);
}

static uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static inline void count(uint64_t *counter, uint64_t n) { __atomic_fetch_add(counter, n, __ATOMIC_RELAXED); }

static void observe(hm_counts *c, uint64_t ns) {
    double seconds = (double)ns * 1e-9;
    int64_t b = 0;
    while (b < c->num_bounds && seconds > c->bounds[b]) ++b;
    count(&c->buckets[b], 1);
    count(&c->seconds_ns, ns);
}

/* Computes a common FORWARD frame into its reply's place; 0 when done, else the frame is Python's. */
static int compute(hm_tables *t, hm_conn *conn, const header *h, uint64_t *compute_ns) {
    if (h->magic != MAGIC || h->version != FRAME_VERSION || h->kind != KIND_FORWARD) return 1;
    int64_t itemsize = h->dtype == WIRE_FLOAT32 ? 4 : (h->dtype == WIRE_FLOAT16 || h->dtype == WIRE_BFLOAT16) ? 2 : 0;
    if (!itemsize || !h->rows || !h->pairs || h->slot >= MAX_SLOTS || !conn->base[h->slot]) return 1;
    uint64_t hidden_bytes = (uint64_t)h->rows * h->hidden * (uint64_t)itemsize;
    if (h->payload != hidden_bytes + (uint64_t)h->pairs * PAIR_BYTES) return 1; /* Python names the mismatch */
    uint64_t reply_at = (h->payload + 63) / 64 * 64;                           /* frames.reply_offset */
    if (reply_at + (uint64_t)h->rows * h->hidden * 4 > conn->size[h->slot]) return 1;
    const unsigned char *payload = conn->base[h->slot];
    int32_t expert;
    memcpy(&expert, payload + h->payload - 8 * (uint64_t)h->pairs, 4); /* the first pair's expert */
    int status = 1;
    pthread_mutex_lock(&t->lock);
    const hm_layer *layer = h->layer < (uint64_t)t->num_layers ? &t->layers[h->layer] : NULL;
    if (layer && layer->set_of && h->hidden == (uint64_t)t->hidden && expert >= 0 && expert < t->num_experts) {
        int64_t held = layer->set_of[expert];
        const hm_set *set = held >= 0 ? &layer->sets[held] : NULL;
        if (set && set->kernel) {
            uint64_t start = now_ns();
            status = set->kernel(payload, h->dtype, h->rows, h->hidden, h->pairs, layer->offset[held],
                                 set->intermediate, set->num_experts, set->w13t, set->w2t, (int)set->act,
                                 (float *)(conn->base[h->slot] + reply_at));
            *compute_ns = now_ns() - start;
        }
    }
    pthread_mutex_unlock(&t->lock);
    return status;
}

/* Serves frames on `fd` until one is Python's (returns 1: conn->message, length, fd), the peer
 * closes the connection (0) or the socket fails (-errno). With `hand_back`, a reply is not sent
 * but returned (2: conn->message holds its header) for the caller to send later (a benchmark's
 * reply delay, expert_server/transport/base.py). */
int hm_shm_serve(int fd, hm_tables *t, hm_counts *counts, hm_conn *conn, int hand_back) {
    union {
        struct cmsghdr align;
        char space[CMSG_SPACE(sizeof(int))];
    } control;
    for (;;) {
        struct iovec iov = {conn->message, HEADER_BYTES};
        struct msghdr msg = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = control.space,
                             .msg_controllen = sizeof control.space};
        ssize_t n = recvmsg(fd, &msg, MSG_CMSG_CLOEXEC);
        if (n < 0) {
            if (errno == EINTR) continue;
            return -errno;
        }
        if (n == 0) return 0;
        uint64_t start = now_ns();
        int received = -1;
        for (struct cmsghdr *c = CMSG_FIRSTHDR(&msg); c; c = CMSG_NXTHDR(&msg, c))
            if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS && c->cmsg_len >= CMSG_LEN(sizeof(int)))
                memcpy(&received, CMSG_DATA(c), sizeof(int));
        conn->length = n;
        conn->fd = received;
        header h;
        uint64_t compute_ns = 0;
        if (n != HEADER_BYTES || conn->fd >= 0 || (msg.msg_flags & (MSG_TRUNC | MSG_CTRUNC))) return 1;
        memcpy(&h, conn->message, sizeof h);
        if (compute(t, conn, &h, &compute_ns) != 0) return 1;
        uint64_t reply_bytes = (uint64_t)h.rows * h.hidden * 4;
        header reply = {MAGIC, FRAME_VERSION, KIND_PARTIAL, h.request, 0, 0, h.rows, h.hidden, 0, WIRE_FLOAT32, 0,
                        reply_bytes, compute_ns}; /* frames.partial_header */
        count(&counts->ok, 1); /* before the reply leaves: a scrape after it sees this request */
        count(&counts->received_bytes, h.payload);
        count(&counts->sent_bytes, reply_bytes);
        count(&counts->rows, h.rows);
        count(&counts->pairs, h.pairs);
        observe(counts, now_ns() - start);
        if (hand_back) {
            memcpy(conn->message, &reply, sizeof reply);
            conn->length = sizeof reply;
            return 2;
        }
        while (send(fd, &reply, sizeof reply, MSG_NOSIGNAL) < 0)
            if (errno != EINTR) return -errno;
    }
}
