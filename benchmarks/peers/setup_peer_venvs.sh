#!/usr/bin/env bash
# The two peer environments of eap_peer.py, outside headlab's venv. torch is installed first and pinned
# (-c) so that nothing pulls another (CUDA) build.
set -euo pipefail
PY=${PY:-python3.11}
PIN=$(mktemp); echo "torch==2.13.0" > "$PIN"
# TransformerLens 4.3 (TransformerBridge + tools.analysis.attribution_patching)
$PY -m venv /work/peer-venv
/work/peer-venv/bin/pip install -q torch==2.13.0
/work/peer-venv/bin/pip install -q -c "$PIN" transformer-lens==4.3.0
# auto-circuit 1.0.1 needs the legacy HookedTransformer (removed in TL 4.0), hence TL 2.16.1 + transformers 4;
# numpy<2 (TL 2.x) wants pyarrow 21, datasets wants >=21; attrs is an undeclared dependency of auto-circuit
$PY -m venv /work/peer-venv-ac
/work/peer-venv-ac/bin/pip install -q torch==2.13.0
/work/peer-venv-ac/bin/pip install -q -c "$PIN" transformer-lens==2.16.1 auto-circuit==1.0.1 attrs "transformers<5" "pyarrow>=21,<22"
rm -f "$PIN"
