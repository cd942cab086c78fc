/* How the persistent Hopper GEMM's CTAs take their work units
 * (grouped_gemm_sm90_impl.cuh). Units are numbered in the order the kernel
 * wants them run (groups of m units, m fastest: consecutive units share a
 * weight tile). The CTA's j-th unit, for j = 0, 1, 2, ...:
 *   round robin: cluster + j * clusters (CTA pairs, and single CTAs
 *           launched without a counter);
 *   dealt:  the next value of a global counter (atomicAdd), so each unit
 *           goes to the first CTA to ask. Round robin gives unit u + 1 to
 *           the next CTA whatever its timing: after tens of units the CTAs
 *           have drifted apart by more than the ~0.3 of a unit that L2 holds
 *           a weight tile for, and at 1-2 m tiles per expert the weights
 *           were read 1.14-1.47x from DRAM (ncu, NOTES "Packed weights on an
 *           H200"; benchmarks/persistent_reuse_model.py models both walks).
 * Dealt units: producer thread 0 takes them from the counter and hands them
 * to the CTA's other threads through kSm90UnitRing shared-memory slots (the
 * CTA's j-th unit in slot j % kSm90UnitRing), each slot with a full barrier
 * (one arrival: thread 0 stored the unit) and an empty barrier (one arrival
 * per warp that reads it: the math warps that run the unit and, when they
 * copy A rows, the producer warps). Thread 0 takes the CTA's unit j as it
 * starts that unit's loads (the producer runs a few k blocks ahead of the
 * math warps), so a unit goes to a CTA about to be free: taken earlier, a
 * unit waits behind the CTA's current one while its neighbours, which share
 * its weight tile, run elsewhere (taking two units ahead made forwards at
 * 2-4 m tiles per expert up to 7% slower than round robin; taking the unit
 * one k block early, its round trip hidden, gained nothing: H100,
 * 2026-11-28). The cooperative math warps read unit j + 1 after unit j's
 * mainloop, a ping-pong warpgroup its next (j + 2) after its epilogue. A
 * value >= total ends the walk: thread 0 stores it in two slots (a
 * ping-pong warpgroup may look two ahead) and takes no more. Each CTA thus
 * takes exactly one such value, so the CTA that takes total + CTAs - 1 took
 * the counter's last value and sets it back to zero: the next GEMM over the
 * same tile table (GEMM2 after GEMM1) finds it zeroed. Before the first
 * GEMM of a forward, moe_align zeroed it (moe_align.cuh: num_tiles[1]); the
 * kernels of a forward run in stream order. Which forwards deal, and what
 * it gained: gemm_configs.cuh mx_sm90_deals_units. */
#ifndef MOE_EXT_CUDA_SM90_UNITS_CUH
#define MOE_EXT_CUDA_SM90_UNITS_CUH

#include "gemm_configs.cuh"
#include "sm90_common.cuh"

namespace {

/* The CTA's units: the round robin of cluster blockIdx.x / CM, or the ring
 * of dealt ones at `ring` (shared memory: kSm90UnitRing full barriers, as
 * many empty barriers, then the int32 slots). The walk is read off the
 * special registers, so that the producer warps, at 40 registers, hold
 * only the ring and the counter. */
template <int CM> struct sm90_units {
    uint32_t ring;
    int32_t *taken; /* the global counter; nullptr: round robin */

    __device__ __forceinline__ uint32_t full_bar(int j) const { return ring + 8u * (j % kSm90UnitRing); }
    __device__ __forceinline__ uint32_t empty_bar(int j) const
    {
        return ring + 8u * (kSm90UnitRing + j % kSm90UnitRing);
    }
    __device__ __forceinline__ uint32_t slot(int j) const
    {
        return ring + 16u * kSm90UnitRing + 4u * (j % kSm90UnitRing);
    }
    __device__ __forceinline__ uint32_t phase(int j) const { return static_cast<uint32_t>(j / kSm90UnitRing) & 1u; }
    /* round robin: the cluster's j-th unit */
    __device__ __forceinline__ int walk(int j) const
    {
        return static_cast<int>(blockIdx.x / CM + j * (gridDim.x / CM));
    }

    /* The CTA's j-th unit, for a warp whose lanes all ask for the same j. */
    __device__ __forceinline__ int read(int j) const
    {
        if (!taken)
            return walk(j);
        mbar_wait(full_bar(j), phase(j));
        const int unit = static_cast<int>(ld_shared_u32(slot(j)));
        __syncwarp();
        if ((threadIdx.x & 31) == 0)
            mbar_arrive(empty_bar(j));
        return unit;
    }

    /* Producer thread 0 stores unit as the CTA's j-th. */
    __device__ __forceinline__ void put(int j, int unit) const
    {
        mbar_wait(empty_bar(j), phase(j) ^ 1u); /* a fresh barrier passes parity 1 at once */
        st_shared_u32(slot(j), static_cast<uint32_t>(unit));
        mbar_arrive(full_bar(j));
    }

    /* Producer thread 0, as the CTA's unit j starts: takes a unit from the
     * counter, stores it as the CTA's j-th and returns it; a value >= total
     * (the end) also as the (j + 1)-th, and the counter's last value resets
     * it. */
    __device__ __forceinline__ int deal(int j, int total) const
    {
        const int unit = atomicAdd(taken, 1);
        put(j, unit);
        if (unit < total)
            return unit;
        put(j + 1, unit);
        if (unit == total + static_cast<int>(gridDim.x) - 1)
            atomicExch(taken, 0);
        return unit;
    }
};

} /* namespace */

#endif /* MOE_EXT_CUDA_SM90_UNITS_CUH */
