/* The model fabric's memory-speed path: registered memory that lies in a
 * shared mapping of a /dev/shm file (a benchmark's windows, allocated so)
 * is written and read by peers through their own mapping of that file,
 * with memcpy, rather than with process_vm_writev/readv (a syscall and page
 * pinning per operation, which made the NIC thread, not the modeled link,
 * the bottleneck for small writes). */
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>

#include "pm.h"

void pm_window_find(const void *buf, size_t len, char shm[PM_NAME_LEN], uint64_t *off) {
  shm[0] = 0, *off = 0;
  FILE *f = fopen("/proc/self/maps", "r");
  if (!f) return;
  uintptr_t a = (uintptr_t)buf;
  char line[512];
  while (fgets(line, sizeof line, f)) {
    uintptr_t lo, hi;
    unsigned long long foff;
    char perms[8], path[384] = "";
    if (sscanf(line, "%" SCNxPTR "-%" SCNxPTR " %7s %llx %*s %*s %383s", &lo, &hi, perms, &foff,
               path) < 4)
      continue;
    if (a < lo || a >= hi) continue;
    const char *name = strncmp(path, "/dev/shm/", 9) ? NULL : path + 9;
    if (name && perms[3] == 's' && len <= hi - a && strlen(name) < PM_NAME_LEN &&
        !strncmp(name, "pm_", 3) && !strchr(name, '/')) {
      snprintf(shm, PM_NAME_LEN, "%s", name);
      *off = foff + (a - lo);
    }
    break;
  }
  fclose(f);
}

/* Peers' window files, mapped once and kept for the process's life: a
 * window's name is never reused, and a freed one costs only its mapping. */
typedef struct win_map {
  struct win_map *next;
  char name[PM_NAME_LEN];
  char *base;
  size_t size;
} win_map_t;
static win_map_t *wins;
static pthread_mutex_t wins_lock = PTHREAD_MUTEX_INITIALIZER;

static win_map_t *map_window(const char *name) {
  pthread_mutex_lock(&wins_lock);
  win_map_t *w = wins;
  while (w && strcmp(w->name, name)) w = w->next;
  if (!w) {
    int fd = shm_open(name, O_RDWR, 0);
    struct stat st;
    void *p = MAP_FAILED;
    if (fd >= 0 && !fstat(fd, &st) && st.st_size > 0)
      p = mmap(NULL, (size_t)st.st_size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (fd >= 0) close(fd);
    if (p != MAP_FAILED && (w = calloc(1, sizeof *w))) {
      snprintf(w->name, sizeof w->name, "%s", name);
      w->base = p, w->size = (size_t)st.st_size, w->next = wins, wins = w;
    } else if (p != MAP_FAILED) {
      munmap(p, (size_t)st.st_size);
    }
  }
  pthread_mutex_unlock(&wins_lock);
  return w;
}

void *pm_window_at(const pm_mr_slot_t *s, uint64_t addr, size_t len) {
  char name[PM_NAME_LEN];
  memcpy(name, s->shm, sizeof name); /* a peer's segment: read once, then checked */
  uint64_t off = s->shm_off, base = s->addr;
  if (!name[0] || !memchr(name, 0, sizeof name) || addr < base) return NULL;
  win_map_t *w = map_window(name);
  uint64_t at = off + (addr - base);
  if (!w || at < off || at > w->size || w->size - at < len) return NULL;
  return w->base + at;
}

const char *pm_move(const pm_mr_slot_t *s, pid_t pid, int is_read, void *buf, uint64_t raddr,
                    size_t len, char *why, size_t why_len) {
  if (!len) return NULL;
  char *win = pm_window_at(s, raddr, len);
  if (win) { /* the peer's memory is mapped here too */
    if (is_read) memcpy(buf, win, len);
    else memcpy(win, buf, len);
    return NULL;
  }
  struct iovec l = {buf, len}, r = {(void *)(uintptr_t)raddr, len};
  ssize_t n = is_read ? process_vm_readv(pid, &l, 1, &r, 1, 0) : process_vm_writev(pid, &l, 1, &r, 1, 0);
  if (n == (ssize_t)len) return NULL;
  snprintf(why, why_len, "process_vm_%sv to pid %d: %s", is_read ? "read" : "write", (int)pid,
           n < 0 ? strerror(errno) : "short");
  return why;
}
