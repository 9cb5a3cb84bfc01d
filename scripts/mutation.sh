#!/usr/bin/env bash
# Mutation run over miles/gateway and miles/state ([tool.mutmut] in pyproject.toml; docs/testing.md).
# It mutates a clean export of a commit (default HEAD), so the score belongs to that commit and
# nobody's uncommitted edits leak in; [tool.mutmut] comes from the checkout's pyproject.toml.
# Usage: scripts/mutation.sh [REV]   (env: JOBS, mutants run at once, default 2)
set -euo pipefail

repo=$(git rev-parse --show-toplevel)
rev=$(git -C "$repo" rev-parse --short=12 "${1:-HEAD}")
mutmut="$repo/.venv/bin/mutmut"
[[ -x $mutmut ]] || { echo "no $mutmut: run  .venv/bin/pip install -e '.[test,mutation]'" >&2; exit 2; }

work="$repo/runs/mutation/$rev"
rm -rf "$work"
mkdir -p "$work"
git -C "$repo" archive "$rev" | tar -x -C "$work"
# the mutation settings are the checkout's, so two commits (before/after new tests) are judged alike
cp "$repo/pyproject.toml" "$work/pyproject.toml"
cd "$work"
echo "mutating $rev in $work"
start=$(date +%s)
# nice: the run shares the machine; mutmut's own progress line goes to the log only
nice -n 19 "$mutmut" run --max-children "${JOBS:-2}" >mutmut.log 2>&1 || { tail -40 mutmut.log; exit 1; }
"$mutmut" export-cicd-stats >/dev/null
"$mutmut" results >survivors.txt || true
wall=$(( $(date +%s) - start ))
python3 - "$rev" "$wall" <<'PY'
import json, sys
rev, wall = sys.argv[1], int(sys.argv[2])
s = json.load(open("mutants/mutmut-cicd-stats.json"))
judged = s["killed"] + s["survived"]
print(f"commit {rev}: {s['killed']} killed, {s['survived']} survived, {s['no_tests']} without tests, "
      f"{s['timeout']} timed out, {s['suspicious']} suspicious of {s['total']} mutants; "
      f"score {100 * s['killed'] / max(judged, 1):.1f}% (killed / (killed + survived)); {wall // 60} min")
PY
echo "survivors: $work/survivors.txt   (see one: cd $work && $mutmut show NAME)"
