"""gpuwatch agent: daemon core, configuration, store, control socket and CLI."""
__version__ = "0.1.0"
