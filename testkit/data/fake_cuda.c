/*
 * A TEST DOUBLE of the CUDA driver library (libcuda.so.1), for nixl-rs's tests on
 * machines without a GPU. It is not CUDA: "device memory" is host memory and every
 * copy is memcpy. It implements the calls nixl makes with the driver's semantics
 * that matter to nixl, and checks how they are used:
 *
 * - memory calls need a current context (CUDA_ERROR_INVALID_CONTEXT otherwise);
 * - device ranges must lie in a live cuMemAlloc allocation, and asynchronous copies
 *   must use page-locked memory from cuMemHostAlloc (nixl's staging design);
 * - asynchronous copies and stream callbacks run later, in order, on a thread per
 *   stream; a copy whose memory was freed before it ran, or any driver call made from
 *   inside a stream callback (forbidden by CUDA), aborts the process with a message;
 * - cuMemGetHandleForAddressRange wants host-page-aligned ranges inside one
 *   allocation and returns a descriptor of /dev/null;
 * - freed memory is never handed out again and faults on access.
 *
 * Every other symbol of the driver API is a generated stub returning
 * CUDA_ERROR_NOT_SUPPORTED (801), so that a binding which resolves them all loads.
 */
#define _GNU_SOURCE
#include <fcntl.h>
#include <pthread.h>
#include <sys/mman.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

typedef int CUresult;
typedef int CUdevice;
typedef void *CUcontext;
typedef uint64_t CUdeviceptr;
typedef struct fake_stream *CUstream;
typedef void (*CUstreamCallback)(CUstream, CUresult, void *);

enum {
    OK = 0,
    INVALID_VALUE = 1,
    NOT_INITIALIZED = 3,
    INVALID_DEVICE = 101,
    INVALID_CONTEXT = 201,
    NOT_SUPPORTED = 801,
};

#define DEVICES 2
static int initialised;
static char contexts[DEVICES];
static __thread CUcontext current;
static __thread int in_callback;

static void fatal(const char *what) {
    fprintf(stderr, "fake libcuda (test double): %s\n", what);
    fflush(stderr);
    abort();
}

#define ENTER()                                                                    \
    do {                                                                           \
        if (in_callback) fatal("a CUDA call from inside a stream callback");       \
    } while (0)
#define NEED_CTX()                                                                 \
    do {                                                                           \
        ENTER();                                                                   \
        if (!initialised) return NOT_INITIALIZED;                                  \
        if (!current) return INVALID_CONTEXT;                                      \
    } while (0)

enum kind { DEVICE = 1, PINNED = 2 };
struct alloc {
    uintptr_t base;
    size_t len;
    enum kind kind;
    struct alloc *next;
};
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static struct alloc *allocs;

/* Whether p..p+n lies in one live allocation of `kind` (callers hold `mu`). */
static int inside(uintptr_t p, size_t n, enum kind kind) {
    for (struct alloc *a = allocs; a; a = a->next)
        if (a->kind == kind && p >= a->base && p + n >= p && p + n <= a->base + a->len)
            return 1;
    return 0;
}

static int checked(uintptr_t p, size_t n, enum kind kind) {
    pthread_mutex_lock(&mu);
    int ok = inside(p, n, kind);
    pthread_mutex_unlock(&mu);
    return ok;
}

/* Allocations are mappings of their own, never reused: a freed one stays reserved
 * and inaccessible (PROT_NONE), so a late access faults instead of silently
 * reading or writing a newer allocation at the same address. */
static CUresult add(uintptr_t *out, size_t len, size_t align, enum kind kind) {
    size_t rounded = (len + align - 1) / align * align;
    if (!rounded) rounded = align;
    /* Over-map to align the start, as the real allocators do. */
    void *m = mmap(NULL, rounded + align, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS,
                   -1, 0);
    if (m == MAP_FAILED) return 2; /* CUDA_ERROR_OUT_OF_MEMORY */
    void *p = (void *)(((uintptr_t)m + align - 1) / align * align);
    struct alloc *a = malloc(sizeof *a);
    a->base = (uintptr_t)p;
    a->len = rounded;
    a->kind = kind;
    pthread_mutex_lock(&mu);
    a->next = allocs;
    allocs = a;
    pthread_mutex_unlock(&mu);
    *out = (uintptr_t)p;
    return OK;
}

static CUresult release(uintptr_t p, enum kind kind) {
    pthread_mutex_lock(&mu);
    for (struct alloc **a = &allocs; *a; a = &(*a)->next) {
        if ((*a)->base == p && (*a)->kind == kind) {
            struct alloc *gone = *a;
            *a = gone->next;
            /* Quarantine: inaccessible and never handed out again. */
            madvise((void *)gone->base, gone->len, MADV_DONTNEED);
            mprotect((void *)gone->base, gone->len, PROT_NONE);
            pthread_mutex_unlock(&mu);
            free(gone);
            return OK;
        }
    }
    pthread_mutex_unlock(&mu);
    return INVALID_VALUE;
}

CUresult cuDriverGetVersion(int *v) { *v = 12040; return OK; }
CUresult cuInit(unsigned flags) { ENTER(); (void)flags; initialised = 1; return OK; }
CUresult cuDeviceGetCount(int *n) {
    ENTER();
    if (!initialised) return NOT_INITIALIZED;
    *n = DEVICES;
    return OK;
}
CUresult cuDeviceGet(CUdevice *d, int ordinal) {
    ENTER();
    if (!initialised) return NOT_INITIALIZED;
    if (ordinal < 0 || ordinal >= DEVICES) return INVALID_DEVICE;
    *d = ordinal;
    return OK;
}
CUresult cuDevicePrimaryCtxRetain(CUcontext *c, CUdevice d) {
    ENTER();
    if (d < 0 || d >= DEVICES) return INVALID_DEVICE;
    *c = &contexts[d];
    return OK;
}
CUresult cuDevicePrimaryCtxRelease_v2(CUdevice d) { ENTER(); (void)d; return OK; }
CUresult cuCtxGetCurrent(CUcontext *c) { ENTER(); *c = current; return OK; }
CUresult cuCtxSetCurrent(CUcontext c) { ENTER(); current = c; return OK; }

/* The context stack: push makes a context current, pop restores the one below. */
static __thread CUcontext stack[16];
static __thread int depth;
CUresult cuCtxPushCurrent_v2(CUcontext c) {
    ENTER();
    if (!c) return INVALID_CONTEXT;
    if (depth == 16) fatal("context stack overflow (pushes without pops)");
    stack[depth++] = current;
    current = c;
    return OK;
}
CUresult cuCtxPopCurrent_v2(CUcontext *c) {
    ENTER();
    if (!depth) return INVALID_CONTEXT;
    if (c) *c = current;
    current = stack[--depth];
    return OK;
}

CUresult cuMemAlloc_v2(CUdeviceptr *p, size_t n) {
    NEED_CTX();
    uintptr_t out;
    CUresult r = add(&out, n, 1 << 16, DEVICE);
    *p = out;
    return r;
}
CUresult cuMemFree_v2(CUdeviceptr p) { NEED_CTX(); return release(p, DEVICE); }
CUresult cuMemHostAlloc(void **p, size_t n, unsigned flags) {
    NEED_CTX();
    (void)flags;
    uintptr_t out;
    CUresult r = add(&out, n, 4096, PINNED);
    *p = (void *)out;
    return r;
}
CUresult cuMemFreeHost(void *p) { NEED_CTX(); return release((uintptr_t)p, PINNED); }

/* Synchronous copies check and copy under `mu`, so a racing free is caught. */
CUresult cuMemcpyDtoH_v2(void *dst, CUdeviceptr src, size_t n) {
    NEED_CTX();
    pthread_mutex_lock(&mu);
    int ok = inside(src, n, DEVICE);
    if (ok) memcpy(dst, (void *)src, n);
    pthread_mutex_unlock(&mu);
    return ok ? OK : INVALID_VALUE;
}
CUresult cuMemcpyHtoD_v2(CUdeviceptr dst, const void *src, size_t n) {
    NEED_CTX();
    pthread_mutex_lock(&mu);
    int ok = inside(dst, n, DEVICE);
    if (ok) memcpy((void *)dst, src, n);
    pthread_mutex_unlock(&mu);
    return ok ? OK : INVALID_VALUE;
}
CUresult cuMemcpy(CUdeviceptr dst, CUdeviceptr src, size_t n) {
    NEED_CTX();
    pthread_mutex_lock(&mu);
    int ok = inside(dst, n, DEVICE) && inside(src, n, DEVICE);
    if (ok) memmove((void *)dst, (void *)src, n);
    pthread_mutex_unlock(&mu);
    return ok ? OK : INVALID_VALUE;
}

/* Streams: a FIFO of operations run by a thread of the stream's own. */
struct op {
    int is_copy;
    uintptr_t dst, src;
    size_t n;
    enum kind dst_kind, src_kind;
    CUstreamCallback cb;
    void *data;
    struct op *next;
};
struct fake_stream {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    struct op *head, *tail;
    int busy;
    pthread_t thread;
};

static void *stream_main(void *arg) {
    struct fake_stream *s = arg;
    for (;;) {
        pthread_mutex_lock(&s->mu);
        while (!s->head) pthread_cond_wait(&s->cv, &s->mu);
        struct op *o = s->head;
        s->head = o->next;
        if (!s->head) s->tail = NULL;
        s->busy = 1;
        pthread_mutex_unlock(&s->mu);
        if (o->is_copy) {
            /* Large copies take a while, as over PCIe. */
            if (o->n >= (1 << 20)) {
                struct timespec t = {0, 300000};
                nanosleep(&t, NULL);
            }
            pthread_mutex_lock(&mu);
            int ok = inside(o->dst, o->n, o->dst_kind) && inside(o->src, o->n, o->src_kind);
            if (ok) memcpy((void *)o->dst, (void *)o->src, o->n);
            pthread_mutex_unlock(&mu);
            if (!ok) fatal("an asynchronous copy's memory was freed before the copy ran");
        } else {
            in_callback = 1;
            o->cb(s, OK, o->data);
            in_callback = 0;
        }
        free(o);
        pthread_mutex_lock(&s->mu);
        s->busy = 0;
        pthread_cond_broadcast(&s->cv);
        pthread_mutex_unlock(&s->mu);
    }
    return NULL;
}

CUresult cuStreamCreate(CUstream *out, unsigned flags) {
    NEED_CTX();
    (void)flags;
    struct fake_stream *s = calloc(1, sizeof *s);
    pthread_mutex_init(&s->mu, NULL);
    pthread_cond_init(&s->cv, NULL);
    pthread_create(&s->thread, NULL, stream_main, s);
    pthread_detach(s->thread);
    *out = s;
    return OK;
}

static void push(struct fake_stream *s, struct op *o) {
    pthread_mutex_lock(&s->mu);
    if (s->tail) s->tail->next = o; else s->head = o;
    s->tail = o;
    pthread_cond_broadcast(&s->cv);
    pthread_mutex_unlock(&s->mu);
}

static CUresult copy_async(uintptr_t dst, enum kind dk, uintptr_t src, enum kind sk, size_t n,
                           CUstream s) {
    NEED_CTX();
    if (!s) fatal("an asynchronous copy on the legacy default stream");
    if (!checked(dst, n, dk) || !checked(src, n, sk)) {
        fprintf(stderr, "fake libcuda (test double): asynchronous copy of %zu bytes "
                        "outside device memory or page-locked host memory\n", n);
        return INVALID_VALUE;
    }
    struct op *o = calloc(1, sizeof *o);
    o->is_copy = 1;
    o->dst = dst;
    o->src = src;
    o->n = n;
    o->dst_kind = dk;
    o->src_kind = sk;
    push(s, o);
    return OK;
}
CUresult cuMemcpyDtoHAsync_v2(void *dst, CUdeviceptr src, size_t n, CUstream s) {
    return copy_async((uintptr_t)dst, PINNED, src, DEVICE, n, s);
}
CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dst, const void *src, size_t n, CUstream s) {
    return copy_async(dst, DEVICE, (uintptr_t)src, PINNED, n, s);
}
CUresult cuStreamAddCallback(CUstream s, CUstreamCallback cb, void *data, unsigned flags) {
    NEED_CTX();
    if (!s || !cb || flags) return INVALID_VALUE;
    struct op *o = calloc(1, sizeof *o);
    o->cb = cb;
    o->data = data;
    push(s, o);
    return OK;
}
CUresult cuStreamSynchronize(CUstream s) {
    NEED_CTX();
    /* The legacy stream: this double runs its (synchronous) copies at once. */
    if (!s) return OK;
    pthread_mutex_lock(&s->mu);
    while (s->head || s->busy) pthread_cond_wait(&s->cv, &s->mu);
    pthread_mutex_unlock(&s->mu);
    return OK;
}

CUresult cuMemGetHandleForAddressRange(void *handle, CUdeviceptr p, size_t n, int type,
                                       unsigned long long flags) {
    NEED_CTX();
    if (type != 1 || flags) return INVALID_VALUE;
    if (p % 4096 || n % 4096 || !n) return INVALID_VALUE;
    if (!checked(p, n, DEVICE)) return INVALID_VALUE;
    int fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
    if (fd < 0) return 999;
    *(int *)handle = fd;
    return OK;
}

CUresult cuGetErrorName(CUresult r, const char **s) { (void)r; *s = "CUDA_ERROR_FAKE"; return OK; }
CUresult cuGetErrorString(CUresult r, const char **s) {
    (void)r;
    *s = "fake libcuda (test double) error";
    return OK;
}
