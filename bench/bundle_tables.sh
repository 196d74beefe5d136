#!/usr/bin/env bash
# Re-run, in one sweep, every BENCHMARKS.md table that depends on the shipped bundle (bundles/ua-gec,
# or $SPECDEC_BUNDLE), each with the command its section names, and write them (--write). Run it when
# the bundle changes, on a quiet machine: the tables are compared with each other and with README's
# headline, so they must come from one bundle, one host and one day.
#
#   bench/bundle_tables.sh [LOG_DIR]        (default LOG_DIR: runs/bundle-tables; one log per table)
#
# Resumable: a table that finished for this very bundle (LOG_DIR/NAME.done holds the bundle's file
# hashes) is skipped, so a sweep cut short (the larger verifier's sweep outlasts one sitting) goes
# on where it stopped; delete LOG_DIR or its .done files to re-run everything.
#
# The tables of random or tiny models (bench_backends, bench_head, bench_block_cost, bench_services
# without --bundle) do not depend on the bundle and are not re-run here.
set -euo pipefail
cd "$(dirname "$0")/.."

logs=${1:-runs/bundle-tables}
mkdir -p "$logs"
bundle=${SPECDEC_BUNDLE:-bundles/ua-gec}

started=$SECONDS
# The bundle's identity: the hashes of its own files (weights, tokenizer, config, card), not of the
# onnx/ and ct2/ caches the benchmarks write beside them.
fingerprint=$(cd "$bundle" && find . -maxdepth 1 -type f -print0 | sort -z | xargs -0 sha256sum | sha256sum | cut -d' ' -f1)
# Each command as its BENCHMARKS.md section states it; its output goes to LOG_DIR/NAME.log.
table() {
  local name=$1 t0=$SECONDS
  shift
  if [ "$(cat "$logs/$name.done" 2>/dev/null)" = "$fingerprint" ]; then
    echo "== $name: done for this bundle (in an earlier sweep); skipped"
    return
  fi
  echo "== $name: $*"
  "$@" > "$logs/$name.log" 2>&1 || { echo "$name failed; see $logs/$name.log" >&2; exit 1; }
  echo "$fingerprint" > "$logs/$name.done"
  echo "   $((SECONDS - t0)) s"
}
table ua_gec specdec bench --bundle "$bundle" --through both --write
table services python bench/bench_services.py --bundle "$bundle" --sentences 24 --max-new-tokens 200 --repeats 5 --write
table gad_backends python bench/bench_gad_backends.py --bundle "$bundle" --sample 200 --write
table round_trip python bench/bench_round_trip.py --bundle "$bundle" --write
table int8 python bench/bench_int8.py --bundle "$bundle" --write
table ctranslate2 python bench/bench_ctranslate2.py --bundle "$bundle" --sample 300 --threads 2 --write
table overlap python bench/bench_overlap.py --bundle "$bundle" --sentences 150 --rounds 2 --write
table transport python bench/bench_transport.py --bundle "$bundle" --sentences 30 --rounds 3 --write
table load python bench/bench_load.py --bundle "$bundle" --sentences 128 \
  --extra-mode 'GAD k=10 adaptive:mode=gad,k=10,adaptive=true' --write
table load_agreement python bench/bench_load_agreement.py --bundle "$bundle" --write
table adaptive_load python bench/bench_adaptive_load.py --bundle "$bundle" --rounds 5 --extra-mode 'GAD k=4:mode=gad,k=4' --write
echo "all tables in $((SECONDS - started)) s; logs in $logs"
