#!/usr/bin/env bash
# scripts/check_layers.py, the build step that keeps the layers one-way: the sources as they are
# pass; a copy of them with an upward include planted in a .cpp, in a public header and through an
# internal header, a header outside any layer's folder, and a model family's headers included
# from the train layer and from a tool, and a private train header included from a tool, fails
# naming each file and line.
# Usage: check_layers_test.sh SOURCE_DIR PYTHON
set -euo pipefail
src=$1 python=$2
work=$(mktemp -d "${TMPDIR:-/tmp}/mfsdp_layers_test.XXXXXX")
trap 'rm -rf "$work"' EXIT

"$python" "$src/scripts/check_layers.py" "$src" || { echo "FAIL: the sources break the layering"; exit 1; }

cp -r "$src/src" "$src/include" "$src/tools" "$work/"
line_of_last() { wc -l < "$1"; }
echo '#include "mfsdp/train/policy_loss.h"' >> "$work/src/comm/store.cpp"
store_line=$(line_of_last "$work/src/comm/store.cpp")
echo '#include "mfsdp/fsdp/fully_shard.h"' >> "$work/include/mfsdp/optim/optim.h"
optim_line=$(line_of_last "$work/include/mfsdp/optim/optim.h")
echo '#include "checkpoint/interop_util.h"' >> "$work/src/models/llama/llama.cpp"
llama_line=$(line_of_last "$work/src/models/llama/llama.cpp")
echo '#include "mfsdp/models/llama_hf_config.h"' >> "$work/src/train/sft.cpp"
sft_line=$(line_of_last "$work/src/train/sft.cpp")
echo '#include "models/llama/llama_spec.h"' >> "$work/tools/mfsdp_generate.cpp"
generate_line=$(line_of_last "$work/tools/mfsdp_generate.cpp")
echo '#include "train/tool_flags.h"' >> "$work/tools/mfsdp_pretrain.cpp"
pretrain_line=$(line_of_last "$work/tools/mfsdp_pretrain.cpp")
echo '#pragma once' > "$work/include/mfsdp/stray.h"
# Sideways and downward stay allowed: data is torch-free and beside comm, checkpoint may use data;
# the family-neutral model headers are for everyone.
echo '#include "mfsdp/base/crc32c.h"' >> "$work/src/checkpoint/load_model.cpp"
echo '#include "mfsdp/models/causal_lm.h"' >> "$work/src/train/sft.cpp"

set +e
out=$("$python" "$src/scripts/check_layers.py" "$work")
rc=$?
set -e
echo "$out"
[[ $rc == 1 ]] || { echo "FAIL: exit $rc, want 1"; exit 1; }
expect() { grep -qF -- "$1" <<<"$out" || { echo "FAIL: no line with: $1"; exit 1; }; }
expect "src/comm/store.cpp:$store_line: the comm layer includes \"mfsdp/train/policy_loss.h\" of the train layer"
expect "include/mfsdp/optim/optim.h:$optim_line: the optim layer includes \"mfsdp/fsdp/fully_shard.h\" of the fsdp layer"
expect "src/models/llama/llama.cpp:$llama_line: the models layer includes \"checkpoint/interop_util.h\" of the checkpoint layer"
expect "include/mfsdp/stray.h: not inside a layer's folder"
expect "src/train/sft.cpp:$sft_line: includes \"mfsdp/models/llama_hf_config.h\" of the llama model family"
expect "tools/mfsdp_generate.cpp:$generate_line: includes \"models/llama/llama_spec.h\" of the llama model family"
expect "tools/mfsdp_pretrain.cpp:$pretrain_line: includes the private header \"train/tool_flags.h\" of the train layer"
[[ $(grep -c "layer includes\|not inside\|model family\|private header" <<<"$out") == 7 ]] || { echo "FAIL: want exactly 7 problems"; exit 1; }
echo PASS
