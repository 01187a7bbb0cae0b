"""CUPTI: what the GPU did. Two halves, because CUPTI activity works only inside the process it
measures: the in-process agent (`gpuwatch run -- CMD`, or `import gpuwatch.probes.cupti.inprocess`)
records kernel, copy and set activity and the allocator's bytes and reports them to the daemon;
the daemon samples device-wide counters (achieved occupancy, cache hit ratios, DRAM throughput)
through PM sampling in a supervised child process.
"""

# The oldest CUPTI worth running: 13.0 decoded a kernel record in ~116 µs, 13.4 in ~1.4 µs (H200).
MIN_CUPTI = (13, 4)


def version_tuple(text: str) -> tuple[int, ...]:
    """"13.4.92" -> (13, 4, 92); stops at the first part that does not start with a digit."""
    import re

    out = []
    for part in (text or "").split("."):
        digits = re.match(r"\d+", part)
        if not digits:
            break
        out.append(int(digits.group()))
    return tuple(out)
