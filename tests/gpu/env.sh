# Sourced by the tests/gpu/*.sh scripts on the GPU machine (repo root): gpuwatch importable from
# this checkout, and CUPTI from the wheels in .whl/ (the machine reaches no registry; cupti-python
# 13.4 + nvidia-cuda-cupti 13.4.92 + cuda-pathfinder + pyelftools, from `pip download` here).
export PYTHONUNBUFFERED=1
export PATH="$PATH:/usr/local/cuda/bin"  # ncu, nvcc
shim=$(mktemp -d)/site; mkdir -p "$shim/gpuwatch"
for d in agent probes exporters detectors; do ln -s "$PWD/$d" "$shim/gpuwatch/$d"; done
cupti=$(mktemp -d)/cupti
python3 - "$cupti" .whl/*.whl <<'PY'
import sys, zipfile
for w in sys.argv[2:]:
    zipfile.ZipFile(w).extractall(sys.argv[1])
PY
export PYTHONPATH="$shim:$cupti${PYTHONPATH:+:$PYTHONPATH}"
# GPU.md: the 13.4 libcupti first, or the image's older one (torch's 13.0) is what gets loaded.
export LD_LIBRARY_PATH="$cupti/nvidia/cu13/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
gpu_env() {  # what the results were measured on
  date -u; nvidia-smi --query-gpu=name,driver_version,uuid --format=csv,noheader
  python3 -c 'import sys, torch, importlib.metadata as m; print(sys.version.split()[0], "torch", torch.__version__, "cupti-python", m.version("cupti-python"), "nvidia-cuda-cupti", m.version("nvidia-cuda-cupti"))'
}
