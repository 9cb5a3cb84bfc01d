#!/usr/bin/env bash
# Mutation run over miles/gateway, miles/state and miles/errors.py ([tool.mutmut] in pyproject.toml;
# docs/testing.md). It mutates a clean export of a commit (default HEAD), so the score belongs to that
# commit and nobody's uncommitted edits leak in; [tool.mutmut] comes from the checkout's pyproject.toml.
# Usage: scripts/mutation.sh [REV]   (env: JOBS, mutants run at once, default 2)
set -euo pipefail

main() {
  local repo rev mutmut work start wall
  repo=$(git rev-parse --show-toplevel)
  rev=$(git -C "$repo" rev-parse --short=12 "${1:-HEAD}")
  mutmut="$repo/.venv/bin/mutmut"
  [[ -x $mutmut ]] || { echo "no $mutmut: run  .venv/bin/pip install -e '.[runtime,test,mutation]'" >&2; exit 2; }

  work="$repo/runs/mutation/$rev"
  rm -rf "$work"
  mkdir -p "$work"
  git -C "$repo" archive "$rev" | tar -x -C "$work"
  # the mutation settings are the checkout's, so two commits (before/after new tests) are judged alike
  cp "$repo/pyproject.toml" "$work/pyproject.toml"
  cd "$work"
  echo "mutating $rev in $work"
  start=$(date +%s)
  # nice: the run shares the machine; mutmut's progress line goes to the log only
  nice -n 19 "$mutmut" run --max-children "${JOBS:-2}" >mutmut.log 2>&1 || { tail -40 mutmut.log; exit 1; }
  "$mutmut" export-cicd-stats >/dev/null
  "$mutmut" results >survivors.txt || true
  wall=$(($(date +%s) - start))
  python3 - "$rev" "$wall" <<'PY'
import json, sys
rev, wall = sys.argv[1], int(sys.argv[2])
s = json.load(open("mutants/mutmut-cicd-stats.json"))
detected = s["killed"] + s["timeout"]  # a mutant that hangs the tests is caught too
print(f"commit {rev}: {s['killed']} killed, {s['timeout']} timed out, {s['survived']} survived, "
      f"{s['no_tests']} without tests, {s['suspicious']} suspicious, of {s['total']} mutants; "
      f"score {100 * detected / max(detected + s['survived'], 1):.1f}% (caught / (caught + survived)); "
      f"{wall // 60} min")
PY
  echo "survivors: $work/survivors.txt   (one mutant's diff: cd $work && $mutmut show NAME)"
}

# bash reads a script as it runs it: main's whole body is read before it starts, so editing this file
# during a (half-hour) run cannot derail it
main "$@"
exit
