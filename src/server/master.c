/*
 * master.c: the master process of --workers N (see master.h): forks the workers, starts
 * again one that dies, passes signals on, and exits when they have all gone.
 *
 * The master runs no event loop and no gateway: it is a plain poll() on a signalfd (the
 * signals it handles are blocked, so they queue there instead of interrupting it) and on
 * a pipe the workers write to when they listen. It must not use libuv, since the workers
 * are forked from it and libuv's signal handling is per process. A worker keeps the
 * master's signal mask until it has installed its own handlers (cg_worker_ready), so a
 * SIGHUP or SIGTERM sent during its start waits for it instead of killing it.
 *
 * Restarts: a worker that ran for CG_RESTART_QUICK_MS or more is started again at once; one
 * that died sooner waits 1 s, then 2, 4 ... up to 30 s, so a worker that cannot live (its
 * Redis refuses it, a crash at start) is not forked in a tight loop. At the first start,
 * a worker that exits before it listens (port in use, a bad store URL, the rules) stops the
 * master with the worker's status, as one process would have.
 *
 * SIGHUP from outside goes to every worker; one sent by a worker (it reloaded its rules for
 * POST /admin/reload) goes to the others only.
 *
 * Shutdown: SIGTERM or SIGINT goes to every worker, which drains (gateway.c); a second one
 * is passed on too (the workers then stop at once). The master waits for them, and kills
 * the ones still running shutdown_timeout_s + CG_KILL_GRACE_MS after the first signal.
 * If the master is killed itself, each worker gets SIGTERM (PR_SET_PDEATHSIG) and drains.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/random.h>
#include <sys/signalfd.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "chatgate/core/log.h"
#include "chatgate/server/master.h"

#define CG_RESTART_QUICK_MS 5000   /* a worker that died sooner than this died "at once" */
#define CG_RESTART_BACKOFF_MS 1000 /* its first pause; doubled up to the next */
#define CG_RESTART_BACKOFF_MAX_MS 30000
#define CG_KILL_GRACE_MS 10000     /* after shutdown_timeout_s, before SIGKILL */

/* This process's view: the area in every process, the index in a worker. */
static cg_workers *shared;
static size_t shared_size;
static pid_t master_pid; /* a worker's: the master that started it */
static int self_index = -1;
static int ready_fd = -1;    /* a worker's end of the ready pipe */
static sigset_t saved_mask;  /* the mask before the master's; a worker restores it */

/* The master's books, one per worker. */
typedef struct worker {
    pid_t pid;          /* 0 while down */
    int ready;          /* it has said it listens */
    uint64_t started;   /* ms */
    uint64_t respawn_at; /* ms; when down and waiting to start again */
    uint64_t backoff_ms; /* the next pause after a quick death */
} worker;

static worker workers[CG_MAX_WORKERS];

cg_workers *cg_workers_shared(void)
{
    return shared;
}

pid_t cg_worker_master(void)
{
    return master_pid;
}

cg_worker_slot *cg_worker_self(void)
{
    return shared && self_index >= 0 ? &shared->slots[self_index] : NULL;
}

int cg_worker_index(void)
{
    return self_index;
}

static uint64_t now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000 + (uint64_t)ts.tv_nsec / 1000000;
}

void cg_worker_ready(void)
{
    if (ready_fd < 0)
        return;
    shared->slots[self_index].listening = 1;
    unsigned char b = (unsigned char)self_index;
    ssize_t w;
    do
        w = write(ready_fd, &b, 1);
    while (w < 0 && errno == EINTR);
    close(ready_fd);
    ready_fd = -1;
    /* its own signal handlers are installed (gateway.c): what waited comes now */
    sigprocmask(SIG_SETMASK, &saved_mask, NULL);
}

/* Forks worker i: 1 in the child, 0 in the master (or when fork failed: tried again later). */
static int spawn(int i, int sfd, int ready_r, int ready_w, pid_t master)
{
    pid_t pid = fork();
    if (pid < 0) {
        cg_error("workers: could not start worker %d: %s; trying again in 1 s", i, strerror(errno));
        workers[i].respawn_at = now_ms() + 1000;
        return 0;
    }
    if (pid == 0) {
        /* the worker: a gateway from here on, with the master's signals still blocked */
        close(sfd);
        close(ready_r);
        self_index = i;
        ready_fd = ready_w;
        master_pid = master;
        prctl(PR_SET_PDEATHSIG, SIGTERM);
        if (getppid() != master) /* the master died before prctl */
            _exit(1);
        return 1;
    }
    workers[i] = (worker){.pid = pid, .started = now_ms(), .backoff_ms = workers[i].backoff_ms};
    cg_info("workers: worker %d started (pid %d)", i, (int)pid);
    return 0;
}

/* signum to every worker, but `except` (a pid, or 0) */
static void signal_others(int signum, pid_t except)
{
    for (int i = 0; i < shared->n; i++)
        if (workers[i].pid > 0 && workers[i].pid != except)
            kill(workers[i].pid, signum);
}

static void signal_all(int signum)
{
    signal_others(signum, 0);
}

static int live_count(void)
{
    int n = 0;
    for (int i = 0; i < shared->n; i++)
        n += workers[i].pid > 0;
    return n;
}

static void describe_status(int status, char *buf, size_t len)
{
    if (WIFEXITED(status))
        snprintf(buf, len, "exited with status %d", WEXITSTATUS(status));
    else if (WIFSIGNALED(status))
        snprintf(buf, len, "was killed by signal %d (%s)", WTERMSIG(status), strsignal(WTERMSIG(status)));
    else
        snprintf(buf, len, "ended (status 0x%x)", status);
}

/* A worker is gone: its slot's counters go to the retired ones, the slot is cleared for
 * the next one. */
static void retire(int i)
{
    cg_worker_slot *s = &shared->slots[i];
    cg_metrics_add(&shared->retired, &s->metrics);
    cg_store_stats_add(&shared->retired_store, &s->store, 0);
    memset(s, 0, sizeof(*s));
}

static void unmap_shared(void)
{
    if (shared)
        munmap(shared, shared_size);
    shared = NULL;
}

/* The master's loop, and what it decides from: its file descriptors, its workers' life. */
typedef struct master {
    const cg_config *cfg;
    int n;           /* workers */
    int sfd;         /* signalfd: SIGCHLD, SIGTERM, SIGINT, SIGHUP */
    int ready[2];    /* the pipe each worker writes its index to once it listens */
    pid_t pid;
    int starting;    /* until every worker of the first start has said it listens */
    int stopping;    /* a SIGTERM or SIGINT came, or a worker could not start */
    uint64_t kill_at; /* ms: the stragglers of a drain get SIGKILL */
    int status;      /* the exit status */
} master;

/* The shared memory, the resume secret, the ready pipe and the signalfd; 0, or -1 (said,
 * and undone). */
static int master_open(master *m)
{
    shared_size = sizeof(cg_workers) + (size_t)m->n * sizeof(cg_worker_slot);
    void *area = mmap(NULL, shared_size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (area == MAP_FAILED) {
        cg_error("workers: could not map the shared memory: %s", strerror(errno));
        return -1;
    }
    shared = area; /* zeroed by mmap */
    shared->n = m->n;
    if (getrandom(shared->resume_secret, sizeof(shared->resume_secret), 0) != (ssize_t)sizeof(shared->resume_secret)) {
        cg_error("workers: no random bytes for the resume secret: %s", strerror(errno));
        unmap_shared();
        return -1;
    }
    memset(workers, 0, sizeof(workers));
    if (pipe2(m->ready, O_CLOEXEC) < 0) {
        cg_error("workers: pipe: %s", strerror(errno));
        unmap_shared();
        return -1;
    }
    fcntl(m->ready[0], F_SETFL, O_NONBLOCK);
    sigset_t mask;
    sigemptyset(&mask);
    sigaddset(&mask, SIGCHLD);
    sigaddset(&mask, SIGTERM);
    sigaddset(&mask, SIGINT);
    sigaddset(&mask, SIGHUP);
    sigprocmask(SIG_BLOCK, &mask, &saved_mask);
    m->sfd = signalfd(-1, &mask, SFD_CLOEXEC | SFD_NONBLOCK);
    if (m->sfd < 0) {
        cg_error("workers: signalfd: %s", strerror(errno));
        sigprocmask(SIG_SETMASK, &saved_mask, NULL);
        close(m->ready[0]);
        close(m->ready[1]);
        unmap_shared();
        return -1;
    }
    return 0;
}

static void master_close(master *m)
{
    close(m->sfd);
    close(m->ready[0]);
    close(m->ready[1]);
    sigprocmask(SIG_SETMASK, &saved_mask, NULL);
    unmap_shared();
}

/* Starts worker i; 1 in the new worker (it returns to run the gateway), else 0. */
static int master_spawn(master *m, int i)
{
    return spawn(i, m->sfd, m->ready[0], m->ready[1], m->pid);
}

/* Stops every worker: they drain within shutdown_timeout_s, then get SIGKILL. */
static void master_stop(master *m, int signo)
{
    if (!m->stopping)
        m->kill_at = now_ms() + (uint64_t)m->cfg->shutdown_timeout_s * 1000 + CG_KILL_GRACE_MS;
    m->stopping = 1;
    signal_all(signo);
}

/* Workers due to start again are started; the stragglers of a drain are killed when due.
 * The next moment something is due (UINT64_MAX: none) into *next. 1 in a new worker. */
static int master_timers(master *m, uint64_t now, uint64_t *next)
{
    *next = UINT64_MAX;
    for (int i = 0; i < m->n && !m->stopping; i++) {
        if (workers[i].pid > 0 || !workers[i].respawn_at)
            continue;
        if (workers[i].respawn_at <= now) {
            shared->restarts++;
            if (master_spawn(m, i))
                return 1;
        } else if (workers[i].respawn_at < *next) {
            *next = workers[i].respawn_at;
        }
    }
    if (m->stopping && m->kill_at) {
        if (now >= m->kill_at) {
            cg_warn("workers: %d still running %ld s after the signal: killed", live_count(),
                    m->cfg->shutdown_timeout_s + CG_KILL_GRACE_MS / 1000);
            signal_all(SIGKILL);
            m->kill_at = 0;
        } else if (m->kill_at < *next) {
            *next = m->kill_at;
        }
    }
    return 0;
}

/* The workers that said they listen; the first start ends when all have. */
static void master_read_ready(master *m)
{
    unsigned char b;
    while (read(m->ready[0], &b, 1) == 1) {
        if (b >= m->n || workers[b].pid <= 0)
            continue;
        workers[b].ready = 1;
        int all = 1;
        for (int i = 0; i < m->n; i++)
            all &= workers[i].ready;
        if (m->starting && all) {
            m->starting = 0;
            cg_info("workers: all %d workers listen", m->n);
        }
    }
}

/* A SIGHUP (the operator's, or a worker's after its POST /admin/reload) goes to the others;
 * SIGTERM and SIGINT stop them all. */
static void master_read_signals(master *m)
{
    struct signalfd_siginfo si;
    while (read(m->sfd, &si, sizeof(si)) == (ssize_t)sizeof(si)) {
        int signo = (int)si.ssi_signo;
        if (signo == SIGHUP) {
            pid_t from = 0; /* a worker's: done there already */
            for (int i = 0; i < m->n; i++)
                if (workers[i].pid > 0 && (pid_t)si.ssi_pid == workers[i].pid)
                    from = workers[i].pid;
            if (from)
                cg_info("workers: worker pid %d reloaded its rules: passed on to the others", (int)from);
            else
                cg_info("workers: SIGHUP: passed on to the workers (rules reload)");
            signal_others(SIGHUP, from);
            /* the new set's rules are counted from 0 (gateway.c, count_rules): so are
             * those of workers gone before it */
            memset(shared->retired.rule_hits, 0, sizeof(shared->retired.rule_hits));
            memset(shared->retired.rule_limited, 0, sizeof(shared->retired.rule_limited));
            memset(shared->retired.rule_file_time, 0, sizeof(shared->retired.rule_file_time));
        } else if (signo == SIGTERM || signo == SIGINT) {
            cg_info("workers: signal %d: passed on to %d workers%s", signo, live_count(),
                    m->stopping ? " (again: they stop now)" : ", which drain");
            master_stop(m, signo);
        }
    }
}

/* Worker i (pid) ended: stopping, it is counted out; one that could not start stops them
 * all; else it starts again, after a pause when it died soon after its start. */
static void master_worker_ended(master *m, int i, pid_t pid, int wstatus)
{
    char how[96];
    describe_status(wstatus, how, sizeof(how));
    uint64_t lived = now_ms() - workers[i].started;
    int was_ready = workers[i].ready;
    workers[i].pid = 0;
    workers[i].ready = 0;
    retire(i);
    if (m->stopping) {
        cg_info("workers: worker %d (pid %d) %s; %d left", i, (int)pid, how, live_count());
        return;
    }
    if (m->starting && !was_ready) {
        /* it could not start: neither can the others; exit as one process would */
        cg_error("workers: worker %d (pid %d) %s before it listened: stopping", i, (int)pid, how);
        m->status = WIFEXITED(wstatus) && WEXITSTATUS(wstatus) ? WEXITSTATUS(wstatus) : 1;
        master_stop(m, SIGTERM);
        return;
    }
    uint64_t wait_ms = 0;
    if (lived < CG_RESTART_QUICK_MS) {
        wait_ms = workers[i].backoff_ms ? workers[i].backoff_ms : CG_RESTART_BACKOFF_MS;
        workers[i].backoff_ms = wait_ms * 2 > CG_RESTART_BACKOFF_MAX_MS ? CG_RESTART_BACKOFF_MAX_MS : wait_ms * 2;
    } else {
        workers[i].backoff_ms = 0;
    }
    cg_warn("workers: worker %d (pid %d) %s after %.1f s; starting it again%s", i, (int)pid, how,
            (double)lived / 1000.0, wait_ms ? " after a pause (it died soon after its start)" : "");
    if (wait_ms)
        cg_warn("workers: worker %d starts again in %.1f s", i, (double)wait_ms / 1000.0);
    workers[i].respawn_at = now_ms() + wait_ms;
    if (!workers[i].respawn_at)
        workers[i].respawn_at = 1;
}

/* SIGCHLD, or anything else: every worker that ended is collected. */
static void master_reap(master *m)
{
    int wstatus;
    pid_t pid;
    while ((pid = waitpid(-1, &wstatus, WNOHANG)) > 0) {
        int i = 0;
        while (i < m->n && workers[i].pid != pid)
            i++;
        if (i < m->n)
            master_worker_ended(m, i, pid, wstatus);
    }
}

int cg_master_run(const cg_config *cfg, int *exit_status)
{
    master m = {.cfg = cfg, .n = (int)cfg->workers, .pid = getpid(), .starting = 1};
    *exit_status = 1;
    if (master_open(&m) < 0)
        return 0;
    cg_info("workers: master (pid %d) starting %d workers%s", (int)m.pid, m.n,
            cfg->workers_auto ? " (auto: one per CPU this process may run on)" : "");
    for (int i = 0; i < m.n; i++)
        if (master_spawn(&m, i))
            return 1;
    while (!m.stopping || live_count() > 0) {
        uint64_t now = now_ms(), next;
        if (master_timers(&m, now, &next))
            return 1;
        struct pollfd fds[2] = {{.fd = m.sfd, .events = POLLIN}, {.fd = m.ready[0], .events = POLLIN}};
        int timeout = next == UINT64_MAX ? -1 : (int)(next > now ? next - now : 0);
        if (poll(fds, 2, timeout) < 0 && errno != EINTR) {
            cg_error("workers: poll: %s", strerror(errno));
            break;
        }
        master_read_ready(&m);
        master_read_signals(&m);
        master_reap(&m);
    }
    master_close(&m);
    if (m.status == 0)
        cg_info("workers: every worker has stopped; master exits");
    *exit_status = m.status;
    return 0;
}
