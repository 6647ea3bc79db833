"""What an autograd graph saves for its backward and what a call allocates, for
the tests that bound memory (CPU: the profiler's allocation events; CUDA: the
caching allocator's peak)."""

import torch


def saved_sizes(fn):
    """fn's output and the element counts of the tensors its graph saves for backward."""
    sizes = []

    def pack(t):
        sizes.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sizes


def _cuda_peak(fn):
    torch.cuda.synchronize()
    start = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - start


def _cpu_events(fn):
    """fn's output and the CPU profiler's events, with their memory use."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                profile_memory=True) as prof:
        out = fn()
    return out, prof.events()


def largest_allocation(fn, device):
    """Bytes of the largest tensor allocated while fn runs (CUDA: the allocator's
    peak above its start, an upper bound)."""
    if device == "cuda":
        return _cuda_peak(fn)
    _, events = _cpu_events(fn)
    return max((e.cpu_memory_usage for e in events if e.cpu_memory_usage > 0), default=0)


def peak_bytes(fn, device):
    """Bytes allocated at the peak while fn runs, above what was allocated before."""
    if device == "cuda":
        return _cuda_peak(fn)
    _, events = _cpu_events(fn)
    # Each event's own net allocation (its children's are theirs): counted when
    # it starts if it allocated, when it ends if it freed (an op's temporaries
    # count until it returns).
    changes = []
    for e in events:
        delta = e.self_cpu_memory_usage
        if delta > 0:
            changes.append((e.time_range.start, 0, delta))
        elif delta < 0:
            changes.append((e.time_range.end, 1, delta))
    live = peak = 0
    for _, _, delta in sorted(changes):
        live += delta
        peak = max(peak, live)
    return peak


def cpu_allocated_bytes(fn):
    """fn's output and the bytes it allocated on the CPU in all (frees not subtracted)."""
    out, events = _cpu_events(fn)
    return out, sum(e.self_cpu_memory_usage for e in events if e.self_cpu_memory_usage > 0)


def cpu_allocations_at_least(fn, nbytes):
    """fn's output and how many single CPU allocations of at least nbytes it made."""
    out, events = _cpu_events(fn)
    return out, sum(1 for e in events if e.self_cpu_memory_usage >= nbytes)
