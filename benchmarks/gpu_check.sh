#!/usr/bin/env bash
# GPU check of lit_slowcal on one CUDA device, in under 9 minutes; prints the figures at the end.
#
#   benchmarks/gpu_check.sh            (from anywhere; it runs in the repository root)
#   PY=/path/to/python benchmarks/gpu_check.sh
#
# Steps, each bounded by `timeout` (the sum of the limits stays under 9 minutes):
#   device   nvidia-smi, torch and CUDA versions; fails unless torch.cuda.is_available()
#   (a)      pytest -m cuda tests/test_cuda.py: the CUDA tests must run (none skipped) and pass;
#            their figures (largest differences to the CPU, ...) come from the JUnit XML
#   (b)      the main job on the GPU, timed, with its summary, next to the same job on the CPU (run here too)
#   (c)      2 processes sharing the GPU == 1 process (examples/torch_loop.py, gloo): run by (a)'s
#            test_plain_torch_loop_* tests; the summary prints their figures
#   (d)      benchmarks/bench_local_training.py --device cuda (Lightning against a minimal loop)
#   (e)      the paper grid (sweeps/paper.yaml, 135 runs) with the README's sweep command, as configured
#            but on the GPU (--trainer.accelerator=gpu added to its command): its wall time, and its
#            records against the CPU's stored ones (sweeps/results/paper.jsonl)
#   (f)      benchmarks/bench_sync.py --sizes 1M,10M on this machine's CPUs (2 gloo processes): one
#            synchronisation against one all-reduce of the same bytes, on a quieter host than CI's
# Exit status 0 only if every step passed. Needs no network. PY: the Python to use (default the
# repository's .venv, else python3); T_DEVICE, T_TESTS, T_MAIN, T_BENCH, T_GRID, T_SYNC: the steps' limits in seconds;
# KEEP_LOGS: a folder to keep the whole logs in.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
if [ -z "${PY:-}" ] && [ ! -x .venv/bin/python ]; then
    echo "note: .venv/bin/python not found; using python3 (set PY to choose)"
    PY=python3
fi
PY=${PY:-.venv/bin/python}
# lit_slowcal from this checkout, also where it is not installed into $PY's environment (the
# subprocesses, e.g. examples/torch_loop.py, inherit it).
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# Seconds per step, nvidia-smi's 10 included: 10 + 20 + 120 + 2 x 40 + 100 + 130 + 60 = 520 < 540. Seen on an
# H100 (16 CPUs): device 7 s, tests 65-82 s, main job 18-22 s, benchmark 56-74 s; 151-194 s in all
# before (e); (e) 83-85 s on an H100 and an H200.
T_DEVICE=${T_DEVICE:-20}
T_TESTS=${T_TESTS:-120}
T_MAIN=${T_MAIN:-40}
T_BENCH=${T_BENCH:-100}
T_GRID=${T_GRID:-130}
T_SYNC=${T_SYNC:-60}

WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX")
# KEEP_LOGS=DIR: copy the steps' whole logs (and the JUnit XML) there at the end.
finish() {
    if [ -n "${KEEP_LOGS:-}" ]; then
        mkdir -p "$KEEP_LOGS" && cp "$WORK"/*.txt "$WORK"/*.xml "$KEEP_LOGS"/ 2>/dev/null || true
    fi
    rm -rf "$WORK"
}
trap finish EXIT
T0=$SECONDS
FAILED=()
section() { echo; echo "=== $* [t=$((SECONDS - T0)) s]"; }
# run NAME LIMIT LOG CMD...: runs CMD under `timeout LIMIT`, output to LOG; records a failure, never exits.
run() {
    local name=$1 limit=$2 log=$3 rc=0
    shift 3
    timeout --kill-after=10 "$limit" "$@" >"$log" 2>&1 || rc=$?
    if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
        FAILED+=("$name (timed out after ${limit} s)")
    elif [ "$rc" -ne 0 ]; then
        FAILED+=("$name (exit status $rc)")
    fi
    return 0
}

section "device"
if command -v nvidia-smi >/dev/null; then
    timeout 10 nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv,noheader \
        || echo "nvidia-smi failed"
else
    echo "nvidia-smi not found"
fi
run device "$T_DEVICE" "$WORK/device.txt" "$PY" - <<'EOF'
import sys

import torch

print(f"python {sys.version.split()[0]}, torch {torch.__version__}, CUDA build {torch.version.cuda}, "
      f"cuDNN {torch.backends.cudnn.version()}, torch.cuda.is_available() {torch.cuda.is_available()}")
if not torch.cuda.is_available():
    sys.exit("FAIL: torch.cuda.is_available() is False: the CUDA tests would only be skipped")
p = torch.cuda.get_device_properties(0)
print(f"cuda:0 {p.name}, {p.total_memory / 2**30:.1f} GiB, compute capability {p.major}.{p.minor}, "
      f"{torch.cuda.device_count()} device(s), {p.multi_processor_count} SMs")
x = torch.randn(1024, 1024, device="cuda", dtype=torch.float64)
print(f"smoke: float64 matmul on the GPU vs the CPU, max |diff| {((x @ x).cpu() - x.cpu() @ x.cpu()).abs().max().item():.1e}")
EOF
cat "$WORK/device.txt"
DEVICE=$(grep '^cuda:0' "$WORK/device.txt" | cut -d, -f1 | cut -c8- || true)
if [ ${#FAILED[@]} -ne 0 ]; then
    echo "GPU check FAILED: no usable CUDA device (${FAILED[*]})"
    exit 1
fi

section "(a) pytest -m cuda tests/test_cuda.py"
run "(a) CUDA tests" "$T_TESTS" "$WORK/pytest.txt" \
    "$PY" -m pytest -q -m cuda tests/test_cuda.py -p no:cacheprovider --tb=short --show-capture=no \
    --durations=5 -o junit_family=xunit1 --junitxml="$WORK/cuda.xml"
tail -n 60 "$WORK/pytest.txt"

section "(b) the main job on the GPU"
run "(b) main job" "$T_MAIN" "$WORK/main.txt" bash -c \
    'TIMEFORMAT="wall %R s (user %U s, sys %S s)"; time "$@"' _ \
    "$PY" -m lit_slowcal fit --config configs/slowcal.yaml --wandb=false --trainer.accelerator=gpu \
    --trainer.enable_progress_bar=false --run_dir "$WORK/runs"
run "(b) main job on the CPU" "$T_MAIN" "$WORK/main_cpu.txt" bash -c \
    'TIMEFORMAT="wall %R s (user %U s, sys %S s)"; time "$@"' _ \
    "$PY" -m lit_slowcal fit --config configs/slowcal.yaml --wandb=false --trainer.accelerator=cpu \
    --trainer.enable_progress_bar=false --run_dir "$WORK/runs_cpu"
for log in main main_cpu; do
    if grep -q "lit_slowcal summary" "$WORK/$log.txt"; then
        sed -n '/lit_slowcal summary/,/wall time/p' "$WORK/$log.txt"
        grep '^wall ' "$WORK/$log.txt" || true
    else
        tail -n 30 "$WORK/$log.txt"
        FAILED+=("(b) $log (no summary)")
    fi
done

section "(d) benchmarks/bench_local_training.py --device cuda"
run "(d) training benchmark" "$T_BENCH" "$WORK/bench.txt" \
    "$PY" benchmarks/bench_local_training.py --device cuda --repeats 3 --large-machines 1024 --large-local-steps 16
tail -n 25 "$WORK/bench.txt"

section "(e) the paper grid on the GPU, the README's sweep command"
"$PY" - "$WORK" <<'EOF'
import sys, yaml
spec = yaml.safe_load(open("sweeps/paper.yaml"))
spec["command"] += ["--trainer.accelerator=gpu", f"--run_dir={sys.argv[1]}/grid_runs"]
yaml.safe_dump(spec, open(f"{sys.argv[1]}/paper_gpu.yaml", "w"), sort_keys=False)
EOF
run "(e) paper grid" "$T_GRID" "$WORK/grid.txt" bash -c 'TIMEFORMAT="wall %R s (user %U s, sys %S s)"; time "$@"' _ \
    "$PY" -m lit_slowcal sweep "$WORK/paper_gpu.yaml" --wandb=false --results "$WORK/paper_gpu.jsonl"
grep -E "^(stacking|workers|[0-9]+ trials in|[0-9]+ finished|wall )" "$WORK/grid.txt" || tail -n 20 "$WORK/grid.txt"

section "(f) benchmarks/bench_sync.py on this machine's CPUs"
run "(f) sync benchmark" "$T_SYNC" "$WORK/sync.txt" "$PY" benchmarks/bench_sync.py --sizes 1M,10M --reps 40
tail -n 4 "$WORK/sync.txt"

section "summary"
rc=0
"$PY" - "$WORK" "$DEVICE" "${FAILED[@]+"${FAILED[@]}"}" <<'EOF' || rc=$?
import os
import re
import sys
import xml.etree.ElementTree as ET

work, device, failed = sys.argv[1], sys.argv[2], sys.argv[3:]
print(f"device {device}")
for line in open(os.path.join(work, "device.txt")):
    if line.startswith("python "):
        print("  " + line.strip())

xml = os.path.join(work, "cuda.xml")
cases = []
if os.path.exists(xml):
    suite = ET.parse(xml).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    print(f"(a) CUDA tests: {suite.get('tests')} run, {suite.get('failures')} failed, {suite.get('errors')} errors, "
          f"{suite.get('skipped')} skipped, {float(suite.get('time')):.1f} s")
    if suite.get("tests") in (None, "0") or suite.get("skipped") not in (None, "0"):
        failed.append("(a) CUDA tests did not all run")
    for case in suite.iter("testcase"):
        outcome = "FAIL" if case.find("failure") is not None or case.find("error") is not None else (
            "SKIP" if case.find("skipped") is not None else "ok")
        props = {p.get("name"): p.get("value") for p in case.iter("property")}
        cases.append((case.get("name"), outcome, float(case.get("time", 0)), props))
        figures = "  ".join(f"{k}={v}" for k, v in props.items())
        print(f"  {outcome:4s} {float(case.get('time', 0)):5.1f} s  {case.get('name')}  {figures}")
else:
    print("(a) CUDA tests: no JUnit XML (the run did not finish)")

def job(name):
    path = os.path.join(work, name)
    text = open(path).read() if os.path.exists(path) else ""
    acc = re.search(r"final test accuracy (\S+)\s+test loss (\S+)", text)
    wall = re.search(r"^wall (\S+) s", text, re.M)
    return (float(acc[1]), float(acc[2])) if acc else None, wall[1] if wall else "?"

(gpu, gpu_wall), (cpu, cpu_wall) = job("main.txt"), job("main_cpu.txt")
if gpu and cpu:
    print(f"(b) main job: GPU test accuracy {gpu[0]:.4f} loss {gpu[1]:.4f} (wall {gpu_wall} s); CPU {cpu[0]:.4f} / "
          f"{cpu[1]:.4f} (wall {cpu_wall} s); |diff| {abs(gpu[0] - cpu[0]):.4f} / {abs(gpu[1] - cpu[1]):.4f} (tolerance 0.003 / 0.01)")
    if abs(gpu[0] - cpu[0]) > 0.003 or abs(gpu[1] - cpu[1]) > 0.01:
        failed.append("(b) main job on the GPU off the CPU figures")
else:
    print(f"(b) main job: no summary on the {'GPU' if not gpu else 'CPU'}")

loops = [c for c in cases if c[0].startswith("test_plain_torch_loop")]
for name, outcome, _, props in loops:
    print(f"(c) {name[name.find('['):]} 2 processes vs 1 on the GPU (M=4): {outcome}, "
          f"max |diff| {props.get('max_abs_diff_P2_P1', '?')} (tolerance 1e-6), wall P=1 {props.get('wall_s_P1', '?')} s, "
          f"P=2 {props.get('wall_s_P2', '?')} s")
if not loops:
    print("(c) no result")

bench = open(os.path.join(work, "bench.txt")).read() if os.path.exists(os.path.join(work, "bench.txt")) else ""
keep = ("M=", "  minimal loop (autograd) ", "  Lightning, training epoch ", "Lightning / minimal (autograd)",
        "peak GPU memory", "cross-check", "  peak GPU memory", "  Lightning, training epoch, second")
lines = [l for l in bench.splitlines() if l.startswith(keep)]
print("(d) training benchmark (--device cuda):" if lines else "(d) training benchmark: no figures")
for line in lines:
    print("  " + line.strip()[:220])
if "DIFFERENT" in bench:
    failed.append("(d) Lightning and the minimal loop disagree on the GPU")

import json
def records(path):
    return {json.dumps(r["params"], sort_keys=True): r for r in map(json.loads, open(path))} if os.path.exists(path) else {}
gpu_grid, cpu_grid = records(os.path.join(work, "paper_gpu.jsonl")), records("sweeps/results/paper.jsonl")
grid_text = open(os.path.join(work, "grid.txt")).read() if os.path.exists(os.path.join(work, "grid.txt")) else ""
grid_wall = re.search(r"^wall (\S+) s", grid_text, re.M)
finished = sum(r["status"] == "finished" for r in gpu_grid.values())
common = [k for k in gpu_grid if k in cpu_grid and gpu_grid[k]["status"] == "finished"]
def rel(name):
    pairs = [(gpu_grid[k]["metrics"].get(name), cpu_grid[k]["metrics"].get(name)) for k in common]
    pairs = [(a, b) for a, b in pairs if a is not None and b is not None]
    return max((abs(a - b) / abs(b) for a, b in pairs), default=float("nan"))
same_acc = sum(gpu_grid[k]["metrics"].get("test_acc") == cpu_grid[k]["metrics"].get("test_acc") for k in common)
print(f"(e) paper grid on the GPU: {finished}/{len(gpu_grid)} finished, wall {grid_wall[1] if grid_wall else '?'} s (the whole command); "
      f"against the CPU's stored records: test_acc equal in {same_acc}/{len(common)}, largest relative difference "
      + ", ".join(f"{n} {rel(n):.1e}" for n in ("test_acc", "test_loss", "train_objective")))
if finished != 135:
    failed.append("(e) the paper grid did not finish every run")

sync = open(os.path.join(work, "sync.txt")).read() if os.path.exists(os.path.join(work, "sync.txt")) else ""
rows = [l for l in sync.splitlines() if "<= 1.1x" in l]
print("(f) one sync vs one all-reduce of the same bytes, this machine's CPUs (bench_sync.py):" if rows else "(f) sync benchmark: no figures")
for line in [l for l in sync.splitlines() if l.lstrip().startswith("parameters")] + rows:
    print("  " + line.rstrip()[:260])

print("GPU check " + ("PASSED" if not failed else "FAILED: " + "; ".join(failed)))
sys.exit(1 if failed else 0)
EOF
echo "total wall $((SECONDS - T0)) s"
exit $rc
