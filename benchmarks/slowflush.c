/*
 * slowflush: an LD_PRELOAD shim that makes every durable flush of the process slower, to emulate a disk whose
 * flush takes about a millisecond (a cloud volume, a disk without a write cache) on a machine whose own flush takes
 * a tenth of that. benchmarks/durability.py compiles it at run time into benchmarks/.work/ and starts PostgreSQL
 * with it in LD_PRELOAD; PostgreSQL's backends are forked from the postmaster, so every one of them has it.
 *
 * What it delays, after the real call returns (so a flush takes its real time plus the delay):
 *   fdatasync()                      PostgreSQL's WAL flush (wal_sync_method = fdatasync, pinned by the harness)
 *   fsync(), syncfs()                data files at a checkpoint, a new WAL segment, the control file
 *   sync_file_range() with SYNC_FILE_RANGE_WAIT_AFTER only: without it the call starts writeback and waits for
 *                                    nothing (PostgreSQL's writeback hints), so it stays as fast as it is
 * Writes to files opened with O_SYNC or O_DSYNC (wal_sync_method = open_datasync) are not delayed.
 *
 * The delay is read, at every call, from a small control file that the harness maps too ($SLOWFLUSH_CONTROL): it
 * changes between measurements without restarting the server, and 0 makes the shim a pass-through. The shim also
 * counts its calls there, so the harness can check that the calls it delays are the flushes PostgreSQL counts.
 * Without the variable, or when the file cannot be mapped, the shim delays and counts nothing.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

/* The control file's layout: eight little-endian signed 64-bit integers (durability.py's SlowFlush reads the same). */
struct control {
    int64_t delay_ns;        /* written by the harness */
    int64_t fdatasync_calls; /* the rest: counted by the shim */
    int64_t fsync_calls;
    int64_t sync_file_range_calls; /* those that waited (SYNC_FILE_RANGE_WAIT_AFTER) */
    int64_t syncfs_calls;
    int64_t delayed_calls;
    int64_t delayed_ns; /* time spent in the added sleeps */
    int64_t reserved;
};

static struct control *mapped;  /* NULL: not mapped yet; MAP_FAILED: nothing to map */

static struct control *control(void) {
    struct control *found = __atomic_load_n(&mapped, __ATOMIC_ACQUIRE);
    if (found != NULL)
        return found == MAP_FAILED ? NULL : found;
    int saved = errno;
    const char *path = getenv("SLOWFLUSH_CONTROL");
    found = MAP_FAILED;
    if (path != NULL && path[0] != '\0') {
        int fd = open(path, O_RDWR | O_CLOEXEC);
        if (fd >= 0) {
            void *area = mmap(NULL, sizeof(struct control), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
            close(fd);
            if (area != MAP_FAILED)
                found = area;
        }
    }
    __atomic_store_n(&mapped, found, __ATOMIC_RELEASE);
    errno = saved;
    return found == MAP_FAILED ? NULL : found;
}

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* Count one call in *counter and sleep for the current delay; errno is the real call's afterwards. */
static void after_flush(struct control *c, int64_t *counter) {
    int saved = errno;
    __atomic_add_fetch(counter, 1, __ATOMIC_RELAXED);
    int64_t delay = __atomic_load_n(&c->delay_ns, __ATOMIC_RELAXED);
    if (delay > 0) {
        int64_t start = now_ns();
        int64_t end = start + delay;
        struct timespec until = {.tv_sec = end / 1000000000, .tv_nsec = end % 1000000000};
        /* An absolute deadline: a signal (PostgreSQL wakes its processes with SIGUSR1) does not cut it short. */
        while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &until, NULL) == EINTR) {
        }
        __atomic_add_fetch(&c->delayed_calls, 1, __ATOMIC_RELAXED);
        __atomic_add_fetch(&c->delayed_ns, now_ns() - start, __ATOMIC_RELAXED);
    }
    errno = saved;
}

typedef int (*fd_call)(int);
typedef int (*range_call)(int, off64_t, off64_t, unsigned int);

/* The C library's own function of that name, or NULL (then the call fails with ENOSYS). */
static void *next(const char *name) {
    return dlsym(RTLD_NEXT, name);
}

int fdatasync(int fd) {
    static fd_call real;
    if (real == NULL && (real = (fd_call)next("fdatasync")) == NULL)
        return errno = ENOSYS, -1;
    int result = real(fd);
    struct control *c = control();
    if (c != NULL)
        after_flush(c, &c->fdatasync_calls);
    return result;
}

int fsync(int fd) {
    static fd_call real;
    if (real == NULL && (real = (fd_call)next("fsync")) == NULL)
        return errno = ENOSYS, -1;
    int result = real(fd);
    struct control *c = control();
    if (c != NULL)
        after_flush(c, &c->fsync_calls);
    return result;
}

int syncfs(int fd) {
    static fd_call real;
    if (real == NULL && (real = (fd_call)next("syncfs")) == NULL)
        return errno = ENOSYS, -1;
    int result = real(fd);
    struct control *c = control();
    if (c != NULL)
        after_flush(c, &c->syncfs_calls);
    return result;
}

int sync_file_range(int fd, off64_t offset, off64_t nbytes, unsigned int flags) {
    static range_call real;
    if (real == NULL && (real = (range_call)next("sync_file_range")) == NULL)
        return errno = ENOSYS, -1;
    int result = real(fd, offset, nbytes, flags);
    struct control *c = control();
    if (c != NULL && (flags & SYNC_FILE_RANGE_WAIT_AFTER))
        after_flush(c, &c->sync_file_range_calls);
    return result;
}
