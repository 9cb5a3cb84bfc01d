#!/usr/bin/env bash
# Mutation run ([tool.mutmut] in pyproject.toml; docs/testing.md). It mutates a clean export of a commit
# (default HEAD), so the score belongs to that commit and nobody's uncommitted edits leak in; the settings
# come from the checkout's pyproject.toml. The default set is the gateway, the state store and
# miles/errors.py; SET=planning takes [tool.miles.mutation.planning] instead (roles, catalog, elastic
# policy, bucketing).
# Usage: scripts/mutation.sh [REV]   (env: JOBS, mutants run at once, default 2; SET, default gateway)
set -euo pipefail

main() {
  local repo rev mutmut work start wall
  repo=$(git rev-parse --show-toplevel)
  rev=$(git -C "$repo" rev-parse --short=12 "${1:-HEAD}")
  mutmut="$repo/.venv/bin/mutmut"
  [[ -x $mutmut ]] || { echo "no $mutmut: run  .venv/bin/pip install -e '.[runtime,test,mutation]'" >&2; exit 2; }

  work="$repo/runs/mutation/$rev${SET:+-$SET}"
  rm -rf "$work"
  mkdir -p "$work"
  git -C "$repo" archive "$rev" | tar -x -C "$work"
  # the mutation settings are the checkout's, so two commits (before/after new tests) are judged alike
  cp "$repo/pyproject.toml" "$work/pyproject.toml"
  [[ -z ${SET:-} || $SET == gateway ]] || use_set "$SET" "$work/pyproject.toml"
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

# [tool.miles.mutation.SET]'s keys replace [tool.mutmut]'s in the exported pyproject.toml
use_set() {
  python3 - "$1" "$2" <<'PY'
import re, sys, tomllib
name, path = sys.argv[1], sys.argv[2]
text = open(path).read()
chosen = tomllib.loads(text)["tool"].get("miles", {}).get("mutation", {}).get(name)
if chosen is None:
    sys.exit(f"no [tool.miles.mutation.{name}] in pyproject.toml")
for key, value in chosen.items():
    line = f"{key} = {value!r}".replace("'", '"')
    text, n = re.subn(rf"(?m)^{key} = .*$", line, text, count=1)
    if n != 1:
        sys.exit(f"[tool.mutmut] has no {key} to replace")
open(path, "w").write(text)
PY
}

# bash reads a script as it runs it: main's whole body is read before it starts, so editing this file
# during a (half-hour) run cannot derail it
main "$@"
exit
