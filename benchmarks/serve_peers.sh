#!/usr/bin/env bash
# specport serve beside llama.cpp's llama-server, one server at a time on the same cores: the chat
# workload at fixed concurrency, a Poisson rate sweep, and a long prompt arriving while 4 streams decode.
#
#   bash scripts/build_llama_server.sh                  # once: ../peers/llama.cpp/build/bin
#   bash benchmarks/serve_peers.sh                      # ROUNDS=1, concurrency 1,4,16, no rate sweep
#   RATES=0.25,0.5,1 ROUNDS=2 bash benchmarks/serve_peers.sh
#   REQUESTS=16 ANSWER=64 STALL_ROUNDS=1 bash benchmarks/serve_peers.sh   # the 2026-12-05 page's run
#
# Per round and server (the servers alternate, specport first in odd rounds): start it, then
#  * the chat workload (python -m benchmarks.chat_workload: the 16 chat prompts in the artifact's chat
#    template, ANSWER tokens each, ignore_eos) at each concurrency of CONCURRENCY, REQUESTS requests
#    (`specport loadtest URL --prompts chat.jsonl --rate inf --max-concurrency C`);
#  * if RATES is set, the same prompts at those Poisson rates (`--rate RATES`);
#  * the long-prompt stall (python -m benchmarks.long_prompt_stall --url: 4 streams, then a
#    2,500-token prompt; STALL_ROUNDS runs);
# with `uptime` and the server process's CPU seconds (utime + stime) before and after each part.
# The levels repeat the same 16 prompts: both servers reuse a prompt's cached KV (specport's prefix
# cache, llama-server's slot prompt cache), as a chat service sees repeated system prompts.
# Writes $OUT/<server>-r<R>-*.json, $OUT/log.txt, the servers' logs, and $OUT/summary.md.
#
# llama-server serves the F32 GGUF (made here once with llama-quantize --allow-requantize from the
# Q4_1 GGUF in ../shared: ../shared/PEERS.md compares answers on F32), specport the fp32 export of the
# same file. Both take THREADS threads; llama-server gets SLOTS parallel slots of 4,096 tokens.
set -euo pipefail
cd "$(dirname "$0")/.."

Q41=${Q41:-../shared/models/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf}
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
OUT=${OUT:-serve-peers-$(date +%Y%m%d-%H%M%S)}
MODEL=model

die() { echo "serve_peers: $*" >&2; exit 1; }
[ -e "$OUT" ] && die "$OUT exists; give a new OUT="
[ -x "$LLAMA_BIN/llama-server" ] || die "no llama-server in $LLAMA_BIN (bash scripts/build_llama_server.sh)"
if [ ! -d "$ART" ]; then
    echo "serve_peers: exporting $Q41 to $ART (once)" >&2
    specport export "$Q41" --out "$ART"
fi
mkdir -p "$OUT"
if [ ! -f "$GGUF_F32" ]; then
    "$LLAMA_BIN/llama-quantize" --allow-requantize "$Q41" "$GGUF_F32" F32 >"$OUT/quantize.log" 2>&1 ||
        { tail -5 "$OUT/quantize.log"; die "llama-quantize failed (log $OUT/quantize.log)"; }
fi
exec > >(tee -a "$OUT/log.txt") 2>&1
python -m benchmarks.chat_workload "$ART" "$OUT/chat.jsonl" --max-tokens "$ANSWER"
{
    echo "date: $(date -Is)"
    echo "specport commit: $(git rev-parse --short HEAD) ($(git status --porcelain | wc -l) changed paths)"
    echo "artifact: $ART; llama-server: $LLAMA_BIN/llama-server on $GGUF_F32 ($("$LLAMA_BIN/llama-server" --version 2>&1 | grep -m1 version || true))"
    echo "rounds $ROUNDS; concurrency $CONCURRENCY x $REQUESTS requests x $ANSWER tokens; rates '${RATES}'; threads $THREADS; slots $SLOTS"
    echo "cpu: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2)"
    echo "flags: $(grep -m1 '^flags' /proc/cpuinfo | grep -o -w -E 'avx2|avx512f|avx512_vnni|avx512_bf16|amx_tile|amx_int8|amx_bf16' | tr '\n' ' ')"
} | tee "$OUT/meta.txt"

free_port() { python -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
cpu_s() { awk '{printf "%.2f", ($14 + $15) / '"$(getconf CLK_TCK)"'}' "/proc/$PID/stat"; }

PID=""
stop_server() {
    [ -n "$PID" ] || return 0
    kill -TERM "$PID" 2>/dev/null || true
    for _ in $(seq 60); do kill -0 "$PID" 2>/dev/null || break; sleep 1; done
    kill -KILL "$PID" 2>/dev/null || true
    wait "$PID" 2>/dev/null || true
    PID=""
}
trap stop_server EXIT

start_server() {  # $1 server, $2 port, $3 log
    case $1 in
    specport)
        # shellcheck disable=SC2086
        specport serve "$ART" --host 127.0.0.1 --port "$2" --threads "$THREADS" \
            --model-name "$MODEL" --no-access-log -q $SPECPORT_ARGS >"$3" 2>&1 &
        ;;
    llama.cpp)
        "$LLAMA_BIN/llama-server" -m "$GGUF_F32" --host 127.0.0.1 --port "$2" -t "$THREADS" \
            -tb "$THREADS" -np "$SLOTS" -c $((SLOTS * 4096)) -cb --alias "$MODEL" >"$3" 2>&1 &
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

part() {  # $1 name, $2 json file, then the command; logs load and the server's CPU seconds around it
    local name=$1 file=$2; shift 2
    local c0; c0=$(cpu_s)
    echo "-- $name; uptime before: $(uptime)"
    "$@" >"$file"
    echo "-- $name; uptime after: $(uptime); server cpu s: $(python -c "print(round($(cpu_s) - $c0, 2))")"
}

for round in $(seq "$ROUNDS"); do
    order=$SERVERS
    [ $((round % 2)) -eq 0 ] && order=$(echo "$SERVERS" | tr ' ' '\n' | tac | tr '\n' ' ')
    for server in $order; do
        port=$(free_port)
        url="http://127.0.0.1:$port"
        echo "== round $round $server (port $port)"
        start_server "$server" "$port" "$OUT/$server-r$round.log"
        for c in ${CONCURRENCY//,/ }; do
            part "$server c=$c" "$OUT/$server-r$round-c$c.json" specport loadtest "$url" --model "$MODEL" \
                --prompts "$OUT/chat.jsonl" --rate inf --max-concurrency "$c" --requests "$REQUESTS" --json -q
        done
        if [ -n "$RATES" ]; then
            part "$server rates $RATES" "$OUT/$server-r$round-rates.json" specport loadtest "$url" \
                --model "$MODEL" --prompts "$OUT/chat.jsonl" --rate "$RATES" --requests "$REQUESTS" --json -q
        fi
        part "$server stall" "$OUT/$server-r$round-stall.json" python -m benchmarks.long_prompt_stall \
            "$MODEL" --url "$url" --rounds "$STALL_ROUNDS" --json
        stop_server
    done
done
python -m benchmarks.serve_peers_report "$OUT" | tee "$OUT/summary.md"
