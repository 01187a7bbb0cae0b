set -uo pipefail
shim=$(mktemp -d)/site; mkdir -p "$shim/gpuwatch"
for d in agent probes exporters detectors; do ln -s "$PWD/$d" "$shim/gpuwatch/$d"; done
source .gpu-bundle/activate.sh
LD_LIBRARY_PATH=$GW_BCC_LD_LIBRARY_PATH PYTHONPATH=$shim:$GW_BCC_PYTHONPATH python3 bench/ebpf_throughput.py --build-dir .gpu-build --threads 8 --calls 500000 --out "$OUT/throughput.json" 2>&1 | grep -v "cannot attach\|not present" | tail -8
LD_LIBRARY_PATH=$GW_BCC_LD_LIBRARY_PATH PYTHONPATH=$shim:$GW_BCC_PYTHONPATH python3 bench/ebpf_throughput.py --build-dir .gpu-build --threads 1 --calls 2000000 --out "$OUT/throughput1.json" 2>&1 | grep -v "cannot attach\|not present" | tail -7
