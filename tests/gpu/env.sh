# Sourced by the tests/gpu/*.sh scripts on the GPU machine (repo root): gpuwatch importable from
# this checkout, and CUPTI from the wheels in .whl/ (the machine reaches no registry; cupti-python
# 13.4 + nvidia-cuda-cupti 13.4.92 + cuda-pathfinder + pyelftools, from `pip download` here),
# when carried.
export PYTHONUNBUFFERED=1
export PATH="$PATH:/usr/local/cuda/bin"  # ncu, nvcc
shim=$(mktemp -d)/site; mkdir -p "$shim/gpuwatch"
for d in agent probes exporters detectors; do ln -s "$PWD/$d" "$shim/gpuwatch/$d"; done
cupti=$(mktemp -d)/cupti
if compgen -G '.whl/*.whl' >/dev/null; then
python3 - "$cupti" .whl/*.whl <<'PY'
import sys, zipfile
for w in sys.argv[2:]:
    zipfile.ZipFile(w).extractall(sys.argv[1])
PY
fi
export PYTHONPATH="$shim:$cupti${PYTHONPATH:+:$PYTHONPATH}"
# GPU.md: the 13.4 libcupti first, or the image's older one (torch's 13.0) is what gets loaded.
export LD_LIBRARY_PATH="$cupti/nvidia/cu13/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
gpu_env() {  # what the results were measured on
  date -u; nvidia-smi --query-gpu=name,driver_version,uuid --format=csv,noheader
  python3 -c 'import sys, torch, triton, importlib.metadata as m
def v(d):
    try: return m.version(d)
    except m.PackageNotFoundError: return "absent"
print(sys.version.split()[0], "torch", torch.__version__, "triton", triton.__version__, "cupti-python", v("cupti-python"), "nvidia-cuda-cupti", v("nvidia-cuda-cupti"))'
}
