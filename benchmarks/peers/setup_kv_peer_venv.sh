#!/usr/bin/env bash
# The environment of kv_peer.py --side peer, outside headlab's venv: transformers' own QuantizedCache (optimum-quanto
# and HQQ backends) and NVIDIA's kvpress. torch is installed first and, with transformers, pinned (-c) so that
# nothing pulls another (CUDA) build or another transformers. pip resolved optimum-quanto 0.2.7, hqq 0.2.8.post1 and
# kvpress 0.5.2 (which asks for transformers>=4.56) under these pins; kvpress 0.5.2's hook reads the attention's
# `past_key_values` and `cache_position` keyword arguments, which transformers 5.25 renamed to `cache` and dropped:
# kv_peer.py passes them to it (kvpress_shim), nothing is patched on disk.
set -euo pipefail
PY=${PY:-python3.11}
VENV=${VENV:-/work/peer-venv-kv}
PIN=$(mktemp); printf 'torch==2.13.0\ntransformers==5.25.0\n' > "$PIN"
$PY -m venv "$VENV"
"$VENV/bin/pip" install -q torch==2.13.0
"$VENV/bin/pip" install -q -c "$PIN" transformers==5.25.0 optimum-quanto hqq kvpress
"$VENV/bin/pip" check
rm -f "$PIN"
