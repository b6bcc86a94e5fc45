/* A fake one-sided rank for hostile tests: a libfabric endpoint of its own
 * (PERSEUS_PROVIDER on the domain PERSEUS_IFACE names) that joins a real
 * rank's comm through a handle, takes part in the collective exchanges by
 * echoing the real rank's parts (so a real rank can register windows, GPU
 * ones included), and sends whatever control messages or writes a test
 * crafts: a peer that breaks the engine's promises on purpose. */
#ifndef FAKE_RMA_PEER_H
#define FAKE_RMA_PEER_H

#include <stddef.h>
#include <stdint.h>

typedef struct fake_peer fake_peer_t;

/* Opens the endpoint; NULL (printed why) on failure. */
fake_peer_t *fake_open(void);
void fake_close(fake_peer_t *f);
/* Our handle as rank `rank` of the real rank's comm, whose handle is
 * `real` (NCCL_NET_HANDLE_MAXSIZE bytes; its wire hash is copied, and its
 * address becomes where we send). 0, or -1 printed why. */
int fake_handle(fake_peer_t *f, uint32_t rank, const void *real, void *out);
/* Sends `len` bytes on `tag` to the real rank and waits (bounded) until
 * the send completed, echoing exchanges meanwhile. 0, or -1 printed why. */
int fake_send(fake_peer_t *f, uint64_t tag, const void *msg, size_t len);
/* Echoes the real rank's registration and staging-streams parts (as our
 * own: same window, same size, no streams) until *stop is set, at most
 * timeout_s. 0, or -1 printed why. */
int fake_serve(fake_peer_t *f, const int *stop, double timeout_s);
/* From now on the parts it echoes claim to be rank `rank`'s, not ours. */
void fake_claim(fake_peer_t *f, uint32_t rank);
/* Writes 8 bytes at the start of the real rank's part of the last window
 * whose registration it echoed, with `data` as remote CQ data, and waits
 * (bounded) until the write completed. 0, or -1 printed why. */
int fake_write(fake_peer_t *f, uint64_t data);

#endif
