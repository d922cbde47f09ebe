#!/usr/bin/env bash
# `yrpd bench` on workloads nobody here wrote: vLLM's own prefix_repetition dataset, and chat conversations in the
# shape of vLLM's benchmarks/multi_turn, each through the same targets on the embedded default (SmolLM2, localhost).
# The reports docs/benchmarks.md quotes under "Workloads nobody here wrote" are this script's output.
#
#   benchmarks/field_workloads.sh OUT_DIR [TARGETS]
#
# Writes OUT_DIR/cpu-smollm2-{prefix-repetition,multi-turn}-{results.json,report.md,ttft_throughput.png}; every
# results.json carries its provenance (commit, CPU, the exact commands). Commit first: a run from a tree with changes
# says so. It deploys `yrpd deploy --hosts localhost` (a fresh session) and tears it down at the end.
set -euo pipefail
cd "$(dirname "$0")/.."
out="$(realpath -m "${1:?usage: benchmarks/field_workloads.sh OUT_DIR [TARGETS]}")"
targets="${2:-pd,pd-noreuse,single,single-yr,peer-lmcache,peer-nixl-pd}"
mkdir -p "$out"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
yrpd() { .venv/bin/python -m yrpd "$@"; }
# a request counts as good within 4 s to its first token and 250 ms a token after it (SmolLM2 on 2 cores: a
# 1.3 k-token prompt computed in full takes 2-4 s here)
slo="ttft:4000 tpot:250"

newest_run() {  # the bench directory `yrpd bench run` wrote last
    ls -td "${YRPD_HOME:-$HOME/.yrpd}"/sessions/*/bench/*/ | head -n 1
}
keep() {  # keep NAME: the newest run's report under OUT_DIR
    local run
    run="$(newest_run)"
    cp "$run/results.json" "$out/$1-results.json"
    cp "$run/report.md" "$out/$1-report.md"
    [ -f "$run/ttft_throughput.png" ] && cp "$run/ttft_throughput.png" "$out/$1.png"
    echo "kept $run as $out/$1-*" >&2
}

yrpd deploy --hosts localhost --new-session
# 16 prompts in 4 groups that share a 1,024-token prefix, each with its own 256-token suffix; 8 tokens each answer
status=0
yrpd bench run --targets "$targets" --vllm-dataset prefix_repetition \
    --vllm-dataset-args "--prefix-repetition-prefix-len 1024 --prefix-repetition-suffix-len 256 --prefix-repetition-num-prefixes 4 --prefix-repetition-output-len 8" \
    --num-prompts 16 --max-concurrency 2 --goodput "$slo" || status=$?
keep cpu-smollm2-prefix-repetition
# 4 conversations x 4 turns: a 512-token system prompt all share, a 256-token opening each, 64-token questions and
# 48-token answers kept in the history; 8 tokens asked each turn
yrpd bench dataset --workload multi-turn --conversations 4 --turns 4 --prefix-len 512 --suffix-len 256 \
    --question-len 64 --answer-len 48 --output-len 8 --out "$work/chat.jsonl"
yrpd bench run --targets "$targets" --dataset "$work/chat.jsonl" --max-concurrency 2 --goodput "$slo" || status=$?
keep cpu-smollm2-multi-turn
yrpd down
exit "$status"
