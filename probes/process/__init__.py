"""Host-side views of GPU processes: which Kubernetes pod and container a process belongs to."""
