/*
 * shmserve.h — the shared-memory protocol of shmserve, version 2.
 *
 * The one header of the protocol: the Python extension (core.c, mapping.c, slots.c) and the
 * C++ client (clients/cpp) include it, and nobody declares a shared layout, constant
 * or slot procedure anywhere else. docs/protocol.md describes the same thing in prose.
 * It is split by concern; include this file, not the parts:
 *
 *   shms_layout.h    constants, enums (X-macro lists), shared structs, the field table
 *   shms_wait.h      clock, futex, doorbells
 *   shms_ring.h      the request ring (MPSC, claim/publish/skip)
 *   shms_segments.h  segment geometry, header writers and checkers
 *   shms_request.h   the batcher's take and validation of a request
 *   shms_slot.h      a slot's life: submit, push, read the answer, complete; mailboxes
 *   shms_stats.h     a model's statistics: durations, failures, latency histograms
 *
 * Build as C11 or C++11 (or later) with -D_GNU_SOURCE, or include this header first.
 */
#ifndef SHMSERVE_H
#define SHMSERVE_H

/* futex and clock_gettime need POSIX/GNU declarations. */
#if defined(__linux__) && !defined(_GNU_SOURCE)
#define _GNU_SOURCE 1
#endif

#include "shms_layout.h"
#include "shms_wait.h"
#include "shms_ring.h"
#include "shms_segments.h"
#include "shms_request.h"
#include "shms_slot.h"
#include "shms_stats.h"

#endif /* SHMSERVE_H */
