#!/bin/bash
# CI checks of the systemd units in deploy/systemd/ (ctest label `deploy`, see deploy/CMakeLists.txt).
#
#   check_units.sh verify UNIT_DIR BIN_DIR
#       `systemd-analyze verify` on every unit, on a copy whose /usr/bin/ paths point into BIN_DIR
#       (the build's binaries). systemd-analyze exits 0 on unknown keys and bad values ("Unknown key
#       'Restrat' ..., ignoring"), so any message that names one of our units is a failure too.
#   check_units.sh security UNIT_DIR UNIT=THRESHOLD...
#       `systemd-analyze security --offline=true --threshold=THRESHOLD` on each UNIT: the overall
#       exposure (0-10, shown with one decimal) times ten must not exceed THRESHOLD.
#   check_units.sh selftest UNIT_DIR BIN_DIR UNIT=THRESHOLD...
#       proves the two checks can fail: a copy of each unit with a misspelt key, one with a bad
#       value and one with an unknown section must fail `verify`; a copy with its hardening lines
#       removed must fail `security`; the untouched units must pass both.
# Exit status: 0 pass, 1 a check failed, 77 systemd-analyze is missing (ctest SKIP_RETURN_CODE).
set -u -o pipefail

if ! command -v systemd-analyze >/dev/null 2>&1; then
  echo "SKIP: systemd-analyze not found (Debian: apt-get install systemd)"
  exit 77
fi

die() { echo "FAIL: $*" >&2; exit 1; }

# copy_units UNIT_DIR BIN_DIR DEST: the units with /usr/bin/ replaced by BIN_DIR/.
copy_units() {
  local src=$1 bin=$2 dest=$3
  mkdir -p "$dest"
  cp "$src"/*.service "$src"/*.target "$dest"/ || return 1
  sed -i "s#/usr/bin/#${bin%/}/#g" "$dest"/*.service
}

# verify_dir DIR: 0 when every unit in DIR verifies without a message about our units.
verify_dir() {
  local dir=$1 failed=0 unit out rc
  for unit in "$dir"/*.service "$dir"/*.target; do
    out=$(cd "$dir" && systemd-analyze verify "./$(basename "$unit")" 2>&1)
    rc=$?
    # Messages about other units (systemd's own, on odd hosts) are not ours to judge.
    local ours
    ours=$(printf '%s\n' "$out" | grep -E 'tessera' || true)
    if [[ $rc -ne 0 || -n "$ours" ]]; then
      echo "verify $(basename "$unit"): exit $rc"
      printf '%s\n' "$out" | sed 's/^/  /'
      failed=1
    else
      echo "verify $(basename "$unit"): ok"
    fi
  done
  return $failed
}

# security_units DIR UNIT=THRESHOLD...: 0 when every unit's exposure is within its threshold.
security_units() {
  local dir=$1 failed=0 spec unit threshold score
  shift
  for spec in "$@"; do
    unit=${spec%%=*}
    threshold=${spec#*=}
    [[ -f "$dir/$unit" ]] || { echo "security $unit: no such unit in $dir"; failed=1; continue; }
    score=$(cd "$dir" && systemd-analyze security --offline=true --no-pager "./$unit" 2>&1 |
            sed -n 's/.*Overall exposure level for [^:]*: \([0-9.]*\).*/\1/p')
    if (cd "$dir" && systemd-analyze security --offline=true --threshold="$threshold" \
          --no-pager "./$unit" >/dev/null 2>&1); then
      echo "security $unit: exposure ${score:-?} within threshold $threshold/10: ok"
    else
      echo "security $unit: exposure ${score:-?} above threshold $threshold/10"
      failed=1
    fi
  done
  return $failed
}

mode=${1:-}
case "$mode" in
  verify)
    [[ $# -eq 3 ]] || die "usage: $0 verify UNIT_DIR BIN_DIR"
    for b in tessera-coordinator tessera-server tessera-worker; do
      [[ -x "$3/$b" ]] || die "$3/$b is not built (build tessera-coordinator tessera-server tessera-worker)"
    done
    tmp=$(mktemp -d) || die "mktemp"
    trap 'rm -rf "$tmp"' EXIT
    copy_units "$2" "$3" "$tmp" || die "copying $2"
    verify_dir "$tmp" || die "systemd-analyze verify found problems (above)"
    echo "PASS: every unit verifies"
    ;;
  security)
    [[ $# -ge 3 ]] || die "usage: $0 security UNIT_DIR UNIT=THRESHOLD..."
    dir=$2
    shift 2
    security_units "$dir" "$@" || die "a unit's exposure is above its threshold (above)"
    echo "PASS: every unit within its threshold"
    ;;
  selftest)
    [[ $# -ge 4 ]] || die "usage: $0 selftest UNIT_DIR BIN_DIR UNIT=THRESHOLD..."
    src=$2
    bin=$3
    shift 3
    tmp=$(mktemp -d) || die "mktemp"
    trap 'rm -rf "$tmp"' EXIT
    copy_units "$src" "$bin" "$tmp/good" || die "copying $src"
    verify_dir "$tmp/good" >/dev/null || die "the untouched units do not verify"
    security_units "$tmp/good" "$@" >/dev/null || die "the untouched units fail security"
    checked=0
    for unit in "$tmp"/good/*.service "$tmp"/good/*.target; do
      name=$(basename "$unit")
      # A misspelt key, a bad value, an unknown section: each alone must fail verify.
      for breakage in 's/^Description=/Descripton=/' 's/^\(WantedBy\|PartOf\)=.*/&\nAfter=network-online.targ et/' \
                      's/^\[Install\]/[Instal]/'; do
        rm -rf "$tmp/bad" && cp -r "$tmp/good" "$tmp/bad"
        sed -i "$breakage" "$tmp/bad/$name"
        cmp -s "$tmp/good/$name" "$tmp/bad/$name" && die "$name: '$breakage' changed nothing"
        if verify_dir "$tmp/bad" >/dev/null 2>&1; then
          die "$name with '$breakage' passed verify"
        fi
        echo "selftest $name: verify catches '$breakage'"
        checked=$((checked + 1))
      done
      if [[ $name == *.service ]]; then
        rm -rf "$tmp/bad" && cp -r "$tmp/good" "$tmp/bad"
        sed -i 's/^ExecStart=/ExecStrat=/' "$tmp/bad/$name"
        verify_dir "$tmp/bad" >/dev/null 2>&1 && die "$name without ExecStart= passed verify"
        echo "selftest $name: verify catches a misspelt ExecStart="
        checked=$((checked + 1))
        rm -rf "$tmp/bad" && cp -r "$tmp/good" "$tmp/bad"
        sed -i 's/^ProtectSystem=strict/ProtectSystem=stric/' "$tmp/bad/$name"
        verify_dir "$tmp/bad" >/dev/null 2>&1 && die "$name with ProtectSystem=stric passed verify"
        echo "selftest $name: verify catches ProtectSystem=stric"
        checked=$((checked + 1))
      fi
    done
    for spec in "$@"; do
      unit=${spec%%=*}
      rm -rf "$tmp/bad" && cp -r "$tmp/good" "$tmp/bad"
      sed -i -E '/^(NoNewPrivileges|CapabilityBoundingSet|ProtectSystem|ProtectHome|PrivateTmp|SystemCallFilter|RestrictAddressFamilies|ProtectKernel[A-Za-z]*)=/d' \
        "$tmp/bad/$unit"
      security_units "$tmp/bad" "$spec" >/dev/null 2>&1 && die "$unit without hardening passed security"
      echo "selftest $unit: security catches the hardening removed"
      checked=$((checked + 1))
    done
    echo "PASS: $checked broken copies all caught"
    ;;
  *)
    die "usage: $0 verify|security|selftest ..."
    ;;
esac
