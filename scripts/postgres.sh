# Sourced by scripts/run and scripts/test: start_postgres DATA_DIR PORT starts a local Postgres
# (initialising DATA_DIR on first use, trust auth on 127.0.0.1 only) and exports DATABASE_URL.
# Works as root by running the server as the `postgres` user. PG_EXTRA_OPTS adds server options
# (for profiling, e.g. "-c shared_preload_libraries=pg_stat_statements").

pg_bin() {
    local name=$1
    if command -v "$name" >/dev/null 2>&1; then command -v "$name"; return; fi
    local found
    found=$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n 1)
    if [ -n "$found" ] && [ -x "$found/$name" ]; then echo "$found/$name"; return; fi
    echo "PostgreSQL server binaries ($name) not found; install PostgreSQL 15 or set DATABASE_URL" >&2
    return 1
}

as_pg_owner() {
    if [ "$(id -u)" = 0 ]; then runuser -u postgres -- "$@"; else "$@"; fi
}

start_postgres() {
    local dir=$1 port=$2
    local initdb pg_ctl
    initdb=$(pg_bin initdb) || return 1
    pg_ctl=$(pg_bin pg_ctl) || return 1
    mkdir -p "$dir"
    if [ "$(id -u)" = 0 ]; then chown -R postgres "$dir"; fi
    if [ ! -f "$dir/data/PG_VERSION" ]; then
        as_pg_owner "$initdb" -D "$dir/data" -U postgres --auth=trust --encoding=UTF8 --no-sync >"$dir/initdb.log" 2>&1 \
            || { cat "$dir/initdb.log" >&2; return 1; }
    fi
    as_pg_owner "$pg_ctl" -D "$dir/data" -l "$dir/server.log" -w -t 60 start \
        -o "-p $port -k $dir -c listen_addresses=127.0.0.1 -c max_connections=500 -c fsync=off -c synchronous_commit=off -c full_page_writes=off ${PG_EXTRA_OPTS:-}" \
        >/dev/null || { cat "$dir/server.log" >&2; return 1; }
    export DATABASE_URL="postgres://postgres@127.0.0.1:$port/postgres"
    PG_DIR=$dir
}

stop_postgres() {
    [ -n "${PG_DIR:-}" ] || return 0
    as_pg_owner "$(pg_bin pg_ctl)" -D "$PG_DIR/data" -m fast -w stop >/dev/null 2>&1 || true
}

free_port() {
    python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1]); s.close()'
}
