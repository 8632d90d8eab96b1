#!/usr/bin/env bash
# Two hosts for real: network namespaces joined by a veth pair, 2 hosts x 2 ranks of
# mfsdp-pretrain (ZeRO-3, collectives over TCP between the hosts, MFSDP_SHM=0), a save, a resume
# on one host with 2 ranks; losses equal a one-host run's at every iteration (mfsdp's losses do
# not depend on the rank count); then killing one host's ranks ends the job on the other host
# with the dead rank named. With mfsdp-run --max-restarts on both hosts (docs/launcher.md,
# "Restarts across nodes"): a rank of host 1 killed after the first save makes both launchers
# start round 1 together, which resumes from the checkpoint and ends with the uninterrupted run's
# losses; host 1's launcher killed with its ranks makes host 0's fail round 1 at the join timeout,
# naming node 1. Needs root and `ip netns` (CI runs as root); exits 77 (ctest: skipped) naming
# what is missing otherwise.
#
#   multihost_netns_test.sh MFSDP_RUN MFSDP_PRETRAIN PYTHON
set -uo pipefail
RUN=$1 PRETRAIN=$2 PYTHON=$3
skip() { echo "SKIPPED: $*"; exit 77; }
fail() { echo "FAILED: $*"; exit 1; }
[[ $(id -u) == 0 ]] || skip "needs root to create network namespaces (ip netns)"
command -v ip >/dev/null || skip "no ip command (iproute2)"
tag=$$
h0=mfsdp_h0_$tag h1=mfsdp_h1_$tag
work=$(mktemp -d /tmp/mfsdp_netns.XXXXXX)
cleanup() {
  for ns in $h0 $h1; do
    ip netns pids "$ns" 2>/dev/null | xargs -r kill -9 2>/dev/null
    ip netns del "$ns" 2>/dev/null
  done
  rm -rf "$work"
}
trap cleanup EXIT
# mfsdp-run's progress files: a launcher killed with SIGKILL below cannot remove its own.
export TMPDIR=$work
ip netns add $h0 2>/dev/null || skip "cannot create a network namespace here (ip netns add failed)"
ip netns add $h1 || fail "ip netns add $h1"
ip link add veth0_$tag netns $h0 type veth peer name veth1_$tag netns $h1 || fail "cannot create a veth pair"
net=10.$((tag % 200 + 20)).$((tag / 200 % 250)).
ip -n $h0 addr add ${net}1/24 dev veth0_$tag && ip -n $h1 addr add ${net}2/24 dev veth1_$tag || fail "addresses"
for ns in $h0 $h1; do ip -n $ns link set lo up; done
ip -n $h0 link set veth0_$tag up && ip -n $h1 link set veth1_$tag up || fail "links up"
port=$((20000 + tag % 20000))
export MFSDP_SHM=0 OMP_NUM_THREADS=1 MFSDP_JOB_TOKEN=netns_${tag}_$RANDOM$RANDOM
MODEL="--device cpu --mock-data --vocab-size 64 --make-vocab-size-divisible-by 64 --num-layers 2 --hidden-size 32
  --num-attention-heads 4 --group-query-attention --num-query-groups 2 --swiglu --ffn-hidden-size 48 --seq-length 16
  --micro-batch-size 1 --global-batch-size 8 --lr 3e-3 --lr-warmup-iters 2 --lr-decay-style cosine --min-lr 3e-4
  --lr-decay-iters 8 --clip-grad 1.0 --log-interval 1 --eval-iters 0 --seed 7
  --data-parallel-sharding-strategy optim_grads_params"

# host N of a 2-host job: ns, node rank, interface; the rest are the trainer's flags. RUN_FLAGS:
# more of mfsdp-run's own.
RUN_FLAGS=""
host() {
  local ns=$1 node=$2 ifname=$3; shift 3
  ip netns exec "$ns" env MFSDP_SOCKET_IFNAME="$ifname" "$RUN" --nnodes 2 --node-rank "$node" \
    --nproc-per-node 2 --master-addr ${net}1 --master-port "$port" $RUN_FLAGS "$PRETRAIN" $MODEL "$@"
}
# The pids of host N's trainer ranks (not its mfsdp-run).
ranks_of() { for p in $(ip netns pids "$1"); do [[ $(cat /proc/$p/comm 2>/dev/null) == mfsdp-pretrain ]] && echo $p; done; }

echo "== reference: one host, 2 ranks, 8 iterations"
ip netns exec $h0 "$RUN" --nproc-per-node 2 --master-port $((port + 1)) "$PRETRAIN" $MODEL --train-iters 8 \
  --metrics-file "$work/ref.jsonl" >"$work/ref.log" 2>&1 || { cat "$work/ref.log"; fail "the one-host run failed"; }

echo "== 2 hosts x 2 ranks, 4 iterations, save at 4"
host $h0 0 veth0_$tag --train-iters 8 --exit-interval 4 --save "$work/ckpt" --save-interval 4 \
  --metrics-file "$work/two.jsonl" >"$work/h0.log" 2>&1 &
p0=$!
host $h1 1 veth1_$tag --train-iters 8 --exit-interval 4 --save "$work/ckpt" --save-interval 4 >"$work/h1.log" 2>&1 &
p1=$!
wait $p0; r0=$?; wait $p1; r1=$?
[[ $r0 == 0 && $r1 == 0 ]] || { tail -30 "$work/h0.log" "$work/h1.log"; fail "the 2-host job failed ($r0, $r1)"; }
grep -q "world size 4\|4 ranks\|of 4" "$work/h0.log" "$work/h1.log" || true

echo "== resume on one host with 2 ranks, iterations 5-8"
ip netns exec $h0 "$RUN" --nproc-per-node 2 --master-port $((port + 2)) "$PRETRAIN" $MODEL --train-iters 8 \
  --load "$work/ckpt" --metrics-file "$work/resumed.jsonl" >"$work/resume.log" 2>&1 ||
  { cat "$work/resume.log"; fail "the resume failed"; }

"$PYTHON" - "$work" <<'PY' || fail "losses differ"
import json, sys
w = sys.argv[1]
def losses(name):
    return {r["iteration"]: r["lm_loss"] for r in map(json.loads, open(f"{w}/{name}.jsonl")) if not r.get("eval")}
ref, two, res = losses("ref"), losses("two"), losses("resumed")
assert sorted(two) == [1, 2, 3, 4], f"2-host iterations {sorted(two)}"
assert sorted(res) == [5, 6, 7, 8], f"resumed iterations {sorted(res)}"
for it, loss in {**two, **res}.items():
    assert abs(loss - ref[it]) <= 1e-5 * abs(ref[it]), f"iteration {it}: {loss} vs one host {ref[it]}"
print("losses equal the one-host run at iterations 1-8:", [round(ref[i], 5) for i in range(1, 9)])
PY

echo "== kill host 1's ranks mid-training"
host $h0 0 veth0_$tag --train-iters 100000 --lr-decay-iters 100000 --metrics-file "$work/long.jsonl" >"$work/k0.log" 2>&1 &
p0=$!
host $h1 1 veth1_$tag --train-iters 100000 --lr-decay-iters 100000 >"$work/k1.log" 2>&1 &
p1=$!
for _ in $(seq 1 600); do [[ -s $work/long.jsonl ]] && break; sleep 0.1; done
[[ -s $work/long.jsonl ]] || { cat "$work/k0.log"; fail "the job did not start training"; }
killed_at=$(date +%s.%N)
ip netns pids $h1 | xargs -r kill -9
for _ in $(seq 1 1200); do kill -0 $p0 2>/dev/null || break; sleep 0.1; done
if kill -0 $p0 2>/dev/null; then kill -9 $p0; fail "host 0 still runs 120 s after host 1's ranks were killed"; fi
wait $p0; r0=$?
ended=$(awk -v a="$killed_at" -v b="$(date +%s.%N)" 'BEGIN{printf "%.1f", b-a}')
[[ $r0 != 0 ]] || fail "host 0 exited 0 after its peers died"
grep -Eq "rank [23]" "$work/k0.log" || { cat "$work/k0.log"; fail "host 0's output does not name rank 2 or 3"; }
echo "host 0 ended $ended s after host 1's ranks were killed, exit $r0, naming: $(grep -Eo "rank [23][^,;]*" "$work/k0.log" | head -1)"
echo "== --max-restarts 2 on both hosts: one of host 1's ranks killed after the first save"
LONG="--train-iters 40 --lr-decay-iters 40"
ip netns exec $h0 "$RUN" --nproc-per-node 2 --master-port $((port + 3)) "$PRETRAIN" $MODEL $LONG \
  --metrics-file "$work/ref40.jsonl" >"$work/ref40.log" 2>&1 || { cat "$work/ref40.log"; fail "the 40-iteration one-host run failed"; }
RUN_FLAGS="--max-restarts 2 --rdzv-conf join_timeout=30"
SAVE="--save $work/rckpt --load $work/rckpt --save-interval 5"
started=$(date +%s.%N)
host $h0 0 veth0_$tag $LONG $SAVE --metrics-file "$work/restarted.jsonl" >"$work/r0.log" 2>&1 &
p0=$!
host $h1 1 veth1_$tag $LONG $SAVE >"$work/r1.log" 2>&1 &
p1=$!
for _ in $(seq 1 6000); do [[ -s $work/rckpt/latest_checkpointed_iteration.txt ]] && break; sleep 0.01; done
victim=$(ranks_of $h1 | head -1)
[[ -n $victim ]] || { tail -20 "$work/r0.log" "$work/r1.log"; fail "no rank of host 1 to kill after the first save"; }
kill -9 "$victim"
echo "killed host 1's rank (pid $victim) after the save at iteration $(cat "$work/rckpt/latest_checkpointed_iteration.txt")"
for _ in $(seq 1 1800); do kill -0 $p0 2>/dev/null || kill -0 $p1 2>/dev/null || break; sleep 0.1; done
kill -0 $p0 2>/dev/null || kill -0 $p1 2>/dev/null && { kill -9 $p0 $p1; fail "the restarted job still runs after 180 s"; }
wait $p0; r0=$?; wait $p1; r1=$?
echo "the job ended $(awk -v a="$started" -v b="$(date +%s.%N)" 'BEGIN{printf "%.1f", b-a}') s after it started"
[[ $r0 == 0 && $r1 == 0 ]] || { tail -30 "$work/r0.log" "$work/r1.log"; fail "the restarted 2-host job failed ($r0, $r1)"; }
for log in r0 r1; do
  grep -q "mfsdp-run: restarting every rank (restart 1 of 2)" "$work/$log.log" ||
    { cat "$work/$log.log"; fail "$log.log: mfsdp-run did not restart round 1"; }
  ! grep -q "restart 2" "$work/$log.log" || { cat "$work/$log.log"; fail "$log.log: a second restart"; }
done
# Rank 0 (host 0) says which start it is.
grep -q "\[rank0\]:  restart 1 of at most 2" "$work/r0.log" || { cat "$work/r0.log"; fail "rank 0 does not say restart 1"; }
grep "mfsdp-run: round 0 failed on node 1\|mfsdp-run: rank [0-3] (pid" "$work/r0.log" | head -1
! grep -q "mfsdp-run: goodput" "$work/r1.log" || fail "host 1 printed a goodput summary (rank 0 is on host 0)"
grep "mfsdp-run: goodput" "$work/r0.log" || echo "(host 0 printed no goodput summary: the trainer wrote no progress)"
"$PYTHON" - "$work" <<'PY' || fail "the restarted job's losses differ from the uninterrupted run's"
import json, sys
w = sys.argv[1]
def records(name):
    return [r for r in map(json.loads, open(f"{w}/{name}.jsonl")) if not r.get("eval")]
ref = {r["iteration"]: r["lm_loss"] for r in records("ref40")}
runs = records("restarted")
got = {r["iteration"]: r["lm_loss"] for r in runs}  # the last record of each iteration: the restart's
assert sorted(got) == list(range(1, 41)), f"iterations {sorted(got)}"
for it, loss in got.items():
    assert abs(loss - ref[it]) <= 1e-5 * abs(ref[it]), f"iteration {it}: {loss} vs uninterrupted {ref[it]}"
print(f"restarted: {len(runs) - 40} iterations redone; losses equal the uninterrupted run's at iterations 1-40")
PY

echo "== --max-restarts 2: host 1's mfsdp-run killed with its ranks; host 0's fails round 1 naming node 1"
RUN_FLAGS="--max-restarts 2 --rdzv-conf join_timeout=10"
host $h0 0 veth0_$tag --train-iters 100000 --lr-decay-iters 100000 --metrics-file "$work/gone.jsonl" >"$work/g0.log" 2>&1 &
p0=$!
host $h1 1 veth1_$tag --train-iters 100000 --lr-decay-iters 100000 >"$work/g1.log" 2>&1 &
p1=$!
for _ in $(seq 1 600); do [[ -s $work/gone.jsonl ]] && break; sleep 0.1; done
[[ -s $work/gone.jsonl ]] || { cat "$work/g0.log"; fail "the job did not start training"; }
killed_at=$(date +%s.%N)
ip netns pids $h1 | xargs -r kill -9
for _ in $(seq 1 600); do kill -0 $p0 2>/dev/null || break; sleep 0.1; done
if kill -0 $p0 2>/dev/null; then kill -9 $p0; fail "host 0 still runs 60 s after host 1's launcher was killed"; fi
wait $p0; r0=$?
ended=$(awk -v a="$killed_at" -v b="$(date +%s.%N)" 'BEGIN{printf "%.1f", b-a}')
[[ $r0 != 0 ]] || { cat "$work/g0.log"; fail "host 0 exited 0 without node 1"; }
grep -q "mfsdp-run: the job ends: node 1 did not join round 1 within 10 s" "$work/g0.log" ||
  { cat "$work/g0.log"; fail "host 0 does not name node 1 as the node that never joined"; }
echo "host 0 ended $ended s after host 1's launcher was killed, exit $r0: $(grep -o "node 1 did not join.*" "$work/g0.log")"
echo "PASSED"
