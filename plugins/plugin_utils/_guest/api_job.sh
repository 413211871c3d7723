#!/bin/sh
# Copyright (c) 2026, microvm.sandbox contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
#
# The api road's job script (a guest program: _mux/api_exec.py sends it as the one `sh -c` argument of a
# documented buffered exec; _guest/__init__.py's script_of() fills in the @NAME@ bounds).
#
# $1 mode (run, wait, kill, drop), $2 job dir, $3 seconds to wait at most, $4 $5 the stdout and stderr bytes the
# road has already, $6 the task's output limit (0: none); run: $7 how stdin comes (0 inline, 1 staged in the job
# dir, 2 none), then argv. A wait ends early once STEP new bytes are there, so output flows while the command runs
# (a worker over its output limit hangs up, which stops the job), and a job more than BACKLOG bytes ahead of the
# road is paused until it catches up, as a pipe would hold it; with a limit, not before its output passes the
# limit: the road sees that in the sizes a running job reports and stops it, without moving output that would
# only be dropped. Output travels base64 (the answer carries text: other bytes could change);
# without base64(1) in the guest it is left in the job dir for download (kept=1).
# A stream sent whole from its start is one base64(1), an empty one nothing: tail and head only for a part, and
# always while the job runs (its files grow past the sizes just read; -1 says so).
# The last line of stderr is the script's word on the job, after the marker: `done <rc> <stdout bytes>
# <stderr bytes> <kept>`, `running <stdout bytes> <stderr bytes> <written>` (read so far; stdout and stderr
# bytes written by the job), or `absent`.
m=$1 d=$2 w=$3 oo=$4 eo=$5 lim=$6; shift 6
M='@TRAILER@'
S=@STEP@
size() { os=$(($(wc -c <"$d/out"))) es=$(($(wc -c <"$d/err"))); }
fresh() { size; [ $((os - oo + es - eo)) -ge $S ]; }
b64() {
  if [ "$3" -eq 0 ]; then :
  elif [ "$2" -eq 0 ] && [ "$3" -eq "$4" ]; then base64 <"$1"
  else tail -c +$(($2 + 1)) "$1" | head -c "$3" | base64; fi
}
emit() {
  size
  if [ -e "$d/rc" ]; then
    read -r rc <"$d/rc"
    if command -v base64 >/dev/null 2>&1 && [ $((os - oo)) -le @INLINE@ ] && [ $((es - eo)) -le @INLINE@ ]; then
      b64 "$d/out" "$oo" $((os - oo)) "$os"; b64 "$d/err" "$eo" $((es - eo)) "$es" >&2; rm -rf -- "$d"; k=0
    else k=1; fi
    printf '\n%s done %s %s %s %s\n' "$M" "$rc" "$os" "$es" "$k" >&2
  else
    if command -v base64 >/dev/null 2>&1; then
      no=$((os - oo)) ne=$((es - eo)); [ $no -le $S ] || no=$S; [ $ne -le $S ] || ne=$S
      b64 "$d/out" "$oo" $no -1; b64 "$d/err" "$eo" $ne -1 >&2; oo=$((oo + no)) eo=$((eo + ne))
      p=$(cat "$d/pid" 2>/dev/null)
      if { [ $((os - oo)) -gt @BACKLOG@ ] || [ $((es - eo)) -gt @BACKLOG@ ]; } && { [ "$lim" -eq 0 ] || [ $((os + es)) -gt "$lim" ]; }
      then kill -STOP "-$p" 2>/dev/null
      else kill -CONT "-$p" 2>/dev/null; fi
    fi
    printf '\n%s running %s %s %s\n' "$M" "$oo" "$eo" $((os + es)) >&2
  fi
}
case $m in
run)
  s=$1; shift
  mkdir -p -- "$d" || exit 1
  case $s in 0) cat >"$d/in" || exit 1 ;; 2) : >"$d/in" || exit 1 ;; esac
  : >"$d/out" && : >"$d/err" || exit 1
  X=; command -v setsid >/dev/null 2>&1 && X=setsid
  $X /bin/sh -c 'd=$1; shift; "$@" <"$d/in" >"$d/out" 2>"$d/err"; echo $? >"$d/rc.t" && mv -f "$d/rc.t" "$d/rc"' \
    sh "$d" "$@" </dev/null >/dev/null 2>&1 &
  p=$!; echo "$p" >"$d/pid"
# The watcher ends the wait below at the slice (or once STEP bytes are there) with USR1, sent again every 0.1 s
# until it is stopped: one that came before `wait` began would be lost and leave the exec waiting for the job.
  trap : USR1
  (i=0; while [ $i -lt $((w * 10)) ] && ! fresh; do sleep 0.1; i=$((i + 1)); done
   while kill -USR1 $$ 2>/dev/null; do sleep 0.1; done) </dev/null >/dev/null 2>&1 &
  t=$!
  wait "$p"
  kill "$t" 2>/dev/null ;;
wait|kill|drop)
  if [ ! -d "$d" ]; then printf '\n%s absent\n' "$M" >&2; exit 0; fi
  if [ "$m" = wait ]; then
    i=0; while [ ! -e "$d/rc" ] && [ $i -lt $((w * 10)) ] && ! fresh; do sleep 0.1; i=$((i + 1)); done
  else
    p=$(cat "$d/pid" 2>/dev/null)
    if [ ! -e "$d/rc" ] && [ -n "$p" ]; then
      kill -TERM "-$p" 2>/dev/null || kill -TERM "$p" 2>/dev/null
      kill -CONT "-$p" 2>/dev/null
      i=0; while kill -0 "-$p" 2>/dev/null && [ $i -lt 20 ]; do sleep 0.1; i=$((i + 1)); done
      kill -KILL "-$p" 2>/dev/null
      [ -e "$d/rc" ] || echo 143 >"$d/rc"
    fi
    if [ "$m" = drop ]; then rm -rf -- "$d"; printf '\n%s absent\n' "$M" >&2; exit 0; fi
  fi ;;
esac
emit
