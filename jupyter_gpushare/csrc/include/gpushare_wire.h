/* gpushare_wire.h - the C side of the daemon <-> interposer wire format: control version 4
 * (an agent serves 3 and 4; an interposer falls back to 3 with an older agent), shared-memory
 * layout 3 (docs/develop/wire.md, "Versions and upgrades").
 *
 * The specification is docs/develop/wire.md, and jupyter_gpushare/daemon/wire.py its Python side;
 * this header reproduces its shared-memory layout field by field (tests/enforcement/test_wire.py
 * compares the offsets). Control messages on the unix socket are newline-delimited JSON.
 *
 * Three mappings share the layout of struct gpushare_wire_slot (wire.md, "Shared memory"): per GPU
 * the lease board (a 256-byte header, then GPUSHARE_WIRE_SLOTS slots of 256 bytes, one per
 * (allocation, GPU); read-write for the GPU's tenants: lease fields only) and the policy (same
 * size; read-only for clients: state, generation, mem_cap, request/limit, runahead_ns,
 * backfill_cap_ns, allocation), and per (allocation, GPU) the account (one slot: mem_used,
 * mem_peak, oom_count, lease_waits, wait_ns, fs_next_ns, backfill_ns, idle_ns). All three arrive
 * as descriptors with the hello reply (SCM_RIGHTS). Fields declared _Atomic are only accessed
 * atomically.
 */
#ifndef GPUSHARE_WIRE_H
#define GPUSHARE_WIRE_H

#include <stddef.h>
#include <stdint.h>

#define GPUSHARE_WIRE_VERSION        4u /* control: the hello's "v" */
#define GPUSHARE_WIRE_OLDEST_VERSION 3u /* the hello's "v_min", the fallback with an older agent */
#define GPUSHARE_WIRE_LAYOUT_VERSION 3u /* shared memory: header.version */
#define GPUSHARE_WIRE_MAGIC          0x48535047u /* "GPSH" */
#define GPUSHARE_WIRE_SLOTS          64
#define GPUSHARE_WIRE_HEADER_SIZE    256
#define GPUSHARE_WIRE_SLOT_SIZE      256
#define GPUSHARE_WIRE_FILE_SIZE                                                                    \
    (GPUSHARE_WIRE_HEADER_SIZE + GPUSHARE_WIRE_SLOTS * GPUSHARE_WIRE_SLOT_SIZE)
/* an account file: one slot */
#define GPUSHARE_WIRE_ACCOUNT_SIZE       GPUSHARE_WIRE_SLOT_SIZE
#define GPUSHARE_WIRE_HEARTBEAT_STALE_NS 2000000000ull

#define GPUSHARE_SLOT_FREE     0u
#define GPUSHARE_SLOT_ACTIVE   1u
#define GPUSHARE_SLOT_RELEASED 2u

struct gpushare_wire_header {
    uint32_t magic;                     /* 0 */
    uint32_t version;                   /* 4 */
    uint32_t slot_count;                /* 8 */
    uint32_t slot_size;                 /* 12 */
    uint64_t daemon_pid;                /* 16 */
    _Atomic uint64_t epoch;             /* 24: bumped by every daemon start */
    _Atomic uint64_t heartbeat_ns;      /* 32: CLOCK_MONOTONIC */
    _Atomic uint64_t quantum_ns;        /* 40 */
    _Atomic uint64_t window_ns;         /* 48 */
    _Atomic uint32_t holder;            /* 56: slot + 1 of the lease holder, 0 none */
    _Atomic uint32_t waiting_slots;     /* 60: slots other than the holder waiting for a lease */
    char uuid[64];                      /* 64 */
    _Atomic uint32_t next_slot;         /* 128: slot + 1 the holder may hand the GPU to (daemon) */
    _Atomic uint32_t next_other;        /* 132: slot + 1 to hand to when the holder is next but
                                        does not want more (idle): the best of the others */
    _Atomic uint64_t next_lease_ns;     /* 136: the lease to give it */
    _Atomic uint64_t direct_handoffs;   /* 144: handoffs done by clients */
    _Atomic uint64_t backfill_until_ns; /* 152: a share backfills the holder's gap until then
                                           (clients, CAS; wire.md "Backfill") */
    _Atomic uint64_t backfills;         /* 160: backfill launches (clients, atomic add) */
    uint8_t pad[88];                    /* 168 */
};

struct gpushare_wire_slot {
    _Atomic uint64_t lease_until_ns;  /* 0: the fast path compares CLOCK_MONOTONIC with this */
    _Atomic uint64_t lease_start_ns;  /* 8 */
    _Atomic uint32_t grant_seq;       /* 16: futex word, bumped on every grant/revoke/release */
    _Atomic uint32_t state;           /* 20: GPUSHARE_SLOT_* */
    _Atomic uint32_t joined;          /* 24: processes that launched under the current lease */
    _Atomic uint32_t waiters;         /* 28: threads blocked waiting for a lease */
    _Atomic uint64_t mem_cap;         /* 32 */
    _Atomic uint64_t mem_used;        /* 40: CAS reserve, fetch_sub release */
    _Atomic uint64_t used_ns;         /* 48: device time charged (daemon) */
    _Atomic uint64_t drain_end_ns;    /* 56: atomic max (clients) */
    _Atomic uint32_t request_ppm;     /* 64 */
    _Atomic uint32_t limit_ppm;       /* 68 */
    _Atomic uint64_t lease_waits;     /* 72 */
    _Atomic uint64_t wait_ns;         /* 80 */
    _Atomic uint64_t oom_count;       /* 88 */
    _Atomic uint64_t mem_peak;        /* 96 */
    _Atomic uint64_t generation;      /* 104 */
    char allocation[32];              /* 112 */
    _Atomic uint64_t launches;        /* 144 */
    _Atomic uint64_t first_launch_ns; /* 152: atomic min (clients): first join of the lease */
    _Atomic uint64_t drain_eta_ns;    /* 160: when the draining holder expects its work done */
    _Atomic uint64_t runahead_ns;     /* 168: device time it may queue ahead (daemon; 0: any) */
    _Atomic uint64_t fs_next_ns;      /* 176: account: while no agent answers, when the share's
                                         last self-granted lease was due (clients, CAS; 0: none) */
    _Atomic uint64_t queued_until_ns; /* 184: board: when the holder's queued work should be done
                                         (its processes, atomic max; 0: it does not say) */
    _Atomic uint64_t backfill_cap_ns; /* 192: policy: backfill_ns may grow up to this (daemon) */
    _Atomic uint64_t backfill_ns;     /* 200: account: device time backfilled (clients, add) */
    _Atomic uint64_t idle_ns; /* 208: account: device idle in its holder's leases (clients) */
    uint8_t pad[40];          /* 216 */
};

_Static_assert(sizeof(struct gpushare_wire_header) == GPUSHARE_WIRE_HEADER_SIZE, "header size");
_Static_assert(sizeof(struct gpushare_wire_slot) == GPUSHARE_WIRE_SLOT_SIZE, "slot size");
_Static_assert(offsetof(struct gpushare_wire_header, holder) == 56, "holder offset");
_Static_assert(offsetof(struct gpushare_wire_slot, mem_used) == 40, "mem_used offset");
_Static_assert(offsetof(struct gpushare_wire_slot, allocation) == 112, "allocation offset");
_Static_assert(offsetof(struct gpushare_wire_slot, launches) == 144, "launches offset");

/* Slot `index` (0-based) of a lease board that starts with its header. */
static inline struct gpushare_wire_slot *gpushare_wire_slot_at(void *board, size_t index) {
    return (struct gpushare_wire_slot *)((char *)board + GPUSHARE_WIRE_HEADER_SIZE +
                                         index * GPUSHARE_WIRE_SLOT_SIZE);
}

/* The offsets by name, for the wire-format test (tools/wire_offsets in the build). */
/* clang-format off */
#define GPUSHARE_WIRE_HEADER_FIELDS(X) X(magic) X(version) X(slot_count) X(slot_size) \
    X(daemon_pid) X(epoch) X(heartbeat_ns) X(quantum_ns) X(window_ns) X(holder) \
    X(waiting_slots) X(uuid) X(next_slot) X(next_other) X(next_lease_ns) X(direct_handoffs) \
    X(backfill_until_ns) X(backfills)
#define GPUSHARE_WIRE_SLOT_FIELDS(X) X(lease_until_ns) X(lease_start_ns) X(grant_seq) X(state) \
    X(joined) X(waiters) X(mem_cap) X(mem_used) X(used_ns) X(drain_end_ns) X(request_ppm) \
    X(limit_ppm) X(lease_waits) X(wait_ns) X(oom_count) X(mem_peak) X(generation) \
    X(allocation) X(launches) X(first_launch_ns) X(drain_eta_ns) X(runahead_ns) X(fs_next_ns) \
    X(queued_until_ns) X(backfill_cap_ns) X(backfill_ns) X(idle_ns)
/* clang-format on */

#endif
