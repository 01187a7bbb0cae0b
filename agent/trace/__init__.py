"""`gpuwatch trace --pid PID`: attach the eBPF CUDA probe to one running process and watch it live.

Two ways to get at the process's CUDA calls:
  * standalone, for root (or CAP_BPF and CAP_PERFMON): compile the probe and attach uprobes here;
  * through the gpuwatch agent, for everyone else: the agent's system-wide probe already counts
    every process's calls, and its control socket (trace.snapshot) hands a caller the counts of
    a process the caller owns. The agent's counters run from when it first saw the process, so
    every refresh is reported minus the snapshot taken at the start (since()).

The pieces, so that tests can use them without a terminal:
  * pids: check_pid() / validate(): every check made before anything is compiled, each
    failure a TraceError (errors) whose message says what is wrong and what to do; alive() and
    pid_reused(): is it still the same process;
  * summary: percentile(), summarize(), rates(): pure functions from probe snapshots
    (EbpfCudaProbe.snapshot(pid)) to the JSON summary; since(): the agent's snapshots, counted
    from the start of the trace;
  * render: render_live(), render_line(), render_summary(): what is printed;
  * output: the checked output paths, the Chrome/Perfetto trace and the OTLP spans written at the end;
  * session: AgentTrace (the agent's probe through its socket), GpuKernels, and run_trace():
    compile and attach (or ask the agent), refresh every `interval` seconds until the duration is
    up, Ctrl-C/SIGTERM, or the process exits (or its PID is reused), then print the summary.

Latency percentiles come from the probe's log2 histogram: slot s counts calls that took
[2**(s-1), 2**s) ns, so p50/p99 are reported as the upper edge of a power-of-two bucket; the true
value lies between half of it and it.
"""
