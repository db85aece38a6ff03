#!/usr/bin/env bash
# What bench/h200_session.sh needs carried to the GPU host, rebuilt in a fresh checkout (here, with the venv of
# `make install`): .whl (the fla-core wheel; the host has torch, triton and transformers but not fla-core) and
# .devcache (the Qwen tokenizer JSON: the host is offline and lacks the convert-time packages). Both are ignored.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .git/info
for path in /.whl/ /.devcache/; do grep -qxF "$path" .git/info/exclude 2>/dev/null || echo "$path" >> .git/info/exclude; done
ls .whl/fla_core-*.whl >/dev/null 2>&1 || python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d .whl "fla-core>=0.6,<0.7"
if [ ! -s .devcache/qwen3_6-tokenizer.json ]; then
  mkdir -p .devcache
  .venv/bin/python -c "from ninfer.artifact.qwen_tokenizer import build_qwen_tokenizer_json as b; import sys; sys.stdout.write(b())" \
    > .devcache/qwen3_6-tokenizer.json.partial
  mv .devcache/qwen3_6-tokenizer.json.partial .devcache/qwen3_6-tokenizer.json
fi
ls -l .whl/fla_core-*.whl .devcache/qwen3_6-tokenizer.json
