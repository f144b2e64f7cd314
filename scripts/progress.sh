# Sourced by the install scripts: `step LABEL CMD...` runs CMD with its output kept in a file,
# says LABEL when it starts, a line every 10 s while it runs (a silent install of several minutes
# looks hung), and how long it took; on failure it shows CMD's output and returns its status.
step() {
  local label=$1 out rc=0 start=$SECONDS ticker
  shift
  out=$(mktemp)
  echo "install: $label" >&2
  ( while sleep 10; do echo "install:   ... $label ($((SECONDS - start)) s)" >&2; done ) &
  ticker=$!
  "$@" >"$out" 2>&1 || rc=$?
  kill "$ticker" 2>/dev/null
  wait "$ticker" 2>/dev/null || true
  if [ "$rc" -ne 0 ]; then
    cat "$out" >&2
    echo "install: $label FAILED (exit $rc)" >&2
  elif [ $((SECONDS - start)) -ge 10 ]; then
    echo "install: $label: done in $((SECONDS - start)) s" >&2
  fi
  rm -f "$out"
  return "$rc"
}
