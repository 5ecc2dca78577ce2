# Sourced by the serving benchmarks (serve_peers.sh, serve_vs_vllm.sh): a free port, and
# stopping the running server's whole process group (vLLM serves from worker processes) on
# the next start and on exit. The caller starts a server with `setsid ... &` and sets PID=$!.
# The shared data folder: specport's one setting for it (SPECPORT_SHARED, else beside the checkout).
SHARED=$(python -c 'from specport.core.settings import shared_dir; print(shared_dir())')

free_port() { python -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

PID=""
stop_server() {
    [ -n "$PID" ] || return 0
    kill -TERM -- "-$PID" 2>/dev/null || true
    for _ in $(seq 60); do kill -0 "$PID" 2>/dev/null || break; sleep 1; done
    kill -KILL -- "-$PID" 2>/dev/null || true
    wait "$PID" 2>/dev/null || true
    PID=""
}
trap stop_server EXIT
