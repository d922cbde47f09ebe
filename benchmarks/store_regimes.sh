#!/usr/bin/env bash
# Issue 47's preset: the data system as a prefix store in both regimes, every store target side by side in one
# `yrpd bench run` per regime, each target measured 3 times (medians, [min, max]) in rounds (`--interleave`: every
# target's first run, then every target's second, ...), so the machine's drift over a run lands on every target.
#
#   benchmarks/store_regimes.sh OUT_DIR [TARGETS] [REGIMES]
#
# TARGETS: default single,single-yr,peer-lmcache,pd,pd-noreuse. REGIMES: default "roomy overflow":
#   roomy     vLLM's own KV pool (nothing overflows): what a store costs where it gives nothing back;
#   overflow  the single instance's pool cut to 96 MB (`--kv-cache-mb 48`: a single instance gets a PD pair's two): a
#             chat's history no longer fits, so only a store beyond the pool keeps the reuse. The PD targets are left
#             out here: their instances would get 48 MB each, less than one 2,048-token sequence of SmolLM2 in
#             float32 (90 MB), which vLLM refuses; pd / pd-noreuse is the roomy regime's. `single-roomy` runs
#             beside them: the plain instance with vLLM's own pool, the reuse no store beats, so single-roomy /
#             single in the same run is the floor of single-yr / single.
# The workload is one for both: 8 chats x 4 turns (a 512-token system prompt all share, a 256-token opening each,
# 64-token questions, 48-token answers kept in the history: prompts of 832-1,168 tokens), 16 tokens asked each turn,
# 2 at a time. The deployment is `yrpd deploy --hosts localhost` (SmolLM2) with --max-model-len 2048, which a 96 MB
# pool needs (vLLM wants one whole sequence in it). CONNECTOR='{"key": value}' deploys with those connector settings
# (docs/dev/connector.md), e.g. '{"resave_after_s": 0}' for the behaviour before blocks saved lately were skipped.
#
# Writes OUT_DIR/<regime>-{results.json,report.md,ttft_throughput.png}; every results.json carries its provenance
# (commit, CPU, the exact commands). Commit first. Tears the deployment down at the end.
set -euo pipefail
cd "$(dirname "$0")/.."
out="$(realpath -m "${1:?usage: benchmarks/store_regimes.sh OUT_DIR [TARGETS] [REGIMES]}")"
targets="${2:-single,single-yr,peer-lmcache,pd,pd-noreuse}"
regimes="${3:-roomy overflow}"
mkdir -p "$out"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
yrpd() { .venv/bin/python -m yrpd "$@"; }

{
    echo 'engine_args: ["--max-model-len", "2048"]'
    echo "connector: ${CONNECTOR:-{\}}"
} > "$work/yrpd.yaml"
yrpd deploy --hosts localhost --new-session --config "$work/yrpd.yaml"
status=0
for regime in $regimes; do
    case "$regime" in
        roomy) pool=(); run_targets="$targets" ;;
        overflow) pool=(--kv-cache-mb 48)
                  run_targets="$(tr , '\n' <<<"$targets" | { grep -v '^pd' || true; } | paste -sd, -)"
                  [ -n "$run_targets" ] || { echo "overflow: no single-instance target in $targets" >&2; continue; }
                  grep -qx single-roomy <<<"${run_targets//,/$'\n'}" || run_targets+=,single-roomy ;;
        *) echo "unknown regime $regime: roomy or overflow" >&2; exit 2 ;;
    esac
    yrpd bench run --targets "$run_targets" --workload multi-turn --conversations 8 --turns 4 --prefix-len 512 \
        --suffix-len 256 --question-len 64 --answer-len 48 --output-len 16 --max-concurrency 2 --repeat 3 --interleave \
        "${pool[@]}" || status=$?
    run="$(ls -td "${YRPD_HOME:-$HOME/.yrpd}"/sessions/*/bench/*/ | head -n 1)"
    for f in results.json report.md; do cp "$run/$f" "$out/$regime-$f"; done
    [ -f "$run/ttft_throughput.png" ] && cp "$run/ttft_throughput.png" "$out/$regime.png"
    echo "kept $run as $out/$regime-*" >&2
done
yrpd down
exit "$status"
