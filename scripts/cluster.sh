#!/usr/bin/env bash
# The cloud past one process, on one machine: PostgreSQL, N `cdcca-cloud --role front`
# processes behind nginx (gRPC, configs/nginx/grpc_proxy.conf.in) and M `--role trainer`
# processes, all on loopback. Devices dial the one address `up` prints.
#
#   scripts/cluster.sh up [options]     start everything
#   scripts/cluster.sh status [--dir]   list the processes and whether they run
#   scripts/cluster.sh down [--dir]     stop everything, nginx first, PostgreSQL last
#
# Options of up:
#   --dir DIR             where everything lives (default /tmp/cdcca-cluster): pg/ (the
#                         database), front-<i>/ and trainer-<j>/ (each process's scratch
#                         data dir), nginx/, logs/, run/ (pids, ports), tokens
#   --fronts N            front processes (default 2)
#   --trainers M          trainer processes (default 2)
#   --devices K           device tokens dev-0 .. dev-<K-1> written to DIR/tokens the first
#                         time (default 8)
#   --checkpoint_dir DIR  the models every process loads (default models/small)
#   --build DIR           the build holding cloud/cdcca-cloud (default build)
#   --timeout S           how long to wait for each process to answer (default 60)
# The database and the tokens stay in DIR across down/up; remove DIR to start afresh.
# When run as root, PostgreSQL and nginx run as an unprivileged user (postgres if it
# exists, else nobody) that owns DIR/pg and DIR/nginx.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

usage() { sed -n '2,26p' "$0" | sed 's/^# \{0,1\}//'; }
die() { echo "cluster.sh: $*" >&2; exit 1; }

# ---- options ---------------------------------------------------------------------------------
command="${1:-}"
[ $# -gt 0 ] && shift
case "$command" in
  up|down|status) ;;
  -h|--help|help) usage; exit 0 ;;
  "") usage >&2; exit 2 ;;
  *) echo "cluster.sh: unknown command '$command' (up, down or status)" >&2; exit 2 ;;
esac
dir=/tmp/cdcca-cluster
fronts=2
trainers=2
devices=8
checkpoint_dir="$root/models/small"
build="$root/build"
timeout_s=60
while [ $# -gt 0 ]; do
  case "$1" in
    -h|--help) usage; exit 0 ;;
    --dir|--fronts|--trainers|--devices|--checkpoint_dir|--build|--timeout)
      [ $# -ge 2 ] || die "$1 needs a value"
      case "$1" in
        --dir) dir="$2" ;;
        --fronts) fronts="$2" ;;
        --trainers) trainers="$2" ;;
        --devices) devices="$2" ;;
        --checkpoint_dir) checkpoint_dir="$2" ;;
        --build) build="$2" ;;
        --timeout) timeout_s="$2" ;;
      esac
      shift 2 ;;
    --dir=*|--fronts=*|--trainers=*|--devices=*|--checkpoint_dir=*|--build=*|--timeout=*)
      set -- "${1%%=*}" "${1#*=}" "${@:2}" ;;
    *) die "unknown option '$1' (see --help)" ;;
  esac
done
for n in fronts trainers devices timeout_s; do
  [[ "${!n}" =~ ^[0-9]+$ ]] || die "--${n%_s} must be a number, not '${!n}'"
done
[ "$fronts" -ge 1 ] || die "--fronts must be at least 1: nginx needs a front to pass calls to"
[ "$devices" -ge 1 ] || die "--devices must be at least 1"
dir="$(realpath -m "$dir")"
checkpoint_dir="$(realpath -m "$checkpoint_dir")"
build="$(realpath -m "$build")"
run="$dir/run"
logs="$dir/logs"

# ---- helpers ---------------------------------------------------------------------------------
# The unprivileged user PostgreSQL and nginx run as when this script is root (PostgreSQL
# refuses root); as_user is the command prefix that runs a program as that user.
server_user=""
as_user=()
if [ "$(id -u)" = 0 ]; then
  if id postgres >/dev/null 2>&1; then server_user=postgres; else server_user=nobody; fi
  as_user=(setpriv --reuid="$(id -u "$server_user")" --regid="$(id -g "$server_user")"
           --clear-groups --)
fi
own() { [ -z "$server_user" ] || chown -R "$server_user:$(id -gn "$server_user")" "$@"; }

# A TCP port on 127.0.0.1 that nothing listens on now (a process started on it may still
# lose a race; `up` then fails with that process's log).
free_port() {
  local port
  for _ in $(seq 100); do
    port=$(( 20000 + RANDOM % 40000 ))
    if ! (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then echo "$port"; return; fi
  done
  die "no free loopback port found"
}
# Whether something accepts connections on 127.0.0.1:$1.
accepts() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

# Polls "$@" every 0.1 s until it succeeds or timeout_s pass.
wait_for() {
  local deadline=$(( $(date +%s) + timeout_s ))
  until "$@"; do
    [ "$(date +%s)" -lt "$deadline" ] || return 1
    sleep 0.1
  done
}

# The pid in run/$1.pid when that process is alive and is still the program it was
# (a pid can be reused); nothing otherwise.
live_pid() {
  local file="$run/$1.pid" pid
  [ -f "$file" ] || return 0
  pid="$(cat "$file")"
  [[ "$pid" =~ ^[0-9]+$ ]] || return 0
  [ -r "/proc/$pid/cmdline" ] || return 0
  if tr '\0' ' ' <"/proc/$pid/cmdline" | grep -qF -- "$(cat "$run/$1.cmd" 2>/dev/null)"; then
    # A zombie is as good as gone.
    [ "$(awk '{print $3}' "/proc/$pid/stat" 2>/dev/null)" = Z ] || echo "$pid"
  fi
}

# Starts "$@" in the background as process $name, its output in logs/$name.log, detached
# from this shell (its own session) so that it outlives it.
launch() {
  local name="$1"; shift
  setsid "$@" </dev/null >>"$logs/$name.log" 2>&1 &
  echo $! >"$run/$name.pid"
  # live_pid checks the pid still runs this program: the first word of the command that
  # is not a wrapper.
  local program="$1"
  [ "$program" = setpriv ] && program="$(printf '%s\n' "$@" | sed -n '/^--$/{n;p;q}')"
  echo "$program" >"$run/$name.cmd"
}

log_tail() { tail -n 20 "$logs/$1.log" 2>/dev/null | sed "s/^/  $1: /" >&2 || true; }

# Stops process $1: SIGTERM, then SIGKILL after 30 s.
stop_process() {
  local name="$1" pid
  pid="$(live_pid "$name")"
  if [ -n "$pid" ]; then
    kill -TERM "$pid" 2>/dev/null || true
    local deadline=$(( $(date +%s) + 30 ))
    while [ -n "$(live_pid "$name")" ] && [ "$(date +%s)" -lt "$deadline" ]; do sleep 0.1; done
    if [ -n "$(live_pid "$name")" ]; then
      echo "  $name did not stop within 30 s: SIGKILL" >&2
      kill -KILL "$pid" 2>/dev/null || true
    fi
    echo "stopped $name (pid $pid)"
  fi
  rm -f "$run/$name.pid" "$run/$name.cmd" "$run/$name.port"
}

postgres_bin() {
  if [ -n "${CDCCA_POSTGRES_BIN:-}" ]; then echo "$CDCCA_POSTGRES_BIN"; return; fi
  local d newest
  newest="$(for d in /usr/lib/postgresql/*/bin; do [ -x "$d/postgres" ] && echo "$d"; done |
            sort -V | tail -n 1)"
  [ -n "$newest" ] ||
    die "PostgreSQL not found in /usr/lib/postgresql: apt-get install postgresql (scripts/setup.sh does)"
  echo "$newest"
}

# The processes `up` started, in start order.
names() {
  echo postgres
  local f
  for f in "$run"/trainer-*.pid "$run"/front-*.pid; do
    [ -e "$f" ] && basename "$f" .pid
  done
  [ -e "$run/nginx.pid" ] && echo nginx
  return 0
}

# ---- down ------------------------------------------------------------------------------------
stop_all() {
  [ -d "$run" ] || return 0
  # Reverse start order: no call reaches a front that is going, no front a database that is.
  stop_process nginx
  local name
  for name in $(names | grep '^front-' | sort -r) $(names | grep '^trainer-' | sort -r); do
    stop_process "$name"
  done
  local pid
  pid="$(live_pid postgres)"
  if [ -n "$pid" ]; then
    # Fast shutdown: sessions end, the server checkpoints and exits.
    "${as_user[@]}" "$(postgres_bin)/pg_ctl" -D "$dir/pg/data" -m fast -t 30 stop >/dev/null ||
      kill -KILL "$pid" 2>/dev/null || true
    echo "stopped postgres (pid $pid)"
  fi
  rm -f "$run/postgres.pid" "$run/postgres.cmd" "$run/postgres.port"
}

# ---- status ----------------------------------------------------------------------------------
show_status() {
  [ -d "$run" ] || { echo "no cluster in $dir"; return 0; }
  local name pid port
  printf '%-12s %-8s %-8s %s\n' PROCESS PID STATE PORT
  for name in $(names); do
    pid="$(live_pid "$name")"
    port="$(cat "$run/$name.port" 2>/dev/null || true)"
    printf '%-12s %-8s %-8s %s\n' "$name" "${pid:--}" "$([ -n "$pid" ] && echo running || echo stopped)" \
      "${port:--}"
  done
  if [ -n "$(live_pid nginx)" ]; then
    echo "devices dial 127.0.0.1:$(cat "$run/nginx.port") (insecure) with tokens from $dir/tokens"
  fi
}

# ---- up --------------------------------------------------------------------------------------
# Stops what this `up` started and exits, showing the failed process's log.
fail_up() {
  echo "cluster.sh: $1" >&2
  [ -n "${2:-}" ] && log_tail "$2"
  echo "cluster.sh: stopping what started" >&2
  stop_all >&2
  exit 1
}

start_postgres() {
  local bin pgdir="$dir/pg" port
  bin="$(postgres_bin)"
  mkdir -p "$pgdir"
  own "$pgdir"
  if [ ! -f "$pgdir/data/PG_VERSION" ]; then
    # Trust on loopback only: the server listens on 127.0.0.1 and its socket is in DIR/pg.
    "${as_user[@]}" "$bin/initdb" -D "$pgdir/data" -U postgres --auth=trust -E UTF8 \
      --locale=C >"$logs/initdb.log" 2>&1 || fail_up "initdb failed" initdb
  fi
  port="$(free_port)"
  # pg_ctl keeps the server running after this script ends; its pid is the postmaster's.
  touch "$logs/postgres.log"
  own "$logs/postgres.log"
  "${as_user[@]}" "$bin/pg_ctl" -D "$pgdir/data" -l "$logs/postgres.log" -w -t "$timeout_s" \
    -o "-p $port -k $pgdir -c listen_addresses=127.0.0.1" start >/dev/null ||
    fail_up "PostgreSQL did not start" postgres
  head -n 1 "$pgdir/data/postmaster.pid" >"$run/postgres.pid"
  echo postgres >"$run/postgres.cmd"
  echo "$port" >"$run/postgres.port"
  # The cloud's own login (not a superuser) and its database.
  local psql=("$bin/psql" -h 127.0.0.1 -p "$port" -U postgres -d postgres -v ON_ERROR_STOP=1 -qtA)
  if [ "$("${psql[@]}" -c "SELECT 1 FROM pg_roles WHERE rolname = 'cdcca'")" != 1 ]; then
    "${psql[@]}" -c "CREATE ROLE cdcca LOGIN" || fail_up "cannot create the role cdcca" postgres
  fi
  if [ "$("${psql[@]}" -c "SELECT 1 FROM pg_database WHERE datname = 'cdcca'")" != 1 ]; then
    "${psql[@]}" -c "CREATE DATABASE cdcca OWNER cdcca" ||
      fail_up "cannot create the database cdcca" postgres
  fi
  echo "started postgres on 127.0.0.1:$port"
}

write_tokens() {
  [ -f "$dir/tokens" ] && return 0
  local i
  # 24 random bytes per device, hex: readable by this user only.
  (
    umask 077
    for i in $(seq 0 $(( devices - 1 ))); do
      echo "dev-$i $(od -An -N24 -tx1 /dev/urandom | tr -d ' \n')"
    done >"$dir/tokens"
  )
  echo "wrote $devices device tokens to $dir/tokens"
}

# The flags every cloud process of this cluster shares.
cloud_flags() {
  local name="$1"
  echo "--store=postgresql://cdcca@127.0.0.1:$(cat "$run/postgres.port")/cdcca"
  echo "--data_dir=$dir/$name"
  echo "--tokens=$dir/tokens"
  echo "--checkpoint_dir=$checkpoint_dir"
  echo "--status_file=$run/$name.status.json"
}

start_front() {
  local name="front-$1" flags
  mkdir -p "$dir/$name"
  rm -f "$run/$name.port"
  mapfile -t flags < <(cloud_flags "$name")
  launch "$name" "$build/cloud/cdcca-cloud" --role=front "${flags[@]}" \
    --listen=127.0.0.1:0 --port_file="$run/$name.port" --insecure
}

start_trainer() {
  local name="trainer-$1" flags
  mkdir -p "$dir/$name"
  rm -f "$run/$name.status.json"
  mapfile -t flags < <(cloud_flags "$name")
  # One core per CPU trainer: its LibTorch thread and one BLAS thread, whose idle workers would
  # otherwise spin on the cores the fronts serve from (docs/BENCHMARKS.md, "Cloud on
  # PostgreSQL" and "A fleet against the scaled cloud").
  launch "$name" "$build/cloud/cdcca-cloud" --role=trainer --blas_threads=1 "${flags[@]}"
}

# A front answers once it wrote its port and accepts connections on it.
front_answers() {
  local port
  port="$(cat "$run/$1.port" 2>/dev/null)" && [ -n "$port" ] && accepts "$port"
}
# A trainer answers once it wrote its status file.
trainer_answers() { [ -s "$run/$1.status.json" ]; }

start_nginx() {
  local ngdir="$dir/nginx" port status_port backends=()
  local name
  for name in $(names | grep '^front-'); do backends+=("127.0.0.1:$(cat "$run/$name.port")"); done
  mkdir -p "$ngdir"
  own "$ngdir"
  port="$(free_port)"
  status_port="$(free_port)"
  [ "$port" != "$status_port" ] || status_port="$(free_port)"
  # A template line holding @BACKEND@ stands for one line per front.
  # One connection per device and one per open call, with room for the others.
  awk -v prefix="$ngdir" -v listen="127.0.0.1:$port" -v status="127.0.0.1:$status_port" \
      -v backends="${backends[*]}" -v connections="$((1024 + 2 * devices))" '
    {
      gsub(/@PREFIX@/, prefix); gsub(/@STATUS_LISTEN@/, status); gsub(/@LISTEN@/, listen)
      gsub(/@GENERATION@/, "1"); gsub(/@WORKERS@/, "1")
      gsub(/@WORKER_CONNECTIONS@/, connections)
      gsub(/@STREAM_IDLE_TIMEOUT@/, "600s"); gsub(/@CONNECT_TIMEOUT@/, "2s")
      gsub(/@FAIL_TIMEOUT@/, "5s"); gsub(/@LISTEN_SSL@/, ""); gsub(/@TLS@/, "")
      if ($0 !~ /@BACKEND@/) { print; next }
      n = split(backends, b, " ")
      for (i = 1; i <= n; i++) { line = $0; gsub(/@BACKEND@/, b[i], line); print line }
    }' "$root/configs/nginx/grpc_proxy.conf.in" >"$ngdir/nginx.conf"
  own "$ngdir"
  "${as_user[@]}" "$nginx_bin" -t -q -p "$ngdir/" -c "$ngdir/nginx.conf" -e "$ngdir/error.log" \
    >>"$logs/nginx.log" 2>&1 || fail_up "nginx refused $ngdir/nginx.conf" nginx
  launch nginx "${as_user[@]}" "$nginx_bin" -p "$ngdir/" -c "$ngdir/nginx.conf" -e "$ngdir/error.log"
  echo "$port" >"$run/nginx.port"
  echo "$status_port" >"$run/nginx.status_port"
  wait_for nginx_answers "$status_port" "$port" ||
    fail_up "nginx did not answer within $timeout_s s (see $ngdir/error.log)" nginx
  echo "started nginx on 127.0.0.1:$port, passing to ${backends[*]}"
}
# nginx answers once its status port serves the configuration's generation (the workers
# run) and the devices' port accepts connections.
nginx_answers() {
  [ -n "$(live_pid nginx)" ] && [ "$(http_get_last_line "$1" /generation)" = 1 ] &&
    accepts "$2"
}
# The last line of the answer to `GET $2` on 127.0.0.1:$1.
http_get_last_line() {
  (
    exec 3<>"/dev/tcp/127.0.0.1/$1" && printf 'GET %s HTTP/1.0\r\n\r\n' "$2" >&3 &&
      tail -n 1 <&3
  ) 2>/dev/null || true
}

bring_up() {
  [ -x "$build/cloud/cdcca-cloud" ] ||
    die "$build/cloud/cdcca-cloud not found: build it (CDCCA_TARGETS=cdcca-cloud scripts/build.sh) or pass --build"
  [ -d "$checkpoint_dir" ] || die "no checkpoint directory $checkpoint_dir (--checkpoint_dir)"
  nginx_bin="$(PATH="$PATH:/usr/sbin" command -v nginx)" ||
    die "nginx not found: apt-get install nginx (scripts/setup.sh does)"
  mkdir -p "$dir" "$run" "$logs"
  local name
  for name in $(names); do
    [ -z "$(live_pid "$name")" ] ||
      die "$name of a cluster in $dir runs already: see '$0 status --dir $dir', or stop it with '$0 down --dir $dir'"
  done
  start_postgres
  write_tokens
  local i
  for i in $(seq 0 $(( trainers - 1 ))); do start_trainer "$i"; done
  for i in $(seq 0 $(( fronts - 1 ))); do start_front "$i"; done
  for i in $(seq 0 $(( fronts - 1 ))); do
    name="front-$i"
    wait_for front_answers "$name" ||
      fail_up "$name did not serve within $timeout_s s" "$name"
    [ -n "$(live_pid "$name")" ] || fail_up "$name exited" "$name"
    echo "started $name on 127.0.0.1:$(cat "$run/$name.port")"
  done
  for i in $(seq 0 $(( trainers - 1 ))); do
    name="trainer-$i"
    wait_for trainer_answers "$name" ||
      fail_up "$name wrote no status within $timeout_s s" "$name"
    [ -n "$(live_pid "$name")" ] || fail_up "$name exited" "$name"
    echo "started $name"
  done
  start_nginx
  echo
  echo "devices dial: 127.0.0.1:$(cat "$run/nginx.port") (plaintext: --insecure)"
  echo "tokens:       $dir/tokens"
  echo "stop with:    $0 down --dir $dir"
}

case "$command" in
  up) bring_up ;;
  down) stop_all ;;
  status) show_status ;;
esac
