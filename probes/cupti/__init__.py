"""CUPTI: what the GPU did. Two halves, because CUPTI activity works only inside the process it
measures: the in-process agent (`gpuwatch run -- CMD`, or `import gpuwatch.probes.cupti.inprocess`)
records kernel, copy and set activity and the allocator's bytes and reports them to the daemon;
the daemon samples device-wide counters (achieved occupancy, cache hit ratios, DRAM throughput)
through PM sampling in a supervised child process.
"""
