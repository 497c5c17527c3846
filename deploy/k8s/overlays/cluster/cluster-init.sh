#!/bin/sh
# Creates nopecache's Redis Cluster once every node answers; safe to run again.
#
#   NODES     "host:port host:port ...": every node of the cluster (required)
#   REPLICAS  replicas per master (default 1: 6 nodes -> 3 masters + 3 replicas)
#   WAIT_S    how long to wait for each node to resolve and answer PING (default 300)
#
# Exit 0: the cluster was created, or every node already belongs to it. Exit 1: a node
# never answered, the cluster did not reach cluster_state:ok, or some nodes belong to a
# cluster and others are blank (a node lost its volume): that needs a person, e.g.
# `redis-cli --cluster add-node NEW:6379 EXISTING:6379`.
set -eu

: "${NODES:?NODES must list host:port of every cluster node}"
REPLICAS="${REPLICAS:-1}"
WAIT_S="${WAIT_S:-300}"

log() { echo "cluster-init: $*" >&2; }

# redis-cli before 7.0 took only IP addresses; resolving here works with every version.
resolve() {
    getent ahostsv4 "$1" 2>/dev/null | awk 'NR == 1 { print $1 }'
}

known_nodes() {
    redis-cli -h "$1" -p "$2" cluster info | tr -d '\r' |
        awk -F: '$1 == "cluster_known_nodes" { print $2 }'
}

cluster_state() {
    redis-cli -h "$1" -p "$2" cluster info | tr -d '\r' |
        awk -F: '$1 == "cluster_state" { print $2 }'
}

addrs=""
for node in $NODES; do
    host="${node%:*}"
    port="${node##*:}"
    deadline=$(($(date +%s) + WAIT_S))
    while :; do
        ip="$(resolve "$host")"
        if [ -n "$ip" ] && [ "$(redis-cli -h "$ip" -p "$port" ping 2>/dev/null)" = "PONG" ]; then
            break
        fi
        if [ "$(date +%s)" -ge "$deadline" ]; then
            log "$node did not answer PING within ${WAIT_S}s"
            exit 1
        fi
        sleep 2
    done
    addrs="$addrs $ip:$port"
done

# A node that knows other nodes has joined a cluster; a blank node knows only itself.
joined=0
blank=""
for addr in $addrs; do
    if [ "$(known_nodes "${addr%:*}" "${addr##*:}")" -gt 1 ]; then
        joined=$((joined + 1))
    else
        blank="$blank $addr"
    fi
done

if [ -z "$blank" ]; then
    log "every node already belongs to the cluster; nothing to do"
    exit 0
fi
if [ "$joined" -gt 0 ]; then
    log "nodes$blank are blank while $joined others form a cluster; add them by hand"
    exit 1
fi

log "creating the cluster over$addrs with $REPLICAS replica(s) per master"
# shellcheck disable=SC2086  # one argument per address
redis-cli --cluster create $addrs --cluster-replicas "$REPLICAS" --cluster-yes

for addr in $addrs; do
    deadline=$(($(date +%s) + WAIT_S))
    until [ "$(cluster_state "${addr%:*}" "${addr##*:}")" = "ok" ]; do
        if [ "$(date +%s)" -ge "$deadline" ]; then
            log "$addr did not reach cluster_state:ok within ${WAIT_S}s"
            exit 1
        fi
        sleep 1
    done
done
log "cluster_state:ok on every node"
