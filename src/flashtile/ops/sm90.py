"""Pieces every Hopper (Gluon) kernel shares: hardware named barriers and register budgets, named
in one place (FA4's `named_barrier.py`)."""


from triton.experimental import gluon
from triton.experimental.gluon import language as gl

# the first named barrier the Hopper kernels may take for their own: Gluon's are 0 (the default
# partition's warpgroup), 1 (the CTA's) and 2 + worker partition (2, or 2-3 with three consumers)
FIRST_FREE_BARRIER = gl.constexpr(8)


@gluon.jit
def named_barrier_sm90(barrier, ARRIVE: gl.constexpr):
    """Hardware named barrier `barrier` of two warpgroups (256 threads): bar.sync, which waits until
    all 256 have arrived, or with ARRIVE bar.arrive, which counts this warpgroup and goes on. An
    mbarrier's arrival and wait are shared-memory operations and a polling loop; this is neither."""
    if ARRIVE:
        gl.inline_asm_elementwise("bar.arrive $1, 256; mov.b32 $0, 0;", "=r,r", [barrier], dtype=gl.int32,
                                  is_pure=False, pack=1)
    else:
        gl.inline_asm_elementwise("bar.sync $1, 256; mov.b32 $0, 0;", "=r,r", [barrier], dtype=gl.int32,
                                  is_pure=False, pack=1)


# Register budgets of the warp-specialised kernels (setmaxnreg):
# 12 warps (the two consumer warpgroups and the loader's) share the SM's 64K registers: 168 each
# at launch; setmaxnreg then moves them to the consumers (240) from the loader (24).
HOPPER_MAXNREG = 168


HOPPER_CONSUMER_REGS = gl.constexpr(240)


HOPPER_LOADER_REGS = gl.constexpr(24)


# three consumer warpgroups (configs.hopper_forward_consumers): 16 warps, 128 registers each at
# launch, then 160 for each consumer and 24 for the loader's warpgroup (64512 of 65536)
HOPPER_THREE_MAXNREG = 128


HOPPER_THREE_CONSUMER_REGS = gl.constexpr(160)
