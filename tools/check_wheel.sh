#!/usr/bin/env bash
# Builds moeroute's wheel, installs it into a fresh venv outside the checkout and runs the demo
# and one routing call from it: the package as a user gets it (kernels shipped as package data).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
TORCH_PIN=${TORCH_PIN:-torch==2.13.0}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$PYTHON" -m pip wheel -q --no-deps -w "$work/dist" .
wheel=$(ls "$work"/dist/moeroute-*.whl)
"$PYTHON" -m zipfile -l "$wheel" > "$work/files"
for needed in 'moeroute/gpu/kernels/.*\.cu ' 'moeroute/gpu/kernels/.*\.hip ' 'moeroute/py.typed ' 'licenses/LICENSE '; do
    grep -q "$needed" "$work/files" || { echo "the wheel lacks $needed"; exit 1; }
done
"$PYTHON" -m venv "$work/venv"
"$work/venv/bin/python" -m pip install -q "$TORCH_PIN"
"$work/venv/bin/python" -m pip install -q "$wheel[torch]"
cd "$work"    # away from the checkout: only the installed package can be imported
"$work/venv/bin/moeroute" --version
"$work/venv/bin/moeroute" demo
"$work/venv/bin/python" - <<'PY'
import numpy as np
import moeroute
assert "site-packages" in moeroute.__file__, moeroute.__file__
config = moeroute.RouterConfig(num_experts=16, top_k=2)
logits = np.arange(4 * 16, dtype=np.float32).reshape(4, 16) % 7
weights, ids = moeroute.select_experts(logits, config)
expected = np.argsort(-logits, axis=1, kind="stable")[:, :2]
assert np.array_equal(ids, expected), (ids, expected)
scores = np.exp(logits - logits.max(1, keepdims=True)); scores /= scores.sum(1, keepdims=True)
top = np.take_along_axis(scores, expected, 1)
assert np.allclose(weights, top / (top.sum(1, keepdims=True) + 1e-20), rtol=1e-6), weights
print("installed wheel: routing matches the reference")
PY
echo "wheel check passed: $(basename "$wheel")"
