#!/usr/bin/env bash
# Two runs of `bench/smollm2_call.sh all` side by side in one device call, for two measurements that
# need different data stages (different REGENERATED answer files), so that one session's device time
# buys both. Each run has its own work folder, stash folder and $OUT/<a|b>; neither writes a file the
# other reads:
#   run a: W=/tmp/smolrun   S=/tmp/smol    (the stash calls' folder)
#   run b: W=/tmp/smolrun-b S=/tmp/smol-b  (a copy of /tmp/smol made here: its REGENERATED must point
#                                           into /tmp/smol-b/data)
# Settings both share come from the environment (DEADLINE, OVERRIDES, SETS, TEMPS, JOBS, RESUME, …);
# each run's own from PAIR_A and PAIR_B, as assignments without spaces, e.g.
#   PAIR_A="REGENERATED=/tmp/smol/data/x.jsonl.gz TRAINERS=none DFLASH_VARIANTS=l1-dpace"
# Run after the two `stash` calls: the wheels are installed once there, and these runs skip installing
# so that neither rewrites /tmp/site while the other imports from it. CORES (default 8) is each run's.
# At its deadline, or when its data stages fail, a run kills only its own processes (those that inherit
# its SMOLLM2_RUN), so the two may take different DEADLINEs (in PAIR_A / PAIR_B) and one run's failure
# leaves the other running.
set -u
[ -d /tmp/smol-b ] || cp -r /tmp/smol /tmp/smol-b
export SKIP_INSTALL=1 CORES=${CORES:-8}
# shellcheck disable=SC2086  # PAIR_A / PAIR_B are word lists of assignments
env W=/tmp/smolrun S=/tmp/smol OUT="$OUT/a" ${PAIR_A:-} bash bench/smollm2_call.sh all > "$OUT/a.log" 2>&1 &
env W=/tmp/smolrun-b S=/tmp/smol-b OUT="$OUT/b" ${PAIR_B:-} bash bench/smollm2_call.sh all > "$OUT/b.log" 2>&1 &
wait
tail -n 15 "$OUT/a.log" "$OUT/b.log"
rm -f "$OUT"/[ab]/regenerated.jsonl.gz  # the runs read answers they were given; nothing to return
