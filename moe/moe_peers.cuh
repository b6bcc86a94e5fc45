/* moe_peers.cuh: what the fused MoE kernel waits for from its peers, and
 * what it checks of what they send (included by moe_kernel.cuh).
 *
 * Every wait for a peer (its header, its rows, its results) ends when the
 * data is there, when that peer has failed here (an earlier wait for it gave
 * up, or its header was refused: peer_fault, sticky), when the peer told us
 * it failed us (ps_moe_told), when the host aborts
 * the layer (perseus_moe_abort), or after PERSEUS_MOE_TIMEOUT_MS. In the
 * last three the CTA goes on without the data, so that every CTA still
 * reaches the grid barriers and the kernel ends, and the host reports the
 * layer's first fault (perseus_moe_forward and perseus_moe_last_profile
 * return ncclRemoteError). Waits for healthy peers go on as usual, so the
 * results we owe them stay valid; a failed peer's are not returned as
 * valid, and the peer is told at once (ps_moe_tell: an NVLink peer gets
 * poisoned done marks, PS_MOE_POISON; a GIN peer a poison added to its
 * results signal from us, PS_MOE_GIN_POISON), which fails its forward in
 * turn instead of leaving it to wait for its own timeout. Forwards enqueued
 * behind a failed one do not wait for the failed peer. */
#ifndef PS_MOE_PEERS_CUH
#define PS_MOE_PEERS_CUH

/* A done mark with this bit: the expert's results for that source are not
 * valid (the marking rank failed that source). Marks stay monotonic. */
#define PS_MOE_POISON (1ull << 63)

/* Added to a GIN peer's results signal from us (hcomb) when we fail it
 * (ps_moe_tell). Counts of returns never come near it. The peer's combine
 * takes the signal as reached and sees the bit, and every wait of the peer
 * for us checks it (ps_moe_told); from then on the peer counts us as
 * failed (sticky), so the one add is all it ever sees: a second would
 * carry into bit 63 and no longer compare as reached. */
#define PS_MOE_GIN_POISON (1ull << 62)

/* Expert j's done mark in the window of LSA peer l (a source, or us):
 * forward `ps_fwd + 1` is done, its results valid or (poison) not. */
__device__ __forceinline__ void ps_moe_mark_done(const ps_moe_args &a, int l, int j, bool poison)
{
  uint64_t *done = (uint64_t *)ncclGetLsaPointer(
      a.win, a.off_done + ((size_t)a.dc.rank * a.L + j) * sizeof(uint64_t), l);
  const uint64_t v = (ps_fwd(a) + 1) | (poison ? PS_MOE_POISON : 0);
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(done), "l"(v) : "memory");
}

/* Tells `peer` at once that we failed it, so that it fails too instead of
 * waiting for us until its own timeout (we may refuse our next forwards,
 * which it would wait for): an LSA peer gets our expert 0's done mark
 * poisoned in its window, a GIN peer the GIN poison. One thread. */
__device__ void ps_moe_tell(const ps_moe_args &a, int peer)
{
  if (peer == a.dc.rank) return;
  if (const int l = perseus_lsa_index(a.dc, peer); l >= 0) {
    ps_moe_mark_done(a, l, 0, true);
    return;
  }
  ps_gin_posted();
  ncclGin gin{a.dc, a.hcomb.ctx};
  gin.signal(ncclTeamWorld(a.dc), peer,
             ncclGin_SignalAdd{a.hcomb.signal0 + (ncclGinSignal_t)a.dc.rank, PS_MOE_GIN_POISON});
}

/* Whether `peer` told us it failed us (ps_moe_tell, or the poisoned marks
 * of ps_moe_release): read every 32 polls of a wait for it. */
__device__ __forceinline__ bool ps_moe_told(const ps_moe_args &a, int peer)
{
  if (peer == a.dc.rank) return false;
  if (perseus_lsa_index(a.dc, peer) >= 0)
    return (*(const volatile uint64_t *)ncclGetLocalPointer(
               a.win, a.off_done + (size_t)peer * a.L * sizeof(uint64_t)) & PS_MOE_POISON) != 0;
  ncclGin gin{a.dc, a.hcomb.ctx};
  return (gin.readSignal(a.hcomb.signal0 + (ncclGinSignal_t)peer, 64, cuda::memory_order_relaxed) &
          PS_MOE_GIN_POISON) != 0;
}

/* Records a fault concerning `peer` (any thread): the peer counts as failed
 * from then on and is told (ps_moe_tell); the first fault of the layer
 * goes to the host. */
__device__ void ps_moe_fail(const ps_moe_args &a, int kind, int peer, int what, int expert = 0,
                            int count = 0, long long rows = 0)
{
  if (atomicExch(&a.st.peer_fault[peer], 1) == 0) ps_moe_tell(a, peer);
  if (kind == PS_MOE_FAULT_ABORT) atomicExch(a.st.aborted, 1);
  if (atomicCAS(a.st.fault, 0, kind) != 0) return;
  ps_moe_ctl *c = a.ctl;
  c->f = ps_moe_fault_t{kind, peer, what, expert, count, a.P, rows};
  __threadfence_system();
  c->set = 1;
}

/* Whether `peer` failed here: its data will not be waited for, and what we
 * owe it is not returned as valid. */
__device__ __forceinline__ bool ps_peer_failed(const ps_moe_args &a, int peer)
{
  return *(volatile int *)&a.st.peer_fault[peer] != 0;
}

/* How often at most the GPU reads the host's abort flag (ns). */
#define PS_MOE_ABORT_READ_NS 100000ull

/* Whether the host asked the layer to abort (perseus_moe_abort), read by one
 * waiting thread of the GPU at a time, at most every PS_MOE_ABORT_READ_NS;
 * the others learn it from st.aborted. The flag is in host memory: every
 * waiting lane reading it (thousands in the combine) would fill PCIe with
 * reads and slow the GIN plugin's staged copies into this GPU. */
__device__ __forceinline__ bool ps_moe_host_abort(const ps_moe_args &a, unsigned long long now)
{
  const unsigned long long last = *(volatile unsigned long long *)a.st.abort_read;
  if ((long long)(now - last) < (long long)PS_MOE_ABORT_READ_NS) return false;
  if (atomicCAS(a.st.abort_read, last, now) != last) return false; /* another thread reads it */
  return a.ctl->abort != 0;
}

/* Spins until ready() holds (ready acquires what it checks): true; false
 * when the peer failed, the layer was aborted or the wait timed out (see
 * above). The device flags are read every 32 polls, the clock (and so
 * maybe the host's abort) every 1024, so a wait that is met at once costs
 * nothing more. */
template <typename Ready>
__device__ bool ps_moe_wait(const ps_moe_args &a, int what, int peer, Ready ready)
{
  unsigned long long t0 = 0;
  for (unsigned n = 0;; n++) {
    if (ready()) return true;
    if (n % 32 != 31) continue;
    if (ps_peer_failed(a, peer)) return false;
    if (ps_moe_told(a, peer)) { /* it failed us: it may never send (e.g. our next header) */
      ps_moe_fail(a, PS_MOE_FAULT_PEER, peer, what, -1);
      return false;
    }
    const bool clock = n % 1024 == 1023;
    const unsigned long long now = clock ? ps_now_ns() : 0;
    if (*(volatile int *)a.st.aborted || (clock && ps_moe_host_abort(a, now))) {
      ps_moe_fail(a, PS_MOE_FAULT_ABORT, peer, what);
      return false;
    }
    if (!clock) continue;
    if (!t0) t0 = now;
    else if (a.timeout_ns && now - t0 > a.timeout_ns) {
      ps_moe_fail(a, PS_MOE_FAULT_TIMEOUT, peer, what);
      return false;
    }
  }
}

/* ---- headers in (a warp per source) ---------------------------------------
 * A source's header is untrusted: every count in 0..P and their sum at most
 * P (its region of our receive window). Otherwise, or when it did not come,
 * the source failed here: its rows are dropped (counted as none), and it is
 * told at once (poisoned done marks for an LSA source, here; the GIN poison
 * for a GIN one, ps_moe_fail), so that its combine neither waits for rows
 * we will not compute nor takes stale ones as results. */
__device__ void ps_moe_release(const ps_moe_args &a, int src, int lane)
{
  const int l = perseus_lsa_index(a.dc, src);
  for (int i = lane; l >= 0 && i < a.L; i += 32) ps_moe_mark_done(a, l, i, true);
}

__device__ void ps_moe_headers(const ps_moe_args &a, int src, int lane)
{
  const perseus_recv rv(a.dc, a.hctl);
  const unsigned long long want = ps_fwd(a) + 1;
  /* our own header is not put: this warp wrote it (ps_moe_offsets) and
   * reads it where it is, with no put, signal or wait on the chain that
   * every expert task waits for */
  const bool own = src == a.dc.rank && ps_moe_hdr_sent(a, src);
  /* every lane waits: each acquires */
  bool bad = !own && !__all_sync(0xffffffffu, ps_moe_wait(a, PS_MOE_WAIT_HEADER, src,
                                                          [&] { return rv.poll(src, want); }));
  const volatile int *hdr = (const volatile int *)ncclGetLocalPointer(
      a.win, (own ? a.off_hdr_out : a.off_hdr_in) + (size_t)src * a.L * sizeof(int));
  int base = 0, segs = 0;
  for (int j0 = 0; j0 < a.L && !bad; j0 += 32) { /* each count read once; base <= P throughout */
    const int j = j0 + lane, c = j < a.L ? hdr[j] : 0, cc = c < 0 || c > a.P ? 0 : c;
    const int incl = ps_warp_scan(cc, lane); /* < 33 P: no overflow */
    const unsigned over = __ballot_sync(0xffffffffu, j < a.L && (cc != c || base + incl > a.P));
    if (over) {
      const int f = __ffs(over) - 1, cf = __shfl_sync(0xffffffffu, c, f);
      const long long before = base + (long long)__shfl_sync(0xffffffffu, incl - cc, f);
      if (lane == 0) ps_moe_fail(a, PS_MOE_FAULT_HEADER, src, PS_MOE_WAIT_HEADER, j0 + f, cf, before + max(cf, 0));
      bad = true;
    }
    /* tot may run ahead for a source that turns out bad: every later wait
     * for it gives up (ps_peer_failed), so nothing reads it as a target */
    if (j < a.L) {
      a.st.rcnt[src * a.L + j] = cc, a.st.roff[src * a.L + j] = base + incl - cc;
      a.st.tot[j * a.R + src] += ps_seg_tiles(a, src, cc);
    }
    base += __shfl_sync(0xffffffffu, incl, 31);
    segs += __popc(__ballot_sync(0xffffffffu, cc > 0));
  }
  if (bad) { /* its rows dropped: no expert counts any */
    for (int j = lane; j < a.L; j += 32) a.st.rcnt[src * a.L + j] = 0, a.st.roff[src * a.L + j] = 0;
    ps_moe_release(a, src, lane);
  } else if (lane == 0 && ps_gin_whole(a, src)) { /* its rows in one put; ours back in one */
    a.st.rsegs[src] = segs;
    if (base > 0) a.st.tot_r[src] += 1;
  }
}

#endif
