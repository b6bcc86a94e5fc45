/* Link watch: whether the path to a peer's host still carries packets.
 *
 * A two-sided comm over an IP provider (tcp, sockets) cannot tell a cut link
 * from a slow peer: the kernel retransmits for minutes, and a probe counts as
 * sent once it sits in our own socket buffer. So each process keeps one TCP
 * listener per device (on the device's address), and toward each peer process
 * one plain TCP connection of its own with kernel keepalive and
 * TCP_USER_TIMEOUT = PERSEUS_PEER_TIMEOUT_MS. The peer's kernel answers the
 * keepalives whatever its process is doing (stopped, busy, idle on the
 * comm), so only a dead link or host breaks the watch (a peer process that
 * exits closes it, which ends the watch without failing anything: its last
 * bytes may still be on their way). Nothing is ever sent on it; comms to the
 * same peer share one. */
#ifndef PS_WATCH_H
#define PS_WATCH_H

#include <stddef.h>
#include <stdint.h>

#include "ps_fabric.h"

typedef struct ps_watch ps_watch_t;

/* The port of this process's watch listener for device d, opened on first
 * call; 0 where there is none (not an IP provider, or it could not be
 * opened: logged at INFO), which peers take as "no watch". */
uint16_t ps_watch_port(ps_device_t *d);

/* Starts (or shares) the watch of the peer whose fabric address is
 * addr/addrlen (a sockaddr: its IP, our device's family) and whose listener
 * has `port`. NULL when port is 0 or nothing can be set up (logged). */
ps_watch_t *ps_watch_attach(ps_device_t *d, const void *addr, size_t addrlen, uint16_t port);
void ps_watch_detach(ps_watch_t *w);

/* NULL while the link answers (or the watch never came up or ended, which
 * is logged and then ignored); otherwise why it is broken. `now` is
 * ps_now_ns(). Cheap: the socket is looked at once per 50 ms at most. */
const char *ps_watch_broken(ps_watch_t *w, uint64_t now);

#endif
