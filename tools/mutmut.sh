#!/usr/bin/env bash
# mutmut 3 over the modules where a silent error costs users most (not the engine-mutant feature,
# k2vec.mutation: docs/mutmut.md says how the two differ).
#
#   tools/mutmut.sh [MODULE ...]          MODULE: quant spec report kdtr runner fast_schema (default: all, in that order)
#
# Each module is mutated in its own copy of this checkout under .mutmut/MODULE (git-ignored), with only
# the fast tests that exercise it; mutmut then runs, per mutant, only the tests that call the mutated
# function. Nothing outside .mutmut/ is written. Needs mutmut importable (`pip install -e .[mutmut]`,
# or MUTMUT_PATH=/dir/with/mutmut). Environment: PYTHON (default: python3), MUTMUT_JOBS (default: cores).
# Survivors: `cd .mutmut/MODULE && python -m mutmut results` then `python -m mutmut show NAME`;
# the equivalent ones are listed in docs/mutmut.md.
set -euo pipefail

repo=$(cd "$(dirname "$0")/.." && pwd)
cd "$repo"
PYTHON=${PYTHON:-python3}
jobs=${MUTMUT_JOBS:-$(nproc)}
work="$repo/.mutmut"

# module -> "files to mutate|test files" (tests: fast, in-process ones that call the module directly)
declare -A SOURCES TESTS DESELECT
# runner: the runner and the contract it holds a result to (modes, expectations, checks, result files)
SOURCES[runner]="src/k2vec/engines/runner.py src/k2vec/engines/contract/modes.py src/k2vec/engines/contract/expectations.py src/k2vec/engines/contract/checks.py src/k2vec/engines/contract/files.py src/k2vec/engines/contract/errors.py"
TESTS[runner]="tests/test_runner.py tests/test_runner_hardening.py tests/test_mutmut_runner.py"
SOURCES[fast_schema]="src/k2vec/engines/contract/schema.py"   # the runner's quick pass of valid results
TESTS[fast_schema]="tests/test_fast_schema.py"
# the three tests of the hostile_run fixture run Snakemake (the runner in subprocesses): they cannot kill a mutant
DESELECT[runner]="tests/test_runner_hardening.py::test_hostile_engines_are_failed_rows_in_the_report_and_the_rest_completes tests/test_runner_hardening.py::test_detached_process_is_gone_after_the_run tests/test_runner_hardening.py::test_sandboxed_engines_write_nothing_outside_and_a_real_engine_still_passes"
# spec: the config expansion, the engines section and the model presets
SOURCES[spec]="src/k2vec/config/expand.py src/k2vec/config/engines.py src/k2vec/config/presets.py"
TESTS[spec]="tests/test_spec.py tests/test_mutmut_spec.py"
SOURCES[report]="src/k2vec/report/classify.py src/k2vec/report/tokens.py src/k2vec/report/logits.py src/k2vec/report/score.py"
TESTS[report]="tests/test_report_metrics.py tests/test_report_classify.py tests/test_report_gate.py tests/test_mutmut_report.py"
SOURCES[kdtr]="src/k2vec/kdtr/reader.py src/k2vec/kdtr/format.py"
TESTS[kdtr]="tests/test_kdtr_roundtrip.py tests/test_kdtr_malformed.py tests/test_kdtr_cli.py tests/test_mutmut_kdtr.py"
# tests that run `python -m k2vec.kdtr` in a subprocess without mutmut on its path: they cannot kill a mutant
DESELECT[kdtr]="tests/test_kdtr_cli.py::test_module_entry_point tests/test_kdtr_cli.py::test_list_into_a_closed_pipe_ends_quietly"
SOURCES[quant]="src/k2vec/model/int4.py"
TESTS[quant]="tests/test_quant.py tests/test_mutmut_quant.py"
ALL=(quant spec report kdtr runner fast_schema)

modules=("$@")
[ ${#modules[@]} -gt 0 ] || modules=("${ALL[@]}")
for m in "${modules[@]}"; do
    [ -n "${SOURCES[$m]:-}" ] || { echo "unknown module '$m' (one of: ${ALL[*]})" >&2; exit 2; }
done

mutmut_pythonpath=${MUTMUT_PATH:+$MUTMUT_PATH}
PYTHONPATH="$mutmut_pythonpath" "$PYTHON" -c "import mutmut" 2>/dev/null || {
    echo "mutmut is not importable: pip install -e '.[mutmut]' (or set MUTMUT_PATH)" >&2; exit 2; }

summary="$work/summary.tsv"
mkdir -p "$work"
printf 'module\tmutants\tkilled\tsurvived\tno_tests\ttimeouts\tother\tseconds\n' >"$summary"

for m in "${modules[@]}"; do
    dir="$work/$m"
    rm -rf "$dir"
    mkdir -p "$dir"
    # the checkout as it is (tracked and new, not ignored files), so uncommitted tests count too
    git ls-files -z --cached --others --exclude-standard \
        | tar --null -T - --ignore-failed-read -cf - 2>/dev/null | tar -xf - -C "$dir"
    tests=""
    for t in ${TESTS[$m]}; do [ -e "$dir/$t" ] && tests="$tests $t"; done
    {
        echo "[mutmut]"
        echo "source_paths = src"
        echo "only_mutate ="
        for s in ${SOURCES[$m]}; do echo "    $s"; done
        echo "pytest_add_cli_args_test_selection ="
        for t in $tests; do echo "    $t"; done
        echo "pytest_add_cli_args ="
        echo "    -p"
        echo "    no:cacheprovider"
        for t in ${DESELECT[$m]:-}; do printf '    --deselect\n    %s\n' "$t"; done
        # keep every session's temp directory: a fixture cached in the forked test process (the report's
        # goldens) points into the session that built it, which pytest would delete after 3 more sessions
        echo "    -o"
        echo "    tmp_path_retention_count=1000000"
        echo "also_copy ="
        for f in Snakefile config.yaml workflow profiles include tools docs; do echo "    $f"; done
        echo "use_git_change_detection = false"
    } >"$dir/setup.cfg"
    echo "== $m: mutating ${SOURCES[$m]}; tests:$tests"
    start=$(date +%s)
    # mutmut's exit status is not the verdict: the counts below are
    # a private pytest temp root: the default one (/tmp/pytest-of-USER) keeps only the 3 newest sessions'
    # directories, so a concurrent pytest elsewhere on the machine could delete a session fixture's files
    mkdir -p "$dir/tmp"
    (cd "$dir" && env -u PYTHONPATH ${mutmut_pythonpath:+PYTHONPATH=$mutmut_pythonpath} \
        PYTEST_DEBUG_TEMPROOT="$dir/tmp" "$PYTHON" -m mutmut run --max-children "$jobs" >"$dir/mutmut.log" 2>&1) || {
        echo "mutmut failed for $m; log: $dir/mutmut.log" >&2; tail -20 "$dir/mutmut.log" >&2; exit 1; }
    seconds=$(( $(date +%s) - start ))
    (cd "$dir" && env -u PYTHONPATH ${mutmut_pythonpath:+PYTHONPATH=$mutmut_pythonpath} \
        "$PYTHON" -m mutmut results --all true >"$dir/results.txt" 2>&1)
    "$PYTHON" - "$m" "$dir/results.txt" "$seconds" >>"$summary" <<'EOF'
import collections, sys
module, results, seconds = sys.argv[1], sys.argv[2], sys.argv[3]
status = collections.Counter(line.rsplit(": ", 1)[1].strip() for line in open(results) if ": " in line)
known = ("killed", "survived", "no tests", "timeout")
other = sum(n for s, n in status.items() if s not in known)
print(module, sum(status.values()), *(status[s] for s in known), other, seconds, sep="\t")
EOF
    grep -E ': (survived|no tests|suspicious|timeout|segfault)$' "$dir/results.txt" >"$dir/survivors.txt" || true
done

echo
column -t -s $'\t' "$summary"
echo "survivors (not killed): .mutmut/MODULE/survivors.txt; show one: cd .mutmut/MODULE && $PYTHON -m mutmut show NAME"
