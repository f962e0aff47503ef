"""How K/V shards and their gradients move around the ring, and the one-process stand-in.

The ring loops (ring.py) talk to a *ring* object with two methods:

    handle = ring.start(tensors, what, step)   # send tensors to the next rank, receive the same
                                               # shapes from the previous one; returns at once
    received = ring.wait(handle)               # the received tensors, ready to read

`what` is "kv" (the K/V shard the rank holds at `step`) or "dkv" (the float32 partial dK/dV of
the shard it held at step - 1, travelling back to its owner). `P2PRing` does this with
torch.distributed's batched isend/irecv (NCCL on GPUs, gloo on CPUs): the loops start the
exchange for the next step before the current step's kernels and wait after them, so the
transfer overlaps the compute. `SimulatedRing` hands rank r the shards the other simulated ranks
hold, without any transfer: `flashtile bench ring` runs one rank's schedule on one GPU with it,
through the same loops.
"""

from __future__ import annotations

import struct
import weakref

import torch
import torch.distributed as dist

from flashtile._checks import ArgumentError

_TAGS = {"kv": 0, "dkv": 1}  # gloo matches messages by (peer, tag): K/V and dK/dV are in flight together
_side_streams: dict = {}  # CUDA device -> the stream P2P transfers are issued on


def _side_stream(device: torch.device) -> "torch.cuda.Stream":
    if device not in _side_streams:
        _side_streams[device] = torch.cuda.Stream(device)
    return _side_streams[device]


def check_group(group, caller: str):
    """The process group to use (the default one for None); a clear error when torch.distributed
    is not initialised."""
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(f"{caller} needs torch.distributed: call torch.distributed.init_process_group(...) "
                           f"on every rank first (gloo on CPUs, nccl on GPUs)")
    if group is None:
        return dist.group.WORLD
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"group must be a torch.distributed ProcessGroup or None, got {type(group).__name__}")
    return group


class P2PRing:
    """Send to the next rank of `group`, receive from the previous one (torch.distributed P2P).

    On CUDA the batch is issued on a side stream that first waits for the compute stream (what is
    sent has been written), and every tensor is recorded on that stream, so the caching allocator
    does not hand its memory to another tensor while the transfer may still read or write it.
    wait() makes the compute stream, not the host, wait for the transfer.
    """

    def __init__(self, group):
        self.group = group
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        self.next = dist.get_global_rank(group, (rank + 1) % world)
        self.prev = dist.get_global_rank(group, (rank - 1) % world)

    def start(self, tensors, what: str, step: int):
        received = [torch.empty_like(t, memory_format=torch.contiguous_format) for t in tensors]
        tag = _TAGS[what]
        ops = [dist.P2POp(dist.isend, t, self.next, self.group, tag) for t in tensors] + \
              [dist.P2POp(dist.irecv, r, self.prev, self.group, tag) for r in received]
        device = tensors[0].device
        if device.type != "cuda":
            return dist.batch_isend_irecv(ops), received, None
        side = _side_stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            works = dist.batch_isend_irecv(ops)
        for t in (*tensors, *received):
            t.record_stream(side)
        return works, received, side

    def wait(self, handle):
        works, received, side = handle
        for work in works:
            work.wait()
        if side is not None:
            torch.cuda.current_stream(side.device).wait_stream(side)
        return received


class SimulatedRing:
    """What rank `rank` of a simulated ring receives, without communication: at step t the K/V
    shard of rank (rank - t) mod world (kv_shards[i] = rank i's (k, v)), and in place of the dK/dV
    partials the other ranks would send, zeros (allocated once; their values change no timing)."""

    def __init__(self, rank: int, kv_shards):
        self.rank, self.kv_shards = rank, kv_shards
        self._partials = None

    def start(self, tensors, what: str, step: int):
        if what == "kv":
            return list(self.kv_shards[(self.rank - step) % len(self.kv_shards)])
        if self._partials is None:
            self._partials = [torch.zeros_like(t) for t in tensors]
        return self._partials

    def wait(self, handle):
        return handle


# --------------------------------------------------------------------------------------------
# Every rank must call with the same shapes and options
# --------------------------------------------------------------------------------------------

_host_groups: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # group -> a gloo group over its ranks


def _host_group(group):
    """A group over group's ranks that gathers CPU tensors (gloo): the group itself where it is
    gloo, else one made once, with only its ranks taking part (use_local_synchronization), at the
    first call, which every rank of the group makes at once."""
    host = _host_groups.get(group)
    if host is None:
        if dist.get_backend(group) == "gloo":
            host = group
        else:
            host = dist.new_group(dist.get_process_group_ranks(group), backend="gloo", use_local_synchronization=True)
        _host_groups[group] = host
    return host


def _code(x) -> int:
    """A signature value as an int64: ints as they are, floats by their bits, strings by their
    first 8 bytes (enough to tell the values apart that signatures hold)."""
    if isinstance(x, (bool, int)):
        return int(x)
    if isinstance(x, float):
        return struct.unpack("<q", struct.pack("<d", x))[0]
    return int.from_bytes(str(x).encode()[:8].ljust(8, b"\0"), "little", signed=True)


def _decode(code: int, like):
    """The value _code(value) came from, for a value of like's type."""
    if isinstance(like, (bool, int)):
        return code
    if isinstance(like, float):
        return struct.unpack("<d", struct.pack("<q", code))[0]
    return code.to_bytes(8, "little", signed=True).rstrip(b"\0").decode(errors="replace")


def check_ranks_agree(group, signature: dict, caller: str) -> None:
    """Raise on every rank if the ranks of `group` disagree on any entry of signature
    ({description: int, float or str}), naming the entry and each rank's value.

    On every call: a call whose shards differ in shape between ranks would otherwise post P2P
    transfers of different sizes, which gloo answers by aborting the process (SIGABRT) and NCCL
    by hanging. The entries travel as one small int64 tensor through an all_gather on the host
    (_host_group: gloo, so no CUDA stream is synchronised), ~14 numbers a call."""
    names = list(signature)
    mine = torch.tensor([_code(signature[n]) for n in names], dtype=torch.int64)
    host = _host_group(group)
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size(host))]
    dist.all_gather(everyone, mine, group=host)
    table = torch.stack(everyone)  # (world, entries)
    for i, name in enumerate(names):
        if bool((table[:, i] != table[0, i]).any()):
            values = [_decode(c, signature[name]) for c in table[:, i].tolist()]
            raise ArgumentError(f"{caller}: the ranks disagree on {name}: {values} by rank (every rank must "
                                f"hold an equal shard and pass the same options)")
