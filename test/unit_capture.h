/* Capturing what a unit test's code under test writes to stderr (the
 * single-process unit tests: logging, error messages). capture_begin()
 * redirects stderr to a temporary file; capture_end() restores it and
 * returns what was written (at most 8 KiB). */
#ifndef PS_UNIT_CAPTURE_H
#define PS_UNIT_CAPTURE_H

#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

static char captured[8192];
static int saved_fd = -1;
static FILE *cap_file;

static void capture_begin(void) {
  fflush(stderr);
  cap_file = tmpfile();
  if (!cap_file) {
    perror("tmpfile");
    exit(2);
  }
  saved_fd = dup(STDERR_FILENO);
  dup2(fileno(cap_file), STDERR_FILENO);
}

static const char *capture_end(void) {
  fflush(stderr);
  dup2(saved_fd, STDERR_FILENO);
  close(saved_fd);
  rewind(cap_file);
  size_t n = fread(captured, 1, sizeof captured - 1, cap_file);
  captured[n] = '\0';
  fclose(cap_file);
  return captured;
}

#endif
