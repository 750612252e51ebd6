#!/usr/bin/env bash
# Entry points:  scripts/run.sh main [ARGS...]   -> python -m equiconvert demo ARGS
#                scripts/run.sh test [ARGS...]   -> pytest -q tests ARGS
# Both run scripts/setup.sh first (fast when nothing changed).
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."

usage() {
    cat >&2 <<'EOF'
usage: scripts/run.sh <subcommand> [args...]
  main [args...]   set up, then run: python -m equiconvert demo [args...]
  test [args...]   set up, then run: python -m pytest -q tests [args...]
EOF
}

cmd="${1:-}"
[ $# -gt 0 ] && shift

case "$cmd" in
    main)
        bash scripts/setup.sh
        exec .venv/bin/python -m equiconvert demo "$@"
        ;;
    test)
        bash scripts/setup.sh
        # pytest's exit code is propagated as is: 5 (no tests collected) fails.
        exec .venv/bin/python -m pytest -q tests "$@"
        ;;
    -h|--help|help)
        usage
        exit 0
        ;;
    *)
        [ -n "$cmd" ] && printf 'run.sh: unknown subcommand: %s\n' "$cmd" >&2
        usage
        exit 2
        ;;
esac
